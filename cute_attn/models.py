"""A model's attention, read from its Hugging Face ``config.json`` (or a built-in name), and the
kernel specializations serving it can load: ``python -m cute_attn compile --model CONFIG``.

What a serving step of such a model calls, and so what is compiled per arch:

* decode (both arches): every layer kind's variant -- plain, sliding window, soft-cap, and
  with ``run(sinks=)`` the same + sinks -- at one kv head per work item and at the head
  packings the wrapper may choose (2 / 4 heads where ``heads * group <= 16``), and the
  partials' merge of the decode tile;
* prefill (Hopper): causal (a request's own tokens) and non-causal (a cascade's shared prefix)
  at the planner's 64- and 128-row tiles, ragged and paged (TMA page boxes for page sizes
  k*16, the cp.async gather for the others, the KV pass's gather), with the layer kinds' flags
  and sinks; the speculative-decoding tree mask (a custom mask over a paged cache); the
  partials' merges of the prefill tiles;
* prefill on the portable kernel (every other arch, and Hopper's batches the backend table
  gives it: ``families.backends.portable_tiles``): the same cases at its 16 / 32 / 64-row
  tiles, ragged and paged (it reads any page size itself); a 16-bit cache only (an fp8 cache
  needs the Hopper kernel's KV pass);
* the ⊕ merges the cascade uses (``merge_pair``, masked or not, and ``merge_states``).

An fp8 KV cache (``kv_dtype``: from a config's ``kv_cache_dtype`` -- vLLM's names ``fp8`` /
``fp8_e4m3`` / ``fp8_e5m2`` -- or a compressed-tensors ``quantization_config.kv_cache_scheme``
of 8-bit floats, or ``compile --model NAME --kv-cache-dtype fp8``) swaps the cache-reading
kernels: the fp8 decode kernels, and for prefill the KV pass that dequantizes the cache
(paged and ragged) ahead of the ragged 16-bit kernels (the paged ones never read an fp8
cache).

Multi-head latent attention (DeepSeek-V2/V3/R1: a config with ``kv_lora_rank``; built-in
``deepseek-v3``): prefill runs on the decompressed K / V as MHA with head_dim_qk = nope + rope
(192) and head_dim_vo = ``v_head_dim`` (128), ragged (the engines' MLA prefill: the new tokens
causal, chunks of the cached prefix non-causal, merged by their LSE), so its set is the ragged
prefill at 192 / 128, its merges at 128 and the MLA decode kernels (``families/mla.py``); with
an fp8 cache the MLA decode kernels are the fp8-latent ones (the prefill's decompressed K / V
stay 16-bit).

RoPE is the engine's (applied before attention), so no RoPE kernels are compiled; a model with
a head dim no kernel serves is an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from .abi.archs import HOPPER
from .abi.dtypes import ATTENTION, name_of
from .families import decode, kv_pass, merge, mla, prefill, prefill_mma
from .families.backends import portable_paged, portable_tiles
from .families.decode import decode_spec
from .families.kept import kept_update_spec
from .families.prefill import PAGE_BOX, page_box_for, prefill_spec
from .families.prefill_mma import prefill_mma_spec
from .variants.builtins import AttentionSink, SlidingWindow, SoftCap
from .wrappers.options import resolve_variant


@dataclass(frozen=True)
class ModelAttention:
    """What of a model's config shapes its attention kernels."""

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"  # spec name of torch_dtype
    sliding_window: Optional[int] = None  # layers with a window (all, or some: layer kinds)
    global_layers: bool = True  # layers without a window exist too
    logits_soft_cap: Optional[float] = None
    sinks: bool = False
    kv_dtype: Optional[str] = None  # an fp8 KV cache: "e4m3" / "e5m2" (None: the model's dtype)
    head_dim_vo: Optional[int] = None  # V's head dim where it differs from q / k's (MLA's prefill)
    mla: bool = False  # multi-head latent attention: decode by the MLA kernel, prefill as MHA

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def dv(self) -> int:
        return self.head_dim_vo or self.head_dim


