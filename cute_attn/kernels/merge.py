"""The ⊕ operator on attention states, as CuTe DSL kernels (docs/design.md, §6 Split-KV and the ⊕ merge).

A state is (v, s): v the normalized output of attention over some key set, s its
log-sum-exp in base 2.  Two states merge as

    m = max(s_a, s_b);  w_a = 2^(s_a - m);  w_b = 2^(s_b - m)
    v = (w_a v_a + w_b v_b) / (w_a + w_b);  s = m + log2(w_a + w_b)

and a row whose every state is empty (s = -inf) merges to v = 0, s = -inf rather than NaN.

Both kernels are memory-bound: each thread owns one 16-byte vector of a row's head_dim and
walks the states; a CTA covers ``rows_per_cta`` (seq, head) rows per step of a grid-stride
loop.  Plain SIMT loads (LDG.128): there is nothing for TMA or the tensor cores to do, so the
same code serves sm_90a and sm_100a.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..abi.dtypes import elt_bytes

VEC_BYTES = 16
TARGET_THREADS = 128


def row_geometry(dtype_bytes: int, head_dim: int) -> tuple[int, int, int]:
    """(elements per vector, threads per row, rows per CTA) for a row of ``head_dim`` elements."""
    vec = VEC_BYTES // dtype_bytes
    assert head_dim % vec == 0, "head_dim must be a multiple of one 16-byte vector"
    tpr = head_dim // vec
    assert tpr <= 1024, "head_dim too large for one CTA row"
    return vec, tpr, max(1, TARGET_THREADS // tpr)


@cute.jit
def load_vec(row: cute.Tensor, lane: Int32, vec: cutlass.Constexpr):
    """This thread's ``vec`` contiguous elements of a row, converted to fp32."""
    src = cute.local_tile(row, (vec,), (lane,))
    frag = cute.make_rmem_tensor((vec,), row.element_type)
    cute.autovec_copy(src, frag)
    return frag.load().to(Float32)


@cute.jit
def store_vec(row: cute.Tensor, lane: Int32, vec: cutlass.Constexpr, value):
    frag = cute.make_rmem_tensor((vec,), row.element_type)
    frag.store(value.to(row.element_type))
    cute.autovec_copy(frag, cute.local_tile(row, (vec,), (lane,)))


@cute.jit
def oplus_step(m: Float32, d: Float32, acc, s_i: Float32, v_i):
    """Fold one state (v_i, LSE s_i) into a running (max m, denominator d, unnormalized acc).
    ``m_safe`` keeps exp2 finite while every state so far is empty (-inf): weights are then 0,
    and a row that stays empty ends with d = 0 (written as v = 0, LSE = -inf).  An empty
    state's v is not read: whatever it holds (a caller's NaN) would survive 0 * v."""
    m_new = cute.arch.fmax(m, s_i)
    m_safe = m_new if m_new != -Float32.inf else Float32(0.0)
    scale = cute.math.exp2(m - m_safe, fastmath=True)
    w = cute.math.exp2(s_i - m_safe, fastmath=True)
    return m_new, d * scale + w, acc * scale + _weighted(v_i, w, s_i)


@cute.jit
def _weighted(v, w: Float32, s: Float32):
    """w * v, or 0 for an empty state (s = -inf, w = 0) whatever v holds."""
    return cute.where(cute.full_like(v, s) != -Float32.inf, v * w, 0.0)


PARTIALS_BATCH = 8  # partial slots whose loads one batch of the split merge issues together


@cute.jit
def fold_states(n: Int32, load: cutlass.Constexpr, batch: cutlass.Constexpr, width: cutlass.Constexpr):
    """(v, lse) of states 0 .. n - 1 folded left to right with ⊕ (a fixed order: deterministic
    output), where ``load(i)`` returns state i as (lse, v: ``width`` fp32 values).

    The loads of ``batch`` states are issued before any of their folds, so each thread keeps
    several 16-byte loads in flight and a long fold costs a few load latencies, not one per
    state.  Past-the-end states of the last batch re-read state n - 1 with LSE -inf: weight
    exactly 0 and scale exactly 1, so the result is that of the real states (up to the sign
    of a zero).  No state, or only empty ones (LSE -inf): v = 0, lse = -inf."""
    m = -Float32.inf
    d = Float32(0.0)
    acc = cute.zeros_like(cute.make_rmem_tensor((width,), Float32).load())
    for i0 in cutlass.range(0, n, batch, unroll=1):
        s_batch, v_batch = [], []
        for k in cutlass.range_constexpr(batch):
            s_k, v_k = load(i0 + k if i0 + k < n else n - 1)
            s_batch.append(s_k if i0 + k < n else -Float32.inf)
            v_batch.append(v_k)
        for k in cutlass.range_constexpr(batch):
            m, d, acc = oplus_step(m, d, acc, s_batch[k], v_batch[k])
    lse = -Float32.inf
    if d > Float32(0.0):
        acc = acc * cute.arch.rcp_approx(d)
        lse = m + cute.math.log2(d, fastmath=True)
    return acc, lse


