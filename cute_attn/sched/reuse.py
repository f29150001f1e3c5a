"""Re-plans that keep the last plan's items: a decode step's new lengths on the old split.

Between two decode steps of a serving engine every request grows by one token, a few end and
a few start, and engines re-order their batch as they go. What a decode plan balances is the
*sorted* length profile of the batch (the planner deals items by length), and that profile
barely moves between steps even when requests come and go: a request swapped for another
shifts the lengths between the two ranks by one place each, and neighbours in sorted order
have similar lengths.

So a kept plan is keyed by rank. Every item of the last full plan is (request, kv head, kv
range [start, end), CTA, partial slot); its request is replaced by its *rank* r in that plan's
length order. For new lengths, rank r names the new batch's r-th longest request, and the items
of rank r serve it once each range is clamped to its length (``start' = min(start, len)``) and
the last chunk of each (rank, head) pair is stretched to it (``end' = len``; the others keep
``min(end, len)``). That is a correct plan for *any* new lengths of the same batch size: ranks
and requests are a bijection and each pair's chunks still tile [0, len) in merge order. A range
that becomes empty is an item with no kv blocks, which every kernel serves (state o = 0, lse =
-inf, which the ⊕ merge treats as empty) -- except that a split pair's chunks must not all start at
kv 0 (a request of length 0 on such a rank: then a full re-plan). CTA lists, partial slots and meta are unchanged; the
records' request and length fields and the merge tasks' request fields are rewritten.

Whether the kept items are still *balanced* is the one question: the busiest CTA's modelled
cost (``alpha * tile`` per item + ``beta`` per kv token, the planner's model) against the
mean. The last full plan reached ``q0 = C * max / total``; a kept plan is used while ``q <=
(1 + tol) * max(1, q0)``, so a full re-plan runs when the profile has drifted (growth, a long
request arriving in a batch of short ones). Batch-invariant plans (``kv_split_size``) are never
kept: their chunks are fixed multiples of the split size, which a stretched chunk would break.

A kept plan's split depends on the plans before it, so two wrappers given the same lengths
can differ in the last bits of their outputs (as two batch compositions do); a wrapper that
needs plans to depend on the batch alone uses a full ``plan()`` or ``fixed_split_size``.
"""

from __future__ import annotations

import numpy as np

from ..abi import kept as kp
from . import workspace as ws
from .assign import ids

_BIG = np.int64(np.iinfo(np.int64).max)


def length_order(kv: np.ndarray) -> np.ndarray:
    """Requests longest first, ties by request index (the planner's dealing order)."""
    b = kv.shape[0]
    if b < 512:
        return (-kv).argsort(kind="stable")
    # one int64 key (length, request): a plain sort is ~3x faster than a stable argsort
    key = np.sort(((int(kv.max()) - kv) << 32) | ids(b))
    return key & 0xFFFFFFFF


