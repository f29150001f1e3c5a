"""Assignment of work items to persistent CTAs: snake, LPT, wrap-around split.

An item is one (tile or kv chunk, kv head) pair; items are handed in sorted by cost,
largest first. The rules below are tried in this order by ``Planner`` (cheapest first;
the first within ``balance_tol`` of the mean wins, see ``Planner``): snake, LPT, LPT +
pairwise refinement, wrap-around split (+ pairwise refinement of its pieces).

**Snake** (``Snake``). Deal the sorted items in rounds of C: round 0 to CTAs 0..C-1,
round 1 to CTAs C-1..0, and so on (boustrophedon). It needs no load bookkeeping at all:
the CTA of item i and each CTA's item list depend on (i, C) alone, so they are cached
tables, and the records come out CTA-major without a sort. For items of about equal cost
-- the common decode batch -- it balances about as well as LPT (BENCHMARKS.md, scheduler), and it
keeps the LPT bound: two CTAs' loads differ by at most the sum over rounds of the
round's spread (its largest - smallest item; plus the last, partial round's largest
item), and the rounds are disjoint stretches of the sorted costs, so that sum is at most
the largest item.

**LPT.** Items arrive sorted by cost, largest first; each goes to the least-loaded CTA. A
heap does this one item at a time (~0.25 us per item in CPython: too slow for thousands of
items in a 50 us budget), so the same rule is applied in vectorized steps:

* round 1: the C largest items, one per CTA (all CTAs are empty: exactly what LPT does);
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

**Pairwise refinement** (``refine_pairs``). LPT's weak spot is a few items per CTA (its
last, partial round can leave a CTA an item above the rest: up to 4/3 of optimal). Pair
the j-th busiest CTA with the j-th least busy and, in all pairs at once, move one item
across or swap two, whichever evens the pair best; a few passes. Both new loads of a pair
stay below its busier one's, so the maximum never rises (the LPT bound holds).

**Pre-cut + LPT** (``Planner._precut``, ``cost.cut_schedule``), tried before the
wrap-around split where whole items cannot balance: tiles longer than a CTA's fair share
are cut at multiples of it (a last piece shorter than the minimum chunk joins the one
before), and the pieces x heads go through LPT. Few cuts, and the short items are spread
over all CTAs as fillers. Taken if within ``balance_tol``; else the planner keeps
whichever of it and the wrap-around split has the lower modelled makespan (ties: fewer
merges, then fewer items). The LPT bound holds over the pieces.

**Wrap-around split** (``wrap_fill``), for batches whole items cannot balance (a tile
longer than a CTA's share, or too few items per CTA). McNaughton's rule, the optimal
schedule of divisible work: lay the items on a line in cost order, each as its per-item
cost followed by its kv tokens, and give CTA k the stretch [k*Q, (k+1)*Q) with Q =
ceil(total / C). An item a boundary falls in is cut there, at the nearest page multiple
that leaves both pieces >= ``min_chunk`` tokens; where the item's start or end is nearer
(always the case within its first per_item + min_chunk or last min_chunk units, where no
cut is allowed), the boundary moves to that edge instead of cutting. A cut piece pays the
per-item cost again, so a CTA ends at about Q or Q + per_item; where per_item is a
sizeable part of Q (> Q / EXACT_WRAP_RATIO) the boundaries are placed one by one instead,
each CTA aiming at its share of what is left, cut costs included (``_wrap_exact``). At
most C - 1 cuts, so at most 2 (C - 1) partial slots; the pieces are in line order, which
is CTA-major. Deterministic. The planner keeps the result only if it beats whole items
and keeps the LPT bound.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

HEAD_ROUNDS = 6


_ARANGE = np.arange(0)
_ZEROS = np.zeros(0, np.int64)
_ONES = np.ones(0, np.int64)


def ids(n: int) -> np.ndarray:
    """arange(n), int64, read-only (a view of a cached array)."""
    global _ARANGE
    if _ARANGE.shape[0] < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0], 1024))
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


def zeros(n: int) -> np.ndarray:
    """zeros(n), int64, read-only (a view of a cached array)."""
    global _ZEROS
    if _ZEROS.shape[0] < n:
        _ZEROS = np.zeros(max(n, 2 * _ZEROS.shape[0], 1024), np.int64)
        _ZEROS.flags.writeable = False
    return _ZEROS[:n]


def ones(n: int) -> np.ndarray:
    """ones(n), int64, read-only (a view of a cached array)."""
    global _ONES
    if _ONES.shape[0] < n:
        _ONES = np.ones(max(n, 2 * _ONES.shape[0], 1024), np.int64)
        _ONES.flags.writeable = False
    return _ONES[:n]


_ids = ids


class Snake:
    """Snake tables for C CTAs (module doc): the CTA of each item, and each CTA's items."""

    def __init__(self, num_ctas: int):
        self.c = num_ctas
        self._cta = np.zeros(0, np.int64)
        self._major = {}  # rounds -> item ids CTA-major, C x rounds
        self._pos = np.arange(num_ctas + 1)

    def cta(self, n: int) -> np.ndarray:
        """CTA of items 0..n-1 (read-only view)."""
        if self._cta.shape[0] < n:
            c = self.c
            i = np.arange(max(n, 2 * self._cta.shape[0], 4 * c))
            r, j = np.divmod(i, c)
            self._cta = np.where(r & 1, c - 1 - j, j)
            self._cta.flags.writeable = False
        return self._cta[:n]

    def cta_major(self, n: int):
        """(item ids grouped by CTA, each CTA's in dealing order; work_indptr [C+1])."""
        c = self.c
        r = -(-n // c)
        tab = self._major.get(r)
        if tab is None:
            if len(self._major) >= 64:
                self._major.clear()
            rr = np.arange(r)[None, :]
            cc = np.arange(c)[:, None]
            tab = self._major[r] = (rr * c + np.where(rr & 1, c - 1 - cc, cc)).ravel()
            tab.flags.writeable = False
        last = n - (r - 1) * c  # items in the last round, 1..C
        pos = self._pos
        if r & 1:  # last round dealt forwards: CTAs 0..last-1 got one
            indptr = pos * (r - 1) + np.minimum(pos, last)
            items = tab if last == c else tab[tab < n]
        else:
            indptr = pos * (r - 1) + np.maximum(pos - (c - last), 0)
            items = tab if last == c else tab[tab < n]
        return items, indptr


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
            order = loads.argsort(kind="stable")  # (methods: no numpy dispatch wrapper)
        # Deal the next items largest-to-least-loaded, but only as far as that is exactly
        # what one-at-a-time LPT would do: the j-th least-loaded CTA may take the j-th item
        # while its load <= the least load + that item (else LPT would stack an item on a
        # lighter CTA first). That prefix is found with one binary search.
        mm = min(n - k, c)
        ls = loads[order[:mm]]
        m = max(1, int((ls - costs[k : k + mm]).searchsorted(ls[0], side="right")))
        order = order[:m]
        cta[k : k + m] = order
        loads[order] += costs[k : k + m]
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


REFINE_PASSES = 4  # pairwise refinement: at most this many passes ...
REFINE_MAX_ITEMS = 16  # ... and only where no CTA holds more items than this


def refine_pairs(costs, cta, num_ctas: int, passes: int = REFINE_PASSES):
    """Pairwise refinement of an assignment of whole items (module doc): pair the j-th
    busiest CTA with the j-th least busy (j < C / 2) and, in every pair at once, move one
    item from the busy CTA to the other or swap two, whichever brings the pair closest to
    even (up to ``passes`` times, while any pair can). A pair's new loads are both below
    its busy CTA's, so the maximum never rises and the mean does not change: the LPT
    bound is kept. Returns (cta, loads) -- new arrays -- or None when there are too many
    items per CTA (LPT is close to even there anyway) or the maximum did not drop."""
    c = num_ctas
    cnt = np.bincount(cta, minlength=c)
    k = int(cnt.max())
    if c < 2 or k > REFINE_MAX_ITEMS or costs.shape[0] == 0:
        return None
    cta = cta.copy()
    loads = np.bincount(cta, costs, c).astype(np.int64)
    best = int(loads.max())  # the maximum never rises (doc): compare at the end
    half = c // 2
    big = np.iinfo(np.int64).max // 4
    improved = False
    for _ in range(passes):
        by = np.argsort(cta, kind="stable")
        cnt = np.bincount(cta, minlength=c)
        k = int(cnt.max())
        slot = ids(by.shape[0]) - (np.cumsum(cnt) - cnt)[cta[by]]
        m = np.full((c, k + 1), -1, np.int64)  # items of each CTA, padded; last column: none
        m[cta[by], slot] = by
        x = np.where(m >= 0, costs[m], big)
        x[:, k] = 0  # "swap with nothing" = move
        order = np.argsort(loads, kind="stable")
        hv, lt = order[::-1][:half], order[:half]
        xu = x[hv, :k]  # (padding: big, so never moved)
        d = xu[:, :, None] - x[lt][:, None, :]
        g = (loads[hv] - loads[lt])[:, None, None]
        score = np.where((d > 0) & (d < g) & (xu[:, :, None] < big), np.abs(2 * d - g), big)
        flat = score.reshape(half, -1)
        pick = flat.argmin(axis=1)
        ok = flat[ids(half), pick] < big
        if not ok.any():
            break
        a, b = np.divmod(pick[ok], k + 1)
        h, l = hv[ok], lt[ok]
        new = cta.copy()
        new[m[h, a]] = l
        sw = b < k
        new[m[l[sw], b[sw]]] = h[sw]
        cta, loads = new, np.bincount(new, costs, c).astype(np.int64)
        improved = True
    return (cta, loads) if improved and int(loads.max()) < best else None


_INF = np.iinfo(np.int64).max
EXACT_WRAP_RATIO = 64  # place boundaries one by one where per_item > Q / 64 (see wrap_fill)


def _wrap_exact(k_est, cum, cost, ext, c, w, per_item, beta, page, m):
    """Boundaries placed one by one (see ``wrap_fill``): CTA k - 1, starting at line
    position B, aims at its share of what is left, T_k = (w - B + per_item * (its own
    second per-item cost + the cuts expected after it, k_est pro rata)) / (C - k + 1), so
    a boundary that lands early or late is made up for by all the CTAs after it (rather
    than by the next one, or by the last). Of the options -- the start or end of the item
    the target falls in, or the page-aligned cut nearest to it -- the nearest wins (ties:
    no cut). Returns the arrays ``snap`` does. ~0.6 us per CTA."""
    n = ext.shape[0]
    cum_l, start_l = cum.tolist(), (cum - cost).tolist()
    hi_l = ((ext - m) // page * page).tolist()  # last allowed cut of each item (< m: none)
    ii, xx, cuts, bps = [0] * (c - 1), [0] * (c - 1), [False] * (c - 1), [w] * (c - 1)
    fut = per_item * k_est / c
    base = per_item  # line position of kv token x of an item starting at s: s + base + beta * x
    bpos, pc = 0, 0
    for j in range(c - 1):
        left = c - j
        b = bpos + (w - bpos + pc) / left + fut - pc
        if b >= w:
            break
        i = bisect_right(cum_l, b, 0, n)
        s, end = start_l[i], cum_l[i]
        if b - s <= end - b:
            bp, dist = s, b - s
        else:
            bp, dist = end, end - b
        pc = 0
        hi = hi_l[i]
        if hi >= m:
            xc = round((b - s - base) / (beta * page)) * page
            xc = m if xc < m else hi if xc > hi else xc
            pos = s + base + beta * xc
            if abs(pos - b) < dist:
                bp, pc = pos, per_item
                ii[j], xx[j], cuts[j] = i, xc, True
        bps[j] = bpos = bp
    return (np.array(ii, np.int64), np.array(xx, np.int64), np.array(cuts, bool), np.array(bps, np.int64))


def wrap_fill(ext, *, per_item: int, beta: int, page: int, min_chunk: int, num_ctas: int, tol: float = 0.05):
    """The wrap-around split (module doc) of items with kv lengths ``ext`` (in line order).

    ``tol``: the one-by-one placement runs only where the quick one is further than tol
    above the mean. Returns None where it does not apply (beta 0, one CTA, or too little
    work per CTA to cut pieces of ``min_chunk``), else ``(item, start, end, chunk, cta, loads, ncut)``: the
    pieces in line order (item index, kv range, index within the item), each one's CTA
    (non-decreasing), the CTA loads, and the number of cuts of each item.
    """
    n, c, m = ext.shape[0], num_ctas, min_chunk
    if n == 0 or c == 1 or beta <= 0:
        return None
    cost = per_item + beta * ext
    cum = np.cumsum(cost)
    w = int(cum[-1])
    q = -(-w // c)
    if q < per_item + 4 * beta * (m + page):
        return None
    k1 = ids(c)[1:]  # boundary k starts CTA k

    def snap(b):
        """Cut or move boundaries ``b`` (line positions); boundaries at/after the end of
        the line start empty CTAs."""
        inside = b < w
        b = np.minimum(b, w - 1)
        i = np.searchsorted(cum, b, side="right")  # the item each boundary falls in
        end = cum[i]
        s = end - cost[i]
        # Nearest page multiple to the boundary's kv position, within [m, e - m].
        xc = ((b - s - per_item) * 2 + beta * page) // (2 * beta * page) * page
        hi = (ext[i] - m) // page * page
        xc = np.minimum(np.maximum(xc, m), hi)
        pos = s + per_item + beta * xc
        d_cut = np.where(hi >= m, np.abs(pos - b), _INF)
        d_start = b - s - per_item  # the next CTA then pays no second per-item cost
        d_end = end - b
        at_start = (d_start <= d_end) & (d_start <= d_cut)
        at_end = ~at_start & (d_end <= d_cut)
        cut = ~(at_start | at_end) & inside
        bp = np.where(inside, np.where(at_start, s, np.where(at_end, end, pos)), w)
        return i, xc, cut, bp

    i, xc, cut, bp = snap(k1 * q)
    if per_item * EXACT_WRAP_RATIO > q:
        # A CTA that starts with a cut piece pays the per-item cost again, so at boundaries
        # k * Q the loads are Q or Q + per_item. Where per_item is a sizeable part of Q,
        # and that puts the busiest CTA more than tol above the mean, place the boundaries
        # one by one, each CTA aiming at its share of
        # what is left including the per-item costs of the cuts (``_wrap_exact``).
        def top(bp, cut):  # the busiest CTA's load
            edges = np.concatenate(([0], bp, [w]))
            return int((edges[1:] - edges[:-1] + per_item * np.concatenate(([0], cut))).max())

        t1 = top(bp, cut)
        if t1 * c > (1 + tol) * (w + per_item * int(cut.sum())):
            r = _wrap_exact(int(cut.sum()), cum, cost, ext, c, w, per_item, beta, page, m)
            if top(r[3], r[2]) < t1:
                i, xc, cut, bp = r
    if (bp[1:] < bp[:-1]).any():
        return None  # (cannot happen with the guard on q; kept as a safety net)
    ci, cx = i[cut], xc[cut]
    k = ci.shape[0]
    if k > 1 and ((ci[1:] == ci[:-1]) & (cx[1:] <= cx[:-1])).any():
        return None
    ncut = np.bincount(ci, minlength=n)
    npc = ncut + 1
    item = np.repeat(ids(n), npc)
    first = np.cumsum(npc) - npc
    chunk = ids(n + k) - first[item]
    start = np.zeros(n + k, np.int64)
    stop = ext[item]
    at = first[ci] + (ids(k) - np.searchsorted(ci, ci, side="left"))
    stop[at] = cx
    start[at + 1] = cx
    if k and ((stop - start)[npc[item] > 1] < m).any():
        return None  # (a piece below min_chunk: cannot happen with the guard on q)
    lpos = (cum - cost)[item] + np.where(start > 0, per_item + beta * start, 0)
    cta = np.searchsorted(bp, lpos, side="right")
    loads = np.bincount(cta, weights=per_item + beta * (stop - start), minlength=c).astype(np.int64)
    return item, start, stop, chunk, cta, loads, ncut
