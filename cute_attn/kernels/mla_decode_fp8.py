"""The paged MLA kernel over an fp8 latent cache (e4m3 / e5m2): ``mla_decode.MlaDecode`` with
the cache loaded as bytes and widened to the query dtype in shared memory.

What changes, and why:
- **A byte ring.** The ``cp.async`` stream lands in a ring of ``stages`` [32, 576]-byte
  stages (18 KB each, row-major: the 8 threads of a row write 128 contiguous bytes per
  access, one quarter-warp phase, so no swizzle is needed).  Per row the 8 threads copy ckv
  chunks t, t + 8, t + 16, t + 24 and, threads 0-3, kpe chunk t (36 chunks of 16 bytes).
- **Widened once per block, by the thread that loaded it.** After the block's ``cp.async``
  wait and the loop's first barrier (every warp is done with the previous block's tile), each
  thread converts the chunks it copied itself -- visible to it after its own wait, so no
  barrier in between -- into the one 16-bit [32, 576] tile, under the 16-bit kernel's swizzle:
  ``cvt.rn.f16x2.e4m3x2`` / ``.e5m2x2`` (``kernels/fp8.py``), then fp16 -> bf16 pairs for a
  bf16 query.  One barrier, and from there the block runs the 16-bit kernel's code unchanged:
  Q, K and V by ``ldmatrix`` from the tile, the MMA in the query dtype.
- **Exact.** Every e4m3 / e5m2 value is exactly an fp16 and a bf16 value, so the widened tile
  holds the cache's values and the MMA multiplies the query as it is (a bf16 query is not
  rounded to fp16, as the paged fp8 decode kernel must).
Cost against converting in registers after ``ldmatrix`` (``decode_fp8.py``'s way): one more
barrier per block and 36 KB of shared stores + loads of the tile; the bytes read from memory
(the decode bound) are halved either way.  Shared memory: the ring (8 / 7 stages) + one tile
+ Q staging + scores fit as the 16-bit kernel's (``families/mla.py``).

No scale reaches the kernel: as with FlashInfer's MLA wrapper, the engine folds the cache's
scale into ``sm_scale`` and the output; the kernel sees the raw fp8 values.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Int32, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .copy import cp_async_16
from .fp8 import f16x2_to_bf16x2, fp8_kind, fp8x4_to_f16x4, ld_shared_v2
from .mla_decode import BLOCK_N, D_CKV, D_QK, THREADS_PER_ROW, LoadStream, MlaDecode, smem_off

RING_ROW = D_QK  # bytes of a [ckv | kpe] fp8 row
RING_STAGE = BLOCK_N * RING_ROW  # bytes of a ring stage: 18 KB
CKV_CHUNKS = D_CKV // 16  # 16-byte fp8 chunks of a ckv row: 32
KPE_CHUNKS = (D_QK - D_CKV) // 16  # of a kpe row: 4


@dsl_user_op
def st_shared_v4(addr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    """Four Int32 to shared byte address ``addr`` (16-byte aligned)."""
    llvm.inline_asm(
        None,
        [Int32(a).ir_value(loc=loc, ip=ip) for a in (addr, w0, w1, w2, w3)],
        "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class MlaDecodeFp8(MlaDecode):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.kind = fp8_kind(cfg.kv_dtype)
        self.tile_stages = 1  # the one widened tile; ``stages`` counts the byte ring

    def _smem_fields(self, kv_layout, q_layout) -> dict:
        fields = super()._smem_fields(kv_layout, q_layout)
        fields["sRing"] = cute.struct.Align[cute.struct.MemRange[Uint8, self.stages * RING_STAGE], 128]
        return fields

    def _ring_base(self, st, sKV):
        return st.sRing.data_ptr().toint()

    def _block_tile(self, sKV, ld: LoadStream, stage):
        sK = sKV[None, None, 0]
        self._widen(ld, sK.iterator.toint(), stage)
        cute.arch.sync_threads()
        return sK

    def _chunk(self, src, dst0, dst1):
        """The 16 fp8 values at ring byte address ``src`` -> 16-bit values at ``dst0`` (the
        first 8) and ``dst1``, one 8-byte half at a time (few live registers: the loop around
        holds the output accumulators and Q)."""
        for h, dst in enumerate((dst0, dst1)):
            out = []
            for x in ld_shared_v2(src + 8 * h):
                lo, hi = fp8x4_to_f16x4(x, self.kind)
                out += [lo, hi]
            if self.dtype is not Float16:
                out = [f16x2_to_bf16x2(x) for x in out]
            st_shared_v4(dst, *out)

    @cute.jit
    def _widen(self, ld: LoadStream, tile_base: Int32, stage: Int32):
        """This thread's chunks of ring stage ``stage`` (the ones ``_issue_kv`` copied: chunks
        t + 8 k of rows r0 + i row_step) into the tile.  Every address is one of three per-thread
        bases plus a constant (the row step is a multiple of the swizzle's 8 rows, chunk 16 k + x
        of a row is x plus 2 k whole atoms), so nothing per chunk stays live across the loop."""
        t = ld.tidx % THREADS_PER_ROW
        r0 = ld.tidx // THREADS_PER_ROW
        src = ld.kv_base + stage * RING_STAGE + r0 * RING_ROW + t * 16
        dst0 = tile_base + smem_off(r0, (2 * t) // 8, (2 * t) % 8, 0, BLOCK_N) * 2
        dst1 = tile_base + smem_off(r0, (2 * t + 1) // 8, (2 * t + 1) % 8, 0, BLOCK_N) * 2
        for i in cutlass.range_constexpr(self.n_lookups):
            for k in cutlass.range_constexpr(CKV_CHUNKS // THREADS_PER_ROW + 1):
                s_off = i * self.row_step * RING_ROW + k * THREADS_PER_ROW * 16
                d_off = (i * self.row_step * 64 + 2 * k * BLOCK_N * 64) * 2
                if cutlass.const_expr(k < CKV_CHUNKS // THREADS_PER_ROW):
                    self._chunk(src + s_off, dst0 + d_off, dst1 + d_off)
                else:
                    if t < KPE_CHUNKS:  # chunk 32 + t: the kpe part
                        self._chunk(src + s_off, dst0 + d_off, dst1 + d_off)

    @cute.jit
    def _issue_kv(self, ld: LoadStream, blk_start: Int32, kv_end: Int32, stage: Int32):
        """cp.async this thread's chunks of the block's rows into ring stage ``stage``: per row,
        ckv chunks t, t + 8, t + 16, t + 24 and (t < 4) kpe chunk t."""
        t = ld.tidx % THREADS_PER_ROW
        for i in cutlass.range_constexpr(self.n_lookups):
            r, ckv, kpe = self._row_source(ld, i, blk_start, kv_end)
            row = ld.kv_base + stage * RING_STAGE + r * RING_ROW
            for k in cutlass.range_constexpr(CKV_CHUNKS // THREADS_PER_ROW):
                c = t + THREADS_PER_ROW * k
                cp_async_16(row + c * 16, ckv + c * 16)
            if t < KPE_CHUNKS:
                cp_async_16(row + (CKV_CHUNKS + t) * 16, kpe + t * 16)
