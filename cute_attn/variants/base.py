"""The variant interface: hook points traced into the attention kernels.

A variant is a subclass of :class:`Variant` that overrides some of the hooks below; a hook
left at ``None`` is not traced at all (the kernel compiles exactly as without it).  The kernel
calls the hooks while it is being traced, with DSL values, so their arithmetic is inlined into
the kernel (no runtime dispatch).  Hooks use DSL operations through
:mod:`cute_attn.variants.dsl` (see there why not ``import cutlass`` at module level).

Hook points (``ctx`` is a :class:`Ctx`; all positions are token indices of the request):

* ``transform_q(ctx, lo, hi, i) -> (lo, hi)`` / ``transform_k(...)``: once per pair of loaded
  query / key elements (dims ``i`` and ``i + head_dim/2``, ``i < head_dim/2``), fp32 values,
  before the QK product (RoPE).  ``ctx.q_pos`` / ``ctx.kv_pos`` give the token's position.
* ``logits(ctx, s) -> s``: per element, ``s = q·k·sm_scale`` in natural units (the kernel folds
  log2(e) itself).  In a variant with ``softmax = False`` the chain of logits hooks must end
  in the attention *weight* (e.g. FlashSigmoid's ``sigmoid(s + bias)``): weights are summed,
  ``out = Σ w·v``, with no normalization.
* ``bias(ctx, scale) -> b``: an additive logit that does not depend on ``s`` (ALiBi, a position
  bias table), returned multiplied by ``scale``: the same as ``logits(ctx, s) = s + b / scale``.
  The prefill kernel seeds its Q·Kᵀ accumulator with it (``scale = 1 / sm_scale``: q·k's
  units), so it costs no instruction in the softmax and a bias load is not waited on there;
  elsewhere it is added as a logit (``scale = 1``).  Biases of components before the first
  ``logits`` component are seeded; a bias after one is applied in order, as a logit.
* ``mask(ctx) -> Boolean``: per element, True keeps the key.  Applied without block skipping.
* ``mask_bits(ctx) -> (bits, offset)``: the same as a bitmap, per query row: key ``kv_pos`` is
  kept iff bit ``offset + kv_pos`` of ``bits`` (a uint8 tensor, little bit order within a
  byte) is 1 (FlashInfer's ``packed_custom_mask``).  Evaluated once per row of a work item;
  kernels read a block's bits a byte at a time and test them per element in registers
  (``kernels/bitmask.py``).
* ``kv_range(ctx) -> (lo, hi)``: per query row, keys outside ``[lo, hi)`` are masked (either
  bound may be ``None``).  Both bounds must be non-decreasing in ``ctx.q_pos``; kernels use the
  range to skip whole KV blocks (causal, sliding window).
* ``finalize(ctx, m, l) -> (m, l)``: per query row, at the end of a work item (one KV chunk of
  one request): the online-softmax statistics in base 2 (``m`` = running max of
  ``s·log2 e``, ``l = Σ 2^(s·log2 e - m)``).  ``ctx.first_chunk`` is true for exactly one chunk
  of every row (so a virtual key, e.g. an attention sink, is added once even when the KV is
  split across CTAs).  The output is ``Σ 2^(s·log2 e - m)·v / l`` and LSE ``m + log2 l``.
* ``output(ctx, o, d) -> o``: per element ``d`` of the final, normalized output row (fp32),
  before the store.  Kernels that split a request's KV apply it after the merge or do not
  split (the decode wrapper disables split-KV for such variants).

Static properties (class attributes) kernels may rely on: ``causal`` (every visible key
satisfies ``kv_pos <= q_pos``), ``softmax`` (False: no softmax, see ``logits``),
``range_in_bits`` (the component's ``kv_range`` only tells the kernels which blocks they may
skip: its ``mask_bits`` already hide every key outside it, so no per-score range test).

Parameters come in two kinds:

* *static* (``static = {"name": default}``): compile-time constants, plain JSON scalars
  (bool/int/float/str); they are part of the variant's fingerprint and of the kernel's cache
  key, readable as ``self.name``;
* *runtime* (``runtime = (TensorParam(...), ScalarParam(...))``): kernel arguments, read in the
  hooks as ``ctx.args.<name>`` (a ``cute.Tensor`` or a Float32/Int32).  Their values are given
  as constructor keywords, filled by :meth:`Variant.fill` from the wrapper's plan (built-ins:
  ALiBi slopes, ...), or passed to ``run(q, kv, *args)`` positionally in declaration order.

Identity: :func:`fingerprint` hashes the class name, the source code of the class and of its
variant base classes, and the static parameters.  A spec names the variant by
:func:`encode` (``module:qualname(k=v;...)``, built-ins by their short name) plus the
fingerprint, so any edit of the class recompiles, the same variant never does, and a separate
process (``python -m cute_attn compile``) can re-create it with :func:`decode` — which needs
the class to be importable by that name (classes defined in ``__main__`` or a notebook only
compile in the process that defined them).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "Variant",
    "TensorParam",
    "ScalarParam",
    "Ctx",
    "Compose",
    "fingerprint",
    "encode",
    "decode",
    "components",
    "Hooks",
    "register_builtin",
]


# --------------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class TensorParam:
    """A runtime tensor argument: dtype one of f32/f16/bf16/i32/u8, ``ndim`` dims of dynamic
    extent; the last dim must be contiguous (stride 1), other strides are free.  ``rows``: a
    key of the plan's ``info`` (``"num_qo_heads"``) the first extent must reach -- a per-head
    table read at ``[qo_head]`` -- checked before launch with the dtype, rank and device."""

    name: str
    dtype: str = "f32"
    ndim: int = 1
    rows: str = ""


@dataclass(frozen=True)
class ScalarParam:
    """A runtime scalar argument (``"f32"`` or ``"i32"``); ``default`` is used when no value is given."""

    name: str
    dtype: str = "f32"
    default: Optional[float] = None


_JSON_SCALARS = (bool, int, float, str)
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STR_RE = re.compile(r"^[A-Za-z0-9_.\-]*$")


class Variant:
    """Base class of attention variants; see the module docstring for the hooks."""

    static: Dict[str, Any] = {}
    runtime: Sequence = ()
    causal: bool = False
    softmax: bool = True
    range_in_bits: bool = False  # kv_range only narrows the blocks: its mask_bits already hide the rest

    transform_q = None
    transform_k = None
    bias = None
    logits = None
    mask = None
    mask_bits = None
    kv_range = None
    finalize = None
    output = None

    def __init__(self, **kwargs):
        rt_names = {p.name for p in self.runtime}
        self.values: Dict[str, Any] = {}
        self.params: Dict[str, Any] = dict(self.static)
        for k, v in kwargs.items():
            if k in rt_names:
                self.values[k] = v
            elif k in self.static:
                if not isinstance(v, _JSON_SCALARS):
                    raise TypeError(
                        f"{type(self).__name__}: static parameter {k} must be bool/int/float/str, "
                        f"got {type(v).__name__}"
                    )
                if isinstance(v, str) and not _STR_RE.match(v):
                    raise ValueError(f"{type(self).__name__}: static string {k}={v!r} may only use [A-Za-z0-9_.-]")
                self.params[k] = v
            else:
                raise TypeError(
                    f"{type(self).__name__} takes static {sorted(self.static)} and runtime "
                    f"{sorted(rt_names)} parameters, not {k!r}"
                )
        for k, v in self.params.items():
            setattr(self, k, v)

    # composition: a + b applies a's hooks, then b's
    def __add__(self, other: Variant) -> Variant:
        return Compose(self, other)

    def fill(self, info: dict) -> dict:
        """Default values of runtime arguments from the wrapper's plan (``info``: num_qo_heads,
        num_kv_heads, head_dim, sm_scale, device, ...).  Built-ins override this."""
        return {}

    def __repr__(self):
        return encode(self)

    def __eq__(self, other):
        return isinstance(other, Variant) and encode(self) == encode(other) and fingerprint(self) == fingerprint(other)

    def __hash__(self):
        return hash(encode(self))


class Compose(Variant):
    """Several variants in order: transforms and logits hooks chain, masks and ranges
    intersect, ``finalize``/``output`` chain.  Built by ``a + b``."""

    def __init__(self, *parts: Variant):
        super().__init__()
        flat: List[Variant] = []
        for p in parts:
            if p is None:
                continue
            if not isinstance(p, Variant):
                raise TypeError(f"not a Variant: {p!r}")
            flat.extend(p.parts if isinstance(p, Compose) else [p])
        self.parts = tuple(flat)


def components(v: Optional[Variant]) -> Tuple[Variant, ...]:
    if v is None:
        return ()
    return v.parts if isinstance(v, Compose) else (v,)


# ------------------------------------------------------------------------------------ identity

_BUILTINS: Dict[str, type] = {}


def register_builtin(cls):
    """Built-ins are encoded by their short class name."""
    _BUILTINS[cls.__name__] = cls
    return cls


def _class_source(cls) -> str:
    """The code a variant's fingerprint covers: each class's source and, for a class defined
    outside cute_attn, the whole source file that defines it -- hooks call module-level helpers
    (a helper edited without touching the class must not reuse a stale module).  cute_attn's
    own files are in every cache key already (``families.sources.source_fingerprint``).  Helpers
    imported from other files are not covered: keep them in the variant's file."""
    parts = []
    for k in cls.__mro__:
        if k in (Variant, Compose, object):
            break
        try:
            parts.append(inspect.getsource(k))
            mod = inspect.getmodule(k)
            if mod is not None and mod.__name__.partition(".")[0] != "cute_attn":
                parts.append(inspect.getsource(mod))
        except (OSError, TypeError) as e:
            raise ValueError(
                f"variant class {k.__qualname__}: its source code is not available ({e}); define variants in a .py file"
            ) from None
    return "\n".join(parts)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v).replace("e+", "e")  # no '+': it separates components
    return str(v)


