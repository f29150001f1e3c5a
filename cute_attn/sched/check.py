"""An independent checker of a plan against the contract (used by the tests; kernel
authors can run it on plans they feed their kernels). Raises AssertionError on a violation.
"""

from __future__ import annotations

import numpy as np

from . import workspace as ws


def visible_end(qo_len, kv_len, token, causal: bool):
    """One past the last kv position query token ``token`` may see."""
    if not causal:
        return kv_len
    return np.clip(kv_len - qo_len + token + 1, 0, kv_len)


def verify_plan(plan, qo_indptr, kv_lens, num_kv_heads: int, *, alpha: int = 2, beta: int = 1):
    qo_indptr = np.asarray(qo_indptr, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    qo_len = np.diff(qo_indptr)
    b, hk, g, tile, nc = qo_len.shape[0], num_kv_heads, plan.group_size, plan.cta_tile_q, plan.num_ctas
    w, m = plan.work_items.astype(np.int64), plan.merge_tasks.astype(np.int64)
    n = w.shape[0]
    assert plan.work_items.dtype == np.int32 and plan.work_items.shape[1] == ws.WORK_FIELDS
    assert plan.merge_tasks.dtype == np.int32 and plan.merge_tasks.shape[1] == ws.MERGE_FIELDS
    ip = plan.work_indptr.astype(np.int64)
    assert ip.shape == (nc + 1,) and ip[0] == 0 and ip[-1] == n and (np.diff(ip) >= 0).all()
    meta = plan.meta
    assert meta[ws.META_NUM_WORK_ITEMS] == n and meta[ws.META_NUM_MERGE_TASKS] == m.shape[0]
    assert meta[ws.META_CTA_TILE_Q] == tile and meta[ws.META_NUM_CTAS] == nc

    req, head = w[:, ws.W_REQ], w[:, ws.W_KV_HEAD]
    r0, nr = w[:, ws.W_ROW_START], w[:, ws.W_NUM_ROWS]
    ks, ke, dest = w[:, ws.W_KV_START], w[:, ws.W_KV_END], w[:, ws.W_DEST]
    assert ((req >= 0) & (req < b)).all() and ((head >= 0) & (head < hk)).all()
    assert (w[:, ws.W_QO_OFFSET] == qo_indptr[req]).all()
    assert (w[:, ws.W_QO_LEN] == qo_len[req]).all() and (w[:, ws.W_KV_LEN] == kv_lens[req]).all()
    assert (r0 % tile == 0).all() and (nr >= 1).all() and (nr <= tile).all()
    assert (r0 + nr <= qo_len[req] * g).all()
    assert ((0 <= ks) & (ks <= ke) & (ke <= kv_lens[req])).all()
    # No wasted work: a chunk lies within what the tile's last row may see, and is empty
    # only when the whole tile sees nothing (then it is the tile's only item).
    ext = visible_end(qo_len[req], kv_lens[req], (r0 + nr - 1) // g, plan.causal)
    assert (ke <= ext).all()
    assert ((ks < ke) | ((ext == 0) & (w[:, ws.W_NUM_CHUNKS] == 1))).all()

    # Tiles partition every (request, kv head)'s packed rows.
    tiles = np.unique(np.stack([req, head, r0, nr], 1), axis=0)
    want = sum(int(-(-int(q) * g // tile)) for q in qo_len) * hk
    assert tiles.shape[0] == want, (tiles.shape[0], want)
    full = tiles[:, 3] == np.minimum(tile, qo_len[tiles[:, 0]] * g - tiles[:, 2])
    assert full.all()

    # Exact cover: for every (request, kv head, packed row), the visible parts of its items'
    # kv ranges tile [0, visible end) without overlap.
    rows_per = nr
    it = np.repeat(np.arange(n), rows_per)
    row = r0[it] + (np.arange(it.shape[0]) - np.repeat(np.cumsum(rows_per) - rows_per, rows_per))
    v = visible_end(qo_len[req[it]], kv_lens[req[it]], row // g, plan.causal)
    s, e = ks[it], np.minimum(ke[it], v)
    e = np.maximum(e, s)
    key = (req[it] * hk + head[it]) * (int(qo_len.max(initial=0)) * g + 1) + row
    o = np.lexsort((s, key))
    ko, so, eo = key[o], s[o], e[o]
    same = ko[1:] == ko[:-1]
    assert (so[1:][same] >= eo[:-1][same]).all(), "overlapping kv ranges for a row"
    tot = np.bincount(np.unique(ko, return_inverse=True)[1], weights=eo - so)
    uk, first = np.unique(ko, return_index=True)
    assert np.array_equal(tot, v[o][first]), "a row's visible kv is not covered exactly"
    assert uk.shape[0] == sum(int(q) * g for q in qo_len) * hk, "a row has no item"

    # Destinations: unsplit -> -1; split -> a slot owned by one item, merged by one task
    # whose contiguous slot run lists the chunks in chunk order.
    nch, ch = w[:, ws.W_NUM_CHUNKS], w[:, ws.W_CHUNK]
    assert ((nch == 1) == (dest == -1)).all() and ((ch >= 0) & (ch < nch)).all()
    pair_tile = np.stack([req, head, r0], 1)
    _, inv, cnt = np.unique(pair_tile, axis=0, return_inverse=True, return_counts=True)
    assert (cnt[inv.reshape(-1)] == nch).all(), "NUM_CHUNKS disagrees with the items of a tile"
    used = dest[dest >= 0]
    nslots = plan.num_partial_slots
    assert np.unique(used).shape[0] == used.shape[0] == nslots and (used < nslots).all()
    mslots = np.zeros(nslots, np.int64) - 1
    for j, t in enumerate(m):
        a, k = t[ws.M_SLOT_START], t[ws.M_NUM_SLOTS]
        assert k >= 2 and (mslots[a : a + k] == -1).all() and a + k <= nslots
        mslots[a : a + k] = j
    assert (mslots >= 0).all() or nslots == 0
    sel = dest >= 0
    task = mslots[dest[sel]]
    mt = m[task]
    assert (mt[:, ws.M_REQ] == req[sel]).all() and (mt[:, ws.M_KV_HEAD] == head[sel]).all()
    assert (mt[:, ws.M_ROW_START] == r0[sel]).all() and (mt[:, ws.M_NUM_ROWS] == nr[sel]).all()
    assert (mt[:, ws.M_QO_OFFSET] == qo_indptr[req[sel]]).all()
    assert (dest[sel] == mt[:, ws.M_SLOT_START] + ch[sel]).all(), "merge order is not chunk order"
    assert (mt[:, ws.M_NUM_SLOTS] == nch[sel]).all()

    # Modelled CTA costs.
    cost = alpha * tile + beta * (ke - ks)
    cta = np.repeat(np.arange(nc), np.diff(ip))
    assert np.array_equal(np.bincount(cta, weights=cost, minlength=nc).astype(np.int64), plan.cta_cost.astype(np.int64))
    return cost, cta
