"""Scheduler properties (CPU only): exact cover, LPT bound, determinism, fixed workspace
offsets, batch invariance, input validation, upload without device synchronization."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cute_attn.sched import Limits, Planner, WorkspaceLayout, kv_lens_from_paged, kv_lens_from_ragged
from cute_attn.sched import workspace as ws
from cute_attn.sched.assign import Snake, lpt_assign, refine_pairs, wrap_fill
from cute_attn.sched.check import verify_plan
from cute_attn.sched.cost import MIN_CHUNK_FLOOR, build_tiles, min_chunk_len
from cute_attn.sched.locality import TAIL_ROUNDS, request_major_order, request_rounds, round_deal

LIM = Limits(
    max_batch=48, max_total_q_tokens=4096, num_qo_heads=8, num_kv_heads=4, head_dim=64, max_partial_rows=1 << 18
)
SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    b = draw(st.integers(0, 24))
    kind = draw(st.sampled_from(["decode", "mixed", "prefill"]))
    if kind == "decode":
        q = [1] * b
    else:
        q = draw(st.lists(st.integers(0, 64 if kind == "mixed" else 160), min_size=b, max_size=b))
    kv = draw(
        st.lists(st.one_of(st.integers(0, 2), st.integers(0, 3000), st.integers(0, 60000)), min_size=b, max_size=b)
    )
    if draw(st.booleans()) and b:  # causal needs kv >= q only for bottom-right rows to see keys
        kv = [max(k, x) for k, x in zip(kv, q)]
    hk = draw(st.sampled_from([1, 2, 4]))
    hq = hk * draw(st.sampled_from([1, 2]))
    return dict(
        q=np.array(q, np.int64),
        kv=np.array(kv, np.int64),
        hq=hq,
        hk=hk,
        causal=draw(st.booleans()),
        page=draw(st.sampled_from([1, 16, 64])),
        sms=draw(st.integers(1, 40)),
        per_sm=draw(st.sampled_from([1, 2])),
        tile=draw(st.sampled_from([None, None, 16, 64, 128])),
        min_chunk=draw(st.sampled_from([16, 256])),
        tol=draw(st.sampled_from([0.05, 0.05, 0.0])),
    )  # 0: split whenever it helps


def _plan(d, planner=None, **kw):
    pl = planner or Planner(LIM, d["sms"], d["per_sm"], min_kv_chunk=d["min_chunk"], balance_tol=d["tol"])
    qi = np.r_[0, np.cumsum(d["q"])]
    p = pl.plan(
        qi,
        d["kv"],
        causal=d["causal"],
        page_size=d["page"],
        num_qo_heads=d["hq"],
        num_kv_heads=d["hk"],
        cta_tile_q=d["tile"],
        **kw,
    )
    return pl, qi, p


@SETTINGS
@given(batches())
def test_exact_cover_bound_and_determinism(d):
    pl, qi, p = _plan(d)
    cost, _ = verify_plan(p, qi, d["kv"], d["hk"])  # exact cover, merge lists, costs
    if cost.shape[0]:
        loads = p.cta_cost
        assert loads.max() <= loads.mean() + cost.max() + 1e-6  # the LPT bound
    # Same lengths -> byte-identical plan, also from a fresh planner.
    _, _, p2 = _plan(d)
    for f in ("work_items", "work_indptr", "merge_tasks", "meta", "cta_cost"):
        assert getattr(p, f).tobytes() == getattr(p2, f).tobytes(), f
    # Chunks are page-aligned where cut (a start is 0, a page multiple, or where a tile was
    # cut at a non-aligned position that is its own end -- which never starts a chunk).
    starts = p.work_items[:, ws.W_KV_START]
    assert (starts % d["page"] == 0).all()
    # Cut chunks are never shorter than the plan's minimum, itself never below the floor.
    w = p.work_items
    cut = w[:, ws.W_NUM_CHUNKS] > 1
    if cut.any():
        m = p.min_kv_chunk
        assert m % d["page"] == 0 and m >= min(d["min_chunk"], max(d["page"], MIN_CHUNK_FLOOR))
        assert (w[cut, ws.W_KV_END] - w[cut, ws.W_KV_START] >= m).all()


@SETTINGS
@given(batches(), st.integers(1, 3000))
def test_batch_invariant_mode(d, split):
    """With a fixed split size, request 0's items and merge order do not depend on the rest."""
    if d["q"].shape[0] == 0 or d["q"][0] == 0:
        return
    tile = d["tile"] or 64
    base = dict(d, tile=tile)
    alone = dict(base, q=d["q"][:1], kv=d["kv"][:1])
    rng = np.random.default_rng(int(split))
    others = rng.permutation(d["q"].shape[0] - 1) + 1
    mixed = dict(base, q=np.r_[d["q"][others], d["q"][:1]], kv=np.r_[d["kv"][others], d["kv"][:1]])
    mine = []
    for case, idx in ((alone, 0), (mixed, len(others))):
        try:
            pl, qi, p = _plan(case, kv_split_size=split)
        except ValueError as e:  # more chunks than the workspace holds: a clear error
            assert "partial slots" in str(e)
            assume(False)
        verify_plan(p, qi, case["kv"], case["hk"])
        w = p.work_items[p.work_items[:, ws.W_REQ] == idx]
        key = np.lexsort((w[:, ws.W_CHUNK], w[:, ws.W_ROW_START], w[:, ws.W_KV_HEAD]))
        cols = [
            ws.W_KV_HEAD,
            ws.W_ROW_START,
            ws.W_NUM_ROWS,
            ws.W_KV_START,
            ws.W_KV_END,
            ws.W_QO_LEN,
            ws.W_KV_LEN,
            ws.W_CHUNK,
            ws.W_NUM_CHUNKS,
        ]
        mine.append((w[key][:, cols], (w[key][:, ws.W_DEST] >= 0), p.cta_tile_q))
        # Chunks sit at multiples of the split size; merge order = chunk order = kv order.
        assert (w[:, ws.W_KV_START] == w[:, ws.W_CHUNK] * split).all()
    assert np.array_equal(mine[0][0], mine[1][0]) and np.array_equal(mine[0][1], mine[1][1])
    assert mine[0][2] == mine[1][2]


