"""Portable batch prefill / append attention: ``mma.sync`` + ``cp.async``, any SM >= 80.

The prefill that every arch has (Blackwell's first, until a ``tcgen05`` kernel exists; on
Hopper the planner takes it where it beats the wgmma kernel, ``families.backends``).  It is the
paged decode kernel (``decode.PagedDecode``) grown to query tiles of 16, 32 or 64 packed rows,
and it reuses that kernel's pieces: the plan's work items read as one load stream over the
CTA's items (``LoadCursor``: K / V blocks of 64 tokens gathered by 16-byte ``cp.async`` into a
swizzled stage ring, STAGES deep, a Q tile per stage), fragments by ``ldmatrix``, m16n8k16
MMAs, the online softmax of a row (``_online_row``), the epilogue's ⊕ of warps through the
stage of the item's last block (``_o_buf`` / ``_store``) and the variant hook helpers.

Geometry: 4 warps; the tile's rows are cut into ``warps_m`` groups of 16 or 32 rows (the
warp's M tiles), and each group's keys over ``warps_n = 4 / warps_m`` warps:

  tile 16: 1 x 4 warps, 16 keys per warp and block (decode's geometry: K / V fragments whole);
  tile 32: 2 x 2 warps, 32 keys per warp;
  tile 64: 4 x 1 warps, all 64 keys of a block per warp;
  tile 128: 4 x 1 warps of 32 rows (head dims 64 / 128): every K / V fragment serves two M
  tiles, and Q is read from shared memory one k16 step at a time (``q_per_step``; head dim
  256 reads it so at every tile).

The knob ``groups=2`` puts two such 4-warp groups in one CTA, each running one CTA of the plan
with its own shared memory and named barrier; ``pingpong=1`` makes them take turns at the tensor
pipe (``prefill_mma_turns.py``); ``defer=1`` takes the ping-pong's block order (P V of block
j - 1 beside S of block j) in one group, without turns.

With 32 or 64 keys per warp the K and V fragments are read one k16 step at a time next to
their MMAs (a whole 64-key K fragment would be 128 registers).  Each warp keeps its own
online-softmax state; the warps of a row group are ⊕-merged through shared memory at the end
of the item (tiles 16 / 32; with 2 row groups one barrier more, since a group's buffers are
in rows the other group also read), a tile of 64 rows writes from registers.

KV: paged (``[pages, page_size, kv_heads, D]``, any page size, page ids looked up one block
ahead and clamped into the cache, ``pages.in_cache``) or ragged (``[1, tokens, kv_heads, D]``,
token offsets ``kv_indptr``: the lookup keeps the request's first token).  Rows past the item's
kv end re-read its last token (finite) and are masked.

Static flags, as the Hopper kernel's (``families/prefill.py``): ``causal`` (bottom-right: row
limit min(kv end, q_pos + 1)), ``window`` (blocks left of the tile's first row's window are
not read; keys below q_pos - window_left masked) and ``soft_cap`` (tanh of q·k · sm_scale /
cap, in units of cap; the softmax scale is then cap · log2 e).  Blocks that no bound cuts for
any row of a warp take a mask-free softmax (a warp vote).  A traced variant (custom mask,
ALiBi, sinks, FlashSigmoid, RoPE on Q, ...) goes through decode's per-row helpers on every
block; an in-kernel key transform (RoPE on paged K) needs the 16-row tile (whole K fragments),
others read K transformed by the KV pass (``keys_transformed``).

No Hopper-only instruction (no wgmma, TMA, setmaxnreg), so it compiles for sm_90a and sm_100a
alike; the sm_100a build has never run on Blackwell hardware (we have none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from ..variants.dsl import LOG2E
from ..variants.trace import make_entry
from .decode import BLOCK_N, NUM_WARPS, THREADS, DecodeConfig, LoadCursor, LoadStream, Outputs, PagedDecode
from .fragments import lazy_rescale, mma_acc_as_a, mma_mn_view, quad_max, quad_sum
from .prefill_mma_loads import KvLoads
from .prefill_mma_turns import TurnTaking
from .work import ItemInfo, TraceCtx, item_row_values, row_token, tok_head

TILES = (16, 32, 64, 128)
LAZY_RESCALE = 8.0  # base-2 units a row's block max may exceed its kept max by before O is rescaled
# warp rows groups per tile (the rest of the 4 warps split a group's keys): 16 -> 1 x 4 (decode's
# geometry), 32 -> 2 x 2, 64 -> 4 x 1, 128 -> 4 x 1 with 32 rows per warp (two M tiles reusing every
# K / V fragment: half the shared-memory reads per MMA of the 64-row tile, whose 16-row warps read
# more K / V bytes per MMA than shared memory delivers at the MMA rate); ``warps_m`` = 2 at tile 64
# (a knob) gives each warp 32 rows and 32 keys
WARPS_M = {16: 1, 32: 2, 64: 4, 128: 4}
# head dims of the 128-row tile: a 32-row warp's O is D x 32 / 32 fp32 registers per thread
TILE128_HEAD_DIMS = (64, 128)
# K / V pipeline depth per (head dim, tile): what leaves two CTAs per SM room in 228 KB of
# shared memory at head dims 64 / 80 / 96 / 128 (a stage: a Q tile + 64 tokens of K and V; the
# 128-row tile has one Q tile beside the stages, 100 KB at head dim 128); one at 256.  Head dim
# 96 (unmeasured): the most stages two CTAs fit, 108 / 90 / 108 KB per CTA
STAGES = {
    (64, 16): 4,
    (64, 32): 4,
    (64, 64): 3,
    (80, 16): 4,
    (80, 32): 4,
    (80, 64): 3,
    (96, 16): 4,
    (96, 32): 3,
    (96, 64): 3,
    (128, 16): 3,
    (128, 32): 2,
    (128, 64): 2,
    (64, 128): 3,
    (128, 128): 2,
    (256, 16): 2,
    (256, 32): 2,
    (256, 64): 2,
}


@dataclass(frozen=True)
class PrefillMmaConfig:
    """What a ``batch_prefill_mma`` specialization fixes (the spec's parameters)."""

    dtype: Any  # DSL type
    head_dim: int
    tile_q: int
    paged: bool
    causal: bool
    soft_cap: bool
    window: bool
    variant: Any = None
    stages: int = 0  # 0: STAGES
    warps_m: int = 0  # 0: WARPS_M
    groups: int = 0  # 0 / 1: one 4-warp group per CTA; 2: two, each a CTA of the plan
    pingpong: int = 0  # with groups=2: the groups take turns at the tensor pipe
    defer: int = 0  # P V of block j - 1 next to S of block j (the ping-pong's order, no turns)

    @classmethod
    def from_spec(cls, p: dict) -> PrefillMmaConfig:
        from ..abi.dtypes import to_dsl
        from ..families.base import spec_variant

        return cls(
            to_dsl(p["dtype"]),
            p["head_dim"],
            p["tile_q"],
            p["paged"],
            p["causal"],
            p["soft_cap"],
            p["window"],
            spec_variant(p),
            p.get("stages", 0),
            p.get("warps_m", 0),
            p.get("groups", 0),
            p.get("pingpong", 0),
            p.get("defer", 0),
        )


class PrefillMma(TurnTaking, KvLoads, PagedDecode):
    """The kernel: decode's load stream, fragments and epilogue pieces with a prefill main
    loop (see the module docstring)."""

    def __init__(self, cfg: PrefillMmaConfig):
        assert cfg.tile_q in TILES, cfg.tile_q
        # the deferred order waits for every load each block (V one block ahead): two stages
        stages = cfg.stages or (2 if cfg.pingpong or cfg.defer else STAGES[cfg.head_dim, cfg.tile_q])
        warps_m = cfg.warps_m or WARPS_M[cfg.tile_q]
        super().__init__(DecodeConfig(cfg.dtype, cfg.head_dim, stages, cfg.variant), cfg.tile_q, warps_m)
        self.pcfg = cfg
        self.paged = cfg.paged
        # Two groups of 4 warps per CTA: each runs the plan's work of one CTA (CTA 2 b + group)
        # with its own shared memory and barriers, so the two warps of an SMSP belong to one
        # CTA and can be scheduled against each other
        self.groups = cfg.groups or 1
        if self.groups != 1 and (self.groups != 2 or cfg.tile_q != 128):
            raise NotImplementedError(f"the portable prefill's groups={cfg.groups}: 2 at the 128-row tile only")
        # FA3's ping-pong on mma.sync: a turn {P V of block j - 1, S of block j} at the group's
        # turn barrier, the softmax of block j during the other group's turn
        self.pingpong = bool(cfg.pingpong)
        if self.pingpong and (self.groups != 2 or self.hooks.per_row):
            raise NotImplementedError("the portable prefill's ping-pong: groups=2, no per-row variant")
        # The ping-pong's block order without its turns: one basic block holds P V of block j - 1
        # and S of block j, so S's MMAs can be issued ahead of P V's and its results are in by
        # the softmax (the microbenchmark: 464 vs 413 TFLOP/s)
        self.deferred = self.pingpong or bool(cfg.defer)
        if self.deferred and (cfg.tile_q != 128 or self.hooks.per_row or stages != 2):
            raise NotImplementedError(
                "the portable prefill's deferred P V: the 128-row tile, 2 stages, no per-row variant"
            )
        self.causal, self.soft_cap, self.window = cfg.causal, cfg.soft_cap, cfg.window
        H = self.hooks
        if H.has_transform_k and self.keys_per_warp != 16:
            raise NotImplementedError(
                "the portable prefill transforms keys (RoPE) in-kernel with whole K fragments: 16-row tiles only"
            )
        self.m_tiles = self.warp_rows // 16
        assert self.m_tiles == 1 or self.warps_n <= 2, "32-row warps: one or two warps per row group"
        # The 128-row tile keeps no Q in registers (32 rows would take 64 more beside O's 128 and
        # S's 64): each k16 step of S reads its Q fragment from shared memory next to K's.  Its Q
        # tile (32 KB at head dim 128) has a single buffer, not one per stage, so two CTAs fit an
        # SM; it is loaded at the item's first block, once every warp is past the last item's.
        self.q_single = cfg.tile_q == 128
        if self.q_single:
            if cfg.head_dim not in TILE128_HEAD_DIMS:
                raise NotImplementedError(f"the portable prefill's 128-row tile at head dim {cfg.head_dim}")
            if H.has_transform_q:
                raise NotImplementedError("the portable prefill's 128-row tile reads Q from shared memory: no Q hook")
            self.q_bufs = 1
        # Head dim 256 reads Q per k16 step too (its Q buffer per stage outlives the item: the
        # cursor is fewer blocks ahead than there are buffers): a 16-row warp's whole Q fragment
        # is 64 registers beside O's 128, and sm_100a's build spilled inside the block loop
        self.q_per_step = self.q_single or (cfg.head_dim == 256 and not H.has_transform_q)
        # whole K / V fragments per block (decode) or one k16 step at a time next to its MMAs
        self.whole_frags = self.keys_per_warp == 16
        # the row maxima of the flag path (``_softmax``) are kept in raw q·k units (the scale
        # folds into the exponent's FFMA); the per-row variant path's (decode's) in base 2
        self.raw_max = not H.per_row

    # ---- host side ----------------------------------------------------------------------
    @cute.jit
    def host(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        sm_scale: Float32,
        soft_cap: Float32,
        window_left: Int32,
        num_ctas: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """The host function behind the generated entry: the prefill family's arguments (as the
        Hopper kernel's), then the variant's tensors and scalars as tuples."""
        sQ_layout, sKV_layout, Smem, tiled_mma = self._smem_and_mma()
        cap = soft_cap if soft_cap > Float32(0.0) else Float32(1.0)
        scale_log2 = sm_scale * LOG2E  # raw q·k -> base-2 logits
        if const_expr(self.soft_cap):
            scale_log2 = cap * LOG2E  # tanh values (units of cap) -> base-2 logits
        self.kernel(
            mQ,
            mK,
            mV,
            mKvIndptr,
            mKvIndices,
            mO,
            mLse,
            mWork,
            mWorkIndptr,
            mPartO,
            mPartLse,
            var_tensors,
            group,
            scale_log2,
            sm_scale,
            sm_scale / cap,
            window_left,
            num_ctas,
            var_scalars,
            sQ_layout,
            sKV_layout,
            tiled_mma,
            Smem,
        ).launch(
            grid=[(num_ctas + self.groups - 1) // self.groups, 1, 1], block=[THREADS * self.groups, 1, 1], stream=stream
        )

    # ---- device side --------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        var_tensors: tuple,
        group: Int32,
        scale_log2: Float32,
        sm_scale: Float32,
        inv_cap: Float32,
        window_left: Int32,
        num_ctas: Int32,
        var_scalars: tuple,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        # the split-KV merge (a programmatic dependent launch) waits for this grid before it
        # reads anything; its launch may overlap this kernel
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grp = None  # this thread's group (two groups: its storage, barriers and CTA of the plan)
        if const_expr(self.groups > 1):
            grp = cute.arch.make_warp_uniform(tidx // THREADS)
            tidx = tidx % THREADS
            cta = cta * self.groups + grp
        wid = tidx // 32
        lane = tidx % 32
        D, KW, WR, WN, TQ = self.head_dim, self.keys_per_warp, self.warp_rows, self.warps_n, self.tile_q
        H = self.hooks
        rg, kg = self._warp_place(wid)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        q_ptr, kv_ptr = st.sQ.data_ptr(), st.sKV.data_ptr()
        m_ptr, l_ptr = st.sM.data_ptr(), st.sL.data_ptr()
        if const_expr(self.groups > 1):  # the group's storage: group g's follows g - 1's
            q_ptr = q_ptr + cute.assume(grp * cute.cosize(sQ_layout), divby=512)
            kv_ptr = kv_ptr + cute.assume(grp * 2 * cute.cosize(sKV_layout), divby=512)
            m_ptr, l_ptr = m_ptr + grp * (NUM_WARPS * TQ), l_ptr + grp * (NUM_WARPS * TQ)
        sQ = cute.make_tensor(q_ptr, sQ_layout)
        sK = cute.make_tensor(kv_ptr, sKV_layout)
        sV = cute.make_tensor(kv_ptr + cute.cosize(sKV_layout), sKV_layout)
        sM = cute.make_tensor(m_ptr, cute.make_layout((TQ, WN), stride=(1, TQ)))
        sL = cute.make_tensor(l_ptr, cute.make_layout((TQ, WN), stride=(1, TQ)))

        thr_mma = tiled_mma.get_slice(lane)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.mma_dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.mma_dtype)
        s2r_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(lane)
        s2r_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(lane)
        s2r_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(lane)

        # this thread's accumulator coordinates: (tile row, key of the warp's KW) and (tile row, dim)
        idS, idO = cute.make_identity_tensor((WR, KW)), cute.make_identity_tensor((WR, D))
        if const_expr(self.warps_m > 1):
            idS, idO = cute.domain_offset((rg * WR, 0), idS), cute.domain_offset((rg * WR, 0), idO)
        tScS = mma_mn_view(thr_mma.partition_C(idS))
        tOcO = mma_mn_view(thr_mma.partition_C(idO))
        n_rows_thr = cute.size(tScS, mode=[0])
        tS0 = mma_mn_view(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((WR, KW))))
        col_off = tuple(tS0[0, c][1] - tS0[0, 0][1] for c in range(cute.size(tS0, mode=[1])))
        tc = TraceCtx(
            vargs=H.bind(var_tensors, var_scalars),
            sm_scale=sm_scale,
            col_off=col_off,
            inv_cap=inv_cap,
            group=group,
            window_left=window_left,
            scale_log2=scale_log2,
        )

        page_size = None
        if const_expr(self.paged):
            page_size = cute.FastDivmodDivisorV2(mK.shape[1])  # multiply-high + shift per gathered row
        rows = cute.make_rmem_tensor((self.n_lookups,), Int32)  # the cursor's next block's pages
        if const_expr(self.groups > 1):
            item_begin, item_end = self._items_of(mWorkIndptr, cta, num_ctas)
        else:
            item_begin, item_end = mWorkIndptr[cta], mWorkIndptr[cta + 1]
        gdiv = cute.FastDivmodDivisorV2(group)  # Q rows -> (token, head): multiply-high, no division
        k_turn = Int32(0)  # this group's turns so far
        t_other = Int32(0)  # the other group's turns in all
        if const_expr(self.pingpong):
            other = cta - 2 * grp + 1  # the other group's CTA of the plan
            t_other = self._turns(mWork, mWorkIndptr, other, num_ctas, group, gdiv, tc)
            if grp == 1:
                if t_other > 0:  # the first group's first turn
                    cute.arch.barrier_arrive(barrier_id=3, number_of_threads=2 * THREADS)
        ld = LoadStream(
            mQ, mK, mV, mWork, mKvIndptr, mKvIndices, sQ, sK, sV, rows, tidx, page_size, group, item_end, gdiv
        )
        # the load stream, as in decode: block t of the CTA's items goes to stage t % STAGES,
        # issued STAGES - 1 blocks ahead of the compute; an item's Q rides with its first block
        z = Int32(0)
        cur = self._cursor_next(ld, tc, LoadCursor(item_begin - 1, z, z, z, z, z, z, Int32(-1)))
        rows_v = None  # the deferred order: the pages of the block whose V is issued next
        if const_expr(self.deferred):  # K of the first block; its V comes with the next K
            rows_v = cute.make_rmem_tensor((self.n_lookups,), Int32)
            cur = self._cursor_issue_k(ld, tc, Int32(0), cur, rows_v)
            cute.arch.cp_async_commit_group()
        else:
            for s in cutlass.range_constexpr(self.stages - 1):
                cur = self._cursor_issue(ld, tc, s, cur)
        g = Int32(0)  # blocks computed so far
        q_cnt = Int32(0)  # items with blocks computed so far (selects the Q buffer)
        outs = Outputs(mO, mLse, mPartO, mPartLse)
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(mWork, item, group, gdiv)
            blk_start, blk_end = self._kv_blocks(info, tc)
            n_blocks = (blk_end - blk_start + self.block_n - 1) // self.block_n
            qb = q_cnt % self.q_bufs
            sQ_w = sQ[None, None, qb]
            if const_expr(self.warps_m > 1):
                sQ_w = cute.local_tile(sQ_w, (WR, D), (rg, 0))
            row_vals = None
            if const_expr(H.per_row):
                row_vals = item_row_values(H, info, tc, tScS, n_rows_thr, D)
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((WR, D)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_l = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            lim, lo = self._row_bounds(info, tScS, n_rows_thr, blk_end, tc)
            tSrQ = self._q_fragment(thr_mma, sQ_w)
            q_steps = None  # (shared Q, its fragment) where S reads Q one k16 step at a time
            if const_expr(self.q_per_step):
                q_steps = (s2r_q.partition_S(sQ_w), s2r_q.retile(tSrQ))
            n_plain = n_blocks  # blocks of the loop without turns
            if const_expr(self.deferred):
                n_plain = Int32(0)
                mma = (tiled_mma, thr_mma, s2r_k, s2r_v, (tSrQ, q_steps, s2r_q))
                blocks = (item, info, n_blocks, (blk_start, blk_end), g, kg)
                cur, k_turn = self._blocks_deferred(
                    (ld, rows_v),
                    tc,
                    cur,
                    blocks,
                    mma,
                    (sK, sV),
                    (acc_O, row_m, row_l),
                    (tScS, lim, lo),
                    (grp, k_turn, t_other),
                )
            for nb in cutlass.range(n_plain):
                cute.arch.cp_async_wait_group(self.stages - 2)
                self._sync(grp)
                if const_expr(self.q_single):
                    if nb == 0:  # the single Q buffer: the barrier above ended the last item's reads
                        PagedDecode._issue_q(self, ld, item, Int32(0))
                        cute.arch.cp_async_commit_group()
                elif const_expr(not self.q_per_step):
                    if nb == 0:
                        self._load_q(s2r_q, sQ_w, tSrQ, lane, sQ, qb)
                        if const_expr(H.has_transform_q):
                            self._transform_q(tSrQ, thr_mma, info, tc, self._row0(rg))
                cur = self._cursor_issue(ld, tc, (g + nb + self.stages - 1) % self.stages, cur)
                if const_expr(self.q_single):
                    if nb == 0:  # Q landed (the group before the block just issued), for every thread
                        cute.arch.cp_async_wait_group(1)
                        self._sync(grp)

                stage = (g + nb) % self.stages
                key0 = blk_start + nb * self.block_n + kg * KW
                sK_w = cute.local_tile(sK[None, None, stage], (KW, self.kv_width), (kg, 0))
                sV_w = cute.local_tile(sV[None, None, stage], (KW, self.kv_width), (kg, 0))
                acc_S = self._scores(tiled_mma, thr_mma, (s2r_k, sK_w), (tSrQ, q_steps, s2r_q), info, tc, key0)

                acc_S_mn = mma_mn_view(acc_S)
                acc_O_mn = mma_mn_view(acc_O)
                rP = cute.make_fragment_like(acc_S, self.mma_dtype)  # P, the second MMA's A
                if const_expr(H.per_row):  # a variant: its logits / masks on every block
                    for r in cutlass.range_constexpr(n_rows_thr):
                        m_blk = self._row_scores(acc_S_mn, r, tScS, key0, lim[r], row_vals[r], tc)
                        if const_expr(H.softmax):
                            self._online_row(acc_S_mn, acc_O_mn, r, m_blk, row_m, row_l)
                    rP.store(acc_S.load().to(self.mma_dtype))
                else:
                    self._flag_block(acc_S, rP, acc_O_mn, (row_m, row_l), (key0, tScS, lim, lo), tc)
                self._pv(tiled_mma, thr_mma, s2r_v, sV_w, rP, acc_O)

            if n_blocks > 0:
                q_cnt = q_cnt + 1
            g = g + n_blocks
            if const_expr(WN == 1):
                self._store_rows(outs, acc_O, row_m, row_l, tScS, tOcO, lane, info, tc)
            elif const_expr(self.m_tiles > 1):
                place = (rg, kg, lane, grp)
                self._merge_pair_store(outs, acc_O, row_m, row_l, (sM, sL), kv_ptr, g, place, tScS, tOcO, info, tc)
            else:
                # decode's epilogue: unscaled O rows into the stage of this item's last block
                # (``_o_buf``), the statistics into sM / sL, one barrier, the ⊕ of the warps_n
                # warps per row (``_store``).  With 2 row groups the other group read these rows
                # too: a barrier first.  No block at all: the previous item's store phase may
                # still read sM / sL and the buffers.
                if const_expr(self.warps_m > 1):
                    self._sync(grp)
                else:
                    if n_blocks == 0:
                        self._sync(grp)
                    else:
                        cute.arch.sync_warp()  # the warp's ldmatrix reads of these rows come before its writes
                o_stage = (g + self.stages - 1) % self.stages
                sO = self._o_buf(kv_ptr, o_stage, wid)
                acc_O_mn = mma_mn_view(acc_O)
                w_item = self._warp_weight(info)
                for r in cutlass.range_constexpr(n_rows_thr):
                    if const_expr(H.softmax):
                        row_l[r] = quad_sum(row_l[r])
                    else:  # summed weights: the state (0, w / warps_n) per warp, see ``_item_weight``
                        row_m[r] = Float32(0.0)
                        row_l[r] = w_item
                    j = tScS[r, 0][0]
                    if lane % 4 == 0:
                        sM[j, kg] = self._m_base2(row_m[r], tc)
                        sL[j, kg] = row_l[r]
                    if j < info.num_rows:  # rows past the tile's end are never stored
                        for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                            sO[j - self._row0(rg, 0), self._o_col(tOcO[0, c][1])] = acc_O_mn[r, c]
                self._sync(grp)
                self._store(outs, kv_ptr, o_stage, (sM, sL), tidx, info, tc)

    @cute.jit
    def _items_of(self, mWorkIndptr, cta, num_ctas):
        """The plan's items [begin, end) of CTA ``cta``, none past its last CTA (with two groups
        per CTA, an odd plan leaves the last CTA's second group idle)."""
        c = cutlass.min(cta, num_ctas)
        return mWorkIndptr[c], mWorkIndptr[cutlass.min(c + 1, num_ctas)]

    def _sync(self, grp):
        """The barrier of the thread's group: the CTA's, or named barrier 1 + group over its
        128 threads (the groups never wait for each other)."""
        if const_expr(self.groups > 1):
            cute.arch.barrier(barrier_id=1 + grp, number_of_threads=THREADS)
        else:
            cute.arch.sync_threads()

    # ---- the warp's place, the block: scores, masks, softmax, P V ------------------------------
    def _warp_place(self, wid):
        """(row group, key group) of warp ``wid``: tile rows [WR rg, WR rg + WR), keys
        [KW kg, KW kg + KW) of every block."""
        WN = self.warps_n
        if WN == NUM_WARPS:
            return 0, wid
        if WN == 1:
            return wid, 0
        return wid // WN, wid % WN

    def _row0(self, rg, none=None):
        """The tile row of row group ``rg``'s first row (``none`` for the single group)."""
        return none if self.warps_m == 1 else rg * self.warp_rows

    def _warp_weight(self, info: ItemInfo):
        """No softmax: each of the warps_n warps' state is (0, w / warps_n) (``_item_weight``)."""
        return None if self.hooks.softmax else self._item_weight(info) * (1.0 / self.warps_n)

    def _scores(self, tiled_mma, thr_mma, k_src, q_src, info: ItemInfo, tc: TraceCtx, key0):
        """S = Q K_wᵀ of the warp's rows and KW keys: the K fragment whole (16 keys: decode's
        path, with an in-kernel key transform) or one k16 step at a time next to its MMAs.
        ``k_src`` = (K's ldmatrix copy, the warp's K rows); ``q_src`` = (the Q fragment, None where
        it holds the item's Q, else (shared Q, fragment view) to read each k16 step, Q's copy)."""
        s2r_k, sK_w = k_src
        tSrQ, q_steps, s2r_q = q_src
        WR, KW = self.warp_rows, self.keys_per_warp
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((WR, KW)), Float32)
        acc_S.fill(0.0)
        if self.whole_frags:
            tSrK = self._load_k(thr_mma, s2r_k, sK_w)
            if self.hooks.has_transform_k:
                self._transform_k(tSrK, thr_mma, info, tc, key0)
        else:
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_w))
            src, dst = s2r_k.partition_S(sK_w), s2r_k.retile(tSrK)
        for k in range(cute.size(tSrK, mode=[2])):
            if q_steps is not None:
                cute.copy(s2r_q, q_steps[0][None, None, k], q_steps[1][None, None, k])
            if not self.whole_frags:
                cute.copy(s2r_k, src[None, None, k], dst[None, None, k])
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
        return acc_S

    def _pv(self, tiled_mma, thr_mma, s2r_v, sV_w, rP, acc_O):
        """O += P V_w: P = the block's weights in the MMA dtype, V_w the warp's KW rows seen as
        [D, KW] by the transposing ldmatrix (whole, or 16 keys at a time)."""
        tOrP = mma_acc_as_a(rP)
        if self.whole_frags:
            tOrV = self._load_v(thr_mma, s2r_v, sV_w)
        else:
            D, KW = self.head_dim, self.keys_per_warp
            sVt_w = cute.composition(sV_w, cute.make_layout((D, KW), stride=(KW, 1)))
            tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_w))
            src, dst = s2r_v.partition_S(sVt_w), s2r_v.retile(tOrV)
        for k in range(cute.size(tOrP, mode=[2])):
            if not self.whole_frags:
                cute.copy(s2r_v, src[None, None, k], dst[None, None, k])
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

    def _issue_q(self, ld: LoadStream, item: Int32, buf: Int32):
        """The load cursor's Q issue with an item's first block; the 128-row tile loads its Q at
        the item's first block instead (the kernel's loop)."""
        if not self.q_single:
            PagedDecode._issue_q(self, ld, item, buf)

    def _row_bounds(self, info: ItemInfo, tScS, n_rows: int, blk_end, tc: TraceCtx):
        """Per accumulator row: the key limit (the item's end; causal: min(end, q_pos + 1)) and,
        with a window, the lowest visible key (q_pos - window_left; else ``lim`` itself, unread).
        Once per item."""
        lim = cute.make_rmem_tensor((n_rows,), Int32)
        lo = cute.make_rmem_tensor((n_rows,), Int32) if self.window else lim
        for r in range(n_rows):
            lim[r] = blk_end
            if self.causal or self.window:
                q_pos = info.qpos_base + row_token(info, info.row_start + tScS[r, 0][0])
                if self.causal:
                    lim[r] = cutlass.min(blk_end, q_pos + 1)
                if self.window:
                    lo[r] = q_pos - tc.window_left
        return lim, lo

    def _cut(self, key0, lim, lo, n_rows: int):
        """Whether some bound cuts the warp's keys [key0, key0 + KW) of this block for some of
        its rows (a warp vote: the branch it picks is warp-uniform)."""
        cut = key0 + self.keys_per_warp > lim[0]
        for r in range(1, n_rows):
            cut = cut | (key0 + self.keys_per_warp > lim[r])
        if self.window:
            for r in range(n_rows):
                cut = cut | (key0 < lo[r])
        return cute.arch.vote_any_sync(cut)

    @cute.jit
    def _flag_block(self, acc_S, rP, acc_O_mn, stats, blk, tc: TraceCtx):
        """The flag path's block after S: the softmax (its masks only where a bound cuts the
        warp's keys), P into ``rP``, O's lazy rescale.  ``stats`` = (row max, row sum)."""
        row_m, row_l = stats
        key0, tScS, lim, lo = blk
        n_rows = cute.size(tScS, mode=[0])
        out = (rP, cute.make_rmem_tensor((n_rows,), Float32))
        if self._cut(key0, lim, lo, n_rows):
            self._softmax(acc_S, out, row_m, row_l, blk, tc, True)
        else:
            self._softmax(acc_S, out, row_m, row_l, blk, tc, False)
        lazy_rescale(acc_O_mn, out[1])

    def _softmax(self, acc_S, out, row_m, row_l, blk, tc: TraceCtx, masked: bool):
        """The flag path's online softmax of a block: the soft-cap's tanh (in units of cap), the
        static masks where ``masked`` (``blk`` = (key0, tScS, lim, lo)), each row's max in raw
        units -- kept while the block's exceeds it by at most LAZY_RESCALE in base 2, so most
        blocks leave O alone (``fragments.lazy_rescale``) -- and the weights 2^(s·scale - m·scale), one FFMA
        and one ex2 per score.  Max and sum in 4 partial chains (shorter dependencies).
        ``out`` = (P in the MMA dtype, each row's O correction).  P is packed here, before the
        caller's rescale of O, so the weights do not cross that branch as fp32 (64 registers
        per thread at the 128-row tile)."""
        key0, tScS, lim, lo = blk
        rP, corr = out
        acc_S_mn = mma_mn_view(acc_S)
        scale = tc.scale_log2
        n_rows, n_cols = cute.size(acc_S_mn, mode=[0]), cute.size(acc_S_mn, mode=[1])
        for r in range(n_rows):
            part = [Float32(-Float32.inf)] * 4
            for c in range(n_cols):
                v = acc_S_mn[r, c]
                if self.soft_cap:
                    v = cute.math.tanh(v * tc.inv_cap, fastmath=True)
                if masked:
                    kv_pos = key0 + tScS[0, c][1]
                    ok = kv_pos < lim[r]
                    if self.window:
                        ok = ok & (kv_pos >= lo[r])
                    v = cutlass.select_(ok, v, -Float32.inf)
                acc_S_mn[r, c] = v
                part[c % 4] = cute.arch.fmax(part[c % 4], v)
            m_blk = quad_max(cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3])))
            m_old = row_m[r]
            m_new = cute.arch.fmax(m_old, m_blk)
            # (both -inf: NaN <= x is false, m_new stays -inf)
            m_new = cutlass.select_((m_blk - m_old) * scale <= Float32(LAZY_RESCALE), m_old, m_new)
            m_use = cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new)  # a row that saw nothing yet
            m_scaled = m_use * scale
            corr[r] = cute.math.exp2((m_old - m_use) * scale, fastmath=True)  # exactly 1 where the max was kept
            psum = [Float32(0.0)] * 4
            for c in range(n_cols):
                p = cute.math.exp2(acc_S_mn[r, c] * scale - m_scaled, fastmath=True)
                acc_S_mn[r, c] = p
                psum[c % 4] = psum[c % 4] + p
            row_l[r] = row_l[r] * corr[r] + ((psum[0] + psum[1]) + (psum[2] + psum[3]))
            row_m[r] = m_new
        rP.store(acc_S.load().to(self.mma_dtype))

    def _m_base2(self, m, tc: TraceCtx):
        """A row max as the epilogue and the ⊕ want it: base 2 (the flag path keeps raw units)."""
        return m * tc.scale_log2 if self.raw_max else m

    # the static flags in decode's per-row variant path (``_row_scores``)
    def _logit(self, s, tc: TraceCtx):
        if self.soft_cap:
            return cute.math.tanh(s * tc.inv_cap, fastmath=True) * tc.scale_log2
        return s * tc.scale_log2

    def _cap_logit(self, v, tc: TraceCtx):
        """Soft-cap after a logits hook (a bias such as ALiBi's is capped with q·k, as the Hopper
        kernel's seeded bias): cap · tanh(v / cap), cap = sm_scale / inv_cap."""
        if self.soft_cap:
            return (tc.sm_scale / tc.inv_cap) * cute.math.tanh(v * (tc.inv_cap / tc.sm_scale), fastmath=True)
        return v

    def _flag_ok(self, ok, kv_pos, rctx, tc: TraceCtx):
        """The window's lower bound (causal is in the row limit ``_row_scores`` gets)."""
        if self.window:
            return ok & (kv_pos >= rctx.q_pos - tc.window_left)
        return ok

    def _kv_blocks(self, info: ItemInfo, tc: TraceCtx):
        """The item's KV range (a variant's kv_range clips it, as in decode); with a window the
        keys left of what the tile's first row may see are not read at all."""
        start, end = PagedDecode._kv_blocks(self, info, tc)
        if self.window:
            lo = info.qpos_base + info.row_start // info.group - tc.window_left
            start = cutlass.select_(lo > start, lo, start)
            start = cutlass.select_(start < end, start, end)
        return start, end

    def _item_weight(self, info: ItemInfo):
        """A variant without softmax: the item's share of its tile's kv extent (causal tiles end
        at their last row's diagonal, as the planner cuts them), so the ⊕ of the split items'
        states (o / w, log2 w) returns the sum of the weighted values."""
        ext = info.kv_len
        if self.causal:
            last_tok = (info.row_start + info.num_rows - 1) // info.group
            ext = cutlass.min(info.kv_len - info.qo_len + last_tok + 1, info.kv_len)
        ext_f = Int32(cutlass.select_(ext > 0, ext, Int32(1))).to(Float32)
        return cutlass.select_(ext > 0, Int32(info.kv_end - info.kv_start).to(Float32) / ext_f, Float32(0.0))

    # ---- epilogue of a 64-row tile: one warp per row group, straight from registers ------------
    @cute.jit
    def _store_rows(self, outs: Outputs, acc_O, row_m, row_l, tScS, tOcO, lane, info: ItemInfo, tc: TraceCtx):
        """Normalize this thread's rows (the variant's ``finalize`` / ``output``; no softmax:
        the state (0, w), ``_item_weight``) and store them: final rows in the value dtype with
        their LSE, or a partial slot (fp32), two columns per store.  The row group's whole
        state is in this warp (one warp per group, or ``_merge_pair_store`` merged it)."""
        mO, mLse, mPartO, mPartLse = outs
        H = self.hooks
        O = mma_mn_view(acc_O)
        w_item = self._item_weight(info) if const_expr(not H.softmax) else None
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            j = tScS[r, 0][0]
            m, l = self._row_state(row_m, row_l, r, w_item, tc)
            fac = Float32(1.0)  # 2^(m - m') when finalize moves the max to m'
            if const_expr(H.has_finalize):
                m_use = m if m != -Float32.inf else Float32(0.0)
                m, l = self._finalize(m, l, info, info.row_start + j, tc)
                m2 = m if m != -Float32.inf else Float32(0.0)
                fac = cute.math.exp2(m_use - m2, fastmath=True)
            inv = Float32(0.0)
            lse = -Float32.inf
            if l > Float32(0.0):
                inv = cute.arch.rcp_approx(l) * fac
                lse = m + cute.math.log2(l, fastmath=True)
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                O[r, c] = O[r, c] * inv
            if j < info.num_rows:
                if info.dest < 0:
                    tok, head = tok_head(info, info.row_start + j)
                    if const_expr(H.has_output):
                        o4 = cute.make_rmem_tensor((cute.size(O, mode=[1]),), Float32)
                        for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                            o4[c] = O[r, c]
                        self._output_cols(o4, tOcO, info, info.row_start + j, tc)
                        for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                            O[r, c] = o4[c]
                    for c in cutlass.range_constexpr(0, cute.size(O, mode=[1]), 2):
                        pair = cute.make_rmem_tensor((2,), mO.element_type)
                        pair[0] = O[r, c].to(mO.element_type)
                        pair[1] = O[r, c + 1].to(mO.element_type)
                        cute.autovec_copy(pair, cute.local_tile(mO[tok, head, None], (2,), (tOcO[0, c][1] // 2,)))
                    if lane % 4 == 0:
                        mLse[tok, head] = lse
                else:
                    slot_row = info.dest * self.tile_q + j
                    for c in cutlass.range_constexpr(0, cute.size(O, mode=[1]), 2):
                        pair = cute.make_rmem_tensor((2,), Float32)
                        pair[0] = O[r, c]
                        pair[1] = O[r, c + 1]
                        cute.autovec_copy(pair, cute.local_tile(mPartO[slot_row, None], (2,), (tOcO[0, c][1] // 2,)))
                    if lane % 4 == 0:
                        mPartLse[slot_row] = lse

    def _row_state(self, row_m, row_l, r, w_item, tc: TraceCtx):
        """(m, l) of accumulator row r: the softmax's running max (base 2) and its sum over the
        quad, or the state (0, w) of summed weights."""
        if self.hooks.softmax:
            return self._m_base2(row_m[r], tc), quad_sum(row_l[r])
        return Float32(0.0), w_item

    @cute.jit
    def _merge_pair_store(self, outs, acc_O, row_m, row_l, stats, kv_ptr, g, place, tScS, tOcO, info, tc):
        """Two warps per row group with 32 rows each (``warps_m`` = 2 at tile 64): the second
        warp of a group leaves its O fragment in the stage of the item's last block (the K part
        for group 0, the V part for group 1: D fp32 per lane, 16-byte vectors, conflict-free)
        and its row statistics in sM / sL; the first warp ⊕-merges them into its own fragment,
        register by register (the two warps' fragments have the same layout), and stores
        (``_store_rows``).  Two barriers: every warp done with the stage's K / V rows, then the
        exchange complete.  The next block into that stage is issued after the next item's
        first barrier, which the first warps reach after their reads."""
        sM, sL = stats
        rg, kg, lane, grp = place
        H = self.hooks
        D = self.head_dim
        self._sync(grp)
        xb = self._xbuf(kv_ptr, (g + self.stages - 1) % self.stages, rg, lane)
        flat = cute.make_layout((4, D // 4))  # a fragment's registers in order: 16-byte vectors
        if kg == 1:
            cute.autovec_copy(cute.make_tensor(acc_O.iterator, flat), xb)
            for r in cutlass.range_constexpr(cute.size(row_m)):
                j = tScS[r, 0][0]
                l_sum = quad_sum(row_l[r])
                if lane % 4 == 0:
                    sM[j, 1] = row_m[r]
                    sL[j, 1] = l_sum
        self._sync(grp)
        if kg == 0:
            other = cute.make_rmem_tensor(acc_O.layout, Float32)
            cute.autovec_copy(xb, cute.make_tensor(other.iterator, flat))
            O, P = mma_mn_view(acc_O), mma_mn_view(other)
            sc = tc.scale_log2 if const_expr(self.raw_max) else Float32(1.0)
            for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
                a, b = Float32(1.0), Float32(1.0)  # summed weights (no softmax) just add
                if const_expr(H.softmax):
                    j = tScS[r, 0][0]
                    m0, m1 = row_m[r], sM[j, 1]
                    mn = cute.arch.fmax(m0, m1)
                    mu = cutlass.select_(mn == -Float32.inf, Float32(0.0), mn)
                    a = cute.math.exp2((m0 - mu) * sc, fastmath=True)
                    b = cute.math.exp2((m1 - mu) * sc, fastmath=True)
                    row_l[r] = row_l[r] * a + sL[j, 1] * b * 0.25  # a per-thread quarter: _store_rows sums the quad
                    row_m[r] = mn
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    O[r, c] = O[r, c] * a + P[r, c] * b
            self._store_rows(outs, acc_O, row_m, row_l, tScS, tOcO, lane, info, tc)

    def _xbuf(self, kv_ptr, stage, rg, lane):
        """Row group ``rg``'s exchange buffer (``_merge_pair_store``): the K (rg 0) or V (rg 1)
        part of ``stage``, this lane's D fp32 as 16-byte vectors 512 bytes apart (D x 32 x 4
        bytes: exactly the part)."""
        base = kv_ptr + (rg * self.stages + stage) * (self.block_n * self.kv_width)
        addr = cute.recast_ptr(base, dtype=Float32).toint() + lane * 16
        ptr = cute.make_ptr(Float32, addr, cute.AddressSpace.smem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout((4, self.head_dim // 4), stride=(1, 128)))

    def _output_cols(self, o, tOcO, info: ItemInfo, row, tc: TraceCtx):
        """The variant's ``output`` on this thread's columns of one row."""
        ctx = self._ctx(info, row, tc)
        for c in range(cute.size(o)):
            o[c] = self.hooks.output(ctx, tc.vargs, o[c], tOcO[0, c][1])


def build_batch_prefill_mma(spec):
    """The jit entry for a ``batch_prefill_mma`` spec (the variant re-created from the spec's
    text and checked against its fingerprint)."""
    from ..families.prefill import prefill_abi_fixed
    from ..families.prefill_mma import WIDE_HEAD_DIMS, WIDE_STAGES
    from ..variants.base import abi_args
    from .decode_wide import WideDecode

    cfg = PrefillMmaConfig.from_spec(spec.pdict)
    if cfg.head_dim in WIDE_HEAD_DIMS:  # rows too wide for this kernel's warps (kernels/decode_wide.py)
        wide = WideDecode.for_prefill(cfg, cfg.stages or WIDE_STAGES[cfg.tile_q])
        return make_entry(wide, prefill_abi_fixed(spec.pdict), abi_args(None), host="host_prefill")
    return make_entry(PrefillMma(cfg), prefill_abi_fixed(spec.pdict), abi_args(cfg.variant))


assert BLOCK_N == 64  # the epilogue's buffers and STAGES assume decode's 64-token blocks
