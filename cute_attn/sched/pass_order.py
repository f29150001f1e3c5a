"""The order of the fp8 pass's tasks inside the prefill kernel (``kernels/prefill_sm90_kv8_pass.py``):
the order in which the plan's CTAs will first need each (block of ``block`` rows of the ragged
cache, kv head).  Pure numpy.

Each CTA runs its work items in order and walks an item's key blocks from last to first, one
block per step; a block is needed at the first step (counted from the kernel's start, every
CTA in parallel) at which any CTA's block overlaps its rows.  The helpers then convert blocks
in that order, so the conversion front runs where the consumers are, whatever the batch and
the plan's item order (requests first, heads grouped, longest tiles first)."""

from __future__ import annotations

import numpy as np

from .workspace import W_KV_END, W_KV_HEAD, W_KV_START, W_REQ


def demand_order(work_items, work_indptr, kv_lens, num_kv_heads: int, block: int) -> np.ndarray:
    """(block, kv head) pairs, int64 [n_blocks * num_kv_heads, 2], sorted by the step at which
    the plan first needs them (ties: block, then head); blocks no item reads come last."""
    kv = np.asarray(kv_lens, dtype=np.int64)
    total = int(kv.sum())
    n = -(-total // block)
    H = num_kv_heads
    first = np.full((n, H), np.iinfo(np.int64).max, dtype=np.int64)
    w = np.asarray(work_items, dtype=np.int64)
    if n and w.size:
        ip = np.asarray(work_indptr, dtype=np.int64)
        nb = -(-(w[:, W_KV_END] - w[:, W_KV_START]) // block)
        ends = np.cumsum(nb)
        before = ends - nb  # blocks of all earlier items
        cta_start = np.concatenate([[0], ends])[ip[:-1]]  # blocks before each CTA's first item
        cta = np.repeat(np.arange(ip.size - 1), np.diff(ip))
        it = np.repeat(np.arange(w.shape[0]), nb)
        j = np.arange(int(ends[-1])) - before[it]  # walk order: the item's last block first
        step = before[it] - cta_start[cta[it]] + j
        kv_off = np.concatenate([[0], np.cumsum(kv)])
        row = kv_off[w[it, W_REQ]] + w[it, W_KV_START] + (nb[it] - 1 - j) * block
        head = w[it, W_KV_HEAD]
        for g in (row // block, (np.minimum(row + block, total) - 1) // block):
            np.minimum.at(first, (g, head), step)
    order = np.argsort(first.reshape(-1), kind="stable")
    return np.stack([order // H, order % H], 1)


def pass_plan(work_items, work_indptr, kv_lens, num_kv_heads: int, block: int):
    """(the int32 plan of the pass inside the kernel, its flag count): ``[n_tasks, 3, tokens,
    (block, kv head, request)...]``, one task per block of ``block`` rows of the ragged cache
    (all requests' rows one after the other) and kv head, in :func:`demand_order`; ``request``:
    the one holding the block's first row (a paged cache's pass walks the page table from it)."""
    kv = np.asarray(kv_lens, dtype=np.int64)
    total = int(kv.sum())
    tasks = demand_order(work_items, work_indptr, kv_lens, num_kv_heads, block)
    starts = np.concatenate([[0], np.cumsum(kv)])[:-1]
    # the last request starting at or before the row: empty ones before it are skipped
    req = np.searchsorted(starts, tasks[:, 0] * block, side="right") - 1
    fields = np.concatenate([tasks, req[:, None]], 1)
    plan = np.concatenate([[len(tasks), 3, total], fields.reshape(-1)]).astype(np.int32)
    return plan, len(tasks)
