"""fp8 attention for prefill on Hopper: fp8 (e4m3) Q, K and V on the fp8 wgmma
(``m64nNk32.f32.e4m3.e4m3``), fp32 accumulation, P quantized to e4m3 for P·V, the output in
f16 / bf16.  ``prefill_sm90.BatchPrefillSm90`` with the operands in fp8; its softmax, block
walk, ping-pong and epilogue are reused as they are (``self.dtype`` is the output's dtype here,
``self.qkv`` the operands').

What changes, and why:
- **Operands in fp8.** Q (cp.async, 16-byte chunks of 16 elements), K (TMA, one box per block)
  and their stage tiles are e4m3 with the 128-byte swizzle of 128 one-byte elements; the QK
  GEMM is the fp8 wgmma with both operands in shared memory, K-major.  Keys per block: 192 at
  hd128 (``KV_TILES``; the fp8 P takes half the registers of a 16-bit one, so 192 keys keep the
  wgmmas asynchronous where the 16-bit kernel takes 112).
- **V^T.** The fp8 wgmma's B operand must be K-major: the kernel reads V^T (``[kv_heads,
  head_dim, columns]``, written by ``kernels/vt_pass.py``) by TMA as (head_dim, keys per block) boxes.
- **P without shuffles.** The fp8 A fragment (per thread and 32 keys: k positions 4t..4t+3 and
  16+4t..16+4t+3) differs from S's accumulator layout (columns 2t, 2t+1 of each n8 tile).  Each
  thread packs its own S values into its A registers (``cvt.rn.satfinite.e4m3x2.f32``, two per
  16 bits), and V^T's keys are stored in the order that gives them (``vt_key``, checked here at
  trace time for every thread: ``_p_sources``).
- **P's range.** With the lazy rescale (``prefill_sm90_softmax``) a weight is at most 2^8 = 256,
  inside e4m3's 448; weights below 2^-10 of the kept max round to 0 (the row sum is taken
  in fp32 before the rounding).  The kept max may lag the row's true max (by < 8, base 2), so
  a row's largest weight is not always exactly 1 and rounds like any other (up to 2^-4
  relative): on rows one key dominates, the output error is that rounding's, larger than
  with an exact max (FA3 rescales on every new max): measured 1.4e-2 against 5.2e-3 relative
  on logits of ~+-60 (``tests/test_fp8_attention.py``).  Rescaling on every new max would
  remove it, at the cost of the O rescales the lazy rule saves (not measured for fp8).
- **Exponentials.**  The fp8 GEMMs of a block take half the 16-bit ones' time, about what its
  exponentials need at MUFU's 16 per clock per SM (768 / 776 clk per 64 x 192 block), so the
  softmax is no longer hidden under the other warpgroup's GEMMs.  Moving 1-4 of every 8 columns'
  2^x to an FMA-pipe polynomial (FA4's trick; commit ``08ca950``) made the kernel 6-15 % slower
  on the H200 (BENCHMARKS.md); ``scripts/microbench/fp8_softmax_floor.cu`` measures why.
- **Scales.** ``sm_scale`` arrives with q_scale and k_scale folded in; v_scale multiplies O once
  per item, before the epilogue.
- **Alignment.** A block starts ``kv_start + tile_n i`` keys into its request; the plan cuts
  split-KV chunks at multiples of 32 keys (``VT_GROUP``), so each block starts on a permuted
  group of V^T.  Rows of a block past the item's end are masked (P = 0); V^T's columns there
  are the pass's zeros, the next request's keys or TMA's zero fill: finite.

Variants, soft-cap, window and paged reads are not built (the wrapper refuses them for fp8
queries; a paged cache goes through the pass, which gathers K as well)."""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum

from ..families.prefill_fp8 import VT_GROUP, vt_key
from ..variants.dsl import LOG2E
from .fragments import WG, pin_fragment, wgmma_mn_view
from .prefill_sm90 import BAR_PINGPONG0, BatchPrefillSm90, Gmem, PrefillConfig, Stages
from .prefill_sm90_softmax import ItemRows, SoftmaxState
from .prefill_sm90_tiles import SMEM_MAX
from .work import ItemInfo, TraceCtx, row_token, tok_head

