"""Persistent paged-KV decode attention (CuTe DSL), executing the scheduler's work items.

One CTA = 4 warps; the grid is the plan's ``num_ctas``; CTA c runs work items
``work_indptr[c] .. work_indptr[c+1]`` (contract: ``cute_attn/sched/__init__.py``).  An item is
one tile of TILE_Q packed query rows (GQA packing: row r of kv head h is query token
r // group of qo head h*group + r % group, so one KV read serves the whole group) against a
token range of one request's paged KV.

Per KV block of BLOCK_N tokens:
- every thread gathers 16-byte chunks of K and V rows with ``cp.async`` into a swizzled shared
  tile, looking each token's page up in ``kv_indices`` (any page size, 1 included: sparse
  load, dense compute), STAGES blocks in flight.  The loads are one stream over the CTA's
  items: a load cursor issues block after block STAGES-1 ahead of the compute and moves to the
  next item as soon as one is exhausted, so the pipeline never drains at item boundaries;
- warp w owns keys [16w, 16w+16) of the block: S = Q Kᵀ and O += P V on tensor cores
  (``mma.sync`` m16n8k16, fragments via ``ldmatrix``), with its own online-softmax state;
- the four warp states are ⊕-merged through shared memory at the end of the item (one
  barrier), and the result goes to the final output (bf16/fp16 + LSE) or to a partial slot
  (fp32) for the merge kernel.

Head packing (``heads_per_item`` = H in 2, 4; softmax variants without query/key transforms,
``Hooks.packs_heads``): an item covers H consecutive kv heads of one request, its tile the
H x group packed rows of their query heads (the plan's group is group x H, so the row ->
(token, qo head) rule is unchanged).  A block then holds BLOCK_N / H tokens of each of the H
heads; warp w reads head w // (4 / H) and masks the tile's rows of the other heads (they stay
m = -inf, l = 0 and drop out of the ⊕); each row's hook context carries its own kv head.  A
variant's ``kv_range`` still clips the item's blocks by its first and last rows, which assumes
the bounds depend on the query position, not the head.  The MMA work per KV byte is the same
(an unpacked GQA-4 tile uses 4 of its 16 rows); what changes is H times fewer items, hence
item boundaries (epilogue barrier + store, record and Q loads): packing takes batch 256 x 1k
from 4.10 to 4.18 TB/s (BENCHMARKS.md).  The wrapper packs where items stay plentiful and
whole (``decode.MIN_PACKED_ITEMS_PER_CTA``).

Scores are kept in base 2 (scaled by sm_scale·log2 e), so LSE comes out in base 2 as
FlashInfer returns it.  Variants (``cute_attn/variants``, docs/variants.md) are traced in:
``transform_q`` on the Q fragment once per item, ``transform_k`` on each warp's K fragment
after ``ldmatrix`` (both in registers, no extra barrier), ``logits``/``mask``/``kv_range`` per
score element (a ``kv_range`` also clips the item's KV blocks: sliding windows read only the
window), ``finalize`` on each row's merged statistics, ``output`` in the store; a variant
without softmax (FlashSigmoid) accumulates its weights directly.  With no variant the kernel
is the plain fast path (no hook code is traced).  Soft-cap and the sliding window are
built-in variants.  Uses no Hopper-only instruction, so it also compiles for sm_100a.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from ..variants.base import Ctx, Hooks
from ..variants.dsl import LOG2E
from ..variants.trace import transform_fragment
from . import row_tiles
from .bitmask import bit_set, row_words
from .copy import cp_async_16
from .fragments import mma_acc_as_a, mma_mn_view, quad_max, quad_sum
from .pages import in_cache
from .work import ItemInfo, TraceCtx, item_row_values, row_ctx, tok_head

TILE_Q = 16  # packed query rows per work item (one m16 MMA tile)
BLOCK_N = 64  # KV tokens per pipeline stage of a 16-bit cache: 4 warps x 16 keys
NUM_WARPS = 4
THREADS = 32 * NUM_WARPS


@dataclass(frozen=True)
class DecodeConfig:
    """What a ``paged_decode`` specialization fixes: value dtype (DSL type), head dim, pipeline
    stages, the variant (or None) and the kv heads per work item."""

    dtype: Any
    head_dim: int
    stages: int
    variant: Any = None
    heads_per_item: int = 1
    kv_dtype: Any = None  # the cache's DSL type where it differs from ``dtype`` (fp8)
    block_n: Any = None  # KV rows per stage of a 16-bit cache (None: BLOCK_N)
    tile_q: int = TILE_Q  # packed rows per item: 32 = two row groups of 16, one kv head per warp

    @classmethod
    def from_spec(cls, p: dict) -> DecodeConfig:
        from ..abi.dtypes import to_dsl
        from ..families.base import spec_variant

        kv = to_dsl(p["kv_dtype"]) if "kv_dtype" in p else None
        hpi, bn, tq = p.get("heads_per_item", 1), p.get("block_n"), p.get("tile_q", TILE_Q)
        return cls(to_dsl(p["dtype"]), p["head_dim"], p["stages"], spec_variant(p), hpi, kv, bn, tq)


class Outputs(NamedTuple):
    """Where an item's rows go: final rows and their LSE, or fp32 partial slots."""

    mO: Any
    mLse: Any
    mPartO: Any
    mPartLse: Any


@dataclass(frozen=True)
class LoadStream:
    """What the load cursor reads and writes, fixed for the CTA (made before the item loop and
    only read in it): the global tensors, the shared Q / K / V stages, the page lookups of the
    cursor's next block (``rows``), this thread, the page-size divisor and the work list."""

    mQ: Any
    mK: Any
    mV: Any
    mWork: Any
    mKvIndptr: Any
    mKvIndices: Any
    sQ: Any
    sK: Any
    sV: Any
    rows: Any
    tidx: Any
    page_size: Any
    group: Any
    item_end: Any
    group_div: Any = None  # the group as a FastDivmodDivisorV2 (Q rows -> token, head), or None


