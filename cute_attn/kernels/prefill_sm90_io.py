"""The Hopper prefill consumers' row I/O (``prefill_sm90.py``): a warpgroup's Q rows in by
``cp.async`` (GQA addressing: packed row r is token r // group of head kv_head * group + r %
group), and the item's normalized rows out -- final rows (value dtype + LSE) through the
staging tile (filled by ``stmatrix`` where two consumer warpgroups hold O and it leaves in one
pass, head dims <= 128; else a value per store) as 16-byte stores, each row to its own (token,
head) address, or a split item's fp32 partial rows straight from registers for the ⊕ merge; and
the zeroing of V rows past the item's keys in shared memory.

A mixin of ``BatchPrefillSm90``: its methods read the kernel's configuration from ``self``,
the item from an ``ItemInfo`` and the launch's values from a ``TraceCtx`` (``work.py``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .fragments import WG, quad_sum, wgmma_mn_view
from .work import ItemInfo, TraceCtx, tok_head


class PrefillRowIO:
    """Q rows in, output rows out (see the module docstring)."""

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
    def _epilogue(self, acc_O, st, tOcO, sO, gm, thr, info: ItemInfo, tc: TraceCtx):
        """Normalize and store: final rows (value dtype + LSE) through the staging tile sO, or a
        partial slot (fp32) straight from registers."""
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
            # through shared memory: 16-byte stores, each row to its own (token, head) address;
            # o_cols columns per pass (column c of a thread is at the static offset
            # tc.o_col_off[c] from its first, which is < 8: the pass of c is known at trace time)
            OC = self.o_cols
            oc_chunks = OC // 8
            for h in cutlass.range_constexpr(D // OC):
                if const_expr(h > 0):
                    cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)  # pass h-1's reads done
                if const_expr(tc.o_stage is not None):  # one pass: the whole accumulator by stmatrix
                    rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
                    rO.store(acc_O.load().to(self.dtype))
                    cute.copy(tc.o_stage, tc.o_stage.retile(rO), tc.o_stage.partition_D(sO))
                for r in cutlass.range_constexpr(n_rows):
                    j = tOcO[r, 0][0]
                    if const_expr(tc.o_stage is None):
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
