"""The L2 side of a prefill plan, on the CPU: for the bench's ragged batches (16 / 16 heads, hd128,
128-row tiles, 132 CTAs), a plan's balance and the K/V it reads from DRAM, modelled.

Model: every CTA runs its items back to back, an item taking its 128-key blocks (walked from the
last) plus PER_ITEM blocks (about what an item costs beyond its blocks, BENCHMARKS.md session
38); all CTAs' block reads, merged in time order, go through an LRU cache of whole blocks (K and
V of one head, 64 KiB).  With L2_MB = 30 (of the H100's 50 MB: part of it holds Q, O and the
other copy of lines the two partitions share) the model gives the DRAM reads Nsight Compute
measured on an H100 (session 38; Q's 0.07-0.26 GB added): cost-ordered plans 5.59 / 2.37 / 0.26
GB against 5.41 / 2.40 / 0.31 measured (bimodal48 / varlen32 / 2 x 8k causal), FlashInfer fa3's
order 0.80 / 0.73 / 0.20 against 0.80 / 0.72 / 0.20.  ``fa3 order``: FlashInfer 0.7.2's
PrefillSM90Plan as its source describes it (heads outer, requests longest first, a request's
tiles last first, each to the least-loaded CTA).  ``in flight``: the median K/V bytes of the
(request, head) pairs being read at one time.

    python scripts/plan_locality.py [Planner keyword=value ...]   # e.g. locality_tol=-1
    (PYTHONPATH=. for a checkout other than the installed one)
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict

import numpy as np

from cute_attn.bench.prefill import bimodal_lengths, varlen32_lengths
from cute_attn.sched import Limits, Planner
from cute_attn.sched import workspace as ws

H, D, TILE, CTAS, PER_ITEM, L2_MB = 16, 128, 128, 132, 2.5, 30
BLOCK_BYTES = TILE * D * 2 * 2  # K and V of one 128-key block of one head, bf16


def ours(qo_lens, kv_lens, causal, **kw):
    """Our plan: per CTA, its items as (request, kv head, kv start, kv end)."""
    lim = Limits(max_batch=len(qo_lens), max_total_q_tokens=sum(qo_lens), num_qo_heads=H, num_kv_heads=H, head_dim=D)
    qo = np.concatenate(([0], np.cumsum(qo_lens))).astype(np.int32)
    p = Planner(lim, CTAS, pin_memory=False, **kw).plan(
        qo, np.array(kv_lens, np.int32), causal=causal, num_qo_heads=H, num_kv_heads=H, cta_tile_q=TILE
    )
    w, ind = np.asarray(p.work_items)[: p.num_work_items], np.asarray(p.work_indptr)
    cols = [ws.W_REQ, ws.W_KV_HEAD, ws.W_KV_START, ws.W_KV_END]
    return [[tuple(int(x) for x in r) for r in w[ind[c] : ind[c + 1]][:, cols]] for c in range(CTAS)]


def fa3_order(qo_lens, kv_lens, causal):
    """FlashInfer's sm90 prefill plan, modelled (module doc)."""
    heap, per = [(0.0, c) for c in range(CTAS)], [[] for _ in range(CTAS)]
    for h in range(H):
        for i in sorted(range(len(qo_lens)), key=lambda i: -kv_lens[i]):
            q, n = qo_lens[i], kv_lens[i]
            for t in range(-(-q // TILE) - 1, -1, -1):
                end = min(n, n - q + (t + 1) * TILE) if causal else n
                load, c = heapq.heappop(heap)
                heapq.heappush(heap, (load + -(-end // TILE) + PER_ITEM, c))
                per[c].append((i, h, 0, end))
    return per


def block_reads(per):
    """(time, request, head, block) of every block read, in time order, and each CTA's load."""
    ev, loads = [], []
    for items in per:
        t = 0.0
        for req, head, s, e in items:
            b0, b1 = s // TILE, -(-e // TILE)
            ev += [(t + PER_ITEM / 2 + k, req, head, b) for k, b in enumerate(range(b1 - 1, b0 - 1, -1))]
            t += b1 - b0 + PER_ITEM
        loads.append(t)
    ev.sort()
    return ev, np.array(loads)


def dram_gb(ev, l2_mb=L2_MB) -> float:
    """K/V bytes the block reads miss in an LRU cache of ``l2_mb``."""
    lru, cap, miss = OrderedDict(), int(l2_mb * 1e6 // BLOCK_BYTES), 0
    for _, req, head, b in ev:
        key = (req, head, b)
        if key in lru:
            lru.move_to_end(key)
            continue
        miss += 1
        lru[key] = None
        if len(lru) > cap:
            lru.popitem(last=False)
    return miss * BLOCK_BYTES / 1e9


def in_flight_mb(ev) -> float:
    """Median over time of the K/V bytes of the (request, head) pairs read within one block."""
    t = np.array([e[0] for e in ev])
    pairs = [(e[1], e[2]) for e in ev]
    mb = []
    for at in np.linspace(0.0, t.max(), 100, endpoint=False):
        lo, hi = np.searchsorted(t, at), np.searchsorted(t, at + 1.0)
        extent = {}
        for j in range(lo, hi):
            extent[pairs[j]] = max(extent.get(pairs[j], 0), ev[j][3] + 1)
        mb.append(sum(extent.values()) * BLOCK_BYTES / 1e6)
    return float(np.median(mb))


def main(argv) -> None:
    kw = {k: float(v) if "." in v or "tol" in k else int(v) for k, v in (a.split("=") for a in argv)}
    print(f"K/V read from DRAM in GB (LRU L2 of {L2_MB} MB; 25-35 MB in brackets), balance, K/V in flight (MB)")
    chunk = ([8192], [65536])  # chunked prefill: an 8k chunk of a prompt on its 56k prefix
    for name, (qo, kv), causal in (
        ("bimodal48", (bimodal_lengths(),) * 2, True),
        ("varlen32_lognormal2k", (varlen32_lengths(),) * 2, True),
        ("s8192 x 2 causal", ([8192] * 2,) * 2, True),
        ("s8192 x 2 non-causal", ([8192] * 2,) * 2, False),
        ("s1024 x 64 causal", ([1024] * 64,) * 2, True),
        ("s32768 x 1 causal", ([32768],) * 2, True),
        ("8k chunk on 64k", chunk, True),
    ):
        once = sum(-(-n // TILE) for n in kv) * H * BLOCK_BYTES / 1e9
        cols = []
        for who, per in (("ours", ours(qo, kv, causal, **kw)), ("fa3 order", fa3_order(qo, kv, causal))):
            ev, loads = block_reads(per)
            g = [dram_gb(ev, mb) for mb in (25, L2_MB, 35)]
            cols.append(
                f"{who} {g[1]:5.2f} [{g[0]:.2f}-{g[2]:.2f}] {loads.max() / loads.mean():.3f} {in_flight_mb(ev):3.0f}"
            )
        print(f"{name:21s} once {once:.2f} | " + " | ".join(cols))


if __name__ == "__main__":
    main(sys.argv[1:])
