"""The portable prefill's deferred block order and ping-pong (``kernels/prefill_mma.py`` with
``defer=1``, or ``groups=2, pingpong=1``: FA3's schedule on ``mma.sync``).  Two groups of 4
warps share a CTA, one warp of each on every SMSP, and each group runs one CTA of the plan.
Where the warps of an SMSP otherwise run their MMAs and their softmax in no set phase (the
tensor pipe idles while both are in a softmax), the groups take turns at the tensor pipe: a
turn issues P V of block j - 1 and S = Q K^T of block j, and the group then runs block j's
softmax during the other group's turn.

P V of block j - 1 reads V from that block's stage during turn j, so V is loaded a block later
than K: after the barrier that opens block j, one group of copies takes V of block j (into the
stage whose V held block j - 2) and K of block j + 1 (into the stage whose K held block j - 1),
each with a block's time to land.  ``defer=1`` is the same order in one group, without turns.
Only the flag path (no per-row variant) at the 128-row tile, with two stages."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .decode import THREADS, PagedDecode
from .fragments import mma_mn_view
from .work import ItemInfo, TraceCtx


class TurnTaking:
    """The ping-pong's block loop and turns, mixed into ``PrefillMma``."""

    @cute.jit
    def _blocks_deferred(self, lds, tc: TraceCtx, cur, blocks, mma, stages, state, bounds, turn):
        """One item's blocks in the deferred order (in turns with ``pingpong``); returns (the
        load cursor, this group's turns so far).  ``lds`` = (the load stream, the pages of the
        block whose V is issued next); ``blocks`` = (item, its ItemInfo, blocks, its keys [start,
        end), blocks computed before, key group); ``mma`` = (tiled MMA, thread slice, K / V ldmatrix
        copies, (Q fragment, per-step Q, Q's copy)); ``stages`` = (sK, sV); ``state`` = (O, row
        max, row sum); ``bounds`` = (accumulator coordinates, row limits, window starts);
        ``turn`` = (group, turns so far, the other group's turns in all)."""
        ld, rows_v = lds
        item, info, n_blocks, (blk_start, blk_end), g, kg = blocks
        tiled_mma, thr_mma, s2r_k, s2r_v, q_src = mma
        sK, sV = stages
        acc_O, row_m, row_l = state
        tScS, lim, lo = bounds
        grp, k_turn, t_other = turn
        WR, KW = self.warp_rows, self.keys_per_warp
        rP = cute.make_rmem_tensor(thr_mma.partition_shape_C((WR, KW)), self.mma_dtype)
        acc_O_mn = mma_mn_view(acc_O)
        for nb in cutlass.range(n_blocks):
            # K of this block and V of the last landed; every warp is past the last block's reads
            cute.arch.cp_async_wait_group(0)
            self._sync(grp)
            if nb == 0:  # the single Q buffer: the barrier above ended the last item's reads
                PagedDecode._issue_q(self, ld, item, Int32(0))
                cute.arch.cp_async_commit_group()
            # V of this block (its stage's V held block nb - 2's), K of the cursor's next block
            # (its stage's K held block nb - 1's): one group, waited for at the next block
            stage = (g + nb) % 2
            self._issue_kv(ld, info.kv_head, blk_start + nb * self.block_n, blk_end, stage, (1,), rows_v)
            cur = self._cursor_issue_k(ld, tc, 1 - stage, cur, rows_v)
            cute.arch.cp_async_commit_group()
            if nb == 0:  # Q landed, for every thread
                cute.arch.cp_async_wait_group(1)
                self._sync(grp)
            key0 = blk_start + nb * self.block_n + kg * KW
            sK_w = cute.local_tile(sK[None, None, stage], (KW, self.kv_width), (kg, 0))
            self._turn_begin(grp, k_turn, t_other)
            if nb > 0:  # P V of the previous block
                sV_w = cute.local_tile(sV[None, None, 1 - stage], (KW, self.kv_width), (kg, 0))
                self._pv(tiled_mma, thr_mma, s2r_v, sV_w, rP, acc_O)
            acc_S = self._scores(tiled_mma, thr_mma, (s2r_k, sK_w), q_src, info, tc, key0)
            self._turn_end(grp, k_turn, t_other)
            k_turn = k_turn + 1
            self._flag_block(acc_S, rP, acc_O_mn, (row_m, row_l), (key0, tScS, lim, lo), tc)
        if n_blocks > 0:  # the last block's P V (a turn of its own) once its V landed
            cute.arch.cp_async_wait_group(0)
            self._sync(grp)
            self._turn_begin(grp, k_turn, t_other)
            sV_w = cute.local_tile(sV[None, None, (g + n_blocks - 1) % 2], (KW, self.kv_width), (kg, 0))
            self._pv(tiled_mma, thr_mma, s2r_v, sV_w, rP, acc_O)
            self._turn_end(grp, k_turn, t_other)
            k_turn = k_turn + 1
        return cur, k_turn

    @cute.jit
    def _cursor_issue_k(self, ld, tc: TraceCtx, stage, cur, rows_v):
        """The cursor's next block's K into ``stage`` (no commit), its pages kept in ``rows_v``
        for its V, issued with the next K; the cursor advanced."""
        if cur.nb < cur.n:
            for i in cutlass.range_constexpr(self.n_lookups):
                rows_v[i] = ld.rows[i]
            self._issue_kv(ld, cur.head, cur.start + cur.nb * self.tpb, cur.end, stage, (0,))
            cur = self._cursor_next(ld, tc, cur.next_block())
        return cur

    # ---- turns: group 0 first, then in alternation while both groups have turns left ----------
    # Turn k of a group waits at its barrier (3 + group, 256 threads: its own 128 and the other
    # group's 128 arrivals).  With T0 / T1 the groups' turns in all (``_turns``), every wait meets
    # exactly one arrival and none is left pending: group 0 waits before turn k while k <= T1
    # (turn 0: group 1's arrival at the start) and arrives after it while k < T1; group 1 waits
    # while k < T0 and arrives while k + 1 < T0.
    @cute.jit
    def _turn_begin(self, grp, k, t_other):
        if const_expr(self.pingpong):
            if k < t_other + 1 - grp:
                cute.arch.barrier(barrier_id=3 + grp, number_of_threads=2 * THREADS)

    @cute.jit
    def _turn_end(self, grp, k, t_other):
        if const_expr(self.pingpong):
            if k < t_other - grp:
                cute.arch.barrier_arrive(barrier_id=4 - grp, number_of_threads=2 * THREADS)

    @cute.jit
    def _turns(self, mWork, mWorkIndptr, cta, num_ctas, group, gdiv, tc: TraceCtx):
        """The turns a group running CTA ``cta`` of the plan takes: each item of n > 0 blocks
        n + 1 (S of block 0; P V of block j - 1 and S of block j; P V of the last)."""
        t = Int32(0)
        b, e = self._items_of(mWorkIndptr, cta, num_ctas)
        for item in cutlass.range(b, e, unroll=1):
            blk_start, blk_end = self._kv_blocks(ItemInfo(mWork, item, group, gdiv), tc)
            n = (blk_end - blk_start + self.block_n - 1) // self.block_n
            if n > 0:
                t = t + n + 1
        return t
