"""An fp8 KV cache read by the Hopper prefill kernel itself (``prefill_sm90.py``, spec
``kv_dtype``): K and V arrive by TMA as fp8 and the producer warpgroup widens them to the query
dtype in shared memory, where the 16-bit wgmma reads them.

Why in the kernel: the other way, the KV pass (``kv_pass.py``), writes the whole cache out again
in 16 bits before the kernel starts -- 3 bytes moved per element, ~80 us at 2 x 8k x 16 heads
(1.05x / 1.10x the bf16 kernel's time, non-causal / causal, H200), and no faster than HBM allows.
Here the fp8 bytes are read once by TMA, and the widening runs on the producer warpgroup, whose
warps otherwise only issue TMA.

In place, so no shared memory is added: a 16-bit stage tile of D = 128 columns is two
128-byte-swizzled atom columns (columns 0..63, then 64..127, each ``TN x 128`` bytes), and the
fp8 tile (one 128-byte atom column of ``TN x 128`` bytes, the same swizzle) is loaded into the
second.  Widening fp8 row r writes 16-bit row r: its columns 0..63 into the first atom column
(free), its columns 64..127 over the very bytes of fp8 row r (the swizzle permutes 16-byte
chunks within a row's 128 bytes only).  So a warp that owns whole rows reads all of them, syncs
its lanes (``bar.warp.sync``), then writes: no other warp's rows are touched.  Lane l takes row
l % 8 of an 8-row group and 16-byte chunks q and q + 4 (q = l // 8): the eight lanes of a
quarter-warp hit eight distinct chunk positions (the swizzle XORs the chunk with the row), so
neither the loads nor the stores conflict.

Roles: warps 0-1 widen K, warps 2-3 V, each pair on its own stage ring, so K's and V's TMA
latencies overlap (one warp per pair issues the TMA).  Per block: wait for the 16-bit stage to
be free (the consumers' release), TMA the fp8 block into its upper half (``pipe8``: the
transaction barrier), widen, ``fence.proxy.async`` (generic-proxy stores, then wgmma reads
through the async proxy), arrive on the stage's full barrier (64 threads).  Each e4m3 / e5m2
value is exactly an fp16 and a bf16 value: ``cvt.rn.f16x2.e4m3x2`` (NaN stays NaN), then
through fp32 to bf16.  ``k_scale`` / ``v_scale`` are folded by the wrapper (softmax scale,
output), as for the pass.

Head dim 128 only: at 256 the consumers need 240 registers and leave the producer 24, too few
to hold a row's chunks; at 64 a 16-bit row is one atom and the fp8 rows would straddle others.
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
        has_side_effects=True,  # kept in order with the stores and bar.warp.sync around it
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

    def _kv8_pipelines(self, smem, sK, sV, s8_layout, mma_threads):
        """(the 16-bit stage rings' pipeline maker, (sK8, sV8, pipe_k8, pipe_v8)): the rings are
        filled by KV8_WARPS producer warps each (one arrive per thread) and released by every
        consumer thread; the fp8 tiles come by a TMA pipeline those warps consume (one release
        per warp)."""
        T = pipeline.Agent.Thread
        mk_pipe = lambda bar, d=None: pipeline.PipelineAsync.create(  # noqa: E731
            barrier_storage=bar,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(T, 32 * KV8_WARPS),
            consumer_group=pipeline.CooperativeGroup(T, mma_threads),
            defer_sync=True,
        )

        @cute.struct
        class Kv8Bars:
            mbar_k8: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_v8: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]

        bars = smem.allocate(Kv8Bars)
        mk_pipe8 = lambda bar: pipeline.PipelineTmaAsync.create(  # noqa: E731
            barrier_storage=bar,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(T, 1),
            consumer_group=pipeline.CooperativeGroup(T, KV8_WARPS),
            tx_count=self.tile_n * self.head_dim,  # one byte per element
            defer_sync=True,
        )
        views = (self._kv8_view(sK, s8_layout), self._kv8_view(sV, s8_layout))
        return mk_pipe, views + (mk_pipe8(bars.mbar_k8.data_ptr()), mk_pipe8(bars.mbar_v8.data_ptr()))

    def _kv8_view(self, sX, s8_layout):
        """The fp8 tiles inside the 16-bit stage ring ``sX``: stage s's upper half (byte offset
        ``TN * D``), with the fp8 tile's swizzled layout and the ring's stage stride."""
        TN, D = self.tile_n, self.head_dim
        ptr = cute.recast_ptr(sX.iterator, s8_layout.inner, dtype=self.kv8)
        staged = cute.append(s8_layout.outer, cute.make_layout(self.stages, stride=2 * TN * D))
        return cute.make_tensor(ptr + TN * D, staged)

    @cute.jit
    def _produce_kv8(self, gm, tma, sm, cta, warp_idx, tc):
        """Warps 0-1 stream K, warps 2-3 V (``_stream_kv8``)."""
        tma_k, tK, tma_v, tV = tma
        if warp_idx < KV8_WARPS:
            self._stream_kv8(gm, tma_k, tK, sm.sK, sm.sK8, sm.pipe_k, sm.pipe_k8, cta, warp_idx, tc)
        else:
            self._stream_kv8(gm, tma_v, tV, sm.sV, sm.sV8, sm.pipe_v, sm.pipe_v8, cta, warp_idx - KV8_WARPS, tc)

    @cute.jit
    def _stream_kv8(self, gm, tma_x, tX, sX, sX8, pipe, pipe8, cta, w, tc):
        """One tensor's blocks, in the consumers' order (last block first), item after item:
        warp w = 0 of the pair waits for the 16-bit stage and issues the fp8 TMA; both warps wait
        for it to land, widen their rows, fence and arrive on the stage's full barrier."""
        mKvIndptr, mWork, mWorkIndptr = gm.mKvIndptr, gm.mWork, gm.mWorkIndptr
        TN, D = self.tile_n, self.head_dim
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        load = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        landed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        base = sX.iterator.toint()
        for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1], unroll=1):
            info = ItemInfo(mWork, item, tc.group, tc.group_div)
            first, n_blocks = self._block_range(info, tc)
            row0 = mKvIndptr[info.req] + info.kv_start
            gX = cute.local_tile(cute.domain_offset((row0, 0), tX[None, None, info.kv_head]), (TN, D), (None, 0))
            tXs, tXg = cpasync.tma_partition(
                tma_x, 0, cute.make_layout(1), cute.group_modes(sX8, 0, 2), cute.group_modes(gX, 0, 2)
            )
            for j in cutlass.range(n_blocks - first, unroll=1):
                if w == 0:
                    pipe.producer_acquire(state)  # the consumers are done with the stage's last block
                    pipe8.producer_acquire(load)
                    cute.copy(
                        tma_x,
                        tXg[None, n_blocks - 1 - j],
                        tXs[None, load.index],
                        tma_bar_ptr=pipe8.producer_get_barrier(load),
                    )
                    load.advance()
                pipe8.consumer_wait(landed)
                self._widen(base + landed.index * (TN * D * 2), w)
                cute.arch.fence_view_async_shared()  # generic stores -> read by wgmma (async proxy)
                pipe.producer_commit(state)
                pipe8.consumer_release(landed)
                landed.advance()
                state.advance()

    @cute.jit
    def _widen(self, stage, w):
        """Widen the fp8 tile in the upper half of the 16-bit stage tile at shared byte address
        ``stage`` into the whole tile: this warp's 8-row groups w, w + KV8_WARPS, ... (the
        lane mapping and the order of reads and writes: the module docstring)."""
        TN, D = self.tile_n, self.head_dim
        lane = cute.arch.lane_idx()
        r8, q = lane % 8, lane // 8
        # byte offsets of this lane's chunks in a 128-byte row: fp8 chunks q (columns 16q ..,
        # widened into the first atom column) and q + 4 (into the second, over the fp8 row);
        # their 16-bit chunks 2q and 2q + 1
        src = [((q + 4 * k) ^ r8) * 16 for k in range(2)]
        dst = [((2 * q + h) ^ r8) * 16 for h in range(2)]
        row0 = stage + (w * 8 + r8) * 128
        for i in cutlass.range_constexpr(TN // (8 * KV8_WARPS)):
            row = row0 + i * (8 * KV8_WARPS * 128)
            lo = ld_shared_v4(row + TN * D + src[0])
            hi = ld_shared_v4(row + TN * D + src[1])
            self._store_widened(row + dst[0], row + dst[1], lo)  # first atom column: nothing to clobber
            cute.arch.sync_warp()  # every lane has read its fp8 row chunks before any is overwritten
            self._store_widened(row + TN * 128 + dst[0], row + TN * 128 + dst[1], hi)

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
