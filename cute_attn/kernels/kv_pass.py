"""The KV pass: one memory-bound sweep over a batch's keys (and values) before the prefill
kernel, so that the kernel reads plain contiguous K/V by TMA.  Three jobs, one mechanism:

* ``transform_k`` (RoPE): a key transform depends only on the key (its position, head,
  request), yet inside the attention kernel every query tile that reads a K block would
  transform it again -- and the producer cannot transform a TMA-written tile without another
  barrier, so such kernels fall back to the cp.async gather (1.84x the plain kernel's time at
  2 x 8k causal, hd128).  Here each key is read, transformed and written once.
* ``paged``: the gather of a paged cache into contiguous ``[1, tokens, kv_heads, head_dim]``
  K and V (token t of request b in page ``kv_indices[page_indptr[b] + t // page_size]``, slot
  ``t % page_size``).  A cache whose pages are not whole TMA boxes (page sizes other than
  multiples of 16, page 1 above all) is otherwise gathered inside the kernel by 16-byte
  ``cp.async``, for every query tile that reads a block, at 15-20 % of the TMA kernel's time
  (BENCHMARKS.md); this pass reads the cache once and writes it once.
* ``kv_dtype`` (an fp8 cache, e4m3 / e5m2): K and V are read as fp8 and written in the query
  dtype, so the unchanged 16-bit wgmma kernel runs on them.  Prefill at long lengths is
  compute-bound and this is one sweep (1 byte read, 2 written per element), cheaper than an
  fp8 path inside the kernel's pipeline.  Every e4m3 / e5m2 value is exactly an fp16 and a
  bf16 value, so the conversion is exact: ``cvt.rn.f16x2.e4m3x2`` (or ``.e5m2x2``; sm_89+),
  then fp16 -> fp32 -> bf16 for a bf16 output (PTX has no fp8 -> bf16x2 before ISA 9.2).
  ``k_scale`` / ``v_scale`` are not applied here: the wrapper folds ``k_scale`` into the
  softmax scale and multiplies the output by ``v_scale`` (FlashInfer's semantics).

Any combination at once; a ragged 16-bit batch without a key transform has nothing to do here
(the builder refuses it).  The wrapper decides when the gather pays
(``families.backends.kv_pass_pays``): its cost is 2 x the bytes moved, the kernel's saving a
share of its own time, which grows with the queries per key; an fp8 cache always takes it.

Work split: a thread takes chunks ``c`` and ``c + half`` of 16 bytes of input of rows (token,
kv head) -- 8 elements of a 16-bit cache, 16 of an fp8 one (``half`` = D / 16 or D / 32
threads per row) -- so its loads are 16 bytes wide whatever the cache dtype, and each chunk
pair holds the pairs of dims (d, d + D/2) a RoPE-style transform combines; ``c`` is fixed per
thread.  A converted chunk is stored as 16-byte pieces (two for fp8).  Rows are numbered
token-major and walked by a grid-stride loop, two per iteration, so each thread's tokens only
increase and the request of a token is found by a cursor over ``kv_indptr`` (tokens) that
only moves forward.  The loop bound (``kv_indptr[batch]``) is read on the device: a captured
graph replays any plan whose indptr lies in the same buffer (unused tail entries repeat the
last offset: empty requests).  Plain SIMT loads and stores, so nothing here is
Hopper-specific.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from ..variants.base import Ctx, Hooks
from ..variants.trace import make_entry, transform_pairs
from .fp8 import f16x2_to_bf16x2, fp8_kind, fp8x4_to_f16x4
from .pages import in_cache
from .work import TraceCtx

THREADS = 256


class KeyRow(NamedTuple):
    """One row (token, kv head) of the pass as its key transform sees it: the request, the kv
    head, the key's position in the request and the request's lengths."""

    req: Any
    head: Any
    kv_pos: Any
    qo_len: Any
    kv_len: Any


class KvPass:
    def __init__(self, dtype, head_dim: int, paged: bool, variant, kv_dtype=None):
        """``dtype``: the outputs'; ``kv_dtype``: an fp8 cache's DSL type (None: ``dtype``)."""
        self.hooks = Hooks(variant)
        self.transform = self.hooks.has_transform_k
        self.convert = kv_dtype is not None
        if not (paged or self.transform or self.convert):
            raise ValueError(f"kv_pass: a ragged batch and variant {variant!r} without transform_k: nothing to do")
        self.dtype, self.head_dim, self.paged = dtype, head_dim, paged
        self.in_dtype = kv_dtype if self.convert else dtype
        self.kind = fp8_kind(kv_dtype) if self.convert else None
        # input elements per load: 8 (16 bytes), or 16 of fp8 -- 8 (8-byte loads) where fp8 rows
        # are no whole number of 32-byte chunk pairs (80 bytes at head dim 80)
        self.vec = 128 // self.in_dtype.width
        if head_dim % (2 * self.vec):
            self.vec = 8
        assert head_dim % (2 * self.vec) == 0, head_dim
        self.pieces = self.vec // 8  # 16-byte output pieces per chunk
        self.half = head_dim // (2 * self.vec)  # threads per row: each takes chunks c and c + half
        self.rows_per_cta = THREADS // self.half
        # K, and V (the gather and the dequantization; a ragged key transform alone reads only K)
        self.n_tensors = 2 if (paged or self.convert) else 1

    @cute.jit
    def host(
        self,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKout: cute.Tensor,
        mVout: cute.Tensor,
        mQoIndptr: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mPageIndptr: cute.Tensor,
        mPageIndices: cute.Tensor,
        batch: Int32,
        sm_scale: Float32,
        num_ctas: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """``mK`` / ``mV``: the cache, ``[pages, page_size, kv_heads, head_dim]`` (paged) or
        ``[1, tokens, kv_heads, head_dim]`` (ragged; ``mPage*`` unused, and ``mV`` / ``mVout``
        too unless the cache is fp8), of ``kv_dtype``;
        ``mKout`` / ``mVout``: ``[1, tokens, kv_heads, head_dim]``; ``mKvIndptr``: tokens per
        request (prefix sums); ``num_ctas``: the grid (the wrapper passes 8 per SM, of which
        3-4 are resident at 64-80 registers: each thread has 2 rows x 32 bytes of K -- and of
        V -- in flight, which covers the HBM latency; an fp8 cache's pass takes 74-80 registers
        into fp16 (3 resident), 97-125 into bf16 (2 resident, still 64 KB of loads in flight
        per SM), and 141-150 with RoPE (1 resident, 32 KB: the one to measure first))."""
        self.kernel(
            mK,
            mV,
            mKout,
            mVout,
            mQoIndptr,
            mKvIndptr,
            mPageIndptr,
            mPageIndices,
            batch,
            sm_scale,
            var_tensors,
            var_scalars,
        ).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKout: cute.Tensor,
        mVout: cute.Tensor,
        mQoIndptr: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mPageIndptr: cute.Tensor,
        mPageIndices: cute.Tensor,
        batch: Int32,
        sm_scale: Float32,
        var_tensors: tuple,
        var_scalars: tuple,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        half = self.half
        tc = TraceCtx(vargs=self.hooks.bind(var_tensors, var_scalars), sm_scale=sm_scale)
        heads = cute.FastDivmodDivisorV2(mK.shape[2])  # row -> (token, head): multiply-high, no division
        if const_expr(self.paged):
            page_size = cute.FastDivmodDivisorV2(mK.shape[1])  # token -> (page, slot)
        # thread t always takes chunk pair c = t % half of its rows (the stride is a multiple of
        # the rows per CTA), so what a transform computes per dimension (RoPE's frequencies) is
        # loop-invariant and computed once
        c = tidx % half
        stride = nctas * self.rows_per_cta
        end = mKvIndptr[batch] * heads.divisor
        req = Int32(0)
        kv_start, kv_end = mKvIndptr[0], mKvIndptr[1]
        page_base = mPageIndptr[0] if self.paged else Int32(0)
        n_tensors, vec, pieces = self.n_tensors, self.vec, self.pieces
        # two rows per iteration, both loaded before either is used (more bytes in flight)
        first = kv_start * heads.divisor + cta * self.rows_per_cta + tidx // half
        if const_expr(THREADS % half):  # threads past the CTA's whole rows (head dim 96) idle
            if tidx >= self.rows_per_cta * half:
                first = end
        for r0 in cutlass.range(first, end, 2 * stride, unroll=1):
            rows = [r0, r0 + stride]
            lo = [[cute.make_rmem_tensor((vec,), self.in_dtype) for _ in range(n_tensors)] for _ in rows]
            hi = [[cute.make_rmem_tensor((vec,), self.in_dtype) for _ in range(n_tensors)] for _ in rows]
            token, head, pos, reqs, lens = [], [], [], [], []
            for i in cutlass.range_constexpr(2):
                t, h = divmod(cutlass.min(rows[i], end - 1), heads)  # a past-the-end row re-reads the last
                while t >= kv_end:  # the next non-empty request (kv_indptr is non-decreasing)
                    req += 1
                    kv_start = kv_end
                    kv_end = mKvIndptr[req + 1]
                    if const_expr(self.paged):
                        page_base = mPageIndptr[req]
                token.append(t)
                head.append(h)
                pos.append(t - kv_start)
                reqs.append(req)
                lens.append(kv_end - kv_start)
                if const_expr(self.paged):
                    page_idx, slot = divmod(t - kv_start, page_size)
                    page = in_cache(mPageIndices[page_base + page_idx], mK.shape[0])
                    srcs = [mK[page, slot, h, None], mV[page, slot, h, None]]
                else:
                    srcs = [mK[0, t, h, None], mV[0, t, h, None]][:n_tensors]
                for j in cutlass.range_constexpr(n_tensors):
                    cute.autovec_copy(cute.local_tile(srcs[j], (vec,), (c,)), lo[i][j])
                    cute.autovec_copy(cute.local_tile(srcs[j], (vec,), (c + half,)), hi[i][j])
            # each chunk as 16-byte pieces of the output dtype (an fp8 chunk: converted, two)
            lo = [[self._pieces(x) for x in row] for row in lo]
            hi = [[self._pieces(x) for x in row] for row in hi]
            if const_expr(self.transform):
                for i in cutlass.range_constexpr(2):
                    key = KeyRow(reqs[i], head[i], pos[i], mQoIndptr[reqs[i] + 1] - mQoIndptr[reqs[i]], lens[i])
                    self._transform_row(key, tc, lo[i][0], hi[i][0], c)
            outs = [mKout, mVout]
            for i in cutlass.range_constexpr(2):
                if rows[i] < end:
                    for j in cutlass.range_constexpr(n_tensors):
                        dst = outs[j][0, token[i], head[i], None]
                        for p in cutlass.range_constexpr(pieces):
                            cute.autovec_copy(lo[i][j][p], cute.local_tile(dst, (8,), (c * pieces + p,)))
                            cute.autovec_copy(hi[i][j][p], cute.local_tile(dst, (8,), ((c + half) * pieces + p,)))

    def _pieces(self, chunk) -> list:
        """A loaded chunk as 8-element register tensors of the output dtype: itself (a 16-bit
        cache), or its 16 fp8 values converted, 4 bytes at a time (2 x f16x2 each), into two."""
        if not self.convert:
            return [chunk]
        words = cute.recast_tensor(chunk, Int32)  # word w: elements 4w .. 4w+3, 4w in its low byte
        out = []
        for p in range(self.pieces):
            piece = cute.make_rmem_tensor((8,), self.dtype)
            pairs = cute.recast_tensor(piece, Int32)  # pair m: elements 2m (low half), 2m + 1
            for q in range(2):
                a, b = fp8x4_to_f16x4(words[2 * p + q], self.kind)
                if self.dtype is BFloat16:
                    a, b = f16x2_to_bf16x2(a), f16x2_to_bf16x2(b)
                pairs[2 * q] = a
                pairs[2 * q + 1] = b
            out.append(piece)
        return out

    def _transform_row(self, key: KeyRow, tc: TraceCtx, lo: list, hi: list, c):
        """transform_k on one row's chunk pair, piece by piece (a helper: the Ctx stays out of
        the kernel's loop); piece p of chunk c holds dims ``c * vec + 8 p ..``."""
        ctx = Ctx(
            batch=key.req,
            kv_head=key.head,
            kv_pos=key.kv_pos,
            qo_len=key.qo_len,
            kv_len=key.kv_len,
            head_dim=self.head_dim,
            sm_scale=tc.sm_scale,
        )
        for p in range(self.pieces):
            transform_pairs(self.hooks, tc.vargs, ctx, lo[p], hi[p], c * self.vec + 8 * p, self.dtype, query=False)


def build_kv_pass(spec):
    """The jit entry of a ``kv_pass`` spec (dtype, kv_dtype, head_dim, paged, variant, variant_fp)."""
    from ..abi.dtypes import to_dsl
    from ..families.base import spec_variant
    from ..families.kv_pass import kv_pass_abi_fixed
    from ..variants.base import abi_args

    p = spec.pdict
    variant = spec_variant(p)
    kv = to_dsl(p["kv_dtype"]) if "kv_dtype" in p else None
    return make_entry(
        KvPass(to_dsl(p["dtype"]), p["head_dim"], bool(p["paged"]), variant, kv),
        kv_pass_abi_fixed(p),
        abi_args(variant),
    )
