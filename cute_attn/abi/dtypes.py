"""The dtype vocabulary, defined once: the short names specs and ABIs use, their sizes, and
the torch / CuTe DSL types they stand for.  torch and the DSL are imported only by the
functions that need them (the GPU machine has no DSL; the families never need torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # the spec / ABI name
    bytes: int
    torch_name: str  # attribute of the torch module
    dsl_name: str  # attribute of the cutlass module


_ALL = (
    DType("f16", 2, "float16", "Float16"),
    DType("bf16", 2, "bfloat16", "BFloat16"),
    DType("f32", 4, "float32", "Float32"),
    DType("e4m3", 1, "float8_e4m3fn", "Float8E4M3FN"),
    DType("e5m2", 1, "float8_e5m2", "Float8E5M2"),
    DType("i32", 4, "int32", "Int32"),
    DType("u8", 1, "uint8", "Uint8"),
)
BY_NAME = {d.name: d for d in _ALL}

ATTENTION = ("f16", "bf16")  # q / k / v / o of the attention kernels
MERGE_VALUES = ("f16", "bf16", "f32")  # v of the ⊕ merge ops
FP8 = ("e4m3", "e5m2")  # fp8 KV caches (with f16 / bf16 queries)


def dtype(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(BY_NAME)}") from None


def elt_bytes(name: str) -> int:
    return dtype(name).bytes


def vec_elems(name: str, vec_bytes: int = 16) -> int:
    """Elements of ``name`` in one ``vec_bytes`` vector (16: one 128-bit load)."""
    return vec_bytes // dtype(name).bytes


def to_torch(name: str):
    import torch

    return getattr(torch, dtype(name).torch_name)


def to_dsl(name: str):
    import cutlass

    return getattr(cutlass, dtype(name).dsl_name)


def name_of(torch_dtype, allowed=None) -> str | None:
    """The spec name of a torch dtype (None if it has none, or is not in ``allowed``)."""
    text = str(torch_dtype).replace("torch.", "")
    for d in _ALL:
        if d.torch_name == text and (allowed is None or d.name in allowed):
            return d.name
    return None
