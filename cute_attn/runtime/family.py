"""Kernel families: the DSL-free description of a compilable kernel.

A family names a builder (a function in ``cute_attn.kernels``, imported only when compiling,
so the DSL is not needed to *run*), the argument ABI for a given set of parameters, and the
instructions its compiled code must contain per arch (checked by the compile tests and shown
by ``python -m cute_attn compile``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Sequence

from .abi import Arg

_FAMILIES: Dict[str, KernelFamily] = {}


@dataclass(frozen=True)
class KernelFamily:
    name: str
    builder: str  # "module:function"; function(spec) -> (jit_function, fake_args)
    abi: Callable[[dict], Sequence[Arg]]  # params -> host-function arguments (stream excluded)
    # arch -> {label: regex}; each regex must match the PTX ("ptx:" prefix) or SASS ("sass:")
    expect: Dict[str, Dict[str, str]] = field(default_factory=dict)

    def load_builder(self) -> Callable:
        mod, fn = self.builder.split(":")
        return getattr(importlib.import_module(mod), fn)


def register(family: KernelFamily) -> KernelFamily:
    prev = _FAMILIES.get(family.name)
    if prev is not None and prev != family:
        raise ValueError(f"kernel family {family.name!r} registered twice")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> KernelFamily:
    if name not in _FAMILIES:
        _import_all()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(_FAMILIES)}") from None


def _import_all() -> None:
    # Families are declared next to the public ops that launch them.
    importlib.import_module("cute_attn.merge")
    importlib.import_module("cute_attn.decode")
    importlib.import_module("cute_attn.prefill")
