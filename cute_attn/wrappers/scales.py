"""The q / k / v scales of a run (FlashInfer's and vLLM's semantics, for fp8 caches above all):
``q_scale`` and ``k_scale`` multiply the logits, ``v_scale`` the output; the LSE is that of the
scaled logits and is never multiplied by ``v_scale``.

Each scale is None, a Python float or a 1-element tensor (FlashInfer's forms: read with
``.item()``, which a CUDA-graph capture forbids, and folded into the launch's softmax scale /
one multiply of the output), or -- cute_attn's extension -- a per-head tensor: ``q_scale``
``[num_qo_heads]``, ``k_scale`` / ``v_scale`` ``[num_kv_heads]`` (float, on the wrapper's
device; an fp8 cache quantized per kv head).  The kernels take one softmax scale, so per-head
scales stay out of them: the query rows are multiplied by ``q_scale[h] * k_scale[h // group]``
before the launch (computed in fp32, rounded once to the query's dtype: one pass over q, which
for a decode step is the batch's few KB) and the output heads by ``v_scale[h // group]`` after
it.  That needs no synchronization, so per-head tensors work under a CUDA-graph capture; their
values are checked (finite, > 0) with one synchronization outside a capture (and outside
``torch.compile``'s tracing) only -- a captured graph reads whatever they hold at replay.
fp8 queries are already quantized: per-head ``q_scale`` / ``k_scale`` with them are refused
(fold them into the quantization)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from . import guards


@dataclass(frozen=True)
class Scales:
    """One run's scales, checked: what the launch and the code around it apply."""

    logits: float = 1.0  # the scalar q / k scales' product: multiplies the softmax scale
    out: Optional[float] = None  # the scalar v scale; None: no multiply
    q_heads: Optional[torch.Tensor] = None  # fp32 [num_qo_heads]: per-head q * k scales, into the query
    v_heads: Optional[torch.Tensor] = None  # fp32 [num_kv_heads]: per-head v scales, into the output

    def sm_scale(self, base: float) -> float:
        return base * self.logits

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """q ``[..., num_qo_heads, head_dim]`` with the per-head scales multiplied in (a new tensor)."""
        if self.q_heads is None:
            return q
        if q.element_size() == 1:
            raise ValueError(
                "per-head q_scale / k_scale with fp8 queries: the queries are already quantized; "
                "fold the scales into their quantization or pass 1-element scales"
            )
        # fp32 product, one rounding on the store (no fp32 copy of q)
        return torch.mul(q, self.q_heads[:, None], out=torch.empty_like(q))

    def output(self, out: torch.Tensor) -> None:
        """The v scales, in place, on ``out`` ``[..., num_qo_heads, head_dim_vo]``."""
        if self.out is not None:
            out.mul_(self.out)
        if self.v_heads is not None:
            hk = self.v_heads.shape[0]
            out.unflatten(-2, (hk, out.shape[-2] // hk)).mul_(self.v_heads[:, None, None])


NONE = Scales()


def scale_value(x, name: str) -> Optional[float]:
    """A q / k / v scale as a Python float (None stays None): a float or a 0-d / 1-element
    tensor (read with ``.item()``, which a CUDA-graph capture forbids); NaN, inf and <= 0 are
    errors."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor, got shape {tuple(x.shape)}")
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"{name} is a 1-element tensor: reading it (.item()) would synchronize, which a CUDA-graph "
                "capture forbids; pass a Python float (or a per-head tensor)"
            )
        x = x.item()
    return guards.finite_number(name, x, zero_ok=False, kind="a float or a 1-element tensor")


def _per_head(x: torch.Tensor, name: str, heads: int, what: str, device) -> torch.Tensor:
    if x.dim() != 1 or x.shape[0] != heads:
        raise ValueError(
            f"{name} must be a float, a 1-element tensor or one per {what} head ([{heads}]), got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point() or x.element_size() == 1:
        raise ValueError(f"{name} must be a float32 / float16 / bfloat16 tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"a per-head {name} must be on {device} (it is read by the device), got one on {x.device}")
    return x.float()


def resolve(device, hq: int, hk: int, q_scale=None, k_scale=None, v_scale=None) -> Scales:
    """The run's scales, every check made before any launch (module doc)."""
    if q_scale is None and k_scale is None and v_scale is None:  # an engine's usual decode step
        return NONE
    heads, flat = {}, {}
    for name, x, n, what in (("q_scale", q_scale, hq, "query"), ("k_scale", k_scale, hk, "kv"),
                             ("v_scale", v_scale, hk, "kv")):  # fmt: skip
        if isinstance(x, torch.Tensor) and x.numel() != 1:
            heads[name] = _per_head(x, name, n, what, device)
            continue
        if isinstance(x, torch.Tensor) and x.device.type != "cpu" and x.device != device:
            raise ValueError(
                f"{name} must be a float or a 1-element tensor on the CPU or {device}, got one on {x.device}"
            )
        flat[name] = scale_value(x, name)
    if heads and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling():
        ok = torch.stack([(torch.isfinite(t) & (t > 0)).all() for t in heads.values()]).all()
        if not bool(ok):  # the one synchronization
            raise ValueError(f"{' / '.join(heads)} must be finite and positive in every head")
    qh = heads.get("q_scale")
    if "k_scale" in heads:
        kh = heads["k_scale"].repeat_interleave(hq // hk)
        qh = kh if qh is None else qh * kh
    q, k, v = flat.get("q_scale"), flat.get("k_scale"), flat.get("v_scale")
    # a Python 1.0 v scale is no multiply (FlashInfer skips it); a tensor's 1.0 multiplies
    out = None if v is None or (v == 1.0 and isinstance(v_scale, float)) else v
    return Scales((1.0 if q is None else q) * (1.0 if k is None else k), out, qh, heads.get("v_scale"))


def for_single(sm_scale, q: torch.Tensor, hk: int, q_scale=None, k_scale=None, v_scale=None):
    """The single-request functions' scales: (the softmax scale to plan -- ``sm_scale``, None
    for the default, times the scalar q / k scales --, the ``Scales`` left for the run).  q is
    ``[..., num_qo_heads, head_dim]``."""
    sc = resolve(q.device, q.shape[-2], hk, q_scale, k_scale, v_scale)
    if sc.logits != 1.0:
        sm_scale = (1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)) * sc.logits
    return sm_scale, replace(sc, logits=1.0)
