"""Built-in variants (FlashInfer's options), written through the public interface.

Each works in decode and prefill kernels.  Natural units: ``s = q·k·sm_scale``.
"""

from __future__ import annotations

import math
from typing import Dict

from . import dsl
from .base import ScalarParam, TensorParam, Variant, register_builtin

__all__ = [
    "Causal",
    "SlidingWindow",
    "SoftCap",
    "ALiBi",
    "AttentionSink",
    "CustomMask",
    "FlashSigmoid",
    "RoPE",
    "get_alibi_slopes",
]


@register_builtin
class Causal(Variant):
    """Key ``j`` visible to the query at (bottom-right aligned) position ``p`` iff ``j <= p``.
    Kernels skip blocks past the diagonal (``causal`` and ``kv_range``)."""

    causal = True

    def kv_range(self, ctx):
        return None, ctx.q_pos + 1


@register_builtin
class SlidingWindow(Variant):
    """FlashInfer's ``window_left``: keys ``j >= p - window_left`` (with or without causal)."""

    runtime = (ScalarParam("window_left", "i32"),)

    def kv_range(self, ctx):
        return ctx.q_pos - ctx.args.window_left, None


@register_builtin
class SoftCap(Variant):
    """``cap * tanh(s / cap)`` (FlashInfer's ``logits_soft_cap``)."""

    runtime = (ScalarParam("logits_soft_cap", "f32"),)

    def logits(self, ctx, s):
        cap = ctx.args.logits_soft_cap
        rcp = ctx.once("rcp_cap", lambda: dsl.cute.arch.rcp_approx(cap))
        return cap * dsl.tanh(s * rcp)


_SLOPES: Dict[tuple, object] = {}


def get_alibi_slopes(n_heads: int):
    """ALiBi slopes as FlashInfer computes them (fp32, CPU): ``2^(-8 i / n)`` for the largest
    power of two ``n <= n_heads``, then the interleaved ``2^(-4 (2i-1) / n)`` for the rest."""
    import torch

    n = 2 ** math.floor(math.log2(n_heads))
    m = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    m += [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(n_heads - n)]
    return torch.tensor(m, dtype=torch.float32)


@register_builtin
class ALiBi(Variant):
    """``s + slope[qo_head] * (kv_pos - q_pos)`` (FlashInfer's ``pos_encoding_mode="ALIBI"``);
    slopes default to :func:`get_alibi_slopes` of the number of query heads."""

    runtime = (TensorParam("alibi_slopes", "f32", 1, rows="num_qo_heads"),)

    def fill(self, info):
        key = (info["num_qo_heads"], str(info["device"]))
        if key not in _SLOPES:
            _SLOPES[key] = get_alibi_slopes(info["num_qo_heads"]).to(info["device"])
        return {"alibi_slopes": _SLOPES[key]}

    def bias(self, ctx, scale):
        slope = ctx.once("slope", lambda: ctx.args.alibi_slopes[ctx.qo_head])
        return ctx.rel_pos_times(slope * scale)  # one FFMA per score (see Ctx.rel_pos_times)


@register_builtin
class AttentionSink(Variant):
    """A per-head sink logit (natural units, ``sinks[qo_head]``) added to every row's softmax
    denominator, as in gpt-oss and FlashInfer's ``run(..., sinks=...)``; the LSE includes it."""

    runtime = (TensorParam("sinks", "f32", 1, rows="num_qo_heads"),)

    def finalize(self, ctx, m, l):
        sink = ctx.args.sinks[ctx.qo_head] * dsl.LOG2E
        m2 = dsl.fmax(m, sink)
        l2 = l * dsl.exp2(m - m2) + dsl.exp2(sink - m2)
        return dsl.select(ctx.first_chunk, m2, m), dsl.select(ctx.first_chunk, l2, l)