def test_batch_invariant_tile_from_limits():
    lim = Limits(max_batch=8, max_total_q_tokens=512, num_qo_heads=4, num_kv_heads=4, head_dim=64, max_qo_len=1)
    p = Planner(lim, 8).plan([0, 1, 2], [100, 5000], kv_split_size=512)
    assert p.cta_tile_q == 16  # decode wrapper: max_qo_len 1 -> 16, whatever the batch


def test_skew_is_split_and_balanced():
    lim = Limits(max_batch=64, max_total_q_tokens=64, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132)
    kv = np.full(64, 300)
    kv[0] = 131072
    qi = np.arange(65)
    p = pl.plan(qi, kv, page_size=16)
    verify_plan(p, qi, kv, 8)
    assert p.has_split and p.cta_cost.max() / p.cta_cost.mean() < 1.05


def test_workspace_offsets_fixed_and_aligned():
    pl = Planner(LIM, 20, 2)
    lay = pl.layout
    assert lay == WorkspaceLayout(LIM, 40)
    offs = [o for o, _ in lay.sections.values()]
    assert all(o % 256 == 0 for o in offs) and offs == sorted(offs)
    for (o1, n1), (o2, _) in zip(list(lay.sections.values())[:-1], list(lay.sections.values())[1:]):
        assert o1 + n1 <= o2
    assert lay.int_bytes == lay.offset("partial_lse") and lay.total_bytes >= lay.int_bytes
    before = dict(lay.sections)
    rng = np.random.default_rng(0)
    for _ in range(20):  # any batch within the limits fits the fixed sections
        b = int(rng.integers(0, LIM.max_batch + 1))
        q = rng.multinomial(int(rng.integers(0, LIM.max_total_q_tokens + 1)), np.ones(b) / b) if b else []
        qi = np.r_[0, np.cumsum(q)]
        kv = rng.integers(0, 200000, b)
        p = pl.plan(qi, kv, causal=bool(rng.integers(2)), cta_tile_q=16)
        assert p.num_work_items <= lay.max_work_items and p.num_merge_tasks <= lay.max_merge_tasks
        assert p.num_partial_slots * p.cta_tile_q <= lay.max_partial_rows
        assert pl.layout.sections == before


def test_upload_layout_and_no_sync(monkeypatch):
    """CPU inputs: nothing reads a device; the staged bytes land at the fixed offsets."""
    pl = Planner(LIM, 6)
    for name in ("synchronize", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail(f"torch.cuda.{name} called"))
    monkeypatch.setattr(torch.Tensor, "item", lambda *a: pytest.fail(".item() called"))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda *a: pytest.fail(".tolist() called"))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda *a: pytest.fail(".cpu() called"))
    wsb = torch.zeros(pl.layout.total_bytes, dtype=torch.uint8)
    qi = torch.tensor([0, 3, 4, 40], dtype=torch.int32)
    kv = torch.tensor([7, 9000, 50], dtype=torch.int32)
    p = pl.plan(qi, kv, causal=True, workspace=wsb)
    monkeypatch.undo()
    v = pl.layout.views(wsb)
    assert torch.equal(v["meta"], torch.from_numpy(p.meta))
    assert torch.equal(v["work_indptr"], torch.from_numpy(p.work_indptr))
    assert torch.equal(v["work_items"][: p.num_work_items], torch.from_numpy(p.work_items))
    assert torch.equal(v["merge_tasks"][: p.num_merge_tasks], torch.from_numpy(p.merge_tasks))
    assert int(v["meta"][ws.META_BATCH_SIZE]) == 3 and int(v["meta"][ws.META_TOTAL_QO_ROWS]) == 40


