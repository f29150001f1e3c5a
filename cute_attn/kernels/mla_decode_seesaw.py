"""Paged MLA attention for Hopper with both warpgroups computing scores: the "seesaw" schedule.

The problem, the tiles and the shared memory are ``kernels/mla_decode_sm90.py``'s (64 packed
query rows, 64-key blocks, Q [64, 576] and two [64, 576] block buffers under the 128-byte
swizzle, each warpgroup's fp32 O accumulator 64 x 256).  What differs is who computes what.
There, warpgroup 0 computes every score and softmax while the tensor cores wait; the chain
QK -> softmax -> P V of one block bounds it near 580 TFLOP/s.  Here the blocks go in pairs
(block 2i in buffer 0, 2i + 1 in buffer 1) and each warpgroup computes the scores of one of
them, so one warpgroup's softmax runs while the other's GEMMs keep the tensor cores busy
(FlashMLA's published schedule, written here for our work items and loads).  With m the
running row max before the pair, O = [O_L | O_R] (WG 0 | WG 1), V_b = [V_bL | V_bR]:

  WG 0: S0 = Q K0ᵀ; m0 = max(m, rowmax S0); P0 = exp(S0 - m0); O_L = O_L e^(m - m0) + P0 V0L
  WG 1: S1 = Q K1ᵀ; m1 = max(m0, rowmax S1); P1 = exp(S1 - m1); O_R = O_R e^(m - m1) + P1 V1R
  WG 0: P0 *= e^(m0 - m1) (into shared memory); O_L = O_L e^(m0 - m1) + P1 V1L
  WG 1: O_R += P0 V0R

which is the online softmax over the two blocks, reordered.  Each warpgroup keeps its own
partial row sum (relative to the same max after each pair); they are added in the epilogue.

Exchanges per pair, all through shared memory behind named barriers (one direction each):
M (WG 0 -> 1: m0 per row), S1 (WG 1 -> 0: m1 per row and P1 in buffer 1's kpe columns) and
P0 (WG 0 -> 1: the rescaled P0 in buffer 0's kpe columns).  P lands in the block's kpe columns,
which only the block's own scores read, so no P tile needs smem of its own.

Loads: ``cp.async`` 16-byte copies by both warpgroups, each copying the parts of the next pair's
blocks that its own last reader frees, as soon as that reader is done, with completion tracked
per part by an mbarrier (``cp.async.mbarrier.arrive.noinc``, 128 arrivals):
  buffer 0: ckv columns 0-255 (last read by WG 0's P V0L) -- WG 0;
            ckv 256-511 and the kpe columns (WG 1's P V0R reads V0R and P0) -- WG 1;
  buffer 1: ckv 256-511 (WG 1's P V1R) -- WG 1;
            ckv 0-255 and kpe (WG 0's P V1L reads V1L and P1) -- WG 0.
Each score GEMM starts on the part that was freed earliest (WG 0: columns 0-255 first; WG 1:
256-511) and waits for the rest between its ``wgmma`` issues, so the later copies overlap the
first k steps.  Q: copied by WG 0 at each item, one mbarrier both wait on.

Causal masking (bottom-right), base-2 scores and LSE, partial slots for split items: as in
``mla_decode_sm90.py``, whose loads, views and epilogue stores this class reuses.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .fragments import WG, quad_max, quad_sum, wgmma_acc_as_a, wgmma_mn_view
from .mla_decode_sm90 import BLOCK_N, HALF, TILE_Q, MlaDecodeSm90
from .work import ItemInfo, tok_head

BAR_M = 1  # named barriers (0 is __syncthreads): WG 0's pair max m0 is in shared memory
BAR_S1 = 2  # WG 1's m1 and P1 are in shared memory
BAR_P0 = 3  # WG 0's rescaled P0 is in shared memory
BAR_L = 4  # epilogue: WG 1's row sums are in shared memory
BAR_INV = 5  # epilogue: 1 / l per row is in shared memory
# mbarriers: Q, then the four load parts (buffer, columns)
MB_Q, MB_B0L, MB_B0RE, MB_B1R, MB_B1LE = range(5)
ATOMS_L = (0, 1, 2, 3)  # 64-column swizzle atoms of ckv columns 0-255
ATOMS_R = (4, 5, 6, 7)  # ckv columns 256-511
ATOM_E = (8,)  # the kpe columns
K_L = tuple(range(0, 16))  # k16 steps of the score GEMM over ATOMS_L
K_R = tuple(range(16, 32))
K_E = tuple(range(32, 36))


class MlaDecodeSeesaw(MlaDecodeSm90):
    def _smem_fields(self):
        rows = cute.struct.Align[cute.struct.MemRange[Float32, TILE_Q], 16]
        return {
            "sM0": rows,  # WG 0's pair max m0 per row
            "sM1": rows,  # WG 1's pair max m1 per row
            "sL": rows,  # WG 1's row sums (epilogue)
            "sInv": rows,  # 1 / l per row (epilogue)
            "mbar": cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 5], 8],
        }

    @cute.kernel
    def kernel(
        self,
        mQn: cute.Tensor,
        mQp: cute.Tensor,
        mCkv: cute.Tensor,
        mKpe: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        causal: Int32,
        scale_log2: Float32,
        kv_layout: cute.ComposedLayout,
        q_layout: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv_r: cute.TiledMma,
        mma_pv_s: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG)
        tw = tidx % WG

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        rows = cute.make_layout((TILE_Q,))
        sh = _Shared(
            sKV=st.sKV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner),
            sQ=st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner),
            sM0=st.sM0.get_tensor(rows),
            sM1=st.sM1.get_tensor(rows),
            sL=st.sL.get_tensor(rows),
            sInv=st.sInv.get_tensor(rows),
            mbar=st.mbar.data_ptr(),
            kv_base=st.sKV.data_ptr().toint(),
            q_base=st.sQ.data_ptr().toint(),
        )
        if tidx == 0:
            for i in cutlass.range_constexpr(5):
                cute.arch.mbarrier_init(sh.mbar + i, WG)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        io = _Io(mQn, mQp, mCkv, mKpe, mKvIndptr, mKvIndices, mO, mLse, mWork, mPartO, mPartLse)
        item_begin, item_end = mWorkIndptr[cta], mWorkIndptr[cta + 1]
        if wg == 0:
            self._wg0(io, sh, mma_qk, mma_pv_r, mma_pv_s, item_begin, item_end, group, causal, scale_log2, tw)
        else:
            self._wg1(io, sh, mma_qk, mma_pv_r, mma_pv_s, item_begin, item_end, group, causal, scale_log2, tw)

    # ---- shared steps ---------------------------------------------------------------------------
    @cute.jit
    def _qk_part(self, mma_qk, acc_S, tSrQ, tSrK, buf: int, mbar, ph, ks, first: bool):
        """Issue the score GEMM's k steps ``ks`` over the block in ``buf`` once mbarrier ``mbar``
        completed phase ``ph`` (``first``: the first part, which starts from zero)."""
        cute.arch.mbarrier_wait(mbar, ph)
        if const_expr(first):
            warpgroup.fence()
        atom = cute.make_mma_atom(mma_qk.op)
        for i in cutlass.range_constexpr(len(ks)):
            atom.set(warpgroup.Field.ACCUMULATE, not (first and i == 0))
            k = ks[i]
            cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, buf], acc_S)

    @cute.jit
    def _issue_pv(self, mma, acc_O, tA, tOrV, buf: int):
        """Issue and commit O += P V over the block in ``buf`` (the caller waits)."""
        atom = cute.make_mma_atom(mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc_O, tA[None, None, k], tOrV[None, None, k, buf], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _qk1(self, mma_qk, acc_S, tSrQ, tSrK, mbar, ph_r, ph_le):
        """WG 1's scores of the block in buffer 1: the ckv columns 256-511 it copied itself
        first, then those WG 0 copied; waited."""
        self._qk_part(mma_qk, acc_S, tSrQ, tSrK, 1, mbar + MB_B1R, ph_r, K_R, True)
        self._qk_part(mma_qk, acc_S, tSrQ, tSrK, 1, mbar + MB_B1LE, ph_le, K_L + K_E, False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def _mask(self, acc_S, tScS, row_lim, key0):
        """-inf for keys at or past each row's limit (the item's end, or causal)."""
        S = wgmma_mn_view(acc_S)
        n_rows, n_cols = cute.size(S, mode=[0]), cute.size(S, mode=[1])
        lim_lo = row_lim[0]
        for r in cutlass.range_constexpr(1, n_rows):
            lim_lo = cutlass.min(lim_lo, row_lim[r])
        if key0 + BLOCK_N > lim_lo:
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(n_cols):
                    S[r, c] = S[r, c] if key0 + tScS[0, c][1] < row_lim[r] else -Float32.inf

    @cute.jit
    def _exp(self, acc_S, m_base, row_m, corr, row_l, scale_log2):
        """P = exp2(S scale - m_use) in place (m_use: the new max, 0 while it is -inf), the
        factor exp2(row_m - m_use) of what was accumulated before, and row_l rescaled + the
        block's sums.  ``m_base`` per row: the max the block's own scores are compared with."""
        S = wgmma_mn_view(acc_S)
        n_rows, n_cols = cute.size(S, mode=[0]), cute.size(S, mode=[1])
        m_new = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            m_blk = -Float32.inf
            for c in cutlass.range_constexpr(n_cols):
                m_blk = cute.arch.fmax(m_blk, S[r, c])
            m_blk = quad_max(m_blk) * scale_log2  # a positive scale: the max commutes
            m_new[r] = cute.arch.fmax(m_base[r], m_blk)
            m_use = m_new[r] if m_new[r] != -Float32.inf else Float32(0.0)
            corr[r] = cute.math.exp2(row_m[r] - m_use, fastmath=True)
            l_blk = Float32(0.0)
            for c in cutlass.range_constexpr(n_cols):
                p = cute.math.exp2(S[r, c] * scale_log2 - m_use, fastmath=True)
                S[r, c] = p
                l_blk = l_blk + p
            row_l[r] = row_l[r] * corr[r] + l_blk
        return m_new

    @cute.jit
    def _row_limits(self, info: ItemInfo, tScS, causal):
        n_rows = cute.size(tScS, mode=[0])
        row_lim = cute.make_rmem_tensor((n_rows,), Int32)
        for r in cutlass.range_constexpr(n_rows):
            q_pos = info.qpos_base + (info.row_start + tScS[r, 0][0]) // info.group
            lim = info.kv_end
            if causal != 0:
                lim = cutlass.min(lim, q_pos + 1)
            row_lim[r] = lim
        return row_lim

    @cute.jit
    def _load(self, io, sh, info, page_base, page_size, blk: Int32, buf: int, atoms, mb: int, tw, pages=None):
        """Copy ``atoms`` of block ``blk`` of the item into buffer ``buf``; mbarrier ``mb``
        completes when this warpgroup's copies landed."""
        self._issue_kv(
            io.mCkv, io.mKpe, io.mKvIndices, page_base, info.kv_start + blk * BLOCK_N, info.kv_end, page_size,
            sh.kv_base, buf, tw, atoms, pages,
        )  # fmt: skip
        cute.arch.cp_async_mbarrier_arrive_noinc(sh.mbar + mb)

    @cute.jit
    def _next_pages(self, io, info, page_base, page_size, b: Int32, tw):
        """The page ids of blocks b and b + 1 (the next pair's), read at the top of a pair so
        the lookups are in flight during the scores (past the item they clamp to its last key,
        and are not used)."""
        pa = self._kv_pages(io.mKvIndices, page_base, info.kv_start + b * BLOCK_N, info.kv_end, page_size, tw)
        pb = self._kv_pages(io.mKvIndices, page_base, info.kv_start + (b + 1) * BLOCK_N, info.kv_end, page_size, tw)
        return pa, pb

    # ---- WG 0: block 2i, O[:, 0:256] ------------------------------------------------------------
    @cute.jit
    def _wg0(self, io, sh, mma_qk, mma_pv_r, mma_pv_s, item_begin, item_end, group, causal, scale_log2, tw):
        thr_qk = mma_qk.get_slice(tw)
        thr_r = mma_pv_r.get_slice(tw)
        thr_s = mma_pv_s.get_slice(tw)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sh.sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sh.sKV))
        tOrV_r = mma_pv_r.make_fragment_B(thr_r.partition_B(self._v_half(sh.sKV, 0)))
        tOrV_s = mma_pv_s.make_fragment_B(thr_s.partition_B(self._v_half(sh.sKV, 0)))
        tOsP1 = mma_pv_s.make_fragment_A(thr_s.partition_A(self._p_tile(sh.sKV, 1)))
        tScS = wgmma_mn_view(thr_qk.partition_C(cute.make_identity_tensor((TILE_Q, BLOCK_N))))
        tOcO = wgmma_mn_view(thr_r.partition_C(cute.make_identity_tensor((TILE_Q, HALF))))
        n_rows = cute.size(tScS, mode=[0])
        p_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_qk
        ).get_slice(tw)
        page_size = cute.FastDivmodDivisorV2(io.mCkv.shape[1])
        sM0, sM1, sL, sInv = sh.sM0, sh.sM1, sh.sL, sh.sInv  # written in the loops: local names
        mLse, mPartLse = io.mLse, io.mPartLse
        ph_q = Int32(0)
        ph_l = Int32(0)
        ph_re = Int32(0)
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(io.mWork, item, group)
            n_blocks = (info.kv_end - info.kv_start + BLOCK_N - 1) // BLOCK_N
            page_base = io.mKvIndptr[info.req]
            cute.arch.sync_threads()  # every read of the previous item's tiles is done
            if n_blocks > 0:
                self._issue_q(io.mQn, io.mQp, info, sh.q_base, tw)
                cute.arch.cp_async_mbarrier_arrive_noinc(sh.mbar + MB_Q)
                self._load(io, sh, info, page_base, page_size, Int32(0), 0, ATOMS_L, MB_B0L, tw)
            if n_blocks > 1:
                self._load(io, sh, info, page_base, page_size, Int32(1), 1, ATOMS_L + ATOM_E, MB_B1LE, tw)
            acc_O = cute.make_rmem_tensor(thr_r.partition_shape_C((TILE_Q, HALF)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows,), Float32)
            row_l = cute.make_rmem_tensor((n_rows,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            row_lim = self._row_limits(info, tScS, causal)
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_Q, BLOCK_N)), Float32)
            rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_Q, BLOCK_N)), self.dtype)
            tOrP = cute.make_tensor(rP.iterator, wgmma_acc_as_a(rP.layout))
            corr = cute.make_rmem_tensor((n_rows,), Float32)
            if n_blocks > 0:  # the scores of block 0
                cute.arch.mbarrier_wait(sh.mbar + MB_Q, ph_q)
                ph_q = ph_q ^ 1
                self._qk_part(mma_qk, acc_S, tSrQ, tSrK, 0, sh.mbar + MB_B0L, ph_l, K_L, True)
                self._qk_part(mma_qk, acc_S, tSrQ, tSrK, 0, sh.mbar + MB_B0RE, ph_re, K_R + K_E, False)
                warpgroup.commit_group()
                ph_l = ph_l ^ 1
                ph_re = ph_re ^ 1
                warpgroup.wait_group(0)
            for pr in cutlass.range((n_blocks + 1) // 2, unroll=1):
                # enters with S0 of block b0 in acc_S; leaves with the next pair's
                b0 = 2 * pr
                pg2, pg3 = self._next_pages(io, info, page_base, page_size, b0 + 2, tw)
                self._mask(acc_S, tScS, row_lim, info.kv_start + b0 * BLOCK_N)
                m0 = self._exp(acc_S, row_m, row_m, corr, row_l, scale_log2)
                for r in cutlass.range_constexpr(n_rows):
                    if tw % 4 == 0:
                        sM0[tScS[r, 0][0]] = m0[r]
                cute.arch.barrier_arrive(barrier_id=BAR_M, number_of_threads=2 * WG)
                rP.store(acc_S.load().to(self.dtype))
                self._rescale(acc_O, corr)
                self._issue_pv(mma_pv_r, acc_O, tOrP, tOrV_r, 0)
                warpgroup.wait_group(0)
                if b0 + 2 < n_blocks:  # buffer 0's ckv 0-255 are free: block b0 + 2's
                    self._load(io, sh, info, page_base, page_size, b0 + 2, 0, ATOMS_L, MB_B0L, tw, pg2)
                cute.arch.barrier(barrier_id=BAR_S1, number_of_threads=2 * WG)
                # P0 and what O_L, l hold move to WG 1's max m1 (1 when block b0 + 1 kept m0)
                S = wgmma_mn_view(acc_S)
                for r in cutlass.range_constexpr(n_rows):
                    m1 = sM1[tScS[r, 0][0]]
                    m_use = m1 if m1 != -Float32.inf else Float32(0.0)
                    corr[r] = cute.math.exp2(m0[r] - m_use, fastmath=True)
                    row_l[r] = row_l[r] * corr[r]
                    row_m[r] = m1
                    for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                        S[r, c] = S[r, c] * corr[r]
                rP.store(acc_S.load().to(self.dtype))
                cute.copy(p_copy, p_copy.retile(rP), p_copy.partition_D(self._p_tile(sh.sKV, 0)))
                cute.arch.fence_view_async_shared()  # P0 is read by WG 1's wgmma (async proxy)
                cute.arch.barrier_arrive(barrier_id=BAR_P0, number_of_threads=2 * WG)
                self._rescale(acc_O, corr)
                if b0 + 1 < n_blocks:
                    self._issue_pv(mma_pv_s, acc_O, tOsP1, tOrV_s, 1)
                    if b0 + 2 < n_blocks:
                        # the next pair's scores start on the part copied first, under P V1L
                        self._qk_part(mma_qk, acc_S, tSrQ, tSrK, 0, sh.mbar + MB_B0L, ph_l, K_L, True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)  # P V1L
                        if b0 + 3 < n_blocks:  # buffer 1's ckv 0-255 and kpe are free: block b0 + 3's
                            self._load(
                                io, sh, info, page_base, page_size, b0 + 3, 1, ATOMS_L + ATOM_E, MB_B1LE, tw, pg3
                            )
                        self._qk_part(mma_qk, acc_S, tSrQ, tSrK, 0, sh.mbar + MB_B0RE, ph_re, K_R + K_E, False)
                        warpgroup.commit_group()
                        ph_l = ph_l ^ 1
                        ph_re = ph_re ^ 1
                    warpgroup.wait_group(0)

            # epilogue: l = WG 0's + WG 1's partial sums; 1 / l for WG 1
            cute.arch.barrier(barrier_id=BAR_L, number_of_threads=2 * WG)
            inv = cute.make_rmem_tensor((n_rows,), Float32)
            lse = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                l_all = quad_sum(row_l[r]) + sL[tScS[r, 0][0]]
                inv[r] = Float32(0.0)
                lse[r] = -Float32.inf
                if l_all > Float32(0.0):
                    inv[r] = cute.arch.rcp_approx(l_all)
                    lse[r] = row_m[r] + cute.math.log2(l_all, fastmath=True)
                if tw % 4 == 0:
                    sInv[tScS[r, 0][0]] = inv[r]
            cute.arch.barrier_arrive(barrier_id=BAR_INV, number_of_threads=2 * WG)
            self._store(io.mO, io.mPartO, acc_O, inv, tOcO, info, 0)
            for r in cutlass.range_constexpr(n_rows):
                j = tScS[r, 0][0]
                if (tw % 4 == 0) & (j < info.num_rows):
                    if info.dest < 0:
                        tok, head = tok_head(info, info.row_start + j)
                        mLse[tok, head] = lse[r]
                    else:
                        mPartLse[info.dest * TILE_Q + j] = lse[r]

    # ---- WG 1: block 2i + 1, O[:, 256:512] --------------------------------------------------------
    @cute.jit
    def _wg1(self, io, sh, mma_qk, mma_pv_r, mma_pv_s, item_begin, item_end, group, causal, scale_log2, tw):
        thr_qk = mma_qk.get_slice(tw)
        thr_r = mma_pv_r.get_slice(tw)
        thr_s = mma_pv_s.get_slice(tw)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sh.sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sh.sKV))
        tOrV_r = mma_pv_r.make_fragment_B(thr_r.partition_B(self._v_half(sh.sKV, 1)))
        tOrV_s = mma_pv_s.make_fragment_B(thr_s.partition_B(self._v_half(sh.sKV, 1)))
        tOsP0 = mma_pv_s.make_fragment_A(thr_s.partition_A(self._p_tile(sh.sKV, 0)))
        tScS = wgmma_mn_view(thr_qk.partition_C(cute.make_identity_tensor((TILE_Q, BLOCK_N))))
        tOcO = wgmma_mn_view(thr_r.partition_C(cute.make_identity_tensor((TILE_Q, HALF))))
        n_rows = cute.size(tScS, mode=[0])
        p_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_qk
        ).get_slice(tw)
        page_size = cute.FastDivmodDivisorV2(io.mCkv.shape[1])
        sM0, sM1, sL, sInv = sh.sM0, sh.sM1, sh.sL, sh.sInv  # written in the loops: local names
        ph_q = Int32(0)
        ph_r = Int32(0)
        ph_le = Int32(0)
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(io.mWork, item, group)
            n_blocks = (info.kv_end - info.kv_start + BLOCK_N - 1) // BLOCK_N
            page_base = io.mKvIndptr[info.req]
            cute.arch.sync_threads()
            if n_blocks > 0:
                self._load(io, sh, info, page_base, page_size, Int32(0), 0, ATOMS_R + ATOM_E, MB_B0RE, tw)
            if n_blocks > 1:
                self._load(io, sh, info, page_base, page_size, Int32(1), 1, ATOMS_R, MB_B1R, tw)
            acc_O = cute.make_rmem_tensor(thr_r.partition_shape_C((TILE_Q, HALF)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows,), Float32)
            row_l = cute.make_rmem_tensor((n_rows,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            row_lim = self._row_limits(info, tScS, causal)
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_Q, BLOCK_N)), Float32)
            rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_Q, BLOCK_N)), self.dtype)
            tOrP = cute.make_tensor(rP.iterator, wgmma_acc_as_a(rP.layout))
            corr = cute.make_rmem_tensor((n_rows,), Float32)
            m0 = cute.make_rmem_tensor((n_rows,), Float32)
            if n_blocks > 0:
                cute.arch.mbarrier_wait(sh.mbar + MB_Q, ph_q)
                ph_q = ph_q ^ 1
            if n_blocks > 1:  # the scores of block 1
                self._qk1(mma_qk, acc_S, tSrQ, tSrK, sh.mbar, ph_r, ph_le)
                ph_r = ph_r ^ 1
                ph_le = ph_le ^ 1
            for pr in cutlass.range((n_blocks + 1) // 2, unroll=1):
                # enters with S1 of block b1 in acc_S (when it exists); leaves with the next pair's
                b1 = 2 * pr + 1
                pg2, pg3 = self._next_pages(io, info, page_base, page_size, b1 + 1, tw)
                if b1 < n_blocks:
                    self._mask(acc_S, tScS, row_lim, info.kv_start + b1 * BLOCK_N)
                else:
                    acc_S.fill(-Float32.inf)  # the pair's second block is past the item
                cute.arch.barrier(barrier_id=BAR_M, number_of_threads=2 * WG)
                for r in cutlass.range_constexpr(n_rows):
                    m0[r] = sM0[tScS[r, 0][0]]
                m1 = self._exp(acc_S, m0, row_m, corr, row_l, scale_log2)
                for r in cutlass.range_constexpr(n_rows):
                    row_m[r] = m1[r]
                    if tw % 4 == 0:
                        sM1[tScS[r, 0][0]] = m1[r]
                rP.store(acc_S.load().to(self.dtype))
                if b1 < n_blocks:
                    cute.copy(p_copy, p_copy.retile(rP), p_copy.partition_D(self._p_tile(sh.sKV, 1)))
                    cute.arch.fence_view_async_shared()  # P1 is read by WG 0's wgmma
                cute.arch.barrier_arrive(barrier_id=BAR_S1, number_of_threads=2 * WG)
                self._rescale(acc_O, corr)
                if b1 < n_blocks:
                    self._issue_pv(mma_pv_r, acc_O, tOrP, tOrV_r, 1)
                cute.arch.barrier(barrier_id=BAR_P0, number_of_threads=2 * WG)
                self._issue_pv(mma_pv_s, acc_O, tOsP0, tOrV_s, 0)
                if b1 < n_blocks:
                    warpgroup.wait_group(1)  # P V1R
                    if b1 + 2 < n_blocks:  # buffer 1's ckv 256-511 are free: block b1 + 2's
                        self._load(io, sh, info, page_base, page_size, b1 + 2, 1, ATOMS_R, MB_B1R, tw, pg3)
                warpgroup.wait_group(0)  # P V0R
                if b1 + 1 < n_blocks:  # buffer 0's ckv 256-511 and kpe are free: block b1 + 1's
                    self._load(io, sh, info, page_base, page_size, b1 + 1, 0, ATOMS_R + ATOM_E, MB_B0RE, tw, pg2)
                if b1 + 2 < n_blocks:  # the next pair's scores
                    self._qk1(mma_qk, acc_S, tSrQ, tSrK, sh.mbar, ph_r, ph_le)
                    ph_r = ph_r ^ 1
                    ph_le = ph_le ^ 1

            for r in cutlass.range_constexpr(n_rows):
                l_part = quad_sum(row_l[r])
                if tw % 4 == 0:
                    sL[tScS[r, 0][0]] = l_part
            cute.arch.barrier_arrive(barrier_id=BAR_L, number_of_threads=2 * WG)
            cute.arch.barrier(barrier_id=BAR_INV, number_of_threads=2 * WG)
            inv = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                inv[r] = sInv[tOcO[r, 0][0]]
            self._store(io.mO, io.mPartO, acc_O, inv, tOcO, info, HALF)


class _Shared:
    """The kernel's shared-memory views and barriers, passed to both warpgroups' loops."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Io:
    """The kernel's global tensors (the ABI's order)."""

    def __init__(self, mQn, mQp, mCkv, mKpe, mKvIndptr, mKvIndices, mO, mLse, mWork, mPartO, mPartLse):
        self.mQn, self.mQp, self.mCkv, self.mKpe = mQn, mQp, mCkv, mKpe
        self.mKvIndptr, self.mKvIndices, self.mO, self.mLse = mKvIndptr, mKvIndices, mO, mLse
        self.mWork, self.mPartO, self.mPartLse = mWork, mPartO, mPartLse