@register_builtin
class CustomMask(Variant):
    """A boolean mask per request, bit-packed as FlashInfer's ``packed_custom_mask``: request
    ``b``'s ``[qo_len, kv_len]`` row-major bits start at byte ``mask_indptr[b]``, little bit
    order.  A bitmap (``mask_bits``), tested in registers by both kernels.
    ``packed_custom_mask`` is passed as int32 words holding those bytes (:meth:`words`): a
    kernel then reads a row's bits of a block with a few word loads instead of a load per byte.
    ``kv_bounds[qo_indptr[b] + i]`` = (lo, hi) of query row i of request b: no key outside
    ``[lo, hi)`` is visible to it, and both are non-decreasing in i (:func:`mask_kv_bounds`);
    as a ``kv_range`` it lets the kernels skip the blocks outside (block sparsity: a causal or
    document mask visits only its own blocks), implied by the bits (``range_in_bits``)."""

    runtime = (
        TensorParam("packed_custom_mask", "i32", 1),
        TensorParam("mask_indptr", "i32", 1),
        TensorParam("kv_bounds", "i32", 2),
        TensorParam("qo_indptr", "i32", 1),
    )
    range_in_bits = True

    def mask_bits(self, ctx):
        a = ctx.args
        row = ctx.once("mask_row", lambda: a.mask_indptr[ctx.batch] * 8 + ctx.q_idx * ctx.kv_len)
        return a.packed_custom_mask, row

    def kv_range(self, ctx):
        a = ctx.args
        row = a.qo_indptr[ctx.batch] + ctx.q_idx
        return a.kv_bounds[row, 0], a.kv_bounds[row, 1]

    @staticmethod
    def words(packed, out=None, device=None):
        """FlashInfer's packed mask bytes (uint8, any device) as int32 words (zero-padded to
        whole words), in one copy: a new tensor on ``device`` (default: ``packed``'s), or written
        into ``out`` (an int32 buffer, e.g. one a CUDA graph captured).  Its bytes
        (``.view(torch.uint8)``) are the mask again, for :func:`mask_kv_bounds`."""
        import torch

        n = packed.numel()
        nw = n // 4 + 1
        if out is None:
            out = torch.zeros(nw, dtype=torch.int32, device=packed.device if device is None else device)
        elif out.dtype != torch.int32 or out.numel() < nw:
            raise ValueError(f"the mask needs {nw} int32 words, the buffer has {out.numel()} {out.dtype}")
        else:
            out[n // 4 : nw].zero_()  # the last (partial) word's padding
        out.view(torch.uint8)[:n].copy_(packed.reshape(-1), non_blocking=True)
        return out


def mask_kv_bounds(packed, mask_indptr, qo_lens, kv_lens, out=None, chunk_bits: int = 1 << 23):
    """``CustomMask.kv_bounds`` from the packed bytes (uint8, on any device; ``mask_indptr``,
    ``qo_lens``, ``kv_lens``: per request, host ints): int32 ``[sum(qo_lens), 2]`` on
    ``packed``'s device, or written into ``out``.  Row i of a request gets lo = its first
    visible key, hi = its last + 1 (an empty row: kv_len, 0), then lo = the minimum over rows
    >= i and hi = the maximum over rows <= i: non-decreasing in i (the kernels clip a tile by
    its first row's lo and its last row's hi), still no visible key outside.

    The same dozen tensor ops for any batch (decode plans every step): rows are gathered as a
    padded [rows, max kv_len] bit matrix, ``chunk_bits`` at a time, and the per-request running
    min / max run over all rows at once, each request's values lifted above the previous one's."""
    import numpy as np
    import torch

    dev = packed.device
    qo = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
    kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    rows = int(qo.sum())
    if rows == 0:
        res = torch.zeros((1, 2), dtype=torch.int32, device=dev)
    else:
        req = np.repeat(np.arange(qo.size), qo)
        row_in_req = np.arange(rows) - np.repeat(np.cumsum(qo) - qo, qo)
        klen = kv[req]
        start = np.asarray(mask_indptr, dtype=np.int64).reshape(-1)[req] * 8 + row_in_req * klen
        lo = torch.as_tensor(klen).to(dev)  # rows that see nothing: (kv_len, 0)
        hi = torch.zeros(rows, dtype=torch.int64, device=dev)
        kmax = max(int(klen.max()), 1)
        step = max(1, chunk_bits // kmax)
        nbits = packed.numel() * 8
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            k = torch.as_tensor(klen[r0:r1]).to(dev)
            cols = torch.arange(int(klen[r0:r1].max()) if r1 > r0 else 0, device=dev)
            if cols.numel() == 0:
                continue
            bit = torch.as_tensor(start[r0:r1]).to(dev)[:, None] + cols[None, :]
            valid = (cols[None, :] < k[:, None]) & (bit < nbits)
            bit = torch.where(valid, bit, 0)
            bits = ((packed[bit >> 3] >> (bit & 7).to(torch.uint8)) & 1).bool() & valid
            seen = bits.any(1)
            b8 = bits.to(torch.uint8)
            lo[r0:r1] = torch.where(seen, b8.argmax(1), k)
            hi[r0:r1] = torch.where(seen, cols.numel() - b8.flip(1).argmax(1), 0)  # last visible + 1
        # non-decreasing within each request: lift request b's values by b * (kmax + 1), so a
        # running max / (reversed) min over all rows never crosses a request boundary
        lift = torch.as_tensor(req * (kmax + 1)).to(dev)
        hi = (hi + lift).cummax(0).values - lift
        lo = (lo + lift).flip(0).cummin(0).values.flip(0) - lift
        res = torch.stack([lo, hi], 1).to(torch.int32)
    if out is None:
        return res
    if out.dtype != torch.int32 or out.dim() != 2 or out.shape[0] < res.shape[0]:
        raise ValueError(f"the mask's kv bounds need an int32 [{res.shape[0]}, 2] buffer, got {tuple(out.shape)}")
    out[: res.shape[0]].copy_(res)
    return out


@register_builtin
class FlashSigmoid(Variant):
    """Sigmoid attention: ``out = Σ_j sigmoid(s_j + bias) · v_j`` (no softmax, no normalization;
    sigmoid through ``tanh.approx``: each weight within ~2.5e-4 absolute).
    The LSE is not meaningful (the kernel returns log2 of the fraction of the request's keys it
    saw, 0 for a whole request)."""

    softmax = False
    runtime = (ScalarParam("sigmoid_bias", "f32", default=0.0),)

    def logits(self, ctx, s):
        return dsl.sigmoid(s, ctx.args.sigmoid_bias)  # the bias folded into the tanh's FFMA


@register_builtin
class RoPE(Variant):
    """Llama RoPE fused into the Q/K loads (``pos_encoding_mode="ROPE_LLAMA"``): dims ``i`` and
    ``i + D/2`` rotate by ``pos / (rope_scale * rope_theta^(2i/D))``; a query sits at its
    bottom-right aligned position, a key at its index in the request."""

    runtime = (ScalarParam("rope_scale", "f32", default=1.0), ScalarParam("rope_theta", "f32", default=1e4))

    @staticmethod
    def _rotate(ctx, pos, lo, hi, i):
        a = ctx.args
        neg_log2_theta = ctx.once("nl2t", lambda: -dsl.log2(a.rope_theta) * (2.0 / ctx.head_dim))
        rcp_scale = ctx.once("rcps", lambda: dsl.cute.arch.rcp_approx(a.rope_scale))
        freq = rcp_scale * dsl.exp2(dsl.f32(i) * neg_log2_theta)
        sin, cos = dsl.sincos_multiple(pos, freq)  # the angle pos * freq reduced in fixed point
        return lo * cos - hi * sin, hi * cos + lo * sin

    def transform_q(self, ctx, lo, hi, i):
        return self._rotate(ctx, ctx.q_pos, lo, hi, i)

    def transform_k(self, ctx, lo, hi, i):
        return self._rotate(ctx, ctx.kv_pos, lo, hi, i)
