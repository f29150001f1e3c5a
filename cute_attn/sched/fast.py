"""The planner's fast path: batches of one query tile per request (decode), vectorized.

A serving engine re-plans decode every step, so this path is built for few numpy calls
rather than for generality. It applies where every request is one tile (``build_tiles``'s
``one_each``), nothing is batch-invariant and beta > 0; anything else takes the general
path (``Planner._plan_balanced``).

**Head groups.** The H kv heads of a request cost the same, so with ``g = gcd(C, H)`` the
plan is that of one group of ``H / g`` heads on ``C / g`` CTAs, repeated g times (group j:
heads ``j * H / g ..``, CTAs ``j * C / g ..``). The repeated plan balances exactly as well
as the group's, and every candidate below runs on g times fewer items and CTAs.

**Candidates**, in the general path's order and with its rules (``Planner`` class doc),
each vectorized:

* whole items dealt by the snake (``assign.Snake``: cached tables) if within tolerance;
* else whole items by LPT (``assign.lpt_assign``) if within tolerance;
* else the pre-cut candidate (``Planner._precut``'s rule: tiles longer than a CTA's share
  cut at multiples of it, LPT over the pieces) if within tolerance;
* else the lower modelled makespan (``Planner._score``) of that (or whole items by LPT)
  and a wrap-around split (``wrap_line``), where makespans within tol of each other (at
  most one per-item cost) count as a tie, which goes to fewer merges (``_clearly_better``).

What the general path adds and this one leaves out, for time: pairwise refinement
(``assign.refine_pairs``) and the one-by-one boundary placement (``assign._wrap_exact``).
In their place the wrap-around split is laid on the snake's line instead of the cost-sorted
one, its CTA boundaries are aimed at targets that already count the per-item cost of each
cut, and near-ties go to the candidate with fewer merges (above). The snake line alternates
long and short items, so no CTA gets a run of short ones (the general path's reason to
prefer pre-cut plans on the GPU), and a boundary rarely has to move far to a page multiple
or item edge. How the two paths compare (modelled makespan, merges, items per CTA over
random batches): ``tests/test_sched_fast.py``.
"""

from __future__ import annotations

from math import gcd

import numpy as np

from . import workspace as ws
from .assign import Snake, ids, lpt_assign
from .cost import chunk_counts, min_chunk_len, pieces
from .reuse import length_order

_INF = np.iinfo(np.int64).max // 4
SNAP_SLACK = 0.5  # a wrap boundary moves to an item edge, rather than cutting, within this x tol x target


def limit_of(loads, tol: float) -> float:
    return (1.0 + tol) * int(loads.sum())