def _class_name(cls) -> str:
    if _BUILTINS.get(cls.__name__) is cls:
        return cls.__name__
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(v: Optional[Variant]) -> str:
    """Readable, parseable name of a variant (spec parameter ``variant``): ``none``, ``SoftCap``,
    ``SoftCap+SlidingWindow``, ``my.module:RelBias(buckets=32)``.  No commas (spec strings are
    comma-separated)."""
    comps = components(v)
    if not comps:
        return "none"
    out = []
    for c in comps:
        s = _class_name(type(c))
        changed = {k: val for k, val in sorted(c.params.items())}
        if changed:
            s += "(" + ";".join(f"{k}={_fmt(val)}" for k, val in changed.items()) + ")"
        out.append(s)
    return "+".join(out)


def fingerprint(v: Optional[Variant]) -> str:
    """Hash of the class names, class source code and static parameters of every component;
    ``"x"`` + 16 hex digits (the prefix keeps it a string through ``Spec.parse``)."""
    h = hashlib.sha256()
    for c in components(v):
        cls = type(c)
        h.update(f"{cls.__module__}:{cls.__qualname__}\0".encode())
        h.update(_class_source(cls).encode())
        h.update(json.dumps(c.params, sort_keys=True).encode())
        h.update(b"\1")
    return "x" + h.hexdigest()[:16]


