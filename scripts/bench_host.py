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


def time_steps(call, steps, sync=None, passes: int = 3, prep=None, after=None):
    """Per-step host times (s) of ``call(indptr, last)`` over the steps, after a warm-up pass
    over the first 8: the quietest of ``passes`` passes over the trace (lowest median; the
    lent machines' host cores are shared).  ``prep(indptr, last)`` / ``after()``: the engine's
    work before / after the re-plan (untimed: writing the device buffers, the step's launch)."""
    args = [paged_args(kv) for kv in steps]
    for a in args[:8]:
        if prep:
            prep(*a)
        call(*a)
        if after:
            after()
    if sync:
        sync()
    best = None
    for _ in range(passes):
        ts = []
        for a in args:
            if prep:
                prep(*a)
            t0 = time.perf_counter()
            call(*a)
            ts.append(time.perf_counter() - t0)
            if after:
                after()
        if sync:
            sync()
        if best is None or statistics.median(ts) < statistics.median(best):
            best = ts
    return best


def summary(ts):
    return dict(
        median_us=round(statistics.median(ts) * 1e6, 1),
        mean_us=round(statistics.mean(ts) * 1e6, 1),
        p90_us=round(sorted(ts)[int(0.9 * len(ts))] * 1e6, 1),
    )


def count_full_plans(w) -> list:
    """[n]: n counts the full plans of ``w``'s planner from here on (the kept ones are not)."""
    full, inner = [0], w._planner.plan

    def counted(*a, **k):
        full[0] += 1
        return inner(*a, **k)

    w._planner.plan = counted
    return full