BUILTIN = {
    "llama-3": ModelAttention("llama-3", 32, 8, 128),
    "llama-3-70b": ModelAttention("llama-3-70b", 64, 8, 128),
    "qwen3": ModelAttention("qwen3", 32, 8, 128),
    "mistral": ModelAttention("mistral", 32, 8, 128, sliding_window=4096, global_layers=False),
    "gemma-2": ModelAttention("gemma-2", 16, 8, 256, sliding_window=4096, logits_soft_cap=50.0),
    "gemma-3": ModelAttention("gemma-3", 16, 8, 256, sliding_window=1024),
    "gpt-oss": ModelAttention("gpt-oss", 64, 8, 64, sliding_window=128, sinks=True),
    "phi-3": ModelAttention("phi-3", 40, 10, 128),  # Phi-3-medium
    # head dim 96: rows of 192 bytes (an fp8 cache at 96 decodes on the prefill kernels, Hopper only)
    "phi-3-mini": ModelAttention("phi-3-mini", 32, 32, 96, sliding_window=2047, global_layers=False),
    "phi-4": ModelAttention("phi-4", 40, 10, 128),
    # head dim 80: rows of 160 bytes (as at 96, an fp8 cache decodes on the prefill kernels)
    "phi-2": ModelAttention("phi-2", 32, 32, 80),
    # MLA: prefill over the decompressed K / V (128 heads, q/k 128 nope + 64 rope, v 128)
    "deepseek-v3": ModelAttention("deepseek-v3", 128, 128, 192, head_dim_vo=128, mla=True),
}
ALIASES = {
    "llama-3.1": "llama-3",
    "llama-3.2": "llama-3",
    "llama-3.3": "llama-3-70b",
    "phi-3-medium": "phi-3",
    "deepseek-r1": "deepseek-v3",
}


# vLLM's --kv-cache-dtype names (and the dtypes' own) -> the spec name of an fp8 cache
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": "e4m3",
    "fp8_e4m3": "e4m3",
    "float8_e4m3fn": "e4m3",
    "e4m3": "e4m3",
    "fp8_e5m2": "e5m2",
    "float8_e5m2": "e5m2",
    "e5m2": "e5m2",
}


def kv_cache_dtype(text, name: str = "model") -> Optional[str]:
    """The spec name of a ``kv_cache_dtype`` setting (None: the model's own dtype)."""
    if text is None:
        return None
    key = str(text).replace("torch.", "").lower()
    if key in ("bfloat16", "float16", "half", "bf16", "fp16"):
        return None
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"{name}: kv_cache_dtype {text!r}; known: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[key]


def _config_kv_dtype(cfg: dict, name: str) -> Optional[str]:
    if cfg.get("kv_cache_dtype") is not None:
        return kv_cache_dtype(cfg["kv_cache_dtype"], name)
    scheme = (cfg.get("quantization_config") or {}).get("kv_cache_scheme") or {}
    if scheme.get("num_bits") == 8 and scheme.get("type", "float") == "float":
        return "e4m3"  # compressed-tensors' fp8 KV cache (vLLM serves it as fp8_e4m3)
    return None


def with_kv_cache_dtype(m: ModelAttention, text) -> ModelAttention:
    """``m`` with its KV cache in ``text`` (``kv_cache_dtype``'s names; None keeps it)."""
    return m if text is None else replace(m, kv_dtype=kv_cache_dtype(text, m.name))


def from_config(cfg: dict, name: str = "model") -> ModelAttention:
    """The attention of a Hugging Face ``config.json`` (a multimodal config's ``text_config``)."""
    cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
    hq = int(cfg["num_attention_heads"])
    hk = int(cfg.get("num_key_value_heads") or hq)
    d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq)
    mla_model = cfg.get("kv_lora_rank") is not None and cfg.get("qk_rope_head_dim") is not None
    dv = None
    if mla_model:  # the prefill's MHA form: every head its own decompressed K / V
        hk = hq
        d = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        dv = int(cfg.get("v_head_dim") or cfg["qk_nope_head_dim"])
    text = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    dt = name_of("float16" if text == "half" else text, ATTENTION)
    if dt is None:
        raise ValueError(f"{name}: torch_dtype {cfg.get('torch_dtype')!r} has no attention kernels (fp16/bf16)")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) is not False else None
    types = cfg.get("layer_types") or []
    kinds = set(types)
    global_layers = bool(
        window is None
        or kinds & {"full_attention"}
        or cfg.get("sliding_window_pattern")
        or cfg.get("_sliding_window_pattern")
        or cfg.get("model_type") in ("gemma2", "gemma3", "gemma3_text", "gpt_oss")
    )
    if types and "sliding_attention" not in kinds:
        window = None
    cap = cfg.get("attn_logit_softcapping")
    sinks = cfg.get("model_type") == "gpt_oss" or bool(cfg.get("attention_sinks"))
    kv = _config_kv_dtype(cfg, name)
    return ModelAttention(
        name, hq, hk, d, dt, int(window) if window else None, global_layers, cap, sinks, kv, dv if dv != d else None,
        mla_model,
    )  # fmt: skip


