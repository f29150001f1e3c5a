"""The exported C header's side of the ABI (``abi.args``): the struct each argument packs to,
the symbols ``export_to_c`` wrote, and ``check_header``, which verifies the header's dynamic
mode counts against the family's argument description."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Sequence

from ..abi.args import Arg, ScalarArg, TensorArg


def struct_format(arg: Arg) -> str:
    """``struct`` format of one argument's C struct, native alignment, padded to 8 bytes."""
    if isinstance(arg, ScalarArg):
        return {"i32": "i4x", "f32": "f4x"}[arg.dtype]
    k, m = len(arg.dyn_shape_modes), len(arg.dyn_stride_modes)
    fmt = "Q" + "i" * k
    if m:
        pad = (-(8 + 4 * k)) % 8
        fmt += "x" * pad + "q" * m
    else:
        fmt += "x" * ((-(8 + 4 * k)) % 8)
    return fmt


_STRUCT_RE = re.compile(
    r"typedef struct \{\s*void \*data;\s*(?:int32_t dynamic_shapes\[(\d+)\];)?\s*"
    r"(?:int64_t dynamic_strides\[(\d+)\];)?\s*\}\s*(\w+)_t;"
)
_WRAPPER_RE = re.compile(r"static inline int32_t (\w+)_wrapper\((.*?)\)\s*\{(.*?)\n\}", re.S)
_CALL_RE = re.compile(r"(_mlir_\w+)\(args, (\d+)\);")
_INIT_RE = re.compile(r"void (_mlir_\w+_cuda_init)\(void \*\*\);")
_LOAD_RE = re.compile(r"void (_mlir_\w+_cuda_load_to_device)\(void \*\*\);")


@dataclass(frozen=True)
class HeaderABI:
    init_symbol: str
    load_symbol: str
    launch_symbol: str
    num_args: int  # entries of the void* array the launch symbol takes (args + stream + ret)
    tensor_structs: tuple  # (name, n_shapes, n_strides) in declaration order


def parse_header(text: str) -> HeaderABI:
    """Pull the symbol names and tensor struct shapes out of an ``export_to_c`` header."""
    m_init, m_load = _INIT_RE.search(text), _LOAD_RE.search(text)
    m_wrap = _WRAPPER_RE.search(text)
    if not (m_init and m_load and m_wrap):
        raise RuntimeError("unrecognised export_to_c header (DSL version change?)")
    m_call = _CALL_RE.search(m_wrap.group(3))
    if not m_call:
        raise RuntimeError("unrecognised export_to_c wrapper body (DSL version change?)")
    structs = tuple((name, int(ns or 0), int(nst or 0)) for ns, nst, name in _STRUCT_RE.findall(text))
    return HeaderABI(m_init.group(1), m_load.group(1), m_call.group(1), int(m_call.group(2)), structs)


def check_header(abi: HeaderABI, args: Sequence[Arg], family: str) -> None:
    tensors = [a for a in args if isinstance(a, TensorArg)]
    if abi.num_args != len(args) + 2:
        raise RuntimeError(f"{family}: header takes {abi.num_args - 2} args, ABI lists {len(args)}")
    if len(abi.tensor_structs) != len(tensors):
        raise RuntimeError(
            f"{family}: header declares {len(abi.tensor_structs)} tensor structs, ABI lists {len(tensors)}"
        )
    for (sname, ns, nst), t in zip(abi.tensor_structs, tensors):
        if not sname.endswith("_" + t.name) or ns != len(t.dyn_shape_modes) or nst != len(t.dyn_stride_modes):
            raise RuntimeError(
                f"{family}: header struct {sname} has {ns} dynamic shapes / {nst} strides; "
                f"ABI for {t.name} says {len(t.dyn_shape_modes)} / {len(t.dyn_stride_modes)}"
            )


def args_format(args: Sequence[Arg]) -> tuple[str, list]:
    """One ``struct`` format for all arguments + stream + ret, and the byte offset of each."""
    fmt, offsets, off = "=", [], 0
    for a in list(args) + ["stream", "ret"]:
        f = "Q" if a == "stream" else ("i4x" if a == "ret" else struct_format(a))
        offsets.append(off)
        fmt += f
        off += struct.calcsize("=" + f)
    return fmt, offsets
