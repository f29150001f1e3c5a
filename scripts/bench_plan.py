#!/usr/bin/env python3
"""CPU benchmark of the scheduler: plan() time and load balance.

Timing: median wall time of ``Planner.plan()`` (validation, tiling, assignment -- snake,
LPT or the wrap-around split --, records, staging into the host buffer) over --calls
calls, on one core (no GPU: nothing is uploaded); the 10th / 90th percentiles show the
spread. Balance: for length distributions, max / mean modelled CTA cost
(cost = alpha * cta_tile_q + beta * kv tokens per work item) of

* cute_attn   -- our plan;
* per_request -- one CTA per (request, kv head), all its query tiles, no kv split, launched
                 as a grid: the hardware hands blocks out in launch order to whichever CTA
                 slot frees first (greedy list scheduling, unsorted);
* split_k     -- a fixed split-k heuristic (FlashDecoding-style): every (request, kv
                 head, query tile) cut into the same number of equal kv chunks, enough for
                 the units to fill the CTAs once (k = ceil(C / units), chunks >= 256
                 tokens), launched as a grid the same way.

Each impl's mean is its own total / num_ctas, so splitting overhead shows up in its total;
``max/ideal`` (makespan over the unsplit total / num_ctas) is printed as well.

    python scripts/bench_plan.py [--calls 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cute_attn.sched import Limits, Planner  # noqa: E402
from cute_attn.sched.cost import build_tiles  # noqa: E402

NUM_SMS = 132  # H100 / H200
HQ, HK, HEAD_DIM = 32, 8, 128  # Llama-3-8B-like GQA (group 4)
PAGE = 16
ALPHA, BETA = 2, 1


def limits():
    return Limits(max_batch=1024, max_total_q_tokens=32768, num_qo_heads=HQ, num_kv_heads=HK, head_dim=HEAD_DIM)


# -- length distributions ----------------------------------------------------------------
def lengths(dist: str, b: int, rng, scale: int = 1):
    if dist == "uniform":
        x = rng.integers(512, 8193, b)
    elif dist == "zipf":  # a heavy tail: most short, a few very long
        x = np.minimum(256 * rng.zipf(1.4, b), 131072)
    elif dist == "lognormal":  # ShareGPT-like conversation lengths (median ~1.1k)
        x = np.clip(rng.lognormal(7.0, 1.0, b), 16, 32768).astype(np.int64)
    elif dist == "onelong":  # one long context among many short ones
        x = rng.integers(64, 1025, b)
        x[0] = 131072
    else:
        raise ValueError(dist)
    return np.maximum(x // scale, 1)


def batch(mode: str, dist: str, b: int, rng):
    """(qo_indptr, kv_lens, causal). decode: one query token each; prefill: causal
    chunked prefill, qo_len = a chunk of the tail of kv (<= 512 tokens)."""
    kv = lengths(dist, b, rng)
    if mode == "decode":
        q = np.ones(b, np.int64)
        causal = False
    else:
        q = np.minimum(kv, rng.integers(16, 513, b))
        causal = True
    return np.r_[0, np.cumsum(q)], kv, causal


# -- baselines ---------------------------------------------------------------------------
def list_schedule(costs, c):
    """Blocks in launch order, each to the CTA slot that frees first."""
    h = [(0, i) for i in range(c)]
    for x in costs:
        load, i = heapq.heappop(h)
        heapq.heappush(h, (load + int(x), i))
    return np.array(sorted(load for load, _ in h), np.int64)


def baselines(qo_indptr, kv, causal, tile, c):
    q = np.diff(qo_indptr)
    g = HQ // HK
    req, _, _, ext, _ = build_tiles(q, kv, g, tile, causal)
    per = ALPHA * tile
    # per_request: (request, head) units, all tiles of the request in one CTA
    unit = np.bincount(req, weights=per + BETA * ext, minlength=q.shape[0]).astype(np.int64)
    per_req = list_schedule(np.repeat(unit[q > 0], HK), c)
    # split_k: (tile, head) units cut into k equal chunks, k fills the grid once
    units = ext.shape[0] * HK
    k = max(1, -(-c // max(units, 1)))
    kk = np.minimum(k, np.maximum(1, ext // 256))
    chunk = -(-ext // kk)
    costs = []
    for e, n, ch in zip(ext.tolist(), kk.tolist(), chunk.tolist()):
        for j in range(n):
            costs.append(per + BETA * max(0, min(ch, e - j * ch)))
    split = list_schedule(np.tile(np.array(costs, np.int64), HK), c)
    ideal = HK * (ext.shape[0] * per + BETA * int(ext.sum())) / c
    return {"per_request": per_req, "split_k": split}, ideal


# -- main --------------------------------------------------------------------------------
def time_plan(planner, args, kw, calls):
    """(median, 10th percentile, 90th percentile) of plan() wall time in us."""
    for _ in range(min(calls, 50)):  # warm up (caches, allocator)
        planner.plan(*args, **kw)
    ts = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter()
        planner.plan(*args, **kw)
        ts[i] = time.perf_counter() - t0
    p10, p50, p90 = np.percentile(ts, [10, 50, 90]) * 1e6
    return float(p50), float(p10), float(p90)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None, help="append records to this JSON list file")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    except (AttributeError, OSError):
        pass
    rng = np.random.default_rng(a.seed)
    planner = Planner(limits(), NUM_SMS, 1, alpha=ALPHA, beta=BETA)
    records = []

    def rec(case, metric, value):
        records.append({"case": case, "metric": metric, "value": round(value, 4)})

    print(f"plan() time, median of {a.calls} calls, one core, C={planner.num_ctas} CTAs, {HQ}/{HK} heads, page {PAGE}")
    print(
        f"{'case':34s} {'us':>8s} {'p10-p90':>13s} {'items':>7s} {'merges':>7s} {'tile':>5s} "
        f"{'max/mean':>9s} {'items/CTA max':>13s}"
    )

    def one(case, pl, qi, kv, kw):
        us, lo, hi = time_plan(pl, (qi, kv), kw, a.calls)
        p = pl.plan(qi, kv, **kw)
        ratio = p.cta_cost.max() / p.cta_cost.mean()
        per = np.diff(p.work_indptr)
        print(
            f"{case:34s} {us:8.1f} {f'{lo:.0f}-{hi:.0f}':>13s} {p.num_work_items:7d} "
            f"{p.num_merge_tasks:7d} {p.cta_tile_q:5d} {ratio:9.3f} "
            f"{f'{per.max()} ({per.mean():.1f})':>13s}"
        )
        rec(case, "us", us)

    timing = [
        ("plan/decode/bs64", "decode", "uniform", 64),
        ("plan/decode/bs64/zipf", "decode", "zipf", 64),
        ("plan/decode/bs64/onelong", "decode", "onelong", 64),
        ("plan/decode/bs1024", "decode", "uniform", 1024),
        ("plan/prefill/bs1024", "prefill", "lognormal", 1024),
        ("plan/prefill/bs64", "prefill", "lognormal", 64),
        ("plan/decode/bs16/lognormal", "decode", "lognormal", 16),  # (last: keeps the others' data)
    ]
    # The H200 decode regression case (132 SMs x 2 CTAs, alpha 8, tol 0.01): 128 lognormal
    # requests; the kernel pays per item and per split, so items/CTA and merges matter.
    h200 = Planner(
        Limits(
            max_batch=128,
            max_total_q_tokens=128,
            num_qo_heads=HQ,
            num_kv_heads=HK,
            head_dim=HEAD_DIM,
            max_qo_len=1,
            max_partial_rows=HK * 264 * 16,
        ),
        NUM_SMS,
        2,
        alpha=8,
        beta=BETA,
        balance_tol=0.01,
        pin_memory=False,
    )
    for case, mode, dist, b in timing:
        qi, kv, causal = batch(mode, dist, b, rng)
        if mode == "prefill" and qi[-1] > 32768:  # keep within max_total_q_tokens
            q = np.minimum(np.diff(qi), 32768 // b)
            qi = np.r_[0, np.cumsum(q)]
        one(case, planner, qi, kv, dict(causal=causal, page_size=PAGE))
    lr = __import__("random").Random(0)
    kv = np.array([max(1, min(32768, int(lr.lognormvariate(7.0, 1.0)))) for _ in range(128)])
    one("plan/decode/bs128/lognormal/264cta", h200, np.arange(129), kv, dict(page_size=PAGE, cta_tile_q=16))

    print("\nbalance: max/mean CTA cost (max/ideal), mean of 5 seeds, worst seed in brackets")
    print(f"{'case':34s} {'cute_attn':>22s} {'per_request':>22s} {'split_k':>22s}")
    for mode, bs in (("decode", (16, 64, 256)), ("prefill", (8, 64))):
        for dist in ("uniform", "zipf", "lognormal", "onelong"):
            for b in bs:
                case = f"balance/{dist}/{mode}/bs{b}"
                res = {"cute_attn": [], "per_request": [], "split_k": []}
                for seed in range(5):
                    r2 = np.random.default_rng(1000 * seed + b)
                    qi, kv, causal = batch(mode, dist, b, r2)
                    p = planner.plan(qi, kv, causal=causal, page_size=PAGE)
                    base, ideal = baselines(qi, kv, causal, p.cta_tile_q, planner.num_ctas)
                    base["cute_attn"] = p.cta_cost
                    for k, loads in base.items():
                        res[k].append((loads.max() / loads.mean(), loads.max() / ideal))
                cells = []
                for k in ("cute_attn", "per_request", "split_k"):
                    r = np.array(res[k])
                    cells.append(f"{r[:, 0].mean():6.3f} [{r[:, 0].max():6.3f}] ({r[:, 1].mean():5.2f})")
                    rec(case, "ratio", float(r[:, 0].mean()))
                    records[-1]["impl"] = k
                print(f"{case:34s} " + " ".join(f"{c:>22s}" for c in cells))

    if a.json:
        try:
            commit = (
                subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"],
                    capture_output=True,
                    text=True,
                    cwd=os.path.dirname(__file__),
                ).stdout.strip()
                or None
            )
        except OSError:
            commit = None
        device = f"CPU: {platform.processor() or platform.machine()} (1 core)"
        date = datetime.date.today().isoformat()
        old = []
        if os.path.exists(a.json):
            with open(a.json) as f:
                old = json.load(f)
        for r in records:
            r.setdefault("impl", "cute_attn")
            r.update(device=device, commit=commit, date=date)
        keys = {(r["case"], r["impl"], r["metric"]) for r in records}
        old = [r for r in old if (r["case"], r["impl"], r["metric"]) not in keys]
        with open(a.json, "w") as f:
            json.dump(old + records, f, indent=1)
        print(f"\nwrote {len(records)} records to {a.json}")


if __name__ == "__main__":
    main()
