"""Attention variants traced into the kernels (docs/design.md §7; interface: docs/variants.md).

Importable without the CuTe DSL: hooks reach the DSL lazily through :mod:`.dsl`.
"""

from . import dsl
from .base import (
    Compose,
    Ctx,
    Hooks,
    ScalarParam,
    TensorParam,
    Variant,
    abi_args,
    components,
    decode,
    encode,
    fingerprint,
    register_builtin,
    runtime_values,
)
from .builtins import (
    ALiBi,
    AttentionSink,
    Causal,
    CustomMask,
    FlashSigmoid,
    RoPE,
    SlidingWindow,
    SoftCap,
    get_alibi_slopes,
)

__all__ = [
    "Variant",
    "TensorParam",
    "ScalarParam",
    "Ctx",
    "Compose",
    "Hooks",
    "fingerprint",
    "encode",
    "decode",
    "components",
    "abi_args",
    "runtime_values",
    "register_builtin",
    "dsl",
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
