"""The paged decode kernel over an fp8 KV cache (e4m3 / e5m2): ``decode.PagedDecode`` with
the cache read as bytes and multiplied in fp16.

What changes, and why:
- **Bytes in flight.** A stage holds 128 tokens (32 keys per warp) of D-byte rows, the same
  bytes as the 16-bit kernel's 64 tokens, so the pipeline depth, the shared-memory budget and
  the epilogue's buffers in a stage's K / V rows are unchanged.  The gather is the same
  16-byte ``cp.async`` stream (D / 16 chunks per row).
- **fp8 -> fp16 in registers.** The tile is stored as 16-bit pairs, [128, D / 2], under the
  same swizzle, so ``ldmatrix`` reads it conflict-free; each 32-bit register it gives holds 4
  fp8 values, converted by ``cvt.rn.f16x2.e4m3x2`` (``kernels/fp8.py``).  The MMA runs in fp16
  (every fp8 value is exactly an fp16 one); a bf16 query is converted to fp16 once per item.
- **K: a permuted contraction.** ``ldmatrix`` gives a thread the 4 consecutive head-dim
  elements 4j .. 4j+3 of a 16-element step where m16n8k16 expects 2j, 2j+1, 2j+8, 2j+9.  A dot
  product does not care about the order of its terms as long as Q and K agree, so Q is loaded
  in the same order (one 8-byte shared load per row and step) and no shuffle is needed.
- **V: permuted output columns.** The transposing ``ldmatrix`` of the pair tile gives a thread
  two keys x two adjacent head-dim columns; one ``prmt`` regroups them by column.  So the
  accumulator's n8 tile 2t holds the even columns of the 16 columns 16t .. 16t+15 and tile
  2t+1 the odd ones: the epilogue writes column ``_o_col(c)``.
- In-kernel key / query transforms (RoPE) would see permuted head-dim positions: refused.

``k_scale`` / ``v_scale`` never reach the kernel: the wrapper folds ``k_scale`` into the softmax
scale and applies ``v_scale`` to the output, as FlashInfer does.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float16, Int32

from .decode import BLOCK_N, TILE_Q, DecodeConfig, PagedDecode
from .fp8 import bf16x2_to_f16x2, fp8_kind, fp8x4_to_f16x4, fp8x4_to_f16x4_interleaved, ld_shared_v2


class PagedDecodeFp8(PagedDecode):
    kv_bytes = 1
    block_n = 2 * BLOCK_N

    def __init__(self, cfg: DecodeConfig):
        super().__init__(cfg)
        self.kind = fp8_kind(cfg.kv_dtype)
        self.mma_dtype = Float16
        if self.hooks.has_transform_q or self.hooks.has_transform_k:
            raise NotImplementedError("fp8 KV decode with an in-kernel query / key transform (RoPE)")

    def _q_fragment(self, thr_mma, sQ_i):
        return cute.make_rmem_tensor(thr_mma.partition_shape_A((TILE_Q, self.head_dim)), Float16)

    def _load_q(self, s2r_q, sQ_i, tSrQ, lane, sQ, buf):
        """Q rows g and g+8 (g = lane / 4) in K's permuted order: for step s, registers lo / hi
        take elements 16s + 4j .. 4j+3 (j = lane % 4), one 8-byte load per row and step."""
        D = self.head_dim
        g, j = lane // 4, lane % 4
        q32 = cute.recast_tensor(tSrQ, Int32)  # 4 per step: (row g, lo), (g+8, lo), (g, hi), (g+8, hi)
        base = sQ.iterator.toint()
        for s in range(D // 16):
            for h in range(2):
                off = self._smem_off(g + 8 * h, 2 * s + j // 2, buf, TILE_Q, D) + (j % 2) * 4
                w0, w1 = ld_shared_v2(base + off * 2)
                if self.dtype is not Float16:
                    w0, w1 = bf16x2_to_f16x2(w0), bf16x2_to_f16x2(w1)
                q32[4 * s + h] = w0
                q32[4 * s + 2 + h] = w1

    def _load_k(self, thr_mma, s2r_k, sK_w):
        """ldmatrix of the [KW, D / 2] pair tile (virtual step v = fp8 elements 32v .. 32v+31),
        then each register's 4 bytes -> the two registers of physical step 2v (first 8 pairs) or
        2v + 1 (last 8)."""
        KW = self.keys_per_warp
        raw = thr_mma.make_fragment_B(thr_mma.partition_B(sK_w))
        cute.copy(s2r_k, s2r_k.partition_S(sK_w), s2r_k.retile(raw))
        raw32 = cute.recast_tensor(raw, Int32)  # (r, n tile, virtual step): r + 2 nt + 2 NT v
        frag = cute.make_rmem_tensor(thr_mma.partition_shape_B((KW, self.head_dim)), Float16)
        f32 = cute.recast_tensor(frag, Int32)  # (r, n tile, step): r + 2 nt + 2 NT s
        NT = KW // 8
        for v in range(self.kv_width // 16):
            for nt in range(NT):
                for r in range(2):
                    lo, hi = fp8x4_to_f16x4(raw32[r + 2 * nt + 2 * NT * v], self.kind)
                    s = 2 * v + r
                    f32[2 * nt + 2 * NT * s] = lo
                    f32[1 + 2 * nt + 2 * NT * s] = hi
        return frag

    def _load_v(self, thr_mma, s2r_v, sV_w):
        """Transposing ldmatrix of the pair tile seen as [D / 2, KW] (virtual n tile t = head-dim
        columns 16t .. 16t+15), then per register: even columns -> n tile 2t, odd -> 2t + 1."""
        D, KW, W = self.head_dim, self.keys_per_warp, self.kv_width
        sVt_w = cute.composition(sV_w, cute.make_layout((W, KW), stride=(KW, 1)))
        raw = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_w))
        cute.copy(s2r_v, s2r_v.partition_S(sVt_w), s2r_v.retile(raw))
        raw32 = cute.recast_tensor(raw, Int32)  # (r, virtual n tile, k step): r + 2 t + (W / 4) ks
        frag = cute.make_rmem_tensor(thr_mma.partition_shape_B((D, KW)), Float16)
        f32 = cute.recast_tensor(frag, Int32)  # (r, n tile, k step): r + 2 n + (D / 4) ks
        for ks in range(KW // 16):
            for t in range(W // 8):
                for r in range(2):
                    ev, od = fp8x4_to_f16x4_interleaved(raw32[r + 2 * t + (W // 4) * ks], self.kind)
                    f32[r + 2 * (2 * t) + (D // 4) * ks] = ev
                    f32[r + 2 * (2 * t + 1) + (D // 4) * ks] = od
        return frag

    def _o_col(self, c: int) -> int:
        """Accumulator column c = 8 n + g of n tile n -> head-dim column 16 (n / 2) + 2 g + n % 2."""
        n, g = c // 8, c % 8
        return 16 * (n // 2) + 2 * g + n % 2