def test_staging_buffers_rotate():
    pl = Planner(LIM, 4, num_staging=2)
    a = pl.plan([0, 1], [10])
    a_bytes = [getattr(a, f).tobytes() for f in ("work_items", "work_indptr", "meta", "cta_cost")]
    b = pl.plan([0, 1, 2], [10, 20])
    w1, w2 = (
        torch.zeros(pl.layout.total_bytes, dtype=torch.uint8),
        torch.zeros(pl.layout.total_bytes, dtype=torch.uint8),
    )
    pl.upload(w2)  # the last plan
    assert int(pl.layout.views(w2)["meta"][ws.META_NUM_WORK_ITEMS]) == b.num_work_items
    with pytest.raises(ValueError, match="workspace has"):
        pl.upload(w1[:10])
    assert a.num_work_items == 4
    for _ in range(3):  # later plans (cached tables, templates, staging) leave a Plan alone
        pl.plan([0, 1, 2, 3], [5, 6, 7])
    assert a_bytes == [getattr(a, f).tobytes() for f in ("work_items", "work_indptr", "meta", "cta_cost")]


def test_kv_lens_helpers():
    assert kv_lens_from_paged([0, 2, 2, 5], [3, 7, 16], 16).tolist() == [19, 0, 48]
    assert kv_lens_from_ragged([0, 5, 5, 12]).tolist() == [5, 0, 7]
    idx = np.arange(5)
    kv_lens_from_paged([0, 2, 5], [1, 1], 4, kv_indices=idx, num_pages_total=5)
    with pytest.raises(ValueError, match=r"kv_indices\[3\] = 9 is outside \[0, num_pages_total=5\)"):
        kv_lens_from_paged([0, 2, 5], [1, 1], 4, kv_indices=[0, 1, 2, 9, 4], num_pages_total=5)
    with pytest.raises(ValueError, match=r"last_page_len\[1\] = 0 is outside \[1, page_size=4\]"):
        kv_lens_from_paged([0, 2, 5], [1, 0], 4)
    with pytest.raises(ValueError, match=r"last_page_len\[0\] = 5"):
        kv_lens_from_paged([0, 2, 5], [5, 1], 4)
    with pytest.raises(ValueError, match="kv_indices has 3 entries"):
        kv_lens_from_paged([0, 2, 5], [1, 1], 4, kv_indices=[0, 1, 2])


@pytest.mark.parametrize(
    "args, kw, msg",
    [
        (([0, 3, 12, 9, 20], [1, 1, 1, 1]), {}, r"qo_indptr is not non-decreasing at index 3 \(12 > 9\)"),
        (([1, 3], [1]), {}, r"qo_indptr\[0\] must be 0, got 1"),
        (([0, 1, 2], [5, -1]), {}, r"kv_lens\[1\] is negative \(-1\)"),
        (([0, 1, 2], [5]), {}, r"kv_lens must have length 2, got 1"),
        (([0, 1], [2**31]), {}, r"kv_lens\[0\] = 2147483648 exceeds max_kv_len"),
        ((np.arange(50), np.ones(49, int)), {}, r"batch size 49 .* exceeds max_batch \(48\)"),
        (([0, 5000], [1]), {}, r"qo_indptr\[-1\] = 5000 query tokens exceeds max_total_q_tokens \(4096\)"),
        (([0, 1], [1]), {"num_qo_heads": 6, "num_kv_heads": 4}, r"not a multiple of num_kv_heads"),
        (([0, 1], [1]), {"num_kv_heads": 8}, r"exceed the limits"),
        (([0, 1], [1]), {"cta_tile_q": 24}, r"cta_tile_q must be a multiple of 16"),
        (([0, 1], [1]), {"page_size": 0}, r"page_size must be a positive int"),
        (([0, 1], [1]), {"kv_split_size": 0}, r"kv_split_size must be a positive int"),
        (([[0, 1]], [1]), {}, r"qo_indptr must be 1-D"),
        (([0.0, 1.5], [1]), {}, r"qo_indptr must hold integers"),
    ],
)
def test_validation_errors(args, kw, msg):
    with pytest.raises(ValueError, match=msg):
        Planner(LIM, 4).plan(*args, **kw)