def ours(b, steps, on=on_gpu, calls=("fast_decode_plan", "cached_module_plan", "plan")):
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
        full = count_full_plans(w)
        if name == "plan":
            call = lambda ip, last: w.plan(ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        elif name == "cached_module_plan":  # vLLM's per-step call (host indptr and seq_lens)
            qo = torch.arange(b + 1, dtype=torch.int32)

            def call(ip, last):
                lens = (ip[1:] - ip[:-1] - 1) * PS + last
                w._cached_module.plan(w._float_workspace_buffer, w._int_workspace_buffer,
                                      w._pin_memory_int_workspace_buffer, qo, ip, lens, b, b, HQ, HK, PS,
                                      True, D, D, False, -1, -1, False, 0)  # fmt: skip
        else:
            call = lambda ip, last: fast_decode_plan(
                w, ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=ip
            )
        sync = torch.cuda.synchronize if on is on_gpu else None
        prep = after = None
        if on is on_gpu:  # the engine's step: the device buffers, then (after the re-plan) the
            # graph replay, of which the kept-plan update (wrappers/kept_device.py) is what the
            # plan reads back: the status that sends a step to a full re-plan

            def prep(ip, last):
                bufs["paged_kv_indptr_buffer"].copy_(ip, non_blocking=True)
                bufs["paged_kv_last_page_len_buffer"].copy_(last, non_blocking=True)

            def after():
                dk = w._dev_keep
                if dk is not None and w._state is not None:
                    dk.before_run(w._indptr_buf, w._last_buf, w._views)

        ts = time_steps(call, steps, sync, prep=prep, after=after)
        out[name] = (ts, full[0] / (3 * len(steps) + 8))
    return out


def update_cost(b: int, trace: str = "churn", reps: int = 32, replays: int = 20) -> float:
    """GPU time (us) of one kept-plan update (``kernels/kept_update.py``) on this batch: ``reps``
    updates captured in one CUDA graph (what a replay runs once per step), the replays timed
    with CUDA events; per update."""
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.decode import fast_decode_plan

    steps = traces(b)[trace][:2]
    cap = int(max(((kv + PS - 1) // PS).sum() for kv in steps))
    bufs = graph_buffers(b, cap)
    w = BatchDecodeWithPagedKVCacheWrapper(
        on_gpu(torch.empty(256 << 20, dtype=torch.uint8)), use_cuda_graph=True, **bufs
    )
    idx = bufs["paged_kv_indices_buffer"]
    for i, kv in enumerate(steps):
        ip, last = paged_args(kv)
        bufs["paged_kv_indptr_buffer"].copy_(ip)
        bufs["paged_kv_last_page_len_buffer"].copy_(last)
        if i == 0:
            w.plan(ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        else:
            fast_decode_plan(w, ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=ip)
    dk = w._dev_keep
    assert dk is not None and dk.on
    launch = lambda: dk.launch(w._indptr_buf, w._last_buf, w._views)  # noqa: E731
    launch()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for _ in range(reps):
                launch()
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (reps * replays)


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


def kept_vs_full(b: int, trace: str, keep_tol=None, every: int = 10, steps: int = 200):
    """GPU time of the kept plans against full plans of the same lengths: wrapper A re-plans
    every step of the trace with ``fast_decode_plan`` (kept items where balanced), wrapper B
    plans every sampled step from scratch with ``plan()``; both replay a captured graph on the
    same cache and queries, timed in turns (CUDA events, medians). Returns [(step, kept?, us A,
    us B)]."""
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.bench.common import interleaved
    from cute_attn.decode import fast_decode_plan

    lens = traces(b, steps)[trace]
    cap = int(max(((kv + PS - 1) // PS).sum() for kv in lens))
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(cap, PS, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(cap, PS, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    wrappers, graphs, outs, bufs_all = [], [], [], []
    ip0, last0 = paged_args(lens[0])
    for _ in range(2):
        bufs = graph_buffers(b, cap)
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                               use_cuda_graph=True, **bufs)  # fmt: skip
        bufs["paged_kv_indptr_buffer"].copy_(ip0)
        bufs["paged_kv_last_page_len_buffer"].copy_(last0)
        w.plan(ip0, bufs["paged_kv_indices_buffer"], last0, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        out = torch.empty_like(q)
        w.run(q, (k, v), out=out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, (k, v), out=out)
        wrappers.append(w), graphs.append(g), outs.append(out), bufs_all.append(bufs)
    (wa, wb), rows = wrappers, []
    if keep_tol is not None:
        wa._planner.keep_tol = keep_tol
    full = count_full_plans(wa)
    for t, kv in enumerate(lens[1:], 1):
        ip, last = paged_args(kv)
        for bufs in bufs_all:
            bufs["paged_kv_indptr_buffer"].copy_(ip, non_blocking=True)
            bufs["paged_kv_last_page_len_buffer"].copy_(last, non_blocking=True)
        idx = bufs_all[0]["paged_kv_indices_buffer"]
        before = full[0]
        fast_decode_plan(wa, ip, idx, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=ip)
        kept = full[0] == before
        if t % every:
            continue
        wb.plan(ip, bufs_all[1]["paged_kv_indices_buffer"], last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        tm = interleaved({"a": graphs[0].replay, "b": graphs[1].replay}, calls=15)
        diff = ((outs[0].float() - outs[1].float()).norm() / outs[1].float().norm()).item()
        assert diff < 1e-2, f"kept and full plans disagree at step {t}: {diff:.3e}"
        rows.append((t, kept, tm["a"], tm["b"]))
    return rows


def profile_step(b: int = 64) -> None:
    """Where a per-step ``fast_decode_plan`` spends its time on this host (and what a numpy
    call costs here, for scale)."""
    import cProfile
    import pstats
    import timeit

    x = np.arange(744, dtype=np.int64)
    for name, f in (("np.minimum", lambda: np.minimum(x, 5)), ("take", lambda: x.take(x[:64])), ("sum", x.sum)):
        print(name, round(min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6, 2), "us", flush=True)
    steps = traces(b)["steady"]
    prof = cProfile.Profile()
    import cute_attn.decode as dec

    inner = dec.fast_decode_plan

    def profiled(*a, **k):
        prof.enable()
        inner(*a, **k)
        prof.disable()

    dec.fast_decode_plan = profiled
    try:
        ours(b, steps, calls=("fast_decode_plan",))
    finally:
        dec.fast_decode_plan = inner
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="append records to this results.json (cute_attn.bench.common.Results)")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--kept-ab", action="store_true", help="also: GPU time of kept vs full plans (churn trace)")
    ap.add_argument("--profile", action="store_true", help="only: cProfile of fast_decode_plan, steady, batch 64")
    ap.add_argument("--update-only", action="store_true", help="only: the GPU time of the kept-plan update")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.profile:
        return profile_step()
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
        if b <= 2048:
            us = update_cost(b)
            print(json.dumps(dict(impl="cute_attn", kept_update_gpu_us=round(us, 2), batch=b)), flush=True)
            records.append((f"host/kept_update_gpu/bs{b}", "cute_attn", "us_per_launch", us))
        if a.update_only:
            continue
        for trace, steps in traces(b).items():
            for call, (ts, full) in ours(b, steps).items():
                emit("cute_attn", call, trace, b, ts, full)
            if fi_ok:
                try:
                    emit("flashinfer", "fast_decode_plan", trace, b, flashinfer_fast(b, steps))
                except Exception as e:  # noqa: BLE001 -- a peer that does not run is reported, not fatal
                    print(f"flashinfer: n/a ({type(e).__name__}: {str(e)[:160]})", flush=True)
                    fi_ok = False
    if a.kept_ab:
        for b, trace, tol in ((64, "churn", None), (64, "churn", 0.05), (64, "random", 0.05), (256, "churn", None),
                              (256, "random", None)):  # fmt: skip
            rows = kept_vs_full(b, trace, tol)
            ratio = [ra / rb for _, kept, ra, rb in rows if kept]
            head = dict(kept_ab=trace, batch=b, keep_tol=tol)
            for t, kept, ra, rb in rows:
                print(json.dumps(dict(head, step=t, kept=bool(kept), us_kept=round(ra, 1), us_full=round(rb, 1))))
            if ratio:
                mean, top = round(statistics.mean(ratio), 4), round(max(ratio), 4)
                print(json.dumps(dict(head, kept_steps=len(ratio), mean_ratio=mean, max_ratio=top)), flush=True)
                tag = "" if tol is None else f"/keep_tol{tol}"
                records.append((f"host/kept_vs_full/{trace}/bs{b}{tag}", "cute_attn", "gpu_time_ratio_mean",
                                    statistics.mean(ratio)))  # fmt: skip
    if a.json:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from cute_attn.bench.common import Results

        res = Results()
        for case, impl, metric, value in records:
            res.add(case, impl, metric, value)
        res.merge_into(a.json)


if __name__ == "__main__":
    main()
