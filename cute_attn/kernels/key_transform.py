"""The key-transform pass: a variant's ``transform_k`` (RoPE) over every key of a ragged batch,
out of place, before the prefill kernel runs.

Why a pass: a key transform depends only on the key (its position, head, request), yet inside
the attention kernel every query tile that reads a K block would transform it again -- and the
producer could not do it on a TMA-written tile without another barrier, so such kernels fell
back to the cp.async gather (1.84x the plain kernel's time at 2 x 8k causal, hd128).  Here each
key is read, transformed and written once (memory-bound: 2 x the K bytes), and the prefill
kernel (spec ``keys_transformed``) reads the result by TMA like plain K; only Q is transformed
in the kernel, once per work item.

Work split: a thread takes chunks ``c`` and ``c + D/16`` of key rows (token, kv head): the 8
pairs of dims (d, d + D/2) a RoPE-style transform combines, 2 x 16 bytes per row; ``c`` is
fixed per thread.  Rows are numbered token-major and walked by a grid-stride loop, two per
iteration, so each thread's tokens only increase and the request of a token is found by a
cursor over ``kv_indptr`` that only moves forward.  The loop
bound (``kv_indptr[batch]``) is read on the device: a captured graph replays any plan whose
indptr lies in the same buffer (unused tail entries repeat the last offset: empty requests).
Plain SIMT loads and stores, so nothing here is Hopper-specific.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..variants.base import Ctx, Hooks
from ..variants.trace import make_entry, transform_pairs

THREADS = 256


class KeyTransform:
    def __init__(self, dtype, head_dim: int, variant):
        self.hooks = Hooks(variant)
        if not self.hooks.has_transform_k:
            raise ValueError(f"key_transform: variant {variant!r} has no transform_k")
        self.dtype, self.head_dim = dtype, head_dim
        self.half = head_dim // 16  # threads per key row: each takes 16-byte chunks c and c + half
        self.rows_per_cta = THREADS // self.half

    @cute.jit
    def host(self, mK: cute.Tensor, mKout: cute.Tensor, mQoIndptr: cute.Tensor, mKvIndptr: cute.Tensor,
             batch: Int32, sm_scale: Float32, num_ctas: Int32, var_tensors: tuple, var_scalars: tuple,
             stream: cuda.CUstream):
        """``mK`` / ``mKout``: ``[1, tokens, kv_heads, head_dim]`` (the prefill kernel's ragged
        view); ``num_ctas``: the grid (the wrapper passes 8 per SM: 2048 threads, each with 32
        bytes in flight, cover the HBM latency)."""
        self.kernel(mK, mKout, mQoIndptr, mKvIndptr, batch, sm_scale, var_tensors, var_scalars).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mKout: cute.Tensor, mQoIndptr: cute.Tensor, mKvIndptr: cute.Tensor,
               batch: Int32, sm_scale: Float32, var_tensors: tuple, var_scalars: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        H, half = self.hooks, self.half
        vargs = H.bind(var_tensors, var_scalars)
        heads = cute.FastDivmodDivisorV2(mK.shape[2])  # row -> (token, head): multiply-high, no division
        # thread t always takes chunk pair c = t % half of its rows (the stride is a multiple of
        # the rows per CTA), so what a transform computes per dimension (RoPE's frequencies) is
        # loop-invariant and computed once
        c = tidx % half
        stride = nctas * self.rows_per_cta
        end = mKvIndptr[batch] * heads.divisor
        req = Int32(0)
        kv_start, kv_end = mKvIndptr[0], mKvIndptr[1]
        # two rows per iteration, both loaded before either is transformed (more bytes in flight)
        first = kv_start * heads.divisor + cta * self.rows_per_cta + tidx // half
        for r0 in cutlass.range(first, end, 2 * stride, unroll=1):
            rows = [r0, r0 + stride]
            lo = [cute.make_rmem_tensor((8,), self.dtype) for _ in rows]
            hi = [cute.make_rmem_tensor((8,), self.dtype) for _ in rows]
            token, head = [], []
            for i in cutlass.range_constexpr(2):
                t, h = divmod(cutlass.min(rows[i], end - 1), heads)  # a past-the-end row re-reads the last
                token.append(t)
                head.append(h)
                src = mK[0, t, h, None]
                cute.autovec_copy(cute.local_tile(src, (8,), (c,)), lo[i])
                cute.autovec_copy(cute.local_tile(src, (8,), (c + half,)), hi[i])
            for i in cutlass.range_constexpr(2):
                while token[i] >= kv_end:  # the next non-empty request (kv_indptr is non-decreasing)
                    req += 1
                    kv_start = kv_end
                    kv_end = mKvIndptr[req + 1]
                self._transform_row(req, head[i], token[i] - kv_start, mQoIndptr[req + 1] - mQoIndptr[req],
                                    kv_end - kv_start, sm_scale, vargs, lo[i], hi[i], c)
            for i in cutlass.range_constexpr(2):
                if rows[i] < end:
                    dst = mKout[0, token[i], head[i], None]
                    cute.autovec_copy(lo[i], cute.local_tile(dst, (8,), (c,)))
                    cute.autovec_copy(hi[i], cute.local_tile(dst, (8,), (c + half,)))

    def _transform_row(self, req, head, kv_pos, qo_len, kv_len, sm_scale, vargs, lo, hi, c):
        """transform_k on one row's chunk pair (a helper: the Ctx stays out of the kernel's loop)."""
        ctx = Ctx(batch=req, kv_head=head, kv_pos=kv_pos, qo_len=qo_len, kv_len=kv_len, head_dim=self.head_dim,
                  sm_scale=sm_scale)
        transform_pairs(self.hooks, vargs, ctx, lo, hi, c * 8, self.dtype, query=False)


_DTYPES = {"f16": cutlass.Float16, "bf16": cutlass.BFloat16}


def build_key_transform(spec):
    """The jit entry of a ``key_transform`` spec (dtype, head_dim, variant, variant_fp)."""
    from ..families import key_transform_abi_fixed, spec_variant
    from ..variants.base import abi_args

    p = spec.pdict
    variant = spec_variant(p)
    return make_entry(KeyTransform(_DTYPES[p["dtype"]], p["head_dim"], variant), key_transform_abi_fixed(p),
                      abi_args(variant))
