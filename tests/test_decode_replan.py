"""Per-step decode re-plans that keep the last plan's items (``cute_attn/sched/reuse.py``).

CPU: the kept items stay a plan of the new lengths (each (request, head) pair's ranges tile
[0, kv_len) in chunk order, every field but the lengths unchanged, the modelled loads within the
bound) or the re-plan falls back to a full plan; through a CUDA-graph wrapper with the kernels
emulated, outputs match the fp64 reference over steps that grow, shrink (empty chunks), zero
and swap lengths. GPU: the same steps on the real decode kernel and merge, replayed from one
captured graph, against the fp32 reference (tolerances as tests/test_decode_gpu.py: relative
L2 2e-2 for bf16, LSE 2e-3 absolute, -inf exactly where the reference has it).
"""

from __future__ import annotations

import math
import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))

from emu_helpers import _cpu_ws, _fake_cuda, _gen, demu, paged_batch  # noqa: E402,F401

from cute_attn import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from cute_attn.decode import fast_decode_plan  # noqa: E402
from cute_attn.sched import Planner  # noqa: E402
from cute_attn.sched import workspace as ws  # noqa: E402
from cute_attn.sched.inputs import kv_lens_from_paged, step_kv_lens  # noqa: E402
from cute_attn.sched.workspace import Limits  # noqa: E402
from cute_attn.testing import paged_reference  # noqa: E402

HQ, HK, D = 8, 2, 64
BF16 = torch.bfloat16
REQUEST_FIELDS = (ws.W_REQ, ws.W_QO_OFFSET, ws.W_KV_START, ws.W_KV_END, ws.W_KV_LEN)


def _steps(rng, kv, n):
    """n successive batches from ``kv``: +1 (most steps), +0..7 and the batch re-ordered, a
    request swapped for a random one, halved lengths (chunks that become empty), a zero-length
    request."""
    out = []
    for t in range(n):
        kv = kv.copy()
        r = t % 5
        if r == 0:
            kv += 1
        elif r == 1:
            kv = rng.permutation(kv + rng.integers(0, 8, size=kv.shape[0]))
        elif r == 2:
            kv[rng.integers(kv.shape[0])] = rng.integers(0, 6000)
        elif r == 3:
            kv //= 2
        else:
            kv[rng.integers(kv.shape[0])] = 0
        out.append(kv)
    return out


def _check_kept(full, got, kv):
    """``got`` (a kept plan of ``full``) serves lengths ``kv``: the module doc's contract."""
    w0, w = full.work_items, got.work_items
    other = [f for f in range(ws.WORK_FIELDS) if f not in REQUEST_FIELDS]
    assert np.array_equal(w0[:, other], w[:, other])
    assert np.array_equal(got.work_indptr, full.work_indptr)
    assert np.array_equal(w[:, ws.W_KV_LEN], kv[w[:, ws.W_REQ]])
    assert np.array_equal(w[:, ws.W_QO_OFFSET], w[:, ws.W_REQ])
    # every request is served by the items of exactly one request of the full plan
    m = {}
    for r0, r in zip(w0[:, ws.W_REQ].tolist(), w[:, ws.W_REQ].tolist()):
        assert m.setdefault(r0, r) == r
    assert sorted(m.values()) == list(range(kv.shape[0]))
    mt0, mt = full.merge_tasks, got.merge_tasks
    assert mt0.shape == mt.shape
    keep = [f for f in range(ws.MERGE_FIELDS) if f not in (ws.M_REQ, ws.M_QO_OFFSET)]
    assert np.array_equal(mt0[:, keep], mt[:, keep])
    assert [m[r] for r in mt0[:, ws.M_REQ].tolist()] == mt[:, ws.M_REQ].tolist()
    assert np.array_equal(mt[:, ws.M_QO_OFFSET], mt[:, ws.M_REQ])
    pairs = {}
    for row in w:
        pairs.setdefault((int(row[ws.W_REQ]), int(row[ws.W_KV_HEAD])), []).append(row)
    for (b, _h), rows in pairs.items():
        rows.sort(key=lambda r: int(r[ws.W_CHUNK]))
        assert [int(r[ws.W_CHUNK]) for r in rows] == list(range(int(rows[0][ws.W_NUM_CHUNKS])))
        # exactly one chunk starts at kv 0: a variant's once-per-row term (sinks) goes there
        assert sum(int(r[ws.W_KV_START]) == 0 for r in rows) == 1
        pos = 0
        for r in rows:
            assert int(r[ws.W_KV_START]) == pos <= int(r[ws.W_KV_END])
            pos = int(r[ws.W_KV_END])
        assert pos == kv[b]


