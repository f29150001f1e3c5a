#!/usr/bin/env python3
"""Host time of decode re-planning without a GPU: the CPU side of ``bench_host.py``.

The same cases (a CUDA-graph decode wrapper, 32 / 8 heads, hd128, page 16, lengths uniform in
[1, 4096], 8 steps' lengths cycled, batch 64 / 256 / 1024) on an H200-shaped grid (132 SMs x 2
CTAs, the decode backend's cost model), with what needs a GPU stubbed: the device queries, the
kernel loader, and the device buffers (CPU tensors that pass the wrappers' ``is_cuda`` checks;
after the first plan the plan's int buffer is a plain CPU tensor, so the upload is one host
memcpy of the same bytes instead of an async H2D copy).  What is timed is the Python / numpy
work of one engine step:

* ``planner``          -- ``Planner.plan()`` with the wrapper's arguments (validation to staging);
* ``plan``             -- the wrapper's ``plan()``;
* ``fast_decode_plan`` -- ``fast_decode_plan(wrapper, ...)`` with a host indptr (SGLang's call).

Prints one JSON line per (call, batch): {call, batch, median_us, p90_us}: the median (and 90th
percentile) of the quietest of ``--rounds`` rounds of ``--calls`` calls, the cases timed in
turns.  Pin it to one core:

    PYTHONPATH=. taskset -c 0 python scripts/bench_plan_host.py [--calls 200] [--rounds 5]
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HQ, HK, D, PS = 32, 8, 128, 16
NUM_SMS = 132  # H100 / H200


class _FakeCuda(torch.Tensor):
    """A CPU tensor that passes the wrappers' ``is_cuda`` checks (workspace, graph buffers),
    without a subclass's Python dispatch on every call (a real CUDA tensor has none)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True


class _Event:
    def record(self, *a):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _Module:
    """The kernel loader's stand-in: plan() only loads modules, nothing is launched."""

    def __call__(self, *a, **k):
        raise RuntimeError("bench_plan_host launches nothing")


def stub_gpu() -> None:
    import cute_attn.wrappers.decode as dec
    import cute_attn.wrappers.decode_engine as eng

    for m in (dec, eng):
        m.arch_of_index = lambda i: "sm_90a"
        m.sm_count_of_index = lambda i: NUM_SMS
    dec.kernel = lambda family, arch, **params: _Module()
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.Event = _Event


def fake_cuda(t):
    return torch.Tensor._make_subclass(_FakeCuda, t)


def timed(call, steps, calls):
    """(median, 90th percentile) of ``calls`` calls in us, cycling through the steps."""
    ts = []
    for i in range(calls):
        s = steps[i % len(steps)]
        t0 = time.perf_counter()
        call(s)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6, sorted(ts)[int(0.9 * len(ts))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200, help="calls per case and round")
    ap.add_argument("--rounds", type=int, default=5, help="the lowest round median is reported")
    ap.add_argument("--batches", default="64,256,1024")
    a = ap.parse_args()
    # one core: torch's intra-op threads would make the host copy wait on a thread pool (a
    # pinned H2D copy on a GPU host is a cudaMemcpyAsync, no pool)
    torch.set_num_threads(1)
    stub_gpu()
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.decode import fast_decode_plan

    rng = np.random.default_rng(0)
    for b in [int(x) for x in a.batches.split(",")]:
        lens = [rng.integers(1, 4097, size=b) for _ in range(8)]
        pages = [(n + PS - 1) // PS for n in lens]
        cap = int(max(p.sum() for p in pages))
        bufs = dict(
            paged_kv_indptr_buffer=fake_cuda(torch.zeros(b + 1, dtype=torch.int32)),
            paged_kv_indices_buffer=fake_cuda(torch.arange(cap, dtype=torch.int32)),
            paged_kv_last_page_len_buffer=fake_cuda(torch.zeros(b, dtype=torch.int32)),
        )
        w = BatchDecodeWithPagedKVCacheWrapper(
            fake_cuda(torch.empty(256 << 20, dtype=torch.uint8)), use_cuda_graph=True, **bufs
        )
        steps = []
        for n, p in zip(lens, pages):
            indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(p)]).astype(np.int32))
            last = torch.from_numpy((n - (p - 1) * PS).astype(np.int32))
            steps.append((indptr, last, n))
        indices = bufs["paged_kv_indices_buffer"]
        w.plan(steps[0][0], indices, steps[0][1], HQ, HK, D, PS, q_data_type=torch.bfloat16)
        w._plan_buf = torch.zeros(w._plan_buf.numel(), dtype=torch.uint8)  # a host memcpy (module doc)
        st = w._state
        planner = w._planner
        qo = np.arange(b + 1)

        def plan_only(s):
            planner.plan(qo, s[2], page_size=PS, num_qo_heads=HQ, num_kv_heads=HK, cta_tile_q=16, heads_per_item=st.hpi)

        cases = (
            ("planner", plan_only),
            ("plan", lambda s: w.plan(s[0], indices, s[1], HQ, HK, D, PS, q_data_type=torch.bfloat16)),
            (
                "fast_decode_plan",
                lambda s: fast_decode_plan(
                    w, s[0], indices, s[1], HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=s[0]
                ),
            ),
        )
        for _, call in cases:  # warm-up
            for s in steps:
                call(s)
        best = {}
        for _ in range(a.rounds):  # cases in turns; the quietest round counts (shared machines)
            for name, call in cases:
                r = timed(call, steps, a.calls)
                if name not in best or r[0] < best[name][0]:
                    best[name] = r
        for name, _ in cases:
            med, p90 = best[name]
            print(json.dumps({"call": name, "batch": b, "median_us": round(med, 1), "p90_us": round(p90, 1)}))


if __name__ == "__main__":
    main()
