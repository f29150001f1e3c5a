"""Assignment of work items to persistent CTAs: LPT, then split-to-fit.

**LPT.** Items arrive sorted by cost, largest first; each goes to the least-loaded CTA. A
heap does this one item at a time (~0.25 us per item in CPython: too slow for thousands of
items in a 50 us budget), so the same rule is applied in vectorized steps:

* round 1: the C largest items, one per CTA (all CTAs are empty: exactly what LPT does);
  so item c (c < C) is the largest item of CTA c -- ``split_to_fit`` relies on this;
* rounds 2..HEAD_ROUNDS: the next items dealt largest to least loaded (after round 1 that
  is the reversed CTA order, no sort needed), as many as one-at-a-time LPT would deal the
  same way: the j-th least-loaded CTA takes the j-th item only while its load <= the least
  load + that item -- else LPT would have stacked that item on the lighter CTA;
* the tail by water-filling: the level the tail would fill the least-loaded CTAs to is
  computed exactly, each CTA's deficit is laid on a line, the tail items (largest first) on
  the same line, and an item goes to the CTA whose stretch holds its midpoint -- what LPT
  converges to when items are small next to the load spread.

Dealing a round of items (descending) to CTAs in ascending-load order keeps max - min
load <= max item (a lighter CTA gets a larger item, so loads cross by less than an item);
water-filling ends every CTA at <= level + max item, level <= final mean. Hence
``max load <= mean + max item``, the LPT bound (tested).

**Split-to-fit.** LPT leaves a CTA up to one item above the mean, and whole items cannot do
better when they are few per CTA or all alike. So each CTA above ``cap = mean +
per_item`` gives away the kv tail of its largest item -- the excess, at least
``min_chunk`` tokens, keeping at least ``min_chunk`` -- and those tails are spread over the
least-loaded CTAs, each taking what fits below the cap (McNaughton's wrap-around rule, the
optimal way to schedule divisible work): a tail is cut where a receiver's room ends, cuts
page-aligned, no piece shorter than ``min_chunk`` or than the per-item overhead. It is kept
only if it lowers the makespan. Deterministic: stable sorts, sequential sums, a heap with
(load, CTA) keys.
"""
from __future__ import annotations

import heapq

import numpy as np

HEAD_ROUNDS = 6


_IDS = {}


def _ids(c: int) -> np.ndarray:
    a = _IDS.get(c)
    if a is None:
        a = _IDS[c] = np.arange(c)
        a.flags.writeable = False
    return a