@pytest.mark.parametrize("batch, hk, ctas", [(5, 2, 8), (64, 8, 264), (200, 4, 132), (1, 8, 264)])
def test_kept_items_serve_any_lengths(batch, hk, ctas):
    rng = np.random.default_rng(random.randrange(1 << 30))
    lim = Limits(max_batch=batch, max_total_q_tokens=batch, num_qo_heads=4 * hk, num_kv_heads=hk, head_dim=128)
    pl = Planner(lim, ctas, 1, alpha=2, beta=1, balance_tol=0.01)
    plan = lambda kv: pl.plan(None, kv, page_size=16, num_qo_heads=4 * hk, num_kv_heads=hk, cta_tile_q=16)
    kv0 = rng.integers(1, 5000, size=batch)
    full = plan(kv0)
    kept = fulls = 0
    for kv in _steps(rng, kv0, 60):
        got = pl.replan(kv.astype(np.int64))
        if got is None:
            full = plan(kv)
            fulls += 1
            continue
        kept += 1
        _check_kept(full, got, kv)
        loads = np.zeros(ctas, np.int64)
        cost = 2 * 16 + (got.work_items[:, ws.W_KV_END] - got.work_items[:, ws.W_KV_START]).astype(np.int64)
        np.add.at(loads, np.repeat(np.arange(ctas), np.diff(got.work_indptr)), cost)
        assert np.array_equal(loads, got.cta_cost)
    assert kept > 0  # the +1 steps at least keep the items


def test_kept_plan_refused_when_unbalanced_or_invariant():
    lim = Limits(max_batch=64, max_total_q_tokens=64, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132, 2, alpha=2, beta=1, balance_tol=0.01)
    kv = np.full(64, 2000)
    pl.plan(None, kv, page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16)
    assert pl.replan(kv + 1) is not None
    grown = kv.copy()
    grown[7] = 40000  # one request 20x the rest: the CTAs holding its items run long
    assert pl.replan(grown) is None
    assert pl.replan(kv[:63]) is None  # another batch size
    split = pl.plan(None, np.array([40000] + [10] * 63), page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16)
    assert split.num_merge_tasks > 0
    pl.keep_tol = 1e9  # balance never refuses: only the length-0 rule below does
    assert pl.replan(np.array([10] * 63 + [0])) is not None  # rank 63 (length 0) is not split
    assert pl.replan(np.zeros(64, np.int64)) is None  # rank 0 (the split one) would have length 0
    pl.plan(None, kv, page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16, kv_split_size=512)
    assert pl.replan(kv + 1) is None  # batch-invariant chunks are never stretched


def test_step_kv_lens_matches_the_checked_path():
    rng = np.random.default_rng(random.randrange(1 << 30))
    for ps in (1, 16):
        for t in range(100):
            b = int(rng.integers(1, 30))
            pages = rng.integers(0 if t % 3 == 0 else 1, 6, size=b)
            ip = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
            last = rng.integers(1, ps + 1, size=b).astype(np.int32)
            want = kv_lens_from_paged(ip, np.ones(b, np.int64) if ps == 1 else last, ps)
            got, upper = step_kv_lens(torch.from_numpy(ip), torch.from_numpy(last), ps, b)
            assert got.dtype == np.int64 and np.array_equal(got, want)
            assert upper is None or upper >= int(got.max())
    with pytest.raises(ValueError, match=r"last_page_len\[1\] = 17"):
        step_kv_lens(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([3, 17], dtype=torch.int32), 16, 2)
    with pytest.raises(ValueError, match="not non-decreasing"):
        step_kv_lens(torch.tensor([0, 4, 3], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32), 16, 2)