def test_partial_capacity_error_in_invariant_mode():
    lim = Limits(max_batch=4, max_total_q_tokens=64, num_qo_heads=4, num_kv_heads=4, head_dim=64, max_partial_rows=64)
    with pytest.raises(ValueError, match="partial slots"):
        Planner(lim, 4).plan([0, 1], [100000], kv_split_size=16)


def test_empty_and_degenerate_batches():
    pl = Planner(LIM, 8)
    for qi, kv, causal in (
        ([0], [], False),
        ([0, 0, 0], [5, 0], True),
        ([0, 1, 2], [0, 0], False),
        ([0, 5], [2], True),
        ([0, 1], [1], True),
    ):
        p = pl.plan(qi, kv, causal=causal)
        verify_plan(p, qi, kv, LIM.num_kv_heads)
    p = pl.plan([0, 5], [2], causal=True)  # 5 queries, 2 keys: the first 3 rows see nothing
    assert (p.work_items[:, ws.W_DEST] == -1).all()


@given(st.integers(0, 10**7), st.sampled_from([1, 16, 64, 256]), st.integers(0, 4096))
@settings(max_examples=300, deadline=None)
def test_min_chunk_rule(share, page, cap):
    """The adaptive minimum: share / 32, never below the floor (unless min_kv_chunk is),
    never above min_kv_chunk, a page multiple, non-decreasing in the share."""
    m = min_chunk_len(share, page, cap)
    ceil_page = lambda x: -(-x // page) * page  # noqa: E731
    assert m % page == 0 and m >= 1
    assert m >= min(cap, max(page, MIN_CHUNK_FLOOR))  # the floor
    assert m <= ceil_page(max(cap, 1))
    assert m >= ceil_page(min(share // 32, max(cap, 1)))
    assert min_chunk_len(share + 1000, page, cap) >= m


@pytest.mark.parametrize("c", [1, 2, 7, 132])
def test_snake_tables(c):
    """The cached snake tables agree with sorting the snake's CTAs; loads keep the bound."""
    sn = Snake(c)
    rng = np.random.default_rng(c)
    for n in [1, c - 1, c, c + 1, 2 * c, 5 * c + 3, int(rng.integers(1, 40 * c))]:
        if n < 1:
            continue
        cta = sn.cta(n)
        assert ((cta >= 0) & (cta < c)).all()
        items, indptr = sn.cta_major(n)
        assert np.array_equal(items, np.argsort(cta, kind="stable"))
        assert np.array_equal(indptr, np.r_[0, np.cumsum(np.bincount(cta, minlength=c))])
        costs = np.sort(rng.integers(1, 1000, n))[::-1]
        loads = np.bincount(cta, costs, c)
        assert loads.max() <= loads.mean() + costs[0] + 1e-6
        assert loads.max() - loads.min() <= costs[0]


@SETTINGS
@given(
    st.lists(st.integers(0, 20000), min_size=1, max_size=60),
    st.integers(1, 40),
    st.sampled_from([0, 32, 256]),
    st.sampled_from([1, 16, 64]),
    st.sampled_from([16, 64, 256]),
)
def test_wrap_fill(ext, c, per_item, page, m):
    """Pieces tile every item in order, cuts are page-aligned and leave >= m, CTAs are
    non-decreasing, loads are the pieces' costs."""
    m = -(-m // page) * page
    ext = np.array(ext, np.int64)
    r = wrap_fill(ext, per_item=per_item, beta=1, page=page, min_chunk=m, num_ctas=c)
    if r is None:
        return
    item, start, stop, chunk, cta, loads, ncut = r
    assert (np.diff(item) >= 0).all() and (np.diff(cta) >= 0).all() and ((cta >= 0) & (cta < c)).all()
    assert np.array_equal(np.bincount(item, minlength=ext.shape[0]), ncut + 1)
    first = np.r_[True, item[1:] != item[:-1]]
    last = np.r_[item[1:] != item[:-1], True]
    assert (start[first] == 0).all() and (stop[last] == ext[item[last]]).all()
    assert (start[~first] == stop[np.flatnonzero(~first) - 1]).all()  # contiguous, in order
    assert (chunk == np.arange(item.shape[0]) - np.flatnonzero(first)[np.cumsum(first) - 1]).all()
    split = ncut[item] > 0
    assert (stop[split] - start[split] >= m).all() and (start[~first] % page == 0).all()
    assert np.array_equal(loads, np.bincount(cta, per_item + stop - start, c).astype(np.int64))


def _lengths(dist, b, rng):
    if dist == "uniform":
        return rng.integers(512, 8193, b)
    if dist == "lognormal":
        return np.clip(rng.lognormal(7.0, 1.0, b), 16, 32768).astype(np.int64)
    if dist == "zipf":
        return np.minimum(256 * rng.zipf(1.4, b), 131072)
    kv = rng.integers(64, 1025, b)
    kv[0] = 131072
    return kv


@pytest.mark.parametrize("dist", ["uniform", "lognormal", "zipf", "onelong"])
@pytest.mark.parametrize("b", [16, 64])
def test_decode_balance_targets(dist, b):
    """Issue 3's balance target on the H100/H200 grid (132 CTAs, 32/8 heads, page 16):
    max / mean CTA cost <= 1.05 on average over seeds (and <= 1.06 for each)."""
    lim = Limits(max_batch=1024, max_total_q_tokens=32768, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132)
    ratios = []
    for seed in range(10):
        kv = _lengths(dist, b, np.random.default_rng(seed))
        qi = np.arange(b + 1)
        p = pl.plan(qi, kv, page_size=16)
        verify_plan(p, qi, kv, 8)
        ratios.append(p.cta_cost.max() / p.cta_cost.mean())
    assert np.mean(ratios) <= 1.05 and max(ratios) <= 1.06, ratios


def test_uniform_decode_is_not_split():
    """Equal-ish decode items are balanced whole (snake / LPT): no partials, no merge."""
    lim = Limits(max_batch=1024, max_total_q_tokens=32768, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132)
    for b, seed in ((64, 0), (256, 1), (1024, 2)):
        kv = np.random.default_rng(seed).integers(512, 8193, b)
        p = pl.plan(np.arange(b + 1), kv, page_size=16)
        verify_plan(p, np.arange(b + 1), kv, 8)
        assert not p.has_split and p.cta_cost.max() <= 1.05 * p.cta_cost.mean()


@SETTINGS
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 40), st.integers(0, 2**31))
def test_refine_pairs(costs, c, seed):
    """Pairwise refinement never raises the busiest CTA, keeps every item on one CTA and the
    total, and (from an LPT start) the LPT bound."""
    costs = np.sort(np.array(costs, np.int64))[::-1]
    rng = np.random.default_rng(seed)
    for cta, loads in (lpt_assign(costs, c), (rng.integers(0, c, costs.shape[0]), None)):
        before = np.bincount(cta, costs, c)
        r = refine_pairs(costs, cta, c)
        if r is None:
            continue
        new, nl = r
        assert ((new >= 0) & (new < c)).all()
        assert np.array_equal(nl, np.bincount(new, costs, c).astype(np.int64))
        assert nl.sum() == costs.sum() and nl.max() < before.max()
        if loads is not None:
            assert nl.max() <= nl.mean() + costs[0] + 1e-6
        assert r[0].tobytes() == refine_pairs(costs, cta, c)[0].tobytes()  # deterministic


@pytest.mark.parametrize("dist", ["uniform", "lognormal", "zipf", "onelong"])
@pytest.mark.parametrize("b", [8, 64])
def test_prefill_balance_targets(dist, b):
    """Causal chunked prefill (qo <= 512 of the kv tail), 132 CTAs: max / mean <= 1.05 on
    average over seeds; a single small batch may stay up to ~7 % above, where cutting would
    cost more per-item overhead than it saves (the plan with the lower makespan wins)."""
    lim = Limits(max_batch=1024, max_total_q_tokens=32768, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132)
    ratios = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        kv = _lengths(dist, b, rng)
        q = np.minimum(kv, rng.integers(16, 513, b))
        qi = np.r_[0, np.cumsum(q)]
        p = pl.plan(qi, kv, causal=True, page_size=16)
        verify_plan(p, qi, kv, 8)
        ratios.append(p.cta_cost.max() / p.cta_cost.mean())
    assert np.mean(ratios) <= 1.05 and max(ratios) <= 1.07, ratios


@pytest.mark.parametrize("tol,alpha", [(0.01, 8), (0.05, 8), (0.05, 2)])
def test_lognormal_decode_few_items_per_cta_and_few_splits(tol, alpha):
    """Regression guard (H200, real decode kernel, 132 SMs x 2 CTAs, 128 lognormal decode
    requests): a plan that wrapped runs of short requests onto a few CTAs and cut items at
    every CTA boundary (1249 items, 216 merges, up to 26 items on a CTA) ran 17 % slower
    than pre-cut + LPT (1048 items, 24 merges, <= 5 per CTA), although its modelled max /
    mean was lower: every item has a fixed cost and every split partial writes + a merge.
    Such a batch must get at most 2x the mean number of items on any CTA and at most 10 %
    of its (tile, kv head) pairs split, within the balance target."""
    import random

    b = 128
    lim = Limits(
        max_batch=b,
        max_total_q_tokens=b,
        num_qo_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_qo_len=1,
        max_partial_rows=8 * 264 * 16,
    )
    pl = Planner(lim, 132, 2, balance_tol=tol, alpha=alpha, pin_memory=False)
    for seed in range(8):
        rng = random.Random(seed)
        kv = np.array([max(1, min(32768, int(rng.lognormvariate(7.0, 1.0)))) for _ in range(b)])
        qi = np.arange(b + 1)
        p = pl.plan(qi, kv, page_size=16, cta_tile_q=16)
        cost, _ = verify_plan(p, qi, kv, 8, alpha=alpha)
        per_cta = np.diff(p.work_indptr)
        assert per_cta.max() <= 2 * per_cta.mean(), (seed, per_cta.max(), per_cta.mean())
        assert p.num_merge_tasks <= 0.10 * 8 * b, (seed, p.num_merge_tasks)
        loads = p.cta_cost
        assert loads.max() <= loads.mean() + cost.max() + 1e-6  # the LPT bound
        assert loads.max() / loads.mean() <= 1.05, (seed, loads.max() / loads.mean())


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_items_ordered_for_l2_reuse(causal):
    """Dealt by cost (``locality_tol=-1``), every CTA's items run by (request, kv head), last
    tile first; dealt request-major (the default, within 2 % of balance here), the CTAs take
    one item of each round.  Either way the CTAs walk the heads roughly in step, so few heads'
    K/V are in flight at once (L2 reuse), and the plan stays a valid exact cover."""
    s, h = 8192, 16
    qo = np.array([0, s, 2 * s])
    lim = Limits(
        max_batch=2, max_total_q_tokens=2 * s, num_qo_heads=h, num_kv_heads=h, head_dim=128, max_partial_rows=128 * 132
    )
    for tol in (-1.0, 0.02):
        p = Planner(lim, 132, 1, locality_tol=tol).plan(
            qo, np.array([s, s]), causal=causal, num_qo_heads=h, num_kv_heads=h, cta_tile_q=128
        )
        verify_plan(p, qo, np.array([s, s]), h)
        w, ind = p.work_items[: p.num_work_items], p.work_indptr
        if tol < 0:
            for c in range(132):
                seg = w[ind[c] : ind[c + 1]]
                key = [(r[ws.W_REQ], r[ws.W_KV_HEAD], -r[ws.W_ROW_START]) for r in seg]
                assert key == sorted(key)
        # at the k-th item of every CTA, only a few (request, head) pairs are in use (16-32 in
        # plain dealing order)
        for k in range(int(np.diff(ind).min())):
            pairs = {(w[ind[c] + k][ws.W_REQ], w[ind[c] + k][ws.W_KV_HEAD]) for c in range(132)}
            assert len(pairs) <= 12, (tol, k, len(pairs))


@pytest.mark.parametrize("page", [1, 64])
def test_snake_deals_a_requests_near_equal_tiles_side_by_side(page):
    """MLA-like decode with 2 query tokens x 128 heads = four 64-row tiles per request, causal:
    the tiles of token 0 see one key fewer than those of token 1.  With ``order_block`` (64 kv
    tokens, the default) they count as equal, so the snake deals a request's four tiles to four
    neighbouring CTAs in the same round; in exact cost order (``order_block=1``) the token-1
    tiles of every request come first and a request's tiles land in different rounds.  Either
    way the plan is a valid exact cover with the same busiest-CTA load."""
    b, h, kv = 64, 128, 8192
    qo, kvl = np.arange(0, 2 * b + 1, 2), np.full(b, kv)
    lim = Limits(max_batch=b, max_total_q_tokens=2 * b, num_qo_heads=h, num_kv_heads=1, head_dim=512)
    plans = {}
    for blk in (64, 1):
        pl = Planner(lim, 132, 1, alpha=8, order_block=blk, locality_tol=-1)  # the MLA backends' planner
        p = pl.plan(qo, kvl, causal=True, page_size=page, num_qo_heads=h, num_kv_heads=1, cta_tile_q=64)
        verify_plan(p, qo, kvl, 1, alpha=8)
        plans[blk] = p
    assert plans[64].cta_cost.max() == plans[1].cta_cost.max()

    def ctas_of(p, q):  # the CTAs that hold request q's tiles
        cta = np.repeat(np.arange(132), np.diff(p.work_indptr))
        return sorted(set(cta[p.work_items[:, ws.W_REQ] == q].tolist()))

    for q in range(32):  # the first round: requests 0-31, each on four neighbouring CTAs
        assert ctas_of(plans[64], q) == list(range(4 * q, 4 * q + 4)), q
        c = ctas_of(plans[1], q)
        assert c[-1] - c[0] > 3, (q, c)  # exact order: its tiles in two rounds, CTAs far apart


@SETTINGS
@given(batches(), st.sampled_from([2, 4]))
def test_heads_per_item_is_the_plan_of_fewer_wider_heads(d, h):
    """heads_per_item=h: the plan of num_kv_heads / h heads of group * h packed rows, its
    per-item cost charged as alpha * tile / h (decode's head packing): byte for byte."""
    assume(d["hk"] % h == 0)
    pl = Planner(LIM, d["sms"], d["per_sm"], alpha=8, min_kv_chunk=d["min_chunk"], balance_tol=d["tol"])
    qi = np.r_[0, np.cumsum(d["q"])]
    kw = dict(causal=d["causal"], page_size=d["page"], cta_tile_q=d["tile"] or 16)
    p = pl.plan(qi, d["kv"], num_qo_heads=d["hq"], num_kv_heads=d["hk"], heads_per_item=h, **kw)
    wide = Planner(LIM, d["sms"], d["per_sm"], alpha=8 // h, min_kv_chunk=d["min_chunk"], balance_tol=d["tol"])
    want = wide.plan(qi, d["kv"], num_qo_heads=d["hq"], num_kv_heads=d["hk"] // h, **kw)
    assert p.group_size == d["hq"] // d["hk"] * h
    for f in ("work_items", "work_indptr", "merge_tasks", "meta", "cta_cost"):
        assert np.array_equal(getattr(p, f), getattr(want, f)), f
    verify_plan(p, qi, d["kv"], d["hk"] // h, alpha=8 // h)


def test_heads_per_item_errors():
    pl = Planner(LIM, 4)
    for h in (0, 3, 8, 2.0):
        with pytest.raises(ValueError, match="heads_per_item"):
            pl.plan(np.arange(3), [10, 20], num_qo_heads=8, num_kv_heads=4, heads_per_item=h)


def test_mixed_prefill_dealtrequest_major_order_for_l2_reuse():
    """A bimodal batch (a few long prompts among many short turns, causal, 16 heads): dealt in
    request-major rounds (``Planner._request_rounds``), every CTA runs its items in the global
    order (requests longest first, head by head, last tile first; the last ``TAIL_ROUNDS`` by
    cost), so the k-th items of all CTAs
    come from a few (request, head) pairs: ~9 MiB of K/V in flight at the median k, where the
    cost order (``locality_tol=-1``) interleaves ~30 pairs, ~40 MiB.  Either plan is an exact
    cover within 2 % of balance."""
    rng = np.random.default_rng(0)
    lens = np.concatenate([rng.integers(4096, 8193, 8), rng.integers(64, 513, 40)])
    rng.shuffle(lens)
    h, qo = 16, np.concatenate(([0], np.cumsum(lens)))
    lim = Limits(max_batch=48, max_total_q_tokens=int(lens.sum()), num_qo_heads=h, num_kv_heads=h, head_dim=128)
    spread = {}
    for tol in (0.02, -1):
        p = Planner(lim, 132, 1, locality_tol=tol).plan(qo, lens, causal=True, num_qo_heads=h, num_kv_heads=h,
                                                         cta_tile_q=128)  # fmt: skip
        verify_plan(p, qo, lens, h)
        loads = p.cta_cost
        assert loads.max() <= 1.02 * loads.mean()
        w, ind = p.work_items[: p.num_work_items], p.work_indptr
        rank = np.argsort(np.argsort(-lens, kind="stable"), kind="stable")
        if tol >= 0:
            for c in range(132):
                seg = w[ind[c] : ind[c + 1] - TAIL_ROUNDS]
                key = [(rank[r[ws.W_REQ]], r[ws.W_KV_HEAD], -r[ws.W_ROW_START]) for r in seg]
                assert key == sorted(key), c
        # the K/V (MiB at hd128 bf16) of the pairs at the k-th item of every CTA
        kv = []
        for k in range(int(np.diff(ind).min())):
            pairs = {}
            for c in range(132):
                r = w[ind[c] + k]
                pairs[r[ws.W_REQ], r[ws.W_KV_HEAD]] = max(pairs.get((r[ws.W_REQ], r[ws.W_KV_HEAD]), 0), r[ws.W_KV_END])
            kv.append(sum(pairs.values()) * 512 / 2**20)
        spread[tol] = float(np.median(kv))
    assert spread[0.02] <= 16 and spread[-1] >= 32, spread  # 9 vs 40 MiB; the L2 holds 50 MB


def test_round_deal():
    """Each round's largest item goes to the least-loaded CTA; every item dealt once, and
    equal rounds end level."""
    cta, loads = round_deal(np.array([5, 3, 1, 5, 3, 1]), 3)
    assert cta.tolist() == [0, 1, 2, 2, 1, 0] and loads.tolist() == [6, 6, 6]
    cost = np.random.default_rng(1).integers(1, 100, 1000)
    cta, loads = round_deal(cost, 7)
    assert np.bincount(cta, cost, 7).tolist() == loads.tolist() and loads.sum() == cost.sum()


def test_round_deal_limit_and_request_rounds_tail():
    """round_deal's limit rejects exactly the dealings whose busiest CTA passes it; and the
    request-major dealing of a uniform causal batch (2 x 8k, 16 heads: 15.5 rounds, a head's
    tiles from 66 down to 3 cost units) ends within 1 % of the mean because its last rounds go
    by cost (dealt wholly in order: 4.2 % above)."""
    cost = np.random.default_rng(2).integers(1, 100, 500)
    cta, loads = round_deal(cost, 9)
    assert round_deal(cost, 9, limit=float(loads.max()) - 1) is None
    cta2, loads2 = round_deal(cost, 9, limit=float(loads.max()))
    assert np.array_equal(cta, cta2) and np.array_equal(loads, loads2)
    lens = np.array([8192, 8192])
    req, _, _, ext, _ = build_tiles(lens, lens, 1, 128, True)
    tile_cost = ext // 128 + 2
    items, indptr, loads = request_rounds(req, tile_cost, lens, 16, 132, np.inf)
    assert sorted(items.tolist()) == list(range(ext.shape[0] * 16))
    assert loads.sum() == 16 * tile_cost.sum() and loads.max() <= 1.01 * loads.mean()
    _, in_order = round_deal(tile_cost[request_major_order(req, lens, 16) // 16], 132)
    assert in_order.max() > 1.03 * in_order.mean()


def test_equal_items_dealt_request_major_where_whole_items_would_be_kept():
    """2 x 8k non-causal, 16 heads: 2048 equal items on 132 CTAs, 15.5 rounds.  No plan of whole
    items beats 16 items on the busiest CTA (3.1 % above the mean), which ``balance_tol`` 0.05
    accepts: the request-major dealing reaches it with two heads in flight per round, the
    cost-ordered plan's busiest CTA is no lighter, so it is used although above
    ``locality_tol`` of the mean.  At ``balance_tol`` 0.02 the cost-ordered plan splits items
    to balance, and is kept (request-major does not block the split)."""
    s, h = 8192, 16
    qo, kv = np.array([0, s, 2 * s]), np.array([s, s])
    lim = Limits(max_batch=2, max_total_q_tokens=2 * s, num_qo_heads=h, num_kv_heads=h, head_dim=128)
    kw = dict(causal=False, num_qo_heads=h, num_kv_heads=h, cta_tile_q=128)
    p = Planner(lim, 132, 1).plan(qo, kv, **kw)
    verify_plan(p, qo, kv, h)
    w, ind = p.work_items[: p.num_work_items], p.work_indptr
    assert p.merge_tasks.shape[0] == 0 and int(np.diff(ind).max()) == 16
    for k in range(15):  # the k-th item of every CTA: one round, two (request, head) pairs
        pairs = {(w[ind[c] + k][ws.W_REQ], w[ind[c] + k][ws.W_KV_HEAD]) for c in range(132)}
        assert len(pairs) <= 3, (k, pairs)
    q = Planner(lim, 132, 1, balance_tol=0.02).plan(qo, kv, **kw)
    verify_plan(q, qo, kv, h)
    assert q.merge_tasks.shape[0] > 0 and q.cta_cost.max() < p.cta_cost.max()


def test_prefill_plans_read_kv_once_in_the_l2_model():
    """``scripts/plan_locality.py``'s model of the L2 (an LRU cache of 30 MB over every CTA's block
    reads in time order; it reproduces the DRAM reads Nsight Compute measured, BENCHMARKS.md
    session 39): the planner's prefill plans read each K/V block from DRAM about once on the
    bench's mixed batches and a single long prompt, where the cost-ordered plan re-read it 4-40x
    (bimodal48 5.3 GB, a 32k prompt 11.5 GB, against 0.54 / 0.27 GB once)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "scripts" / "plan_locality.py"
    spec = importlib.util.spec_from_file_location("plan_locality", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    from cute_attn.bench.prefill import bimodal_lengths

    for lens in (bimodal_lengths(), [32768]):
        once = sum(-(-n // model.TILE) for n in lens) * model.H * model.BLOCK_BYTES / 1e9
        ev, loads = model.block_reads(model.ours(lens, lens, True))
        assert model.dram_gb(ev) <= 1.1 * once and loads.max() <= 1.01 * loads.mean()
        ev, _ = model.block_reads(model.ours(lens, lens, True, locality_tol=-1.0))
        assert model.dram_gb(ev) >= 4 * once  # the model tells the orders apart
