"""Persistent prefill / append attention for Hopper (sm_90a): warp-specialized, wgmma + TMA.

One CTA per SM; the grid is the plan's ``num_ctas``; CTA c runs work items ``work_indptr[c] ..
work_indptr[c+1]`` (contract: ``cute_attn/sched/__init__.py``).  An item is one tile of
TILE_Q packed query rows (GQA packing: packed row r of kv head h is query token r // group of
qo head h*group + r % group, so one KV read serves the whole group) against a token range of
one request's KV.

Roles (warpgroups of 128 threads):
- WG 0, the producer, fills a ring of K and V stages (separate pipelines, so K of the next
  block can land while V of the current one is still read).  Contiguous (ragged) KV: one TMA
  box per block, issued by warp 0.  Paged KV: all 128 threads gather 16-byte chunks of each
  token's row with ``cp.async`` into the very same swizzled tile (any page size, 1 included),
  page lookups in registers, shared by the K and V copies of a block.
- WG 1 (and 2), the consumers, own 64 query rows each: they load their Q rows (cp.async,
  GQA addressing), then per KV block S = Q·Kᵀ (wgmma, both operands in shared memory),
  mask + online softmax in registers, O += P·V (wgmma, P from registers).  Blocks are walked
  from the last to the first, so the blocks that need a mask come first; blocks that need
  none take the mask-free path.  Ping-pong: a WG issues its GEMMs only after the other WG has
  issued its own, so one WG's softmax runs under the other's tensor-core work.
- ``setmaxnreg`` moves registers from the producer to the consumers.

Scores are in base 2 (sm_scale·log2 e folded into one multiply), LSE is base 2 as FlashInfer
returns it.  Final rows go out through shared memory as 16-byte stores (each row has its own
(token, head) address); split items write normalized fp32 partial rows for the ⊕ merge
kernel.

Variants (``cute_attn/variants``, docs/variants.md): causal, the sliding window and soft-cap are
static flags (block skipping, mask-free blocks, the soft-cap folded into ``_logits``); any other
variant is traced in through ``Hooks``, its calls kept in plain-Python helpers (``_item_rows``,
``_hook_logits``, ``_hook_visible``, ``_rotate_q`` / ``_rotate_k``, ``_finalize_rows``):
- ``bias`` (the components' before the first ``logits`` one): seeded into the QK accumulator
  before each block's GEMM (``_seed_bias``, in q·k's units), so the softmax runs the plain path;
- ``logits`` / ``mask`` / ``kv_range`` per score element in ``_softmax``; a variant with a mask or a
  range takes the masked path on every block; a ``kv_range`` also clips the item's blocks;
- ``transform_q``: the consumer WG rotates its Q rows in shared memory once per item;
  ``transform_k``: ragged KV (spec ``keys_transformed``): the wrapper runs the key-transform
  pass (``kernels/key_transform.py``) first, once per key, and this kernel reads its output by
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

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Uint32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from ..variants.base import Ctx, Hooks
from ..variants.trace import make_entry, transform_pairs
from .decode import _quad_max, _quad_sum
from .bitmask import bit_set, load_words
from .copy import cp_async_16
from .work import WorkItem

LOG2E = math.log2(math.e)
WG = 128  # threads per warpgroup
SMEM_MAX = 232448  # bytes of shared memory per block on sm_90

# (tile_n, stages) per (head dim, cp.async gather): what fits 227 KB of shared memory next to the Q tile
# (the epilogue's output tile reuses the Q tile's space) and leaves ptxas enough registers to keep
# the wgmmas asynchronous: at hd128 x 128 keys (and hd256 x 80) it serializes every wgmma
# ("C7512 ... insufficient register resources"), which costs ~30 %.
KV_TILES = {(64, False): (128, 4), (64, True): (128, 4), (128, False): (112, 2), (128, True): (96, 2),
            (256, False): (64, 2), (256, True): (48, 2)}
# registers per thread after setmaxnreg, (producer, consumers): 3 warpgroups share 64512
# registers (168 each at launch); the TMA producer needs few, the cp.async gather more.  With one
# consumer warpgroup the pool is ample.
REGS = {(2, False): (24, 240), (2, True): (56, 224), (1, False): (56, 256), (1, True): (56, 256)}

# named barriers (0 is __syncthreads): per consumer WG, and the two ping-pong barriers
BAR_WG0, BAR_PINGPONG0, BAR_PRODUCER = 1, 3, 5
ROW_RING = 3  # blocks of page lookups staged in smem by the gather producer (see _produce)
BOX_WARPS = 4  # paged TMA: producer warps issuing the boxes of a block (see _produce)
LAZY_RESCALE = 8.0  # base-2 units a row's block max may exceed its kept max by before O is rescaled
FIXED_SHIFT_MAX_SCALE = 63.0  # soft-cap: the largest cap·log2 e whose weights stay >= 2^-126 (_running_max)


class BatchPrefillSm90:
    def __init__(self, dtype, head_dim: int, tile_q: int, paged: bool, causal: bool, soft_cap: bool,
                 window: bool, tile_n: int = 0, stages: int = 0, pingpong: int = -1, page_box: int = 0,
                 box_warps: int = 0, producer_regs: int = 0, variant=None, keys_transformed: bool = False,
                 lazy_rescale: int = 1):
        assert tile_q in (64, 128) and (head_dim, paged) in KV_TILES
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_q = tile_q
        self.num_mma_wg = tile_q // 64
        self.paged = paged
        self.hooks = H = Hooks(variant, seed_bias=True)  # biases seed the Q·Kᵀ accumulator (_seed_bias)
        if keys_transformed:  # K comes already transformed (kernels/key_transform.py): not again here
            assert H.has_transform_k and not paged, "keys_transformed: a ragged spec whose variant has transform_k"
            H.has_transform_k = False
        if soft_cap and H.has_logits:
            raise ValueError("soft_cap flag with a logits variant: put SoftCap into the variant (the order matters)")
        # How K/V reach shared memory: TMA -- one box per block (ragged) or one box per page_box
        # rows of a page (paged, page size a multiple of page_box) -- or a cp.async gather
        # (paged, any page size; and always when the producer rotates K blocks (transform_k):
        # a TMA write cannot be followed by a producer pass without another barrier).
        self.page_box = page_box if paged and not H.has_transform_k else 0
        self.gather = (paged and not self.page_box) or H.has_transform_k
        # paged TMA: producer warps that issue a block's boxes (box b by warp b % box_warps)
        self.box_warps = box_warps or BOX_WARPS
        self.causal = causal
        self.soft_cap = soft_cap
        self.window = window
        self.mask_all = H.has_mask or H.has_kv_range  # masked path on every block
        # the soft-cap's fixed shift (see _running_max): its weights reach 2^-126, which a bf16
        # P holds (fp32's exponent range) and an fp16 one does not (subnormal below 2^-14)
        self.cap_fixed_shift = soft_cap and dtype is cutlass.BFloat16
        dn, ds = KV_TILES[head_dim, self.gather]
        self.tile_n = tile_n or dn
        self.stages = stages or ds
        self.threads = WG * (1 + self.num_mma_wg)
        self.chunks = head_dim // 8  # 16-byte chunks per row
        self.producer_regs, self.mma_regs = REGS[self.num_mma_wg, self.gather]
        if self.page_box and self.num_mma_wg == 2 and head_dim <= 128:
            # paged TMA: the page lookups want a few more producer registers (24 spills a little);
            # hd256 consumers need all 240 (at 232 ptxas serializes the wgmmas)
            self.producer_regs, self.mma_regs = 32, 232
        if producer_regs and self.num_mma_wg == 2:  # knob: 3 warpgroups share 504 registers per lane
            self.producer_regs, self.mma_regs = producer_regs, (504 - producer_regs) // 2 // 8 * 8
        # ping-pong between the two consumer WGs pays off while O is small; with head_dim 256 the
        # tensor cores are busy enough with one WG's GEMMs (as FA3)
        self.pingpong = self.num_mma_wg == 2 and (head_dim <= 128 if pingpong < 0 else bool(pingpong))
        self.rescale_before_pv = head_dim > 128
        # the running max is only raised when a block's max exceeds it by more than LAZY_RESCALE
        # (base 2), so most blocks skip the O rescale (64 FMULs per thread at hd128, 128 at
        # hd256: as many as the block's scores); an idea from FA4
        self.lazy_rescale = bool(lazy_rescale)
        # The output goes out through its own staging tile (coalesced 16-byte stores), so the
        # next item's Q can be prefetched into sQ during this item's last PV and epilogue.  At
        # hd256 only half of O's columns fit next to Q and the K/V stages: it is staged in two
        # passes of o_cols columns.
        self.o_cols = head_dim if head_dim <= 128 else head_dim // 2

    # ---- variant hook points -------------------------------------------------------------
    def _row_scale(self, scale_log2):
        """What turns S (and row_m, kept in S's units) into base-2 logits: ``scale_log2`` --
        sm_scale·log2 e for raw q·k, cap·log2 e after the soft-cap (S then holds tanh(q·k ·
        sm_scale / cap), see ``host``) -- or log2 e after a variant's logits (natural units).
        The factor folds into the softmax's FFMA, not a multiply per score."""
        if const_expr(self.hooks.has_logits):
            return Float32(LOG2E)
        return scale_log2

    @cute.jit
    def _logits(self, s: Float32) -> Float32:
        """The soft-cap on raw q·k, in units of cap (``_row_scale`` has the factor): tanh(q·k ·
        sm_scale / cap)."""
        return cute.math.tanh(s * self._trace_inv_cap, fastmath=True)

    @cute.jit
    def _visible(self, kv_pos: Int32, kv_end: Int32, q_pos: Int32, window_left: Int32):
        """Logits mask: inside the item's range, causal (bottom-right aligned) and the window."""
        ok = kv_pos < kv_end
        if const_expr(self.causal):
            ok = ok & (kv_pos <= q_pos)
        if const_expr(self.window):
            ok = ok & (kv_pos >= q_pos - window_left)
        return ok

    # ---- host side ----------------------------------------------------------------------
    @cute.jit
    def host(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKvIndptr: cute.Tensor,
             mKvIndices: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, mWork: cute.Tensor,
             mWorkIndptr: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
             group: Int32, sm_scale: Float32, soft_cap: Float32, window_left: Int32, num_ctas: Int32,
             var_tensors: tuple, var_scalars: tuple, stream: cuda.CUstream):
        """The host function behind the generated entry (``variants.trace.make_entry``): the
        family's arguments, then the variant's tensors and scalars as tuples."""
        D, TN, TQ, dt = self.head_dim, self.tile_n, self.tile_q, self.dtype
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, D), dt)
        sQ_layout = cute.tile_to_shape(atom, (TQ, D), (0, 1))
        o_atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, self.o_cols),
                                                 dt)
        sO_layout = cute.tile_to_shape(o_atom, (TQ, self.o_cols), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (TN, D, self.stages), (0, 1, 2))
        if const_expr(self.gather):
            _check_gather_swizzle(sKV_layout, TN, D)
        mma_qk = sm90_utils.make_trivial_tiled_mma(dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
                                                   Float32, (self.num_mma_wg, 1, 1), (64, TN))
        mma_pv = sm90_utils.make_trivial_tiled_mma(dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
                                                   Float32, (self.num_mma_wg, 1, 1), (64, D),
                                                   warpgroup.OperandSource.RMEM)
        # TMA.  Ragged: [1, tokens, kv_heads, D] viewed as (tokens, D, kv_heads), one (TN, D) box per
        # block.  Paged with page_box: the cache viewed as (page_size, D, kv_heads, pages), boxes of
        # (page_box, D) written into row slices of the stage tile -- each slice starts on a
        # 1024-byte swizzle-atom boundary, so the sub-tile layout is the tile's own.  The gather
        # path has no TMA descriptor at all.
        tma_k = tK = tma_v = tV = None
        if const_expr(not self.gather):
            if const_expr(self.page_box):
                PB = self.page_box
                k4 = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
                v4 = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 3, 2, 0]))
                stage0 = cute.make_tensor(cute.make_ptr(dt, 0, cute.AddressSpace.smem, assumed_align=1024),
                                          sKV_layout.outer)[None, None, 0]
                sub = cute.select(cute.local_tile(stage0, (PB, D), (0, 0)).layout, mode=[0, 1])
                box = cute.make_composed_layout(sKV_layout.inner, 0, sub)
                tma_k, tK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), k4, box, (PB, D))
                tma_v, tV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), v4, box, (PB, D))
            else:
                k3 = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2]))
                v3 = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 3, 2]))
                kv_box = cute.select(sKV_layout, mode=[0, 1])
                tma_k, tK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), k3, kv_box, (TN, D))
                tma_v, tV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), v3, kv_box, (TN, D))

        @cute.struct
        class Smem:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sO_layout)], 1024]
            # gather: K / V row addresses
            sRows: cute.struct.MemRange[cutlass.Int64, 2 * TN * ROW_RING if self.gather else 1]

        if const_expr(Smem.size_in_bytes() > SMEM_MAX):
            raise ValueError(f"{Smem.size_in_bytes()} bytes of shared memory > {SMEM_MAX}: fewer stages or keys per block")
        cap = soft_cap if soft_cap > Float32(0.0) else Float32(1.0)
        scale_log2 = sm_scale * LOG2E  # S's units -> base-2 logits (see _row_scale)
        if const_expr(self.soft_cap):
            scale_log2 = cap * LOG2E
        self.kernel(mQ, mK, mV, mKvIndptr, mKvIndices, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse,
                    tma_k, tK, tma_v, tV, var_tensors, group, scale_log2, sm_scale / cap, window_left,
                    sm_scale, var_scalars, sQ_layout, sO_layout, sKV_layout, mma_qk, mma_pv, Smem).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    # ---- device side --------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKvIndptr: cute.Tensor,
               mKvIndices: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, mWork: cute.Tensor,
               mWorkIndptr: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
               tma_k: Optional[cute.CopyAtom], tK: Optional[cute.Tensor], tma_v: Optional[cute.CopyAtom],
               tV: Optional[cute.Tensor], var_tensors: tuple,
               group: Int32, scale_log2: Float32, inv_cap_scaled: Float32,
               window_left: Int32, sm_scale: Float32, var_scalars: tuple, sQ_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
               Smem: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # per variant component: its runtime arguments (kernel values), read by the hook helpers
        # while this kernel is traced (kept off the kernel's locals: the DSL's loop analysis
        # only admits DSL values there)
        self._trace_vargs = self.hooks.bind(var_tensors, var_scalars)
        self._trace_sm_scale = sm_scale
        self._trace_inv_sm_scale = Float32(1.0) / sm_scale if self.hooks.has_bias else None
        self._trace_inv_cap = inv_cap_scaled  # sm_scale / cap: the soft-cap's tanh argument per raw q·k
        self._trace_group = group
        if const_expr(not self.gather):
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = st.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
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
            # per block in the consumers cost up to 8 % (session 7, BENCHMARKS.md).
            mk_pipe = lambda bar: pipeline.PipelineCpAsync.create(  # noqa: E731
                barrier_storage=bar, num_stages=self.stages, producer_group=pipeline.CooperativeGroup(T, WG),
                consumer_group=pipeline.CooperativeGroup(T, mma_threads), defer_sync=True)
        else:
            # TMA: one arming thread, transaction bytes; release is one arrive per consumer warp.
            mk_pipe = lambda bar: pipeline.PipelineTmaAsync.create(  # noqa: E731
                barrier_storage=bar, num_stages=self.stages, producer_group=pipeline.CooperativeGroup(T, 1),
                consumer_group=pipeline.CooperativeGroup(T, mma_threads // 32),
                tx_count=self.tile_n * self.head_dim * (self.dtype.width // 8), defer_sync=True)
        pipe_k = mk_pipe(st.mbar_k.data_ptr())
        pipe_v = mk_pipe(st.mbar_v.data_ptr())
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        if tidx < WG:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self._produce(mK, mV, mKvIndptr, mKvIndices, mWork, mWorkIndptr, tma_k, tK, tma_v, tV, sK, sV, sRows,
                          pipe_k, pipe_v, cta, tidx, warp_idx, group, window_left)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consume(mQ, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse, sQ, sK, sV, sO, pipe_k, pipe_v,
                          mma_qk, mma_pv, cta, tidx - WG, group, scale_log2,
                          window_left)

    @cute.jit
    def _block_range(self, w: WorkItem, group: Int32, window_left: Int32):
        """(first block, number of blocks) of an item; both roles walk the same blocks.
        Block i covers kv [KV_START + i*TN, min(KV_START + (i+1)*TN, KV_END)).  With a window,
        blocks entirely left of what the tile's first row may see are skipped."""
        kv_start = w.kv_start
        n_blocks = (w.kv_end - kv_start + self.tile_n - 1) // self.tile_n
        first = Int32(0)
        if const_expr(self.window):
            q_lo = w.qpos_base + w.row_start // group
            lo_key = q_lo - window_left
            if lo_key > kv_start:
                first = cutlass.min((lo_key - kv_start) // self.tile_n, n_blocks)
        if const_expr(self.hooks.has_kv_range):
            first, n_blocks = self._clip_blocks(w, kv_start, first, n_blocks)
        return first, n_blocks

    # ---- producer ------------------------------------------------------------------------
    @cute.jit
    def _produce(self, mK, mV, mKvIndptr, mKvIndices, mWork, mWorkIndptr, tma_k, tK, tma_v, tV, sK, sV, sRows,
                 pipe_k, pipe_v, cta, tidx, warp_idx, group, window_left):
        TN, D = self.tile_n, self.head_dim
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        ring = Int32(0)  # gather: blocks staged so far (selects the lookup ring slot)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                  num_bits_per_copy=128)
        # p // page_size and p % page_size by multiply-high and shift: a runtime integer division
        # is ~25 instructions, and the issue path does one per box or row
        pdiv = cute.FastDivmodDivisorV2(mK.shape[1])
        dst = None
        if const_expr(self.gather):
            dst = self._gather_dst(sK, sV, tidx)
        for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1], unroll=1):
            w = WorkItem(mWork, item)
            req, kv_head, kv_start, kv_end = w.req, w.kv_head, w.kv_start, w.kv_end
            first, n_blocks = self._block_range(w, group, window_left)
            if const_expr(self.page_box):
                # A block is TN / page_box boxes, and one warp issuing all of them (a shuffle, the
                # coordinates and a TMA each) is slower than the consumers use them: the boxes are
                # shared out over box_warps warps.  Each warp waits for the stage itself; warp 0
                # alone arms the full barrier with the whole block's bytes (boxes landing before
                # that only drive its transaction count below zero, which an mbarrier allows:
                # the phase cannot complete before warp 0's arrival).
                if warp_idx < self.box_warps:
                    # lane b looks up the page of box b and its 16-row slot in the page (all boxes
                    # of a block in one round trip), one block ahead of its use; the TMA issue
                    # reads them with shuffles, as warp-uniform values (see _load_pages)
                    page_base = mKvIndptr[req]
                    page_size = pdiv
                    lane = cute.arch.lane_idx()
                    head = cute.arch.make_warp_uniform(kv_head)
                    nb = n_blocks - first
                    pg_k, rw_k = Int32(0), Int32(0)
                    pg_v, rw_v = Int32(0), Int32(0)
                    if nb > 0:
                        pg_k, rw_k = self._box_page(mKvIndices, lane, kv_start + (n_blocks - 1) * TN, kv_end,
                                                    page_base, page_size)
                    for j in cutlass.range(nb + 1, unroll=1):
                        pg_next, rw_next = Int32(0), Int32(0)
                        if j + 1 < nb:
                            pg_next, rw_next = self._box_page(mKvIndices, lane, kv_start + (n_blocks - 2 - j) * TN,
                                                              kv_end, page_base, page_size)
                        if j < nb:
                            boxes = self._box_coords(pg_k, rw_k, warp_idx)  # before the wait
                            self._acquire_boxes(pipe_k, k_state, warp_idx)
                            self._load_pages(tma_k, tK, sK, pipe_k, k_state.index, boxes, head)
                            k_state.advance()
                        if j > 0:
                            boxes = self._box_coords(pg_v, rw_v, warp_idx)
                            self._acquire_boxes(pipe_v, v_state, warp_idx)
                            self._load_pages(tma_v, tV, sV, pipe_v, v_state.index, boxes, head)
                            v_state.advance()
                        pg_v, rw_v = pg_k, rw_k
                        pg_k, rw_k = pg_next, rw_next
            elif const_expr(not self.gather):
                if warp_idx == 0:
                    row0 = mKvIndptr[req] + kv_start
                    gK = cute.local_tile(cute.domain_offset((row0, 0), tK[None, None, kv_head]), (TN, D), (None, 0))
                    gV = cute.local_tile(cute.domain_offset((row0, 0), tV[None, None, kv_head]), (TN, D), (None, 0))
                    tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                     cute.group_modes(gK, 0, 2))
                    tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                     cute.group_modes(gV, 0, 2))
                    # K(i) goes out one block ahead of V(i): QK of the next block can start
                    # while PV of this one still reads its V stage
                    for j in cutlass.range(n_blocks - first + 1, unroll=1):
                        if j < n_blocks - first:
                            pipe_k.producer_acquire(k_state)
                            cute.copy(tma_k, tKg[None, n_blocks - 1 - j], tKs[None, k_state.index],
                                      tma_bar_ptr=pipe_k.producer_get_barrier(k_state))
                            k_state.advance()
                        if j > 0:
                            pipe_v.producer_acquire(v_state)
                            cute.copy(tma_v, tVg[None, n_blocks - j], tVs[None, v_state.index],
                                      tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
                            v_state.advance()
            else:
                # Page lookups are staged in smem one block ahead: thread t < TN looks up row t of
                # the next block (a global load whose latency hides behind this block's copies)
                # and stores the global addresses of its K and V rows; every thread then reads its
                # rows' addresses from smem (one 8-byte load per 16-byte copy: this loop is the
                # producer's whole work, and with the page arithmetic in it the producer, not the
                # tensor cores, set the pace).  Ring of ROW_RING blocks: K(j), V(j-1) and the
                # lookup of j+1 are in flight together.
                page_base = mKvIndptr[req]
                page_size = pdiv
                nb = n_blocks - first
                if nb > 0:
                    ak, av = self._row_addrs(mK, mV, mKvIndices, tidx, kv_start + (n_blocks - 1) * TN, kv_end,
                                             page_base, page_size, kv_head)
                    if tidx < TN:
                        sRows[0, tidx, ring % ROW_RING] = ak
                        sRows[1, tidx, ring % ROW_RING] = av
                    cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=WG)
                for j in cutlass.range(nb + 1, unroll=1):
                    ak = cutlass.Int64(0)
                    av = cutlass.Int64(0)
                    k_idx = k_state.index  # the stage K(j) goes to (rotated below with transform_k)
                    if j + 1 < nb:
                        ak, av = self._row_addrs(mK, mV, mKvIndices, tidx, kv_start + (n_blocks - 2 - j) * TN, kv_end,
                                                 page_base, page_size, kv_head)
                    if j < nb:
                        pipe_k.producer_acquire(k_state)
                        if const_expr(self.hooks.has_transform_k):
                            # each thread copies both halves (dims d, d + D/2) of its rows, so it can
                            # rotate them itself once its own copies land: no producer barrier
                            self._gather_pairs(sK, sRows, g2s, tidx, k_state.index, (ring + j) % ROW_RING)
                            cute.arch.cp_async_commit_group()
                        else:
                            self._gather(dst, sRows, tidx, 0, k_state.index, (ring + j) % ROW_RING)
                            pipe_k.producer_commit(k_state)
                        k_state.advance()
                    if j > 0:
                        pipe_v.producer_acquire(v_state)
                        self._gather(dst, sRows, tidx, 1, v_state.index, (ring + j - 1) % ROW_RING)
                        pipe_v.producer_commit(v_state)
                        v_state.advance()
                    if const_expr(self.hooks.has_transform_k):
                        if j < nb:
                            # K(j) rotated in place while V(j-1) is in flight, then released
                            cute.arch.cp_async_commit_group()
                            cute.arch.cp_async_wait_group(1)
                            self._rotate_k(sK, tidx, k_idx, kv_start + (n_blocks - 1 - j) * TN, req, kv_head,
                                           w.qo_len, w.kv_len)
                            cute.arch.fence_view_async_shared()  # generic writes -> read by wgmma
                            pipe_k.sync_object_full.arrive_mbarrier(k_idx)
                    if j + 1 < nb:
                        if tidx < TN:
                            sRows[0, tidx, (ring + j + 1) % ROW_RING] = ak
                            sRows[1, tidx, (ring + j + 1) % ROW_RING] = av
                    cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=WG)
                ring = ring + nb
        if const_expr(self.gather):
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # no copy of this thread outlives it

    @cute.jit
    def _acquire_boxes(self, pipe, state, warp_idx):
        """Every box-issuing warp waits for the stage to be free; warp 0 arms its full barrier."""
        pipe.sync_object_empty.wait(state.index, state.phase)
        if warp_idx == 0:
            pipe.sync_object_full.arrive(state.index, pipe.producer_mask)

    def _box_coords(self, pg, rw, warp_idx):
        """(box, page, slot) of this warp's boxes of a block (box b by warp b % box_warps) as
        warp-uniform values, from lane b of ``pg`` / ``rw`` (``_box_page``).  TMA operands must
        sit in uniform registers; for a value the compiler cannot prove uniform (a shuffle's
        result) it converts per issue.  Computed before the stage wait, off the issue path."""
        out = []
        for k in range((self.tile_n // self.page_box + self.box_warps - 1) // self.box_warps):
            b = cute.arch.make_warp_uniform(warp_idx + k * self.box_warps)
            out.append((b, cute.arch.make_warp_uniform(cute.arch.shuffle_sync(pg, b)),
                        cute.arch.make_warp_uniform(cute.arch.shuffle_sync(rw, b))))
        return out

    @cute.jit
    def _load_pages(self, tma, tX, sX, pipe, stage, boxes, kv_head):
        """This warp's boxes of one block (``boxes``: ``_box_coords``), each from its own page.
        Boxes past kv_end re-read the last valid box; the unused slots of the last page are
        zeroed in smem by the consumers before P V (``_zero_v_tail``)."""
        PB, D = self.page_box, self.head_dim
        stage = cute.arch.make_warp_uniform(stage)
        bar = pipe.sync_object_full.get_barrier(stage)
        for k in cutlass.range_constexpr(len(boxes)):
            b, page, row = boxes[k]
            if b < self.tile_n // PB:
                g = cute.local_tile(tX[None, None, kv_head, page], (PB, D), (row, 0))
                s_ = cute.local_tile(sX[None, None, stage], (PB, D), (b, 0))
                ts, tg = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(s_, 0, 2),
                                               cute.group_modes(g, 0, 2))
                cute.copy(tma, tg, ts, tma_bar_ptr=bar)

    @cute.jit
    def _box_page(self, mKvIndices, lane, blk, kv_end, page_base, page_size):
        """(page, page_box-row slot in the page) of box ``lane`` of the block starting at token blk
        (clamped to the last valid token, so every lane reads a valid index)."""
        p = blk + lane * self.page_box
        p = p if p < kv_end else kv_end - 1
        q, r = divmod(p, page_size)
        return mKvIndices[page_base + q], r // self.page_box

    @cute.jit
    def _row_addrs(self, mK, mV, mKvIndices, tidx, blk, kv_end, page_base, page_size, kv_head):
        """Global byte addresses of the K and V rows (this kv head) of row tidx of the block
        starting at token blk; rows past kv_end re-read the last token (finite data, masked
        later: a NaN there would survive 0 * NaN in P V)."""
        p = blk + tidx
        p = p if p < kv_end else kv_end - 1
        page, slot = Int32(0), page_base + p  # ragged KV gathered (transform_k): token kv_indptr[req] + p
        if const_expr(self.paged):
            q, slot = divmod(p, page_size)
            page = mKvIndices[page_base + q]
        return mK[page, slot, kv_head, None].iterator.toint(), mV[page, slot, kv_head, None].iterator.toint()

    def _chunk(self, addr):
        """The 16 bytes at global byte address ``addr`` as a tensor (a cp.async source)."""
        return cute.make_tensor(cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=16),
                                cute.make_layout((8,)))

    def _gather_dst(self, sK, sV, tidx):
        """Where this thread's gathered chunks go: thread t copies 16-byte chunk c = t % chunks of
        rows t // chunks + r * (WG / chunks).  A stage tile is the linear layout x(row, col)
        (elements, checked in ``host``) under the 128-byte swizzle on byte addresses, b -> b ^
        ((b >> 7) & 7) << 4, which repeats every 8 rows (1024 bytes): row r's address is one of
        max(1, 8 / (WG / chunks)) per-thread bases plus a static multiple of whole periods, no
        swizzle arithmetic per copy.  Returns (K base, V base, bases), bytes."""
        TN, rpp = self.tile_n, WG // self.chunks
        col = (tidx % self.chunks) * 8
        bases = []
        for k in range(max(1, 8 // rpp)):
            b = ((col // 64) * (TN * 64) + (tidx // self.chunks + k * rpp) * 64 + col % 64) * 2
            bases.append(b ^ (((b >> 7) & 7) << 4))
        return sK.iterator.toint(), sV.iterator.toint(), bases

    @cute.jit
    def _gather(self, dst, sRows, tidx, which, stage, buf):
        """cp.async this thread's 16-byte chunks of a block's K (which = 0) or V rows into a
        stage: row addresses from sRows, destinations from ``_gather_dst``."""
        TN, D, rpp = self.tile_n, self.head_dim, WG // self.chunks
        nb = max(1, 8 // rpp)
        c16 = (tidx % self.chunks) * 16
        s_base = dst[which] + stage * (TN * D * 2)
        # all row addresses first: a cp.async writes shared memory, so the compiler keeps each
        # smem load behind the copies before it, and the load -> copy chains would serialize
        addrs = [sRows[which, tidx // self.chunks + r * rpp, buf] for r in range(TN // rpp)]
        for r in cutlass.range_constexpr(TN // rpp):
            d = s_base + dst[2][r % nb] + (r // nb) * (nb * rpp * 128)  # nb * rpp rows: a whole 1 KB period
            cp_async_16(d, addrs[r] + c16)  # with the L2 128-byte prefetch hint

    @cute.jit
    def _gather_pairs(self, sX, sRows, g2s, tidx, stage, buf):
        """As ``_gather`` for K, but thread t copies chunks c and c + chunks/2 (dims d and d + D/2)
        of its rows, c = t % (chunks/2): the pairs a transform_k rotates are all its own."""
        half = self.chunks // 2
        rows_per_pass = WG // half
        c = tidx % half
        for r in cutlass.range(self.tile_n // rows_per_pass, unroll=2):
            row = tidx // half + r * rows_per_pass
            addr = sRows[0, row, buf]
            cute.copy(g2s, self._chunk(addr + c * 16), cute.local_tile(sX[row, None, stage], (8,), (c,)))
            cute.copy(g2s, self._chunk(addr + (c + half) * 16), cute.local_tile(sX[row, None, stage], (8,), (c + half,)))

    @cute.jit
    def _rotate_k(self, sK, tidx, stage, blk, req, kv_head, qo_len, kv_len):
        """transform_k on this thread's pairs of a K block in shared memory (``_gather_pairs``'s
        assignment); key row ``row`` is token ``blk + row`` of the request."""
        half = self.chunks // 2
        rows_per_pass = WG // half
        c = tidx % half
        base = self._k_ctx(req, kv_head, qo_len, kv_len, blk)  # once-values: per block, outside the row loop
        for r in cutlass.range(self.tile_n // rows_per_pass, unroll=1):
            row = tidx // half + r * rows_per_pass
            lo = cute.make_rmem_tensor((8,), self.dtype)
            hi = cute.make_rmem_tensor((8,), self.dtype)
            s_lo = cute.local_tile(sK[row, None, stage], (8,), (c,))
            s_hi = cute.local_tile(sK[row, None, stage], (8,), (c + half,))
            cute.autovec_copy(s_lo, lo)
            cute.autovec_copy(s_hi, hi)
            self._transform_key_pairs(base, blk + row, lo, hi, c * 8)
            cute.autovec_copy(lo, s_lo)
            cute.autovec_copy(hi, s_hi)

    # ---- variant hook helpers: plain Python, called while the kernel is traced --------------
    def _row_ctx(self, req, kv_head, row, qo_len, kv_len) -> Ctx:
        """The hook context of packed query row ``row`` (relative to the request)."""
        g = self._trace_group
        return Ctx(batch=req, qo_head=kv_head * g + row % g, kv_head=kv_head, q_pos=kv_len - qo_len + row // g,
                   qo_len=qo_len, kv_len=kv_len, head_dim=self.head_dim, sm_scale=self._trace_sm_scale)

    def _k_ctx(self, req, kv_head, qo_len, kv_len, kv_pos) -> Ctx:
        """The context of a key (transform_k): no query row.  Its once-values are evaluated here
        (a dummy call), so they are computed once per block, not per row."""
        ctx = Ctx(batch=req, kv_head=kv_head, kv_pos=kv_pos, qo_len=qo_len, kv_len=kv_len, head_dim=self.head_dim,
                  sm_scale=self._trace_sm_scale)
        self.hooks.transform_k(ctx, self._trace_vargs, Float32(0.0), Float32(0.0), Int32(0))
        return ctx

    def _transform_key_pairs(self, base, kv_pos, lo, hi, d0):
        """``transform_pairs`` for key ``kv_pos`` (a helper: a ``base.replace`` written in the
        caller's runtime loop would make the DSL carry the Ctx through it)."""
        transform_pairs(self.hooks, self._trace_vargs, base.replace(kv_pos=kv_pos), lo, hi, d0, self.dtype, query=False)

    def _clip_blocks(self, w, kv_start, first, n_blocks):
        """Blocks of an item clipped to the variant's kv_range (bounds non-decreasing in q_pos:
        the tile's first row gives the lower bound, its last row the upper)."""
        H, va, TN = self.hooks, self._trace_vargs, self.tile_n
        req, kv_head, row0, nrows, qo_len, kv_len = w.req, w.kv_head, w.row_start, w.num_rows, w.qo_len, w.kv_len
        lo, _ = H.kv_range(self._row_ctx(req, kv_head, row0, qo_len, kv_len), va)
        _, hi = H.kv_range(self._row_ctx(req, kv_head, row0 + nrows - 1, qo_len, kv_len), va)
        if hi is not None:
            nb = cutlass.select_(hi > kv_start, (hi - kv_start + TN - 1) // TN, Int32(0))
            n_blocks = cutlass.select_(nb < n_blocks, nb, n_blocks)
        if lo is not None:
            f = cutlass.select_(lo > kv_start, (lo - kv_start) // TN, Int32(0))
            first = cutlass.select_(f > first, f, first)
        return cutlass.select_(first < n_blocks, first, n_blocks), n_blocks

    def _item_rows(self, req, kv_head, row_start, tScS, qo_len, kv_len, n_rows):
        """``self._trace_rows``: per accumulator row of this thread, (ctx, kv_range lo, hi,
        mask_bits) for the item (``Hooks.row_values``: once-values evaluated here, once per
        item, and reused by the per-block calls)."""
        out = []
        for r in range(n_rows):
            ctx = self._row_ctx(req, kv_head, row_start + tScS[r, 0][0], qo_len, kv_len)
            out.append((ctx, *self.hooks.row_values(ctx, self._trace_vargs)))
        self._trace_rows = out

    def _hook_logits(self, r, kv_pos, s, kv_pos_f32, rel_pos_f32):
        """Raw q·k -> the variant's logit (natural units: the softmax's scale is log2 e, see
        ``_row_scale``) or its weight (no softmax).  The float positions come as (per-block
        base, column constant) pairs (``Ctx``)."""
        ctx = self._trace_rows[r][0].replace(kv_pos=kv_pos, kv_pos_f32=kv_pos_f32, rel_pos_f32=rel_pos_f32)
        return self.hooks.logits(ctx, self._trace_vargs, s * self._trace_sm_scale)

    def _seed_bias(self, acc_S, tScS, blk, q_pos):
        """S := the variant's bias / sm_scale for the block at blk (``Hooks.bias``), so the QK
        GEMM accumulates onto it and the softmax sees q·k + bias in q·k's units, at no cost per
        score there.  Called before the block's QK wait (a bias load's latency hides under it);
        float positions as (per-block base, column constant) pairs (``Ctx``)."""
        S = _rowcol(acc_S)
        kv_f0 = (blk + tScS[0, 0][1]).to(Float32)
        for r in range(cute.size(S, mode=[0])):
            ctx = self._trace_rows[r][0]
            rel_f0 = kv_f0 - q_pos[r].to(Float32)
            for c in range(cute.size(S, mode=[1])):
                off = float(self._trace_col_off[c])
                cc = ctx.replace(kv_pos=blk + tScS[0, c][1], kv_pos_f32=(kv_f0, off), rel_pos_f32=(rel_f0, off))
                S[r, c] = self.hooks.bias(cc, self._trace_vargs, self._trace_inv_sm_scale)

    def _hook_visible(self, r, kv_pos, ok):
        H = self.hooks
        ctx, lo, hi, _ = self._trace_rows[r]
        if H.has_mask:
            ok = H.mask(ctx.replace(kv_pos=kv_pos), self._trace_vargs, ok)
        if lo is not None:
            ok = _and(ok, kv_pos >= lo)
        if hi is not None:
            ok = _and(ok, kv_pos < hi)
        return ok

    def _mask_words(self, blk, tScS):
        """Per row of this thread, per ``mask_bits`` component: the bits of its keys of the
        block at blk as words (``bitmask.load_words``), bit j of word k = key blk + col0 + 32k +
        j.  Loaded before the block's QK wait (a variant mask tests every block), so their
        latency hides under the GEMM."""
        if not self.hooks.has_mask_bits:
            return None
        n_rows = len(self._trace_rows)
        return [[load_words(t, off + blk + tScS[0, 0][1], self._trace_col_off[-1] + 1)
                 for t, off in self._trace_rows[r][3]] for r in range(n_rows)]

    def _bits_uniform(self, words):
        """(no key visible, every key visible) to this warp's rows in the block by the bitmaps
        of ``_mask_words`` (this thread's columns only; warp-uniform votes)."""
        none_seen, all_seen = None, None
        masks = [0] * ((self._trace_col_off[-1] + 32) // 32)
        for off in self._trace_col_off:
            masks[off // 32] |= 1 << (off % 32)
        for per_row in words:
            for bits in per_row:
                for k, wd in enumerate(bits):
                    m = Uint32(masks[k])
                    x = wd & m
                    none_seen = _and(none_seen, x == Uint32(0))
                    all_seen = _and(all_seen, x == m)
        return cute.arch.vote_all_sync(none_seen), cute.arch.vote_all_sync(all_seen)

    def _bounds_ok(self, bounds: bool, kv_pos, kv_end, q_pos, window_left):
        """The item-end / causal / window test of a score, or None in a block they do not cut."""
        return self._visible(kv_pos, kv_end, q_pos, window_left) if bounds else None

    def _mask_bits_ok(self, bitmaps, c, ok):
        """``ok`` and this thread's column c in every bitmap of ``_mask_words``."""
        for words in bitmaps:
            ok = _and(ok, bit_set(words, self._trace_col_off[c]))
        return ok

    def _finalize_rows(self, row_m, row_l, tOcO, inv_t, lse, scale, w, dest, n_rows):
        """Per row of this thread: the factor O is scaled by and the LSE, with the variant's
        ``finalize`` (first_chunk: the item that starts at kv 0) or, without softmax, the
        weights' state: o = Σ w·v as is for a final row (LSE 0, -inf without keys); a split
        item writes (o / s, log2 s) with s its share of the tile's kv extent (as the planner
        cuts it: causal tiles end at their last row's diagonal), so the ⊕ merge sums them."""
        H, va, g = self.hooks, self._trace_vargs, self._trace_group
        req, kv_head, row_start, qo_len, kv_len = w.req, w.kv_head, w.row_start, w.qo_len, w.kv_len
        kv_start, kv_end = w.kv_start, w.kv_end
        ninf, zero = -Float32.inf, Float32(0.0)
        if not H.softmax:
            ext = kv_len
            if self.causal:
                last_tok = (row_start + w.num_rows - 1) // g
                ext = kv_len - qo_len + last_tok + 1
                ext = cutlass.select_(ext < kv_len, ext, kv_len)
                ext = cutlass.select_(ext > 0, ext, Int32(0))
            ext_f = Int32(cutlass.select_(ext > 0, ext, Int32(1))).to(Float32)
            w = cutlass.select_(ext > 0, Int32(kv_end - kv_start).to(Float32) / ext_f, zero)
            final = dest < 0
            inv = cutlass.select_(final, Float32(1.0), cutlass.select_(w > zero, cute.arch.rcp_approx(w), zero))
            ls = cutlass.select_(w > zero, cutlass.select_(final, zero, cute.math.log2(w, fastmath=True)), ninf)
            for r in range(n_rows):
                inv_t[r] = inv
                lse[r] = ls
            return
        for r in range(n_rows):
            l = _quad_sum(row_l[r])
            m = row_m[r] * scale  # base 2 (-inf: nothing seen)
            ctx = self._row_ctx(req, kv_head, row_start + tOcO[r, 0][0], qo_len, kv_len)
            ctx.first_chunk = kv_start == 0
            m2, l2 = H.finalize(ctx, va, m, l)
            m2u = cutlass.select_(m2 == ninf, zero, m2)
            m_use = cutlass.select_(m == ninf, m2u, m)
            ok = l2 > zero
            inv_t[r] = cutlass.select_(ok, cute.math.exp2(m_use - m2u, fastmath=True) *
                                       cute.arch.rcp_approx(cutlass.select_(ok, l2, Float32(1.0))), zero)
            lse[r] = cutlass.select_(ok, m2 + cute.math.log2(cutlass.select_(ok, l2, Float32(1.0)), fastmath=True),
                                     ninf)

    def _output_rows(self, O, tOcO, w, n_rows):
        H, va = self.hooks, self._trace_vargs
        req, kv_head, row_start, qo_len, kv_len = w.req, w.kv_head, w.row_start, w.qo_len, w.kv_len
        for r in range(n_rows):
            ctx = self._row_ctx(req, kv_head, row_start + tOcO[r, 0][0], qo_len, kv_len)
            for c in range(cute.size(O, mode=[1])):
                O[r, c] = H.output(ctx, va, O[r, c], tOcO[0, c][1])

    def _rotate_q(self, sQ, tw, wg, req, kv_head, row_start, qo_len, kv_len):
        """transform_q on this WG's 64 Q rows in shared memory, once per item (after the whole
        WG's copies landed).  (Scaling Q here by sm_scale / cap, to save the soft-cap's multiply
        per score, was measured: the extra rounding of Q moved the LSE by up to 8e-3 at cap 30
        and 0.2 with saturated logits, against the tests' 2e-3; an fp32 multiply per score it is.)  Thread tw takes chunks
        c, c + chunks/2 of rows tw // (chunks/2) + k·(WG / (chunks/2))."""
        half = self.chunks // 2
        rows_per_pass = WG // half
        c = tw % half
        g = self._trace_group
        base = Ctx(batch=req, kv_head=kv_head, qo_len=qo_len, kv_len=kv_len, head_dim=self.head_dim,
                   sm_scale=self._trace_sm_scale)
        for k in range(64 // rows_per_pass):
            j = wg * 64 + tw // half + k * rows_per_pass
            row = row_start + j
            ctx = base.replace(qo_head=kv_head * g + row % g, _fresh=True)
            lo = cute.make_rmem_tensor((8,), self.dtype)
            hi = cute.make_rmem_tensor((8,), self.dtype)
            s_lo = cute.local_tile(sQ[j, None], (8,), (c,))
            s_hi = cute.local_tile(sQ[j, None], (8,), (c + half,))
            cute.autovec_copy(s_lo, lo)
            cute.autovec_copy(s_hi, hi)
            transform_pairs(self.hooks, self._trace_vargs, ctx.replace(q_pos=kv_len - qo_len + row // g), lo, hi,
                            c * 8, self.dtype, query=True)
            cute.autovec_copy(lo, s_lo)
            cute.autovec_copy(hi, s_hi)

    # ---- consumers -----------------------------------------------------------------------
    @cute.jit
    def _consume(self, mQ, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse, sQ, sK, sV, sO, pipe_k, pipe_v,
                 mma_qk, mma_pv, cta, ct, group, scale_log2, window_left):
        TN, D, TQ = self.tile_n, self.head_dim, self.tile_q
        wg = ct // WG  # consumer warpgroup 0 / 1: packed rows [64 wg, 64 wg + 64) of the tile
        tw = ct % WG
        lane = ct % 32
        bar_wg = BAR_WG0 + wg
        thr_qk = mma_qk.get_slice(ct)
        thr_pv = mma_pv.get_slice(ct)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tScS = _rowcol(thr_qk.partition_C(cute.make_identity_tensor((TQ, TN))))
        # column c of a thread's scores is key tScS[0, 0] + _trace_col_off[c] (the same static
        # offsets for every thread; thread 0's coordinates are compile-time numbers)
        tS0 = _rowcol(mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((TQ, TN))))
        self._trace_col_off = [tS0[0, c][1] - tS0[0, 0][1] for c in range(cute.size(tS0, mode=[1]))]
        tOcO = _rowcol(thr_pv.partition_C(cute.make_identity_tensor((TQ, D))))
        tO0 = _rowcol(mma_pv.get_slice(0).partition_C(cute.make_identity_tensor((TQ, D))))
        self._o_col_off = [tO0[0, c][1] - tO0[0, 0][1] for c in range(cute.size(tO0, mode=[1]))]
        n_rows = cute.size(tScS, mode=[0])  # rows this thread holds (2)
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                  num_bits_per_copy=128)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.pingpong):
            if wg == 0:  # WG 0 goes first: pre-arrive on its own ping-pong barrier
                cute.arch.barrier_arrive(barrier_id=BAR_PINGPONG0, number_of_threads=2 * WG)

        H = self.hooks
        item_end = mWorkIndptr[cta + 1]
        if mWorkIndptr[cta] < item_end:
            self._load_q(mQ, WorkItem(mWork, mWorkIndptr[cta]), sQ, g2s, wg, tw, group)
        for item in cutlass.range(mWorkIndptr[cta], item_end, unroll=1):
            w = WorkItem(mWork, item)
            kv_head, row_start, num_rows, kv_start, kv_end = w.kv_head, w.row_start, w.num_rows, w.kv_start, w.kv_end
            dest, qo_offset, qpos_base = w.dest, w.qo_offset, w.qpos_base
            first, n_blocks = self._block_range(w, group, window_left)

            # this WG's Q rows: prefetched before the loop or during the previous item
            cute.arch.cp_async_wait_group(0)
            if const_expr(H.has_transform_q):  # rotate the WG's Q rows in place once all landed
                cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
                self._rotate_q(sQ, tw, wg, w.req, kv_head, row_start, w.qo_len, w.kv_len)
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> read by wgmma (async proxy)
            cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)

            # per-row query positions (bottom-right aligned causal / window) and softmax state
            q_pos = cute.make_rmem_tensor((n_rows,), Int32)
            for r in cutlass.range_constexpr(n_rows):
                q_pos[r] = qpos_base + (row_start + tScS[r, 0][0]) // group
            q_lo = qpos_base + row_start // group
            q_hi = qpos_base + (row_start + num_rows - 1) // group
            if const_expr(H.per_row):  # (stored by the helper: an assignment to self here would make
                # the DSL carry self through the loop)
                self._item_rows(w.req, kv_head, row_start, tScS, w.qo_len, w.kv_len, n_rows)
            row_m = cute.make_rmem_tensor((n_rows,), Float32)
            row_l = cute.make_rmem_tensor((n_rows,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TQ, D)), Float32)
            acc_O.fill(0.0)

            # Blocks from last to first.  Software pipeline within the WG: S(j) = Q K(j)^T is
            # issued together with O += P(j-1) V(j-1), and the softmax of S(j) runs while that
            # PV is still on the tensor cores; across WGs, ping-pong barriers order the GEMM
            # issue so one WG's softmax overlaps the other's GEMMs.
            rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((TQ, TN)), self.dtype)
            tOrP = cute.make_tensor(rP.iterator, _acc_to_frgA(rP.layout))
            corr = cute.make_rmem_tensor((n_rows,), Float32)
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TQ, TN)), Float32)
            if n_blocks > first:
                blk = kv_start + (n_blocks - 1) * TN
                first_words = self._mask_words(blk, tScS)
                if const_expr(H.has_bias):
                    self._seed_bias(acc_S, tScS, blk, q_pos)
                pipe_k.consumer_wait(state)
                self._qk(mma_qk, acc_S, tSrQ, tSrK, state)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(state)
                self._mask_softmax(acc_S, row_m, row_l, corr, tScS, q_pos, q_lo, q_hi, blk, kv_end, scale_log2,
                                   window_left, first_words)
                rP.store(acc_S.load().to(self.dtype))
                for j in cutlass.range(1, n_blocks - first, unroll=1):
                    blk = kv_start + (n_blocks - 1 - j) * TN
                    v_state = state.clone()
                    state.advance()
                    blk_words = self._mask_words(blk, tScS)
                    if const_expr(H.has_bias):  # S(j-1) is in rP by now
                        self._seed_bias(acc_S, tScS, blk, q_pos)
                    pipe_k.consumer_wait(state)
                    self._pingpong_wait(wg)
                    self._qk(mma_qk, acc_S, tSrQ, tSrK, state)
                    if const_expr(self.rescale_before_pv and H.softmax):
                        self._rescale_o(acc_O, corr)  # while QK runs: frees S's registers sooner (large O)
                    pipe_v.consumer_wait(v_state)  # V(j-1) lands after K(j): waited for once QK(j) is issued
                    if j == 1:
                        self._zero_v_tail(sV, v_state, kv_end - (kv_start + (n_blocks - 1) * TN), tw, bar_wg)
                    self._pv(mma_pv, acc_O, tOrP, tOrV, v_state)
                    self._pingpong_signal(wg)
                    warpgroup.wait_group(1)  # S(j) is ready; PV(j-1) may still run
                    pipe_k.consumer_release(state)
                    self._mask_softmax(acc_S, row_m, row_l, corr, tScS, q_pos, q_lo, q_hi, blk, kv_end, scale_log2,
                                       window_left, blk_words)
                    warpgroup.wait_group(0)
                    pipe_v.consumer_release(v_state)
                    rP.store(acc_S.load().to(self.dtype))
                    if const_expr(not self.rescale_before_pv and H.softmax):
                        self._rescale_o(acc_O, corr)
                if item + 1 < item_end:  # every QK of this item is done: sQ is free
                    self._load_q(mQ, WorkItem(mWork, item + 1), sQ, g2s, wg, tw, group)
                if const_expr(self.rescale_before_pv and H.softmax):
                    self._rescale_o(acc_O, corr)
                pipe_v.consumer_wait(state)
                if n_blocks - first == 1:
                    self._zero_v_tail(sV, state, kv_end - (kv_start + (n_blocks - 1) * TN), tw, bar_wg)
                self._pv(mma_pv, acc_O, tOrP, tOrV, state)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(state)
                state.advance()
            else:
                if item + 1 < item_end:  # no KV block: this item's Q is not used at all
                    self._load_q(mQ, WorkItem(mWork, item + 1), sQ, g2s, wg, tw, group)

            self._epilogue(acc_O, row_m, row_l, tOcO, sO, mO, mLse, mPartO, mPartLse, wg, tw, lane, bar_wg,
                           row_start, num_rows, dest, qo_offset, kv_head, group, scale_log2, w)

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
                for idx in cutlass.range(tw, (self.tile_n - valid) * self.chunks, WG, unroll=1):
                    cute.autovec_copy(zero, cute.local_tile(sV[valid + idx // self.chunks, None, state.index], (8,),
                                                            (idx % self.chunks,)))
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)

    @cute.jit
    def _load_q(self, mQ, w, sQ, g2s, wg, tw, group):
        """cp.async this WG's 64 packed Q rows of ``item`` into smem (GQA: packed row r is token
        r // group of head kv_head * group + r % group); rows past NUM_ROWS re-read the tile's
        row 0 (finite, never stored).  Waited for at the top of the item loop."""
        kv_head, row_start, num_rows, qo_offset = w.kv_head, w.row_start, w.num_rows, w.qo_offset
        for i in cutlass.range_constexpr(64 * self.chunks // WG):
            idx = tw + i * WG
            j = wg * 64 + idx // self.chunks
            c = idx % self.chunks
            r = row_start + (j if j < num_rows else 0)
            cute.copy(g2s, cute.local_tile(mQ[qo_offset + r // group, kv_head * group + r % group, None], (8,), (c,)),
                      cute.local_tile(sQ[j, None], (8,), (c,)))
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _qk(self, mma_qk, acc_S, tSrQ, tSrK, state):
        """Issue S = Q K(stage)^T (async; the caller waits); S += Q K^T onto the seeded biases
        when the variant has them (``_seed_bias``)."""
        warpgroup.fence()
        # a fresh atom per call: the ACCUMULATE field it carries is set here, inside the caller's
        # loop (setting it on a tiled MMA made outside the loop is a value escaping its region)
        atom = cute.make_mma_atom(mma_qk.op)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            atom.set(warpgroup.Field.ACCUMULATE, k != 0 or self.hooks.has_bias)
            cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, state.index], acc_S)
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

    @cute.jit
    def _mask_softmax(self, acc_S, row_m, row_l, corr, tScS, q_pos, q_lo, q_hi, blk, kv_end, scale_log2,
                      window_left, words):
        """Masked softmax only where some key of the block may be invisible to some row of the
        tile (the partial last block, the causal diagonal, the window's left edge)."""
        need_mask = blk + self.tile_n > kv_end
        if const_expr(self.causal):
            need_mask = need_mask | (blk + self.tile_n - 1 > q_lo)
        if const_expr(self.window):
            need_mask = need_mask | (blk < q_hi - window_left)
        # a variant mask / range masks every block per element; the bounds (item end, causal,
        # window) only where they cut the block
        if const_expr(self.hooks.bits_only):
            # the variant masks by bitmaps alone: where a warp's bits of the block are all 0 it
            # skips the softmax; where they are all 1 it takes the mask-free path (per warp:
            # rows and columns of one warp share no reduction with another warp)
            none_seen, all_seen = self._bits_uniform(words)
            if none_seen:
                acc_S.fill(0.0)
                corr.fill(1.0)
            elif need_mask:
                self._softmax(acc_S, row_m, row_l, corr, tScS, q_pos, blk, kv_end, scale_log2,
                              window_left, words, True, True)
            elif all_seen:
                self._softmax(acc_S, row_m, row_l, corr, tScS, q_pos, blk, kv_end, scale_log2,
                              window_left, words, False, False)
            else:
                self._softmax(acc_S, row_m, row_l, corr, tScS, q_pos, blk, kv_end, scale_log2,
                              window_left, words, True, False)
        elif need_mask:
            self._softmax(acc_S, row_m, row_l, corr, tScS, q_pos, blk, kv_end, scale_log2,
                          window_left, words, True, True)
        else:
            self._softmax(acc_S, row_m, row_l, corr, tScS, q_pos, blk, kv_end, scale_log2,
                          window_left, words, self.mask_all, False)

    @cute.jit
    def _softmax(self, acc_S, row_m, row_l, corr, tScS, q_pos, blk, kv_end, scale_log2,
                 window_left, words, masked: cutlass.Constexpr, bounds: cutlass.Constexpr):
        """Online softmax of one block in place: S -> P = exp2(S * scale - m * scale), l rescaled;
        the factor O must be rescaled by goes to ``corr`` (O may still be in use by a wgmma).
        ``row_m`` is kept in S's units (raw q·k, or the logits after a soft-cap or a variant's
        logits, see ``_row_scale``) so the scale folds into one FFMA per element.  Max and sum use 4 partial accumulators per row:
        one warp runs this alone while the other WG's GEMMs run, so its latency chains matter."""
        S = _rowcol(acc_S)
        ncol = cute.size(S, mode=[1])
        scale = self._row_scale(scale_log2)
        H = self.hooks
        kv_f0 = Float32(0.0)
        if const_expr(H.has_logits):
            # the float positions of ctx: a value per block (per row) plus a constant per column
            kv_f0 = (blk + tScS[0, 0][1]).to(Float32)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            if const_expr(self.soft_cap or masked or H.has_logits):
                rel_f0 = Float32(0.0)
                if const_expr(H.has_logits):
                    rel_f0 = kv_f0 - q_pos[r].to(Float32)
                bitmaps = words[r] if masked and words is not None else []
                for c in cutlass.range_constexpr(ncol):
                    v = S[r, c]
                    kv_pos = blk + tScS[0, c][1]
                    if const_expr(H.has_logits):
                        off = float(self._trace_col_off[c])
                        v = self._hook_logits(r, kv_pos, v, (kv_f0, off), (rel_f0, off))
                    elif const_expr(self.soft_cap):
                        v = self._logits(v)
                    if const_expr(masked):
                        ok = self._bounds_ok(bounds, kv_pos, kv_end, q_pos[r], window_left)
                        if const_expr(self.mask_all):
                            ok = self._hook_visible(r, kv_pos, ok)
                        v = _keep(self._mask_bits_ok(bitmaps, c, ok), v, -Float32.inf if H.softmax else Float32(0.0))
                    S[r, c] = v
            if const_expr(not H.softmax):
                corr[r] = Float32(1.0)  # weights as they are (FlashSigmoid): nothing to rescale
            else:
                m_blk = Float32(1.0)  # soft-cap with a fixed shift: tanh <= 1 (see _running_max)
                if const_expr(self.cap_fixed_shift):
                    if self._running_max(scale):
                        m_blk = self._block_max(S, r, ncol)
                else:
                    m_blk = self._block_max(S, r, ncol)
                m_new = cute.arch.fmax(row_m[r], m_blk)
                if const_expr(self.lazy_rescale):
                    # keep the running max while the block's exceeds it by at most LAZY_RESCALE
                    # in base 2 (weights <= 2^8): corr is then exactly 1 and O is not rescaled
                    m_new = cutlass.select_((m_blk - row_m[r]) * scale <= Float32(LAZY_RESCALE), row_m[r], m_new)
                m_use = m_new if m_new != -Float32.inf else Float32(0.0)  # a row with nothing visible yet
                m_scaled = m_use * scale
                # (row_m - m_use) first: exactly 0 when the max was kept, so corr is exactly 1
                corr[r] = cute.math.exp2((row_m[r] - m_use) * scale, fastmath=True)
                for c in cutlass.range_constexpr(ncol):
                    S[r, c] = cute.math.exp2(S[r, c] * scale - m_scaled, fastmath=True)
                part = [S[r, c] for c in range(4)]
                for c in cutlass.range_constexpr(4, ncol):
                    part[c % 4] = part[c % 4] + S[r, c]
                row_l[r] = row_l[r] * corr[r] + ((part[0] + part[1]) + (part[2] + part[3]))  # quad-reduced at the end
                row_m[r] = m_new

    def _block_max(self, S, r, ncol):
        """Row r's maximum over the block (4 partial maxima: shorter dependency chains)."""
        part = [S[r, c] for c in range(4)]
        for c in range(4, ncol):  # a plain helper: unrolled at trace time
            part[c % 4] = cute.arch.fmax(part[c % 4], S[r, c])
        return _quad_max(cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3])))

    def _running_max(self, scale_log2):
        """Soft-cap: whether the softmax needs a running maximum.  S holds tanh values <= 1, so
        it can subtract the bound 1 instead -- no max per score, no rescale of O per block -- as
        long as no weight underflows: 2^((t - 1)·cap·log2 e) >= 2^-126 for every t >= -1 when
        cap·log2 e <= 63 (cap <= 43.6), and a bf16 P holds such weights (``cap_fixed_shift``).
        Larger caps (Gemma 2's 50) and fp16 keep the running max.  A runtime test on a launch
        scalar: warp-uniform."""
        return scale_log2 > Float32(FIXED_SHIFT_MAX_SCALE)

    @cute.jit
    def _rescale_o(self, acc_O, corr):
        """O *= corr; with ``lazy_rescale`` only when some row of the warp has corr != 1 (its
        max moved by more than LAZY_RESCALE; the soft-cap's fixed shift never moves it)."""
        if const_expr(self.lazy_rescale):
            moved = corr[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(corr)):
                moved = moved | (corr[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                _rescale(acc_O, corr)
        else:
            _rescale(acc_O, corr)

    @cute.jit
    def _epilogue(self, acc_O, row_m, row_l, tOcO, sO, mO, mLse, mPartO, mPartLse, wg, tw, lane, bar_wg,
                  row_start, num_rows, dest, qo_offset, kv_head, group, scale_log2, w):
        """Normalize and store: final rows (value dtype + LSE) through the staging tile sO, or a
        partial slot (fp32) straight from registers."""
        D, TQ = self.head_dim, self.tile_q
        O = _rowcol(acc_O)
        n_rows = cute.size(O, mode=[0])
        lse = cute.make_rmem_tensor((n_rows,), Float32)
        scale = self._row_scale(scale_log2)  # row_m is in S's units (see _softmax)
        H = self.hooks
        if const_expr(H.has_finalize or not H.softmax):
            # variant statistics (sinks) / weights without softmax: plain-Python helper
            inv_t = cute.make_rmem_tensor((n_rows,), Float32)
            self._finalize_rows(row_m, row_l, tOcO, inv_t, lse, scale, w, dest, n_rows)
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    O[r, c] = O[r, c] * inv_t[r]
        else:
            for r in cutlass.range_constexpr(n_rows):
                l = _quad_sum(row_l[r])
                inv = Float32(0.0)
                lse[r] = -Float32.inf
                if l > Float32(0.0):
                    inv = cute.arch.rcp_approx(l)
                    lse[r] = row_m[r] * scale + cute.math.log2(l, fastmath=True)
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    O[r, c] = O[r, c] * inv
        if const_expr(H.has_output):  # final rows only: plan() disables split-KV for such variants
            self._output_rows(O, tOcO, w, n_rows)
        if dest < 0:
            # through shared memory: 16-byte stores, each row to its own (token, head) address;
            # o_cols columns per pass (column c of a thread is at the static offset
            # _o_col_off[c] from its first, which is < 8: the pass of c is known at trace time)
            OC = self.o_cols
            oc_chunks = OC // 8
            for h in cutlass.range_constexpr(D // OC):
                if const_expr(h > 0):
                    cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)  # pass h-1's reads done
                for r in cutlass.range_constexpr(n_rows):
                    j = tOcO[r, 0][0]
                    for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                        if const_expr(self._o_col_off[c] // OC == h):
                            sO[j, tOcO[0, c][1] - h * OC] = O[r, c].to(self.dtype)
                    if const_expr(h == 0):
                        if lane % 4 == 0 and j < num_rows:
                            row = row_start + j
                            mLse[qo_offset + row // group, kv_head * group + row % group] = lse[r]
                cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)
                for i in cutlass.range_constexpr(64 * oc_chunks // WG):
                    idx = tw + i * WG
                    j = wg * 64 + idx // oc_chunks
                    c = idx % oc_chunks
                    if j < num_rows:
                        row = row_start + j
                        frag = cute.make_rmem_tensor((8,), self.dtype)
                        cute.autovec_copy(cute.local_tile(sO[j, None], (8,), (c,)), frag)
                        cute.autovec_copy(frag, cute.local_tile(mO[qo_offset + row // group,
                                                                   kv_head * group + row % group, None],
                                                                (8,), (h * oc_chunks + c,)))
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


def _check_gather_swizzle(layout, TN: int, D: int):
    """``_gather_dst`` computes stage-tile addresses itself: verify at trace time that the tile is
    what it assumes -- the linear map x(row, col, stage) in elements under the 128-byte swizzle
    Swizzle<3,4,3> (which CuTe applies to byte addresses) -- so a DSL change to the smem atom
    fails the build, not the output."""
    sw = layout.inner
    if (sw.num_bits, sw.num_base, sw.num_shift) != (3, 4, 3):
        raise ValueError(f"gather: the stage tile's swizzle is not the one _gather_dst assumes ({layout})")
    for row in range(TN):
        for col in range(0, D, 8):
            for stage in range(2):
                x = stage * TN * D + (col // 64) * (TN * 64) + row * 64 + col % 64
                if cute.crd2idx((row, col, stage), layout.outer) != x:
                    raise ValueError(f"gather: the stage tile's layout is not the one _gather_dst assumes ({layout})")


def _and(ok, x):
    """``ok & x`` where ``ok`` may be None (nothing masked yet)."""
    return x if ok is None else ok & x


def _keep(ok, v, fill):
    """v where ok, else fill; v itself where nothing was masked (ok None)."""
    return v if ok is None else cutlass.select_(ok, v, fill)


@cute.jit
def _rescale(acc_O: cute.Tensor, corr: cute.Tensor):
    O = _rowcol(acc_O)
    for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
            O[r, c] = O[r, c] * corr[r]


def _rowcol(t: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator partition ((2 cols, 2 rows, N/8), M, N) as (rows, cols)."""
    l = cute.make_layout(t.layout.shape)
    s, d = l.shape, l.stride
    mn = cute.make_layout(((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
                          stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def _acc_to_frgA(l):
    """wgmma accumulator ((2,2,N/8), M, N) -> the A operand of the next wgmma from registers,
    ((2,2,2), M, (N/16, N)): two adjacent n8 column groups form one k16 step."""
    d = cute.logical_divide(l, ((None, None, 2), None, None))
    return cute.make_layout(((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1],
                             (d.shape[0][2][1], d.shape[2])),
                            stride=((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1],
                                    (d.stride[0][2][1], d.stride[2])))


_DTYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16}


def build_batch_prefill_sm90(spec):
    """The jit entry for a ``batch_prefill_sm90`` spec: the variant (if any) is re-created from
    the spec's ``variant`` text and must still have the spec's fingerprint."""
    from ..families import prefill_abi_fixed as _prefill_abi_fixed, spec_variant as _spec_variant
    from ..variants.base import abi_args

    p = spec.pdict
    variant = _spec_variant(p)
    k = BatchPrefillSm90(_DTYPES[p["dtype"]], p["head_dim"], p["tile_q"], p["paged"], p["causal"], p["soft_cap"],
                         p["window"], p.get("tile_n", 0), p.get("stages", 0), p.get("pingpong", -1),
                         p.get("page_box", 0), p.get("box_warps", 0), p.get("producer_regs", 0),
                         variant, p.get("keys_transformed", False), p.get("lazy_rescale", 1))
    return make_entry(k, _prefill_abi_fixed(p), abi_args(variant))
