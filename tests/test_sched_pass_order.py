"""The order of the fp8 pass's tasks inside the prefill kernel (``sched.pass_order``): every
(block of the ragged cache, kv head) once, sorted by the step at which the plan's CTAs first
read it, against a plain loop over the plan's items.  CPU only."""

from __future__ import annotations

import numpy as np
import pytest

from cute_attn.sched import Limits, Planner
from cute_attn.sched import workspace as ws
from cute_attn.sched.pass_order import demand_order, pass_plan


def _first_need(plan, kv_lens, hk, block):
    kv_off = np.concatenate([[0], np.cumsum(kv_lens)])
    total = int(kv_off[-1])
    need = {}
    ip = plan.work_indptr
    for c in range(len(ip) - 1):
        step = 0
        for f in plan.work_items[ip[c] : ip[c + 1]]:
            ks, ke = int(f[ws.W_KV_START]), int(f[ws.W_KV_END])
            for b in reversed(range(-(-(ke - ks) // block))):
                row = int(kv_off[f[ws.W_REQ]]) + ks + block * b
                for g in {row // block, (min(row + block, total) - 1) // block}:
                    key = (g, int(f[ws.W_KV_HEAD]))
                    need[key] = min(need.get(key, step), step)
                step += 1
    return need


@pytest.mark.parametrize(
    "qo,kv,hk,causal,sms",
    [
        ([8192, 8192], [8192, 8192], 4, True, 16),
        ([300, 1, 2000, 129, 700], [300, 1, 2000, 129, 700], 2, False, 8),
        ([1, 4000, 3, 900], [30000, 4000, 60000, 900], 2, True, 32),  # split KV at odd rows
        ([0, 5, 0, 300], [10, 0, 0, 500], 3, True, 4),  # empty requests, keys no item reads
    ],
)
def test_demand_order_matches_a_walk_of_the_plan(qo, kv, hk, causal, sms):
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % (1 << 32)))
    block = int(rng.choice([64, 128]))
    lim = Limits(max_batch=8, max_total_q_tokens=sum(qo) + 1, num_qo_heads=2 * hk, num_kv_heads=hk, head_dim=128)
    plan = Planner(lim, sms).plan(np.concatenate([[0], np.cumsum(qo)]), np.array(kv), causal=causal, page_size=1,
                                  num_qo_heads=2 * hk, num_kv_heads=hk, cta_tile_q=128)  # fmt: skip
    order = demand_order(plan.work_items, plan.work_indptr, kv, hk, block)
    blocks = -(-sum(kv) // block)
    assert sorted(map(tuple, order.tolist())) == [(g, h) for g in range(blocks) for h in range(hk)]
    need = _first_need(plan, kv, hk, block)
    steps = [need.get(tuple(t), 1 << 40) for t in order.tolist()]
    assert steps == sorted(steps)
    arr, n_flags = pass_plan(plan.work_items, plan.work_indptr, kv, hk, block)
    assert arr.dtype == np.int32 and n_flags == blocks * hk
    fields = arr[3:].reshape(-1, 3)
    assert arr[:3].tolist() == [blocks * hk, 3, sum(kv)] and (fields[:, :2] == order).all()
    # the third field: the request holding the block's first row (a non-empty one)
    kv_off = np.concatenate([[0], np.cumsum(kv)])
    for g, _, r in fields.tolist():
        assert kv_off[r] <= g * block < kv_off[r + 1]
