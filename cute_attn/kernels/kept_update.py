"""A kept decode plan's per-step update on the device (``sched/reuse.py`` is the host half).

A CUDA-graph decode wrapper keeps its last full plan's work items keyed by the *length rank* of
their request (``reuse`` module doc).  Each step only the lengths change, and the engine has
already written them into the device buffers the kernels read (``kv_indptr``,
``kv_last_page_len``).  This kernel, launched once per step ahead of the first layer's
attention (it is part of the captured graph), does what the host would otherwise do every
step: read the lengths, sort the requests longest first, give every item the request of its
rank, clamp its kv range to that request's length (stretching each pair's last chunk to it),
rewrite the merge tasks' requests, and model the CTAs' loads.  When the kept items are out of
balance it says so in a status word in host memory, which the next ``fast_decode_plan`` reads
(no synchronization: a step late at worst) to plan anew.  Any lengths give a correct plan, so a
late re-plan costs time, never correctness.

One CTA: a bitonic sort of ``(INT32_MAX - length) << 32 | request`` keys in shared memory
(ascending = longest first, ties by request index, the host planner's order); then a thread per
item (each record names its CTA) rewrites it and adds its kv tokens to its CTA's count in shared
memory, and a thread per CTA models that CTA's load.  Plain SIMT loads and stores, the same
code for sm_90a and sm_100a.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..abi.kept import (
    K_BATCH,
    K_BETA,
    K_BOUND_Q20,
    K_EPOCH,
    K_MAX_KV_LEN,
    K_NUM_CTAS,
    K_NUM_ITEMS,
    K_NUM_MERGES,
    K_ON,
    K_PAGE_SIZE,
    K_PER_ITEM,
    K_SORT_LOG2,
    KI_CTA,
    KI_END,
    KI_RANK,
    KI_START,
    KS_BAD_LENGTHS,
    KS_UNBALANCED,
    MAX_BATCH,
    MAX_CTAS,
)
from ..abi.records import M_QO_OFFSET, M_REQ, W_KV_END, W_KV_LEN, W_KV_START, W_QO_OFFSET, W_REQ

THREADS = 512
NUM_WARPS = THREADS // 32
ITEM_BATCH = 4  # items per thread whose records are loaded together
_LAST_KEY = 0x7FFFFFFFFFFFFFFF  # sorts after every request: the padding up to a power of two


class KeptUpdate:
    @cute.kernel
    def kernel(
        self,
        mKvIndptr: cute.Tensor,
        mLast: cute.Tensor,
        mParams: cute.Tensor,
        mItems: cute.Tensor,
        mMergeRank: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mMerges: cute.Tensor,
        mStatus: cute.Tensor,
        Smem: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        st = cutlass.utils.SmemAllocator().allocate(Smem)
        sKey = st.sKey.get_tensor(cute.make_layout(MAX_BATCH))
        sLen = st.sLen.get_tensor(cute.make_layout(MAX_BATCH))
        sRed = st.sRed.get_tensor(cute.make_layout((2, NUM_WARPS), stride=(NUM_WARPS, 1)))
        sBad = st.sBad.get_tensor(cute.make_layout(1))
        sTok = st.sTok.get_tensor(cute.make_layout(MAX_CTAS))
        if mParams[K_ON] != 0:
            batch, page_size = mParams[K_BATCH], mParams[K_PAGE_SIZE]
            max_len = mParams[K_MAX_KV_LEN]
            lg = mParams[K_SORT_LOG2]
            n_keys = Int32(1) << lg
            if tidx == 0:
                sBad[0] = Int32(0)
            cute.arch.sync_threads()
            for r in cutlass.range(tidx, n_keys, THREADS, unroll=1):
                key = Int64(_LAST_KEY)
                if r < batch:
                    pages = mKvIndptr[r + 1] - mKvIndptr[r]
                    last = Int32(1)
                    if page_size > 1:
                        last = mLast[r]
                    n = (pages - 1) * page_size + last
                    if pages == 0:
                        n = Int32(0)
                    # a page count below 0, a last page outside [1, page_size] or a length past
                    # the planner's limit: read as 0 (no kv read) and reported
                    if pages < 0 or (pages > 0 and (last < 1 or last > page_size)) or n > max_len:
                        n = Int32(0)
                        sBad[0] = Int32(1)
                    sLen[r] = n
                    key = (Int64(Int32(0x7FFFFFFF) - n) << 32) | Int64(r)
                sKey[r] = key
            cute.arch.sync_threads()
            self._sort(sKey, lg, tidx)
            mx, total = self._items(mParams, mItems, mWork, mWorkIndptr, sKey, sLen, sTok, tidx)
            for m in cutlass.range(tidx, mParams[K_NUM_MERGES], THREADS, unroll=1):
                req = Int32(sKey[mMergeRank[m]] & Int64(0xFFFFFFFF))
                mMerges[m, M_REQ] = req
                mMerges[m, M_QO_OFFSET] = req  # one query token per request
            mx = cute.arch.warp_reduction(mx, cute.arch.fmax)
            total = cute.arch.warp_reduction(total, lambda a, b: a + b)
            if tidx % 32 == 0:
                sRed[0, tidx // 32] = mx
                sRed[1, tidx // 32] = total
            cute.arch.sync_threads()
            if tidx == 0:
                for w in cutlass.range_constexpr(1, NUM_WARPS):
                    mx = cute.arch.fmax(mx, sRed[0, w])
                    total = total + sRed[1, w]
                status = Int32(0)
                ctas = Float32(mParams[K_NUM_CTAS])
                if ctas * mx * Float32(1 << 20) > Float32(mParams[K_BOUND_Q20]) * total:
                    status = Int32(KS_UNBALANCED)
                if sBad[0] != 0:
                    status = status | Int32(KS_BAD_LENGTHS)
                mStatus[0] = mParams[K_EPOCH] * 4 + status

    @cute.jit
    def _sort(self, sKey: cute.Tensor, lg: Int32, tidx: Int32):
        """Bitonic sort of the 2^lg keys, ascending."""
        half = (Int32(1) << lg) // 2
        for s in cutlass.range(lg, unroll=1):
            k = Int32(2) << s
            for t in cutlass.range(s + 1, unroll=1):
                j = Int32(1) << (s - t)
                for u in cutlass.range(tidx, half, THREADS, unroll=1):
                    i = 2 * u - (u & (j - 1))  # a 0 inserted at bit log2(j): pairs (i, i + j)
                    a, b = sKey[i], sKey[i + j]
                    if cutlass.select_((i & k) == 0, a > b, a < b):
                        sKey[i] = b
                        sKey[i + j] = a
                cute.arch.sync_threads()

    @cute.jit
    def _items(self, mParams, mItems, mWork, mWorkIndptr, sKey, sLen, sTok, tidx: Int32):
        """Every item on its rank's request and length, ``ITEM_BATCH`` items per thread at a
        time (their records loaded before any is written: the stores would otherwise keep the
        next loads from starting); each CTA's kv tokens summed in ``sTok``.  Returns this
        thread's (largest, summed) modelled CTA loads."""
        n_ctas = mParams[K_NUM_CTAS]
        for c in cutlass.range(tidx, n_ctas, THREADS, unroll=1):
            sTok[c] = Int32(0)
        cute.arch.sync_threads()
        n_items = mParams[K_NUM_ITEMS]
        for i0 in cutlass.range(tidx, n_items, THREADS * ITEM_BATCH, unroll=1):
            rec = cute.make_rmem_tensor((ITEM_BATCH, 4), Int32)
            for j in cutlass.range_constexpr(ITEM_BATCH):
                i = i0 + j * THREADS
                rec[j, 0] = Int32(0)
                rec[j, 1] = Int32(0)
                rec[j, 2] = Int32(0)
                rec[j, 3] = Int32(0)
                if i < n_items:
                    rec[j, 0] = mItems[i, KI_RANK]
                    rec[j, 1] = mItems[i, KI_START]
                    rec[j, 2] = mItems[i, KI_END]
                    rec[j, 3] = mItems[i, KI_CTA]
            for j in cutlass.range_constexpr(ITEM_BATCH):
                i = i0 + j * THREADS
                if i < n_items:
                    req = Int32(sKey[rec[j, 0]] & Int64(0xFFFFFFFF))
                    n = sLen[req]
                    s0, e0 = rec[j, 1], rec[j, 2]
                    s = cutlass.min(s0, n)
                    e = n
                    if e0 >= 0:
                        e = cutlass.min(e0, n)
                    # a chunk that does not start the pair must not start at kv 0 (variants run
                    # ``finalize`` on the chunk that does): emptied by a length 0, it stays at s0
                    if s0 > 0 and n == 0:
                        s = s0
                        e = s0
                    mWork[i, W_REQ] = req
                    mWork[i, W_QO_OFFSET] = req  # one query token per request
                    mWork[i, W_KV_START] = s
                    mWork[i, W_KV_END] = e
                    mWork[i, W_KV_LEN] = n
                    cute.arch.atomic_add((sTok.iterator + rec[j, 3]).llvm_ptr, e - s)
        cute.arch.sync_threads()
        per_item, beta = Float32(mParams[K_PER_ITEM]), Float32(mParams[K_BETA])
        mx, total = Float32(0.0), Float32(0.0)
        for c in cutlass.range(tidx, n_ctas, THREADS, unroll=1):
            load = per_item * Float32(mWorkIndptr[c + 1] - mWorkIndptr[c]) + beta * Float32(sTok[c])
            mx = cute.arch.fmax(mx, load)
            total = total + load
        return mx, total

    @cute.jit
    def __call__(
        self,
        mKvIndptr: cute.Tensor,
        mLast: cute.Tensor,
        mParams: cute.Tensor,
        mItems: cute.Tensor,
        mMergeRank: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mMerges: cute.Tensor,
        mStatus: cute.Tensor,
        stream: cuda.CUstream,
    ):
        fields = {
            "sKey": cute.struct.Align[cute.struct.MemRange[Int64, MAX_BATCH], 16],
            "sLen": cute.struct.Align[cute.struct.MemRange[Int32, MAX_BATCH], 16],
            "sTok": cute.struct.Align[cute.struct.MemRange[Int32, MAX_CTAS], 16],
            "sRed": cute.struct.MemRange[Float32, 2 * NUM_WARPS],
            "sBad": cute.struct.MemRange[Int32, 4],
        }
        Smem = cute.struct(type("Smem", (), {"__annotations__": fields}))
        self.kernel(mKvIndptr, mLast, mParams, mItems, mMergeRank, mWork, mWorkIndptr, mMerges, mStatus, Smem).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream
        )


def build_kept_update(spec):
    assert spec.pdict["max_batch"] == MAX_BATCH
    return KeptUpdate()