@cute.jit
def _grid(nrows: Int32, rows_per_cta: cutlass.Constexpr, max_ctas: Int32) -> Int32:
    """One CTA per row group, at most ``max_ctas`` (SM count x CTAs per SM, passed in at launch:
    nothing is asked of the GPU at trace time); the grid-stride loop covers the rest."""
    needed = (nrows + rows_per_cta - 1) // rows_per_cta
    return needed if needed < max_ctas else max_ctas


class MergeStates:
    """merge_states: v [seq, n, heads, dim], s [seq, n, heads] -> o [seq, heads, dim], lse [seq, heads]."""

    def __init__(self, dtype_bytes: int, head_dim: int, load_batch: int):
        self.vec, self.tpr, self.rows_per_cta = row_geometry(dtype_bytes, head_dim)
        self.load_batch = load_batch  # states whose loads are issued together

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        seq, nstates, heads = mS.shape
        lane = tidx % self.tpr
        nrows = seq * heads
        for row0 in cutlass.range(bidx * self.rows_per_cta, nrows, gdim * self.rows_per_cta):
            row = row0 + tidx // self.tpr
            if row < nrows:
                si = row // heads
                h = row - si * heads
                acc, lse = fold_states(
                    nstates,
                    lambda i: (mS[si, i, h], load_vec(mV[si, i, h, None], lane, self.vec)),
                    self.load_batch,
                    self.vec,
                )
                store_vec(mO[si, h, None], lane, self.vec, acc)
                if lane == 0:
                    mLse[si, h] = lse

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,
        mS: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        grid = _grid(mS.shape[0] * mS.shape[2], self.rows_per_cta, max_ctas)
        self.kernel(mV, mS, mO, mLse).launch(
            grid=[grid, 1, 1], block=[self.tpr * self.rows_per_cta, 1, 1], stream=stream
        )