def _parse_value(text: str):
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _import_class(name: str):
    if name in _BUILTINS:
        return _BUILTINS[name]
    if ":" not in name:  # the package __init__ imported (and so registered) every built-in
        raise ValueError(f"unknown built-in variant {name!r}; known: {sorted(_BUILTINS)}")
    mod, _, qual = name.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


_COMP_RE = re.compile(r"^([A-Za-z0-9_.:]+)(?:\((.*)\))?$")


def decode(text: str) -> Optional[Variant]:
    """Re-create a variant from :func:`encode`'s text (imports user classes by module:qualname)."""
    if text in ("none", ""):
        return None
    parts = []
    for comp in text.split("+"):
        m = _COMP_RE.match(comp)
        if not m:
            raise ValueError(f"bad variant component {comp!r} in {text!r}")
        cls = _import_class(m.group(1))
        kw = {}
        for item in filter(None, (m.group(2) or "").split(";")):
            k, _, val = item.partition("=")
            kw[k] = _parse_value(val)
        parts.append(cls(**kw))
    return parts[0] if len(parts) == 1 else Compose(*parts)


# ----------------------------------------------------------------------------- runtime arguments


def abi_args(v: Optional[Variant]) -> list:
    """The kernel arguments a variant adds (after the family's own): tensors of all components,
    then scalars, named ``v<i>_<name>``."""
    from ..abi.args import ScalarArg, TensorArg
    from ..abi.dtypes import elt_bytes

    tensors, scalars = [], []
    for i, c in enumerate(components(v)):
        for p in c.runtime:
            if not _NAME_RE.match(p.name):
                raise ValueError(f"{type(c).__name__}: bad runtime parameter name {p.name!r}")
            name = f"v{i}_{p.name}"
            if isinstance(p, TensorParam):
                align = elt_bytes(p.dtype)
                tensors.append(TensorArg(name, p.dtype, (None,) * p.ndim, (None,) * (p.ndim - 1) + (1,), 1, align))
            else:
                scalars.append(ScalarArg(name, p.dtype))
    return tensors + scalars


_TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i32": "int32", "u8": "uint8"}


def _check_tensor(c: Variant, p: TensorParam, val, info: dict) -> None:
    """A runtime tensor as ``p`` declares it, on the plan's device: the kernel reads it with the
    declared element type and rank (a table of another dtype would be read as garbage, a short
    per-head table past its end)."""
    where = f"variant {type(c).__name__}'s {p.name!r}"
    if not hasattr(val, "dtype") or not hasattr(val, "dim"):
        raise TypeError(f"{where} must be a tensor, got {type(val).__name__}")
    want = _TORCH_DTYPES[p.dtype]
    if str(val.dtype) != f"torch.{want}" or val.dim() != p.ndim:
        raise ValueError(f"{where} must be a {p.ndim}-D {want} tensor, got a {val.dim()}-D {val.dtype} one")
    dev = info.get("device")
    if dev is not None:
        d = getattr(dev, "type", str(dev).split(":")[0])
        i = getattr(dev, "index", None)
        if val.device.type != d or (i is not None and val.device.index not in (i, None)):
            raise ValueError(f"{where} must be on {dev}, got {val.device}")
    if p.rows and p.rows in info and (val.shape[0] if p.ndim else 0) < info[p.rows]:
        raise ValueError(f"{where} has {val.shape[0]} rows, the plan's {p.rows} is {info[p.rows]}")


def runtime_values(v: Optional[Variant], info: dict, positional: Sequence = ()) -> list:
    """Values for :func:`abi_args`, in its order: constructor values, then :meth:`Variant.fill`
    defaults, then ``positional`` (run()'s extra arguments, in declaration order over the
    parameters not already given)."""
    tensors, scalars = [], []
    pos = list(positional)
    for c in components(v):
        given = {**c.fill(info), **c.values}
        for p in c.runtime:
            if p.name in given:
                val = given[p.name]
            elif pos:
                val = pos.pop(0)
            elif isinstance(p, ScalarParam) and p.default is not None:
                val = p.default
            else:
                raise ValueError(
                    f"variant {type(c).__name__} needs its runtime argument {p.name!r} "
                    f"(constructor keyword or run(q, kv, *args))"
                )
            if isinstance(p, TensorParam):
                _check_tensor(c, p, val, info)
                tensors.append(val)
            else:
                scalars.append(float(val) if p.dtype == "f32" else int(val))
    if pos:
        raise ValueError(f"{len(pos)} extra positional argument(s) to run() that the variant does not take")
    return tensors + scalars


