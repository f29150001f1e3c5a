"""Kernel-side helpers for variants (imported only when compiling: needs the DSL).

``make_entry`` builds the ``@cute.jit`` host entry of a kernel whose argument list depends on
the variant: the DSL derives the exported C signature from the Python signature, and a
variable number of annotated arguments cannot be written by hand, so the entry is generated
per specialization (explicit names and annotations, so the exported header names each
argument and ``runtime.header.check_header`` can match it).  It forwards to the kernel object's
``host`` method as ``host(*fixed, var_tensors: tuple, var_scalars: tuple, stream)``.

``transform_fragment`` applies ``transform_q``/``transform_k`` to an MMA operand fragment in
registers: for the m16n8k16 A/B layouts every thread holds dims ``d`` and ``d + D/2`` of the
same row at k-blocks ``kb`` and ``kb + K/2``, so a RoPE-style pair rotation needs no shuffle.
``transform_pairs`` does the same for two 16-byte chunks of one row (dims ``d0..d0+7`` and
``d0 + D/2..``) held in registers: the prefill kernel's Q rows and the key-transform pass.
"""

from __future__ import annotations

import types
from typing import Callable, Sequence

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..abi.args import ScalarArg, TensorArg


def _annotation(a):
    if isinstance(a, TensorArg):
        return cute.Tensor
    return {"i32": Int32, "f32": Float32}[a.dtype]


def make_entry(obj, fixed: Sequence, var: Sequence, host: str = "host"):
    """A bound ``@cute.jit`` function ``entry(*fixed, *var, stream)`` -> ``obj.<host>(...)``."""
    fixed_names = [a.name for a in fixed]
    vt = [a.name for a in var if isinstance(a, TensorArg)]
    vs = [a.name for a in var if isinstance(a, ScalarArg)]
    if [a.name for a in var] != vt + vs:
        raise ValueError("variant arguments must list tensors before scalars")
    tup = lambda xs: "(" + "".join(x + ", " for x in xs) + ")"  # noqa: E731
    src = (
        f"def entry(self, {', '.join(fixed_names + vt + vs)}, stream):\n"
        f"    return self.{host}({', '.join(fixed_names)}, {tup(vt)}, {tup(vs)}, stream)\n"
    )
    scope: dict = {}
    exec(compile(src, f"<{type(obj).__name__} entry>", "exec"), scope)
    fn = scope["entry"]
    fn.__annotations__ = {a.name: _annotation(a) for a in list(fixed) + list(var)}
    fn.__annotations__["stream"] = cuda.CUstream
    fn.__qualname__ = f"{type(obj).__name__}.entry"
    fn.__module__ = type(obj).__module__
    return types.MethodType(cute.jit(preprocess=False)(fn), obj)


def transform_fragment(frag: cute.Tensor, coords: cute.Tensor, hook: Callable, ctx_of: Callable, dtype):
    """In place: ``(lo, hi) = hook(ctx_of(coord[0]), lo, hi, dim)`` for every pair of elements
    (dim, dim + D/2) of ``frag`` (mode 2 = k-blocks of 16 dims); ``coords`` is the identity
    partition of the same operand ((row, dim) per element)."""
    nk = cute.size(frag, mode=[2])
    half = nk // 2
    for kb in range(half):
        for m in range(cute.size(frag, mode=[1])):
            for i in range(cute.size(frag, mode=[0])):
                c = coords[i, m, kb]
                lo = frag[i, m, kb].to(Float32)
                hi = frag[i, m, kb + half].to(Float32)
                lo, hi = hook(ctx_of(c[0]), lo, hi, c[1])
                frag[i, m, kb] = lo.to(dtype)
                frag[i, m, kb + half] = hi.to(dtype)


def transform_pairs(hooks, vargs, ctx, lo: cute.Tensor, hi: cute.Tensor, d0, dtype, query: bool):
    """In place: ``(lo[e], hi[e]) = transform(ctx, lo[e], hi[e], d0 + e)`` for the 8 elements of
    two register chunks of one row (dims ``d0..`` and ``d0 + D/2..``), computed in fp32 and
    rounded back to ``dtype``; ``transform_q`` if ``query`` else ``transform_k``."""
    hook = hooks.transform_q if query else hooks.transform_k
    for e in range(8):
        a, b = hook(ctx, vargs, lo[e].to(Float32), hi[e].to(Float32), d0 + e)
        lo[e] = a.to(dtype)
        hi[e] = b.to(dtype)
