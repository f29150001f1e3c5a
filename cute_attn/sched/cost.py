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

Tile size rule (``choose_cta_tile_q``, the FlashInfer paper's): from the mean packed query
length over the requests with queries, p = sum(qo_len * group) / #requests: 16 if p <= 16
(decode-like: group heads of one or a few tokens), 32 if p <= 32, 64 if p <= 64, else 128.
A kernel maps it onto the tiles it is built for (the smallest that holds it; the Hopper
prefill's are 64 and 128). The caller may force any multiple of 16 up to 256.

Shortest chunk rule (``min_chunk_len``): a cut never leaves a kv chunk shorter than

    m = round_up_to_page(clamp(share // MIN_CHUNK_SHARE_DIV, lo, hi)),
    hi = Planner(min_kv_chunk=...) (default 256), lo = min(hi, max(page_size, MIN_CHUNK_FLOOR = 64))

where ``share`` is one CTA's fair share of the batch in kv tokens. Why: the wrap-around
split (``assign.wrap_fill``) moves a CTA boundary off a cut that would leave a piece
shorter than m, to the item's edge; that can overload a CTA by about m / 2 tokens, and
m <= share / 32 keeps it within ~2 % of a CTA's load (more for shares under ~2 k tokens,
where the floor rules). The former fixed 256 tokens was 10-25 % of the share of a small
batch (16 decode requests x a few k tokens over 132 CTAs), and such batches were left
7-15 % out of balance. The floor keeps chunks from getting tiny: a chunk still pays the
whole per-item cost (loading the query tile, writing and merging a partial), and short kv
loops run the kernel's pipeline badly. ``hi`` keeps batches with a large share from being
cut finer than before. An explicit ``min_kv_chunk`` below the floor is honoured (then m =
min_kv_chunk rounded up to a page).
"""

from __future__ import annotations

import numpy as np

from .assign import ids, lpt_assign, zeros

MIN_CHUNK_SHARE_DIV = 32  # m <= share / 32 (see the module doc)
MIN_CHUNK_FLOOR = 64  # ... but never below max(page_size, 64) tokens (unless min_kv_chunk is)


def min_chunk_len(share: int, page_size: int, min_kv_chunk: int) -> int:
    """Shortest kv chunk a cut may leave, for a fair share of ``share`` kv tokens per CTA
    (module doc). Always >= min(min_kv_chunk, max(page_size, MIN_CHUNK_FLOOR)) and a page
    multiple; <= min_kv_chunk rounded up to a page."""
    hi = max(int(min_kv_chunk), 1)
    lo = min(hi, max(page_size, MIN_CHUNK_FLOOR))
    m = min(max(int(share) // MIN_CHUNK_SHARE_DIV, lo), hi)
    return -(-m // page_size) * page_size


def choose_cta_tile_q(total_packed_rows: int, num_requests_with_q: int) -> int:
    if num_requests_with_q == 0:
        return 16
    p = -(-total_packed_rows // num_requests_with_q)
    return 16 if p <= 16 else 32 if p <= 32 else 64 if p <= 64 else 128


def build_tiles(qo_len, kv_len, group: int, tile: int, causal: bool, qo_min=None, qo_max=None):
    """Query tiles of every request: (request, first packed row, rows, kv extent, whether
    it is exactly one tile per request in request order). ``qo_min`` / ``qo_max``: min and
    max of qo_len when the caller has them already.

    Packed row r of a request is query token r // group of qo head kv_head * group +
    r % group. A causal row of token i sees kv [0, kv_len - qo_len + i]; a tile loads up to
    its last row's limit.
    """
    b = qo_len.shape[0]
    if b:
        if qo_min is None:
            qo_min, qo_max = int(qo_len.min()), int(qo_len.max())
        if qo_min >= 1 and qo_max * group <= tile:  # one tile per request (decode-like)
            # (causal or not: the tile's last row is the request's last token, it sees all kv)
            return ids(b), zeros(b), qo_len * group, kv_len, True
    packed = qo_len * group
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


def chunk_counts(ext, chunk: int, absorb_below: int = 0):
    """Chunks per tile when cutting at multiples of ``chunk`` (at least one per tile). A
    last piece shorter than ``absorb_below`` joins the one before it (no tiny chunk)."""
    if not absorb_below:
        return np.maximum(-(-ext // chunk), 1)
    q, r = np.divmod(ext, chunk)
    n = q + (r > 0)
    n -= (r > 0) & (r < absorb_below) & (q >= 1)
    return np.maximum(n, 1)


def pieces(ext, n, chunk: int):
    """(tile index, chunk index, kv start, kv end) of every chunk, tile-major."""
    t = np.repeat(np.arange(ext.shape[0]), n)
    first = np.cumsum(n) - n
    c = np.arange(t.shape[0]) - first[t]
    start = c * chunk
    end = np.where(c == n[t] - 1, ext[t], start + chunk)
    return t, c, start, end


def cut_schedule(ext, chunk, per_item, beta, heads, num_ctas, absorb_below: int = 0):
    """Cut every tile at multiples of ``chunk`` (a last piece shorter than
    ``absorb_below`` joins the one before it), sort the chunks by cost (largest first,
    stable), LPT-assign chunks x heads (item i is chunk order[i // heads] for head i %
    heads). Returns (n, t, c, start, end, order, cta, loads, item_cost). Batch-invariant
    mode (no absorbing) and the pre-cut candidate of the split path."""
    n = chunk_counts(ext, chunk, absorb_below)
    t, c, start, end = pieces(ext, n, chunk)
    cost = per_item + beta * (end - start)
    order = np.argsort(-cost, kind="stable")
    item_cost = np.repeat(cost[order], heads)  # the heads of a chunk cost the same
    cta, loads = lpt_assign(item_cost, num_ctas)
    return n, t, c, start, end, order, cta, loads, item_cost