def _force_keep(w):
    """Make the next re-plan keep the items whatever their balance (a halving step then leaves
    empty chunks of split pairs: the case the kernels must serve)."""
    from cute_attn.sched.reuse import KeptPlan

    pl = w._planner
    if pl._kept is None:
        p, kv, per_item = pl._keep_args
        pl._kept = KeptPlan(p, kv, per_item, pl.beta, pl.balance_tol)
    pl._kept.bound = float("inf")


def _empty_split_items(plan) -> int:
    w = plan.work_items
    return int(((w[:, ws.W_KV_START] == w[:, ws.W_KV_END]) & (w[:, ws.W_NUM_CHUNKS] > 1)).sum())


def _graph_wrapper(bs, cap, make):
    bufs = dict(
        paged_kv_indptr_buffer=make(torch.zeros(bs + 1, dtype=torch.int32)),
        paged_kv_indices_buffer=make(torch.zeros(cap, dtype=torch.int32)),
        paged_kv_last_page_len_buffer=make(torch.zeros(bs, dtype=torch.int32)),
    )
    return bufs


def test_fast_decode_plan_steps_emulated(demu):
    """Steps through ``fast_decode_plan``'s per-step path: the kept items (empty chunks after
    a halving) and the full re-plans both give the reference's output."""
    bs, ps = 6, 16
    rng = np.random.default_rng(random.randrange(1 << 30))
    g = _gen(int(rng.integers(1 << 30)))
    kv0 = rng.integers(200, 3000, size=bs)
    lens = [kv0] + _steps(rng, kv0, 10)
    cap = max(int(((k + ps - 1) // ps).sum()) for k in lens) + 4
    bufs = _graph_wrapper(bs, cap, _fake_cuda)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(64), use_cuda_graph=True, **bufs)
    full_plans, empty = [], 0
    for t, kv in enumerate(lens):
        cache, indptr, indices, last = paged_batch(kv.tolist(), ps, HK, D, BF16, g)
        bufs["paged_kv_indptr_buffer"].copy_(indptr)
        bufs["paged_kv_indices_buffer"][: indices.numel()].copy_(indices)
        bufs["paged_kv_last_page_len_buffer"].copy_(last)
        if t == 0:
            w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=BF16)
            planner = w._planner
            n_full = planner.plan
            planner.plan = lambda *a, **k: full_plans.append(t) or n_full(*a, **k)
        else:
            if t % 5 == 4 and w._planner._keep_args is not None:  # the halving step of _steps
                _force_keep(w)
            fast_decode_plan(w, indptr, indices, last, HQ, HK, D, ps, q_data_type=BF16,
                             global_override_indptr_cpu=indptr)  # fmt: skip
            empty += _empty_split_items(w._state.plan)
        assert list(w._state.kv_lens) == kv.tolist()
        q = torch.randn(bs, HQ, D, generator=g).to(BF16)
        out, lse = w.run(q, cache, return_lse=True)
        ref_o, ref_lse = paged_reference(q.float(), tuple(c.float() for c in cache), None, indptr, indices, last,
                                         sm_scale=1 / math.sqrt(D))  # fmt: skip
        err = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
        assert err < 2e-2, (t, err)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3
    assert len(full_plans) < len(lens) - 1  # some steps kept the items
    assert empty > 0


@pytest.mark.gpu
def test_fast_decode_plan_steps_graph_replay(monkeypatch):
    """One captured graph replayed over steps re-planned by ``fast_decode_plan`` (kept items,
    empty chunks, full re-plans) on the real kernels; a long-batch split plan included.  The
    host-kept path: the device update is off (``test_device_kept_plans_graph_replay`` has it)."""
    monkeypatch.setattr(BatchDecodeWithPagedKVCacheWrapper, "_keep_on_device", lambda *a: None)
    hq, hk, d, ps, bs = 32, 8, 128, 16, 16
    rng = np.random.default_rng(random.randrange(1 << 30))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    kv0 = rng.integers(2000, 12000, size=bs)
    lens = [kv0] + _steps(rng, kv0, 14)
    max_pages = max(int(((k + ps - 1) // ps).sum()) for k in lens) + 8
    bufs = _graph_wrapper(bs, max_pages, lambda t: t.cuda())
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                           use_cuda_graph=True, **bufs)  # fmt: skip
    k = torch.randn(max_pages, ps, hk, d, generator=gen).to(BF16).cuda()
    v = torch.randn(max_pages, ps, hk, d, generator=gen).to(BF16).cuda()
    q = torch.randn(bs, hq, d, generator=gen).to(BF16).cuda()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((bs, hq), float("nan"), device="cuda")
    graph = None
    kept = empty = 0
    for t, kv in enumerate(lens):
        pages = (kv + ps - 1) // ps
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
        indices = torch.randperm(max_pages, generator=gen)[: int(indptr[-1])].to(torch.int32)
        last = torch.tensor(np.where(pages > 0, kv - (pages - 1) * ps, 0), dtype=torch.int32)
        bufs["paged_kv_indptr_buffer"].copy_(indptr)
        bufs["paged_kv_indices_buffer"][: indices.numel()].copy_(indices)
        bufs["paged_kv_last_page_len_buffer"].copy_(last)
        if t == 0:
            w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=BF16)
            w.run(q, (k, v), out=out, lse=lse)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, (k, v), out=out, lse=lse)
        else:
            if t % 5 == 4 and w._planner._keep_args is not None:  # the halving step of _steps
                _force_keep(w)
            fast_decode_plan(w, indptr, indices, last, hq, hk, d, ps, q_data_type=BF16,
                             global_override_indptr_cpu=indptr)  # fmt: skip
            kept += w._planner._kept is not None and w._state.plan.work_items is not w._planner._kept.records
            empty += _empty_split_items(w._state.plan)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        ref_o, ref_lse = paged_reference(q.float(), (k.float(), v.float()), None, indptr, indices, last,
                                         sm_scale=1 / math.sqrt(d))  # fmt: skip
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        err = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
        assert err < 2e-2, (t, err)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        if fin.any():
            assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3, t
        assert (out[~fin] == 0).all()
    assert kept > 0 and empty > 0


def test_step_paths_check_their_input(demu):
    """The per-step paths (fast_decode_plan's, vLLM's _cached_module.plan's) skip only the
    checks of arguments equal to the last call's: bad arrays still raise the named error before
    anything changes, and other arguments take the full path."""
    bs, ps = 4, 16
    g = _gen(random.randrange(1 << 30))
    cache, indptr, indices, last = paged_batch([100, 300, 17, 64], ps, HK, D, BF16, g)
    bufs = _graph_wrapper(bs, 64, _fake_cuda)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(64), use_cuda_graph=True, **bufs)
    w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=BF16)
    step = lambda ip, lp, **kw: fast_decode_plan(w, ip, indices, lp, HQ, HK, D, ps, q_data_type=BF16, **kw)
    step(indptr, last)
    step(indptr, last)  # the per-step path from here on
    st = w._state
    bad = last.clone()
    bad[2] = ps + 1
    with pytest.raises(ValueError, match=r"last_page_len\[2\] = 17"):
        step(indptr, bad)
    with pytest.raises(ValueError, match="not non-decreasing"):
        step(torch.tensor([0, 7, 3, 30, 35], dtype=torch.int32), last)
    with pytest.raises(ValueError, match="fixed in CUDA-graph mode"):
        step(indptr[:4], last[:3])
    assert w._state is st
    with pytest.raises(ValueError, match="differs from the first plan"):
        step(indptr, last, kv_data_type=torch.float16)  # another argument: the full path's checks
    m = w._cached_module
    args = lambda lens: (w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer,
                         torch.arange(bs + 1, dtype=torch.int32), indptr, lens, bs, bs, HQ, HK, ps, True, D, D,
                         False, -1, -1, False, 0)  # fmt: skip
    lens = torch.tensor([100, 300, 17, 64], dtype=torch.int32)
    m.plan(*args(lens))
    m.plan(*args(lens + 1))  # the per-step path
    assert list(w._state.kv_lens) == [101, 301, 18, 65]
    st = w._state
    with pytest.raises(ValueError, match=r"kv_lens\[1\] is negative"):
        m.plan(*args(torch.tensor([100, -3, 17, 64], dtype=torch.int32)))
    assert w._state is st


