"""Host time of decode re-planning on a GPU machine: ``plan()`` and ``fast_decode_plan`` of a
CUDA-graph decode wrapper (the engines' per-step call), at batch 64 / 256 / 1024, 32/8 heads,
hd128, page 16, lengths 1-4096.  Run it pinned to one core (``taskset -c 0``): the figure is
what one engine thread pays per step.  Prints one JSON line per (call, batch).

    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=build/aot taskset -c 0 python scripts/bench_host.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.decode import fast_decode_plan

HQ, HK, D, PS = 32, 8, 128, 16


def main() -> None:
    rng = np.random.default_rng(0)
    for b in (64, 256, 1024):
        lens = [rng.integers(1, 4097, size=b) for _ in range(8)]  # 8 steps' lengths, cycled
        pages = [(n + PS - 1) // PS for n in lens]
        cap = int(max(p.sum() for p in pages))
        bufs = dict(
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device="cuda"),
            paged_kv_indices_buffer=torch.arange(cap, dtype=torch.int32, device="cuda"),
            paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device="cuda"),
        )
        w = BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True, **bufs
        )
        steps = []
        for n, p in zip(lens, pages):
            indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(p)]).astype(np.int32))
            last = torch.from_numpy((n - (p - 1) * PS).astype(np.int32))
            steps.append((indptr, last))
        indices = bufs["paged_kv_indices_buffer"]
        indptr, last = steps[0]
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
        for name, call in (
            ("plan", lambda s: w.plan(s[0], indices, s[1], HQ, HK, D, PS, q_data_type=torch.bfloat16)),
            (
                "fast_decode_plan",
                lambda s: fast_decode_plan(
                    w, s[0], indices, s[1], HQ, HK, D, PS, q_data_type=torch.bfloat16, global_override_indptr_cpu=s[0]
                ),
            ),
        ):
            for s in steps:  # warm-up
                call(s)
            torch.cuda.synchronize()
            ts = []
            for i in range(400):
                t0 = time.perf_counter()
                call(steps[i % len(steps)])
                ts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            print(json.dumps({"call": name, "batch": b, "median_us": round(statistics.median(ts) * 1e6, 1),
                              "p90_us": round(sorted(ts)[int(0.9 * len(ts))] * 1e6, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
