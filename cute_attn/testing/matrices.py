"""The test matrices: which variants and configurations the GPU tests and the ``variants`` bench
run, and the specializations those load (the ``variants`` / ``all`` presets).  Kept out of the
library modules: what ships for users is the families' business (``families.backends``)."""

from __future__ import annotations

from ..families.decode import PACKED_HEADS, decode_spec
from ..families.kv_pass import kv_pass_spec
from ..families.merge import merge_partials_spec
from ..families.prefill import ARCH as PREFILL_ARCH
from ..families.prefill import TILES, page_box_for, prefill_spec, prefill_specs
from ..families.prefill_mma import prefill_mma_spec
from ..variants.builtins import ALiBi, AttentionSink, Causal, CustomMask, FlashSigmoid, RoPE, SlidingWindow, SoftCap
from ..variants.examples import RelativePositionBias
from ..wrappers.options import resolve_variant


def variant_test_variants():
    """The variants tests/test_variants_gpu.py and the ``variants`` bench run in decode."""
    return [
        Causal(),
        ALiBi(),
        RoPE(),
        AttentionSink(),
        CustomMask(),
        FlashSigmoid(),
        RelativePositionBias(),
        SlidingWindow() + AttentionSink(),
        ALiBi() + SoftCap(),
        RoPE() + AttentionSink(),
    ]


def variant_decode_specs(arch: str):
    """Decode specializations of the variant GPU tests and bench: every variant of
    :func:`variant_test_variants` at (bf16, d128) and (f16, d64), the sink kernels of
    head-packed plans (``run(sinks=)`` after a packed plain or window ``plan()``) and a few
    packed variants the tests force."""
    sinks = [AttentionSink(), SlidingWindow() + AttentionSink()]  # run(sinks=) after a packed plan
    specs = [
        decode_spec(arch, dt, d, v, h)
        for dt, d in (("bf16", 128), ("f16", 64))
        for v, h in [(v, 1) for v in variant_test_variants()] + [(v, h) for v in sinks for h in PACKED_HEADS]
    ]
    # packed variants the GPU tests force (tests/test_variants_gpu.py, test_variant_head_packing)
    return specs + [decode_spec(arch, "bf16", 128, v, 4) for v in (Causal(), ALiBi(), CustomMask())]


def variant_test_cases():
    """The prefill variant cases of tests/test_prefill_variants_gpu.py and the ``variants``
    bench: (name, resolve_variant keywords, run() takes sinks).  ``causal`` is a no-op name
    (Causal() maps onto the flag)."""
    return [
        ("causal", dict(variant=Causal())),
        ("alibi", dict(pos_encoding_mode="ALIBI")),
        ("rope", dict(pos_encoding_mode="ROPE_LLAMA")),
        ("sink", dict(sinks=True)),
        ("custom_mask", dict(custom_mask=True)),
        ("sigmoid", dict(variant=FlashSigmoid())),
        ("rel_bias", dict(variant=RelativePositionBias())),
        ("window_sink", dict(window_left=100, sinks=True)),
        ("alibi_softcap", dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0)),
        ("rope_sink", dict(pos_encoding_mode="ROPE_LLAMA", sinks=True)),
        (
            "alibi_softcap_rel_bias",
            dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0, variant=RelativePositionBias()),
        ),
    ]


# (dtype, head_dim, page size (0: ragged), causal) of the GPU tests' configurations (tile 128
# throughout) and the extra head-dim-256 cases; the bench runs bf16/128 ragged, causal and not.
VARIANT_TEST_CONFIGS = (("bf16", 128, 0, True), ("bf16", 128, 16, False), ("f16", 64, 1, True), ("f16", 64, 0, False))
VARIANT_TEST_HD256 = (("rope_sink", ("bf16", 256, 0, True)), ("alibi_softcap", ("bf16", 256, 0, True)))


def variant_prefill_specs(arch: str):
    """Prefill specializations of the variant GPU tests and bench (for the compile presets)."""
    if arch != PREFILL_ARCH:
        return []
    cases = dict(variant_test_cases())
    todo = [(name, cfg) for name in cases for cfg in VARIANT_TEST_CONFIGS] + list(VARIANT_TEST_HD256)
    todo += [(name, ("bf16", 128, 0, c)) for name in cases for c in (False, True)]  # bench
    out, seen = [], set()
    for name, (dt, d, page_size, causal) in todo:
        kw = dict(cases[name])
        paged = page_size > 0
        # a sink case plans without its sinks (plan() picks that kernel) and runs with them
        for sinks in (False, True) if kw.get("sinks") else (kw.get("sinks", False),):
            c, cap, win, v = resolve_variant(causal=causal, **dict(kw, sinks=sinks))
            specs = [prefill_spec(arch, dt, d, 128, paged, c, cap, win, v, page_box_for(paged, page_size))]
            if paged:  # plan(kv_pass=True): the pass gathers the cache, then the ragged kernel runs
                specs.append(prefill_spec(arch, dt, d, 128, False, c, cap, win, v))
            if not sinks:  # the KV pass is keyed by the plan's variant (run()'s sinks are not in it)
                specs += [kv_pass_spec(arch, dt, d, p, v) for p in ((False, True) if paged else (False,))]
            specs = [s for s in specs if s is not None]
            for spec in specs:
                if spec not in seen:
                    seen.add(spec)
                    out.append(spec)
    return out


