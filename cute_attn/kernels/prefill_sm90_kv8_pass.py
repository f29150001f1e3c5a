"""The KV pass inside the Hopper prefill kernel (spec ``kv8_pass``): an fp8 cache, ragged (1) or
paged (2), is dequantized once per key, as by the standalone pass (``kv_pass.py``), but by the
kernel's own producer warps while its consumers already compute, instead of before the kernel
starts.  Either way the kernel itself reads the ragged 16-bit copy (a paged cache's rows in the
order of the copy's token offsets, ``mKvIndptr``).

Why: a long prefill is compute-bound, so the standalone pass's ~70 us of memory traffic (2 x 8k
x 16 heads, hd128: 67 MB read, 134 MB written) is pure added time (1.06-1.09x the bf16
kernel), and widening inside the pipeline (``prefill_sm90_kv8.py``) repeats the conversion for
every query tile that reads a block (1.3x).  Here each (key block, kv head) is converted once,
by whichever CTA claims it, into the 16-bit copy in the workspace that the unchanged TMA
producer then reads.  Tasks are blocks of ``tile_n`` rows of the whole ragged cache (token-major,
every request's rows one after the other), not of a request: a K / V block the producer loads
runs past its request's end into the next request's rows (masked, but P V still multiplies
them by zero, and 0 x NaN is NaN), so those rows must be converted too -- as the standalone
pass has converted them.

Roles in the producer warpgroup:
- warp 0 streams the 16-bit K / V blocks by TMA as for a ragged cache, but first waits until
  the block's task is done (its flag, ``ld.acquire.gpu``; then ``fence.proxy.async.global``,
  as the TMA reads through the async proxy what generic stores wrote);
- warps 1-3 (the helpers) claim tasks from a global counter (``atom.add``) in the plan's order
  (last blocks first: the order in which the consumers, who walk blocks from last to first,
  need them), load the task's fp8 K and V rows into the staging tiles (the output staging
  tile's memory: O goes out through the item's Q buffer, as with the widening) -- a ragged
  cache's as one TMA box each, a paged cache's by ``cp.async`` per 16-byte chunk through the
  page table (a block's rows span pages and requests: each row's request is found from the
  plan's request of the block's first row) --, convert them (to the pass's values, NaN / Inf
  kept) and store 16-bit rows to global memory, then fence and publish the flag
  (``st.release.gpu``).  The plan orders the tasks as its CTAs will
  first need them (``sched.pass_order``): in the order nearest a request's end first, CTAs
  whose first items sit low in a causal batch waited for most of the pass (2 x 8k causal:
  1.13x the bf16 time against 1.04x, H200).

No deadlock whatever the residency: a flag waited for belongs to a task that is either claimed
-- by a running CTA whose helpers never wait on anything but their own loads -- or not yet
claimed, and then the waiting CTA's own helpers will claim it (they keep claiming until the
counter passes the last task).

Workspace (``families/prefill.py``, ``kv8_pass_plan``): ``mPassState`` (int32, zeroed before
every launch) holds the claim counter at 0 and one flag per (block, kv head) from
``PASS_FLAGS``, block g of head h at ``g * kv_heads + h``, and the count of published tasks
at ``PASS_DONE`` (once it is the task count, warp 0 stops checking flags); ``mPassPlan`` (int32, written by
plan()): ``[n_tasks, task_offset, tokens]`` then tasks ``(block, kv head, request of the block's
first row)``; a paged cache's kernel also takes the page table (page indptr, page ids).  A K / V block the
producer loads starts anywhere in the cache (a request's first row, a split point): it waits
for the (at most two) blocks its rows overlap.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from ..families.prefill import KV8_PASS_PAGED
from .copy import cp_async_16
from .fp8 import fp8_kind, fp8x4_to_bf16x4_exact, fp8x4_to_f16x4
from .pages import in_cache
from .prefill_sm90_kv8 import ld_shared_v4

HELPER_WARPS = 3  # producer warps 1-3 (warp 0 streams the 16-bit blocks)
BAR_HELPERS = 6  # the helpers' named barrier (prefill_sm90's barriers: 1-5)
PASS_DONE = 1  # mPassState: the claim counter at 0, the tasks published at 1, flags from PASS_FLAGS
PASS_FLAGS = 4
PLAN_FIELDS = 3  # a task: block of the cache's rows, kv head, the request of the block's first row


def _asm(ret, args, text, cons):
    return llvm.inline_asm(
        ret, args, text, cons, has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT
    )


@dsl_user_op
def ld_acquire_gpu(addr, *, loc=None, ip=None) -> Int32:
    """The int32 at global byte address ``addr``, loaded with acquire semantics at GPU scope."""
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l"))


@dsl_user_op
def st_release_gpu(addr, value, *, loc=None, ip=None) -> None:
    """Store ``value`` (int32) at global byte address ``addr`` with release semantics (GPU scope)."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    _asm(None, args, "st.release.gpu.global.b32 [$0], $1;", "l,r")


