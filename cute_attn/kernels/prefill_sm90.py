"""Persistent prefill / append attention for Hopper (sm_90a): warp-specialized, wgmma + TMA.

One CTA per SM; the grid is the plan's ``num_ctas``; CTA c runs work items ``work_indptr[c] ..
work_indptr[c+1]`` (contract: ``cute_attn/sched/__init__.py``).  An item is one tile of
TILE_Q packed query rows (GQA packing: packed row r of kv head h is query token r // group of
qo head h*group + r % group, so one KV read serves the whole group) against a token range of
one request's KV.

Roles (warpgroups of 128 threads):
- WG 0, the producer (``prefill_sm90_producer.py``), fills a ring of K and V stages (separate
  pipelines, so K of the next block can land while V of the current one is still read).
  Contiguous (ragged) KV: one TMA box per block, issued by warp 0.  Paged KV: one TMA box per
  16-row page run, or (any page size, 1 included) all 128 threads gather 16-byte chunks of each
  token's row with ``cp.async`` into the very same swizzled tile.  An fp8 cache (spec
  ``kv_dtype``): fp8 boxes into staging tiles, widened into the stages by the producer's warps
  (``prefill_sm90_kv8.py``), or (``kv8_pass``) dequantized once per key into the workspace by
  warps 1-3 while warp 0 streams the 16-bit copy (``prefill_sm90_kv8_pass.py``).
- WG 1 (and 2), the consumers, own 64 query rows each: they load their Q rows (cp.async,
  GQA addressing), then per KV block S = Q·Kᵀ (wgmma, both operands in shared memory), mask +
  online softmax in registers (``prefill_sm90_softmax.py``), O += P·V (wgmma, P from
  registers).  Blocks are walked from the last to the first, so the blocks that need a mask
  come first; blocks that need none take the mask-free path.  Ping-pong: a WG issues its GEMMs
  only after the other WG has issued its own, so one WG's softmax runs under the other's
  tensor-core work.  Items back to back (``overlap_items``, on where ``OVERLAP_TILES`` says):
  with a second Q buffer, the next item's Q is loaded while this one runs and its first Q·Kᵀ
  is issued with this item's last P·V, so the pipeline and the ping-pong run on across items
  and a WG's epilogue runs under the other WG's GEMMs.
- ``setmaxnreg`` moves registers from the producer to the consumers.

Scores are in base 2 (sm_scale·log2 e folded into one multiply), LSE is base 2 as FlashInfer
returns it.  Final rows go out through shared memory as 16-byte stores (each row has its own
(token, head) address); split items write normalized fp32 partial rows for the ⊕ merge
kernel.

Variants (``cute_attn/variants``, docs/variants.md): causal, the sliding window and soft-cap are
static flags (block skipping, mask-free blocks, the soft-cap folded into ``_logits``); any other
variant is traced in through ``Hooks``, its calls kept in plain-Python helpers
(``prefill_sm90_hooks.py``: ``_hook_logits``, ``_hook_visible``, ``_rotate_q``,
``_finalize_rows``; ``_rotate_k`` is the producer's):
- ``bias`` (the components' before the first ``logits`` one): seeded into the QK accumulator
  before each block's GEMM (``_seed_bias``, in q·k's units), so the softmax runs the plain path;
- ``logits`` / ``mask`` / ``kv_range`` per score element in ``_softmax``; a variant with a mask or a
  range takes the masked path on every block; a ``kv_range`` also clips the item's blocks;
- ``transform_q``: the consumer WG rotates its Q rows in shared memory once per item;
  ``transform_k``: ragged KV (spec ``keys_transformed``): the wrapper runs the key-transform
  pass (``kernels/kv_pass.py``) first, once per key, and this kernel reads its output by
  TMA like plain K.  Paged KV: the producer rotates each K block in shared memory before
  releasing it to the consumers (one extra pass over the block by the otherwise idle producer
  WG, repeated for every query tile); K then always comes by cp.async (a TMA write cannot be
  followed by a producer pass without another barrier), so such a spec uses the gather
  producer's tiles and registers even for ``page_box`` caches;
- ``finalize`` (attention sinks) on each row's statistics in the epilogue (``first_chunk``: the
  item starting at kv 0, so a split row adds the sink once); ``output`` on final rows;
- ``softmax = False`` (FlashSigmoid): weights are accumulated as they are; a split item writes
  ``(o / w, log2 w)`` with ``w`` its share of the tile's kv extent, so the ⊕ merge returns the sum.
With no variant nothing of this is traced: the plain kernel is unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from ..variants.base import Hooks
from ..variants.dsl import LOG2E
from ..variants.trace import make_entry
from .fragments import WG, wgmma_acc_as_a, wgmma_mn_view
from .prefill_sm90_hooks import PrefillHooks
from .prefill_sm90_io import PrefillRowIO
from .prefill_sm90_kv8 import KV8_HEAD_DIMS, PrefillKv8, check_kv8_layouts
from .prefill_sm90_kv8_pass import PrefillKv8Pass
from .prefill_sm90_producer import BAR_PRODUCER, BOX_WARPS, ROW_RING, PrefillProducer, check_gather_swizzle
from .prefill_sm90_softmax import PrefillSoftmax, SoftmaxState, WgAcc, WgMma
from .prefill_sm90_tiles import KV_TILES, KV_TILES_VO, OVERLAP_TILES, PINNED, REGS, SMEM_MAX, smem_bytes
from .work import ItemInfo, TraceCtx, row_token

# named barriers (0 is __syncthreads): per consumer WG (1, 2), the two ping-pong barriers (3, 4)
# and the gather producer's (prefill_sm90_producer)
BAR_WG0, BAR_PINGPONG0 = 1, 3
assert BAR_PRODUCER not in (0, BAR_WG0, BAR_WG0 + 1, BAR_PINGPONG0, BAR_PINGPONG0 + 1) and BAR_PRODUCER < 16


@dataclass(frozen=True)
class PrefillConfig:
    """What a ``batch_prefill_sm90`` specialization fixes (the spec's parameters; 0 / -1: the
    kernel's default for the head dim, see ``KV_TILES`` / ``REGS``)."""

    dtype: Any  # DSL type
    head_dim: int  # of q and k
    tile_q: int
    paged: bool
    causal: bool
    soft_cap: bool
    window: bool
    tile_n: int = 0
    stages: int = 0
    pingpong: int = -1
    page_box: int = 0
    box_warps: int = 0
    producer_regs: int = 0
    variant: Any = None
    keys_transformed: bool = False
    lazy_rescale: int = 1
    head_dim_vo: int = 0  # of v and the output (0: head_dim)
    pin_p: int = -1  # 1: P converted where it is written (fragments.pin_fragment; fewer registers); -1: PINNED
    overlap_items: int = -1  # 1: items back to back (next item's first block with this one's last); -1: OVERLAP_TILES
    kv_dtype: Any = None  # DSL fp8 type of an fp8 K / V widened in the kernel (prefill_sm90_kv8); None: dtype
    kv8_cvt: int = 0  # 1: widen to bf16 by cvt instructions (NaN kept) instead of integer ops (knob)
    kv8_pass: int = 0  # fp8 cache (1 ragged, 2 paged) dequantized once per key by the kernel (prefill_sm90_kv8_pass)

    @classmethod
    def from_spec(cls, p: dict) -> PrefillConfig:
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
            p.get("tile_n", 0),
            p.get("stages", 0),
            p.get("pingpong", -1),
            p.get("page_box", 0),
            p.get("box_warps", 0),
            p.get("producer_regs", 0),
            spec_variant(p),
            p.get("keys_transformed", False),
            p.get("lazy_rescale", 1),
            p.get("head_dim_vo", 0),
            p.get("pin_p", -1),
            p.get("overlap_items", -1),
            to_dsl(p["kv_dtype"]) if p.get("kv_dtype") else None,
            p.get("kv8_cvt", 0),
            p.get("kv8_pass", 0),
        )


