"""Tiles, their costs, and how they are cut into kv chunks.

Cost model (integer, so plans are exactly reproducible)::

    cost(item) = alpha * cta_tile_q + beta * (kv_end - kv_start)

``alpha * cta_tile_q`` is what an item costs regardless of its kv length (loading the
query tile, writing the output or partial tile, filling the pipeline); ``beta`` per kv
token. Defaults alpha = 2, beta = 1: FlashInfer's 2 * l_q + l_kv, with l_q the tile the
kernel computes. The tile size is one value per plan, so within a plan the model weighs kv
tokens against a fixed per-item overhead -- and that overhead is what makes splitting a
tile into more chunks cost something. A causal tile is charged for the kv it loads: its
extent up to its last row's diagonal, not the triangle it computes.

Tile size rule (``choose_cta_tile_q``): from the mean packed query length over the
requests with queries, p = sum(qo_len * group) / #requests: 16 if p <= 16 (decode-like:
group heads of one or a few tokens), 64 if p <= 64, else 128. The caller may force any
multiple of 16 up to 256.
"""
from __future__ import annotations

import numpy as np

from .assign import lpt_assign


def choose_cta_tile_q(total_packed_rows: int, num_requests_with_q: int) -> int:
    if num_requests_with_q == 0:
        return 16
    p = -(-total_packed_rows // num_requests_with_q)
    return 16 if p <= 16 else 64 if p <= 64 else 128


def build_tiles(qo_len, kv_len, group: int, tile: int, causal: bool):
    """Query tiles of every request: (request, first packed row, rows, kv extent, whether
    it is exactly one tile per request in request order).

    Packed row r of a request is query token r // group of qo head kv_head * group +
    r % group. A causal row of token i sees kv [0, kv_len - qo_len + i]; a tile loads up to
    its last row's limit.
    """
    packed = qo_len * group
    b = qo_len.shape[0]
    if b and packed.max() <= tile and qo_len.min() >= 1:  # one tile per request (decode-like)
        rows = packed
        # (causal or not: the tile's last row is the request's last token, it sees all kv)
        return np.arange(b), np.zeros(b, np.int64), rows, kv_len, True
    else:
        ntiles = (packed + tile - 1) // tile
        req = np.repeat(np.arange(b), ntiles)
        first = np.cumsum(ntiles) - ntiles
        row0 = (np.arange(req.shape[0]) - first[req]) * tile
        rows = np.minimum(packed[req] - row0, tile)
    kl = kv_len[req]
    if causal:
        last_tok = (row0 + rows - 1) // group
        ext = np.clip(kl - qo_len[req] + last_tok + 1, 0, kl)
    else:
        ext = kl
    return req, row0, rows, ext, False


def chunk_counts(ext, chunk: int, absorb_below: int):
    """Chunks per tile when cutting at multiples of ``chunk`` (0: no cut). A last piece
    shorter than ``absorb_below`` joins the one before it, so no chunk is tiny."""
    if chunk == 0:
        return np.ones(ext.shape[0], np.int64)
    q, r = np.divmod(ext, chunk)
    n = q + (r > 0)
    if absorb_below:
        n -= (r > 0) & (r < absorb_below) & (q >= 1)
    return np.maximum(n, 1)


def pieces(ext, n, chunk: int):
    """(tile index, chunk index, kv start, kv end) of every chunk, tile-major."""
    if chunk == 0:
        t = np.arange(ext.shape[0])
        return t, np.zeros_like(t), np.zeros_like(t), ext
    t = np.repeat(np.arange(ext.shape[0]), n)
    first = np.cumsum(n) - n
    c = np.arange(t.shape[0]) - first[t]
    start = c * chunk
    end = np.where(c == n[t] - 1, ext[t], start + chunk)
    return t, c, start, end


def fair_chunk(ext, *, per_item: int, beta: int, heads: int, num_ctas: int, page_size: int,
               min_chunk: int) -> int:
    """Max kv chunk length: the kv tokens whose chunk costs one CTA's fair share of the
    unsplit total, ``(total / num_ctas - per_item) / beta``, rounded down to a page
    multiple and never below ``min_chunk`` rounded up to a page; 0 (no cut) when no tile is
    longer. Finer balance is left to split-to-fit, which cuts only where it pays."""
    if ext.shape[0] == 0:
        return 0
    total = heads * (ext.shape[0] * per_item + beta * int(ext.sum()))
    share = (total / num_ctas - per_item) / beta
    floor = -(-max(min_chunk, 1) // page_size) * page_size
    chunk = max(floor, int(share) // page_size * page_size)
    return chunk if chunk < int(ext.max()) else 0


def schedule(ext, chunk, absorb_below, per_item, beta, heads, num_ctas):
    """Cut, sort by cost (largest first, stable), LPT-assign. Returns a dict of arrays."""
    if chunk == 0:  # no cut: one chunk per tile (the common decode case, kept lean)
        cost = beta * ext + per_item
        order = np.argsort(-cost, kind="stable")
        item_cost = np.repeat(cost[order], heads)
        cta, loads = lpt_assign(item_cost, num_ctas)
        nt = ext.shape[0]
        return dict(chunk=0, n=None, t=None, c=None, start=None, end=ext, order=order, cta=cta,
                    loads=loads, cost=item_cost, nt=nt)
    n = chunk_counts(ext, chunk, absorb_below)
    t, c, start, end = pieces(ext, n, chunk)
    cost = per_item + beta * (end - start)
    order = np.argsort(-cost, kind="stable")
    item_cost = np.repeat(cost[order], heads)  # the heads of a chunk cost the same
    cta, loads = lpt_assign(item_cost, num_ctas)
    return dict(chunk=chunk, n=n, t=t, c=c, start=start, end=end, order=order, cta=cta,
                loads=loads, cost=item_cost, nt=ext.shape[0])


def full(s):
    """The chunk arrays of a schedule made without a cut (filled in lazily)."""
    if s["n"] is None:
        nt = s["nt"]
        s["n"] = np.ones(nt, np.int64)
        s["t"] = np.arange(nt)
        s["c"] = np.zeros(nt, np.int64)
        s["start"] = np.zeros(nt, np.int64)
    return s
