#!/usr/bin/env python3
"""A/B of the prefill planner's item order on the GPU: whole items by LPT re-sorted per CTA
(``locality_tol=None``) against the locality list schedule (``sched/plan.Planner._locality``),
the same kernel, data and wrapper API, with FlashInfer's fa3 ragged prefill in the same turns
where it imports.

Each variant is its own planned ``BatchPrefillWithRaggedKVCacheWrapper`` (own workspace); the
outputs must be bitwise equal (the items are the same, only their CTA and order differ).
Also printed per variant: the plan's host time (median of 5 plans) and the modelled CTA balance.
Timing: ``bench.common.interleaved`` (one call of each in turns, CUDA events, medians),
``AB_ROUNDS`` rounds; ``AB_ONLY``: substrings of case names.  Kernels from
``$CUTE_ATTN_CACHE_DIR`` (the bench's prefill specs; the planner does not enter a cache key).

    python scripts/prefill_order_ab.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from cute_attn.bench.prefill import varlen32_lengths

ROUNDS, CALLS = int(os.environ.get("AB_ROUNDS", 3)), 10
VARIANTS = {"lpt": None, "locality": 1.0}


def _lognormal(n, mu, sigma, seed):
    rng = random.Random(seed)
    return [max(16, min(16384, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


# (case, lengths, causal, head dim, qo heads, kv heads)
CASES = [
    ("hd128/causal/varlen32_lognormal2k", varlen32_lengths(), True, 128, 16, 16),
    ("hd128/noncausal/varlen32_lognormal2k", varlen32_lengths(), False, 128, 16, 16),
    ("hd128/causal/varlen64_lognormal_gqa4", _lognormal(64, 7.0, 1.0, 1), True, 128, 32, 8),
    ("hd128/causal/bimodal_24x512_2x8k", [512] * 24 + [8192] * 2, True, 128, 16, 16),
    ("hd128/causal/8x4k", [4096] * 8, True, 128, 16, 16),
    ("hd128/causal/s8192", [8192] * 2, True, 128, 16, 16),
    ("hd128/noncausal/s8192", [8192] * 2, False, 128, 16, 16),
    ("hd128/causal/1x16k", [16384], True, 128, 16, 16),
    ("hd256/causal/varlen32_lognormal2k", varlen32_lengths(), True, 256, 16, 16),
]
if os.environ.get("AB_ONLY"):
    CASES = [c for c in CASES if any(w in c[0] for w in os.environ["AB_ONLY"].split(","))]


def run(json_path) -> None:
    import torch

    from cute_attn.bench import peers
    from cute_attn.bench.common import interleaved

    fi = peers.flashinfer()
    records = []
    for case, lens, causal, d, hq, hk in CASES:
        total = sum(lens)
        ind = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
        q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = sum(4 * hq * d * n * n / (2 if causal else 1) for n in lens)
        fns, outs, info = {}, {}, {}
        for name, tol in VARIANTS.items():
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            call = peers.ragged_prefill(peers.ours(), ws, ind, q, k, v, causal, d)
            w = call.wrapper
            w._planner.locality_tol = tol
            seen = []
            orig = w._planner.plan

            def spy(*a, _orig=orig, _seen=seen, **kw):
                p = _orig(*a, **kw)
                _seen.append(p)
                return p

            w._planner.plan = spy
            host = []
            for _ in range(5):
                t0 = time.perf_counter()
                w.plan(ind, ind, hq, hk, d, causal=causal, q_data_type=q.dtype)
                host.append((time.perf_counter() - t0) * 1e3)
            p = seen[-1]
            bal = float(p.cta_cost.max()) * p.num_ctas / float(p.cta_cost.sum())
            info[name] = (statistics.median(host), bal, p.time_ordered, p.num_work_items, p.has_split)
            call.out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            fns[name], outs[name] = call, call.out.clone()
        if fi is not None:
            call, why = peers.fi_call(peers.ragged_prefill, fi, fi.workspace(256), ind, q, k, v, causal, d)
            if call is None:
                print(f"{case}: flashinfer skipped: {why}")
            else:
                fns["flashinfer"], outs["flashinfer"] = call, call.out
        ref = outs["lpt"]
        for name, o in outs.items():
            diff = (o.float() - ref.float()).abs().max().item()
            nan = int(torch.isnan(o).sum())
            same = bool(torch.equal(o, ref))
            extra = ""
            if name in info:
                h, bal, to, n, sp = info[name]
                extra = f" plan {h:.2f} ms, modelled max/mean {bal:.3f}, time_ordered {to}, items {n}, split {sp}"
            print(f"{case} {name}: maxdiff {diff:.2e} bitwise {same} nan {nan}{extra}", flush=True)
            if nan or (name in VARIANTS and not same) or diff > 5e-2:
                print(f"  WRONG: {name} dropped from timing")
                fns.pop(name)
        rounds = [interleaved(fns, CALLS) for _ in range(ROUNDS)]
        base = None
        for name in fns:
            us = statistics.median(r[name] for r in rounds)
            base = base or us
            rec = dict(case=case, impl=name, us=us, tflops=flops / us / 1e6)
            if name in info:
                rec.update(plan_ms=info[name][0], balance=info[name][1])
            records.append(rec)
            print(f"{case:42s} {name:10s} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s lpt/this {base / us:.3f}")
        del q, k, v, fns, outs
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    run(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