@pytest.mark.gpu
def test_uploads_in_stream_order_while_the_gpu_lags():
    """Plans staged and uploaded while the stream is still busy (a sleep kernel ahead of them):
    each upload lands in stream order with its own plan's bytes (a clone enqueued after each
    upload sees exactly that plan), although the host reuses the two staging buffers -- the
    third plan waits for the first one's copy (the runtime event of ``runtime.hostcopy``)."""
    lim = Limits(max_batch=64, max_total_q_tokens=64, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132, 2, alpha=8, beta=1, balance_tol=0.01, keep_tol=0.03)
    dev = torch.zeros(pl.layout.total_bytes, dtype=torch.uint8, device="cuda")  # what layout.views reads
    rng = np.random.default_rng(random.randrange(1 << 30))
    kv = rng.integers(1, 4097, size=64)
    pl.plan(None, kv, page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16)
    pl.upload(dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copies
    clones, want = [], []
    for t in range(6):
        kv = kv + 1 if t % 3 else rng.permutation(kv)
        p = pl.replan(kv.astype(np.int64))
        if p is None:
            p = pl.plan(None, kv, page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16)
        want.append((p.work_items.copy(), p.merge_tasks.copy()))
        pl.upload(dev)
        clones.append(dev.clone())
    torch.cuda.synchronize()
    for (w, m), c in zip(want, clones):
        v = pl.layout.views(c)
        assert torch.equal(v["work_items"][: w.shape[0]].cpu(), torch.from_numpy(w))
        assert torch.equal(v["merge_tasks"][: m.shape[0]].cpu(), torch.from_numpy(m))


def _expected_records(kept, kv):
    """The kept items on lengths ``kv`` as the device update must write them (an independent
    reading of ``kernels/kept_update.py``'s doc): rank r -> the r-th longest request (ties by
    index), ranges clamped, each pair's last chunk stretched, and a chunk that does not start its
    pair, emptied by a length 0, left empty at its start."""
    order = np.lexsort((np.arange(kv.shape[0]), -kv))
    req = order[kept.rank]
    n = kv[req]
    s0, e0 = kept.bounds[:, 0], kept.bounds[:, 1]
    s = np.minimum(s0, n)
    e = np.minimum(e0, n)
    zero = (s0 > 0) & (n == 0)
    s[zero] = e[zero] = s0[zero]
    items = np.stack([req, req, s, e, n], axis=1)
    return items, order[kept.merge_rank]


def _fill_step(bufs, kv, ps, max_pages, gen):
    pages = (kv + ps - 1) // ps
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
    indices = torch.randperm(max_pages, generator=gen)[: int(indptr[-1])].to(torch.int32)
    last = torch.tensor(np.where(pages > 0, kv - (pages - 1) * ps, 0), dtype=torch.int32)
    bufs["paged_kv_indptr_buffer"].copy_(indptr)
    bufs["paged_kv_indices_buffer"][: indices.numel()].copy_(indices)
    bufs["paged_kv_last_page_len_buffer"].copy_(last)
    return indptr, indices, last


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64])
def test_device_kept_plans_graph_replay(bs):
    """Kept plans updated on the device (``wrappers/kept_device.py``): one captured graph
    replayed over steps whose re-plan the host leaves to the update (grow, re-order, swap,
    halve, zero a length), against the fp32 reference; the records the update wrote equal the
    kept items' on the new lengths; a step the update found out of balance is planned anew on
    the host at the next step; eager runs after a per-step re-plan update first too."""
    hq, hk, d, ps = 32, 8, 128, 16
    rng = np.random.default_rng(random.randrange(1 << 30))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    kv0 = rng.integers(2000, 12000, size=bs)
    lens = [kv0] + _steps(rng, kv0, 20)
    max_pages = max(int(((k + ps - 1) // ps).sum()) for k in lens) + 8
    bufs = _graph_wrapper(bs, max_pages, lambda t: t.cuda())
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                           use_cuda_graph=True, **bufs)  # fmt: skip
    k = torch.randn(max_pages, ps, hk, d, generator=gen).to(BF16).cuda()
    v = torch.randn(max_pages, ps, hk, d, generator=gen).to(BF16).cuda()
    q = torch.randn(bs, hq, d, generator=gen).to(BF16).cuda()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((bs, hq), float("nan"), device="cuda")
    graph, full, on_device, checked = None, [], 0, 0
    for t, kv in enumerate(lens):
        indptr, indices, last = _fill_step(bufs, kv, ps, max_pages, gen)
        if t == 0:
            w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=BF16)
            assert w._dev_keep is not None and w._dev_keep.on, "the kept_update kernel is not in the cache"
            inner = w._planner.plan
            w._planner.plan = lambda *a, **kw: full.append(t) or inner(*a, **kw)
            w.run(q, (k, v), out=out, lse=lse)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, (k, v), out=out, lse=lse)
        else:
            n_full = len(full)
            fast_decode_plan(w, indptr, indices, last, hq, hk, d, ps, q_data_type=BF16,
                             global_override_indptr_cpu=indptr)  # fmt: skip
            device_step = w._dev_keep.pending and len(full) == n_full
            on_device += device_step
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if t % 4 == 3:
            w.run(q, (k, v), out=out, lse=lse)  # eager: the update runs first (records stale)
        else:
            graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = paged_reference(q.float(), (k.float(), v.float()), None, indptr, indices, last,
                                         sm_scale=1 / math.sqrt(d))  # fmt: skip
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), t
        err = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
        assert err < 2e-2, (t, err)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), t
        if fin.any():
            assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3, t
        assert (out[~fin] == 0).all()
        kept = w._planner.kept()
        if t and device_step:
            items, merge_req = _expected_records(kept, kv.astype(np.int64))
            n, m = items.shape[0], merge_req.shape[0]
            got = w._views["work_items"][:n].cpu().numpy()
            assert np.array_equal(got[:, list(REQUEST_FIELDS)], items), t
            kept_cols = [c for c in range(ws.WORK_FIELDS) if c not in REQUEST_FIELDS]
            assert np.array_equal(got[:, kept_cols], kept.records[:, kept_cols]), t
            mt = w._views["merge_tasks"][:m].cpu().numpy()
            assert np.array_equal(mt[:, ws.M_REQ], merge_req) and np.array_equal(mt[:, ws.M_QO_OFFSET], merge_req)
            checked += 1
        assert w._dev_keep.status() in (0, 1), t  # no invalid length was read
    assert on_device >= 8 and checked >= 8, (on_device, checked)
    assert len(full) >= 1, "no step was found out of balance (the halving / zeroing steps should be)"
    # an invalid length on the device (the host's arrays are fine): reported at the next step
    indptr, indices, last = _fill_step(bufs, lens[-1] + 1, ps, max_pages, gen)
    fast_decode_plan(w, indptr, indices, last, hq, hk, d, ps, q_data_type=BF16, global_override_indptr_cpu=indptr)
    if w._dev_keep.pending:
        bufs["paged_kv_last_page_len_buffer"][1] = ps + 3
        graph.replay()
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="held an invalid length"):
            fast_decode_plan(w, indptr, indices, last, hq, hk, d, ps, q_data_type=BF16,
                             global_override_indptr_cpu=indptr)  # fmt: skip


