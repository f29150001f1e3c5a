"""Public ⊕ ops with FlashInfer's names and conventions: ``merge_state``,
``merge_state_in_place``, ``merge_states``.

Values ``v`` are fp16/bf16 (fp32 also accepted), LSE ``s`` is fp32 in base 2. A row whose
states are all empty (s = -inf) merges to v = 0, s = -inf (FlashInfer gives NaN there).
The last dim (head_dim) must be contiguous; other strides are free as long as they keep
16-byte alignment — otherwise the input is copied to a contiguous tensor first.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

from .runtime.abi import ScalarArg, TensorArg
from .runtime.family import KernelFamily, register
from .runtime.spec import Spec

_DTYPE_NAMES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32"}
_VEC = {"f16": 8, "bf16": 8, "f32": 4}  # elements per 16-byte vector
LOAD_BATCH = 4  # merge_states: states whose loads each thread issues together
CTAS_PER_SM = 16  # merge grids: 16 CTAs of 128 threads fill an SM; the kernels loop over the rest

# PTX/SASS that the merge kernels must contain: 16-byte vector loads, on both arches.
_MERGE_EXPECT = {arch: {"16B ld.global (PTX)": r"ptx:ld\.global(\.\w+)*\.(v4\.[bfu]32|v2\.[bfu]64)",
                        "LDG.E.128 (SASS)": r"sass:LDG\.E\.128"}
                 for arch in ("sm_90a", "sm_100a")}


def _vtensor(name, dtype, rank, head_dim):
    v = _VEC[dtype]
    return TensorArg(name, dtype, (None,) * (rank - 1) + (head_dim,), (None,) * (rank - 1) + (1,),
                     stride_divisibility=v, align=16)


def _stensor(name, rank):
    return TensorArg(name, "f32", (None,) * rank, (None,) * rank, 1, 4)


MERGE_STATES = register(KernelFamily(
    name="merge_states",
    builder="cute_attn.kernels.merge:build_merge_states",
    abi=lambda p: [_vtensor("mV", p["dtype"], 4, p["head_dim"]), _stensor("mS", 3),
                   _vtensor("mO", p["dtype"], 3, p["head_dim"]), _stensor("mLse", 2), ScalarArg("max_ctas", "i32")],
    expect=_MERGE_EXPECT,
))

MERGE_PAIR = register(KernelFamily(
    name="merge_pair",
    builder="cute_attn.kernels.merge:build_merge_pair",
    abi=lambda p: [_vtensor("mVa", p["dtype"], 3, p["head_dim"]), _stensor("mSa", 2),
                   _vtensor("mVb", p["dtype"], 3, p["head_dim"]), _stensor("mSb", 2),
                   _vtensor("mO", p["dtype"], 3, p["head_dim"]), _stensor("mLse", 2),
                   TensorArg("mMask", "u8", (None,) if p["masked"] else (1,), (1,), 1, 1),
                   ScalarArg("max_ctas", "i32")],
    expect=_MERGE_EXPECT,
))


@functools.lru_cache(maxsize=None)
def _module(family: str, arch: str, **params):
    from .runtime.loader import get_module

    return get_module(Spec.make(family, arch, **params))


def _max_ctas(device) -> int:
    from .runtime.arch import sm_count

    return sm_count(device) * CTAS_PER_SM


def _value_dtype(v) -> str:
    name = _DTYPE_NAMES.get(str(v.dtype))
    if name is None:
        raise TypeError(f"merge ops take float16/bfloat16/float32 values, got {v.dtype}")
    return name


def _prep_v(v, name: str, rank: int):
    if v.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(v.shape)}")
    dt = _value_dtype(v)
    vec = _VEC[dt]
    if v.shape[-1] % vec:
        raise ValueError(f"{name}: head_dim {v.shape[-1]} must be a multiple of {vec} for {v.dtype}")
    if v.stride(-1) != 1 or any(s % vec for s in v.stride()[:-1]) or v.data_ptr() % 16:
        v = v.contiguous()
    return v, dt


def _prep_s(s, name: str, shape):
    import torch

    if s.dtype != torch.float32:
        raise TypeError(f"{name} (LSE) must be float32, got {s.dtype}")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(s.shape)}")
    return s


def _out_tensor(t, name, shape, dtype, device):
    import torch

    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}, got {t.dtype}{tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] != 1 and len(shape) == 3:
        raise ValueError(f"{name} must have a contiguous last dim")
    return t


def _same_device(*ts):
    dev = ts[0].device
    for t in ts[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    from .runtime.arch import device_arch

    return device_arch(dev)


def merge_states(v, s, *, out=None, lse=None) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """Merge ``num_states`` states per row: v [seq, num_states, heads, dim], s [seq, num_states, heads]
    -> (v_merged [seq, heads, dim], s_merged [seq, heads]).  ``out``/``lse`` (an extension to
    FlashInfer's signature) receive the result when given."""
    import torch

    v, dt = _prep_v(v, "v", 4)
    seq, n, h, d = v.shape
    s = _prep_s(s, "s", (seq, n, h))
    out = _out_tensor(out, "out", (seq, h, d), v.dtype, v.device)
    lse = _out_tensor(lse, "lse", (seq, h), torch.float32, v.device)
    arch = _same_device(v, s, out, lse)
    if seq * h:
        _module("merge_states", arch, dtype=dt, head_dim=d, load_batch=LOAD_BATCH)(
            v, s, out, lse, _max_ctas(v.device))
    return out, lse


def _merge_pair(va, sa, vb, sb, out, lse, mask):
    va, dt = _prep_v(va, "v_a", 3)
    vb, dtb = _prep_v(vb, "v_b", 3)
    if dtb != dt or vb.shape != va.shape:
        raise ValueError(f"v_a and v_b must match: {va.dtype}{tuple(va.shape)} vs {vb.dtype}{tuple(vb.shape)}")
    seq, h, d = va.shape
    sa, sb = _prep_s(sa, "s_a", (seq, h)), _prep_s(sb, "s_b", (seq, h))
    arch = _same_device(va, sa, vb, sb, out, lse, *([] if mask is None else [mask]))
    if seq * h == 0:
        return
    if mask is not None:
        import torch

        if mask.shape != (seq,) or mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"mask must be a bool tensor of shape ({seq},), got {mask.dtype}{tuple(mask.shape)}")
        mask = mask.contiguous().view(torch.uint8)
    masked = mask is not None
    if not masked:
        mask = sa.as_strided((1,), (1,))  # never read by the unmasked kernel; any valid pointer
    _module("merge_pair", arch, dtype=dt, head_dim=d, masked=masked)(
        va, sa, vb, sb, out, lse, mask, _max_ctas(va.device))


def merge_state(v_a, s_a, v_b, s_b, *, out=None, lse=None) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """(v_a, s_a) ⊕ (v_b, s_b): v [seq, heads, dim], s [seq, heads] fp32 base-2 LSE.
    ``out``/``lse`` (an extension to FlashInfer's signature) receive the result when given."""
    import torch

    out = _out_tensor(out, "out", tuple(v_a.shape), v_a.dtype, v_a.device)
    lse = _out_tensor(lse, "lse", tuple(v_a.shape[:-1]), torch.float32, v_a.device)
    _merge_pair(v_a, s_a, v_b, s_b, out, lse, None)
    return out, lse


def merge_state_in_place(v, s, v_other, s_other, mask: Optional["torch.Tensor"] = None) -> None:
    """v, s ← (v, s) ⊕ (v_other, s_other); rows with ``mask[i] == False`` are left unchanged."""
    vv, _ = _prep_v(v, "v", 3)
    if vv.data_ptr() != v.data_ptr():
        raise ValueError("merge_state_in_place: v must have a contiguous last dim and 16-byte aligned strides")
    _merge_pair(v, s, v_other, s_other, v, s, mask)