def resolve_model(text: str) -> ModelAttention:
    """A built-in name (``BUILTIN``) or the path of a ``config.json``."""
    key = ALIASES.get(text.lower(), text.lower())
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {text!r}: neither a built-in model ({', '.join(sorted(BUILTIN))}) nor a config.json")
    return from_config(json.loads(path.read_text()), path.parent.name or path.stem)


def _check(m: ModelAttention) -> None:
    if m.mla:
        if not prefill.serves(m.head_dim, m.dv):
            raise ValueError(
                f"{m.name}: MLA prefill at head_dim_qk {m.head_dim} / head_dim_vo {m.dv} is not served yet "
                f"(kernels: {prefill.HEAD_DIM_PAIRS})"
            )
    elif m.head_dim not in decode.HEAD_DIMS + prefill.HEAD_DIMS or m.dv != m.head_dim:
        raise ValueError(
            f"{m.name}: head_dim {m.head_dim} is not served yet (decode: {decode.HEAD_DIMS}; "
            f"on the prefill kernels: {prefill.HEAD_DIMS} on Hopper, {prefill_mma.HEAD_DIMS} elsewhere)"
        )
    if m.num_qo_heads % m.num_kv_heads:
        raise ValueError(f"{m.name}: {m.num_qo_heads} query heads are not a multiple of {m.num_kv_heads} kv heads")
    if m.dtype not in ATTENTION:
        raise ValueError(f"{m.name}: dtype {m.dtype} has no attention kernels")


def _layer_kinds(m: ModelAttention) -> list:
    """(window, soft_cap) per kind of layer."""
    kinds = []
    if m.sliding_window is None or m.global_layers:
        kinds.append((False, m.logits_soft_cap is not None))
    if m.sliding_window is not None:
        kinds.append((True, m.logits_soft_cap is not None))
    return kinds


def _decode_variant(window: bool, soft_cap: bool):
    """The decode wrapper's composition: soft-cap, then the window."""
    parts = ([SoftCap()] if soft_cap else []) + ([SlidingWindow()] if window else [])
    return None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _portable_prefill_specs(m: ModelAttention, arch: str) -> list:
    """The portable prefill's share of ``model_specs`` (its tiles on ``arch``; none for an fp8
    cache)."""
    tiles, paged = portable_tiles(arch, m.head_dim), portable_paged(arch)
    if m.kv_dtype is not None or not tiles:
        return []
    dt, d, out = m.dtype, m.head_dim, []
    for window, cap in _layer_kinds(m):
        kw = dict(window_left=1 if window else -1, logits_soft_cap=50.0 if cap else None)
        for causal in (True, False):
            for sinks in (False, True) if m.sinks else (False,):
                c, cap_flag, win, v = resolve_variant(causal=causal, sinks=sinks, **kw)
                out += [prefill_mma_spec(arch, dt, d, t, p, c, cap_flag, win, v) for t in tiles for p in paged]
        c, cap_flag, win, v = resolve_variant(custom_mask=True, **kw)  # speculative decoding's tree mask
        out += [prefill_mma_spec(arch, dt, d, t, True, c, cap_flag, win, v) for t in tiles]
    return out + [merge.merge_partials_spec(arch, dt, d, t) for t in tiles]


