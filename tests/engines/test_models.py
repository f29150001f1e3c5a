"""A built-in model's serving step loads only kernels that ``compile --model`` lists.

For each model of ``cute_attn.models.BUILTIN``: the wrapper calls of one serving step -- a
decode step (page 16, with the model's window / soft-cap, ``run(sinks=)`` where it has sinks),
a ragged causal prefill of long and short requests, a paged causal prefill at page 16 and 1, a
two-level cascade over a shared prefix, a speculative-decoding tree mask -- are made on the CPU
with every kernel load recorded (no launch does anything), and each requested specialization
must be in ``model_specs(model, "sm_90a")``.  Once with the model's 16-bit cache and once with an
fp8 one (``kv_cache_dtype="fp8"``: the fp8 decode kernels, the KV pass that dequantizes the
cache, the ragged prefill kernels).  An MLA model (``deepseek-v3``): its prefill's ragged calls
at (head_dim_qk, head_dim_vo), causal over new tokens and non-causal over a cached prefix chunk
(its decode is the MLA wrapper's).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_prefill_gpu import _fake_cuda  # noqa: E402

from cute_attn import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from cute_attn.families.spec import Spec  # noqa: E402
from cute_attn.models import BUILTIN, model_specs  # noqa: E402


class _NoLaunch:
    def __init__(self, family, params, loads):
        loads.append(Spec.make(family, "sm_90a", **params))

    def __call__(self, *args):
        pass


@pytest.fixture
def loads(monkeypatch):
    import cute_attn.wrappers.cascade as C
    import cute_attn.wrappers.compat as X
    import cute_attn.wrappers.decode as D
    import cute_attn.wrappers.decode_engine as E
    import cute_attn.wrappers.prefill_base as P

    got = []
    for m in (D, E, P):
        monkeypatch.setattr(m, "arch_of_index", lambda i: "sm_90a")
        monkeypatch.setattr(m, "sm_count_of_index", lambda i: 132)
    for m in (D, P):
        monkeypatch.setattr(m, "kernel", lambda family, arch, **p: _NoLaunch(family, p, got))
    monkeypatch.setattr(X, "_RUN_MODULES", {})
    monkeypatch.setattr(C, "merge_state_in_place", lambda *a, **k: None)
    monkeypatch.setattr(C, "merge_pair_module", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    return got


class _NoEvent:
    def record(self, *a):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


def _ws(mb=256):
    return _fake_cuda(torch.empty(mb << 20, dtype=torch.uint8))


def _t(n, *shape, dtype=torch.bfloat16):
    return _fake_cuda(torch.zeros(n, *shape, dtype=dtype))


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
@pytest.mark.parametrize("name", sorted(n for n, m in BUILTIN.items() if not m.mla))
def test_serving_step_loads_only_listed_kernels(loads, name, kv_cache):
    m = BUILTIN[name] if kv_cache is None else replace(BUILTIN[name], kv_dtype="e4m3")
    kv_dt = torch.bfloat16 if kv_cache is None else torch.float8_e4m3fn
    dt = dict(q_data_type=torch.bfloat16, kv_data_type=kv_dt)
    hq, hk, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    windows = ([-1] if m.global_layers or m.sliding_window is None else []) + (
        [m.sliding_window - 1] if m.sliding_window else []
    )
    cap = m.logits_soft_cap
    sinks = _fake_cuda(torch.zeros(hq)) if m.sinks else None
    ps, pages = 16, 64
    cache = (_t(pages, ps, hk, d, dtype=kv_dt), _t(pages, ps, hk, d, dtype=kv_dt))
    for window in windows:
        # decode: 64 and 256 requests (head packing differs), page 16
        for b in (64, 256):
            lens = [1 + (i * 37) % 200 for i in range(b)]
            npg = [(n + ps - 1) // ps for n in lens]
            indptr = _i32([0] + torch.tensor(npg).cumsum(0).tolist())
            indices = _i32([i % pages for i in range(int(indptr[-1]))])
            last = _i32([n - (p - 1) * ps for n, p in zip(lens, npg)])
            w = BatchDecodeWithPagedKVCacheWrapper(_ws())
            w.plan(indptr, indices, last, hq, hk, d, ps, window_left=window, logits_soft_cap=cap, **dt)
            w.run(_t(b, hq, d), cache, sinks=sinks)
        # ragged causal prefill: long requests (tile 128) and short ones (tile 64)
        for qo in ([600, 300], [3, 5, 2]):
            ind = _i32([0] + torch.tensor(qo).cumsum(0).tolist())
            r = BatchPrefillWithRaggedKVCacheWrapper(_ws())
            r.plan(ind, ind, hq, hk, d, causal=True, window_left=window, logits_soft_cap=cap, **dt)
            n = int(ind[-1])
            r.run(_t(n, hq, d), _t(n, hk, d, dtype=kv_dt), _t(n, hk, d, dtype=kv_dt), sinks=sinks)
        # paged causal prefill (chunked: 40 new tokens on 200 cached) at page 16 and 1
        for page in (16, 1):
            kv = 240
            npg = (kv + page - 1) // page
            pc = (_t(npg, page, hk, d, dtype=kv_dt), _t(npg, page, hk, d, dtype=kv_dt))
            p = BatchPrefillWithPagedKVCacheWrapper(_ws())
            p.plan(_i32([0, 40]), _i32([0, npg]), _i32(list(range(npg))), _i32([kv - (npg - 1) * page]), hq, hk, d,
                   page, causal=True, window_left=window, logits_soft_cap=cap, **dt)  # fmt: skip
            p.run(_t(40, hq, d), pc, sinks=sinks)
        # speculative decoding: a tree of 4 tokens per request over a paged cache
        spec = BatchPrefillWithPagedKVCacheWrapper(_ws())
        spec.plan(_i32([0, 4, 8]), _i32([0, 4, 8]), _i32(list(range(8))), _i32([16, 16]), hq, hk, d, ps,
                  custom_mask=torch.ones(2 * 4 * 64, dtype=torch.bool), window_left=window, logits_soft_cap=cap,
                  **dt)  # fmt: skip
        spec.run(_t(8, hq, d), cache)
        # cascade: 8 requests sharing a 64-token prefix, 16 own tokens each
        c = MultiLevelCascadeAttentionWrapper(2, _ws(512))
        c.plan([_i32([0, 8]), _i32(list(range(9)))], [_i32([0, 4]), _i32(list(range(9)))],
               [_i32([0, 1, 2, 3]), _i32(list(range(4, 12)))], [_i32([16]), _i32([16] * 8)], hq, hk, d, ps,
               window_left=window, logits_soft_cap=cap, **dt)  # fmt: skip
        c.run(_t(8, hq, d), cache)
    listed = set(model_specs(m, "sm_90a"))
    missing = [s.describe() for s in dict.fromkeys(loads) if s not in listed]
    assert loads and not missing, f"{name}: a serving step loads kernels compile --model does not list: {missing}"


@pytest.mark.parametrize("name", sorted(n for n, m in BUILTIN.items() if m.mla))
def test_mla_prefill_loads_only_listed_kernels(loads, name):
    m = BUILTIN[name]
    hq, d, dv = m.num_qo_heads, m.head_dim, m.dv
    for causal in (True, False):
        for qo in ([600, 300], [3, 5, 2]):
            ind = _i32([0] + torch.tensor(qo).cumsum(0).tolist())
            kv = _i32([0] + (torch.tensor(qo) + (0 if causal else 500)).cumsum(0).tolist())
            r = BatchPrefillWithRaggedKVCacheWrapper(_ws())
            r.plan(ind, kv, hq, hq, d, head_dim_vo=dv, causal=causal, q_data_type=torch.bfloat16)
            n, nk = int(ind[-1]), int(kv[-1])
            r.run(_t(n, hq, d), _t(nk, hq, d), _t(nk, hq, dv))
    listed = set(model_specs(m, "sm_90a"))
    missing = [s.describe() for s in dict.fromkeys(loads) if s not in listed]
    assert loads and not missing, f"{name}: a prefill loads kernels compile --model does not list: {missing}"
