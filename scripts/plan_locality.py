"""The L2 side of a prefill plan, on the CPU: for the bench's ragged batches (16 / 16 heads, hd128,
causal, 128-row tiles, 132 CTAs), the planner's balance and the K/V its CTAs have in flight.

Model: every CTA runs its items back to back, each taking its KV blocks plus PER_ITEM blocks
(about what an item costs beyond its blocks, BENCHMARKS.md session 38); at 200 instants, the
K/V bytes of the distinct (request, kv head) pairs being read (each pair up to the largest
extent in use).  Above the L2 (50 MB on the H100 / H200) the tiles of a pair stop finding its
K/V there: the mixed batches' DRAM reads in Nsight Compute (5.41 GB ours, 0.80 GB FlashInfer's
fa3 on bimodal48) follow this figure (76 MB in flight).

    python scripts/plan_locality.py [Planner keyword=value ...]   # e.g. order_block=1
    (PYTHONPATH=. for a checkout other than the installed one)
"""

from __future__ import annotations

import sys

import numpy as np

from cute_attn.bench.prefill import bimodal_lengths, varlen32_lengths
from cute_attn.sched import Limits, Planner
from cute_attn.sched import workspace as ws

H, D, TILE, CTAS, PER_ITEM = 16, 128, 128, 132, 2.5
KV_BYTES_PER_TOKEN = 2 * D * 2  # K and V rows, bf16


def plan(lens, **kw):
    lim = Limits(max_batch=len(lens), max_total_q_tokens=sum(lens), num_qo_heads=H, num_kv_heads=H, head_dim=D)
    qo = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    pl = Planner(lim, CTAS, pin_memory=False, **kw)
    return pl.plan(qo, np.array(lens, np.int32), causal=True, num_qo_heads=H, num_kv_heads=H, cta_tile_q=TILE)


def in_flight(p, samples=200):
    """Median and 90th percentile of the modelled K/V in flight (MB)."""
    w, ind = np.asarray(p.work_items)[: p.num_work_items], np.asarray(p.work_indptr)
    spans = []  # (start, end, request, head, kv end)
    for c in range(ind.shape[0] - 1):
        t = 0.0
        for r in w[ind[c] : ind[c + 1]]:
            d = -(-(int(r[ws.W_KV_END]) - int(r[ws.W_KV_START])) // TILE) + PER_ITEM
            spans.append((t, t + d, int(r[ws.W_REQ]), int(r[ws.W_KV_HEAD]), int(r[ws.W_KV_END])))
            t += d
    s = np.array(spans)
    mb = []
    for at in np.linspace(0.0, s[:, 1].max(), samples, endpoint=False):
        live = s[(s[:, 0] <= at) & (s[:, 1] > at)]
        pairs = {}
        for _, _, req, head, end in live:
            pairs[req, head] = max(pairs.get((req, head), 0), end)
        mb.append(sum(pairs.values()) * KV_BYTES_PER_TOKEN / 1e6)
    return float(np.median(mb)), float(np.percentile(mb, 90))


def main(argv) -> None:
    kw = {k: float(v) if "." in v or "tol" in k else int(v) for k, v in (a.split("=") for a in argv)}
    for name, lens in (
        ("bimodal48", bimodal_lengths()),
        ("varlen32_lognormal2k", varlen32_lengths()),
        ("s8192 x 2", [8192] * 2),
        ("s32768 x 1", [32768]),
    ):
        p = plan(lens, **kw)
        loads = np.asarray(p.cta_cost)
        med, p90 = in_flight(p)
        print(f"{name:22s} items {p.num_work_items:5d}  balance {loads.max() / loads.mean():.3f}  "
              f"K/V in flight {med:5.0f} MB (p90 {p90:.0f})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
