"""FlashInfer's attention options mapped onto cute_attn's variants, in one place for every
wrapper: ``pos_encoding_mode``, ``logits_soft_cap``, ``window_left``, ``causal``, custom
masks, sinks and a user ``variant``.  :func:`resolve_variant` for the prefill kernel (causal,
window and soft-cap are its static flags), :func:`decode_variant` for the decode kernel (no
static flags: every option is a traced component); both check the options and build the
position encoding the same way (:func:`check_options`, :func:`position_encoding`)."""

from __future__ import annotations

from typing import Optional

from ..variants import base as vbase
from ..variants.builtins import ALiBi, AttentionSink, Causal, CustomMask, RoPE, SlidingWindow, SoftCap
from . import guards

POS_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


def check_options(pos_encoding_mode: str, variant) -> None:
    if pos_encoding_mode not in POS_MODES:
        raise ValueError(f"pos_encoding_mode must be one of {POS_MODES}, got {pos_encoding_mode!r}")
    if variant is not None and not isinstance(variant, vbase.Variant):
        raise TypeError(f"variant must be a cute_attn.variants.Variant, got {type(variant).__name__}")


def position_encoding(pos_encoding_mode: str, rope_scale=None, rope_theta=None) -> list:
    """``pos_encoding_mode`` as variant components: [RoPE] (``rope_scale`` default 1,
    ``rope_theta`` default 1e4), [ALiBi] or []."""
    if pos_encoding_mode == "ROPE_LLAMA":
        scale, theta = _positive("rope_scale", rope_scale, 1.0), _positive("rope_theta", rope_theta, 1e4)
        return [RoPE(rope_scale=scale, rope_theta=theta)]
    return [ALiBi()] if pos_encoding_mode == "ALIBI" else []


def _positive(name: str, value, default: float) -> float:
    """A RoPE scalar: finite and > 0 (``default`` for None); 0, a negative or a NaN would rotate
    every key and query by NaN or by meaningless angles."""
    return default if value is None else guards.finite_number(name, value, zero_ok=False)


def compose(parts: list):
    """None, the one part, or their ``Compose`` in order."""
    return None if not parts else parts[0] if len(parts) == 1 else vbase.Compose(*parts)


def decode_variant(
    *,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    pos_encoding_mode: str = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    custom_mask=None,
    variant=None,
):
    """FlashInfer's options -> the decode kernel's traced variant (or None).  The decode kernel
    has no static flags, so every option is a component, in this order (it fixes the specs and
    their cache keys): RoPE/ALiBi, SoftCap, SlidingWindow, ``custom_mask`` (a ``CustomMask``),
    then the components of ``variant`` (a ``Causal()`` among them stays a traced mask)."""
    check_options(pos_encoding_mode, variant)
    parts = position_encoding(pos_encoding_mode, rope_scale, rope_theta)
    if logits_soft_cap:
        parts.append(SoftCap(logits_soft_cap=float(logits_soft_cap)))
    if window_left is not None and window_left >= 0:
        parts.append(SlidingWindow(window_left=int(window_left)))
    if custom_mask is not None:
        parts.append(custom_mask)
    parts.extend(vbase.components(variant))
    return compose(parts)


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
    check_options(pos_encoding_mode, variant)
    head, tail = position_encoding(pos_encoding_mode, rope_scale, rope_theta), []
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
    return bool(causal), soft_cap, window_left is not None and window_left >= 0, compose(head + tail)