class OneTilePath:
    """Per-planner state of the fast path: snake tables per group grid and the index tables
    of whole-item snake plans, which depend only on the number of items."""

    def __init__(self, num_ctas: int):
        self.c = num_ctas
        self._snakes = {}  # CTAs per group -> Snake
        self._tables = {}  # (items per group, groups, heads per group, CTAs) -> snake index tables

    def snake(self, c: int) -> Snake:
        s = self._snakes.get(c)
        if s is None:
            s = self._snakes[c] = Snake(c)
        return s

    def snake_tables(self, n: int, groups: int, mult: int, cg: int):
        """(the group's items CTA-major, sorted-request index and head of every record of all
        groups, work_indptr of all groups) of the snake plan of n items per group."""
        key = (n, groups, mult, cg)
        t = self._tables.get(key)
        if t is None:
            items, indptr = self.snake(cg).cta_major(n)
            src, head = np.divmod(items, mult)
            off = ids(groups)[:, None]
            full_head = (head[None, :] + off * mult).ravel().astype(np.int32)
            full_ip = np.empty(groups * cg + 1, np.int32)
            full_ip[:-1] = (off * n + indptr[None, :-1]).ravel()
            full_ip[-1] = groups * n
            if len(self._tables) >= 64:
                self._tables.clear()
            t = (items, np.tile(src, groups), full_head, full_ip)
            for a in t:  # shared by the plans (a Plan's work_indptr is the last one)
                a.flags.writeable = False
            self._tables[key] = t
        return t

    # -- the plan -----------------------------------------------------------------------
    def plan(self, pl, ext, hk, per_item, page, rec_args):
        """The plan of a batch of one tile per request (``Planner.plan``'s arguments). Every
        branch ends in a plan that fits the partial slots: whole items need none, the pre-cut
        chunk doubles until its pieces fit, and a wrap-around split that would not fit is
        not a candidate."""
        c, beta, tol = self.c, pl.beta, pl.balance_tol
        groups = gcd(c, hk)
        mult, cg = hk // groups, c // groups  # heads per group, CTAs per group
        order = length_order(ext)
        kvs = ext.take(order)
        cost_r = per_item + beta * kvs
        cost = cost_r.repeat(mult) if mult > 1 else cost_r  # items: (request, head) pairs
        n = cost.shape[0]
        total = int(cost.sum())  # of one group
        limit = (1.0 + tol) * total
        ctx = _Ctx(self, pl, order, kvs, groups, mult, cg, per_item, page, rec_args)
        lpt = None
        if int(cost_r[0]) * cg <= limit:  # whole items may do
            loads = np.bincount(self.snake(cg).cta(n), cost, cg)
            if loads.max() * cg <= limit:
                return ctx.whole_snake(n, loads.astype(np.int64))
            lpt = lpt_assign(cost, cg)
            if int(lpt[1].max()) * cg <= limit:
                return ctx.emit(ctx.whole_lpt(lpt))
        share = (groups * total / c - per_item) / beta
        m = min_chunk_len(int(share), page, pl.min_kv_chunk)
        max_slots = pl.layout.max_partial_rows // rec_args[8]
        pre = ctx.precut(m, share, max_slots)
        if pre is not None and int(pre["loads"].max()) * cg <= limit_of(pre["loads"], tol):
            return ctx.emit(pre, m)
        wrap = ctx.wrap_line(m, max_slots, tol)
        if pre is None:
            if wrap is not None and wrap["key"][0] < int(cost_r[0]):  # LPT's max >= largest item
                return ctx.emit(wrap, m)
            if lpt is None:
                lpt = lpt_assign(cost, cg)
            whole = (ctx.score(lpt[1], 0), 0, n)
            if wrap is None or not _clearly_better(wrap["key"], whole, per_item, tol):
                return ctx.emit(ctx.whole_lpt(lpt))
            return ctx.emit(wrap, m)
        if wrap is not None and _clearly_better(wrap["key"], pre["key"], per_item, tol):
            return ctx.emit(wrap, m)
        return ctx.emit(pre, m)


def _clearly_better(a, b, per_item: int, tol: float) -> bool:
    """Whether candidate key ``a`` (score, merges, items) beats ``b``. Makespans within tol (at
    most one per-item cost) of each other count as a tie, which goes to fewer merges: the
    kernel pays for every item and split more than the model says (``Planner``), and the
    general path's pairwise refinement, which often brings whole items or the pre-cut plan
    level with the wrap-around split, is left out here."""
    if a >= b:
        return False
    return a[1] <= b[1] or a[0] + min(per_item, tol * a[0]) < b[0]


# Merge task fields from the first piece (chunk 0) of a split pair: REQ, KV_HEAD, ROW_START,
# NUM_ROWS, QO_OFFSET, SLOT_START = its DEST, NUM_SLOTS = NUM_CHUNKS, RESERVED = ROW_START (0:
# one tile per request).
_MERGE_COLS = np.array(
    (ws.W_REQ, ws.W_KV_HEAD, ws.W_ROW_START, ws.W_NUM_ROWS, ws.W_QO_OFFSET, ws.W_DEST, ws.W_NUM_CHUNKS, ws.W_ROW_START)
)


