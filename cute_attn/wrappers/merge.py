"""Public ⊕ ops with FlashInfer's names and conventions: ``merge_state``,
``merge_state_in_place``, ``merge_states``.

Values ``v`` are fp16/bf16 (fp32 also accepted), LSE ``s`` is fp32 in base 2. A row whose
states are all empty (s = -inf) merges to v = 0, s = -inf (FlashInfer gives NaN there).
The last dim (head_dim) must be contiguous; other strides are free as long as they keep
16-byte alignment — otherwise the input is copied to a contiguous tensor first.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..abi.dtypes import MERGE_VALUES, name_of, vec_elems
from ..families.merge import LOAD_BATCH
from ..runtime.arch import arch_of_index
from ..runtime.loader import LaunchError, kernel

# The kernels take a grid cap (max_ctas) at launch and loop over the rows beyond it.  Measured
# on the H200 (merge_states 8x4096x32x128 bf16): capping at 8/16/32 CTAs per SM gave 3.6/3.2/3.7
# TB/s, one CTA per row group 3.8 TB/s, so the merge ops launch uncapped.
GRID_CAP = 2**31 - 1


_UNUSED_MASKS: dict = {}


def _unused_mask(device: int) -> torch.Tensor:
    """The mask argument of the unmasked kernel: never read, any valid pointer (one per device)."""
    t = _UNUSED_MASKS.get(device)
    if t is None:
        t = _UNUSED_MASKS[device] = torch.zeros(1, dtype=torch.uint8, device=f"cuda:{device}")
    return t


def _device_of(*ts) -> int:
    """The one CUDA device index of ``ts`` (``None`` entries skipped); CPU tensors are an error."""
    idx = ts[0].get_device()
    for t in ts[1:]:
        if t is not None and t.get_device() != idx:
            raise ValueError(f"all tensors must be on one device, got {ts[0].device} and {t.device}")
    if idx < 0:
        raise ValueError(f"cute_attn kernels run on CUDA tensors, got a tensor on {ts[0].device}")
    return idx


def _value_dtype(v, name: str, rank: int) -> str:
    dt = name_of(v.dtype, MERGE_VALUES)
    if dt is None:
        raise TypeError(f"merge ops take float16/bfloat16/float32 values, got {name} of {v.dtype}")
    if v.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(v.shape)}")
    if v.shape[-1] % vec_elems(dt):
        raise ValueError(f"{name}: head_dim {v.shape[-1]} must be a multiple of {vec_elems(dt)} for {v.dtype}")
    return dt


def _check_lse(s, name: str, shape) -> None:
    if s.dtype != torch.float32:
        raise TypeError(f"{name} (LSE) must be float32, got {s.dtype}")
    if s.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(s.shape)}")


def _output(t, name: str, shape, dtype, device):
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}, got {t.dtype}{tuple(t.shape)}")
    return t


def _launch(mod, inputs: tuple, outputs: tuple, extra: tuple) -> None:
    """Launch; an input whose layout the kernel cannot take (last dim not contiguous, strides
    or pointer not 16-byte aligned) is retried once as a contiguous copy.  Outputs are never
    copied: a bad output layout is an error."""
    try:
        mod(*inputs, *outputs, *extra)
    except LaunchError as e:
        if all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in inputs):
            raise ValueError(f"output tensor layout not supported: {e}") from None
        mod(*(t.contiguous() for t in inputs), *outputs, *extra)


def merge_states(v, s, *, out=None, lse=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` states per row: v [seq, num_states, heads, dim], s [seq, num_states, heads]
    -> (v_merged [seq, heads, dim], s_merged [seq, heads]).  ``out``/``lse`` (an extension to
    FlashInfer's signature) receive the result when given."""
    dt = _value_dtype(v, "v", 4)
    seq, n, h, d = v.shape
    _check_lse(s, "s", (seq, n, h))
    out = _output(out, "out", (seq, h, d), v.dtype, v.device)
    lse = _output(lse, "lse", (seq, h), torch.float32, v.device)
    dev = _device_of(v, s, out, lse)
    if seq * h:
        mod = kernel("merge_states", arch_of_index(dev), dtype=dt, head_dim=d, load_batch=LOAD_BATCH)
        _launch(mod, (v, s), (out, lse), (GRID_CAP,))
    return out, lse


def merge_pair_module(dtype: torch.dtype, head_dim: int, device_index: int, masked: bool = False):
    """The ``merge_pair`` module for values of ``dtype`` (loaded or built on first use; callers
    that launch it inside a CUDA-graph capture call this beforehand)."""
    return kernel(
        "merge_pair", arch_of_index(device_index), dtype=name_of(dtype, MERGE_VALUES), head_dim=head_dim, masked=masked
    )


def _merge_pair(va, sa, vb, sb, out, lse, mask) -> None:
    _value_dtype(va, "v_a", 3)
    if vb.dtype != va.dtype or vb.shape != va.shape:
        raise ValueError(f"v_a and v_b must match: {va.dtype}{tuple(va.shape)} vs {vb.dtype}{tuple(vb.shape)}")
    seq, h, d = va.shape
    _check_lse(sa, "s_a", (seq, h))
    _check_lse(sb, "s_b", (seq, h))
    dev = _device_of(va, sa, vb, sb, out, lse, mask)
    if mask is not None:
        if mask.shape != (seq,) or mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"mask must be a bool tensor of shape ({seq},), got {mask.dtype}{tuple(mask.shape)}")
        mask = mask.contiguous().view(torch.uint8)
    if seq * h == 0:
        return
    mod = merge_pair_module(va.dtype, d, dev, mask is not None)
    if mask is None:
        mask = _unused_mask(dev)
    _launch(mod, (va, sa, vb, sb), (out, lse), (mask, GRID_CAP))


def merge_state(v_a, s_a, v_b, s_b, *, out=None, lse=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(v_a, s_a) ⊕ (v_b, s_b): v [seq, heads, dim], s [seq, heads] fp32 base-2 LSE.
    ``out``/``lse`` (an extension to FlashInfer's signature) receive the result when given."""
    out = _output(out, "out", v_a.shape, v_a.dtype, v_a.device)
    lse = _output(lse, "lse", v_a.shape[:-1], torch.float32, v_a.device)
    _merge_pair(v_a, s_a, v_b, s_b, out, lse, None)
    return out, lse


def merge_state_in_place(v, s, v_other, s_other, mask: Optional[torch.Tensor] = None) -> None:
    """v, s ← (v, s) ⊕ (v_other, s_other); rows with ``mask[i] == False`` are left unchanged.
    ``v`` needs a contiguous last dim and 16-byte aligned strides (it cannot be copied)."""
    _merge_pair(v, s, v_other, s_other, v, s, mask)