class KeptPlan:
    """The length-independent part of one full decode plan (``Planner.plan`` with
    ``qo_indptr=None``) of lengths ``kv``, and its records for new lengths."""

    def __init__(self, plan, kv: np.ndarray, per_item: int, beta: int, tol: float):
        w = plan.work_items
        self.plan = plan
        self.batch = kv.shape[0]
        self.records = w
        rank = np.empty(self.batch, np.intp)
        rank[length_order(kv)] = ids(self.batch)
        self.rank = rank.take(w[:, ws.W_REQ])  # of every item's request
        self.merge_rank = rank.take(plan.merge_tasks[:, ws.M_REQ])
        # A variant's once-per-row term (attention sinks: ``finalize``) goes to the chunk that
        # starts at kv 0, and a request of length 0 would clamp every chunk to start there: its
        # rank must not be one of a split pair (zero lengths sort last, so one bound checks it).
        split = w[:, ws.W_NUM_CHUNKS] > 1
        self.last_split_rank = int(self.rank[split].max()) if split.any() else -1
        start = w[:, ws.W_KV_START].astype(np.int64)
        # the last chunk of a (request, head) pair ends at the request's length, whatever it is
        last = w[:, ws.W_CHUNK] == w[:, ws.W_NUM_CHUNKS] - 1
        end = np.where(last, _BIG, w[:, ws.W_KV_END].astype(np.int64))
        self.bounds = np.stack([start, end], axis=1)  # [items, (start, end)]: one clamp for both
        ip = plan.work_indptr.astype(np.intp)
        counts = np.diff(ip)
        self.num_ctas = counts.shape[0]
        # every CTA's kv tokens: one segmented sum where no CTA is empty, else a prefix sum
        self.first = ip[:-1] if counts.all() else None
        self.ip = ip
        self.fixed = per_item * counts.astype(np.int64)  # per-item cost of every CTA's items
        self.fixed_total = int(self.fixed.sum())
        self.beta = beta
        loads = self.fixed + beta * self._tokens(w[:, ws.W_KV_END].astype(np.int64) - start)
        total = int(loads.sum())
        q0 = self.num_ctas * int(loads.max()) / total if total else 1.0
        self.bound = (1.0 + tol) * max(1.0, q0)  # C * max load may be up to bound * total
        self.per_item = per_item

    def device_records(self, epoch: int, page_size: int, max_kv_len: int):
        """What ``kernels/kept_update.py`` reads to follow this plan on the device: (params
        int32[KEPT_PARAMS], items int32[items, KEPT_ITEM_FIELDS], merge ranks int32[tasks]), or
        None where it cannot (more requests than it sorts)."""
        b = self.batch
        if not 0 < b <= kp.MAX_BATCH or self.num_ctas > kp.MAX_CTAS:
            return None
        p = np.zeros(kp.KEPT_PARAMS, np.int32)
        p[kp.K_ON] = 1
        p[kp.K_BATCH] = b
        p[kp.K_SORT_LOG2] = max(1, (b - 1).bit_length())
        p[kp.K_PAGE_SIZE] = page_size
        p[kp.K_NUM_CTAS] = self.num_ctas
        p[kp.K_NUM_MERGES] = self.merge_rank.shape[0]
        p[kp.K_EPOCH] = epoch
        p[kp.K_PER_ITEM] = self.per_item
        p[kp.K_BETA] = self.beta
        p[kp.K_BOUND_Q20] = min(int(self.bound * (1 << 20)), np.iinfo(np.int32).max)
        p[kp.K_MAX_KV_LEN] = min(max_kv_len, np.iinfo(np.int32).max)
        p[kp.K_NUM_ITEMS] = self.rank.shape[0]
        items = np.zeros((self.rank.shape[0], kp.KEPT_ITEM_FIELDS), np.int32)
        items[:, kp.KI_CTA] = np.repeat(np.arange(self.num_ctas), np.diff(self.ip))
        items[:, kp.KI_RANK] = self.rank
        items[:, kp.KI_START] = self.bounds[:, 0]
        items[:, kp.KI_END] = np.where(self.bounds[:, 1] == _BIG, -1, self.bounds[:, 1])
        return p, items, self.merge_rank.astype(np.int32)

    def _tokens(self, span):
        """kv tokens of every CTA's items (``span``: of every item, CTA-major)."""
        if span.shape[0] == 0:
            return np.zeros(self.num_ctas, np.int64)
        if self.first is not None:
            return np.add.reduceat(span, self.first)
        cs = np.zeros(span.shape[0] + 1, np.int64)
        np.cumsum(span, out=cs[1:])
        return cs.take(self.ip[1:]) - cs.take(self.ip[:-1])

    def follow(self, kv):
        """The kept items on new lengths ``kv`` (int64 [batch]): ((request, kv [start, end),
        kv len) of every item, request of every merge task), CTA loads -- or None where they
        are out of balance (the caller then plans anew)."""
        if self.last_split_rank >= 0 and np.count_nonzero(kv) <= self.last_split_rank:
            return None
        order = length_order(kv)
        req = order.take(self.rank)
        lens = kv.take(req)
        se = np.minimum(self.bounds, lens[:, None])
        span = se[:, 1] - se[:, 0]
        loads = self._tokens(span)
        if self.beta != 1:
            loads *= self.beta
        loads += self.fixed
        total = self.fixed_total + self.beta * int(span.sum())
        if self.num_ctas * int(loads.max()) > self.bound * total:
            return None
        return (req, se, lens, order.take(self.merge_rank)), loads
