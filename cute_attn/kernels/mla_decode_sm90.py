"""Paged MLA attention in the absorbed form for Hopper (sm_90a): both GEMMs on ``wgmma``.

The problem is ``kernels/mla_decode.py``'s (one latent KV head, K = [ckv | kpe] 576 wide,
V = ckv 512 wide, the scheduler's work items of packed query rows); this kernel serves items of
64 packed rows (heads x query tokens of one request), where the ``mma.sync`` kernel's 16 / 32-row
tiles leave the tensor cores idle: 128 heads x 2 query tokens is 256 rows, four items per
request, and compute-bound.

One CTA per SM, two warpgroups of 128 threads, 64 query rows and 64 keys per block:
- **Shared memory**: Q [64, 576] (72 KB), two KV stages [64, 576] (2 x 72 KB) and a row
  vector (the rescale factors, then 1 / l): 216 KB.  Every tile is K-major
  under the 128-byte swizzle, so the KV stage is K of the scores (B of Q Kᵀ, K-major) and,
  read through its transposed view, V of the output (B of P V, MN-major): each latent row is
  read from global memory once per CTA and kept once.
- **WG 0** computes S = Q Kᵀ (64 x 64 over the 576 columns: 36 k16 steps of ``wgmma``
  m64n64k16, both operands in shared memory), the mask and the online softmax in registers,
  writes P (value dtype, into the stage) and the rows' rescale factors to shared memory, and computes
  O[:, 0:256] += P V[:, 0:256] with P from registers.
- **WG 1** issues the loads -- the item's Q and each next block's 64 latent rows with 16-byte
  ``cp.async`` (one page lookup per block where a page holds it, else per token;
  ``kernels/pages.py`` clamps the ids) -- while WG 0 computes the scores, then rescales its
  O[:, 256:512] by WG 0's factors and computes O[:, 256:512] += P V[:, 256:512] with P from
  shared memory.
- Each warpgroup's fp32 O accumulator is 64 x 256: 128 registers per thread.
Synchronization per block: P of block j is written (``stmatrix``) into stage j's kpe columns,
which only the scores read, so no single P tile needs guarding, and three named barriers order
the rest: FULL (block j's copies landed -- WG 1 waited for its group and fenced it for the async
proxy -- WG 1 arrives, WG 0 waits before the scores), P (P and the factors are in shared memory:
WG 0 arrives, WG 1 waits) and FREE (WG 0's P V of block j is done: WG 0 arrives, WG 1 waits
before it copies block j + 2 into that stage, after its own P V of block j).  WG 0 thus starts
the scores of block j + 1 while WG 1's P V of block j may still run.  The
epilogue: one CTA barrier, WG 0 publishes 1 / l per row behind the named barrier, each
warpgroup normalizes and stores its 256 columns (value-dtype rows + LSE by WG 0, or an fp32
partial slot for the merge kernel).

Causal masking (runtime ``causal``) is bottom-right aligned as in ``mla_decode.py``; scores in
base 2 (``sm_scale * log2 e``), LSE base 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from ..variants.dsl import LOG2E
from .copy import cp_async_16
from .fragments import WG, quad_max, quad_sum, wgmma_acc_as_a, wgmma_mn_view
from .mla_decode import D_CKV, D_KPE, D_QK, ROW_CHUNKS, THREADS_PER_ROW, smem_off
from .pages import in_cache
from .work import ItemInfo, tok_head

SMEM_MAX = 232448  # bytes of shared memory per block on sm_90
TILE_Q = 64  # packed query rows per item: one wgmma M
BLOCK_N = 64  # keys per block
HALF = D_CKV // 2  # output columns per warpgroup: 256
BAR_P = 1  # named barrier: P and the row factors are in shared memory (0 is __syncthreads)
BAR_FREE = 2  # named barrier: WG 0 is done with a block's stage (it may be reloaded)
BAR_FULL = 3  # named barrier: the block's copies landed (WG 1 waited and fenced them)
LOAD_ROWS = WG // THREADS_PER_ROW  # rows WG 1 copies per pass: 16


@dataclass(frozen=True)
class MlaSm90Config:
    """What an ``mla_decode_sm90`` specialization fixes: the value dtype (DSL type)."""

    dtype: Any
    no_loads: bool = False  # diagnostic knob only (wrong output): no KV copies after block 0
    block_pages: bool = True  # knob (A/B): False looks up a page per token even where a page holds the block

    @classmethod
    def from_spec(cls, p: dict) -> MlaSm90Config:
        from ..abi.dtypes import to_dsl

        assert p["head_dim_ckv"] == D_CKV and p["head_dim_kpe"] == D_KPE, p
        assert p["tile_q"] == TILE_Q and p["stages"] == 2, p
        return cls(to_dsl(p["dtype"]), bool(p.get("no_loads", 0)), bool(p.get("block_pages", 1)))


class MlaDecodeSm90:
    def __init__(self, cfg: MlaSm90Config):
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.stages = 2
        self.threads = 2 * WG

    # ---- host side ----------------------------------------------------------------------
    @cute.jit
    def __call__(
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
        sm_scale: Float32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        dt = self.dtype
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, D_QK), dt)
        kv_layout = cute.tile_to_shape(atom, (BLOCK_N, D_QK, self.stages), (0, 1, 2))
        q_layout = cute.tile_to_shape(atom, (TILE_Q, D_QK), (0, 1))
        self._check_smem_off(kv_layout, BLOCK_N, self.stages)
        self._check_smem_off(q_layout, TILE_Q, 1)
        mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), (TILE_Q, BLOCK_N)
        )
        mma_pv_r = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            (1, 1, 1),
            (TILE_Q, HALF),
            warpgroup.OperandSource.RMEM,
        )
        mma_pv_s = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1), (TILE_Q, HALF)
        )

        @cute.struct
        class Smem:
            sKV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(kv_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(q_layout)], 1024]
            sRow: cute.struct.Align[cute.struct.MemRange[Float32, TILE_Q], 16]

        if const_expr(Smem.size_in_bytes() > SMEM_MAX):
            raise ValueError(f"{Smem.size_in_bytes()} bytes of shared memory > {SMEM_MAX}")
        self.kernel(
            mQn,
            mQp,
            mCkv,
            mKpe,
            mKvIndptr,
            mKvIndices,
            mO,
            mLse,
            mWork,
            mWorkIndptr,
            mPartO,
            mPartLse,
            group,
            causal,
            sm_scale * LOG2E,
            kv_layout,
            q_layout,
            mma_qk,
            mma_pv_r,
            mma_pv_s,
            Smem,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    def _check_smem_off(self, layout, rows: int, slices: int):
        """Trace time: ``smem_off`` (the copies' element offsets: 16-byte chunk t of a 64-wide
        atom row at chunk t XOR row mod 8) is this wgmma layout -- its linear map with the chunk
        unswizzled, under Swizzle<3, 4, 3>, which CuTe applies to byte addresses (bits 4-6, the
        chunk, XOR bits 7-9, the row in the 1024-byte atom)."""
        sw = layout.inner
        if (sw.num_bits, sw.num_base, sw.num_shift) != (3, 4, 3):
            raise AssertionError(f"the tile's swizzle is not the 128-byte one smem_off assumes ({layout})")
        for r in range(rows):
            for c in range(ROW_CHUNKS):
                for s in range(slices):
                    crd = (r, c * 8, s) if slices > 1 else (r, c * 8)
                    want = cute.crd2idx(crd, layout.outer)
                    t = c % 8
                    got = smem_off(r, c // 8, t ^ (r % 8), s, rows)  # the chunk before the XOR
                    if want != got:
                        raise AssertionError(f"smem_off({r}, {c}, {s}) = {got}, layout {want}")

    # ---- device side --------------------------------------------------------------------
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
        # the merge kernel (a programmatic dependent launch) may start now; it waits for this
        # grid before it reads a partial
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // WG)
        tw = tidx % WG

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        sKV = st.sKV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sQ = st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sRow = st.sRow.get_tensor(cute.make_layout((TILE_Q,)))
        kv_base = st.sKV.data_ptr().toint()
        q_base = st.sQ.data_ptr().toint()

        item_begin, item_end = mWorkIndptr[cta], mWorkIndptr[cta + 1]
        if wg == 0:
            self._scores_wg(
                mO, mLse, mPartO, mPartLse, mWork, sKV, sQ, sRow, mma_qk, mma_pv_r, item_begin, item_end,
                group, causal, scale_log2, tw,
            )  # fmt: skip
        else:
            self._loads_wg(
                mQn, mQp, mCkv, mKpe, mKvIndptr, mKvIndices, mO, mPartO, mWork, sKV, sRow, mma_pv_s,
                kv_base, q_base, item_begin, item_end, group, tw,
            )  # fmt: skip

    # ---- WG 0: scores, softmax, O[:, 0:256] -------------------------------------------------
    @cute.jit
    def _scores_wg(
        self, mO, mLse, mPartO, mPartLse, mWork, sKV, sQ, sRow, mma_qk, mma_pv, item_begin, item_end,
        group, causal, scale_log2, tw,
    ):  # fmt: skip
        thr_qk = mma_qk.get_slice(tw)
        thr_pv = mma_pv.get_slice(tw)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sKV))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(self._v_half(sKV, 0)))
        tScS = wgmma_mn_view(thr_qk.partition_C(cute.make_identity_tensor((TILE_Q, BLOCK_N))))
        tOcO = wgmma_mn_view(thr_pv.partition_C(cute.make_identity_tensor((TILE_Q, HALF))))
        n_rows = cute.size(tScS, mode=[0])
        n_cols = cute.size(tScS, mode=[1])
        p_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_qk
        ).get_slice(tw)
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(mWork, item, group)
            n_blocks = (info.kv_end - info.kv_start + BLOCK_N - 1) // BLOCK_N
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_Q, HALF)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows,), Float32)
            row_l = cute.make_rmem_tensor((n_rows,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            # the last key + 1 each row may see: the item's end, or its query position + 1 (causal)
            row_lim = cute.make_rmem_tensor((n_rows,), Int32)
            for r in cutlass.range_constexpr(n_rows):
                q_pos = info.qpos_base + (info.row_start + tScS[r, 0][0]) // group
                lim = info.kv_end
                if causal != 0:
                    lim = cutlass.min(lim, q_pos + 1)
                row_lim[r] = lim
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_Q, BLOCK_N)), Float32)
            rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_Q, BLOCK_N)), self.dtype)
            tOrP = cute.make_tensor(rP.iterator, wgmma_acc_as_a(rP.layout))
            for nb in cutlass.range(n_blocks, unroll=1):
                stage = nb % self.stages
                key0 = info.kv_start + nb * BLOCK_N
                cute.arch.barrier(barrier_id=BAR_FULL, number_of_threads=2 * WG)  # the block landed
                warpgroup.fence()
                atom = cute.make_mma_atom(mma_qk.op)
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    atom.set(warpgroup.Field.ACCUMULATE, k != 0)
                    cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                S = wgmma_mn_view(acc_S)
                lim_lo = row_lim[0]
                for r in cutlass.range_constexpr(1, n_rows):
                    lim_lo = cutlass.min(lim_lo, row_lim[r])
                if key0 + BLOCK_N > lim_lo:  # a row of this thread ends in this block: mask it
                    for r in cutlass.range_constexpr(n_rows):
                        for c in cutlass.range_constexpr(n_cols):
                            S[r, c] = S[r, c] if key0 + tScS[0, c][1] < row_lim[r] else -Float32.inf
                corr = cute.make_rmem_tensor((n_rows,), Float32)
                for r in cutlass.range_constexpr(n_rows):
                    m_blk = -Float32.inf
                    for c in cutlass.range_constexpr(n_cols):
                        m_blk = cute.arch.fmax(m_blk, S[r, c])
                    m_blk = quad_max(m_blk) * scale_log2  # a positive scale: the max commutes
                    m_new = cute.arch.fmax(row_m[r], m_blk)
                    m_use = m_new if m_new != -Float32.inf else Float32(0.0)
                    corr[r] = cute.math.exp2(row_m[r] - m_use, fastmath=True)
                    l_blk = Float32(0.0)
                    for c in cutlass.range_constexpr(n_cols):
                        p = cute.math.exp2(S[r, c] * scale_log2 - m_use, fastmath=True)
                        S[r, c] = p
                        l_blk = l_blk + p
                    row_l[r] = row_l[r] * corr[r] + l_blk  # per-thread partial sum, quad-reduced at the end
                    row_m[r] = m_new
                rP.store(acc_S.load().to(self.dtype))
                # P and the factors for WG 1 (the async proxy reads P: fence the generic stores)
                cute.copy(p_copy, p_copy.retile(rP), p_copy.partition_D(self._p_tile(sKV, stage)))
                for r in cutlass.range_constexpr(n_rows):
                    if tw % 4 == 0:
                        sRow[tScS[r, 0][0]] = corr[r]
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=BAR_P, number_of_threads=2 * WG)
                self._rescale(acc_O, corr)
                warpgroup.fence()
                atom_pv = cute.make_mma_atom(mma_pv.op)
                atom_pv.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(atom_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if nb + 2 < n_blocks:  # WG 1 reloads this stage with block nb + 2
                    cute.arch.barrier_arrive(barrier_id=BAR_FREE, number_of_threads=2 * WG)

            # epilogue: 1 / l per row for WG 1 (after every read of sRow by WG 1: a CTA barrier)
            inv = cute.make_rmem_tensor((n_rows,), Float32)
            lse = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                l_all = quad_sum(row_l[r])
                inv[r] = Float32(0.0)
                lse[r] = -Float32.inf
                if l_all > Float32(0.0):
                    inv[r] = cute.arch.rcp_approx(l_all)
                    lse[r] = row_m[r] + cute.math.log2(l_all, fastmath=True)
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(n_rows):
                if tw % 4 == 0:
                    sRow[tScS[r, 0][0]] = inv[r]
            cute.arch.barrier_arrive(barrier_id=BAR_P, number_of_threads=2 * WG)
            self._store(mO, mPartO, acc_O, inv, tOcO, info, 0)
            for r in cutlass.range_constexpr(n_rows):
                j = tScS[r, 0][0]
                if (tw % 4 == 0) & (j < info.num_rows):
                    if info.dest < 0:
                        tok, head = tok_head(info, info.row_start + j)
                        mLse[tok, head] = lse[r]
                    else:
                        mPartLse[info.dest * TILE_Q + j] = lse[r]

    # ---- WG 1: loads, O[:, 256:512] ------------------------------------------------------------
    @cute.jit
    def _loads_wg(
        self, mQn, mQp, mCkv, mKpe, mKvIndptr, mKvIndices, mO, mPartO, mWork, sKV, sRow, mma_pv,
        kv_base, q_base, item_begin, item_end, group, tw,
    ):  # fmt: skip
        thr_pv = mma_pv.get_slice(tw)
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(self._v_half(sKV, 1)))
        tOcO = wgmma_mn_view(thr_pv.partition_C(cute.make_identity_tensor((TILE_Q, HALF))))
        n_rows = cute.size(tOcO, mode=[0])
        page_size = cute.FastDivmodDivisorV2(mCkv.shape[1])
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(mWork, item, group)
            n_blocks = (info.kv_end - info.kv_start + BLOCK_N - 1) // BLOCK_N
            page_base = mKvIndptr[info.req]
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_Q, HALF)), Float32)
            acc_O.fill(0.0)
            if n_blocks > 0:
                self._issue_q(mQn, mQp, info, q_base, tw)
                self._issue_kv(mCkv, mKpe, mKvIndices, page_base, info.kv_start, info.kv_end, page_size, kv_base, 0, tw)
                cute.arch.cp_async_commit_group()
            for nb in cutlass.range(n_blocks, unroll=1):
                stage = nb % self.stages
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()  # cp.async writes -> read by wgmma (async proxy)
                cute.arch.barrier_arrive(barrier_id=BAR_FULL, number_of_threads=2 * WG)
                warpgroup.wait_group(0)  # this warpgroup's P V of block nb - 1
                if nb + 1 < n_blocks:
                    if nb > 0:  # WG 0 is done with block nb - 1, whose stage block nb + 1 takes
                        cute.arch.barrier(barrier_id=BAR_FREE, number_of_threads=2 * WG)
                    blk = info.kv_start + (nb + 1) * BLOCK_N
                    if const_expr(not self.cfg.no_loads):
                        self._issue_kv(
                            mCkv, mKpe, mKvIndices, page_base, blk, info.kv_end, page_size, kv_base, 1 - stage, tw
                        )
                    cute.arch.cp_async_commit_group()
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=2 * WG)
                corr = cute.make_rmem_tensor((n_rows,), Float32)
                for r in cutlass.range_constexpr(n_rows):
                    corr[r] = sRow[tOcO[r, 0][0]]
                self._rescale(acc_O, corr)
                warpgroup.fence()
                atom = cute.make_mma_atom(mma_pv.op)
                atom.set(warpgroup.Field.ACCUMULATE, True)
                tOsP = mma_pv.make_fragment_A(thr_pv.partition_A(self._p_tile(sKV, stage)))
                for k in cutlass.range_constexpr(cute.size(tOsP, mode=[2])):
                    cute.gemm(atom, acc_O, tOsP[None, None, k], tOrV[None, None, k, stage], acc_O)
                warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()
            cute.arch.barrier(barrier_id=BAR_P, number_of_threads=2 * WG)
            inv = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                inv[r] = sRow[tOcO[r, 0][0]]
            self._store(mO, mPartO, acc_O, inv, tOcO, info, HALF)

    def _p_tile(self, sKV, stage):
        """Where P of the block in ``stage`` goes: the stage's kpe columns, [64 keys, 64 columns]
        under the same swizzle a [64 rows, 64 keys] P tile would have (the scores, their only
        reader, are done when P is written)."""
        return cute.local_tile(sKV, (BLOCK_N, D_KPE, self.stages), (0, D_CKV // D_KPE, 0))[None, None, stage]

    def _v_half(self, sKV, h: int):
        """Columns [256 h, 256 h + 256) of the KV stages seen as Vᵀ (output column, key, stage):
        whole swizzle atoms, so the view's offset is a constant number of atoms."""
        sV = cute.local_tile(sKV, (BLOCK_N, HALF, self.stages), (0, h, 0))
        return cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))

    @cute.jit
    def _rescale(self, acc_O: cute.Tensor, corr: cute.Tensor):
        O = wgmma_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                O[r, c] = O[r, c] * corr[r]

    # ---- loads (WG 1) ---------------------------------------------------------------------------
    @cute.jit
    def _issue_q(self, mQn: cute.Tensor, mQp: cute.Tensor, info: ItemInfo, q_base, tw):
        """cp.async the item's 64 Q rows: row 16 i + tw / 8, chunks t, t + 8, .. of q_nope and
        chunk t of q_pe (t = tw mod 8).  Rows past num_rows re-read row 0 (never stored)."""
        t = tw % THREADS_PER_ROW
        for i in cutlass.range_constexpr(TILE_Q // LOAD_ROWS):
            r = tw // THREADS_PER_ROW + i * LOAD_ROWS
            j = r if r < info.num_rows else 0
            tok, head = tok_head(info, info.row_start + j)
            row = (mQn[tok, head, None].iterator.toint(), mQp[tok, head, None].iterator.toint())
            self._copy_row(q_base, row, r, t, 0, TILE_Q)

    @cute.jit
    def _issue_kv(self, mCkv, mKpe, mKvIndices, page_base, blk_start, kv_end, page_size, kv_base, stage, tw):
        """cp.async a block's 64 latent rows into a stage (``_issue_kv_rows``); where one page
        holds the whole block (page sizes k * 64, the item starting on a block boundary), with
        one page lookup for the block instead of one per token: the per-token divisions and
        lookups were most of the loading warpgroup's integer work."""
        args = (mCkv, mKpe, mKvIndices, page_base, blk_start, kv_end, page_size, kv_base, stage, tw)
        if const_expr(self.cfg.block_pages):
            if page_size.divisor % BLOCK_N == 0 and blk_start % BLOCK_N == 0:
                self._issue_kv_block(*args)
            else:
                self._issue_kv_rows(*args)
        else:
            self._issue_kv_rows(*args)

    @cute.jit
    def _issue_kv_block(self, mCkv, mKpe, mKvIndices, page_base, blk_start, kv_end, page_size, kv_base, stage, tw):
        """``_issue_kv_rows`` for a block inside one page: rows past kv_end re-read the last
        valid token (in the same page)."""
        t = tw % THREADS_PER_ROW
        pg, slot0 = divmod(blk_start, page_size)
        page = in_cache(mKvIndices[page_base + pg], mCkv.shape[0])
        last = kv_end - 1 - blk_start
        for i in cutlass.range_constexpr(BLOCK_N // LOAD_ROWS):
            r = tw // THREADS_PER_ROW + i * LOAD_ROWS
            slot = slot0 + cutlass.select_(r < last, r, last)
            row = (mCkv[page, slot, None].iterator.toint(), mKpe[page, slot, None].iterator.toint())
            self._copy_row(kv_base, row, r, t, stage, BLOCK_N)

    @cute.jit
    def _issue_kv_rows(self, mCkv, mKpe, mKvIndices, page_base, blk_start, kv_end, page_size, kv_base, stage, tw):
        """cp.async a block's 64 latent rows into a stage: row 16 i + tw / 8 is token
        blk_start + row (past kv_end: the last valid token again, masked later), its ckv chunks
        t, t + 8, .. and kpe chunk t.  The page lookups first (all in flight together)."""
        t = tw % THREADS_PER_ROW
        n = BLOCK_N // LOAD_ROWS
        num_pages = mCkv.shape[0]
        pages = cute.make_rmem_tensor((n,), Int32)
        for i in cutlass.range_constexpr(n):
            p = blk_start + tw // THREADS_PER_ROW + i * LOAD_ROWS
            p = cutlass.select_(p < kv_end, p, kv_end - 1)
            pg, _ = divmod(p, page_size)
            pages[i] = mKvIndices[page_base + pg]
        for i in cutlass.range_constexpr(n):
            r = tw // THREADS_PER_ROW + i * LOAD_ROWS
            p = blk_start + r
            p = cutlass.select_(p < kv_end, p, kv_end - 1)
            _, slot = divmod(p, page_size)
            page = in_cache(pages[i], num_pages)
            row = (mCkv[page, slot, None].iterator.toint(), mKpe[page, slot, None].iterator.toint())
            self._copy_row(kv_base, row, r, t, stage, BLOCK_N)

    @staticmethod
    def _copy_row(base, row, r, t, s, rows: int):
        """cp.async this thread's chunks of one 576-wide row (``row``: the addresses of its 512
        latent / nope and 64 rope values) into row r of slice s of a (rows, 576, n) tile: chunks
        t, t + 8, .. of the first part and chunk t of the second."""
        for c in range(D_QK // 64):  # (plain Python: unrolled while the caller is traced)
            d = smem_off(r, c, t, s, rows) * 2
            if c < D_CKV // 64:
                cp_async_16(base + d, row[0] + (t + 8 * c) * 16)
            else:
                cp_async_16(base + d, row[1] + t * 16)

    # ---- epilogue ------------------------------------------------------------------------------
    @cute.jit
    def _store(self, mO, mPartO, acc_O, inv, tOcO, info: ItemInfo, col0: int):
        """Normalize and store this warpgroup's 256 columns of the item's rows (two adjacent
        columns per store): final rows to o (value dtype), split ones to partial slot ``dest``
        (fp32).  A row that saw no key: o = 0."""
        O = wgmma_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            j = tOcO[r, 0][0]
            if j < info.num_rows:
                if info.dest < 0:
                    tok, head = tok_head(info, info.row_start + j)
                    row = mO[tok, head, None]
                    for c in cutlass.range_constexpr(0, cute.size(O, mode=[1]), 2):
                        out = cute.make_rmem_tensor((2,), mO.element_type)
                        out[0] = (O[r, c] * inv[r]).to(mO.element_type)
                        out[1] = (O[r, c + 1] * inv[r]).to(mO.element_type)
                        cute.autovec_copy(out, cute.local_tile(row, (2,), ((col0 + tOcO[0, c][1]) // 2,)))
                else:
                    row = mPartO[info.dest * TILE_Q + j, None]
                    for c in cutlass.range_constexpr(0, cute.size(O, mode=[1]), 2):
                        out = cute.make_rmem_tensor((2,), Float32)
                        out[0] = O[r, c] * inv[r]
                        out[1] = O[r, c + 1] * inv[r]
                        cute.autovec_copy(out, cute.local_tile(row, (2,), ((col0 + tOcO[0, c][1]) // 2,)))


def build_mla_decode_sm90(spec):
    """The jit entry of an ``mla_decode_sm90`` spec."""
    return MlaDecodeSm90(MlaSm90Config.from_spec(spec.pdict))