def fp8_prefill_test_specs(arch: str):
    """What tests/test_fp8_prefill.py loads beyond the shipped specs (the fp8 KV passes and the
    ragged kernels ship): the RoPE passes over an fp8 cache, paged and ragged, bf16 / d128 (the
    kernel, pre-rotated keys, is the variant tests')."""
    if arch != PREFILL_ARCH:
        return []
    _, _, _, rope = resolve_variant(pos_encoding_mode="ROPE_LLAMA")
    return [kv_pass_spec(arch, "bf16", 128, paged, rope, kv) for paged in (True, False) for kv in ("e4m3", "e5m2")]


def head_dim_test_specs(arch: str):
    """What tests/test_prefill_head_dims.py and the ``head_dims`` bench load beyond ``default``
    (which ships the 192 / 128 set): head dims 80 and 96, bf16 over the prefill grid (tiles,
    ragged / page boxes / gather, causal), fp16 ragged at tile 128, their merges and the bf16
    paged KV pass; at 80 also the e4m3 paged KV pass (an fp8 cache decodes through it)."""
    if arch != PREFILL_ARCH:
        return []
    specs = []
    for d in (80, 96):
        specs += prefill_specs(arch, dtype_names=("bf16",), head_dims=(d,))
        specs += prefill_specs(arch, dtype_names=("f16",), head_dims=(d,), tiles=(128,), paged=(False,))
        specs += [merge_partials_spec(arch, dt, d, t) for dt in ("bf16", "f16") for t in TILES]
        specs.append(kv_pass_spec(arch, "bf16", d, True, None))
    return specs + [kv_pass_spec(arch, "bf16", 80, True, None, "e4m3")]


def portable_prefill_test_specs(arch: str):
    """What tests/test_prefill_mma_gpu.py loads beyond the shipped portable specs (those ship on
    every arch but Hopper): its grid at bf16 / d128 (tiles 16 / 32 / 64 / 128, ragged / paged,
    causal or not), the head-dim 64 / 80 / 96 / 256 cases, soft-cap / window, its variants, and
    the merges of those plans (the ``prefill_mma`` preset is all a GPU run of them and of the
    portable kernel's bench needs)."""
    from ..families.merge import merge_partials_spec

    flag = lambda **kw: resolve_variant(**kw)  # noqa: E731  (causal, soft_cap, window, variant)
    tiles = (16, 32, 64, 128)
    out = [prefill_mma_spec(arch, "bf16", 128, t, p, c) for t in tiles for p in (False, True) for c in (0, 1)]
    out += [
        prefill_mma_spec(arch, "f16", 64, 128, False, True),
        prefill_mma_spec(arch, "f16", 64, 128, True, False),
        prefill_mma_spec(arch, "bf16", 256, 64, False, True),
        prefill_mma_spec(arch, "bf16", 256, 32, True, True),
        prefill_mma_spec(arch, "bf16", 64, 128, True, True),
        prefill_mma_spec(arch, "bf16", 128, 64, False, True, True, True),
        prefill_mma_spec(arch, "bf16", 128, 128, True, True, True, True),
        prefill_mma_spec(arch, "bf16", 128, 32, True, False, False, True),
        prefill_mma_spec(arch, "bf16", 128, 16, True, True, True, False),
    ]
    # head dim 96: bf16 over tiles x ragged / paged x causal, f16 once, soft-cap + window
    out += [prefill_mma_spec(arch, "bf16", 96, t, p, c) for t in (16, 32, 64) for p in (False, True) for c in (0, 1)]
    out += [
        prefill_mma_spec(arch, "f16", 96, 32, True, True),
        prefill_mma_spec(arch, "bf16", 96, 64, True, True, True, True),
        prefill_mma_spec(arch, "bf16", 96, 16, False, False, True, True),
    ]
    # head dim 80 (five 32-byte atom columns): bf16 over tiles x ragged / paged x causal, f16 once
    out += [prefill_mma_spec(arch, "bf16", 80, t, p, c) for t in (16, 32, 64) for p in (False, True) for c in (0, 1)]
    out += [
        prefill_mma_spec(arch, "f16", 80, 32, True, True),
        prefill_mma_spec(arch, "bf16", 80, 64, True, True, True, True),
    ]
    cases = dict(variant_test_cases())
    for name, tile, paged, causal in (
        ("sink", 64, False, True),
        ("custom_mask", 32, True, False),
        ("alibi", 16, True, True),
        ("rope", 16, False, True),
    ):
        kw = dict(cases[name])
        for sinks in (False, True) if kw.get("sinks") else (False,):
            c, cap, win, v = flag(causal=causal, **dict(kw, sinks=sinks))
            out.append(prefill_mma_spec(arch, "bf16", 128, tile, paged, c, cap, win, v))
    merges = [("bf16", 128, t) for t in tiles] + [("bf16", 256, 32), ("bf16", 256, 64)]
    merges += [("f16", 64, 128), ("bf16", 64, 128)]
    merges += [("bf16", 96, 16), ("bf16", 96, 32), ("bf16", 96, 64), ("f16", 96, 32)]
    merges += [("bf16", 80, 16), ("bf16", 80, 32), ("bf16", 80, 64), ("f16", 80, 32)]
    out += [merge_partials_spec(arch, dt, d, t) for dt, d, t in merges]
    return list(dict.fromkeys(out))