# (keys per block, K / V^T stages) per head dim.  hd128: 192 keys x 2 stages ran 1.16x / 1.08x
# faster than 128 x 4 (causal / not, 2 x 8k, H200, scripts/fp8_knobs.py): fewer blocks, so fewer
# per-block barriers, max / sum reductions and rescale votes per key; 192 keys still keep the
# wgmmas asynchronous (S 96 + P 24 + O 64 registers of 240).  V^T's 192-byte rows take the
# 64-byte swizzle.  hd64: 128 x 4 (not measured otherwise).
KV_TILES = {64: (128, 4), 128: (192, 2)}
TRACE_BLOCKS, TRACE_EVENTS = 48, 16  # knob ``trace``: stamps per consumer warp (``_stamp``)


@dsl_user_op
def e4m3x4(a, b, c, d, *, loc=None, ip=None) -> Int32:
    """Four fp32 values -> one word of e4m3 bytes (a, b, c, d), a in the low byte (round to
    nearest, saturating at +-448)."""
    res = llvm.inline_asm(
        T.i32(),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "{ .reg .b16 l, h; cvt.rn.satfinite.e4m3x2.f32 l, $2, $1; cvt.rn.satfinite.e4m3x2.f32 h, $4, $3; "
        "mov.b32 $0, {l, h}; }",
        "=r,f,f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(res)


def _p_sources(mma_qk, mma_pv, TQ: int, TN: int, threads: int) -> tuple:
    """For each register byte of the PV A fragment (in register order), the index of the S
    accumulator element it takes: A element (row m, k position p) <- S (m, key p - p % 32 +
    vt_key(p % 32)).  Computed on thread 0's (compile-time) coordinates and checked for every
    thread: the map must not depend on the thread, or one table could not serve them all."""
    shape_a = mma_pv.get_slice(0).partition_shape_A((TQ, TN))
    frag = cute.make_layout(shape_a)  # a register tensor's layout: compact, column-major
    want = lambda c: (c[0], c[1] - c[1] % VT_GROUP + vt_key(c[1] % VT_GROUP))  # noqa: E731
    src = None
    for t in range(threads):
        cA = mma_pv.get_slice(t).partition_A(cute.make_identity_tensor((TQ, TN)))
        cS = mma_qk.get_slice(t).partition_C(cute.make_identity_tensor((TQ, TN)))
        n = cute.size(cS)
        where = {tuple(cS[i]): i for i in range(n)}
        by_reg = [None] * cute.size(cA)
        for i in range(cute.size(cA)):
            by_reg[frag(i)] = where.get(want(tuple(cA[i])))
        if src is None:
            src = tuple(by_reg)
            if None in src or sorted(src) != list(range(n)):
                raise ValueError(f"fp8 P: the A fragment is not a permutation of S's registers ({src})")
        elif tuple(by_reg) != src:
            raise ValueError(f"fp8 P: thread {t} needs another register map than thread 0")
    return src


class BatchPrefillFp8(BatchPrefillSm90):
    """The fp8 kernel (see the module docstring): the base's configuration with fp8 operands,
    its own host / kernel / producer / consumer loop, the base's softmax and epilogue."""

    def __init__(self, cfg: PrefillConfig, qkv_dtype):
        assert not (cfg.paged or cfg.soft_cap or cfg.window or cfg.variant is not None)
        tn, stages = KV_TILES[cfg.head_dim]
        assert (cfg.tile_n or tn) % VT_GROUP == 0
        super().__init__(dataclasses.replace(cfg, tile_n=cfg.tile_n or tn, stages=cfg.stages or stages))
        self.qkv = qkv_dtype
        self.q_chunks = self.head_dim // 16  # 16-byte chunks per Q row
        self.p_src = None  # set while tracing host_fp8 (_p_sources)
        self.trace = 0  # knob: clock stamps of the first item's blocks into mPartO (_stamp)

    # ---- host side ----------------------------------------------------------------------
    @cute.jit
    def host_fp8(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mVt: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mVtIndptr: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        sm_scale: Float32,
        v_scale: Float32,
        num_ctas: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        D, TN, TQ, f8, dt = self.head_dim, self.tile_n, self.tile_q, self.qkv, self.dtype
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, f8, D), f8)
        sQ_layout = cute.tile_to_shape(atom, (TQ, D), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (TN, D, self.stages), (0, 1, 2))
        vt_atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, f8, TN), f8)
        sVt_layout = cute.tile_to_shape(vt_atom, (D, TN, self.stages), (0, 1, 2))  # keys contiguous
        o_atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, D), dt)
        sO_layout = cute.tile_to_shape(o_atom, (TQ, D), (0, 1))
        K = warpgroup.OperandMajorMode.K
        mma_qk = sm90_utils.make_trivial_tiled_mma(f8, f8, K, K, Float32, (self.num_mma_wg, 1, 1), (64, TN))
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            f8, f8, K, K, Float32, (self.num_mma_wg, 1, 1), (64, D), warpgroup.OperandSource.RMEM
        )
        self.p_src = _p_sources(mma_qk, mma_pv, TQ, TN, WG * self.num_mma_wg)
        # K: [1, tokens, kv_heads, D] as (tokens, D, kv_heads), (TN, D) boxes; V^T: [kv_heads, D,
        # columns] as (D, columns, kv_heads), (D, TN) boxes
        k3 = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2]))
        vt3 = cute.make_tensor(mVt.iterator, cute.select(mVt.layout, mode=[1, 2, 0]))
        G2S = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tK = cpasync.make_tiled_tma_atom(G2S, k3, cute.select(sK_layout, mode=[0, 1]), (TN, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(G2S, vt3, cute.select(sVt_layout, mode=[0, 1]), (D, TN))

        @cute.struct
        class Smem:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sVt_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sO_layout)], 1024]

        if const_expr(Smem.size_in_bytes() > SMEM_MAX):
            raise ValueError(f"{Smem.size_in_bytes()} bytes of shared memory > {SMEM_MAX}: fewer stages")
        self.kernel_fp8(
            mQ,
            mK,
            mVt,
            mKvIndptr,
            mVtIndptr,
            mO,
            mLse,
            mWork,
            mWorkIndptr,
            mPartO,
            mPartLse,
            tma_k,
            tK,
            tma_v,
            tV,
            group,
            sm_scale * LOG2E,
            sm_scale,
            v_scale,
            sQ_layout,
            sO_layout,
            sK_layout,
            sVt_layout,
            mma_qk,
            mma_pv,
            Smem,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    # ---- device side --------------------------------------------------------------------
    @cute.kernel
    def kernel_fp8(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mVt: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mVtIndptr: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,
        tma_v: cute.CopyAtom,
        tV: cute.Tensor,
        group: Int32,
        scale_log2: Float32,
        sm_scale: Float32,
        v_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tc = TraceCtx(
            vargs=self.hooks.bind((), ()),
            sm_scale=sm_scale,
            group=group,
            group_div=cute.FastDivmodDivisorV2(group),
            window_left=Int32(-1),
            scale_log2=scale_log2,
        )
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        st = cutlass.utils.SmemAllocator().allocate(Smem)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = st.sV.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        sO = st.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        T_ = pipeline.Agent.Thread
        mma_threads = WG * self.num_mma_wg
        # TMA: one arming thread, transaction bytes; release is one arrive per consumer warp
        mk_pipe = lambda bar: pipeline.PipelineTmaAsync.create(  # noqa: E731
            barrier_storage=bar,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(T_, 1),
            consumer_group=pipeline.CooperativeGroup(T_, mma_threads // 32),
            tx_count=self.tile_n * self.head_dim,  # one byte per element, K and V^T alike
            defer_sync=True,
        )
        pipe_k = mk_pipe(st.mbar_k.data_ptr())
        pipe_v = mk_pipe(st.mbar_v.data_ptr())
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()
        gm = Gmem(mQ, mK, mVt, mKvIndptr, mVtIndptr, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse)
        sm = Stages(sQ, sK, sVt, sO, None, pipe_k, pipe_v)
        if tidx < WG:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self._produce_fp8(gm, tma_k, tK, tma_v, tV, sm, cta, warp_idx, tc)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consume_fp8(gm, sm, mma_qk, mma_pv, cta, tidx - WG, tc, v_scale)

    @cute.jit
    def _produce_fp8(self, gm: Gmem, tma_k, tK, tma_v, tV, sm: Stages, cta, warp_idx, tc: TraceCtx):
        """Warp 0 issues one K box and one V^T box per block, K(j) one block ahead of V(j) (as
        the base's ragged producer); V^T's columns of a request start at ``mVtIndptr[req]``."""
        mKvIndptr, mVtIndptr, mWork, mWorkIndptr = gm.mKvIndptr, gm.mKvIndices, gm.mWork, gm.mWorkIndptr
        sK, sVt, pipe_k, pipe_v = sm.sK, sm.sV, sm.pipe_k, sm.pipe_v
        TN, D = self.tile_n, self.head_dim
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if warp_idx == 0:
            for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1], unroll=1):
                info = ItemInfo(mWork, item, tc.group, tc.group_div)
                req, kv_head, kv_start = info.req, info.kv_head, info.kv_start
                first, n_blocks = self._block_range(info, tc)
                row0 = mKvIndptr[req] + kv_start
                col0 = mVtIndptr[req] + kv_start
                gK = cute.local_tile(cute.domain_offset((row0, 0), tK[None, None, kv_head]), (TN, D), (None, 0))
                gV = cute.local_tile(cute.domain_offset((0, col0), tV[None, None, kv_head]), (D, TN), (0, None))
                tKs, tKg = cpasync.tma_partition(
                    tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
                )
                tVs, tVg = cpasync.tma_partition(
                    tma_v, 0, cute.make_layout(1), cute.group_modes(sVt, 0, 2), cute.group_modes(gV, 0, 2)
                )
                for j in cutlass.range(n_blocks - first + 1, unroll=1):
                    if j < n_blocks - first:
                        pipe_k.producer_acquire(k_state)
                        cute.copy(
                            tma_k,
                            tKg[None, n_blocks - 1 - j],
                            tKs[None, k_state.index],
                            tma_bar_ptr=pipe_k.producer_get_barrier(k_state),
                        )
                        k_state.advance()
                    if j > 0:
                        pipe_v.producer_acquire(v_state)
                        cute.copy(
                            tma_v,
                            tVg[None, n_blocks - j],
                            tVs[None, v_state.index],
                            tma_bar_ptr=pipe_v.producer_get_barrier(v_state),
                        )
                        v_state.advance()

    # ---- consumers -----------------------------------------------------------------------
    @cute.jit
    def _consume_fp8(self, gm: Gmem, sm: Stages, mma_qk, mma_pv, cta, ct, tc: TraceCtx, v_scale):
        """The base's consumer loop (``BatchPrefillSm90._consume``) for fp8 operands: S(j) is
        issued with P(j-1)·V(j-1); P goes to fp8 by ``_store_p``; O is scaled by v_scale once per
        item."""
        mQ, mWork, mWorkIndptr = gm.mQ, gm.mWork, gm.mWorkIndptr
        sQ, sK, sVt, sO, pipe_k, pipe_v = sm.sQ, sm.sK, sm.sV, sm.sO, sm.pipe_k, sm.pipe_v
        group, gdiv = tc.group, tc.group_div
        TN, D, TQ = self.tile_n, self.head_dim, self.tile_q
        thr, thr_qk, thr_pv, tSrQ, tSrK, tOrV, tScS, tOcO, tc = self._wg_operands(mma_qk, mma_pv, sQ, sK, sVt, ct, tc)
        wg, tw, lane, bar_wg = thr
        n_rows = cute.size(tScS, mode=[0])
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.qkv, num_bits_per_copy=128
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=BAR_PINGPONG0, number_of_threads=2 * WG)

        item_end = mWorkIndptr[cta + 1]
        if mWorkIndptr[cta] < item_end:
            self._load_q(mQ, ItemInfo(mWork, mWorkIndptr[cta], group, gdiv), sQ, g2s, wg, tw)
        for item in cutlass.range(mWorkIndptr[cta], item_end, unroll=1):
            info = ItemInfo(mWork, item, group, gdiv)
            kv_start, kv_end = info.kv_start, info.kv_end
            first, n_blocks = self._block_range(info, tc)
            rec = item == mWorkIndptr[cta] if const_expr(self.trace) else None  # knob trace: the first item
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=bar_wg, number_of_threads=WG)

            q_pos = cute.make_rmem_tensor((n_rows,), Int32)
            for r in cutlass.range_constexpr(n_rows):
                q_pos[r] = info.qpos_base + row_token(info, info.row_start + tScS[r, 0][0])
            q_lo = info.qpos_base + row_token(info, info.row_start)
            q_hi = info.qpos_base + row_token(info, info.row_start + info.num_rows - 1)
            rows = ItemRows(tScS, q_pos, q_lo, q_hi, kv_end, None)
            row_m = cute.make_rmem_tensor((n_rows,), Float32)
            row_l = cute.make_rmem_tensor((n_rows,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TQ, D)), Float32)
            acc_O.fill(0.0)

            tOrP = mma_pv.make_fragment_A(thr_pv.partition_shape_A((TQ, TN)))
            corr = cute.make_rmem_tensor((n_rows,), Float32)
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TQ, TN)), Float32)
            st = SoftmaxState(row_m, row_l, corr)
            if n_blocks > first:
                blk = kv_start + (n_blocks - 1) * TN
                pipe_k.consumer_wait(state)
                self._qk(mma_qk, acc_S, tSrQ, tSrK, state)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(state)
                self._mask_softmax(acc_S, st, rows, blk, None, tc)
                self._store_p(acc_S, tOrP)
                for j in cutlass.range(1, n_blocks - first, unroll=1):
                    blk = kv_start + (n_blocks - 1 - j) * TN
                    sp = (rec, j, lane)
                    self._stamp(gm, sp, 0)
                    v_state = state.clone()
                    state.advance()
                    pipe_k.consumer_wait(state)
                    self._stamp(gm, sp, 1)
                    self._pingpong_wait(wg)
                    self._stamp(gm, sp, 2)
                    self._qk(mma_qk, acc_S, tSrQ, tSrK, state)
                    pipe_v.consumer_wait(v_state)
                    self._stamp(gm, sp, 3)
                    self._pv(mma_pv, acc_O, tOrP, tOrV, v_state)
                    self._pingpong_signal(wg)
                    self._stamp(gm, sp, 4)
                    warpgroup.wait_group(1)
                    self._stamp(gm, sp, 5)
                    pipe_k.consumer_release(state)
                    self._mask_softmax(acc_S, st, rows, blk, None, tc)
                    self._stamp(gm, sp, 6)
                    warpgroup.wait_group(0)
                    self._stamp(gm, sp, 7)
                    pipe_v.consumer_release(v_state)
                    self._store_p(acc_S, tOrP)
                    self._rescale_o(acc_O, corr)
                    self._stamp(gm, sp, 8)
                if item + 1 < item_end:
                    self._load_q(mQ, ItemInfo(mWork, item + 1, group, gdiv), sQ, g2s, wg, tw)
                pipe_v.consumer_wait(state)
                self._pv(mma_pv, acc_O, tOrP, tOrV, state)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(state)
                state.advance()
            else:
                if item + 1 < item_end:
                    self._load_q(mQ, ItemInfo(mWork, item + 1, group, gdiv), sQ, g2s, wg, tw)
            for r in cutlass.range_constexpr(n_rows):
                corr[r] = v_scale
            self._scale_o(acc_O, corr)
            self._epilogue(acc_O, st, tOcO, sO, gm, thr, info, tc)

    @cute.jit
    def _stamp(self, gm: Gmem, sp, event: int):
        """Knob ``trace`` (diagnostic, the output stays right): lane 0 of each consumer warp
        writes ``%clock`` at ``event`` of block j < TRACE_BLOCKS of its CTA's first item into
        mPartO read as int32 words [cta, warp, j, event] (the plan must have no split)."""
        if const_expr(self.trace):
            rec, j, lane = sp
            if rec and lane == 0 and j < TRACE_BLOCKS:
                cta, _, _ = cute.arch.block_idx()
                warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - 4
                words = cute.make_tensor(cute.recast_ptr(gm.mPartO.iterator, dtype=Int32), cute.make_layout(1 << 24))
                words[((cta * 8 + warp) * TRACE_BLOCKS + j) * TRACE_EVENTS + event] = cute.arch.clock()

    def _rescale_o(self, acc_O, corr):
        """With ``lazy_rescale=0`` (the fp8 default: the max is raised on every new maximum, so a
        row's largest weight is exactly 1 and e4m3 holds it exactly, as FA3's; the base's lazy
        rule left peaked rows 3x less accurate) O is still rescaled only where some row of the
        warp moved; ``lazy_rescale=1``: the base's lazy rule."""
        if self.lazy_rescale:
            return BatchPrefillSm90._rescale_o(self, acc_O, corr)
        return self._rescale_o_moved(acc_O, corr)

    @cute.jit
    def _rescale_o_moved(self, acc_O, corr):
        moved = corr[0] != Float32(1.0)
        for r in cutlass.range_constexpr(1, cute.size(corr)):
            moved = moved | (corr[r] != Float32(1.0))
        if cute.arch.vote_any_sync(moved):
            self._scale_o(acc_O, corr)

    @cute.jit
    def _scale_o(self, acc_O, corr):
        """O *= corr per row, unconditionally (v_scale)."""
        O = wgmma_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                O[r, c] = O[r, c] * corr[r]

    def _store_p(self, acc_S, tOrP):
        """P (fp32 in S's registers) -> the fp8 A fragment: register byte b of word w takes S
        element ``p_src[4 w + b]`` (``_p_sources``), four per ``e4m3x4``."""
        src = self.p_src
        words = cute.recast_tensor(tOrP, Int32)
        for w in range(len(src) // 4):
            words[w] = e4m3x4(*(acc_S[src[4 * w + b]] for b in range(4)))
        if const_expr(self.pin_p):
            pin_fragment(tOrP)

    @cute.jit
    def _load_q(self, mQ, info: ItemInfo, sQ, g2s, wg, tw):
        """cp.async this WG's 64 packed fp8 Q rows (16-byte chunks of 16 elements); rows past
        NUM_ROWS re-read row 0 of the tile (finite, never stored)."""
        row_start, num_rows = info.row_start, info.num_rows
        for i in cutlass.range_constexpr(64 * self.q_chunks // WG):
            idx = tw + i * WG
            j = wg * 64 + idx // self.q_chunks
            c = idx % self.q_chunks
            tok, head = tok_head(info, row_start + (j if j < num_rows else 0))
            cute.copy(g2s, cute.local_tile(mQ[tok, head, None], (16,), (c,)), cute.local_tile(sQ[j, None], (16,), (c,)))
        cute.arch.cp_async_commit_group()


def build_batch_prefill_fp8(spec):
    """The jit entry of a ``batch_prefill_fp8_sm90`` spec."""
    from ..abi.dtypes import to_dsl
    from ..families.prefill_fp8 import prefill_fp8_abi
    from ..variants.trace import make_entry

    p = spec.pdict
    cfg = PrefillConfig(
        to_dsl(p["dtype"]),
        p["head_dim"],
        p["tile_q"],
        False,
        p["causal"],
        False,
        False,
        tile_n=p.get("tile_n", 0),
        stages=p.get("stages", 0),
        pingpong=p.get("pingpong", -1),
        lazy_rescale=p.get("lazy_rescale", 0),
        pin_p=p.get("pin_p", 0),
        overlap_items=0,  # its own consumer loop (``_consume_fp8``), one Q buffer
    )
    kern = BatchPrefillFp8(cfg, to_dsl(p["qkv_dtype"]))
    kern.trace = p.get("trace", 0)
    return make_entry(kern, prefill_fp8_abi(p), [], host="host_fp8")
