"""Launch scalars and GPU-resident indices checked before any launch, written once for every
wrapper: a NaN or an infinity in a launch scalar would come back as a NaN output (silently
wrong), and a page id beyond the cache used to cost the whole CUDA context (the kernels now
clamp page ids, ``kernels/pages.py``; the checked mode here names the bad id instead)."""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

# sm_scale = 0 is uniform attention, but the kernels keep a row's running maximum in raw q.k
# units and scale it afterwards (max * 0 of a -inf start is NaN): run them with the smallest
# normal-range scale instead, which gives the same softmax to within fp32 rounding (every
# logit is below 1e-20 for any finite bf16 / fp16 q.k).
UNIFORM_SCALE = 1e-30


def finite_number(name: str, value, *, zero_ok: bool, note: str = "", kind: str = "a number") -> float:
    """A scalar argument as a float, finite and > 0 (``zero_ok``: >= 0), else a ValueError naming
    it (``note``: why, ``kind``: what it may be given as).  The one check of every launch
    scalar and scale: a NaN or an infinity would come back as a NaN output."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind}, got {type(value).__name__}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name} must be finite and {'>=' if zero_ok else '>'} 0{note}, got {v}")
    return v


def launch_sm_scale(sm_scale: Optional[float], head_dim: int) -> float:
    """The softmax scale a kernel is launched with: ``1 / sqrt(head_dim)`` by default; finite
    and >= 0 (0: uniform attention), else ValueError."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    note = " (the kernels' running maximum assumes a non-negative scale)"
    v = finite_number("sm_scale", sm_scale, zero_ok=True, note=note)
    return UNIFORM_SCALE if v == 0 else v


def check_soft_cap(logits_soft_cap) -> None:
    """``logits_soft_cap``: None or 0 is off, else finite and > 0."""
    if logits_soft_cap is not None:
        finite_number("logits_soft_cap", logits_soft_cap, zero_ok=True, note=" (0 or None: off)")


def check_indices_length(indices: torch.Tensor, used: int, name: str) -> None:
    """A page table must hold the ``used`` = indptr[-1] ids the plan reads (known on the host
    whatever device the table is on: no synchronization)."""
    if indices.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.numel() < used:
        raise ValueError(f"{name} has {indices.numel()} entries, kv_indptr[-1] needs {used}")


def checked_mode() -> bool:
    """``CUTE_ATTN_CHECK_INDICES=1``: check GPU-resident page ids in run() (synchronizes)."""
    return os.environ.get("CUTE_ATTN_CHECK_INDICES", "0") not in ("", "0")


def check_device_page_ids(indices: torch.Tensor, used: int, num_pages: int, name: str) -> None:
    """In checked mode: raise if any of the first ``used`` ids lies outside ``[0, num_pages)``
    (one reduction on the device and one synchronization; never under CUDA-graph capture)."""
    if not checked_mode() or used == 0 or not indices.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    ids = indices[:used]
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_pages:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds page id {bad}; the cache has {num_pages} pages (CUTE_ATTN_CHECK_INDICES=1)")
