"""An fp8 KV cache read by the Hopper prefill kernel itself (``prefill_sm90.py``, spec
``kv_dtype``): K and V arrive by TMA as fp8 -- ragged: one box per block; paged (page sizes
k*16): one box per 16-row page run, a lane of the issuing warp looking up each box's page --
and the producer warpgroup widens them to the query dtype in shared memory, where the 16-bit
wgmma reads them.

Why in the kernel: the other way, the KV pass (``kv_pass.py``), writes the whole cache out again
in 16 bits before the kernel starts -- 3 bytes moved per element, ~80 us at 2 x 8k x 16 heads
(1.05x / 1.10x the bf16 kernel's time, non-causal / causal, H200), and no faster than HBM allows.
Here the fp8 bytes are read once by TMA, and the widening runs on the producer warpgroup, whose
warps otherwise only issue TMA.

Staging: each tensor has fp8 tiles of ``TN x D`` bytes (16 KB at hd128) that its TMA fills
while the consumers still read the 16-bit stages, so the load's latency is off the path from a
stage's release to its refill (widening straight into the stage's own upper half, tried first,
waited for every TMA there and ran 1.36x / 1.38x the bf16 time).  With items back to back
(``overlap``) there is one per tensor, in the output staging tile ``sO`` (32 KB: 128 x 128
16-bit values), and the output goes out through the item's own Q buffer instead, free once its
QKs are done; otherwise (one Q buffer, 64-row tiles) two per tensor of their own (64 KB), which
then fit, so a memory-bound batch keeps two loads in flight.

Roles: warps 0-1 widen K, warps 2-3 V, so K's and V's TMA latencies overlap; the first warp of
a pair issues its TMA.  Per block: wait for the fp8 tile (``pipe8``: the TMA's transaction
barrier), wait for the 16-bit stage to be free (the consumers' release), widen, ``fence.proxy
.async`` (generic-proxy stores, then wgmma reads through the async proxy), arrive on the stage's
full barrier (64 threads), release the fp8 tile, and the issuing warp loads the next block into
it.  Lane l takes row l % 8 of each 8-row group and 16-byte fp8 chunks q and q + 4 (q = l // 8):
the eight lanes of a quarter-warp hit eight distinct chunk positions (the 128-byte swizzle XORs
the chunk with the row), so neither the loads nor the 16-bit stores conflict.

Widening: ``fp8.fp8x4_to_bf16x4`` for bf16 queries (integer ops and one bf16 multiply: the
``cvt`` conversions share the pipe of the softmax's exponentials; exact for finite values, NaN /
Inf bytes come out finite -- the KV pass keeps them; spec knob ``kv8_cvt=1`` widens by ``cvt``),
``cvt.rn.f16x2.e4m3x2`` (one instruction per pair) for fp16 queries.  ``k_scale`` / ``v_scale``
are folded by the wrapper (softmax scale, output), as for the pass.

Head dim 128 only: at 256 the consumers need 240 registers and leave the producer 24, too few for
a row's chunks; at 64 the fp8 rows are 64-byte atoms (another lane mapping, not written).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from ..families.prefill import KV8_HEAD_DIMS
from .fp8 import f16x2_to_bf16x2, fp8_kind, fp8x4_to_bf16x4, fp8x4_to_f16x4
from .work import ItemInfo

__all__ = ["KV8_HEAD_DIMS", "KV8_WARPS", "PrefillKv8", "check_kv8_layouts"]

KV8_WARPS = 2  # producer warps per tensor (K: warps 0-1, V: warps 2-3); the first issues the TMA


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None):
    """16 bytes at shared byte address ``addr`` (16-byte aligned) as four Int32."""
    ty = llvm.StructType.get_literal([T.i32()] * 4)
    res = llvm.inline_asm(
        ty,
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        has_side_effects=True,  # kept in order with the barrier waits and stores around it
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def st_shared_v4(addr, words, *, loc=None, ip=None) -> None:
    """Store four Int32 as 16 bytes at shared byte address ``addr`` (16-byte aligned)."""
    llvm.inline_asm(
        None,
        [Int32(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in words],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def check_kv8_layouts(s16_layout, s8_layout, TN: int, D: int):
    """The widening computes tile addresses itself: verify at trace time that the 16-bit stage
    tile and the fp8 tile are what it assumes -- atom columns of 64 (16-bit) / 128 (fp8)
    elements, ``TN x 128`` bytes each, rows of 128 bytes, Swizzle<3, 4, 3> on byte addresses --
    so a DSL change to the smem atoms fails the build, not the output."""
    for layout in (s16_layout, s8_layout):
        sw = layout.inner
        if (sw.num_bits, sw.num_base, sw.num_shift) != (3, 4, 3):
            raise ValueError(f"kv8: a tile's swizzle is not the 128-byte one the widening assumes ({layout})")
    for row in range(TN):
        for col in range(0, D, 8):
            want16 = (col // 64) * (TN * 64) + row * 64 + col % 64
            if cute.crd2idx((row, col, 0), s16_layout.outer) != want16:
                raise ValueError(f"kv8: the 16-bit stage tile is not the one the widening assumes ({s16_layout})")
            want8 = (col // 128) * (TN * 128) + row * 128 + col % 128
            if cute.crd2idx((row, col), s8_layout.outer) != want8:
                raise ValueError(f"kv8: the fp8 tile is not the one the widening assumes ({s8_layout})")


class PrefillKv8:
    """The fp8-KV producer of ``BatchPrefillSm90`` (see the module docstring)."""

    def _kv8_pipelines(self, smem, sO_range, s8_layout, mma_threads):
        """(the 16-bit stage rings' pipeline maker, (sK8, sV8, pipe_k8, pipe_v8)): the rings are
        filled by KV8_WARPS producer warps each (one arrive per thread) and released by every
        consumer thread; each fp8 staging tile comes by a one-slot TMA pipeline those warps
        consume (one release per warp).  ``sO_range``: the output staging tile's memory, which
        holds the two fp8 tiles when items run back to back (module docstring)."""
        Th = pipeline.Agent.Thread
        TN, D = self.tile_n, self.head_dim
        mk_pipe = lambda bar, d=None: pipeline.PipelineAsync.create(  # noqa: E731
            barrier_storage=bar,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(Th, 32 * KV8_WARPS),
            consumer_group=pipeline.CooperativeGroup(Th, mma_threads),
            defer_sync=True,
        )

        n8 = self.kv8_slots

        @cute.struct
        class Kv8Bars:
            mbar_k8: cute.struct.MemRange[cutlass.Int64, 2 * n8]
            mbar_v8: cute.struct.MemRange[cutlass.Int64, 2 * n8]

        @cute.struct
        class Kv8Staging:
            s8: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, 2 * n8 * TN * D], 1024]

        st = smem.allocate(Kv8Bars)
        if const_expr(self.overlap):
            assert self.tile_q * self.o_cols * (self.dtype.width // 8) >= 2 * TN * D, "sO holds both fp8 tiles"
            base = sO_range.data_ptr()
        else:
            base = smem.allocate(Kv8Staging).s8.data_ptr()
        mk_pipe8 = lambda bar: pipeline.PipelineTmaAsync.create(  # noqa: E731
            barrier_storage=bar,
            num_stages=n8,
            producer_group=pipeline.CooperativeGroup(Th, 1),
            consumer_group=pipeline.CooperativeGroup(Th, KV8_WARPS),
            tx_count=TN * D,  # one byte per element
            defer_sync=True,
        )
        ptr = cute.recast_ptr(base, s8_layout.inner, dtype=self.kv8)
        staged = cute.append(s8_layout.outer, cute.make_layout(n8, stride=TN * D))
        views = (cute.make_tensor(ptr, staged), cute.make_tensor(ptr + n8 * TN * D, staged))
        return mk_pipe, views + (mk_pipe8(st.mbar_k8.data_ptr()), mk_pipe8(st.mbar_v8.data_ptr()))

    @cute.jit
    def _produce_kv8(self, gm, tma, sm, cta, warp_idx, tc):
        """Warps 0-1 stream K, warps 2-3 V (``_stream_kv8``)."""
        tma_k, tK, tma_v, tV = tma[:4]
        if warp_idx < KV8_WARPS:
            self._stream_kv8(gm, tma_k, tK, sm.sK, sm.sK8, sm.pipe_k, sm.pipe_k8, cta, warp_idx, tc)
        else:
            self._stream_kv8(gm, tma_v, tV, sm.sV, sm.sV8, sm.pipe_v, sm.pipe_v8, cta, warp_idx - KV8_WARPS, tc)

    @cute.jit
    def _stream_kv8(self, gm, tma_x, tX, sX, sX8, pipe, pipe8, cta, w, tc):
        """One tensor's blocks, in the consumers' order (last block first), item after item:
        warp w = 0 of the pair loads each block into the fp8 tile as soon as the previous one is
        widened; both warps wait for it and for the 16-bit stage, widen their rows, fence and
        arrive on the stage's full barrier."""
        mKvIndptr, mWork, mWorkIndptr = gm.mKvIndptr, gm.mWork, gm.mWorkIndptr
        TN, D = self.tile_n, self.head_dim
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        n8 = self.kv8_slots
        load = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, n8)
        landed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, n8)
        base, src = sX.iterator.toint(), sX8.iterator.toint()
        pdiv = cute.FastDivmodDivisorV2(gm.mK.shape[1])  # paged: token -> (page, slot)
        for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1], unroll=1):
            info = ItemInfo(mWork, item, tc.group, tc.group_div)
            first, n_blocks = self._block_range(info, tc)
            tXs = tXg = None
            if const_expr(not self.paged):
                row0 = mKvIndptr[info.req] + info.kv_start
                gX = cute.local_tile(cute.domain_offset((row0, 0), tX[None, None, info.kv_head]), (TN, D), (None, 0))
                tXs, tXg = cpasync.tma_partition(
                    tma_x, 0, cute.make_layout(1), cute.group_modes(sX8, 0, 2), cute.group_modes(gX, 0, 2)
                )
            nb = n_blocks - first
            for j in cutlass.range(-n8, nb, unroll=1):  # j < 0: the first blocks' loads only
                if j >= 0:
                    pipe8.consumer_wait(landed)
                    pipe.producer_acquire(state)  # the consumers are done with the stage's last block
                    self._widen(src + landed.index * (TN * D), base + state.index * (TN * D * 2), w)
                    cute.arch.fence_view_async_shared()  # generic stores -> read by wgmma (async proxy)
                    pipe.producer_commit(state)
                    pipe8.consumer_release(landed)
                    landed.advance()
                    state.advance()
                if w == 0:
                    if j + n8 < nb:  # block j + n8 into the slot just widened, once both warps read it
                        if const_expr(self.paged):
                            self._issue_pages(gm, tma_x, tX, sX8, pipe8, load, info, n_blocks - 1 - (j + n8), pdiv)
                        else:
                            pipe8.producer_acquire(load)
                            cute.copy(
                                tma_x,
                                tXg[None, n_blocks - 1 - (j + n8)],
                                tXs[None, load.index],
                                tma_bar_ptr=pipe8.producer_get_barrier(load),
                            )
                        load.advance()

    @cute.jit
    def _issue_pages(self, gm, tma_x, tX, sX8, pipe8, load, info, block, pdiv):
        """A paged block into the staging slot ``load.index``: TN / page_box TMA boxes, each from
        its own page (lane b looks up box b's page and slot; the boxes' coordinates go to the TMA
        as warp-uniform values by shuffles, ``prefill_sm90_producer``)."""
        lane = cute.arch.lane_idx()
        pg, rw = self._box_page(
            gm.mKvIndices, lane, info.kv_start + block * self.tile_n, info.kv_end, gm.mKvIndptr[info.req], pdiv
        )
        boxes = []
        for b in cutlass.range_constexpr(self.tile_n // self.page_box):
            page = cute.arch.make_warp_uniform(cute.arch.shuffle_sync(pg, b))
            boxes.append((b, page, cute.arch.make_warp_uniform(cute.arch.shuffle_sync(rw, b))))
        pipe8.producer_acquire(load)
        self._load_pages(tma_x, tX, sX8, pipe8, load.index, boxes, cute.arch.make_warp_uniform(info.kv_head))

    @cute.jit
    def _widen(self, src, stage, w):
        """Widen the fp8 tile at shared byte address ``src`` into the 16-bit stage tile at
        ``stage``: this warp's 8-row groups w, w + KV8_WARPS, ... (the lane mapping: the module
        docstring)."""
        TN = self.tile_n
        lane = cute.arch.lane_idx()
        r8, q = lane % 8, lane // 8
        # byte offsets of this lane's chunks in a 128-byte row: fp8 chunks q (columns 16q ..,
        # widened into the first 16-bit atom column) and q + 4 (into the second); their 16-bit
        # chunks 2q and 2q + 1
        ch8 = [((q + 4 * k) ^ r8) * 16 for k in range(2)]
        ch16 = [((2 * q + h) ^ r8) * 16 for h in range(2)]
        row8 = src + (w * 8 + r8) * 128
        row16 = stage + (w * 8 + r8) * 128
        for i in cutlass.range_constexpr(TN // (8 * KV8_WARPS)):
            off = i * (8 * KV8_WARPS * 128)
            chunks = [ld_shared_v4(row8 + off + ch8[k]) for k in range(2)]
            for k in cutlass.range_constexpr(2):
                col = row16 + off + k * (TN * 128)  # 16-bit atom column k
                self._store_widened(col + ch16[0], col + ch16[1], chunks[k])

    def _store_widened(self, addr0, addr1, words):
        """16 fp8 values (four Int32) -> two 16-byte chunks of the query dtype at ``addr0`` and
        ``addr1`` (elements 0-7, 8-15)."""
        kind = fp8_kind(self.kv8)
        out = []
        for x in words:
            if const_expr(self.dtype is cutlass.BFloat16 and not self.cfg.kv8_cvt):
                a, b = fp8x4_to_bf16x4(x, kind)
            else:
                a, b = fp8x4_to_f16x4(x, kind)
                if const_expr(self.dtype is cutlass.BFloat16):
                    a, b = f16x2_to_bf16x2(a), f16x2_to_bf16x2(b)
            out += [a, b]
        st_shared_v4(addr0, out[:4])
        st_shared_v4(addr1, out[4:])