class _Ctx:
    """One plan's arrays: the candidates of one head group and the record writer.

    A candidate is a dict of the group's pieces, CTA-major: ``src`` (sorted-request index),
    ``head`` (within the group; None: one head per group), for split candidates ``start`` /
    ``stop`` / ``chunk`` / ``nch`` (chunks of the piece's pair) / ``slot`` (partial slot
    within the group, -1: direct) and ``slots`` (per group); ``cta``, ``loads``, ``key``."""

    def __init__(self, path, pl, order, kvs, groups, mult, cg, per_item, page, rec_args):
        self.path, self.pl, self.order, self.kvs = path, pl, order, kvs
        self.groups, self.mult, self.cg, self.per_item = groups, mult, cg, per_item
        self.page, self.rec_args = page, rec_args

    def score(self, loads, merges: int) -> int:
        """``Planner._score`` (merges of all groups)."""
        return int(loads.max()) + self.per_item * (-(-self.groups * merges // self.path.c))

    def split_items(self, items):
        """(sorted request, head within the group) of cost-ordered item ids."""
        return (items, None) if self.mult == 1 else np.divmod(items, self.mult)

    # -- candidates -----------------------------------------------------------------------
    def whole_lpt(self, lpt):
        cta, loads = lpt
        by = cta.astype(np.int16 if self.cg < 2**15 else np.int32).argsort(kind="stable")
        src, head = self.split_items(by)
        return dict(src=src, head=head, cta=cta, loads=loads)

    def precut(self, m, share, max_slots):
        """``Planner._precut`` on one group; None where nothing is longer than the chunk.
        Slots go to split pairs in (sorted request, head) order, chunks in order inside."""
        kvs, mult, groups, page = self.kvs, self.mult, self.groups, self.page
        chunk = max(m, int(share) // page * page)
        emax = int(kvs[0])
        while True:
            if chunk >= emax:
                return None
            npc = chunk_counts(kvs, chunk, m)
            split = npc > 1
            if not split.any():
                return None
            if groups * mult * int(npc[split].sum()) <= max_slots:
                break
            chunk *= 2
        t, ch, start, end = pieces(kvs, npc, chunk)
        pc = self.per_item + self.pl.beta * (end - start)
        po = (-pc).argsort(kind="stable")
        cost = pc.take(po).repeat(mult) if mult > 1 else pc.take(po)
        cta, loads = lpt_assign(cost, self.cg)
        by = cta.astype(np.int16 if self.cg < 2**15 else np.int32).argsort(kind="stable")
        if mult > 1:
            q, head = np.divmod(by, mult)
            q = po.take(q)
        else:
            q, head = po.take(by), None
        src, chunk_i = t.take(q), ch.take(q)
        nsl = np.where(split, npc, 0)  # slots of each sorted request's pairs
        nch = npc.take(src)
        base = mult * (nsl.cumsum() - nsl).take(src)
        if head is not None:
            base += head * nsl.take(src)
        merges = mult * int(np.count_nonzero(split))
        return dict(
            src=src,
            head=head,
            start=start.take(q),
            stop=end.take(q),
            chunk=chunk_i,
            nch=nch,
            slot=np.where(nch > 1, base + chunk_i, -1),
            slots=mult * int(nsl.sum()),
            cta=cta.take(by),
            loads=loads,
            chunk_len=chunk,
            key=(self.score(loads, merges), merges, cost.shape[0]),
        )

    def wrap_line(self, m, max_slots, tol):
        """The wrap-around split laid on the snake's line (module doc): CTA k of the group
        gets the stretch [B_k, B_{k+1}) of the items in the snake's CTA-major order, with
        B_k = k * T - per_item * (k - 1), T = (total + per_item * (C - 1)) / C -- the
        target if every boundary cuts (a piece that starts a CTA pays the per-item cost
        again). A boundary cuts its item at the nearest page multiple that leaves both
        pieces >= m tokens, or moves to the item's start or end where that is nearer (by
        ``SNAP_SLACK * tol * T``: a cut costs a partial and a merge). None where it does
        not apply (too little work per CTA for pieces of m), does not fit the partial slots
        or breaks the LPT bound. Pieces come in line order, which is CTA-major, so a split
        item's pieces are consecutive: slots go in line order."""
        beta, p, page, cg = self.pl.beta, self.per_item, self.page, self.cg
        n = self.kvs.shape[0] * self.mult
        if cg == 1:
            return None
        tab = self.path.snake_tables(n, self.groups, self.mult, cg)[0]
        line_kv = self.kvs.take(tab // self.mult) if self.mult > 1 else self.kvs.take(tab)
        cost = p + beta * line_kv
        cum = cost.cumsum()
        w = int(cum[-1])
        if -(-w // cg) < p + 4 * beta * (m + page):
            return None
        t = (w + p * (cg - 1)) / cg
        bk = ids(cg)[1:] * (t - p) + p  # boundary k starts CTA k (k = 1 .. C - 1)
        inside = bk < w
        b = np.minimum(bk, w - 1)
        i = cum.searchsorted(b, side="right")  # the item each boundary falls in
        end = cum.take(i)
        s = end - cost.take(i)
        hi = (line_kv.take(i) - m) // page * page  # last allowed cut (< m: none)
        xc = np.minimum(np.maximum(((b - s - p) / (beta * page) + 0.5).astype(np.int64) * page, m), hi)
        pos = s + p + beta * xc
        d_cut = np.where(hi >= m, np.abs(pos - b), _INF) + SNAP_SLACK * tol * t
        d_start = b - s - p  # the next CTA then pays no second per-item cost
        d_end = end - b
        at_start = (d_start <= d_cut) & (d_start <= d_end)
        at_end = ~at_start & (d_end <= d_cut)
        cut = ~(at_start | at_end) & inside
        bp = np.where(inside, np.where(at_start, s, np.where(at_end, end, pos)), w)
        ci, cx = i[cut], xc[cut]
        k = ci.shape[0]
        if (bp[1:] < bp[:-1]).any() or (k > 1 and ((ci[1:] == ci[:-1]) & (cx[1:] <= cx[:-1])).any()):
            return None  # (cannot happen with the guard on T; kept as a safety net)
        npc = np.bincount(ci, minlength=n) + 1
        item = ids(n).repeat(npc)
        first = npc.cumsum() - npc
        at = first.take(ci) + (ids(k) - ci.searchsorted(ci, side="left"))
        start = np.zeros(n + k, np.int64)
        start[at + 1] = cx
        stop = line_kv.take(item)
        stop[at] = cx
        pcost = p + beta * (stop - start)
        cta = bp.searchsorted((cum - cost).take(item) + np.where(start > 0, p + beta * start, 0), side="right")
        loads = np.bincount(cta, weights=pcost, minlength=cg).astype(np.int64)
        nch = npc.take(item)
        split = nch > 1
        slots = int(np.count_nonzero(split))
        merges = int(np.count_nonzero(npc > 1))
        if self.groups * slots > max_slots:
            return None
        if int(loads.max()) * cg > int(loads.sum()) + cg * int(pcost.max()):  # the LPT bound
            return None
        src, head = self.split_items(tab.take(item))
        return dict(
            src=src,
            head=head,
            start=start,
            stop=stop,
            chunk=ids(n + k) - first.take(item),
            nch=nch,
            slot=np.where(split, split.cumsum() - 1, -1),
            slots=slots,
            cta=cta,
            loads=loads,
            chunk_len=0,
            key=(self.score(loads, merges), merges, n + k),
        )

    # -- records ------------------------------------------------------------------------
    def _tile_records(self):
        ra = self.rec_args
        return self.pl._tile_records(ra[3].shape[0], *ra[:8])

    def whole_snake(self, n, loads):
        """Records of the snake plan: the index tables are cached per item count."""
        _, src, head, indptr = self.path.snake_tables(n, self.groups, self.mult, self.cg)
        w = self._tile_records().take(self.order.take(src), axis=0)
        w[:, ws.W_KV_HEAD] = head
        return self.pl._finish_unsplit(w, indptr, np.tile(loads, self.groups), self.rec_args)

    def emit(self, cand, m=0):
        """Records of a candidate, repeated for every head group (module doc): heads, CTAs
        and partial slots offset per group; merge tasks from the first piece of each split
        pair."""
        g, mult, cg = self.groups, self.mult, self.cg
        w = self._tile_records().take(self.order.take(cand["src"]), axis=0)
        if cand["head"] is not None:
            w[:, ws.W_KV_HEAD] = cand["head"]
        split = "slot" in cand
        if split:
            w[:, ws.W_KV_START] = cand["start"]
            w[:, ws.W_KV_END] = cand["stop"]
            w[:, ws.W_CHUNK] = cand["chunk"]
            w[:, ws.W_NUM_CHUNKS] = cand["nch"]
            w[:, ws.W_DEST] = cand["slot"]
        ns = w.shape[0]
        counts = np.bincount(cand["cta"], minlength=cg)
        indptr = np.empty(g * cg + 1, np.int32)
        indptr[:-1] = (ids(g)[:, None] * ns + (counts.cumsum() - counts)[None, :]).ravel()
        indptr[-1] = g * ns
        if g > 1:
            full = np.empty((g, ns, ws.WORK_FIELDS), np.int32)
            full[:] = w
            off = ids(g).astype(np.int32)[:, None]
            full[:, :, ws.W_KV_HEAD] += off * mult
            if split:
                d = full[:, :, ws.W_DEST]
                d += (d >= 0) * (off * cand["slots"])
            w = full.reshape(g * ns, ws.WORK_FIELDS)
        loads = np.tile(cand["loads"], g) if g > 1 else cand["loads"]
        if not split:
            return self.pl._finish_unsplit(w, indptr, loads, self.rec_args)
        rows = ((w[:, ws.W_CHUNK] == 0) & (w[:, ws.W_NUM_CHUNKS] > 1)).nonzero()[0]
        merge = w.take(rows, axis=0).take(_MERGE_COLS, axis=1)
        return self.pl._finish_split(w, indptr, merge, loads, g * cand["slots"], cand["chunk_len"], m, self.rec_args)