class Gmem(NamedTuple):
    """The kernel's global tensors (the family's ABI order)."""

    mQ: Any
    mK: Any
    mV: Any
    mKvIndptr: Any
    mKvIndices: Any
    mO: Any
    mLse: Any
    mWork: Any
    mWorkIndptr: Any
    mPartO: Any
    mPartLse: Any


class Tma(NamedTuple):
    """K / V TMA atoms and their global views (None on the gather path); ``kv8_pass``: the fp8
    cache's atoms and views and the pass's state and plan (``prefill_sm90_kv8_pass``)."""

    tma_k: Any
    tK: Any
    tma_v: Any
    tV: Any
    p8: Any = None


class Stages(NamedTuple):
    """Shared memory: the Q tile, the K / V stage rings, the output staging tile, the gather's row
    addresses (or None), the K / V pipelines; for an fp8 cache, the rings' fp8 views and pipelines."""

    sQ: Any
    sK: Any
    sV: Any
    sO: Any
    sRows: Any
    pipe_k: Any
    pipe_v: Any
    sK8: Any = None
    sV8: Any = None
    pipe_k8: Any = None
    pipe_v8: Any = None
    pass_bars: Any = None
    pass_claim: Any = None


class WgThread(NamedTuple):
    """A consumer thread's place: its warpgroup, thread in it, lane and the WG's barrier."""

    wg: Any
    tw: Any
    lane: Any
    bar_wg: Any