def lpt_assign(costs: np.ndarray, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """costs: int64 [n], non-increasing. Returns (cta index per item int64 [n], loads [C])."""
    n, c = costs.shape[0], num_ctas
    ids = _ids(c)
    cta = np.empty(n, np.int64)
    loads = np.zeros(c, np.int64)
    m = min(n, c)
    cta[:m] = ids[:m]
    loads[:m] = costs[:m]
    k = m
    rounds = 1
    while k < n and rounds < HEAD_ROUNDS:
        if rounds == 1:  # loads are non-increasing in the CTA index: ascending = reversed
            order = ids[::-1]
        else:
            order = np.argsort(loads, kind="stable")
        # Deal the next items largest-to-least-loaded, but only as far as that is exactly
        # what one-at-a-time LPT would do: the j-th least-loaded CTA may take the j-th item
        # while its load <= the least load + that item (else LPT would stack an item on a
        # lighter CTA first). That prefix is found with one binary search.
        mm = min(n - k, c)
        ls = loads[order[:mm]]
        m = max(1, int(np.searchsorted(ls - costs[k:k + mm], ls[0], side="right")))
        order = order[:m]
        cta[k:k + m] = order
        loads[order] += costs[k:k + m]
        k += m
        rounds += 1
    if k < n:
        cta[k:] = _water_fill(loads, costs[k:])
    return cta, loads


def _water_fill(loads: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """CTA of each tail item; adds the tail to ``loads`` in place."""
    order = np.argsort(loads, kind="stable")
    ls = loads[order]
    total = int(tail.sum())
    prefix = np.cumsum(ls)
    # With k CTAs below the level: k * ls[k-1] - prefix[k-1] <= total decides; it grows with k.
    need = np.arange(1, ls.shape[0] + 1) * ls - prefix
    k = int(np.searchsorted(need, total, side="right"))
    level = (total + int(prefix[k - 1])) / k
    bounds = np.cumsum(level - ls[:k])  # end of each CTA's deficit stretch
    csum = np.cumsum(tail)
    mid2 = 2 * csum - tail  # twice each item's midpoint on the line
    # Midpoints and bounds are both sorted: count the items before each bound (k binary
    # searches instead of one per item); the last CTA also takes any rounding overflow.
    cnt = np.searchsorted(mid2, 2 * bounds, side="left")
    cnt[-1] = tail.shape[0]
    runs = np.diff(cnt, prepend=0)
    got = np.diff(np.concatenate(([0], csum))[cnt], prepend=0)
    loads[order[:k]] += got
    return np.repeat(order[:k], runs)


_EMPTY = np.zeros(0, np.int64)


def split_to_fit(loads, costs, first_start, first_end, *, per_item, beta, min_chunk, page):
    """Move the excess of overloaded CTAs onto underloaded ones (see module doc).

    ``costs``: the item costs, sorted as for ``lpt_assign``; ``first_start/first_end[c]``:
    kv range of the largest item of CTA c (item c, for c < len). Updates ``loads`` in place.
    Returns ``(donors, cut, src, start, end, dst)``: CTA c in ``donors`` keeps
    [first_start[c], cut) of its largest item; new piece j is [start[j], end[j]) of the
    largest item of CTA ``donors[src[j]]``, run by CTA ``dst[j]``.

    Donors are few (CTAs above the cap), so this walks them in Python with a heap of the
    receivers; every piece is page-aligned at its cut and at least ``min_piece`` long.
    """
    nothing = (_EMPTY,) * 6
    c = loads.shape[0]
    m = first_start.shape[0]
    cap = -(-int(loads.sum()) // c) + per_item
    # A moved piece pays per_item again: make it at least as long as that overhead.
    min_piece = max(min_chunk, -(-per_item // beta))
    min_piece = -(-min_piece // page) * page
    excess = loads[:m] - cap
    mv = np.minimum(np.maximum(-(-excess // beta), min_piece), first_end - first_start - min_chunk)
    cuts = -(-(first_end - mv) // page) * page  # a donor keeps [start, cut) at least
    donors = np.flatnonzero((excess > 0) & (first_end - cuts >= min_piece))
    if donors.shape[0] == 0:
        return nothing
    donors = donors[np.argsort(-excess[donors], kind="stable")].tolist()
    is_donor = np.zeros(c, bool)
    is_donor[donors] = True
    lds = loads.tolist()
    heap = [(lds[r], r) for r in np.flatnonzero(~is_donor).tolist()]
    heapq.heapify(heap)
    fe, cuts = first_end.tolist(), cuts.tolist()
    out_d, out_cut, src, st, en, dst = [], [], [], [], [], []
    for d in donors:
        e, cut = fe[d], cuts[d]
        pos = e  # pieces are taken from the end, so what the donor keeps stays contiguous
        while pos > cut and heap:
            load, r = heap[0]
            room = (cap - load - per_item) // beta
            if room < min_piece:
                break  # r is the least loaded: nobody has room
            lo = max(cut, -(-(pos - room) // page) * page)
            if lo - cut < min_piece:
                lo = cut  # never leave a sliver behind
            if pos - lo < min_piece:
                break
            src.append(len(out_d)), st.append(lo), en.append(pos), dst.append(r)
            heapq.heapreplace(heap, (load + per_item + beta * (pos - lo), r))
            pos = lo
        if pos < e:
            lds[d] -= beta * (e - pos)
            out_d.append(d), out_cut.append(pos)
    if not out_d:
        return nothing
    for load, r in heap:
        lds[r] = load
    new = np.array(lds, np.int64)
    donors, cut = np.array(out_d, np.int64), np.array(out_cut, np.int64)
    start, end = np.array(st, np.int64), np.array(en, np.int64)
    # Keep it only if it lowers the makespan, and with the LPT bound (max <= mean + max
    # item) intact for the new items -- so the result is never worse than LPT's.
    rest = np.ones(costs.shape[0], bool)
    rest[donors] = False
    top = max(int(costs[np.argmax(rest)]) if rest.any() else 0,
              per_item + beta * int((cut - first_start[donors]).max()),
              per_item + beta * int((end - start).max()))
    if new.max() >= loads.max() or new.max() > new.mean() + top:
        return nothing
    loads[:] = new
    return donors, cut, np.array(src, np.int64), start, end, np.array(dst, np.int64)