@dsl_user_op
def atom_add_gpu(addr, value, *, loc=None, ip=None) -> Int32:
    """``atom.add`` (relaxed, GPU scope) on the int32 at global byte address ``addr``: the old value."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    return Int32(_asm(T.i32(), args, "atom.relaxed.gpu.global.add.s32 $0, [$1], $2;", "=r,l,r"))


@dsl_user_op
def red_release_add_gpu(addr, value, *, loc=None, ip=None) -> None:
    """``red.release.gpu.global.add``: add ``value`` to the int32 at ``addr``, after (for an
    acquirer of the result) everything this thread's release covers."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    _asm(None, args, "red.release.gpu.global.add.s32 [$0], $1;", "l,r")


@dsl_user_op
def fence_global_writes(*, loc=None, ip=None) -> None:
    """This thread's global stores before what follows, for other CTAs and for the async proxy
    (the TMA loads of the block): ``fence.acq_rel.gpu`` + ``fence.proxy.async.global``."""
    _asm(None, [], "fence.acq_rel.gpu; fence.proxy.async.global;", "")


@dsl_user_op
def fence_proxy_async_global(*, loc=None, ip=None) -> None:
    """Generic-proxy writes seen (by an acquire) before the async proxy's reads that follow."""
    _asm(None, [], "fence.proxy.async.global;", "")