class LoadCursor:
    """The load cursor's state: the item it is in, its next block ``nb`` of ``n``, the item's key
    range [start, end), page_base and kv head, and ``q`` = the index of the item among the
    items with blocks (selects the Q buffer).  Carried through the kernel's loops as eight
    Int32 values in this order (``__extract_mlir_values__``): the kernel's loops and the
    runtime ``if`` of ``_cursor_issue`` carry it as it is; the while loop of ``_cursor_next``
    wants another order and unpacks it."""

    FIELDS = ("item", "nb", "n", "start", "end", "base", "head", "q")

    def __init__(self, item, nb, n, start, end, base, head, q):
        self.item, self.nb, self.n, self.start = item, nb, n, start
        self.end, self.base, self.head, self.q = end, base, head, q

    def next_block(self):
        """The cursor one block further in its item."""
        return LoadCursor(self.item, self.nb + 1, self.n, self.start, self.end, self.base, self.head, self.q)

    def astuple(self):
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __extract_mlir_values__(self):
        return [v for f in self.FIELDS for v in cutlass.extract_mlir_values(getattr(self, f))]

    def __new_from_mlir_values__(self, values):
        return LoadCursor(*[cutlass.new_from_mlir_values(getattr(self, f), [v]) for f, v in zip(self.FIELDS, values)])


