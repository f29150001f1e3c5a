"""The argument ABI of a kernel family: the one description both sides read.

A family describes its host function's arguments once, as a list of ``TensorArg`` /
``ScalarArg``.  At compile time each ``None`` in a tensor's shape or stride becomes a symbolic
int of a fake tensor (``runtime.build``); at run time the loader packs, for every tensor, the
struct that the DSL's exported C header declares for it::

    struct { void *data; int32_t dynamic_shapes[k]; int64_t dynamic_strides[m]; }

listing only the dynamic modes, in mode order (``runtime.header``).  Because both sides read
the same description, they cannot disagree about which modes are dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: str
    shape: tuple  # int for a static extent, None for dynamic
    stride: tuple  # int for a static stride, None for dynamic
    stride_divisibility: int = 1  # promised divisibility of every dynamic stride (elements)
    align: int = 4  # promised alignment of the data pointer (bytes)

    @property
    def dyn_shape_modes(self) -> tuple:
        return tuple(i for i, s in enumerate(self.shape) if s is None)

    @property
    def dyn_stride_modes(self) -> tuple:
        return tuple(i for i, s in enumerate(self.stride) if s is None)


@dataclass(frozen=True)
class ScalarArg:
    name: str
    dtype: str  # "i32" or "f32"


Arg = Union[TensorArg, ScalarArg]


def abi_to_json(args: Sequence[Arg]) -> list:
    out = []
    for a in args:
        if isinstance(a, TensorArg):
            out.append(
                {
                    "kind": "tensor",
                    "name": a.name,
                    "dtype": a.dtype,
                    "shape": list(a.shape),
                    "stride": list(a.stride),
                    "stride_divisibility": a.stride_divisibility,
                    "align": a.align,
                }
            )
        else:
            out.append({"kind": "scalar", "name": a.name, "dtype": a.dtype})
    return out


def abi_from_json(items: list) -> list:
    args: list = []
    for d in items:
        if d["kind"] == "tensor":
            args.append(
                TensorArg(
                    d["name"], d["dtype"], tuple(d["shape"]), tuple(d["stride"]), d["stride_divisibility"], d["align"]
                )
            )
        else:
            args.append(ScalarArg(d["name"], d["dtype"]))
    return args