class MergePair:
    """merge_state / merge_state_in_place: (v_a, s_a) ⊕ (v_b, s_b) -> (o, lse), rows [seq, heads].

    ``o``/``lse`` may alias ``v_a``/``s_a`` (in place): each thread reads its elements before
    writing them.  With ``masked``, rows whose ``mask[seq]`` byte is 0 are left untouched.
    """

    def __init__(self, dtype_bytes: int, head_dim: int, masked: bool):
        self.vec, self.tpr, self.rows_per_cta = row_geometry(dtype_bytes, head_dim)
        self.masked = masked

    @cute.kernel
    def kernel(
        self,
        mVa: cute.Tensor,
        mSa: cute.Tensor,
        mVb: cute.Tensor,
        mSb: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mMask: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        seq, heads = mSa.shape
        lane = tidx % self.tpr
        nrows = seq * heads
        for row0 in cutlass.range(bidx * self.rows_per_cta, nrows, gdim * self.rows_per_cta):
            row = row0 + tidx // self.tpr
            if row < nrows:
                si = row // heads
                h = row - si * heads
                keep = True
                if const_expr(self.masked):
                    keep = mMask[si] != 0
                if keep:
                    sa = mSa[si, h]
                    sb = mSb[si, h]
                    va = load_vec(mVa[si, h, None], lane, self.vec)
                    vb = load_vec(mVb[si, h, None], lane, self.vec)
                    m = cute.arch.fmax(sa, sb)
                    out = cute.zeros_like(va)
                    lse = -Float32.inf
                    if m != -Float32.inf:
                        wa = cute.math.exp2(sa - m, fastmath=True)
                        wb = cute.math.exp2(sb - m, fastmath=True)
                        d = wa + wb
                        out = (_weighted(va, wa, sa) + _weighted(vb, wb, sb)) * cute.arch.rcp_approx(d)
                        lse = m + cute.math.log2(d, fastmath=True)
                    store_vec(mO[si, h, None], lane, self.vec, out)
                    if lane == 0:
                        mLse[si, h] = lse

    @cute.jit
    def __call__(
        self,
        mVa: cute.Tensor,
        mSa: cute.Tensor,
        mVb: cute.Tensor,
        mSb: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mMask: cute.Tensor,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        grid = _grid(mSa.shape[0] * mSa.shape[1], self.rows_per_cta, max_ctas)
        self.kernel(mVa, mSa, mVb, mSb, mO, mLse, mMask).launch(
            grid=[grid, 1, 1], block=[self.tpr * self.rows_per_cta, 1, 1], stream=stream
        )


class MergePartials:
    """The persistent merge after split-KV attention (contract: ``cute_attn/sched``).

    The work is cut finer than the merge tasks: a *unit* is ``rows_per_unit`` rows of one task
    (one row per ``per_row`` threads, one 16-byte fp32 vector per thread: the whole CTA in one
    pass), and CTA c takes units c, c + num_ctas, ... of the ``units_per_task x num_tasks``
    grid (task-minor).  For each of its rows a thread folds partial slots SLOT_START .. SLOT_START +
    NUM_SLOTS - 1 left to right (fixed order: deterministic) and writes the final o (value
    dtype) / LSE of that packed row.  (One CTA per task left all but a few CTAs idle where a
    plan has few tasks -- a long shared prefix cut for one query tile: 16 tasks of 128 rows
    took 48 us on the H200, each CTA waiting out 64 load latencies in turn.)  The task count is
    read on the device, so a captured graph replays any plan.

    Launched as a programmatic dependent (PDL) of the attention kernel.  The decode kernel lets
    it go at its start (``griddepcontrol.launch_dependents``), so this grid's launch overlaps
    decode; after prefill, which does not, it starts when prefill ends, as a plain launch would.
    Every CTA first waits (``griddepcontrol.wait``: the attention grid has finished and its
    writes are visible) -- before it reads anything, and also when it has no task, so that this
    grid's end still implies the attention kernel's for whatever the stream runs next.
    """

    def __init__(self, head_dim: int, tile_q: int):
        self.head_dim, self.tile_q = head_dim, tile_q
        self.per_row = head_dim // 4  # fp32 partials: 4 per 16-byte vector
        # a unit is whole rows of one pass; threads past its rows * per_row idle (head dim 96)
        assert head_dim % 4 == 0 and self.per_row <= TARGET_THREADS
        self.rows_per_unit = min(TARGET_THREADS // self.per_row, tile_q)
        self.units_per_task = -(-tile_q // self.rows_per_unit)

    @cute.kernel
    def kernel(
        self,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        mTasks: cute.Tensor,
        mMeta: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        group: Int32,
    ):
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        num_tasks = mMeta[META_NUM_MERGE_TASKS]
        for u in cutlass.range(cta, num_tasks * self.units_per_task, nctas):
            # task-minor: units 0 .. num_tasks - 1 are every task's first rows, and so on; a
            # decode tile often has rows in its first unit only (GQA 4: 4 of 16), and
            # task-major units would put those on every units_per_task-th CTA
            sub = u // num_tasks
            t = u - sub * num_tasks
            kv_head, row_start, num_rows = mTasks[t, 1], mTasks[t, 2], mTasks[t, 3]
            qo_offset, slot0, nslots = mTasks[t, 4], mTasks[t, 5], mTasks[t, 6]
            row0 = sub * self.rows_per_unit
            row_end = cutlass.min(num_rows, row0 + self.rows_per_unit)
            # at most one pass (a loop, not a branch: ptxas then keeps a batch's loads together)
            for idx in cutlass.range(row0 * self.per_row + tidx, row_end * self.per_row, TARGET_THREADS):
                j = idx // self.per_row
                c4 = idx - j * self.per_row
                # this row's partial slots slot0 .. slot0 + nslots - 1, 4 columns (one 16-byte vector)
                prow = lambda i: (slot0 + i) * self.tile_q + j  # noqa: E731
                acc, lse = fold_states(
                    nslots, lambda i: (mPartLse[prow(i)], load_vec(mPartO[prow(i), None], c4, 4)), PARTIALS_BATCH, 4
                )
                r = row_start + j
                tok = qo_offset + r // group
                head = kv_head * group + r % group
                store_vec(mO[tok, head, None], c4, 4, acc)
                if c4 == 0:
                    mLse[tok, head] = lse

    @cute.jit
    def __call__(
        self,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        mTasks: cute.Tensor,
        mMeta: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        group: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(mPartO, mPartLse, mTasks, mMeta, mO, mLse, group).launch(
            grid=[num_ctas, 1, 1], block=[TARGET_THREADS, 1, 1], stream=stream, use_pdl=True
        )


META_NUM_MERGE_TASKS = 1  # cute_attn.sched.workspace.META_NUM_MERGE_TASKS (checked in cute_attn.decode)


def build_merge_states(spec):
    p = spec.pdict
    return MergeStates(elt_bytes(p["dtype"]), p["head_dim"], p["load_batch"])


def build_merge_pair(spec):
    p = spec.pdict
    return MergePair(elt_bytes(p["dtype"]), p["head_dim"], p["masked"])


def build_merge_partials(spec):
    p = spec.pdict
    return MergePartials(p["head_dim"], p["tile_q"])