class BatchPrefillSm90(PrefillProducer, PrefillKv8, PrefillKv8Pass, PrefillSoftmax, PrefillHooks, PrefillRowIO):
    """The kernel: configuration, host launch, the CTA's roles and the consumers' block loop and
    epilogue; the producer, the online softmax and the variant hooks are its mixins
    (``prefill_sm90_producer`` / ``_softmax`` / ``_hooks``)."""

    def __init__(self, cfg: PrefillConfig):
        dtype, head_dim, tile_q, paged, soft_cap = cfg.dtype, cfg.head_dim, cfg.tile_q, cfg.paged, cfg.soft_cap
        head_dim_vo = cfg.head_dim_vo or head_dim
        self.cfg = cfg
        kv_tiles = KV_TILES if head_dim_vo == head_dim else {(d, g): t for (d, dv, g), t in KV_TILES_VO.items()}
        assert tile_q in (64, 128) and (head_dim, paged) in kv_tiles, (head_dim, head_dim_vo)
        self.dtype = dtype
        self.head_dim = head_dim  # q / k: the QK GEMM's K-dimension
        self.head_dim_vo = head_dim_vo  # v / o: the PV GEMM's N-dimension, the output's width
        self.tile_q = tile_q
        self.num_mma_wg = tile_q // 64
        self.paged = paged
        self.hooks = H = Hooks(cfg.variant, seed_bias=True)  # biases seed the Q·Kᵀ accumulator (_seed_bias)
        if cfg.keys_transformed:  # K comes already transformed (the KV pass, kv_pass.py): not again here
            assert H.has_transform_k and not paged, "keys_transformed: a ragged spec whose variant has transform_k"
            H.has_transform_k = False
        if soft_cap and H.has_logits:
            raise ValueError("soft_cap flag with a logits variant: put SoftCap into the variant (the order matters)")
        # How K/V reach shared memory: TMA -- one box per block (ragged) or one box per page_box
        # rows of a page (paged, page size a multiple of page_box) -- or a cp.async gather
        # (paged, any page size; and always when the producer rotates K blocks (transform_k):
        # a TMA write cannot be followed by a producer pass without another barrier).
        self.page_box = cfg.page_box if paged and not H.has_transform_k else 0
        self.gather = (paged and not self.page_box) or H.has_transform_k
        # an fp8 cache by TMA, widened by the producer (prefill_sm90_kv8): ragged, plain keys
        self.kv8 = cfg.kv_dtype
        kv8_ok = not self.gather and head_dim == head_dim_vo and head_dim in KV8_HEAD_DIMS
        assert self.kv8 is None or kv8_ok, "kv_dtype: K / V by TMA (ragged, page boxes), one head dim in KV8_HEAD_DIMS"
        self.kv8_pass = int(cfg.kv8_pass)
        # paged TMA: producer warps that issue a block's boxes (box b by warp b % box_warps)
        self.box_warps = cfg.box_warps or BOX_WARPS
        self.causal = cfg.causal
        self.soft_cap = soft_cap
        self.window = cfg.window
        self.mask_all = H.has_mask or H.has_kv_range  # masked path on every block
        # the soft-cap's fixed shift (see _running_max): its weights span 2^-100 .. 2^64, which a bf16
        # P holds (fp32's exponent range) and an fp16 one does not (subnormal below 2^-14)
        self.cap_fixed_shift = soft_cap and dtype is cutlass.BFloat16
        dn, ds = kv_tiles[head_dim, self.gather]
        # items back to back (``_next_item_first_block``): a second Q buffer, so the next item's Q
        # lands while this one runs.  Plain kernels with two ping-pong consumers only (a variant's
        # Q rotation or bias seeding would have to move into that step too)
        plain = tile_q == 128 and cfg.variant is None and head_dim_vo == head_dim
        auto = plain and (head_dim, self.gather) in OVERLAP_TILES
        self.overlap = auto if cfg.overlap_items < 0 else bool(cfg.overlap_items)
        # an fp8 cache: staging tiles per tensor (prefill_sm90_kv8): one in sO with items back
        # to back, else two of their own (which the one-Q-buffer kernels have room for)
        self.kv8_slots = 1 if self.overlap else 2
        if self.overlap and auto:
            dn = OVERLAP_TILES[head_dim, self.gather]
        self.tile_n = cfg.tile_n or dn
        self.stages = cfg.stages or ds
        self.threads = WG * (1 + self.num_mma_wg)
        self.chunks = head_dim // 8  # 16-byte chunks per q / k row
        self.chunks_vo = head_dim_vo // 8  # per v / o row
        if H.has_transform_k or H.has_transform_q:  # per-thread chunk pairs (prefill_sm90_producer, _hooks)
            assert head_dim == head_dim_vo and head_dim % 64 == 0 and WG % self.chunks == 0, head_dim
        self.producer_regs, self.mma_regs = REGS[self.num_mma_wg, self.gather]
        if self.page_box and self.num_mma_wg == 2 and head_dim_vo <= 128:
            # paged TMA: the page lookups want a few more producer registers (24 spills a little);
            # hd256 consumers need all 240 (at 232 ptxas serializes the wgmmas)
            self.producer_regs, self.mma_regs = 32, 232
        if self.kv8 is not None and self.num_mma_wg == 2:  # the widening's chunks; hd128 consumers fit 232
            self.producer_regs, self.mma_regs = 40 if self.kv8_pass else 32, 232
        if cfg.producer_regs and self.num_mma_wg == 2:  # knob: 3 warpgroups share 504 registers per lane
            self.producer_regs, self.mma_regs = cfg.producer_regs, (504 - cfg.producer_regs) // 2 // 8 * 8
        # ping-pong between the two consumer WGs pays off while O is small; with head_dim 256 the
        # tensor cores are busy enough with one WG's GEMMs (as FA3)
        self.pingpong = self.num_mma_wg == 2 and (head_dim_vo <= 128 if cfg.pingpong < 0 else bool(cfg.pingpong))
        self.rescale_before_pv = head_dim_vo > 128
        # the running max is only raised when a block's max exceeds it by more than LAZY_RESCALE
        # (base 2), so most blocks skip the O rescale (64 FMULs per thread at hd128, 128 at
        # hd256: as many as the block's scores); an idea from FA4
        self.lazy_rescale = bool(cfg.lazy_rescale)
        # The output goes out through its own staging tile (coalesced 16-byte stores), so the
        # next item's Q can be prefetched into sQ during this item's last PV and epilogue.  At hd256
        # only half of O's columns fit next to Q and the K/V stages: two passes of o_cols columns.
        # An fp8 cache with items back to back stages O in the finished item's Q buffer instead
        # (sO holds its fp8 tiles; the next item's Q goes into the other buffer).
        self.o_cols = head_dim_vo if head_dim_vo <= 128 else head_dim_vo // 2
        self.o_in_q = self.overlap and self.kv8 is not None
        can = plain and self.pingpong and smem_bytes(self, 2) <= SMEM_MAX
        assert can or not self.overlap, "overlap_items: needs two ping-pong consumers, no variant, smem for 2 Q tiles"
        assert not self.kv8_pass or (self.kv8 is not None and not paged and self.overlap and self.tile_n == 128), (
            "kv8_pass"
        )
        # P pinned (``_store_p``) where S's registers are needed back early: the step across items,
        # the hd256 plain kernels (``PINNED``) and the hd128 masked-variant path (without it ptxas
        # serializes the CustomMask specs' wgmmas)
        pin = (plain and (head_dim, self.gather) in PINNED) or (self.mask_all and head_dim == 128)
        self.pin_p = (pin if cfg.pin_p < 0 else bool(cfg.pin_p)) or self.overlap

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
        """The host function behind the generated entry (``variants.trace.make_entry``): the
        family's arguments, then the variant's tensors and scalars as tuples."""
        D, DV, TN, TQ, dt = self.head_dim, self.head_dim_vo, self.tile_n, self.tile_q, self.dtype
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, D), dt)
        sQ_shape = (TQ, D, 2) if self.overlap else (TQ, D)  # items back to back: two Q buffers
        sQ_layout = cute.tile_to_shape(atom, sQ_shape, tuple(range(len(sQ_shape))))
        o_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, self.o_cols), dt
        )
        sO_layout = cute.tile_to_shape(o_atom, (TQ, self.o_cols), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (TN, D, self.stages), (0, 1, 2))
        sV_layout = sK_layout
        if const_expr(DV != D):
            v_atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, DV), dt)
            sV_layout = cute.tile_to_shape(v_atom, (TN, DV, self.stages), (0, 1, 2))
        if const_expr(self.gather):
            check_gather_swizzle(sK_layout, TN, D)
            check_gather_swizzle(sV_layout, TN, DV)
        s8_layout = None  # an fp8 cache: its (TN, D) tile, loaded into the upper half of a stage
        if const_expr(self.kv8 is not None):
            f8 = self.kv8
            atom8 = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, f8, D), f8)
            s8_layout = cute.tile_to_shape(atom8, (TN, D), (0, 1))
            check_kv8_layouts(sK_layout, s8_layout, TN, D)
        mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            (self.num_mma_wg, 1, 1),
            (64, TN),
        )
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            (self.num_mma_wg, 1, 1),
            (64, DV),
            warpgroup.OperandSource.RMEM,
        )
        # TMA.  Ragged: [1, tokens, kv_heads, D] viewed as (tokens, D, kv_heads), one (TN, D) box per
        # block.  Paged with page_box: the cache viewed as (page_size, D, kv_heads, pages), boxes of
        # (page_box, D) written into row slices of the stage tile -- each slice starts on a
        # 1024-byte swizzle-atom boundary, so the sub-tile layout is the tile's own.  The gather
        # path has no TMA descriptor at all.  K at D = head_dim, V at DV = head_dim_vo.
        tma_k = tK = tma_v = tV = None
        if const_expr(not self.gather):
            if const_expr(self.page_box and self.kv8 is not None):  # fp8 boxes into a staging tile
                s8_staged = cute.make_composed_layout(
                    s8_layout.inner, 0, cute.append(s8_layout.outer, cute.make_layout(1))
                )
                tma_k, tK = self._page_box_tma(mK, s8_staged, D, self.kv8)
                tma_v, tV = self._page_box_tma(mV, s8_staged, DV, self.kv8)
            elif const_expr(self.page_box):
                tma_k, tK = self._page_box_tma(mK, sK_layout, D)
                tma_v, tV = self._page_box_tma(mV, sV_layout, DV)
            else:
                k3 = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2]))
                v3 = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 3, 2]))
                box_k, box_v = cute.select(sK_layout, mode=[0, 1]), cute.select(sV_layout, mode=[0, 1])
                if const_expr(self.kv8 is not None and not self.kv8_pass):  # fp8 boxes into staging tiles
                    box_k = box_v = s8_layout
                tma_k, tK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), k3, box_k, (TN, D))
                tma_v, tV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), v3, box_v, (TN, DV))
        extra, p8 = (), ()  # kv8_pass: the fp8 cache, the pass's state and plan (ahead of the variant's)
        if const_expr(self.kv8_pass):  # the kernel's tensor parameters stay in ABI order (tests/test_abi.py)
            extra, var_tensors, p8 = self._pass_args(var_tensors, s8_layout)

        @cute.struct
        class Smem:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sO_layout)], 1024]
            # gather: K / V row addresses
            sRows: cute.struct.MemRange[cutlass.Int64, 2 * TN * ROW_RING if self.gather else 1]

        if const_expr(Smem.size_in_bytes() + self.pass_smem_bytes() > SMEM_MAX):  # the kernel adds the pass's
            raise ValueError(
                f"{Smem.size_in_bytes()} bytes of shared memory > {SMEM_MAX}: fewer stages or keys per block"
            )
        cap = soft_cap if soft_cap > Float32(0.0) else Float32(1.0)
        scale_log2 = sm_scale * LOG2E  # S's units -> base-2 logits (see _row_scale)
        if const_expr(self.soft_cap):
            scale_log2 = cap * LOG2E
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
            extra,
            tma_k,
            tK,
            tma_v,
            tV,
            p8,
            var_tensors,
            group,
            scale_log2,
            sm_scale / cap,
            window_left,
            sm_scale,
            var_scalars,
            sQ_layout,
            sO_layout,
            sK_layout,
            sV_layout,
            s8_layout,
            mma_qk,
            mma_pv,
            Smem,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

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
        extra: tuple,
        tma_k: Optional[cute.CopyAtom],
        tK: Optional[cute.Tensor],
        tma_v: Optional[cute.CopyAtom],
        tV: Optional[cute.Tensor],
        p8: tuple,
        var_tensors: tuple,
        group: Int32,
        scale_log2: Float32,
        inv_cap_scaled: Float32,
        window_left: Int32,
        sm_scale: Float32,
        var_scalars: tuple,
        sQ_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        s8_layout: Optional[cute.ComposedLayout],
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # the launch's scalars and the variant's runtime arguments, read by both roles' helpers
        vargs = self.hooks.bind(var_tensors, var_scalars)
        inv_sm_scale = Float32(1.0) / sm_scale if self.hooks.has_bias else None
        fixed_shift = None
        if const_expr(self.cap_fixed_shift):
            fixed_shift = self._fixed_shift(scale_log2)
        tc = TraceCtx(
            vargs=vargs,
            sm_scale=sm_scale,
            inv_sm_scale=inv_sm_scale,
            inv_cap=inv_cap_scaled,
            fixed_shift=fixed_shift,
            group=group,
            group_div=cute.FastDivmodDivisorV2(group),
            window_left=window_left,
            scale_log2=scale_log2,
        )
        if const_expr(not self.gather):
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = st.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = st.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sRows = None
        if const_expr(self.gather):
            sRows = st.sRows.get_tensor(cute.make_layout((2, self.tile_n, ROW_RING), stride=(1, 2, 2 * self.tile_n)))

        T = pipeline.Agent.Thread
        mma_threads = WG * self.num_mma_wg
        if const_expr(self.gather):
            # cp.async producers: every producer thread arrives (noinc) once its copies land;
            # the stock consumer release arrives from every consumer thread.  The consumers issue
            # wgmma on a stage once its full barrier completes, with no proxy fence in between:
            # the mbarrier completion of cp.async is what CUTLASS's sm90 cp.async GMMA mainloops,
            # FA3's non-TMA paged KV and quack's gather-A GEMM rely on as well.  A fence.proxy.async
            # per block in the consumers cost up to 8 % (BENCHMARKS.md).
            mk_pipe = lambda bar, d=None: pipeline.PipelineCpAsync.create(  # noqa: E731
                barrier_storage=bar,
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(T, WG),
                consumer_group=pipeline.CooperativeGroup(T, mma_threads),
                defer_sync=True,
            )
        else:
            # TMA: one arming thread, transaction bytes; release is one arrive per consumer warp.
            mk_pipe = lambda bar, d=self.head_dim: pipeline.PipelineTmaAsync.create(  # noqa: E731
                barrier_storage=bar,
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(T, 1),
                consumer_group=pipeline.CooperativeGroup(T, mma_threads // 32),
                tx_count=self.tile_n * d * (self.dtype.width // 8),
                defer_sync=True,
            )
        kv8 = None
        if const_expr(self.kv8_pass):  # an fp8 cache dequantized by the producer's warps 1-3
            kv8, p8 = self._pass_smem(smem, st.sO, s8_layout, tidx), p8 + extra[2:]
        elif const_expr(self.kv8 is not None):  # an fp8 cache widened by the producer
            mk_pipe, kv8 = self._kv8_pipelines(smem, st.sO, s8_layout, mma_threads)
        pipe_k = mk_pipe(st.mbar_k.data_ptr())
        pipe_v = mk_pipe(st.mbar_v.data_ptr(), self.head_dim_vo)
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        gm = Gmem(mQ, mK, mV, mKvIndptr, mKvIndices, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse)
        sm = Stages(sQ, sK, sV, sO, sRows, pipe_k, pipe_v)
        if const_expr(self.kv8 is not None):
            sm = Stages(sQ, sK, sV, sO, sRows, pipe_k, pipe_v, *kv8)
        if tidx < WG:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if const_expr(self.kv8_pass):
                if warp_idx == 0:
                    self._produce(gm, Tma(tma_k, tK, tma_v, tV, p8), sm, cta, tidx, warp_idx, tc)
                else:
                    self._pass_helpers(gm, p8, sm, tidx)
            elif const_expr(self.kv8 is not None):
                self._produce_kv8(gm, Tma(tma_k, tK, tma_v, tV), sm, cta, warp_idx, tc)
            else:
                self._produce(gm, Tma(tma_k, tK, tma_v, tV), sm, cta, tidx, warp_idx, tc)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consume(gm, sm, mma_qk, mma_pv, cta, tidx - WG, tc)

    @cute.jit
    def _block_range(self, info: ItemInfo, tc: TraceCtx):
        """(first block, number of blocks) of an item; both roles walk the same blocks.
        Block i covers kv [KV_START + i*TN, min(KV_START + (i+1)*TN, KV_END)).  With a window,
        blocks entirely left of what the tile's first row may see are skipped."""
        kv_start = info.kv_start
        n_blocks = (info.kv_end - kv_start + self.tile_n - 1) // self.tile_n
        first = Int32(0)
        if const_expr(self.window):
            q_lo = info.qpos_base + row_token(info, info.row_start)
            lo_key = q_lo - tc.window_left
            if lo_key > kv_start:
                first = cutlass.min((lo_key - kv_start) // self.tile_n, n_blocks)
        if const_expr(self.hooks.has_kv_range):
            first, n_blocks = self._clip_blocks(info, tc, kv_start, first, n_blocks)
        return first, n_blocks

    # ---- consumers -----------------------------------------------------------------------
    @cute.jit
    def _consume(self, gm: Gmem, sm: Stages, mma_qk, mma_pv, cta, ct, tc: TraceCtx):
        mQ, mWork, mWorkIndptr = gm.mQ, gm.mWork, gm.mWorkIndptr
        sQ, sK, sV, sO, pipe_k, pipe_v = sm.sQ, sm.sK, sm.sV, sm.sO, sm.pipe_k, sm.pipe_v
        group, gdiv = tc.group, tc.group_div
        TN, TQ = self.tile_n, self.tile_q
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
        thr, thr_qk, thr_pv, tSrQ, tSrK, tOrV, tScS, tOcO, tc = self._wg_operands(mma_qk, mma_pv, sQ, sK, sVt, ct, tc)
        wg, tw, lane, bar_wg = thr
        n_rows = cute.size(tScS, mode=[0])  # rows this thread holds (2)
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.pingpong):
            if wg == 0:  # WG 0 goes first: pre-arrive on its own ping-pong barrier
                cute.arch.barrier_arrive(barrier_id=BAR_PINGPONG0, number_of_threads=2 * WG)

        H = self.hooks
        # O, P and the row statistics: per item, or with items back to back made once (they
        # outlive an item); both ways nothing else is live across items
        kept = self._wg_acc(thr_qk, thr_pv, n_rows) if const_expr(self.overlap) else None
        item0, item_end = mWorkIndptr[cta], mWorkIndptr[cta + 1]
        if item0 < item_end:
            self._load_q(mQ, ItemInfo(mWork, item0, group, gdiv), self._q_buf(sQ, 0), g2s, wg, tw)
        # 1: this item's first block ran in the previous item's last step (without overlap a
        # trace-time 0, so that kernel traces as the plain item loop: nothing live across items)
        started = Int32(0) if const_expr(self.overlap) else 0
        for item in cutlass.range(item0, item_end, unroll=1):
            info = ItemInfo(mWork, item, group, gdiv)
            kv_start, kv_end = info.kv_start, info.kv_end
            first, n_blocks = self._block_range(info, tc)
            qb = (item - item0) % 2 if const_expr(self.overlap) else None  # this item's Q buffer
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TQ, TN)), Float32)
            acc_O, rP, tOrP, st, st_done = kept if const_expr(self.overlap) else self._wg_acc(thr_qk, thr_pv, n_rows)
            row_m, row_l, corr = st

            if started == 0:  # this WG's Q rows: prefetched before the loop or during the previous item
                cute.arch.cp_async_wait_group(0)
                if const_expr(H.has_transform_q):  # rotate the WG's Q rows in place once all landed
                    cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
                    self._rotate_q(self._q_buf(sQ, 0), tw, wg, info, tc)
                cute.arch.fence_view_async_shared()  # generic-proxy writes -> read by wgmma (async proxy)
                cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
            if const_expr(self.overlap):  # the next item's Q into the other buffer (its last reader,
                if item + 1 < item_end:  # the item before, finished its QKs before this item's barrier)
                    if const_expr(self.o_in_q):  # ... and its epilogue staged O there
                        cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
                    self._load_q(mQ, ItemInfo(mWork, item + 1, group, gdiv), self._q_buf(sQ, 1 - qb), g2s, wg, tw)
            rows = self._item_rows(info, tScS, n_rows, tc)

            # Blocks from last to first.  Software pipeline within the WG: S(j) = Q K(j)^T is
            # issued together with O += P(j-1) V(j-1), and the softmax of S(j) runs while that
            # PV is still on the tensor cores; across WGs, ping-pong barriers order the GEMM
            # issue so one WG's softmax overlaps the other's GEMMs.
            last_wait = Int32(1) if const_expr(self.overlap) else 1  # the last PV still to be issued here
            if const_expr(not self.overlap):
                row_m.fill(-Float32.inf)
                row_l.fill(0.0)
                acc_O.fill(0.0)
            if n_blocks > first:
                if started == 0:
                    if const_expr(self.overlap):
                        row_m.fill(-Float32.inf)
                        row_l.fill(0.0)
                        acc_O.fill(0.0)
                    blk = kv_start + (n_blocks - 1) * TN
                    first_words = self._mask_words(blk, rows, tc)
                    if const_expr(H.has_bias):
                        self._seed_bias(acc_S, rows, blk, tc)
                    pipe_k.consumer_wait(state)
                    self._qk(mma_qk, acc_S, tSrQ, tSrK, state, qb)
                    warpgroup.wait_group(0)
                    pipe_k.consumer_release(state)
                    self._mask_softmax(acc_S, st, rows, blk, first_words, tc)
                    self._store_p(acc_S, rP)
                for j in cutlass.range(1, n_blocks - first, unroll=1):
                    blk = kv_start + (n_blocks - 1 - j) * TN
                    v_state = state.clone()
                    state.advance()
                    blk_words = self._mask_words(blk, rows, tc)
                    if const_expr(H.has_bias):  # S(j-1) is in rP by now
                        self._seed_bias(acc_S, rows, blk, tc)
                    pipe_k.consumer_wait(state)
                    self._pingpong_wait(wg)
                    self._qk(mma_qk, acc_S, tSrQ, tSrK, state, qb)
                    if const_expr(self.rescale_before_pv and H.softmax):
                        self._rescale_o(acc_O, corr)  # while QK runs: frees S's registers sooner (large O)
                    pipe_v.consumer_wait(v_state)  # V(j-1) lands after K(j): waited for once QK(j) is issued
                    if j == 1:
                        self._zero_v_tail(sV, v_state, kv_end - (kv_start + (n_blocks - 1) * TN), tw, bar_wg)
                    self._pv(mma_pv, acc_O, tOrP, tOrV, v_state)
                    self._pingpong_signal(wg)
                    warpgroup.wait_group(1)  # S(j) is ready; PV(j-1) may still run
                    pipe_k.consumer_release(state)
                    self._mask_softmax(acc_S, st, rows, blk, blk_words, tc)
                    warpgroup.wait_group(0)
                    pipe_v.consumer_release(v_state)
                    self._store_p(acc_S, rP)
                    if const_expr(not self.rescale_before_pv and H.softmax):
                        self._rescale_o(acc_O, corr)
                if const_expr(self.rescale_before_pv and H.softmax):
                    self._rescale_o(acc_O, corr)
                if const_expr(not self.overlap):
                    if item + 1 < item_end:  # every QK of this item is done: sQ is free
                        self._load_q(mQ, ItemInfo(mWork, item + 1, group, gdiv), self._q_buf(sQ, 0), g2s, wg, tw)
                v_state = state.clone()  # V of the item's last block; K of the next item's first
                state.advance()
                if const_expr(self.overlap):
                    if item + 1 < item_end:
                        last_wait = self._next_item_first_block(
                            ItemInfo(mWork, item + 1, group, gdiv),
                            kv_end - (kv_start + (n_blocks - 1) * TN),
                            n_blocks - first,
                            state,
                            v_state,
                            1 - qb,
                            WgAcc(acc_S, rP, tOrP, acc_O, st, st_done),
                            WgMma(mma_qk, mma_pv, tSrQ, tSrK, tOrV, tScS, n_rows),
                            sm,
                            thr,
                            tc,
                        )
                if last_wait != 0:
                    pipe_v.consumer_wait(v_state)
                    if n_blocks - first == 1:
                        self._zero_v_tail(sV, v_state, kv_end - (kv_start + (n_blocks - 1) * TN), tw, bar_wg)
                    self._pv(mma_pv, acc_O, tOrP, tOrV, v_state)
                    warpgroup.wait_group(0)
                    pipe_v.consumer_release(v_state)
                    if const_expr(self.overlap):
                        for r in cutlass.range_constexpr(n_rows):
                            st_done.row_m[r] = row_m[r]
                            st_done.row_l[r] = row_l[r]
            else:
                if const_expr(not self.overlap):
                    if item + 1 < item_end:  # no KV block: this item's Q is not used at all
                        self._load_q(mQ, ItemInfo(mWork, item + 1, group, gdiv), self._q_buf(sQ, 0), g2s, wg, tw)
                if const_expr(self.overlap):
                    st_done.row_m.fill(-Float32.inf)
                    st_done.row_l.fill(0.0)
                    acc_O.fill(0.0)
            # o_in_q: O goes out through this item's Q buffer (the next load into it waits above)
            o_stage = self._q_buf(sQ, qb) if const_expr(self.o_in_q) else sO
            self._epilogue(acc_O, st_done, tOcO, o_stage, gm, thr, info, tc)
            if const_expr(self.overlap):
                started = 1 - last_wait
                if started != 0:
                    acc_O.fill(0.0)

    def _wg_operands(self, mma_qk, mma_pv, sQ, sK, sVt, ct, tc: TraceCtx):
        """A consumer thread's place (``WgThread``), its MMA slices, the GEMM operands in shared
        memory, the coordinates of its S and O accumulators and ``tc`` with their static column
        offsets.  The warpgroup index is made warp-uniform and the shared-memory operands are
        partitioned through the WG's first thread (the same descriptors for all 128), so the
        wgmma descriptors and barrier ids live in uniform registers (per thread, ptxas rebuilt
        each descriptor before every wgmma: 3 % slower at hd128, ~10 % at hd256)."""
        TN, D, TQ = self.tile_n, self.head_dim_vo, self.tile_q
        wg = cute.arch.make_warp_uniform(ct // WG)  # rows [64 wg, 64 wg + 64) of the tile
        thr = WgThread(wg, ct % WG, ct % 32, BAR_WG0 + wg)
        thr_qk, thr_pv = mma_qk.get_slice(ct), mma_pv.get_slice(ct)
        wg_qk, wg_pv = mma_qk.get_slice(wg * WG), mma_pv.get_slice(wg * WG)
        tSrQ = mma_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = mma_pv.make_fragment_B(wg_pv.partition_B(sVt))
        tScS = wgmma_mn_view(thr_qk.partition_C(cute.make_identity_tensor((TQ, TN))))
        tOcO = wgmma_mn_view(thr_pv.partition_C(cute.make_identity_tensor((TQ, D))))
        # column c of a thread's scores is key tScS[0, 0] + col_off[c] (the same static offsets
        # for every thread; thread 0's coordinates are compile-time numbers), and the same for O
        tS0 = wgmma_mn_view(mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((TQ, TN))))
        tO0 = wgmma_mn_view(mma_pv.get_slice(0).partition_C(cute.make_identity_tensor((TQ, D))))
        col_off = tuple(tS0[0, c][1] - tS0[0, 0][1] for c in range(cute.size(tS0, mode=[1])))
        o_col_off = tuple(tO0[0, c][1] - tO0[0, 0][1] for c in range(cute.size(tO0, mode=[1])))
        # O staged for the output by stmatrix (x4: four 8 x 8 tiles, a 16-bit pair of each per
        # thread) where it goes out in one pass: one instruction per 8 of a thread's values
        # instead of a 16-bit store (and a permute out of the converted pair) each.  Two
        # consumer warpgroups only: with one (256 threads) setmaxnreg is ignored, ptxas picks
        # the register count itself and, with stmatrix's fragment live, serializes the hd128
        # gather kernels' wgmmas
        o_stage = None
        if const_expr(self.num_mma_wg == 2 and self.o_cols == D and self.dtype.width == 16):
            atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
            o_stage = cute.make_tiled_copy_C(atom, mma_pv).get_slice(ct)
        tc = dataclasses.replace(tc, col_off=col_off, o_col_off=o_col_off, o_stage=o_stage)
        return thr, thr_qk, thr_pv, tSrQ, tSrK, tOrV, tScS, tOcO, tc

    def _wg_acc(self, thr_qk, thr_pv, n_rows):
        """A consumer thread's O, P (and P as the A operand), softmax state, and the state the
        epilogue reads: the same, or with items back to back its own (``_next_item_first_block``)."""
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_q, self.head_dim_vo)), Float32)
        rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_q, self.tile_n)), self.dtype)
        tOrP = cute.make_tensor(rP.iterator, wgmma_acc_as_a(rP.layout))
        stats = [cute.make_rmem_tensor((n_rows,), Float32) for _ in range(5)]
        st = SoftmaxState(stats[0], stats[1], stats[4])
        return acc_O, rP, tOrP, st, SoftmaxState(stats[2], stats[3], stats[4]) if const_expr(self.overlap) else st

    @cute.jit
    def _next_item_first_block(
        self,
        nxt: ItemInfo,
        tail_valid,
        n_walked,
        state,
        v_state,
        qb,
        acc: WgAcc,
        mm: WgMma,
        sm: Stages,
        thr: WgThread,
        tc,
    ):
        """``overlap_items``: the item's last step as one more step of the block loop -- the next
        item's first S (from its Q, prefetched into buffer ``qb``) issued with this item's last
        P V, and its softmax run while that PV is on the tensor cores -- so the ping-pong carries
        on across items and this WG's epilogue runs under the other WG's GEMMs.  The finished
        item's statistics go to ``acc.done``.  Returns 0 where it did so (the next item has a
        block), else 1: the caller issues the last PV itself."""
        wg, tw, bar_wg = thr.wg, thr.tw, thr.bar_wg
        st, done = acc.st, acc.done
        TN = self.tile_n
        first_n, n_blocks_n = self._block_range(nxt, tc)
        last_wait = Int32(1)
        if n_blocks_n > first_n:
            last_wait = Int32(0)
            rows_n = self._item_rows(nxt, mm.tScS, mm.n_rows, tc)
            blk = nxt.kv_start + (n_blocks_n - 1) * TN
            words = self._mask_words(blk, rows_n, tc)
            cute.arch.cp_async_wait_group(0)  # the next item's Q rows
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
            sm.pipe_k.consumer_wait(state)
            self._pingpong_wait(wg)
            self._qk(mm.mma_qk, acc.acc_S, mm.tSrQ, mm.tSrK, state, qb)
            sm.pipe_v.consumer_wait(v_state)
            if n_walked == 1:
                self._zero_v_tail(sm.sV, v_state, tail_valid, tw, bar_wg)  # the item's only block is its last
            self._pv(mm.mma_pv, acc.acc_O, acc.tOrP, mm.tOrV, v_state)
            self._pingpong_signal(wg)
            for r in cutlass.range_constexpr(mm.n_rows):
                done.row_m[r] = st.row_m[r]
                done.row_l[r] = st.row_l[r]
            st.row_m.fill(-Float32.inf)
            st.row_l.fill(0.0)
            warpgroup.wait_group(1)
            sm.pipe_k.consumer_release(state)
            self._mask_softmax(acc.acc_S, st, rows_n, blk, words, tc)
            warpgroup.wait_group(0)
            sm.pipe_v.consumer_release(v_state)
            self._store_p(acc.acc_S, acc.rP)
        return last_wait

    @cute.jit
    def _qk(self, mma_qk, acc_S, tSrQ, tSrK, state, qb=None):
        """Issue S = Q K(stage)^T (async; the caller waits); S += Q K^T onto the seeded biases
        when the variant has them (``_seed_bias``)."""
        warpgroup.fence()
        # a fresh atom per call: the ACCUMULATE field it carries is set here, inside the caller's
        # loop (setting it on a tiled MMA made outside the loop is a value escaping its region)
        atom = cute.make_mma_atom(mma_qk.op)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            atom.set(warpgroup.Field.ACCUMULATE, k != 0 or self.hooks.has_bias)
            q = tSrQ[None, None, k] if const_expr(qb is None) else tSrQ[None, None, k, qb]  # qb: Q buffer
            cute.gemm(atom, acc_S, q, tSrK[None, None, k, state.index], acc_S)
        warpgroup.commit_group()

    @cute.jit
    def _pv(self, mma_pv, acc_O, tOrP, tOrV, state):
        """Issue O += P V(stage) (async; the caller waits)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma_pv.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(atom, acc_O, tOrP[None, None, k], tOrV[None, None, k, state.index], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _pingpong_wait(self, wg):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=BAR_PINGPONG0 + wg, number_of_threads=2 * WG)

    @cute.jit
    def _pingpong_signal(self, wg):
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=BAR_PINGPONG0 + 1 - wg, number_of_threads=2 * WG)


def build_batch_prefill_sm90(spec):
    """The jit entry for a ``batch_prefill_sm90`` spec: the variant (if any) is re-created from
    the spec's ``variant`` text and must still have the spec's fingerprint."""
    from ..families.prefill import prefill_abi_fixed, prefill_extra_abi
    from ..variants.base import abi_args

    cfg, p = PrefillConfig.from_spec(spec.pdict), spec.pdict
    return make_entry(BatchPrefillSm90(cfg), prefill_abi_fixed(p), prefill_extra_abi(p) + abi_args(cfg.variant))
