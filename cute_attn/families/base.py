"""A kernel family: the DSL-free description of a compilable kernel, and the registry.

A family names a builder (a function in ``cute_attn.kernels``, imported only when compiling,
so the DSL is not needed to *run*), the argument ABI for a given set of parameters, and the
instructions its compiled code must contain per arch (checked by the compile tests and shown
by ``python -m cute_attn compile``).  Each family module of this package registers its
families when imported; the package imports them all, so the registry is complete whenever
any of it is in use.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Sequence

from ..abi import dtypes
from ..abi.args import Arg, TensorArg
from ..variants import base as vbase

_FAMILIES: Dict[str, KernelFamily] = {}


@dataclass(frozen=True)
class KernelFamily:
    name: str
    builder: str  # "module:function"; function(spec) -> (jit_function, fake_args)
    abi: Callable[[dict], Sequence[Arg]]  # params -> host-function arguments (stream excluded)
    # arch -> {label: regex}; each regex must match the PTX ("ptx:" prefix) or SASS ("sass:")
    expect: Dict[str, Dict[str, str]] = field(default_factory=dict)
    # params -> {label: why}: checks of ``expect`` a specialization is known to fail (an open
    # performance gap, named and explained where the family is declared); they are not checked
    # for it and its meta.json lists them under "known_gaps"
    known_gaps: Callable[[dict], Dict[str, str]] = lambda params: {}

    def expect_for(self, arch: str, params: dict) -> Dict[str, str]:
        """``expect[arch]`` without the specialization's known gaps."""
        gaps = self.known_gaps(params)
        return {k: v for k, v in self.expect.get(arch, {}).items() if k not in gaps}

    def load_builder(self) -> Callable:
        mod, fn = self.builder.split(":")
        return getattr(importlib.import_module(mod), fn)

    @property
    def source_modules(self) -> tuple:
        """The modules its binary is built from: the builder's and the declaring one's."""
        return tuple(sorted({self.builder.split(":")[0], getattr(self.abi, "__module__", "")} - {""}))


def register(family: KernelFamily) -> KernelFamily:
    prev = _FAMILIES.get(family.name)
    if prev is not None and prev != family:
        raise ValueError(f"kernel family {family.name!r} registered twice")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> KernelFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(_FAMILIES)}") from None


def family_names() -> list:
    return sorted(_FAMILIES)


# ---- argument shapes several families share ----------------------------------------------
def cache_arg(name: str, p: dict, dtype: str | None = None) -> TensorArg:
    """K or V: ``[pages or 1, tokens, kv_heads, head_dim]``, any strides, head_dim contiguous;
    of ``dtype`` (default the spec's ``dtype``; an fp8 cache names its own), strides whole
    16-byte vectors."""
    dt = dtype or p["dtype"]
    return TensorArg(name, dt, (None, None, None, p["head_dim"]), (None, None, None, 1), dtypes.vec_elems(dt), 16)


def i32_arg(name: str) -> TensorArg:
    return TensorArg(name, "i32", (None,), (1,), 1, 4)


# ---- variants in spec parameters ----------------------------------------------------------
@functools.cache
def _variant_from(text: str, fp: str):
    v = vbase.decode(text)
    got = vbase.fingerprint(v)
    if got != fp:
        raise ValueError(
            f"variant {text}: its code or static parameters changed since the spec was made "
            f"(fingerprint {got}, spec says {fp}); make the spec again from the variant object"
        )
    return v


_NO_VARIANT_FP = vbase.fingerprint(None)


def spec_variant(p: dict):
    """The variant object of a spec's parameters (checked against its fingerprint)."""
    return _variant_from(p.get("variant", "none"), p.get("variant_fp", _NO_VARIANT_FP))


_FP_CACHE: dict = {}


def variant_params(v) -> dict:
    """Spec parameters naming a variant: ``variant`` (:func:`variants.encode`) and ``variant_fp``
    (:func:`variants.fingerprint`, cached per class and static parameters for this process)."""
    text = vbase.encode(v)
    key = (text, tuple(type(c) for c in vbase.components(v)))
    fp = _FP_CACHE.get(key)
    if fp is None:
        fp = _FP_CACHE[key] = vbase.fingerprint(v)
    return {"variant": text, "variant_fp": fp}