# ------------------------------------------------------------------------- kernel-side adapter


class Ctx:
    """What hooks see.  Integer fields are DSL Int32 values (or Python ints):
    ``batch`` (request index), ``qo_head``, ``kv_head``, ``q_pos`` (bottom-right aligned
    position of the query: ``kv_len - qo_len + q_idx``), ``q_idx`` (row within the request),
    ``kv_pos`` (per-element hooks and ``transform_k``), ``qo_len``, ``kv_len``,
    ``first_chunk`` (``finalize``), ``head_dim`` (Python int), ``sm_scale`` (Float32),
    ``args`` (this component's runtime arguments by name).

    ``ctx.once(key, fn)`` evaluates ``fn()`` once per query row and reuses the value for every
    element of the row (e.g. a per-head slope loaded from global memory).

    ``ctx.kv_pos_f32`` is ``kv_pos`` and ``ctx.rel_pos_f32`` is ``kv_pos - q_pos``, both as
    Float32 (exact below 2^24).  Use them instead of converting positions yourself in a
    per-element hook: the kernels derive them with one addition per score from values computed
    once per block (a per-element int->float conversion runs at a quarter of the FP32 rate on
    Hopper, as slow as the softmax's exponential).  For a bias linear in the position, write
    ``ctx.rel_pos_times(x)`` rather than ``x * ctx.rel_pos_f32``: one FFMA per score instead of
    an addition and an FFMA (see there).

    Kernels give the float positions either as values or as ``(base, offset)`` pairs: a DSL
    value per row and block plus a Python float per column of the thread's fragment."""

    _FIELDS = (
        "batch",
        "qo_head",
        "kv_head",
        "q_pos",
        "qo_len",
        "kv_len",
        "kv_pos",
        "first_chunk",
        "head_dim",
        "sm_scale",
        "args",
        "kv_pos_f32",
        "rel_pos_f32",
    )
    _LAZY = ("kv_pos_f32", "rel_pos_f32")  # stored as _name; the properties fall back to a conversion

    def __init__(self, **kw):
        for f in self._FIELDS:
            setattr(self, "_" + f if f in self._LAZY else f, kw.pop(f, None))
        self._cache = kw.pop("_cache", None)
        if self._cache is None:
            self._cache = {}
        if kw:
            raise TypeError(f"unknown Ctx fields {sorted(kw)}")

    @property
    def q_idx(self):
        return self.q_pos - (self.kv_len - self.qo_len)

    @property
    def kv_pos_f32(self):
        if self._kv_pos_f32 is not None:
            return _value(self._kv_pos_f32)
        from . import dsl

        return dsl.f32(self.kv_pos)

    @property
    def rel_pos_f32(self):
        if self._rel_pos_f32 is not None:
            return _value(self._rel_pos_f32)
        from . import dsl

        return dsl.f32(self.kv_pos - self.q_pos)

    def rel_pos_times(self, x):
        """``x * rel_pos_f32``.  Where the kernel gives ``rel_pos`` as a per-block base plus a
        per-column constant (the per-element hooks of both kernels), this is ``x * offset + x *
        base``: ``x * base`` is the same value for every column of a row (computed once), so a
        score costs one FFMA with an immediate, where ``x * (base + offset)`` costs an addition
        and the multiply (ALiBi: one instruction per score less)."""
        v = self._rel_pos_f32
        if isinstance(v, tuple):
            base, off = v
            return x * off + x * base if off else x * base
        return x * self.rel_pos_f32

    def replace(self, _fresh: bool = False, **kw) -> Ctx:
        """A copy with some fields changed; it shares the ``once`` cache unless ``_fresh``.  A new
        ``kv_pos`` or ``q_pos`` drops the float positions not given with it."""
        d = {f: getattr(self, "_" + f if f in self._LAZY else f) for f in self._FIELDS}
        if "kv_pos" in kw or "q_pos" in kw:
            for f in self._LAZY:
                if f not in kw:
                    d[f] = None
        d.update(kw)
        d["_cache"] = None if _fresh else self._cache
        return Ctx(**d)

    def once(self, key, fn):
        k = (id(self.args), key)
        if k not in self._cache:
            self._cache[k] = fn()
        return self._cache[k]


