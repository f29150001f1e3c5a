"""Persistent paged-KV decode attention (CuTe DSL), executing the scheduler's work items.

One CTA = 4 warps; the grid is the plan's ``num_ctas``; CTA c runs work items
``work_indptr[c] .. work_indptr[c+1]`` (contract: ``cute_attn/sched/__init__.py``).  An item is
one tile of TILE_Q packed query rows (GQA packing: row r of kv head h is query token
r // group of qo head h*group + r % group, so one KV read serves the whole group) against a
token range of one request's paged KV.

Per KV block of BLOCK_N tokens:
- every thread gathers 16-byte chunks of K and V rows with ``cp.async`` into a swizzled shared
  tile, looking each token's page up in ``kv_indices`` (any page size, 1 included: sparse
  load, dense compute), STAGES blocks in flight;
- warp w owns keys [16w, 16w+16) of the block: S = Q Kᵀ and O += P V on tensor cores
  (``mma.sync`` m16n8k16, fragments via ``ldmatrix``), with its own online-softmax state;
- the four warp states are ⊕-merged through shared memory at the end of the item, and the
  result goes to the final output (bf16/fp16 + LSE) or to a partial slot (fp32) for the merge
  kernel.

Scores are kept in base 2 (scaled by sm_scale·log2 e), so LSE comes out in base 2 as
FlashInfer returns it.  Variant hook points (logits transform, logits mask) are the
``_logits`` and ``_visible`` methods: soft-cap and the sliding window go through them.
Uses no Hopper-only instruction, so it also compiles for sm_100a.
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

TILE_Q = 16  # packed query rows per work item (one m16 MMA tile)
BLOCK_N = 64  # KV tokens per pipeline stage: 4 warps x 16 keys
NUM_WARPS = 4
THREADS = 32 * NUM_WARPS
LOG2E = math.log2(math.e)

# work item fields (cute_attn.sched.workspace W_*)
W_REQ, W_KV_HEAD, W_ROW_START, W_NUM_ROWS, W_KV_START, W_KV_END, W_DEST, W_QO_OFFSET, W_QO_LEN, W_KV_LEN = range(10)


class PagedDecode:
    def __init__(self, dtype, head_dim: int, stages: int, soft_cap: bool, window: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.stages = stages
        self.soft_cap = soft_cap
        self.window = window
        self.chunks = head_dim // 8  # 16-byte chunks per row
        self.rows_per_thread = BLOCK_N * self.chunks // THREADS  # KV rows each thread gathers per block
        kv_bytes = 2 * BLOCK_N * head_dim * stages * 2
        o_bytes = NUM_WARPS * TILE_Q * (head_dim + 4) * 4
        assert o_bytes <= kv_bytes, "epilogue buffer must fit in the KV stages it reuses"

    # ---- variant hook points -------------------------------------------------------------
    @cute.jit
    def _logits(self, s: Float32, scale_log2: Float32, cap_log2: Float32, inv_cap_scaled: Float32) -> Float32:
        """Raw q·k -> logit in base 2.  Soft-cap: cap * tanh(q·k * sm_scale / cap)."""
        out = s * scale_log2
        if const_expr(self.soft_cap):
            out = cap_log2 * cute.math.tanh(s * inv_cap_scaled, fastmath=True)
        return out

    @cute.jit
    def _visible(self, kv_pos: Int32, kv_end: Int32, q_pos: Int32, window_left: Int32):
        """Logits mask: inside the item's range and, with a window, at most window_left keys
        to the left of the query's (bottom-right aligned) position."""
        ok = kv_pos < kv_end
        if const_expr(self.window):
            ok = ok & (kv_pos >= q_pos - window_left)
        return ok

    # ---- host side ----------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKvIndptr: cute.Tensor,
                 mKvIndices: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, mWork: cute.Tensor,
                 mWorkIndptr: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
                 group: Int32, sm_scale: Float32, soft_cap: Float32, window_left: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        D = self.head_dim
        atom_cols = 64 if D % 64 == 0 else 32
        swz = cute.make_composed_layout(cute.make_swizzle(3 if atom_cols == 64 else 2, 3, 3), 0,
                                        cute.make_layout((8, atom_cols), stride=(atom_cols, 1)))
        sQ_layout = cute.tile_to_shape(swz, (TILE_Q, D), (0, 1))
        sKV_layout = cute.tile_to_shape(swz, (BLOCK_N, D, self.stages), (0, 1, 2))
        sO_layout = cute.make_layout((TILE_Q, D + 4, NUM_WARPS), stride=(D + 4, 1, TILE_Q * (D + 4)))

        @cute.struct
        class Smem:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            # K stages then V stages; the epilogue's fp32 sO reuses this region once the KV
            # loop is done (it fits: checked in __init__), so two CTAs fit an SM at head_dim <= 128
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, 2 * cute.cosize(sKV_layout)], 1024]
            sM: cute.struct.MemRange[Float32, NUM_WARPS * TILE_Q]
            sL: cute.struct.MemRange[Float32, NUM_WARPS * TILE_Q]

        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (1, 1, 1),
                                        permutation_mnk=(16, 16, 16))
        scale_log2 = sm_scale * LOG2E
        cap = soft_cap if soft_cap > Float32(0.0) else Float32(1.0)
        self.kernel(mQ, mK, mV, mKvIndptr, mKvIndices, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse,
                    group, scale_log2, cap * LOG2E, sm_scale / cap, window_left,
                    sQ_layout, sKV_layout, sO_layout, tiled_mma, Smem).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    # ---- device side --------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKvIndptr: cute.Tensor,
               mKvIndices: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, mWork: cute.Tensor,
               mWorkIndptr: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
               group: Int32, scale_log2: Float32, cap_log2: Float32, inv_cap_scaled: Float32,
               window_left: Int32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sO_layout: cute.Layout, tiled_mma: cute.TiledMma, Smem: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wid = tidx // 32
        lane = tidx % 32
        D = self.head_dim

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        sQ = st.sQ.get_tensor(sQ_layout)
        kv_ptr = st.sKV.data_ptr()
        sK = cute.make_tensor(kv_ptr, sKV_layout)
        sV = cute.make_tensor(kv_ptr + cute.cosize(sKV_layout), sKV_layout)
        sO = cute.make_tensor(cute.recast_ptr(kv_ptr, dtype=Float32), sO_layout)
        sM = st.sM.get_tensor(cute.make_layout((TILE_Q, NUM_WARPS), stride=(1, TILE_Q)))
        sL = st.sL.get_tensor(cute.make_layout((TILE_Q, NUM_WARPS), stride=(1, TILE_Q)))

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                  num_bits_per_copy=128)
        thr_mma = tiled_mma.get_slice(lane)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(lane)
        s2r_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(lane)
        s2r_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(lane)

        # Row/column coordinates of this thread's accumulator elements (MMA C layout).
        tScS = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_Q, 16))))
        tOcO = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_Q, D))))
        n_rows_thr = cute.size(tScS, mode=[0])

        for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1]):
            req = mWork[item, W_REQ]
            kv_head = mWork[item, W_KV_HEAD]
            row_start = mWork[item, W_ROW_START]
            num_rows = mWork[item, W_NUM_ROWS]
            kv_start = mWork[item, W_KV_START]
            kv_end = mWork[item, W_KV_END]
            dest = mWork[item, W_DEST]
            qo_offset = mWork[item, W_QO_OFFSET]
            qpos_base = mWork[item, W_KV_LEN] - mWork[item, W_QO_LEN]
            page_base = mKvIndptr[req]
            page_size = mK.shape[1]
            n_blocks = (kv_end - kv_start + BLOCK_N - 1) // BLOCK_N

            # --- Q tile -> smem (rows past num_rows re-read row 0 and are never written out)
            for i in cutlass.range_constexpr((TILE_Q * self.chunks + THREADS - 1) // THREADS):
                idx = tidx + i * THREADS
                if idx < TILE_Q * self.chunks:
                    j = idx // self.chunks
                    c = idx % self.chunks
                    r = row_start + (j if j < num_rows else 0)
                    tok = qo_offset + r // group
                    head = kv_head * group + r % group
                    cute.copy(g2s, cute.local_tile(mQ[tok, head, None], (8,), (c,)),
                              cute.local_tile(sQ[j, None], (8,), (c,)))

            # --- KV blocks: prologue fills STAGES-1 stages (Q rides in the first group); the
            # page lookups of the next block to issue are always one iteration ahead, so the
            # loop never waits on kv_indices before issuing its copies.
            rows = cute.make_rmem_tensor((self.rows_per_thread,), Int32)
            for s in cutlass.range_constexpr(self.stages - 1):
                if s < n_blocks:
                    self._lookup(mKvIndices, rows, tidx, page_base, page_size, kv_start + s * BLOCK_N, kv_end)
                    self._issue_kv(mK, mV, sK, sV, g2s, rows, tidx, page_size, kv_head, s)
                cute.arch.cp_async_commit_group()
            if self.stages - 1 < n_blocks:
                self._lookup(mKvIndices, rows, tidx, page_base, page_size,
                             kv_start + (self.stages - 1) * BLOCK_N, kv_end)

            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_Q, D)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_l = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))

            for nb in cutlass.range(n_blocks):
                cute.arch.cp_async_wait_group(self.stages - 2)
                cute.arch.sync_threads()
                if nb == 0:
                    cute.copy(s2r_q, s2r_q.partition_S(sQ), s2r_q.retile(tSrQ))
                nxt = nb + self.stages - 1
                if nxt < n_blocks:
                    self._issue_kv(mK, mV, sK, sV, g2s, rows, tidx, page_size, kv_head, nxt % self.stages)
                    if nxt + 1 < n_blocks:
                        self._lookup(mKvIndices, rows, tidx, page_base, page_size, kv_start + (nxt + 1) * BLOCK_N,
                                     kv_end)
                cute.arch.cp_async_commit_group()

                stage = nb % self.stages
                sK_w = cute.local_tile(sK[None, None, stage], (16, D), (wid, 0))
                sV_w = cute.local_tile(sV[None, None, stage], (16, D), (wid, 0))
                # S = Q K_wᵀ  (16 rows x 16 keys)
                tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_w))
                cute.copy(s2r_k, s2r_k.partition_S(sK_w), s2r_k.retile(tSrK))
                acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_Q, 16)), Float32)
                acc_S.fill(0.0)
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

                # logits, mask, online softmax over this warp's 16 keys
                key0 = kv_start + nb * BLOCK_N + wid * 16
                acc_S_mn = _mn_view(acc_S)
                acc_O_mn = _mn_view(acc_O)
                for r in cutlass.range_constexpr(n_rows_thr):
                    row = row_start + tScS[r, 0][0]
                    q_pos = qpos_base + row // group
                    m_blk = -Float32.inf
                    for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                        v = self._logits(acc_S_mn[r, c], scale_log2, cap_log2, inv_cap_scaled)
                        v = v if self._visible(key0 + tScS[0, c][1], kv_end, q_pos, window_left) else -Float32.inf
                        acc_S_mn[r, c] = v
                        m_blk = cute.arch.fmax(m_blk, v)
                    m_blk = _quad_max(m_blk)
                    m_new = cute.arch.fmax(row_m[r], m_blk)
                    m_use = m_new if m_new != -Float32.inf else Float32(0.0)
                    corr = cute.math.exp2(row_m[r] - m_use, fastmath=True)
                    l_blk = Float32(0.0)
                    for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                        p = cute.math.exp2(acc_S_mn[r, c] - m_use, fastmath=True)
                        acc_S_mn[r, c] = p
                        l_blk = l_blk + p
                    row_l[r] = row_l[r] * corr + l_blk  # per-thread partial sum; quad-reduced at the end
                    row_m[r] = m_new
                    for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                        acc_O_mn[r, c] = acc_O_mn[r, c] * corr

                # O += P V_w
                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                tOrP = _acc_as_A(rP)
                sVt_w = cute.composition(sV_w, cute.make_layout((D, 16), stride=(16, 1)))
                tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_w))
                cute.copy(s2r_v, s2r_v.partition_S(sVt_w), s2r_v.retile(tOrV))
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

            # --- epilogue: ⊕ of the four warp states through smem, then store
            cute.arch.cp_async_wait_group(0)
            acc_O_mn = _mn_view(acc_O)
            for r in cutlass.range_constexpr(n_rows_thr):
                row_l[r] = _quad_sum(row_l[r])
                if lane % 4 == 0:
                    sM[tScS[r, 0][0], wid] = row_m[r]
                    sL[tScS[r, 0][0], wid] = row_l[r]
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(n_rows_thr):
                j = tScS[r, 0][0]
                m_all = -Float32.inf
                for w in cutlass.range_constexpr(NUM_WARPS):
                    m_all = cute.arch.fmax(m_all, sM[j, w])
                m_use = m_all if m_all != -Float32.inf else Float32(0.0)
                l_all = Float32(0.0)
                for w in cutlass.range_constexpr(NUM_WARPS):
                    l_all = l_all + sL[j, w] * cute.math.exp2(sM[j, w] - m_use, fastmath=True)
                f = Float32(0.0)
                if l_all > Float32(0.0):
                    f = cute.math.exp2(row_m[r] - m_use, fastmath=True) * cute.arch.rcp_approx(l_all)
                for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                    sO[j, tOcO[0, c][1], wid] = acc_O_mn[r, c] * f
                if wid == 0 and lane % 4 == 0:
                    lse = -Float32.inf
                    if l_all > Float32(0.0):
                        lse = m_all + cute.math.log2(l_all, fastmath=True)
                    sM[j, 0] = lse  # reuse: this row's final LSE, read below
            cute.arch.sync_threads()
            self._store(mO, mLse, mPartO, mPartLse, sO, sM, tidx, row_start, num_rows, dest, qo_offset,
                        kv_head, group)
            cute.arch.sync_threads()  # smem is reused by the next item

    @cute.jit
    def _lookup(self, mKvIndices: cute.Tensor, rows: cute.Tensor, tidx: Int32, page_base: Int32,
                page_size: Int32, blk_start: Int32, kv_end: Int32):
        """Global token offset (page * page_size + slot) of each KV row this thread gathers in a
        block: token p lives in page kv_indices[page_base + p // page_size].  Tokens past kv_end
        re-read the last valid token (finite data; masked to -inf later)."""
        rows_per_pass = THREADS // self.chunks
        for i in cutlass.range_constexpr(self.rows_per_thread):
            p = blk_start + tidx // self.chunks + i * rows_per_pass
            p = p if p < kv_end else kv_end - 1
            rows[i] = mKvIndices[page_base + p // page_size] * page_size + p % page_size

    @cute.jit
    def _issue_kv(self, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                  g2s: cute.CopyAtom, rows: cute.Tensor, tidx: Int32, page_size: Int32, kv_head: Int32,
                  stage: Int32):
        """cp.async this thread's 16-byte chunks of the looked-up K and V rows into a stage."""
        rows_per_pass = THREADS // self.chunks
        c = tidx % self.chunks
        for i in cutlass.range_constexpr(self.rows_per_thread):
            r = tidx // self.chunks + i * rows_per_pass
            page = rows[i] // page_size
            off = rows[i] - page * page_size
            cute.copy(g2s, cute.local_tile(mK[page, off, kv_head, None], (8,), (c,)),
                      cute.local_tile(sK[r, None, stage], (8,), (c,)))
            cute.copy(g2s, cute.local_tile(mV[page, off, kv_head, None], (8,), (c,)),
                      cute.local_tile(sV[r, None, stage], (8,), (c,)))

    @cute.jit
    def _store(self, mO: cute.Tensor, mLse: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
               sO: cute.Tensor, sLse: cute.Tensor, tidx: Int32, row_start: Int32, num_rows: Int32,
               dest: Int32, qo_offset: Int32, kv_head: Int32, group: Int32):
        """Sum the four warps' scaled outputs per row; write final rows (value dtype) or a
        partial slot (fp32): 4 columns per thread-step."""
        per_row = self.head_dim // 4
        for i in cutlass.range_constexpr((TILE_Q * per_row + THREADS - 1) // THREADS):
            idx = tidx + i * THREADS
            j = idx // per_row
            c4 = idx % per_row
            if idx < TILE_Q * per_row and j < num_rows:
                acc = cute.zeros_like(cute.make_rmem_tensor((4,), Float32).load())
                for w in cutlass.range_constexpr(NUM_WARPS):
                    frag = cute.make_rmem_tensor((4,), Float32)
                    cute.autovec_copy(cute.local_tile(sO[j, None, w], (4,), (c4,)), frag)
                    acc = acc + frag.load()
                r = row_start + j
                if dest < 0:
                    tok = qo_offset + r // group
                    head = kv_head * group + r % group
                    out = cute.make_rmem_tensor((4,), mO.element_type)
                    out.store(acc.to(mO.element_type))
                    cute.autovec_copy(out, cute.local_tile(mO[tok, head, None], (4,), (c4,)))
                    if c4 == 0:
                        mLse[tok, head] = sLse[j, 0]
                else:
                    out = cute.make_rmem_tensor((4,), Float32)
                    out.store(acc)
                    slot_row = dest * TILE_Q + j
                    cute.autovec_copy(out, cute.local_tile(mPartO[slot_row, None], (4,), (c4,)))
                    if c4 == 0:
                        mPartLse[slot_row] = sLse[j, 0]


@cute.jit
def _quad_max(v: Float32) -> Float32:
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2))
    return cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1))


@cute.jit
def _quad_sum(v: Float32) -> Float32:
    v = v + cute.arch.shuffle_sync_bfly(v, offset=2)
    return v + cute.arch.shuffle_sync_bfly(v, offset=1)


def _mn_view(t: cute.Tensor) -> cute.Tensor:
    """View an m16n8 accumulator partition ((2 cols, 2 rows), M, N) as (rows, cols)."""
    l = cute.make_layout(t.layout.shape)
    mn = cute.make_layout(((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[2])),
                          stride=((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def _acc_as_A(t: cute.Tensor) -> cute.Tensor:
    """Reuse an m16n8 accumulator fragment (4, M, N) as the A operand of m16n8k16:
    two adjacent n8 tiles form one k16 step -> ((4, 2), M, N/2)."""
    d = cute.logical_divide(t.layout, (None, None, 2))
    a = cute.make_layout(((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
                         stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]))
    return cute.make_tensor(t.iterator, a)


_DTYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16}


def build_paged_decode(spec):
    p = spec.pdict
    return PagedDecode(_DTYPES[p["dtype"]], p["head_dim"], p["stages"], p["soft_cap"], p["window"])
