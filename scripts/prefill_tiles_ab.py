#!/usr/bin/env python3
"""A/B of the Hopper prefill kernel's knobs -- P pinning (``pin_p``), keys per block (``tile_n``),
items back to back (``overlap_items``) -- on
the ragged bench cases, with FlashInfer's fa3 prefill in the same turns where it imports.

Every variant replaces the planned wrapper's module (same plan, same data); every output is
checked against the first variant's (max |diff|, NaNs) and FlashInfer's against ours.  Timing:
``bench.common.interleaved`` (one call of each in turns, CUDA events, medians), ROUNDS rounds.

    # CPU box (the DSL): compile the variants into a cache
    python scripts/prefill_tiles_ab.py compile build/aot
    # GPU machine, that cache as CUTE_ATTN_CACHE_DIR (plus the bench's usual kernels):
    python scripts/prefill_tiles_ab.py run --json out.json

``AB_ROUNDS`` (rounds), ``AB_ONLY`` (substrings of case names) and ``AB_VARIANTS`` (variant names,
e.g. ``main``: the plan's kernel beside FlashInfer) narrow a run.  A development tool
(``python -m cute_attn bench`` is the benchmark of record).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cute_attn.bench.prefill import varlen32_lengths

H = 16  # q and kv heads of the ragged cases (as the bench)
ROUNDS, CALLS = int(os.environ.get("AB_ROUNDS", 3)), 20
# variant name -> knobs over the plan's spec
HD128 = {
    "main": {},
    "sequential": dict(overlap_items=0),  # items one after the other, 112 keys, P not pinned
}
HD64 = {"main": {}, "overlap": dict(overlap_items=1)}
HD256 = {
    "main": {},  # 64 keys, P pinned (PINNED)
    "unpinned": dict(pin_p=0),
    "pingpong": dict(pingpong=1),
}


# (case, lengths, causal, head dim, variants, tile_q values the plan may pick)
CASES = [
    ("prefill/hd128/noncausal/s8192", [8192] * 2, False, 128, HD128, (128,)),
    ("prefill/hd128/causal/s8192", [8192] * 2, True, 128, HD128, (128,)),
    ("prefill/hd128/causal/varlen32_lognormal2k", varlen32_lengths(), True, 128, HD128, (128,)),
    ("prefill/hd64/noncausal/s8192", [8192] * 2, False, 64, HD64, (128,)),
    ("prefill/hd64/causal/s8192", [8192] * 2, True, 64, HD64, (128,)),
    ("prefill/hd64/causal/varlen32_lognormal2k", varlen32_lengths(), True, 64, HD64, (128,)),
    ("prefill/hd256/noncausal/s8192", [8192] * 2, False, 256, HD256, (128,)),
    ("prefill/hd256/causal/s8192", [8192] * 2, True, 256, HD256, (128,)),
]
if os.environ.get("AB_ONLY"):  # a comma-separated subset of the cases, e.g. "hd128/causal"
    CASES = [c for c in CASES if any(w in c[0] for w in os.environ["AB_ONLY"].split(","))]


def _spec(d, causal, tile_q, **knobs):
    return dict(
        dtype="bf16", head_dim=d, tile_q=tile_q, paged=False, causal=causal, soft_cap=False, window=False, **knobs
    )


def specs():
    import cute_attn.prefill  # noqa: F401  (registers the family)
    from cute_attn.families.spec import Spec

    out = {}
    for _case, _lens, causal, d, variants, tqs in CASES:
        for tq in tqs:
            for kn in variants.values():
                s = Spec.make("batch_prefill_sm90", "sm_90a", **_spec(d, causal, tq, **kn))
                out[s.describe()] = s
    return list(out.values())


def compile_all(cache_dir: str) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from pathlib import Path

    from cute_attn.runtime import build

    for s in specs():
        try:
            e = build.build(s, Path(cache_dir))
        except AssertionError as why:  # a knob the kernel refuses for this shape
            print(s.describe(), "skipped:", why, flush=True)
            continue
        print(s.describe(), e.meta.get("resources"), flush=True)


def run(json_path) -> None:
    import torch

    from cute_attn.bench import peers
    from cute_attn.bench.common import interleaved
    from cute_attn.runtime.loader import KernelNotAvailable, kernel

    fi = peers.flashinfer()
    records = []
    for case, lens, causal, d, variants, _tqs in CASES:
        total = sum(lens)
        ind = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
        q = torch.randn(total, H, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        flops = sum(4 * H * d * n * n / (2 if causal else 1) for n in lens)
        fns, outs = {}, {}
        keep = [v for v in os.environ.get("AB_VARIANTS", "").split(",") if v]  # e.g. "main": only those
        for name, kn in variants.items():
            if keep and name not in keep:
                continue
            try:
                call = peers.ragged_prefill(
                    peers.ours(), torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), ind, q, k, v, causal, d
                )
                w = call.wrapper
                base = dict(w._spec_kw)
                w._binding.module = kernel("batch_prefill_sm90", "sm_90a", **{**base, **kn})
            except KernelNotAvailable as e:  # a case or knob the cache was not compiled for
                print(f"{case} {name}: skipped ({str(e)[:120]})", flush=True)
                continue
            call.out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            fns[name], outs[name] = call, call.out
        if fi is not None:
            call, why = peers.fi_call(peers.ragged_prefill, fi, fi.workspace(128), ind, q, k, v, causal, d)
            if call is None:
                print(f"{case}: flashinfer skipped: {why}")
            else:
                fns["flashinfer"], outs["flashinfer"] = call, call.out
        if "main" not in outs:
            continue
        ref = outs["main"]
        for name, o in outs.items():
            diff = (o.float() - ref.float()).abs().max().item()
            nan = int(torch.isnan(o).sum())
            print(f"{case} {name}: maxdiff vs main {diff:.2e} nan {nan}", flush=True)
            if nan or diff > 5e-2:
                print(f"  WRONG: {name} dropped from timing")
                fns.pop(name)
        rounds = [interleaved(fns, CALLS) for _ in range(ROUNDS)]
        for name in fns:
            ts = sorted(r[name] for r in rounds)
            us = ts[len(ts) // 2]
            records.append(dict(case=case, impl=name, us=us, tflops=flops / us / 1e6))
        t0 = records[-len(fns)]["us"]
        for r in records[-len(fns) :]:
            print(
                f"{case:45s} {r['impl']:10s} {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s main/this {t0 / r['us']:.3f}",
                flush=True,
            )
        del q, k, v, fns, outs
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile the variants (needs the DSL)")
    c.add_argument("cache_dir")
    r = sub.add_parser("run", help="time them on the GPU (kernels from $CUTE_ATTN_CACHE_DIR)")
    r.add_argument("--json")
    a = ap.parse_args(argv)
    if a.cmd == "compile":
        compile_all(a.cache_dir)
    else:
        run(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
