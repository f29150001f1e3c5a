"""FlashInfer's attention options mapped onto cute_attn's variants, in one place for every
wrapper: ``pos_encoding_mode``, ``logits_soft_cap``, ``window_left``, ``causal``, custom
masks, sinks and a user ``variant``."""

from __future__ import annotations

from typing import Optional

from ..variants import base as vbase
from ..variants.builtins import ALiBi, AttentionSink, Causal, CustomMask, RoPE, SoftCap

POS_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


def resolve_variant(
    *,
    causal: bool = False,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    pos_encoding_mode: str = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    custom_mask=None,
    variant=None,
    sinks: bool = False,
):
    """FlashInfer's options -> (causal, soft_cap, window, traced variant or None): what the
    prefill kernel specializes on.  Causal, window and soft-cap stay the kernel's static flags
    (mask-free blocks, block skipping, the folded soft-cap); the rest is composed in decode's
    order -- RoPE/ALiBi, soft-cap, custom mask, ``variant``, sink -- where soft-cap joins the
    traced variant only when another component transforms logits or a later one adds a bias (the
    order matters then; the flag caps q·k plus the biases the kernel seeds, ALiBi's).
    ``custom_mask`` (a ``CustomMask``, or True for its spec) replaces causal, as FlashInfer's
    MaskMode.CUSTOM.  ``Causal()`` components of ``variant`` become the causal flag."""
    if pos_encoding_mode not in POS_MODES:
        raise ValueError(f"pos_encoding_mode must be one of {POS_MODES}, got {pos_encoding_mode!r}")
    if variant is not None and not isinstance(variant, vbase.Variant):
        raise TypeError(f"variant must be a cute_attn.variants.Variant, got {type(variant).__name__}")
    head, tail = [], []
    if pos_encoding_mode == "ROPE_LLAMA":
        head.append(
            RoPE(
                rope_scale=1.0 if rope_scale is None else float(rope_scale),
                rope_theta=1e4 if rope_theta is None else float(rope_theta),
            )
        )
    elif pos_encoding_mode == "ALIBI":
        head.append(ALiBi())
    if custom_mask is not None:
        tail.append(custom_mask if isinstance(custom_mask, CustomMask) else CustomMask())
        causal = False
    for c in vbase.components(variant):
        if type(c) is Causal:
            causal = True
        else:
            tail.append(c)
    if sinks:
        tail.append(AttentionSink())
    soft_cap = bool(logits_soft_cap)
    # the kernels' soft-cap flag caps raw q·k plus the biases they seed (ALiBi's): a later logits
    # hook, or a bias meant to follow the cap, needs the cap in the chain
    if soft_cap and (any(c.logits is not None for c in head + tail) or any(c.bias is not None for c in tail)):
        head.append(SoftCap(logits_soft_cap=float(logits_soft_cap)))
        soft_cap = False
    parts = head + tail
    v = None if not parts else parts[0] if len(parts) == 1 else vbase.Compose(*parts)
    return bool(causal), soft_cap, window_left is not None and window_left >= 0, v
