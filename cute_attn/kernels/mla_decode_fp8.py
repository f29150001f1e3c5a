"""The paged MLA kernel over an fp8 latent cache (e4m3 / e5m2): ``mla_decode.MlaDecode`` with
the cache kept as bytes in shared memory and converted to fp16 in registers.

What changes, and why:
- **A swizzled byte ring.** The ``cp.async`` stream lands in ``stages`` [32, 576]-byte stages
  (18 KB each; half the 16-bit kernel's, so twice the stages hold the same bytes in flight).
  A stage is four 128-byte column atoms of ckv ([32 rows, 128 bytes] each, 16-byte chunk
  ``b`` of row ``r`` at ``b ^ (r % 8)``) and the kpe part ([32, 64], chunk ``b`` at
  ``b ^ (r / 2 % 4)``): eight rows of one chunk column, what one ``ldmatrix`` matrix reads,
  hit eight different 16-byte bank groups in both.
- **K: one ``ldmatrix.x4`` per k16 step, a permuted contraction.** Read as 16-bit pairs, the
  32 rows x one 16-byte chunk are four 8 x 8 matrices (one per n8 tile of keys); each lane's
  register holds fp8 columns 4j .. 4j + 3 of its key (j = lane % 4), where m16n8k16 expects
  2j, 2j + 1, 2j + 8, 2j + 9.  ``cvt.rn.f16x2.e4m3x2`` makes the two fp16 registers of the
  step.  A dot product does not care about the order of its terms as long as Q agrees, so Q
  is loaded from its staging tile in the same order (one 8-byte shared load per row and step).
- **V: transposing ``ldmatrix``, permuted output columns.** A transposed 8 x 8 pair matrix
  gives a lane two keys x two adjacent columns; one ``prmt`` regroups them by column (the
  paged fp8 decode kernel's way, ``decode_fp8.py``).  So the accumulator's n8 tile 2u holds
  the even and tile 2u + 1 the odd columns of the 16 columns 16u .. 16u + 15, and a lane's
  four values of a pair of tiles are the 4 adjacent output columns 16u + 4j .. + 3: one
  vector store each (``_out_vectors``).
- **fp16 MMAs.** Every e4m3 / e5m2 value is exactly an fp16 value; a bf16 query is converted
  to fp16 once per item (fp16 holds a bf16 value to its full precision between 6e-5 and 65504;
  larger magnitudes overflow, as in the paged fp8 decode kernel) and P is rounded to fp16.
- Nothing else changes: the load cursor and page lookups, the score exchange, the softmax,
  the epilogue's rows and LSE are the 16-bit kernel's code.

Against widening the stage to a 16-bit tile in shared memory first (this kernel's first
form): no second barrier per block and no 36 KB of tile stores and loads; the conversions
(72 ``cvt`` per lane and block for K, 64 + 32 ``prmt`` for V) are issued between MMAs.

No scale reaches the kernel: as with FlashInfer's MLA wrapper, the engine folds the cache's
scale into ``sm_scale`` and the output; the kernel sees the raw fp8 values.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Int32, Uint8

from .copy import cp_async_16
from .fp8 import bf16x2_to_f16x2, fp8_kind, fp8x4_to_f16x4, fp8x4_to_f16x4_interleaved, ld_shared_v2
from .ldmatrix import ldmatrix_x4
from .mla_decode import BLOCK_N, D_CKV, D_QK, O_COLS, ROWS, THREADS_PER_ROW, LoadStream, MlaDecode, smem_off

RING_ROW = D_QK  # bytes of a [ckv | kpe] fp8 row
RING_STAGE = BLOCK_N * RING_ROW  # bytes of a ring stage: 18 KB
CKV_ATOM = BLOCK_N * 128  # bytes of one 128-byte-wide column atom of a stage
KPE_BASE = (D_CKV // 128) * CKV_ATOM  # where a stage's kpe part starts
CKV_CHUNKS = D_CKV // 16  # 16-byte fp8 chunks of a ckv row: 32
KPE_CHUNKS = (D_QK - D_CKV) // 16  # of a kpe row: 4


def ckv_off(r, atom, b):
    """Byte offset in a stage of row r, ckv chunk 8 atom + b (b < 8)."""
    return atom * CKV_ATOM + r * 128 + (b ^ (r % 8)) * 16


def kpe_off(r, b):
    """Byte offset in a stage of row r, kpe chunk b (b < 4)."""
    return KPE_BASE + r * 64 + (b ^ ((r // 2) % 4)) * 16


class MlaDecodeFp8(MlaDecode):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.kind = fp8_kind(cfg.kv_dtype)
        self.mma_dtype = Float16
        self.tile_stages = 1  # no 16-bit tiles: the ring holds bytes (``stages`` counts it)

    def _smem_fields(self, kv_layout, q_layout) -> dict:
        fields = super()._smem_fields(kv_layout, q_layout)
        del fields["sKV"]
        fields["sRing"] = cute.struct.Align[cute.struct.MemRange[Uint8, self.stages * RING_STAGE], 128]
        return fields

    def _kv_tiles(self, st, kv_layout):
        return None

    def _ring_base(self, st, sKV):
        return st.sRing.data_ptr().toint()

    def _block_tile(self, sKV, ld: LoadStream, stage):
        """The block's stage, as its shared byte address."""
        return ld.kv_base + stage * RING_STAGE

    # ---- Q and K in the permuted contraction order ------------------------------------------
    def _q_fragments(self, thr_mma, sQ, grp, wg):
        return (
            cute.make_rmem_tensor(thr_mma.partition_shape_A((ROWS, O_COLS)), Float16),
            cute.make_rmem_tensor(thr_mma.partition_shape_A((ROWS, 16)), Float16),
        )

    def _load_q(self, s2r_q, sQ, tSrQ, grp, wg, lane):
        """Rows g and g + 8 of the warp's group (g = lane / 4), per k16 step registers lo / hi
        = elements 4j .. 4j + 1 / 4j + 2 .. 4j + 3 of the step (j = lane % 4): one 8-byte load
        per row and step from the staging tile (16-bit, ``smem_off``'s layout)."""
        g, j = lane // 4, lane % 4
        base = sQ.iterator.toint()
        steps = [(tSrQ[0], s, 16 * wg + 2 * s) for s in range(O_COLS // 16)]  # ckv steps: chunk 16 wg + 2 s
        steps.append((tSrQ[1], 0, D_CKV // 8 + 2 * wg))  # the kpe step wg
        for frag, s, chunk0 in steps:
            q32 = cute.recast_tensor(frag, Int32)  # 4 per step: (g, lo), (g + 8, lo), (g, hi), (g + 8, hi)
            chunk = chunk0 + j // 2  # 16-byte chunk (8 elements) of the 576-wide row
            for h in range(2):
                off = smem_off(grp * ROWS + g + 8 * h, chunk // 8, chunk % 8, 0, self.tile_q) + (j % 2) * 4
                w0, w1 = ld_shared_v2(base + off * 2)
                if self.dtype is not Float16:
                    w0, w1 = bf16x2_to_f16x2(w0), bf16x2_to_f16x2(w1)
                q32[4 * s + h] = w0
                q32[4 * s + 2 + h] = w1

    def _k_step(self, thr_mma, addr):
        """The B operand of one k16 step for the block's 32 keys: one ldmatrix.x4 at this lane's
        row address (key = lane), each register's 4 bytes -> the n8 tile's two fp16 registers."""
        frag = cute.make_rmem_tensor(thr_mma.partition_shape_B((BLOCK_N, 16)), Float16)
        f32 = cute.recast_tensor(frag, Int32)  # (r, n tile): r + 2 nt
        for nt, w in enumerate(ldmatrix_x4(addr)):
            lo, hi = fp8x4_to_f16x4(w, self.kind)
            f32[2 * nt] = lo
            f32[2 * nt + 1] = hi
        return frag

    def _scores(self, tiled_mma, thr_mma, s2r_k, acc_S, tSrQ, stage, wg, lane):
        q_c, q_p = tSrQ
        for s in range(O_COLS // 16):
            k = self._k_step(thr_mma, stage + ckv_off(lane, wg, s))
            cute.gemm(tiled_mma, acc_S, q_c[None, None, s], k[None, None, 0], acc_S)
        k = self._k_step(thr_mma, stage + kpe_off(lane, wg))
        cute.gemm(tiled_mma, acc_S, q_p[None, None, 0], k[None, None, 0], acc_S)

    # ---- V by column pairs, and where the columns go ----------------------------------------
    def _v_step(self, thr_mma, s2r_v, stage, k, wg, lane):
        """Keys [16 k, 16 k + 16) x the warp's 128 columns: per 32 columns one transposing
        ldmatrix.x4 (matrices: keys 0-7 / 8-15 of chunk 2p, then of chunk 2p + 1); each
        register -> an even-column and an odd-column fp16 pair (tiles 2u and 2u + 1)."""
        m = lane // 8
        row = 16 * k + 8 * (m % 2) + lane % 8
        frag = cute.make_rmem_tensor(thr_mma.partition_shape_B((O_COLS, 16)), Float16)
        f32 = cute.recast_tensor(frag, Int32)  # (r, n tile): r + 2 n
        for p in range(O_COLS // 32):
            regs = ldmatrix_x4(stage + ckv_off(row, wg, 2 * p + m // 2), trans=True)
            for q in range(2):
                u = 2 * p + q
                for r in range(2):
                    ev, od = fp8x4_to_f16x4_interleaved(regs[2 * q + r], self.kind)
                    f32[r + 2 * (2 * u)] = ev
                    f32[r + 2 * (2 * u + 1)] = od
        return frag

    def _out_vectors(self, tOcO):
        """Tiles 2u and 2u + 1 hold output columns 16u + 4j .. 16u + 4j + 3 of this lane as
        (2u, e0), (2u + 1, e0), (2u, e1), (2u + 1, e1): mn-view columns 4u, 4u + 2, 4u + 1, 4u + 3."""
        col_j = 2 * tOcO[0, 0][1]  # tile 0's first column is 2j
        return [(16 * u + col_j, (4 * u, 4 * u + 2, 4 * u + 1, 4 * u + 3)) for u in range(O_COLS // 16)]

    # ---- loads -------------------------------------------------------------------------------
    @cute.jit
    def _issue_kv(self, ld: LoadStream, blk_start: Int32, kv_end: Int32, stage: Int32, head: Int32):
        """cp.async this thread's chunks of the block's rows into ring stage ``stage``: per row,
        ckv chunks t, t + 8, t + 16, t + 24 (one per atom: the row's 8 threads fill an atom row's
        128 bytes) and, threads t < 4, kpe chunk t."""
        t = ld.tidx % THREADS_PER_ROW
        for i in cutlass.range_constexpr(self.n_lookups):
            r, ckv, kpe = self._row_source(ld, i, blk_start, kv_end)
            dst = ld.kv_base + stage * RING_STAGE
            for a in cutlass.range_constexpr(CKV_CHUNKS // THREADS_PER_ROW):
                cp_async_16(dst + ckv_off(r, a, t), ckv + (t + THREADS_PER_ROW * a) * 16)
            if t < KPE_CHUNKS:
                cp_async_16(dst + kpe_off(r, t), kpe + t * 16)
