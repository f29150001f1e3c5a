"""The planner's fast path (``sched.fast``, one query tile per request) against the general one:
valid work lists (``verify_plan``), deterministic, the LPT bound, and balance, merges and items
per CTA at least as good over many random decode batches (batch 1..1024, kv lengths incl. 0 and
1, page sizes 1 / 16 / 64, several grids, head counts, head packings and cost models)."""

import numpy as np
import pytest

from cute_attn.sched import Limits, Planner
from cute_attn.sched.check import verify_plan

BATCHES = (1, 2, 3, 5, 8, 16, 32, 64, 100, 128, 256, 512, 1024)
# (SMs, CTAs per SM, alpha, balance_tol, qo heads, kv heads): the H200 decode grid and cost
# model first, then the planner's defaults, head counts without GQA, grids whose CTA count the
# kv heads do not divide (no head groups), and tol 0 (split whenever it helps)
CONFIGS = [
    (132, 2, 8, 0.01, 32, 8),
    (132, 1, 2, 0.05, 32, 8),
    (132, 2, 8, 0.01, 8, 8),
    (16, 1, 2, 0.05, 8, 2),
    (7, 2, 2, 0.0, 4, 4),
    (100, 1, 8, 0.01, 64, 8),
]


def _lengths(rng, b):
    kind = rng.integers(0, 5)
    if kind == 0:  # uniform
        x = rng.integers(1, 4097, b)
    elif kind == 1:  # lognormal (ShareGPT-like)
        x = np.clip(rng.lognormal(7, 1, b), 1, 32768).astype(np.int64)
    elif kind == 2:  # heavy tail
        x = np.minimum(64 * rng.zipf(1.4, b), 131072)
    elif kind == 3:  # one long request among short ones
        x = rng.integers(64, 1025, b)
        x[rng.integers(0, b)] = 65536
    else:  # empty and one-token requests
        x = rng.integers(0, 4097, b)
        x[rng.random(b) < 0.3] = 0
        x[rng.random(b) < 0.1] = 1
    return x


def _score(p, per_item):
    """``Planner._score``: the busiest CTA + the merge pass."""
    return int(p.cta_cost.max()) + per_item * (-(-p.num_merge_tasks // p.num_ctas))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_fast_path_valid_and_as_balanced_as_the_general_one(cfg):
    sms, per_sm, alpha, tol, hq, hk = cfg
    rng = np.random.default_rng(sum(cfg[:3]) + hq)
    lim = Limits(
        max_batch=1024,
        max_total_q_tokens=1024,
        num_qo_heads=hq,
        num_kv_heads=hk,
        head_dim=128,
        max_qo_len=1,
        max_partial_rows=8 * sms * per_sm * 16,
    )
    kw = dict(alpha=alpha, balance_tol=tol, pin_memory=False)
    fast, general = Planner(lim, sms, per_sm, **kw), Planner(lim, sms, per_sm, fast_path=False, **kw)
    ratios, merges, per_cta = [], [], []
    for _ in range(60):
        b = int(rng.choice(BATCHES))
        kv = _lengths(rng, b)
        h = int(rng.choice([h for h in (1, 2, 4) if hk % h == 0 and h * hq // hk <= 16]))
        pkw = dict(page_size=int(rng.choice([1, 16, 64])), cta_tile_q=16, heads_per_item=h)
        qi = np.arange(b + 1)
        pf = fast.plan(None, kv, **pkw)
        pg = general.plan(qi, kv, **pkw)
        cost, _ = verify_plan(pf, qi, kv, hk // h, alpha=alpha / h)
        loads = pf.cta_cost
        assert loads.max() <= loads.mean() + cost.max() + 1e-6  # the LPT bound
        again = Planner(lim, sms, per_sm, **kw).plan(qi, kv, **pkw)  # fresh caches, qo_indptr given
        for f in ("work_items", "work_indptr", "merge_tasks", "meta", "cta_cost"):
            assert getattr(pf, f).tobytes() == getattr(again, f).tobytes(), f
        per_item = alpha * 16 // h
        ratios.append(_score(pf, per_item) / _score(pg, per_item))
        merges.append((pf.num_merge_tasks, pg.num_merge_tasks))
        per_cta.append((np.diff(pf.work_indptr).max(), np.diff(pg.work_indptr).max()))
    ratios, merges, per_cta = np.array(ratios), np.array(merges), np.array(per_cta)
    # modelled makespan: as good on average, never much worse
    assert ratios.mean() <= 1.005 and ratios.max() <= 1.05, (ratios.mean(), ratios.max())
    assert merges[:, 0].sum() <= 1.1 * merges[:, 1].sum() + 8, merges.sum(0)
    assert per_cta[:, 0].mean() <= per_cta[:, 1].mean(), per_cta.mean(0)


def test_fast_path_h200_decode_balance():
    """The H200 decode grid (132 SMs x 2 CTAs, alpha 8, tol 0.01, 32 / 8 heads, page 16) at the
    engines' batch sizes, lengths uniform in [1, 4096] (``scripts/bench_plan_host.py``): the
    fast path's modelled makespan stays within 1 % of the general path's on average and its
    busiest CTA holds no more items."""
    lim = Limits(
        max_batch=1024,
        max_total_q_tokens=1024,
        num_qo_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_qo_len=1,
        max_partial_rows=8 * 264 * 16,
    )
    kw = dict(alpha=8, balance_tol=0.01, pin_memory=False)
    fast, general = Planner(lim, 132, 2, **kw), Planner(lim, 132, 2, fast_path=False, **kw)
    rng = np.random.default_rng(0)
    for b, h in ((64, 1), (256, 2), (1024, 4)):
        r = []
        for _ in range(8):
            kv = rng.integers(1, 4097, b)
            pkw = dict(page_size=16, cta_tile_q=16, heads_per_item=h)
            pf, pg = fast.plan(None, kv, **pkw), general.plan(np.arange(b + 1), kv, **pkw)
            verify_plan(pf, np.arange(b + 1), kv, 8 // h, alpha=8 / h)
            r.append(_score(pf, 128 // h) / _score(pg, 128 // h))
            assert np.diff(pf.work_indptr).max() <= np.diff(pg.work_indptr).max()
        assert np.mean(r) <= 1.01, (b, r)


def test_decode_qo_indptr_none_is_arange():
    """``plan(None, kv_lens)`` (the decode wrappers' call) is ``plan(arange(batch + 1), kv_lens)``,
    fast path or not, and validates the lengths the same way."""
    lim = Limits(max_batch=64, max_total_q_tokens=64, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    kv = np.random.default_rng(1).integers(0, 3000, 40)
    for fast_path in (True, False):
        pl = Planner(lim, 12, fast_path=fast_path, pin_memory=False)
        a, b = pl.plan(np.arange(41), kv, page_size=16), pl.plan(None, kv, page_size=16)
        for f in ("work_items", "work_indptr", "merge_tasks", "meta", "cta_cost"):
            assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), f
        with pytest.raises(ValueError, match="kv_lens"):
            pl.plan(None, np.array([3, -1]))
        with pytest.raises(ValueError, match="max_batch"):
            pl.plan(None, np.ones(65, np.int64))