def model_specs(m: ModelAttention, arch: str) -> list:
    """The specializations a serving step of ``m`` may load on ``arch`` (see the module doc)."""
    _check(m)
    if m.mla:
        return _mla_model_specs(m, arch)
    dt, d, kv = m.dtype, m.head_dim, m.kv_dtype
    if d in prefill_mma.WIDE_HEAD_DIMS:  # plain attention on the wide kernels (kernels/decode_wide.py)
        if kv is not None or m.sliding_window is not None or m.logits_soft_cap is not None or m.sinks:
            raise ValueError(f"{m.name}: head_dim {d} serves a 16-bit cache without window, soft-cap or sinks")
        specs = [
            decode_spec(arch, dt, d),
            merge.merge_partials_spec(arch, dt, d, decode.TILE_Q),
            kept_update_spec(arch),
        ]
        return list(dict.fromkeys(specs + [s for s in prefill_mma.wide_specs(arch) if s.pdict["dtype"] == dt]))
    heads = [1] + [
        h
        for h in decode.PACKED_HEADS
        if m.num_kv_heads % h == 0 and h * m.group <= decode.TILE_Q and decode.packed_ok(h, m.group, d)
    ]
    specs = []
    if d in decode.head_dims_for(kv is not None):  # else decode runs on the prefill kernels (below)
        for window, cap in _layer_kinds(m):
            base = _decode_variant(window, cap)
            for v in [base] + ([AttentionSink() if base is None else base + AttentionSink()] if m.sinks else []):
                specs += [decode_spec(arch, dt, d, v, h, kv) for h in heads]
        specs.append(merge.merge_partials_spec(arch, dt, d, decode.TILE_Q))
        specs.append(kept_update_spec(arch))  # CUDA-graph decode's per-step re-plan
    specs += [merge.merge_pair_spec(arch, dt, d, masked) for masked in (False, True)]
    specs.append(merge.merge_states_spec(arch, dt, d))
    if d in prefill_mma.HEAD_DIMS:
        specs += _portable_prefill_specs(m, arch)
    if arch != HOPPER:
        return list(dict.fromkeys(specs))
    boxes = (page_box_for(True, PAGE_BOX), page_box_for(True, 1))
    for window, cap in _layer_kinds(m):
        for causal in (True, False):
            for sinks in (False, True) if m.sinks else (False,):
                c, cap_flag, win, v = resolve_variant(
                    causal=causal, window_left=1 if window else -1, logits_soft_cap=50.0 if cap else None, sinks=sinks
                )
                for tile in prefill.TILES:
                    specs.append(prefill_spec(arch, dt, d, tile, False, c, cap_flag, win, v))
                    if kv is None:  # an fp8 cache: the paged one through the KV pass, then the ragged kernel
                        specs += [prefill_spec(arch, dt, d, tile, True, c, cap_flag, win, v, pb) for pb in boxes]
                    else:  # or widened in the kernel (short queries), ragged and in page boxes
                        specs += _kv8_specs(arch, dt, d, tile, c, cap_flag, win, v, kv)
        # speculative decoding: a tree mask over the paged cache (short queries: the small tile)
        c, cap_flag, win, v = resolve_variant(
            custom_mask=True, window_left=1 if window else -1, logits_soft_cap=50.0 if cap else None
        )
        for tile in prefill.TILES:
            if kv is None:
                specs += [prefill_spec(arch, dt, d, tile, True, c, cap_flag, win, v, pb) for pb in boxes]
            else:
                specs.append(prefill_spec(arch, dt, d, tile, False, c, cap_flag, win, v))
                specs += _kv8_specs(arch, dt, d, tile, c, cap_flag, win, v, kv)
    if kv is None:
        specs.append(kv_pass.kv_pass_spec(arch, dt, d, True, None))
    else:  # the dequantizing passes of a paged and a ragged fp8 cache
        specs += [kv_pass.kv_pass_spec(arch, dt, d, paged, None, kv) for paged in (True, False)]
    specs += [merge.merge_partials_spec(arch, dt, d, t) for t in prefill.TILES]
    return list(dict.fromkeys(specs))


def _kv8_specs(arch, dt, d, tile, causal, cap, window, variant, kv) -> list:
    """The prefill kernels that widen an fp8 cache themselves (ragged, and paged in page boxes)
    where they serve the model's shape (``families.prefill.kv8_serves``), and those that run its
    dequantizing pass themselves (``kv8_pass``: a ragged and a paged cache; no traced variant)."""
    widen = [
        prefill_spec(arch, dt, d, tile, paged, causal, cap, window, variant, pb, kv_dtype=kv)
        for paged, pb in ((False, 0), (True, PAGE_BOX))
        if prefill.kv8_serves(dt, kv, d, d, paged, variant, pb)
    ]
    if variant is not None or not prefill.kv8_pass_serves(dt, kv, d, d, tile):
        return widen
    srcs = (prefill.KV8_PASS_RAGGED, prefill.KV8_PASS_PAGED)
    return widen + [prefill_spec(arch, dt, d, tile, False, causal, cap, window, kv_dtype=kv, kv8_pass=s) for s in srcs]


def _mla_model_specs(m: ModelAttention, arch: str) -> list:
    """An MLA model: the MLA decode kernels (and their merges), the ⊕ merges at head_dim_vo, and
    on Hopper the ragged prefill at (head_dim, head_dim_vo), causal and not, both tiles."""
    dt, d, dv = m.dtype, m.head_dim, m.dv
    specs = mla.shipped_specs(arch, dtype_names=(dt,), kv_names=(m.kv_dtype,))
    specs += [merge.merge_pair_spec(arch, dt, dv, masked) for masked in (False, True)]
    specs.append(merge.merge_states_spec(arch, dt, dv))
    if arch == HOPPER:
        for causal in (True, False):
            specs += [prefill_spec(arch, dt, d, t, False, causal, head_dim_vo=dv) for t in prefill.TILES]
        specs += [merge.merge_partials_spec(arch, dt, dv, t) for t in prefill.TILES]
    return list(dict.fromkeys(specs))