class _StatusKeep:
    """A device update stand-in whose status word the test sets (``kept_device.DeviceKeep``'s
    host interface)."""

    def __init__(self):
        self.on = self.pending = False
        self.bits = 0
        self.loads = 0

    def load(self, kept, page_size, max_kv_len):
        self.on = kept is not None and kept.device_records(1, page_size, max_kv_len) is not None
        self.loads += 1
        return self.on

    def off(self):
        self.on = False

    def status(self):
        return self.bits


def test_device_step_paths(demu, monkeypatch):
    """The host side of device-updated kept plans: a per-step re-plan marks the records stale
    and changes nothing else while the update reports balance; an unbalanced report sends the
    next step to a full plan; an invalid-length report raises (and switches the update off);
    host arrays that fail the quick check take the host path, which names the error."""
    keep = _StatusKeep()

    def install(self, page_size, arch):
        self._dev_keep = keep
        keep.load(self._planner.kept(), page_size, self._planner.limits.max_kv_len)

    monkeypatch.setattr(BatchDecodeWithPagedKVCacheWrapper, "_keep_on_device", install)
    bs, ps = 4, 16
    g = _gen(random.randrange(1 << 30))
    kv = [100, 300, 17, 64]
    cache, indptr, indices, last = paged_batch(kv, ps, HK, D, BF16, g)
    bufs = _graph_wrapper(bs, 64, _fake_cuda)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(64), use_cuda_graph=True, **bufs)
    w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=BF16)
    assert keep.on and keep.loads == 1
    step = lambda ip, lp: fast_decode_plan(w, ip, indices, lp, HQ, HK, D, ps, q_data_type=BF16)
    step(indptr, last)
    st = w._state
    keep.pending = False
    nxt = last.clone()
    nxt[0] += 1
    step(indptr, nxt)  # the device's: nothing on the host changes
    assert w._state is st and keep.pending and keep.loads == 1
    keep.bits = 1
    step(indptr, nxt)  # unbalanced: a full plan on the host
    assert keep.loads == 2 and w._state is not st
    keep.bits = 0
    bad = nxt.clone()
    bad[2] = ps + 1
    with pytest.raises(ValueError, match=r"last_page_len\[2\] = 17"):
        step(indptr, bad)  # the quick check fails: the host path's error
    keep.bits = 2
    with pytest.raises(ValueError, match="held an invalid length"):
        step(indptr, nxt)
    assert not keep.on