class PagedDecode:
    """The kernel of a 16-bit cache; ``decode_fp8.PagedDecodeFp8`` overrides how K, V and Q
    reach the MMA fragments (and the geometry attributes set here) for an fp8 cache."""

    # The shared-memory geometry of a KV stage, as 16-bit elements: ``kv_width`` per row,
    # ``block_n`` rows (tokens), ``keys_per_warp`` of them per warp.  An fp8 cache stores its
    # rows as D / 2 16-bit pairs and twice the tokens, so a stage holds the same bytes.
    kv_bytes = 2
    block_n = BLOCK_N

    def __init__(self, cfg: DecodeConfig, tile_q: int = TILE_Q, warps_m: int = 1):
        """``tile_q`` / ``warps_m``: the query tile and its warp grid (the portable prefill,
        ``prefill_mma.py``): warps_m groups of 16 x m_tiles rows, each split over warps_n =
        4 / warps_m warps by keys.  Decode: one 16-row tile, 4 warps by keys."""
        dtype, head_dim, stages, heads_per_item = cfg.dtype, cfg.head_dim, cfg.stages, cfg.heads_per_item
        self.cfg = cfg
        if cfg.block_n is not None:
            assert self.kv_bytes == 2 and cfg.block_n in (64, 128), cfg.block_n
            self.block_n = cfg.block_n
        self.dtype = dtype
        self.mma_dtype = dtype  # the MMA's A / B type
        self.head_dim = head_dim
        self.stages = stages
        self.q_bufs = stages  # Q tiles in shared memory: one per stage (the portable prefill's 128-row tile: 1)
        self.groups = 1  # independent 4-warp groups per CTA, each with its own storage (prefill_mma)
        self.hooks = Hooks(cfg.variant)
        self.kv_width = head_dim * self.kv_bytes // 2
        self.tile_q = tile_q
        self.warps_m = warps_m
        self.warps_n = NUM_WARPS // warps_m
        self.warp_rows = tile_q // warps_m  # a warp's query rows: 16 x m_tiles
        assert warps_m in (1, 2, 4) and self.warp_rows % 16 == 0, (tile_q, warps_m)
        self.keys_per_warp = self.block_n // self.warps_n
        # Packed decode with two row groups (tile_q 32, ``heads_per_item`` 4 at GQA 8): the warps
        # of a row group split it by kv head, not by keys -- warp w reads kv head w of the item
        # (its block rows [w tpb, (w+1) tpb)) and the Q rows [16 (w // warps_n), +16) that hold
        # its head's 8 rows (the wrapper packs so only where each head's rows lie in one group).
        self.head_split = heads_per_item > 1 and warps_m > 1
        if self.head_split:
            self.keys_per_warp = self.block_n // NUM_WARPS
            assert heads_per_item == NUM_WARPS and warps_m == 2, (heads_per_item, warps_m)
        self.o_region = self.block_n // NUM_WARPS  # K / V rows per warp of the epilogue's buffers
        self.q_chunks = head_dim // 8  # 16-byte chunks per Q row
        self.chunks = self.kv_width // 8  # 16-byte chunks per KV row
        # thread t gathers chunk t % gw (+ gw a, a < col_groups) of rows t // gw + row_step i: gw = a
        # whole row, or one atom row where THREADS is no multiple of a row (192 B: hd96; 160 B: hd80)
        self.gather_w = self.chunks if THREADS % self.chunks == 0 else self._atom_w(self.kv_width) // 8
        self.col_groups = self.chunks // self.gather_w
        self.rows_per_thread = self.block_n * self.gather_w // THREADS  # KV rows each thread gathers per block
        self.row_step = THREADS // self.gather_w  # a thread's gathered rows are row_step apart
        assert THREADS % self.gather_w == 0 and self.chunks % self.gather_w == 0, head_dim
        assert self.keys_per_warp % 16 == 0 and stages >= 2
        # Head packing (``heads_per_item`` = H kv heads per item, module doc): a block holds
        # BLOCK_N // H tokens of each of the H heads, head-major; warp w reads head w // (4 // H).
        # A thread's rows then repeat the same tokens for each head: one page lookup serves H rows.
        assert heads_per_item in (1, 2, 4), heads_per_item
        assert heads_per_item == 1 or self.hooks.packs_heads, (
            "head packing needs a softmax variant without query/key transforms (Hooks.packs_heads)"
        )
        self.hpi = heads_per_item
        self.tpb = self.block_n // heads_per_item  # tokens of each head per block
        self.warps_per_head = NUM_WARPS // heads_per_item
        self.n_lookups = self.tpb // self.row_step  # distinct tokens among a thread's rows of a block
        # a page lookup per row, its head and token from the row, where a head's tokens per block
        # are fewer than a thread's row step (hd80 with packed heads)
        self.slot_lookups = self.tpb < self.row_step
        if self.slot_lookups:
            self.n_lookups = self.rows_per_thread
        assert self.slot_lookups or self.n_lookups * self.row_step == self.tpb, (head_dim, heads_per_item)
        # the epilogue gives each warp an fp32 [warp_rows, D] buffer in the K and V rows it reads
        # (``_o_buf``: pieces of rows_per_piece fp32 rows per atom column, K then V; where a row
        # does not divide a piece, head dims 80 / 96, pieces of o_cols_per_piece columns of 16 rows)
        piece = self.o_region * self._atom_w(self.kv_width) * 2
        halves, fits = self.kv_width // self._atom_w(self.kv_width), piece % (head_dim * 4) == 0
        self.o_rows_per_piece = piece // (head_dim * 4) if fits else 16
        self.o_cols_per_piece = cpp = None if fits else piece // (16 * 4)
        assert head_dim % 64 == 0 if fits else cpp % 4 == 0 and head_dim in (cpp * halves, 2 * cpp * halves), head_dim
        assert self.warps_n == 1 or self.warp_rows > 16 or (self.o_rows_per_piece * halves * 2 >= self.warp_rows), (
            f"the epilogue's buffers (_o_buf) do not tile head_dim {head_dim}"
        )

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
        num_ctas: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """The host function behind the generated entry (``variants.trace.make_entry``): the
        family's arguments, then the variant's tensors and scalars as tuples."""
        sQ_layout, sKV_layout, Smem, tiled_mma = self._smem_and_mma()
        scale_log2 = sm_scale * LOG2E
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
            var_scalars,
            sQ_layout,
            sKV_layout,
            tiled_mma,
            Smem,
        ).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    def _smem_and_mma(self):
        """Host side: the Q and K / V stage layouts, the shared-memory struct and the
        one-warp m16n8k16 MMA (a warp's 16 x m_tiles rows are its M modes)."""
        D = self.head_dim
        # q_bufs Q tiles (a Q tile per stage)
        sQ_layout = cute.tile_to_shape(self._swizzle_atom(D), (self.tile_q, D, self.q_bufs), (0, 1, 2))
        sKV_layout = cute.tile_to_shape(
            self._swizzle_atom(self.kv_width), (self.block_n, self.kv_width, self.stages), (0, 1, 2)
        )
        self._check_smem_off(sQ_layout, self.tile_q, D)
        self._check_smem_off(sKV_layout, self.block_n, self.kv_width)

        G = self.groups  # each group's Q, K / V and statistics follow the previous group's
        fields = {
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, G * cute.cosize(sQ_layout)], 1024],
            # K stages then V stages; the epilogue's fp32 O buffers live in the stage of the
            # item's last block (``_o_buf``), so two CTAs fit an SM at head_dim <= 128
            "sKV": cute.struct.Align[cute.struct.MemRange[self.mma_dtype, G * 2 * cute.cosize(sKV_layout)], 1024],
            "sM": cute.struct.MemRange[Float32, G * NUM_WARPS * self.tile_q],
            "sL": cute.struct.MemRange[Float32, G * NUM_WARPS * self.tile_q],
        }
        # (a class statement here would see string annotations: ``from __future__ import annotations``)
        Smem = cute.struct(type("Smem", (), {"__annotations__": fields}))
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.mma_dtype, Float32, (16, 8, 16)), (1, 1, 1), permutation_mnk=(16, 16, 16)
        )
        return sQ_layout, sKV_layout, Smem, tiled_mma

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
        var_scalars: tuple,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        # the merge kernel (launched after this one as a programmatic dependent) may start now:
        # its launch overlaps this kernel, and it waits for this grid before reading anything
        cute.arch.griddepcontrol_launch_dependents()
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
        # sM[j, k]: tile row j's statistics from the k-th warp of its row group (``_store``)
        TQ, WN = self.tile_q, self.warps_n
        sM = st.sM.get_tensor(cute.make_layout((TQ, WN), stride=(1, TQ)))
        sL = st.sL.get_tensor(cute.make_layout((TQ, WN), stride=(1, TQ)))
        # head-split warps (``head_split``): the tile row of this warp's first row
        rg0 = None
        if const_expr(self.head_split):
            rg0 = (wid // WN) * 16

        thr_mma = tiled_mma.get_slice(lane)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.mma_dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.mma_dtype)
        s2r_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(lane)
        s2r_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(lane)
        s2r_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(lane)

        # Row/column coordinates of this thread's accumulator elements (MMA C layout).
        KW = self.keys_per_warp
        tScS = mma_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_Q, KW))))
        tOcO = mma_mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_Q, D))))
        n_rows_thr = cute.size(tScS, mode=[0])
        tS0 = mma_mn_view(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_Q, KW))))
        col_off = tuple(tS0[0, c][1] - tS0[0, 0][1] for c in range(cute.size(tS0, mode=[1])))
        tc = TraceCtx(vargs=self.hooks.bind(var_tensors, var_scalars), sm_scale=sm_scale, col_off=col_off)

        # p // page_size and p % page_size by multiply-high and shift (a runtime integer
        # division is ~25 instructions, and every gathered row needs one)
        page_size = cute.FastDivmodDivisorV2(mK.shape[1])
        rows = cute.make_rmem_tensor((self.n_lookups,), Int32)  # the pages of the cursor's next block's rows
        item_begin, item_end = mWorkIndptr[cta], mWorkIndptr[cta + 1]
        ld = LoadStream(mQ, mK, mV, mWork, mKvIndptr, mKvIndices, sQ, sK, sV, rows, tidx, page_size, group, item_end)
        # The loads run as one stream over this CTA's items: a load cursor issues the blocks of
        # item after item, STAGES-1 blocks ahead of the compute, into a stage ring that does not
        # restart at item boundaries (block t of the stream goes to stage t % STAGES).  One
        # cp.async group per block, one block issued per computed block: the wait for block t
        # is always "all but the STAGES-2 newest groups".  Q rides in the group of its item's
        # first block, in one of STAGES Q buffers (by count of items with blocks: the cursor is
        # at most STAGES-1 such items ahead).
        z = Int32(0)
        cur = self._cursor_next(ld, tc, LoadCursor(item_begin - 1, z, z, z, z, z, z, Int32(-1)))
        for s in cutlass.range_constexpr(self.stages - 1):
            cur = self._cursor_issue(ld, tc, s, cur)
        g = Int32(0)  # blocks computed so far (the stream position of this item's block 0)
        q_cnt = Int32(0)  # items with blocks computed so far (selects the Q buffer)
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(mWork, item, group)
            blk_start, blk_end = self._kv_blocks(info, tc)
            n_blocks = (blk_end - blk_start + self.tpb - 1) // self.tpb
            sQ_i = sQ[None, None, q_cnt % self.stages]
            if const_expr(self.head_split):
                sQ_i = cute.local_tile(sQ_i, (16, D), (wid // WN, 0))  # 16 rows: two 8-row atoms
            row_vals = None
            if const_expr(self.hooks.per_row):
                row_vals = self._row_values(info, tc, tScS, n_rows_thr, rg0)

            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_Q, D)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_l = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            # key bound per accumulator row: with head packing, a row whose kv head is not the
            # warp's gets bound blk_start (every score masked: it stays m = -inf, l = 0, O = 0)
            row_lim = cute.make_rmem_tensor((n_rows_thr,), Int32)
            for r in cutlass.range_constexpr(n_rows_thr):
                row_lim[r] = blk_end
                if const_expr(self.hpi > 1):
                    row = info.row_start + tScS[r, 0][0]
                    if const_expr(self.head_split):
                        row = row + rg0
                    u = row % group  # index among the token's packed rows
                    own = u // (group // self.hpi) == wid // self.warps_per_head
                    row_lim[r] = cutlass.select_(own, blk_end, blk_start)
            tSrQ = self._q_fragment(thr_mma, sQ_i)

            for nb in cutlass.range(n_blocks):
                cute.arch.cp_async_wait_group(self.stages - 2)
                cute.arch.sync_threads()
                if nb == 0:
                    self._load_q(s2r_q, sQ_i, tSrQ, lane, sQ, q_cnt % self.stages)
                    if const_expr(self.hooks.has_transform_q):
                        self._transform_q(tSrQ, thr_mma, info, tc)
                cur = self._cursor_issue(ld, tc, (g + nb + self.stages - 1) % self.stages, cur)

                stage = (g + nb) % self.stages
                key0 = blk_start + nb * self.tpb + (wid % self.warps_per_head) * KW
                sK_w = cute.local_tile(sK[None, None, stage], (KW, self.kv_width), (wid, 0))
                sV_w = cute.local_tile(sV[None, None, stage], (KW, self.kv_width), (wid, 0))
                # S = Q K_wᵀ  (16 rows x KW keys)
                tSrK = self._load_k(thr_mma, s2r_k, sK_w)
                if const_expr(self.hooks.has_transform_k):
                    self._transform_k(tSrK, thr_mma, info, tc, key0)
                acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_Q, KW)), Float32)
                acc_S.fill(0.0)
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

                # logits, mask, online softmax over this warp's KW keys
                acc_S_mn = mma_mn_view(acc_S)
                acc_O_mn = mma_mn_view(acc_O)
                for r in cutlass.range_constexpr(n_rows_thr):
                    if const_expr(self.hooks.per_row):
                        lim = row_lim[r] if const_expr(self.hpi > 1) else blk_end
                        m_blk = self._row_scores(acc_S_mn, r, tScS, key0, lim, row_vals[r], tc)
                    else:
                        m_blk = -Float32.inf
                        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                            v = acc_S_mn[r, c] * scale_log2
                            v = v if key0 + tScS[0, c][1] < row_lim[r] else -Float32.inf
                            acc_S_mn[r, c] = v
                            m_blk = cute.arch.fmax(m_blk, v)
                    if const_expr(self.hooks.softmax):
                        self._online_row(acc_S_mn, acc_O_mn, r, m_blk, row_m, row_l)

                # O += P V_w
                rP = cute.make_fragment_like(acc_S, self.mma_dtype)
                rP.store(acc_S.load().to(self.mma_dtype))
                tOrP = mma_acc_as_a(rP)
                tOrV = self._load_v(thr_mma, s2r_v, sV_w)
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

            # --- epilogue: each warp's state goes through shared memory -- its unscaled O rows
            # into the K and V rows of this item's last block that only this warp read (``_o_buf``:
            # no other warp's reads to wait for), its row statistics into sM / sL -- then one
            # barrier, and the store phase ⊕-merges the four warps row by row.  The blocks in
            # flight are in the other stages, and the next block to go into this stage is issued
            # after the next block's barrier, which also guards the reuse of sM / sL.  (One
            # barrier per item, not three: each one pauses the copy stream at every item boundary.)
            if n_blocks > 0:
                q_cnt = q_cnt + 1
            else:
                cute.arch.sync_threads()  # no block barrier since the previous item's store phase
            g = g + n_blocks
            o_stage = (g + self.stages - 1) % self.stages
            sO = self._o_buf(kv_ptr, o_stage, wid)
            acc_O_mn = mma_mn_view(acc_O)
            cute.arch.sync_warp()  # the warp's ldmatrix reads of these rows come before its writes
            if const_expr(not self.hooks.softmax):
                # weights were summed, not normalized: give each warp the state (m = 0,
                # l = w/4) with w = this item's share of the request's keys; the ⊕ below and
                # the split-KV merge then return Σ w_i (Σ_j p_j v_j / w_i) / Σ w_i = Σ_j p_j v_j
                w_item = Float32(0.0)
                if info.kv_len > 0:
                    w_item = Float32(info.kv_end - info.kv_start) / Float32(info.kv_len)
            for r in cutlass.range_constexpr(n_rows_thr):
                if const_expr(self.hooks.softmax):
                    row_l[r] = quad_sum(row_l[r])
                else:
                    row_m[r] = Float32(0.0)
                    row_l[r] = w_item * 0.25
                j = tScS[r, 0][0]
                jt, wk = j, wid  # the tile row and the warp's place in its row group
                if const_expr(self.head_split):
                    jt, wk = rg0 + j, wid % WN
                if lane % 4 == 0:
                    sM[jt, wk] = row_m[r]
                    sL[jt, wk] = row_l[r]
                if jt < info.num_rows:  # rows past the tile's end are never stored
                    for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                        sO[j, self._o_col(tOcO[0, c][1])] = acc_O_mn[r, c]
            cute.arch.sync_threads()
            self._store(Outputs(mO, mLse, mPartO, mPartLse), kv_ptr, o_stage, (sM, sL), tidx, info, tc)

    @cute.jit
    def _online_row(self, acc_S_mn, acc_O_mn, r: cutlass.Constexpr, m_blk, row_m, row_l):
        """Online softmax of accumulator row r for one block: ``m_blk`` = this thread's max of
        the row's (base-2) logits; the row's scores become weights 2^(s - m), its partial sum
        and O are rescaled to the new running max.  A row with nothing visible yet keeps m =
        -inf and weights 0."""
        m_blk = quad_max(m_blk)
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

    # ---- shared memory -> MMA fragments (``decode_fp8`` overrides these four) ----------------
    def _q_fragment(self, thr_mma, sQ_i):
        return thr_mma.make_fragment_A(thr_mma.partition_A(sQ_i))

    def _load_q(self, s2r_q, sQ_i, tSrQ, lane, sQ, buf):
        """The item's Q tile (``sQ_i`` = Q buffer ``buf`` of ``sQ``) -> the A fragment."""
        cute.copy(s2r_q, s2r_q.partition_S(sQ_i), s2r_q.retile(tSrQ))

    def _load_k(self, thr_mma, s2r_k, sK_w):
        """The B fragment of S = Q K_wᵀ from the warp's [KW, D] K rows (ldmatrix)."""
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_w))
        cute.copy(s2r_k, s2r_k.partition_S(sK_w), s2r_k.retile(tSrK))
        return tSrK

    def _load_v(self, thr_mma, s2r_v, sV_w):
        """The B fragment of O += P V_w: the warp's [KW, D] V rows seen as [D, KW] (n = head
        dim, k = key), read by the transposing ldmatrix."""
        D, KW = self.head_dim, self.keys_per_warp
        sVt_w = cute.composition(sV_w, cute.make_layout((D, KW), stride=(KW, 1)))
        tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_w))
        cute.copy(s2r_v, s2r_v.partition_S(sVt_w), s2r_v.retile(tOrV))
        return tOrV

    def _o_col(self, c: int) -> int:
        """The head-dim column of accumulator column ``c`` (the identity here)."""
        return c

    # ---- loads and buffers ------------------------------------------------------------------
    def _kv_blocks(self, info: ItemInfo, tc: TraceCtx):
        """The KV range whose blocks an item reads: its token range, clipped by a variant's
        kv_range (bounds non-decreasing in q_pos: the first row gives lo, the last row hi)."""
        if self.hooks.has_kv_range:
            return self._clip_range(info, tc)
        return info.kv_start, info.kv_end

    @cute.jit
    def _cursor_next(self, ld: LoadStream, tc: TraceCtx, cur: LoadCursor):
        """The load cursor past an exhausted item moves on to the next item that has blocks (or
        to the end of the list), then looks up the rows of its next block (the lookups stay one
        block ahead of the copies).  The while loop runs on the cursor's fields unpacked into
        locals: a loop carries its values in the order they are first assigned in its body
        (item, start, end, base, head, n, nb, q here), and carrying the LoadCursor itself
        (field order) changes the generated code."""
        c_item, c_nb, c_n, c_start, c_end, c_base, c_head, c_q = cur.astuple()
        while (c_nb >= c_n) & (c_item + 1 < ld.item_end):
            c_item = c_item + 1
            info = ItemInfo(ld.mWork, c_item, ld.group)
            c_start, c_end = self._kv_blocks(info, tc)
            c_base, c_head = ld.mKvIndptr[info.req], info.kv_head
            c_n = (c_end - c_start + self.tpb - 1) // self.tpb
            c_nb = Int32(0)
            if c_n > 0:
                c_q = c_q + 1
        if c_nb < c_n:
            self._lookup(ld, c_base, c_start + c_nb * self.tpb, c_end)
        return LoadCursor(c_item, c_nb, c_n, c_start, c_end, c_base, c_head, c_q)

    @cute.jit
    def _cursor_issue(self, ld: LoadStream, tc: TraceCtx, stage: Int32, cur: LoadCursor):
        """Issue the cursor's next block into ``stage`` (with its item's Q tile when it is the
        item's first block), advance the cursor, and commit one cp.async group (empty once the
        CTA's items are all issued, so the count the compute waits on stays exact)."""
        if cur.nb < cur.n:
            if cur.nb == 0:
                self._issue_q(ld, cur.item, cur.q % self.q_bufs)
            self._issue_kv(ld, cur.head, cur.start + cur.nb * self.tpb, cur.end, stage)
            cur = self._cursor_next(ld, tc, cur.next_block())
        cute.arch.cp_async_commit_group()
        return cur

    @cute.jit
    def _issue_q(self, ld: LoadStream, item: Int32, buf: Int32):
        """cp.async item ``item``'s Q tile into Q buffer ``buf``; rows past num_rows re-read row 0
        and are never written out."""
        info = ItemInfo(ld.mWork, item, ld.group, ld.group_div)
        TQ = self.tile_q
        for i in cutlass.range_constexpr((TQ * self.q_chunks + THREADS - 1) // THREADS):
            idx = ld.tidx + i * THREADS
            if idx < TQ * self.q_chunks:
                j = idx // self.q_chunks
                c = idx % self.q_chunks
                tok, head = tok_head(info, info.row_start + (j if j < info.num_rows else 0))
                cp_async_16(
                    ld.sQ.iterator.toint() + self._smem_off(j, c, buf, TQ, self.head_dim) * 2,
                    ld.mQ[tok, head, None].iterator.toint() + c * 16,
                )

    def _o_buf(self, kv_ptr, stage, wid):
        """Warp ``wid``'s fp32 [16, D] epilogue buffer in stage ``stage``: the K and V rows
        [R wid, R wid + R) (R = ``o_region``: in decode the KW keys that only this warp reads),
        one contiguous piece per atom column (16-bit: 16 rows x 128 B = 2 KB per 64-column
        half; fp8: 32 rows of D bytes) of K then of V: R x D x kv_bytes x 2 = 16 x D x 4 B, so
        the buffer fills them exactly.  Row j is
        in piece j // rpp (rpp = fp32 rows per piece).  No padding fits there, so the
        accumulator stores see 4-way bank conflicts; a swizzle would avoid them but makes ptxas
        keep every element's swizzled column in registers (it spilled).  Once per item."""
        D, aw = self.head_dim, self._atom_w(self.kv_width)
        tile = self.block_n * self.kv_width  # elements of a stage's K (or V) tile; V stages follow K's
        halves, rpp = self.kv_width // aw, self.o_rows_per_piece
        ptr = cute.recast_ptr(kv_ptr + stage * tile + wid * self.o_region * aw, dtype=Float32)
        if self.o_cols_per_piece is None:
            layout = cute.make_layout(
                ((rpp, halves, 2), D), stride=((D, self.block_n * aw // 2, self.stages * tile // 2), 1)
            )
        else:  # column pieces: [16, cpp] fp32 each, atom column by atom column of K (then V)
            cpp = self.o_cols_per_piece
            layout = cute.make_layout(
                (16, (cpp, halves, D // (cpp * halves))),
                stride=(cpp, (1, self.block_n * aw // 2, self.stages * tile // 2)),
            )
        return cute.make_tensor(cute.make_ptr(Float32, ptr.toint(), cute.AddressSpace.smem, assumed_align=16), layout)

    # ---- variant hook helpers: plain Python, called while the kernel is traced --------------
    def _row_values(self, info: ItemInfo, tc: TraceCtx, tScS, n_rows: int, rg0):
        """``work.item_row_values`` for this warp's rows; ``rg0`` (head-split warps): the tile
        row of its first row."""
        if rg0 is None:
            return item_row_values(self.hooks, info, tc, tScS, n_rows, self.head_dim, self.hpi)
        out = []
        for r in range(n_rows):
            ctx = self._ctx(info, info.row_start + rg0 + tScS[r, 0][0], tc)
            out.append((ctx, *self.hooks.row_values(ctx, tc.vargs)))
        return out

    def _ctx(self, info: ItemInfo, row, tc: TraceCtx) -> Ctx:
        """The hook context of packed query row ``row`` (``row_ctx``: with head packing the
        row's own kv head)."""
        return row_ctx(info, row, self.head_dim, tc.sm_scale, self.hpi)

    def _clip_range(self, info: ItemInfo, tc: TraceCtx):
        """The item's KV range clipped to the variant's kv_range (bounds are non-decreasing in
        q_pos: the first row gives the lower bound, the last row the upper)."""
        lo, _ = self.hooks.kv_range(self._ctx(info, info.row_start, tc), tc.vargs)
        _, hi = self.hooks.kv_range(self._ctx(info, info.row_start + info.num_rows - 1, tc), tc.vargs)
        start, end = info.kv_start, info.kv_end
        if lo is not None:
            start = cutlass.select_(lo > info.kv_start, lo, info.kv_start)
        if hi is not None:
            end = cutlass.select_(hi < info.kv_end, hi, info.kv_end)
        return start, cutlass.select_(end > start, end, start)

    def _transform_q(self, tSrQ, thr_mma, info: ItemInfo, tc: TraceCtx, row0=None):
        """``transform_q`` on a warp's Q fragment; ``row0``: the tile row of the warp's first
        row (None: 0)."""
        first = info.row_start if row0 is None else info.row_start + row0
        transform_fragment(
            tSrQ,
            thr_mma.partition_A(cute.make_identity_tensor((self.warp_rows, self.head_dim))),
            lambda ctx, lo, hi, d: self.hooks.transform_q(ctx, tc.vargs, lo, hi, d),
            lambda j: self._ctx(info, first + j, tc),
            self.dtype,
        )

    def _transform_k(self, tSrK, thr_mma, info: ItemInfo, tc: TraceCtx, key0):
        base = self._ctx(info, info.row_start, tc)
        transform_fragment(
            tSrK,
            thr_mma.partition_B(cute.make_identity_tensor((16, self.head_dim))),
            lambda ctx, lo, hi, d: self.hooks.transform_k(ctx, tc.vargs, lo, hi, d),
            lambda n: base.replace(kv_pos=key0 + n, _fresh=True),
            self.dtype,
        )

    def _row_scores(self, acc_S_mn, r, tScS, key0, blk_end, row_vals, tc: TraceCtx):
        """Logits (base 2) or weights of one accumulator row with the variant's logits, mask
        and kv_range applied (``row_vals``: the row's entry of ``item_row_values``); returns the
        row's max over this thread's columns."""
        H, va, col_off = self.hooks, tc.vargs, tc.col_off
        rctx, lo, hi, bits = row_vals
        # bitmap masks: this row's bits of the warp's 16 keys, tested per element in registers
        bitmaps = row_words(bits, key0, tScS, col_off)
        fill = -Float32.inf if H.softmax else Float32(0.0)
        m_blk = -Float32.inf
        kv_f0 = (key0 + tScS[0, 0][1]).to(Float32)  # float positions: per block + a constant per column
        rel_f0 = kv_f0 - rctx.q_pos.to(Float32)
        for c in range(cute.size(acc_S_mn, mode=[1])):
            kv_pos = key0 + tScS[0, c][1]
            off = float(col_off[c])
            ectx = rctx.replace(kv_pos=kv_pos, kv_pos_f32=(kv_f0, off), rel_pos_f32=(rel_f0, off))
            ok = self._flag_ok(kv_pos < blk_end, kv_pos, rctx, tc)
            if H.has_logits:
                v = self._cap_logit(H.logits(ectx, va, acc_S_mn[r, c] * tc.sm_scale), tc)
                if H.softmax:
                    v = v * LOG2E
            else:
                v = self._logit(acc_S_mn[r, c], tc)
            if H.has_mask:
                ok = H.mask(ectx, va, ok)
            for words in bitmaps:
                ok = ok & bit_set(words, col_off[c])
            if lo is not None:
                ok = ok & (kv_pos >= lo)
            if hi is not None:
                ok = ok & (kv_pos < hi)
            v = cutlass.select_(ok, v, fill)
            acc_S_mn[r, c] = v
            if H.softmax:
                m_blk = cute.arch.fmax(m_blk, v)
        return m_blk

    # the portable prefill's static flags (``prefill_mma.py``) in the variant path: none here
    def _logit(self, s, tc: TraceCtx):
        """Raw q·k -> base-2 logit without a logits hook."""
        return s * (tc.sm_scale * LOG2E)

    def _cap_logit(self, v, tc: TraceCtx):
        """A logits hook's result (natural units) -> the logit the softmax sees."""
        return v

    def _flag_ok(self, ok, kv_pos, rctx, tc: TraceCtx):
        """``ok`` and the static masks at key ``kv_pos`` of the row of ``rctx``."""
        return ok

    def _finalize(self, m, l, info: ItemInfo, row, tc: TraceCtx):
        ctx = self._ctx(info, row, tc)
        ctx.first_chunk = info.kv_start == 0
        return self.hooks.finalize(ctx, tc.vargs, m, l)

    def _output(self, o4, info: ItemInfo, row, tc: TraceCtx, d0):
        ctx = self._ctx(info, row, tc)
        for e in range(4):
            o4[e] = self.hooks.output(ctx, tc.vargs, o4[e], d0 + e)

    @cute.jit
    def _lookup(self, ld: LoadStream, page_base: Int32, blk_start: Int32, kv_end: Int32):
        """The page of each KV row this thread gathers in the block starting at token blk_start
        (token p lives in page kv_indices[page_base + p // page_size]; tokens past kv_end re-read
        the last valid token: finite data, masked to -inf later).  Only the loads: their values
        are first used by the copies of the next iteration (``_issue_kv``), so no instruction
        here waits for them (the cursor's branches would otherwise stall on each lookup)."""
        for t in cutlass.range_constexpr(self.n_lookups):
            page, _ = divmod(self._row_pos(ld.tidx, t, blk_start, kv_end), ld.page_size)
            ld.rows[t] = ld.mKvIndices[page_base + page]

    def _row_pos(self, tidx, t, blk_start, kv_end):
        """Token of this thread's t-th distinct token (its rows t, t + n_lookups, ...: one per
        packed head) of the block starting at blk_start, clamped to the last valid token."""
        r = self._slot(tidx, t)[0]
        p = blk_start + (r % self.tpb if self.slot_lookups else r)
        return cutlass.select_(p < kv_end, p, kv_end - 1)

    def _slot(self, tidx, i):
        """(block row, chunk) of this thread's i-th copy (then col_groups atom columns on)."""
        return tidx // self.gather_w + i * self.row_step, tidx % self.gather_w

    @cute.jit
    def _issue_kv(self, ld: LoadStream, kv_head: Int32, blk_start: Int32, kv_end: Int32, stage: Int32):
        """cp.async this thread's 16-byte chunks of the block's K and V rows (pages looked up in
        ``ld.rows``) into a stage."""
        tidx, rows = ld.tidx, ld.rows
        k_base, v_base = ld.sK.iterator.toint(), ld.sV.iterator.toint()
        slots = [divmod(self._row_pos(tidx, t, blk_start, kv_end), ld.page_size)[1] for t in range(self.n_lookups)]
        pages = [in_cache(rows[t], ld.mK.shape[0]) for t in range(self.n_lookups)]
        for i in cutlass.range_constexpr(self.rows_per_thread):
            # block row r (``_slot``): head i // n_lookups of the item's heads, token t = i %
            # n_lookups of this thread's
            r, c = self._slot(tidx, i)
            if const_expr(self.slot_lookups):  # a lookup of its own: its row's head and token
                t, h = i, kv_head * self.hpi + r // self.tpb
            else:
                t, h = i % self.n_lookups, kv_head * self.hpi + i // self.n_lookups
            d = self._smem_off(r, c, stage, self.block_n, self.kv_width) * 2
            self._copy_row((ld.mK, ld.mV), (pages[t], slots[t], h), (k_base, v_base), d, c)

    def _copy_row(self, kv, at, bases, d, c):
        """cp.async this thread's chunks of one K row and V row (``kv`` the caches, ``at`` the
        row's leading indices, ``bases`` the stages): chunk ``c`` at shared byte offset ``d``,
        then the same chunk of each further atom column (block_n x atom_w elements on in the
        stage, gather_w chunks on in the row: the swizzle depends only on row and chunk)."""
        (mK, mV), (k_base, v_base) = kv, bases
        if self.col_groups == 1:
            cp_async_16(k_base + d, mK[(*at, None)].iterator.toint() + c * 16)
            cp_async_16(v_base + d, mV[(*at, None)].iterator.toint() + c * 16)
            return
        atom_bytes = self.block_n * self._atom_w(self.kv_width) * 2
        for a in range(self.col_groups):
            d_a, g_a = d + a * atom_bytes, c * 16 + a * self.gather_w * 16
            cp_async_16(k_base + d_a, mK[(*at, None)].iterator.toint() + g_a)
            cp_async_16(v_base + d_a, mV[(*at, None)].iterator.toint() + g_a)

    # the shared tiles' geometry (``row_tiles``), as methods: the fp8 and portable kernels use them
    _atom_w = staticmethod(row_tiles.atom_w)
    _swizzle_atom = staticmethod(row_tiles.swizzle_atom)
    _smem_off = staticmethod(row_tiles.smem_off)
    _check_smem_off = staticmethod(row_tiles.check_smem_off)

    @cute.jit
    def _store(self, outs: Outputs, kv_ptr: cute.Pointer, o_stage: Int32, stats, tidx: Int32, info, tc):
        """⊕ of the states of the warps that share a row (the warps_n warps of its row group:
        max m, l = Σ l_w 2^(m_w - m), then the variant's ``finalize``), and the store: final rows
        (value dtype) or a partial slot (fp32), 4 columns per thread-step.  A variant's
        ``output`` hook applies to final rows (the wrapper does not split the KV of such
        variants).  ``stats``: the warps' (sM, sL), sM[j, k] = row j of the k-th warp of its
        group; warp w's O rows are in ``_o_buf(w)``."""
        sM, sL = stats
        mO, mLse, mPartO, mPartLse = outs
        row_start, num_rows, dest = info.row_start, info.num_rows, info.dest
        per_row = self.head_dim // 4
        TQ, WN = self.tile_q, self.warps_n
        for i in cutlass.range_constexpr((TQ * per_row + THREADS - 1) // THREADS):
            idx = tidx + i * THREADS
            j = idx // per_row
            c4 = idx % per_row
            if idx < TQ * per_row and j < num_rows:
                jb, w0 = j, 0  # the row in its warps' buffers, the group's first warp
                if const_expr(self.warps_m > 1):
                    jb, w0 = j % self.warp_rows, (j // self.warp_rows) * WN
                m_all = -Float32.inf
                for w in cutlass.range_constexpr(WN):
                    m_all = cute.arch.fmax(m_all, sM[j, w])
                m_use = m_all if m_all != -Float32.inf else Float32(0.0)
                l_all = Float32(0.0)
                for w in cutlass.range_constexpr(WN):
                    l_all = l_all + sL[j, w] * cute.math.exp2(sM[j, w] - m_use, fastmath=True)
                if const_expr(self.hooks.has_finalize):
                    m_all, l_all = self._finalize(m_all, l_all, info, row_start + j, tc)
                    m_use = m_all if m_all != -Float32.inf else Float32(0.0)
                inv_l = Float32(0.0)
                if l_all > Float32(0.0):
                    inv_l = cute.arch.rcp_approx(l_all)
                acc = cute.zeros_like(cute.make_rmem_tensor((4,), Float32).load())
                for w in cutlass.range_constexpr(WN):
                    frag = cute.make_rmem_tensor((4,), Float32)
                    o_w = self._o_buf(kv_ptr, o_stage, w0 + w)
                    cute.autovec_copy(cute.local_tile(o_w[jb, None], (4,), (c4,)), frag)
                    acc = acc + frag.load() * (cute.math.exp2(sM[j, w] - m_use, fastmath=True) * inv_l)
                lse = -Float32.inf
                if l_all > Float32(0.0):
                    lse = m_all + cute.math.log2(l_all, fastmath=True)
                r = row_start + j
                if dest < 0:
                    tok, head = tok_head(info, r)
                    out = cute.make_rmem_tensor((4,), mO.element_type)
                    if const_expr(self.hooks.has_output):
                        o4 = cute.make_rmem_tensor((4,), Float32)
                        o4.store(acc)
                        self._output(o4, info, r, tc, c4 * 4)
                        out.store(o4.load().to(mO.element_type))
                    else:
                        out.store(acc.to(mO.element_type))
                    cute.autovec_copy(out, cute.local_tile(mO[tok, head, None], (4,), (c4,)))
                    if c4 == 0:
                        mLse[tok, head] = lse
                else:
                    out = cute.make_rmem_tensor((4,), Float32)
                    out.store(acc)
                    slot_row = dest * TQ + j
                    cute.autovec_copy(out, cute.local_tile(mPartO[slot_row, None], (4,), (c4,)))
                    if c4 == 0:
                        mPartLse[slot_row] = lse
