"""The kept-plan update (``kernels/kept_update.py``), compiled and executed on the CPU: its PTX
(sm_90a) run by ``tests/ptx_interp.py`` on the records a real plan hands it
(``KeptPlan.device_records``), the threads in forward and in reverse order between barriers (a
race shows as a difference).  Checked against an independent numpy reading of the kernel's
contract (``wrappers/kept_device.py``): every item on its rank's request (longest first, ties
by index) with its range clamped and each pair's last chunk stretched, a chunk that does not
start its pair and is emptied by a length 0 left at its start, the merge tasks' requests, the
status word (epoch * 4 + out-of-balance / invalid-length bits).  The GPU test is
``tests/test_decode_replan.py::test_device_kept_plans_graph_replay``."""

import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_interp  # noqa: E402
from test_mla_ptx_emulated import ptx_of  # noqa: E402,F401  (the fixture: spec -> kernel.ptx)

from cute_attn.abi import kept as kp  # noqa: E402
from cute_attn.sched import Planner  # noqa: E402
from cute_attn.sched import workspace as ws  # noqa: E402
from cute_attn.sched.workspace import Limits  # noqa: E402

pytestmark = pytest.mark.compile
PS = 16
REQUEST_FIELDS = [ws.W_REQ, ws.W_QO_OFFSET, ws.W_KV_START, ws.W_KV_END, ws.W_KV_LEN]


def _expected(kept, kv):
    order = np.lexsort((np.arange(kv.shape[0]), -kv))
    req = order[kept.rank]
    n = kv[req]
    s0, e0 = kept.bounds[:, 0], kept.bounds[:, 1]
    s, e = np.minimum(s0, n), np.minimum(e0, n)
    zero = (s0 > 0) & (n == 0)
    s[zero] = e[zero] = s0[zero]
    return np.stack([req, req, s, e, n], axis=1), order[kept.merge_rank]


def _run(ptx, params, items, merge_rank, records, work_indptr, merges, kv, last_override=None, order="forward"):
    from cute_attn.families.base import get_family

    pages = (kv + PS - 1) // PS
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.where(pages > 0, kv - (pages - 1) * PS, 0).astype(np.int32)
    if last_override is not None:
        last[last_override[0]] = last_override[1]
    status = np.full(1, -1, np.int32)
    work = records.copy()
    mt = merges.copy()
    arrays = [indptr, last, params, items, merge_rank, work, work_indptr.astype(np.int32), mt, status]
    tensors = [torch.from_numpy(a) for a in arrays]
    mem = ptx_interp.Memory()
    bases = {id(t): mem.add(a.view(np.uint8).reshape(-1)) for t, a in zip(tensors, arrays)}
    abi = get_family("kept_update").abi({"max_batch": kp.MAX_BATCH})
    cta = ptx_interp.CTA(ptx, ptx_interp.pack_params(abi, tensors, mem, bases), mem, 512, order=order)
    cta.run()
    return work, mt, int(status[0])


@pytest.mark.parametrize("b, order", [(12, "forward"), (12, "reverse"), (300, "forward")])
def test_kept_update_interpreted(ptx_of, b, order):  # noqa: F811
    """Batch 12 (one item per thread) and 300 (600+ items: two per thread, in one load batch)."""
    from cute_attn.families.kept import kept_update_spec

    ptx = ptx_of(kept_update_spec("sm_90a"))
    rng = np.random.default_rng(random.randrange(1 << 30))
    hk = 2
    lim = Limits(max_batch=512, max_total_q_tokens=512, num_qo_heads=8, num_kv_heads=hk, head_dim=64)
    pl = Planner(lim, 4, 2, alpha=8, beta=1, balance_tol=0.01, keep_tol=0.03)  # 8 CTAs: long requests split
    kv0 = rng.integers(1, 3000, size=b)
    kv0[3] = 9000
    p = pl.plan(None, kv0, page_size=PS, num_qo_heads=8, num_kv_heads=hk, cta_tile_q=16)
    kept = pl.kept()
    if b < 100:  # split pairs and merges
        assert (p.work_items[:, ws.W_NUM_CHUNKS] > 1).any() and p.num_merge_tasks > 0
    else:  # more items than threads
        assert p.num_work_items > 512
    params, items, merge_rank = kept.device_records(5, PS, lim.max_kv_len)
    full = p.work_items.copy()
    steps = [kv0 + 1, rng.permutation(kv0 + rng.integers(0, 9, size=b)), np.where(np.arange(b) == 3, 0, kv0 // 2)]
    for t, kv in enumerate(steps):
        kv = kv.astype(np.int64)
        work, mt, status = _run(ptx, params, items, merge_rank, full, p.work_indptr, p.merge_tasks, kv, order=order)
        want, merge_req = _expected(kept, kv)
        assert np.array_equal(work[:, REQUEST_FIELDS], want), t
        other = [c for c in range(ws.WORK_FIELDS) if c not in REQUEST_FIELDS]
        assert np.array_equal(work[:, other], full[:, other]), t
        assert np.array_equal(mt[:, ws.M_REQ], merge_req) and np.array_equal(mt[:, ws.M_QO_OFFSET], merge_req)
        assert status >> 2 == 5 and not status & kp.KS_BAD_LENGTHS, t
        # the balance bit: the planner's model of the CTAs' loads on the records written
        span = (want[:, 3] - want[:, 2]).astype(np.float64)
        ip = p.work_indptr.astype(np.int64)
        per_item, beta = int(params[kp.K_PER_ITEM]), int(params[kp.K_BETA])
        loads = np.array([per_item * (ip[c + 1] - ip[c]) + beta * span[ip[c] : ip[c + 1]].sum()
                          for c in range(ip.shape[0] - 1)])  # fmt: skip
        unbalanced = loads.shape[0] * loads.max() * 2**20 > params[kp.K_BOUND_Q20] * loads.sum()
        assert bool(status & kp.KS_UNBALANCED) == unbalanced, t
    # an invalid last-page length on the device: read as 0 and reported
    kv = (kv0 + 2).astype(np.int64)
    work, _, status = _run(ptx, params, items, merge_rank, full, p.work_indptr, p.merge_tasks, kv, (4, PS + 2), order)
    assert status & kp.KS_BAD_LENGTHS
    assert (work[work[:, ws.W_REQ] == 4, ws.W_KV_LEN] == 0).all()