def test_device_records_of_a_kept_plan():
    """``KeptPlan.device_records``: the parameters the update reads and one record per item
    (rank, start, end or -1 for a pair's last chunk); None past ``MAX_BATCH`` requests."""
    from cute_attn.abi import kept as kp

    lim = Limits(max_batch=4096, max_total_q_tokens=4096, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    pl = Planner(lim, 132, 2, alpha=8, beta=1, balance_tol=0.01, keep_tol=0.03)
    rng = np.random.default_rng(random.randrange(1 << 30))
    kv = rng.integers(1, 8000, size=48)
    p = pl.plan(None, kv, page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16)
    params, items, merge_rank = pl.kept().device_records(7, 16, lim.max_kv_len)
    assert params[kp.K_ON] == 1 and params[kp.K_BATCH] == 48 and 2 ** params[kp.K_SORT_LOG2] >= 48
    assert params[kp.K_EPOCH] == 7 and params[kp.K_NUM_CTAS] == 264 and params[kp.K_NUM_MERGES] == p.num_merge_tasks
    w = p.work_items
    last = w[:, ws.W_CHUNK] == w[:, ws.W_NUM_CHUNKS] - 1
    assert np.array_equal(items[:, kp.KI_START], w[:, ws.W_KV_START])
    assert np.array_equal(items[:, kp.KI_END], np.where(last, -1, w[:, ws.W_KV_END]))
    order = np.lexsort((np.arange(48), -kv))
    assert np.array_equal(order[items[:, kp.KI_RANK]], w[:, ws.W_REQ])
    assert np.array_equal(order[merge_rank], p.merge_tasks[:, ws.M_REQ])
    kv = rng.integers(1, 100, size=kp.MAX_BATCH + 1)
    pl.plan(None, kv, page_size=16, num_qo_heads=32, num_kv_heads=8, cta_tile_q=16)
    assert pl.kept().device_records(1, 16, lim.max_kv_len) is None