def _value(v):
    """A float position as a value: ``(base, offset)`` pairs (see :class:`Ctx`) summed."""
    if isinstance(v, tuple):
        return v[0] + v[1] if v[1] else v[0]
    return v


class Hooks:
    """The kernel's view of a (possibly composed) variant: which hooks exist (static facts for
    ``const_expr``) and how to call them with per-component argument namespaces."""

    def __init__(self, v: Optional[Variant], seed_bias: bool = False):
        """``seed_bias``: the kernel adds the ``bias`` of the components before the first
        ``logits`` component through :meth:`bias` (prefill: into the Q·Kᵀ accumulator);
        every other bias is applied by :meth:`logits` as ``s + bias``."""
        self.parts = components(v)
        has = lambda name: any(getattr(c, name) is not None for c in self.parts)  # noqa: E731
        self.has_transform_q = has("transform_q")
        self.has_transform_k = has("transform_k")
        first_logits = next((i for i, c in enumerate(self.parts) if c.logits is not None), len(self.parts))
        # per component: its bias is seeded (True), a logit (False), or it has none (None)
        self._seeded = [None if c.bias is None else seed_bias and i <= first_logits for i, c in enumerate(self.parts)]
        self.has_bias = any(self._seeded)  # the kernel must call bias()
        self.has_logits = has("logits") or False in self._seeded
        self.has_mask_bits = has("mask_bits")
        self.has_mask = has("mask") or self.has_mask_bits  # either: a masked path on every block
        self.has_kv_range = has("kv_range")
        # masking by bitmaps alone: a kernel may skip a block whose bits are all 0 and drop the
        # per-score test where they are all 1
        self.bits_only = (
            self.has_mask_bits
            and not has("mask")
            and all(c.range_in_bits for c in self.parts if c.kv_range is not None)
        )
        self.has_finalize = has("finalize")
        self.has_output = has("output")
        self.softmax = all(c.softmax for c in self.parts)
        self.causal = any(c.causal for c in self.parts)
        self.per_row = self.has_logits or self.has_bias or self.has_mask or self.has_kv_range
        # decode's head packing (several kv heads per work item) masks each warp's rows of the
        # other heads: a softmax turns them into m = -inf, l = 0 (summed weights would still
        # count them), and query/key transforms, applied per warp fragment, would not see them
        self.packs_heads = self.softmax and not (self.has_transform_q or self.has_transform_k)
        self.num_tensors = sum(isinstance(p, TensorParam) for c in self.parts for p in c.runtime)
        self.num_scalars = sum(isinstance(p, ScalarParam) for c in self.parts for p in c.runtime)
        if not self.softmax and (self.has_finalize or self.has_output):
            raise ValueError("a variant without softmax cannot have finalize/output hooks")

    def bind(self, tensors: tuple, scalars: tuple) -> list:
        """Per component, a namespace of its runtime arguments (kernel-side values)."""
        out, ti, si = [], 0, 0
        for c in self.parts:
            ns = {}
            for p in c.runtime:
                if isinstance(p, TensorParam):
                    ns[p.name] = tensors[ti]
                    ti += 1
                else:
                    ns[p.name] = scalars[si]
                    si += 1
            out.append(SimpleNamespace(**ns))
        return out

    def _each(self, name, args):
        for c, a in zip(self.parts, args):
            fn = getattr(c, name)
            if fn is not None:
                yield fn, a

    def transform_q(self, ctx, args, lo, hi, i):
        for fn, a in self._each("transform_q", args):
            lo, hi = fn(ctx.replace(args=a), lo, hi, i)
        return lo, hi

    def transform_k(self, ctx, args, lo, hi, i):
        for fn, a in self._each("transform_k", args):
            lo, hi = fn(ctx.replace(args=a), lo, hi, i)
        return lo, hi

    def bias(self, ctx, args, scale):
        """The sum of the seeded components' ``bias(ctx, scale)`` (see ``seed_bias``)."""
        b = None
        for c, a, seeded in zip(self.parts, args, self._seeded):
            if seeded:
                x = c.bias(ctx.replace(args=a), scale)
                b = x if b is None else b + x
        return b

    def logits(self, ctx, args, s):
        """The chain of ``logits`` hooks, with the biases not seeded added in component order."""
        for c, a, seeded in zip(self.parts, args, self._seeded):
            if seeded is False:
                s = s + c.bias(ctx.replace(args=a), 1.0)
            if c.logits is not None:
                s = c.logits(ctx.replace(args=a), s)
        return s

    def mask(self, ctx, args, ok):
        """``ok`` and every ``mask`` component at ``ctx.kv_pos`` (``ok`` None: nothing masked yet,
        e.g. in a block no bound cuts).  ``mask_bits`` components are the kernel's: see
        :meth:`mask_bits`."""
        for fn, a in self._each("mask", args):
            m = fn(ctx.replace(args=a))
            ok = m if ok is None else ok & m
        return ok

    def row_values(self, ctx, args):
        """Per query row, once per work item: ``(lo, hi, mask_bits)`` (its ``kv_range`` and its
        bitmaps), with the ``once`` values of the logits and mask hooks evaluated by a dummy call
        (its result unused), so the per-block calls on ``ctx``'s copies reuse them: a slope or a
        mask row offset is one load per row per item, not per block."""
        from . import dsl

        lo = hi = None
        if self.has_kv_range:  # (a range its own bitmap implies needs no per-score test)
            lo, hi = self.kv_range(ctx, args, tested_only=True)
        if self.has_logits:
            self.logits(ctx.replace(kv_pos=ctx.q_pos), args, dsl.Float32(0.0))
        if self.has_bias:
            self.bias(ctx.replace(kv_pos=ctx.q_pos), args, dsl.Float32(1.0))
        if self.has_mask:
            self.mask(ctx.replace(kv_pos=ctx.q_pos), args, None)
        return lo, hi, self.mask_bits(ctx, args)

    def mask_bits(self, ctx, args) -> list:
        """Per ``mask_bits`` component of the row of ``ctx``: (uint8 tensor, bit offset of key 0)."""
        return [fn(ctx.replace(args=a)) for fn, a in self._each("mask_bits", args)]

    def kv_range(self, ctx, args, tested_only: bool = False):
        """(lo, hi) intersected over components; None for an open side.  ``tested_only``: only
        the components whose range is not implied by their bitmap (``range_in_bits``)."""
        lo = hi = None
        for c, a in zip(self.parts, args):
            fn = c.kv_range
            if fn is None or (tested_only and c.range_in_bits):
                continue
            l2, h2 = fn(ctx.replace(args=a))
            if l2 is not None:
                lo = l2 if lo is None else _imax(lo, l2)
            if h2 is not None:
                hi = h2 if hi is None else _imin(hi, h2)
        return lo, hi

    def finalize(self, ctx, args, m, l):
        for fn, a in self._each("finalize", args):
            m, l = fn(ctx.replace(args=a), m, l)
        return m, l

    def output(self, ctx, args, o, d):
        for fn, a in self._each("output", args):
            o = fn(ctx.replace(args=a), o, d)
        return o


def _imax(a, b):
    from . import dsl

    return dsl.select(a > b, a, b)


def _imin(a, b):
    from . import dsl

    return dsl.select(a < b, a, b)
