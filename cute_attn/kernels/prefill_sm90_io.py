"""The Hopper prefill consumers' row I/O (``prefill_sm90.py``): a warpgroup's Q rows in by
``cp.async`` (GQA addressing: packed row r is token r // group of head kv_head * group + r %
group), and the item's normalized rows out -- final rows (value dtype + LSE) through the
staging tile as 16-byte stores, each row to its own (token, head) address, or a split item's
fp32 partial rows straight from registers for the ⊕ merge; and the zeroing of V rows past the
item's keys in shared memory.

With ``store_warps`` the final rows' global stores leave the consumers: they stage a WG's rows
(and LSEs) and arrive on its ``o_full`` barrier; the producer warpgroup's warps 1-3, idle in a
ragged TMA kernel, walk the same items, store the staged rows with their per-row (token, head)
addresses and arrive on ``o_empty``, which the WG waits for before it stages its next tile.
Between items a consumer WG then spends on its output only the staging, not the ~8 shared loads,
8 global stores and their address arithmetic per thread that delay its next GEMMs (the other WG's
tensor work covers an epilogue only as long as that is shorter).

A mixin of ``BatchPrefillSm90``: its methods read the kernel's configuration from ``self``,
the item from an ``ItemInfo`` and the launch's values from a ``TraceCtx`` (``work.py``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .fragments import WG, quad_sum, wgmma_mn_view
from .work import ItemInfo, TraceCtx, tok_head

STORE_THREADS = 96  # store_warps: the producer warpgroup's warps 1-3


class PrefillRowIO:
    """Q rows in, output rows out (see the module docstring)."""

    def store_smem_bytes(self) -> int:
        """Shared memory of :meth:`_store_smem` (allocated inside the kernel, beyond the host's
        struct), alignment slack included."""
        return 4 * 8 + self.tile_q * 4 + 64 if self.store_warps else 0

    @cute.jit
    def _store_smem(self, smem, tidx):
        """``store_warps``: the barriers (``o_full`` per consumer WG, then ``o_empty`` per WG) and
        the LSE column of the staged rows."""

        @cute.struct
        class StoreSmem:
            bars: cute.struct.MemRange[cutlass.Int64, 4]
            lse: cute.struct.MemRange[Float32, self.tile_q]

        st = smem.allocate(StoreSmem)
        bars = st.bars.data_ptr()
        if tidx == 0:  # fenced and synced by the kernel's pipeline_init_arrive / _wait
            for w in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(bars + w, WG)  # each thread of WG w, once its rows are staged
                cute.arch.mbarrier_init(bars + 2 + w, STORE_THREADS)  # each storer, once it read them
        return bars, st.lse.get_tensor(cute.make_layout(self.tile_q))

    @cute.jit
    def _store_rows(self, gm, sm, cta, s, tc: TraceCtx):
        """``store_warps``, storer thread ``s`` of STORE_THREADS: the CTA's items in the consumers'
        order; for each with final rows, per consumer WG: wait for its staged rows, store them
        (16-byte chunks, each row to its (token, head) address) and their LSEs, free the tile."""
        mO, mLse, mWork, mWorkIndptr = gm.mO, gm.mLse, gm.mWork, gm.mWorkIndptr
        bars, sLse = sm.out_sync
        sO, cv = sm.sO, self.chunks_vo
        parity = Int32(0)
        for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1], unroll=1):
            info = ItemInfo(mWork, item, tc.group, tc.group_div)
            row_start, num_rows = info.row_start, info.num_rows
            if info.dest < 0:
                for w in cutlass.range_constexpr(self.num_mma_wg):
                    cute.arch.mbarrier_wait(bars + w, parity)
                    for idx in cutlass.range(s, 64 * cv, STORE_THREADS, unroll=1):
                        j = w * 64 + idx // cv
                        if j < num_rows:
                            c = idx % cv
                            frag = cute.make_rmem_tensor((8,), self.dtype)
                            cute.autovec_copy(cute.local_tile(sO[j, None], (8,), (c,)), frag)
                            tok, head = tok_head(info, row_start + j)
                            cute.autovec_copy(frag, cute.local_tile(mO[tok, head, None], (8,), (c,)))
                    if s < 64:
                        j = w * 64 + s
                        if j < num_rows:
                            tok, head = tok_head(info, row_start + j)
                            mLse[tok, head] = sLse[j]
                    cute.arch.mbarrier_arrive(bars + 2 + w)
                parity = parity ^ 1

    @cute.jit
    def _stage_rows(self, O, lse, tOcO, sO, out_sync, o_parity, thr):
        """``store_warps``: once the storers have read this WG's previous tile, write its rows
        (value dtype) and LSEs into the staging tile and hand them over (see the module
        docstring).  Returns the WG's next parity."""
        bars, sLse = out_sync
        cute.arch.mbarrier_wait(bars + 2 + thr.wg, o_parity ^ 1)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            j = tOcO[r, 0][0]
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                sO[j, tOcO[0, c][1]] = O[r, c].to(self.dtype)
            if thr.lane % 4 == 0:
                sLse[j] = lse[r]
        cute.arch.mbarrier_arrive(bars + thr.wg)
        return o_parity ^ 1

    def _q_buf(self, sQ, b):
        """Q buffer ``b`` (items back to back: two; else sQ is the one)."""
        return sQ[None, None, b] if const_expr(self.overlap) else sQ

    @cute.jit
    def _load_q(self, mQ, info: ItemInfo, sQ, g2s, wg, tw):
        """cp.async this WG's 64 packed Q rows of an item into smem (GQA: packed row r is token
        r // group of head kv_head * group + r % group); rows past NUM_ROWS re-read the tile's
        row 0 (finite, never stored).  Waited for at the top of the item loop."""
        row_start, num_rows = info.row_start, info.num_rows
        for i in cutlass.range_constexpr(64 * self.chunks // WG):
            idx = tw + i * WG
            j = wg * 64 + idx // self.chunks
            c = idx % self.chunks
            tok, head = tok_head(info, row_start + (j if j < num_rows else 0))
            cute.copy(
                g2s,
                cute.local_tile(mQ[tok, head, None], (8,), (c,)),
                cute.local_tile(sQ[j, None], (8,), (c,)),
            )
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _epilogue(self, acc_O, st, tOcO, sO, gm, thr, info: ItemInfo, tc: TraceCtx, out_sync=None, o_parity=None):
        """Normalize and store: final rows (value dtype + LSE) through the staging tile sO (with
        ``out_sync``: staged for the storer warps, ``_stage_rows``; returns ``o_parity`` moved on),
        or a partial slot (fp32) straight from registers."""
        row_m, row_l = st.row_m, st.row_l
        mO, mLse, mPartO, mPartLse = gm.mO, gm.mLse, gm.mPartO, gm.mPartLse
        wg, tw, lane, bar_wg = thr
        row_start, num_rows, dest = info.row_start, info.num_rows, info.dest
        D, TQ = self.head_dim_vo, self.tile_q
        O = wgmma_mn_view(acc_O)
        n_rows = cute.size(O, mode=[0])
        lse = cute.make_rmem_tensor((n_rows,), Float32)
        scale = self._row_scale(tc.scale_log2)  # row_m is in S's units (see _softmax)
        H = self.hooks
        if const_expr(H.has_finalize or not H.softmax):
            # variant statistics (sinks) / weights without softmax: plain-Python helper
            inv_t = cute.make_rmem_tensor((n_rows,), Float32)
            self._finalize_rows(st, tOcO, inv_t, lse, scale, info, tc)
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    O[r, c] = O[r, c] * inv_t[r]
        else:
            for r in cutlass.range_constexpr(n_rows):
                l = quad_sum(row_l[r])
                inv = Float32(0.0)
                lse[r] = -Float32.inf
                if l > Float32(0.0):
                    inv = cute.arch.rcp_approx(l)
                    lse[r] = row_m[r] * scale + cute.math.log2(l, fastmath=True)
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    O[r, c] = O[r, c] * inv
        if const_expr(H.has_output):  # final rows only: plan() disables split-KV for such variants
            self._output_rows(O, tOcO, info, tc)
        if dest < 0:
            if const_expr(out_sync is not None):
                o_parity = self._stage_rows(O, lse, tOcO, sO, out_sync, o_parity, thr)
            else:
                # through shared memory: 16-byte stores, each row to its own (token, head) address;
                # o_cols columns per pass (column c of a thread is at the static offset
                # tc.o_col_off[c] from its first, which is < 8: the pass of c is known at trace time)
                OC = self.o_cols
                oc_chunks = OC // 8
                for h in cutlass.range_constexpr(D // OC):
                    if const_expr(h > 0):
                        cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)  # pass h-1's reads done
                    for r in cutlass.range_constexpr(n_rows):
                        j = tOcO[r, 0][0]
                        for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                            if const_expr(tc.o_col_off[c] // OC == h):
                                sO[j, tOcO[0, c][1] - h * OC] = O[r, c].to(self.dtype)
                        if const_expr(h == 0):
                            if lane % 4 == 0 and j < num_rows:
                                tok, head = tok_head(info, row_start + j)
                                mLse[tok, head] = lse[r]
                    cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
                    for i in cutlass.range_constexpr(64 * oc_chunks // WG):
                        idx = tw + i * WG
                        j = wg * 64 + idx // oc_chunks
                        c = idx % oc_chunks
                        if j < num_rows:
                            row = row_start + j
                            frag = cute.make_rmem_tensor((8,), self.dtype)
                            cute.autovec_copy(cute.local_tile(sO[j, None], (8,), (c,)), frag)
                            tok, head = tok_head(info, row)
                            cute.autovec_copy(frag, cute.local_tile(mO[tok, head, None], (8,), (h * oc_chunks + c,)))
        else:
            for r in cutlass.range_constexpr(n_rows):
                j = tOcO[r, 0][0]
                if j < num_rows:
                    slot_row = dest * TQ + j
                    for c in cutlass.range_constexpr(0, cute.size(O, mode=[1]), 2):
                        pair = cute.make_rmem_tensor((2,), Float32)
                        pair[0] = O[r, c]
                        pair[1] = O[r, c + 1]
                        cute.autovec_copy(pair, cute.local_tile(mPartO[slot_row, None], (2,), (tOcO[0, c][1] // 2,)))
                    if lane % 4 == 0:
                        mPartLse[slot_row] = lse[r]
        return o_parity

    @cute.jit
    def _zero_v_tail(self, sV, state, valid, tw, bar_wg):
        """TMA fills a block's rows past KV_END with whatever follows in memory (the next
        request, a page's unused slots, stale data in a CUDA-graph buffer): zero those V rows
        before P V, as P = 0 there would not cancel a NaN or Inf (0 * NaN = NaN).  Both consumer
        WGs write the same zeros; each fences and syncs its own threads before its PV.  Only
        the item's last block can be partial; the cp.async gather re-reads the last valid
        token instead."""
        if const_expr(not self.gather):
            if valid < self.tile_n:
                zero = cute.make_rmem_tensor((8,), self.dtype)
                zero.fill(0.0)
                cv = self.chunks_vo
                for idx in cutlass.range(tw, (self.tile_n - valid) * cv, WG, unroll=1):
                    cute.autovec_copy(
                        zero,
                        cute.local_tile(sV[valid + idx // cv, None, state.index], (8,), (idx % cv,)),
                    )
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