@dsl_user_op
def st_global_v4(addr, words, *, loc=None, ip=None) -> None:
    """Four Int32 as 16 bytes at global byte address ``addr`` (16-byte aligned)."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    _asm(None, args, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r")


class PrefillKv8Pass:
    """The helpers and the block wait of ``BatchPrefillSm90`` with ``kv8_pass`` (module doc)."""

    def _pass_args(self, var_tensors, s8_layout):
        """Host side: (the pass's tensors, the variant's, the fp8 sources the kernel starts ``p8``
        with) from the tensors after the fixed ones: mK8, mV8, mPassState, mPassPlan and for a
        paged cache mPassPageIndptr, mPassPageIds (the kernel appends all but the first two to
        ``p8``: :meth:`_pass_fields`).  A ragged cache's sources are its TMA atoms and views, a
        paged cache's the tensors (``cp.async`` per 16-byte chunk: a block's rows span pages)."""
        n = 6 if self.kv8_pass == KV8_PASS_PAGED else 4
        extra, rest = var_tensors[:n], var_tensors[n:]
        if const_expr(self.kv8_pass == KV8_PASS_PAGED):
            return extra, rest, tuple(extra[:2])
        return extra, rest, self._pass_tma(extra, s8_layout)

    def _pass_fields(self, p8):
        """(state, plan, sources) of ``p8``: sources (tma_k8, tK8, tma_v8, tV8) for a ragged
        cache, (mK8, mV8, page indptr, page ids) for a paged one."""
        if const_expr(self.kv8_pass == KV8_PASS_PAGED):
            mK8, mV8, state, plan, page_indptr, page_ids = p8
            return state, plan, (mK8, mV8, page_indptr, page_ids)
        tma_k8, tK8, tma_v8, tV8, state, plan = p8
        return state, plan, (tma_k8, tK8, tma_v8, tV8)

    def _pass_tma(self, extra, s8_layout):
        """Host side: (TMA atom and view of the fp8 K, the same of V) from the kernel's extra
        tensors (mK8, mV8, mPassState, mPassPlan)."""
        out = []
        for m in extra[:2]:
            x3 = cute.make_tensor(m.iterator, cute.select(m.layout, mode=[1, 3, 2]))  # (tokens, D, heads)
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            out += list(cpasync.make_tiled_tma_atom(g2s, x3, s8_layout, (self.tile_n, self.head_dim)))
        return tuple(out)

    def pass_smem_bytes(self) -> int:
        """Shared memory :meth:`_pass_smem` allocates inside the kernel, beyond the host's struct
        (its size check must count it: over the limit, only the launch fails)."""
        return 64 if self.kv8_pass else 0

    @cute.jit
    def _pass_smem(self, smem, sO_range, s8_layout, tidx):
        """``Stages``' fp8 fields: the K and V staging tiles (one each, in the output staging
        tile's memory), no pipelines, the helpers' two load barriers and their claim slot."""
        TN, D = self.tile_n, self.head_dim

        @cute.struct
        class PassSmem:
            bars: cute.struct.MemRange[cutlass.Int64, 2]
            claim: cute.struct.MemRange[cutlass.Int32, 4]

        st = smem.allocate(PassSmem)
        bars = st.bars.data_ptr()
        if tidx == 0:  # fenced and synced by the kernel's pipeline_init_arrive / _wait
            cute.arch.mbarrier_init(bars, 1)
            cute.arch.mbarrier_init(bars + 1, 1)
        assert self.tile_q * self.o_cols * (self.dtype.width // 8) >= 2 * TN * D, "sO holds both fp8 tiles"
        ptr = cute.recast_ptr(sO_range.data_ptr(), s8_layout.inner, dtype=self.kv8)
        staged = cute.append(s8_layout.outer, cute.make_layout(1, stride=TN * D))
        views = (cute.make_tensor(ptr, staged), cute.make_tensor(ptr + TN * D, staged))
        return views + (None, None, (bars, bars + 1), st.claim.get_tensor(cute.make_layout(4)))

    @cute.jit
    def _pass_pending(self, p8):
        """Warp 0, once per item: 0 once every task is published (the done count, ``atom.release``
        by each task's publisher, equals the task count: then the item's blocks need no flag
        checks, only the proxy fence), else 1."""
        mState, mPlan, _ = self._pass_fields(p8)
        pending = Int32(1)
        if ld_acquire_gpu(mState.iterator.toint() + PASS_DONE * 4) == mPlan[0]:
            fence_proxy_async_global()
            pending = Int32(0)
        return pending

    @cute.jit
    def _wait_block(self, gm, p8, row, kv_head):
        """Warp 0: spin until the tasks of the cache's rows [row, row + tile_n) that exist (at
        most two blocks) are published, then order the async proxy's reads after them."""
        mState, mPlan, _ = self._pass_fields(p8)
        TN = self.tile_n
        hi = cutlass.min(row + TN, mPlan[2])
        base = (row // TN) * gm.mK.shape[2] + kv_head
        flags = mState.iterator.toint() + PASS_FLAGS * 4
        for b in cutlass.range((hi - 1) // TN - row // TN + 1, unroll=1):
            addr = flags + Int64(base + b * gm.mK.shape[2]) * 4
            while ld_acquire_gpu(addr) == 0:
                pass
        fence_proxy_async_global()

    @cute.jit
    def _pass_helpers(self, gm, p8, sm, tidx):
        """Warps 1-3: claim, load, convert and publish tasks until none is left."""
        mState, mPlan, srcs = self._pass_fields(p8)
        TN, D = self.tile_n, self.head_dim
        ht = tidx - 32  # 0 .. 95
        n_tasks, toff = mPlan[0], mPlan[1]
        counter = mState.iterator.toint()
        bar_k, bar_v = sm.pass_bars
        claim = sm.pass_claim
        if ht == 0:
            claim[0] = atom_add_gpu(counter, 1)
        cute.arch.barrier(barrier_id=BAR_HELPERS, number_of_threads=32 * HELPER_WARPS)
        t = claim[0]
        phase = Int32(0)
        pdiv = None
        if const_expr(self.kv8_pass == KV8_PASS_PAGED):
            pdiv = cute.FastDivmodDivisorV2(srcs[0].shape[1])  # the page size
        while t < n_tasks:
            task = toff + PLAN_FIELDS * t
            blk, head = mPlan[task], mPlan[task + 1]
            row0 = blk * TN
            n_rows = cutlass.min(mPlan[2] - row0, TN)
            if const_expr(self.kv8_pass == KV8_PASS_PAGED):
                self._gather_pages(gm, srcs, sm, row0, n_rows, mPlan[task + 2], head, pdiv, ht)
                self._convert_rows(sm.sK8, gm.mK, row0, n_rows, head, ht)
                self._convert_rows(sm.sV8, gm.mV, row0, n_rows, head, ht)
            else:
                tma_k8, tK8, tma_v8, tV8 = srcs
                if ht < 32:  # warp 1, converged: the TMA copy elects its lane itself (elect.sync, all lanes)
                    for x in cutlass.range_constexpr(2):
                        tma, tX, sX, bar = (tma_k8, tK8, sm.sK8, bar_k) if x == 0 else (tma_v8, tV8, sm.sV8, bar_v)
                        gX = cute.local_tile(cute.domain_offset((row0, 0), tX[None, None, head]), (TN, D), (None, 0))
                        ts, tg = cpasync.tma_partition(
                            tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
                        )
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(bar, TN * D)
                        cute.copy(tma, tg[None, 0], ts[None, 0], tma_bar_ptr=bar)
                cute.arch.mbarrier_wait(bar_k, phase)
                self._convert_rows(sm.sK8, gm.mK, row0, n_rows, head, ht)
                cute.arch.mbarrier_wait(bar_v, phase)
                self._convert_rows(sm.sV8, gm.mV, row0, n_rows, head, ht)
                phase = phase ^ 1
            fence_global_writes()
            cute.arch.barrier(barrier_id=BAR_HELPERS, number_of_threads=32 * HELPER_WARPS)
            if ht == 0:
                flag = counter + Int64(PASS_FLAGS + blk * gm.mK.shape[2] + head) * 4
                st_release_gpu(flag, 1)
                red_release_add_gpu(counter + PASS_DONE * 4, 1)
                claim[0] = atom_add_gpu(counter, 1)
            cute.arch.barrier(barrier_id=BAR_HELPERS, number_of_threads=32 * HELPER_WARPS)
            t = claim[0]

    @cute.jit
    def _gather_pages(self, gm, srcs, sm, row0, n_rows, req0, head, pdiv, ht):
        """A paged cache's task: rows [0, n_rows) of the block into the staging tiles, where
        :meth:`_convert_rows` reads them (swizzled 128-byte rows), by ``cp.async`` of 16 bytes.
        Row r is the cache's token ``row0 + r`` of the ragged order (the 16-bit copy's
        ``mKvIndptr``): its request is found from ``req0`` (the plan's: the request of the
        block's first row) forward, then its page from the page table.  A thread takes whole
        rows (r = its index + 96 k) and copies all their chunks: one lookup per row (per chunk,
        the three dependent loads kept each thread's copies in series) and no row table in
        shared memory (the kernel has no 1 KB left for one)."""
        mK8, mV8, mPageIndptr, mPageIds = srcs
        tok = gm.mKvIndptr
        helpers = 32 * HELPER_WARPS
        sk = sm.sK8[None, None, 0].iterator.toint()
        sv = sm.sV8[None, None, 0].iterator.toint()
        for k in cutlass.range_constexpr((self.tile_n + helpers - 1) // helpers):
            r = ht + k * helpers
            if r < n_rows:
                w = row0 + r
                req = req0
                while w >= tok[req + 1]:  # requests ending inside the block (empty ones too)
                    req = req + 1
                page_idx, slot = divmod(w - tok[req], pdiv)
                page = in_cache(mPageIds[mPageIndptr[req] + page_idx], mK8.shape[0])
                src_k = mK8[page, slot, head, None].iterator.toint()
                src_v = mV8[page, slot, head, None].iterator.toint()
                for q in cutlass.range_constexpr(self.head_dim // 16):
                    off = r * 128 + ((q ^ (r % 8)) * 16)
                    cp_async_16(sk + off, src_k + q * 16)
                    cp_async_16(sv + off, src_v + q * 16)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier(barrier_id=BAR_HELPERS, number_of_threads=32 * HELPER_WARPS)

    @cute.jit
    def _convert_rows(self, s8, mX, row0, n_rows, head, ht):
        """Rows [0, n_rows) of the fp8 staging tile ``s8`` (swizzled 128-byte rows) -> 16-bit rows
        row0 .. of kv head ``head`` of ``mX``: 16-byte chunk c = ht + 96 k is row c // 8, chunk
        c % 8 (read at the swizzled position), written as the 32 bytes of its 16 values."""
        TN, D = self.tile_n, self.head_dim
        per_row = D // 16
        src = s8[None, None, 0].iterator.toint()
        for k in cutlass.range_constexpr((TN * per_row + 32 * HELPER_WARPS - 1) // (32 * HELPER_WARPS)):
            c = ht + k * 32 * HELPER_WARPS
            r, q = c // per_row, c % per_row
            if r < n_rows:
                words = ld_shared_v4(src + r * 128 + ((q ^ (r % 8)) * 16))
                dst = mX[0, row0 + r, head, None].iterator.toint() + q * 32
                out = self._widen16(words)
                st_global_v4(dst, out[:4])
                st_global_v4(dst + 16, out[4:])

    def _widen16(self, words):
        """16 fp8 values (four Int32) -> eight Int32 of the query dtype, the values the KV pass
        writes (exact, NaN / Inf kept): bf16 by integer ops (``fp8x4_to_bf16x4_exact``: the ``cvt``
        route takes two conversions per pair on the pipe of the consumers' exponentials), fp16
        by ``cvt`` (one per pair)."""
        kind = fp8_kind(self.kv8)
        out = []
        for x in words:
            if const_expr(self.dtype is cutlass.BFloat16):
                a, b = fp8x4_to_bf16x4_exact(x, kind)
            else:
                a, b = fp8x4_to_f16x4(x, kind)
            out += [a, b]
        return out
