"""Host time of the per-step decode re-plan on a GPU machine: ours (``fast_decode_plan`` and
``plan()``) and FlashInfer's ``fast_decode_plan`` where it imports, CUDA-graph wrappers, 32/8
heads, hd128, bf16, page 16, batch 64 / 256 / 1024, over three length traces (``traces``):

* ``steady``  -- every request one token longer each step;
* ``churn``   -- as steady, and each request ends with probability 1/256 a step (outputs of
  256 tokens on average) and is replaced by a new one of 1-4096 tokens; finished requests
  leave the batch and new ones join at its end (SGLang's filter + merge order, which moves
  every request behind a finished one);
* ``random``  -- independent lengths 1-4096 every step (every step a new batch: the worst case).

The engine's step writes the device index buffers, then calls the re-plan with host copies of
indptr / last_page_len (SGLang's ``global_override_indptr_cpu``); only the re-plan is timed.
Run it pinned to one core: the figure is what one engine thread pays per step. One JSON line
per (impl, call, trace, batch): median / mean / p90 us, and for ours the share of steps that
planned from scratch (``sched/reuse.py``: the others keep the last plan's items).

    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=build/aot taskset -c 0 python3 scripts/bench_host.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HQ, HK, D, PS = 32, 8, 128, 16
STEPS = 400


def traces(b: int, steps: int = STEPS, seed: int = 0):
    """{name: list of int64 length arrays} (module doc)."""
    rng = np.random.default_rng(seed)
    kv0 = rng.integers(1, 4097, size=b)
    steady = [kv0 + t for t in range(steps)]
    churn, kv = [], kv0.copy()
    for _ in range(steps):
        kv = kv + 1
        done = rng.random(b) < 1 / 256
        if done.any():
            kv = np.concatenate([kv[~done], rng.integers(1, 4097, size=int(done.sum()))])
        churn.append(kv)
    random = [rng.integers(1, 4097, size=b) for _ in range(steps)]
    return {"steady": steady, "churn": churn, "random": random}


def paged_args(kv):
    """(indptr, last_page_len) host int32 tensors of lengths ``kv`` at page size PS."""
    pages = (kv + PS - 1) // PS
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
    last = torch.from_numpy((kv - (pages - 1) * PS).astype(np.int32))
    return indptr, last


def on_gpu(t):
    return t.cuda()


def graph_buffers(b: int, cap: int, on=on_gpu):
    return dict(
        paged_kv_indptr_buffer=on(torch.zeros(b + 1, dtype=torch.int32)),
        paged_kv_indices_buffer=on(torch.arange(cap, dtype=torch.int32)),
        paged_kv_last_page_len_buffer=on(torch.zeros(b, dtype=torch.int32)),
    )


def time_steps(call, steps, sync=None):
    """Per-step host times (s) of ``call(indptr, last)`` over the steps, after a warm-up pass
    over the first 8."""
    args = [paged_args(kv) for kv in steps]
    for a in args[:8]:
        call(*a)
    if sync:
        sync()
    ts = []
    for a in args:
        t0 = time.perf_counter()
        call(*a)
        ts.append(time.perf_counter() - t0)
    if sync:
        sync()
    return ts


def summary(ts):
    return dict(
        median_us=round(statistics.median(ts) * 1e6, 1),
        mean_us=round(statistics.mean(ts) * 1e6, 1),
        p90_us=round(sorted(ts)[int(0.9 * len(ts))] * 1e6, 1),
    )


def ours(b, steps, on=on_gpu, calls=("fast_decode_plan", "plan")):
    """{call: (times, full-plan share)} of our CUDA-graph wrapper (``on``: puts a host tensor
    where the wrapper's buffers live; ``bench_plan_host.py`` passes a CPU stand-in)."""
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.decode import fast_decode_plan

    cap = int(max(((kv + PS - 1) // PS).sum() for kv in steps))
    out = {}
    for name in calls:
        bufs = graph_buffers(b, cap, on)
        w = BatchDecodeWithPagedKVCacheWrapper(
            on(torch.empty(256 << 20, dtype=torch.uint8)), use_cuda_graph=True, **bufs
        )
        idx = bufs["paged_kv_indices_buffer"]
        ip0, last0 = paged_args(steps[0])
        w.plan(ip0, idx, last0, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        full = [0]
        inner = w._planner.plan

        def counted(*a, **k):
            full[0] += 1
            return inner(*a, **k)

        w._planner.plan = counted
        if name == "plan":
            call = lambda ip, last: w.plan(ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        else:
            call = lambda ip, last: fast_decode_plan(
                w, ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=ip
            )
        sync = torch.cuda.synchronize if on is on_gpu else None
        ts = time_steps(call, steps, sync)
        out[name] = (ts, full[0] / (len(steps) + 8))
    return out


def flashinfer_fast(b, steps):
    """FlashInfer's fast_decode_plan times on its CUDA-graph tensor-core decode wrapper."""
    import flashinfer
    from flashinfer.decode import fast_decode_plan

    cap = int(max(((kv + PS - 1) // PS).sum() for kv in steps))
    bufs = graph_buffers(b, cap)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, **bufs)
    idx = bufs["paged_kv_indices_buffer"]
    ip0, last0 = paged_args(steps[0])
    w.plan(ip0, idx, last0, HQ, HK, D, PS, q_data_type=torch.bfloat16)
    call = lambda ip, last: fast_decode_plan(
        w, ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=ip
    )
    return time_steps(call, steps, torch.cuda.synchronize)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="append records to this results.json (cute_attn.bench.common.Results)")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--no-flashinfer", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    records = []

    def emit(impl, call, trace, b, ts, full=None):
        row = dict(impl=impl, call=call, trace=trace, batch=b, **summary(ts))
        if full is not None:
            row["full_plans"] = round(full, 3)
        print(json.dumps(row), flush=True)
        case = f"host/{call}/{trace}/bs{b}"
        records.append((case, impl, "us_median", row["median_us"]))
        records.append((case, impl, "us_mean", row["mean_us"]))

    fi_ok = not a.no_flashinfer
    for b in [int(x) for x in a.batches.split(",")]:
        for trace, steps in traces(b).items():
            for call, (ts, full) in ours(b, steps).items():
                emit("cute_attn", call, trace, b, ts, full)
            if fi_ok:
                try:
                    emit("flashinfer", "fast_decode_plan", trace, b, flashinfer_fast(b, steps))
                except Exception as e:  # noqa: BLE001 -- a peer that does not run is reported, not fatal
                    print(f"flashinfer: n/a ({type(e).__name__}: {str(e)[:160]})", flush=True)
                    fi_ok = False
    if a.json:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from cute_attn.bench.common import Results

        res = Results()
        for case, impl, metric, value in records:
            res.add(case, impl, metric, value)
        res.merge_into(a.json)


if __name__ == "__main__":
    main()
