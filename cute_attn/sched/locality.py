"""Where a prefill plan's work runs in time: orders that let the tiles of one (request, kv head)
read its K/V from L2.

Several tiles of a request read the same K/V (a causal tile its prefix).  The 132 CTAs of a
persistent launch each run their items back to back, so the items at the k-th place of every
CTA run at about the same time; if they come from many (request, head) pairs, their K/V together
outgrow the 50 MB L2 of an H100 / H200 and every tile re-reads its K/V from DRAM (Nsight Compute
on a bimodal batch dealt by cost: 5.4 GB read where FlashInfer's fa3 reads 0.8 GB).
Two remedies, one per kind of plan:

* ``locality_order``: after a cost-ordered assignment (``assign``), each CTA's items re-ordered by
  (request, kv head, last tile first).  Enough where every CTA holds a similar mix of the pairs
  (uniform batches: the CTAs then walk the heads in step);
* ``request_rounds``: whole items dealt in one global order -- requests longest first, head by
  head, a head's tiles last first -- in rounds of one item per CTA, each round's items largest
  first to the CTAs in ascending load (``round_deal``).  Every CTA takes one item of each round,
  so at any time the CTAs are on one window of the order: a few heads of one request.  The last
  ``TAIL_ROUNDS`` rounds go by cost instead where their costs differ severalfold (the tail sets
  the makespan).  Used where its busiest CTA is within ``Planner.locality_tol`` of the mean,
  or a quarter of it of the cost-ordered plan's (``scripts/plan_locality.py`` models the DRAM
  reads: the compulsory ones on the bench's mixed batches, where the cost order reads 4-10x as
  much, and on a single 32k prompt, where it reads 40x).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import workspace as ws

TAIL_ROUNDS = 4  # request_rounds: rounds at the end dealt by cost rather than in order


def locality_order(w: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """Each CTA's items re-ordered by (request, kv head, last tile first); the order within a
    CTA does not change its load.  Assignment spreads a head's tiles over many CTAs, and in
    dealing order every CTA works on a different head at a time: all heads' K/V in flight at
    once (32 heads x 4 MiB for 2 x 8k tokens x 16 heads at head dim 128) thrash the 50 MB L2,
    and every tile re-reads its KV from DRAM.  Sorted, the CTAs walk the heads roughly in step
    (4-12 heads in flight in that example), so the tiles of a head share its K/V in L2."""
    if w.shape[0] < 2:
        return w
    cta = np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int64), np.diff(indptr))
    rs = w[:, ws.W_ROW_START].astype(np.int64)
    pair = w[:, ws.W_REQ].astype(np.int64) * (int(w[:, ws.W_KV_HEAD].max()) + 1) + w[:, ws.W_KV_HEAD]
    key = pair * (int(rs.max()) + 1) + (int(rs.max()) - rs)  # last tile first within a pair
    span = int(key.max()) + 1
    if span * (int(cta[-1]) + 1) < 2**62:  # one int64 key: a single argsort, ~4x faster than lexsort
        return w.take(np.argsort(cta * span + key, kind="stable"), axis=0)
    return w.take(np.lexsort((key, cta)), axis=0)


def request_rounds(req, tile_cost, kv_len, hk: int, num_ctas: int, limit: float) -> Optional[tuple]:
    """(items, indptr, loads) of the request-major dealing (module doc): item ids ``t * hk + h``
    (tile t, kv head h), CTA-major with each CTA's items in the global order; None where there
    are fewer items than CTAs or a CTA's load passes ``limit``."""
    nt = tile_cost.shape[0]
    n = nt * hk
    # a CTA of the last round runs ceil(n / C) items: where even the cheapest would pass the
    # limit (equal items, as a non-causal uniform batch: 2 x 8k is 15.5 rounds) stop here
    if n < num_ctas or -(-n // num_ctas) * int(tile_cost.min()) > limit:
        return None
    g = request_major_order(req, kv_len, hk)
    cost = tile_cost[g // hk]
    # the last TAIL_ROUNDS rounds' worth, largest first, where their costs differ severalfold:
    # the tail sets the makespan (2 x 8k causal, 15.5 rounds: 4.2 % above the mean dealt in
    # order, 0.5 % so) and holds the shortest requests' or a head's cheapest tiles, whose K/V is
    # small.  Near-equal items (a chunk on a long prefix) keep their order: sorted, they would
    # interleave all heads of the tail, whose K/V then misses L2 (modelled 1.71 GB from DRAM
    # instead of 0.76 for an 8k chunk on a 56k prefix) for 0.3 % of balance
    tail = max(n - TAIL_ROUNDS * num_ctas, 0)
    if int(cost[tail:].max()) > 2 * int(cost[tail:].min()):
        last = tail + np.argsort(-cost[tail:], kind="stable")
        g[tail:], cost[tail:] = g[last], cost[last]
    dealt = round_deal(cost, num_ctas, limit)
    if dealt is None:
        return None
    cta, loads = dealt
    indptr = np.zeros(num_ctas + 1, np.int64)
    np.cumsum(np.bincount(cta, minlength=num_ctas), out=indptr[1:])
    # a 16-bit key sorts by radix (~10x faster than an int64 one at 8k items)
    key = cta.astype(np.int16) if num_ctas <= np.iinfo(np.int16).max else cta
    return g[np.argsort(key, kind="stable")], indptr, loads


def request_major_order(req, kv_len, hk: int) -> np.ndarray:
    """Item ids ``t * hk + h`` in the global order: requests by kv length, longest first
    (ties in request order), each request head by head, a head's tiles last first.  Built
    in O(n) from the tiles' layout (``build_tiles``: a request's tiles adjacent, first row
    ascending) rather than by sorting a composite key (0.5 ms at 8k items)."""
    b = kv_len.shape[0]
    ntiles = np.bincount(req, minlength=b).astype(np.int64)
    first = np.cumsum(ntiles) - ntiles  # a request's first tile
    ro = np.argsort(-kv_len.astype(np.int64), kind="stable")
    size = ntiles[ro] * hk  # items of each request, in dealing order
    seg = np.repeat(np.arange(b, dtype=np.int64), size)
    pos = np.arange(seg.shape[0], dtype=np.int64) - (np.cumsum(size) - size)[seg]
    n_r = ntiles[ro][seg]
    h = pos // n_r
    t = first[ro][seg] + n_r - 1 - (pos - h * n_r)
    return t * hk + h


def round_deal(cost: np.ndarray, num_ctas: int, limit: Optional[float] = None):
    """Items in the given order, dealt in rounds of ``num_ctas``: each round's items, largest
    first, to the CTAs in ascending load (the last round to the least loaded).  Returns (CTA of
    each item, loads), or None once a CTA's load exceeds ``limit`` (checked every few rounds;
    loads only grow: the plan() that would reject the result stops paying for it there).
    Within a round a lighter CTA gets a larger item, so loads stay within one round's largest
    item of each other when rounds hold items of similar cost -- the case ``request_rounds``
    deals (a request's adjacent tiles)."""
    n, c = cost.shape[0], num_ctas
    rounds = -(-n // c)
    # every round's items largest first, in one row-wise sort (pads sort last)
    key = np.full(rounds * c, np.iinfo(np.int64).max, np.int64)
    key[:n] = -cost
    big = np.argsort(key.reshape(rounds, c), axis=1, kind="stable")
    big += np.arange(0, rounds * c, c, dtype=np.int64)[:, None]
    cta = np.empty(n, np.int64)
    loads = np.zeros(c, np.int64)
    for i in range(rounds):
        idx = big[i, : min(c, n - i * c)]
        to = np.argsort(loads, kind="stable")[: idx.shape[0]]
        cta[idx] = to
        loads[to] += cost[idx]
        if limit is not None and i % 4 == 3 and loads.max() > limit:
            return None
    if limit is not None and loads.max() > limit:
        return None
    return cta, loads
