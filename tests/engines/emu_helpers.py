"""CPU emulation of the decode kernel (next to test_prefill_gpu's of the prefill kernel), for the
engine-call and wrapper-API tests: ``demu`` patches what needs a GPU in the decode and prefill
wrappers and records every launch (family, spec params, arguments)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_prefill_gpu import (  # noqa: E402,F401
    _cpu_ws,
    _emulate_kv_pass,
    _emulate_merge,
    _emulate_prefill,
    _fake_cuda,
    _FakeEvent,
    _gen,
    _plain,
    make_paged,
)

NUM_SMS = 8


def emulate_decode(p, q, k4, v4, kv_indptr, kv_indices, out, lse, work, work_indptr, part_o, part_lse, group,
                   sm_scale, num_ctas, *vargs):  # fmt: skip
    """What kernels/decode.py must compute, item by item (fp64): one query token per request,
    the variant's soft-cap / window from its runtime values."""
    from cute_attn.families.base import spec_variant
    from cute_attn.families.decode import TILE_Q
    from cute_attn.sched import workspace as ws
    from cute_attn.variants import abi_args, components
    from cute_attn.variants.builtins import SlidingWindow, SoftCap

    var = spec_variant(p)
    val = dict(zip([a.name for a in abi_args(var)], vargs))
    cap, window = 0.0, -1
    for i, c in enumerate(components(var)):
        if isinstance(c, SoftCap):
            cap = float(val[f"v{i}_logits_soft_cap"])
        elif isinstance(c, SlidingWindow):
            window = int(val[f"v{i}_window_left"])
        else:
            raise NotImplementedError(f"emulate_decode: {type(c).__name__}")
    hq, hk = q.shape[1], k4.shape[2]
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    ip = work_indptr.tolist()
    kvp = kv_indptr.long()
    ps = k4.shape[1]
    for c in range(num_ctas):
        for it in range(ip[c], ip[c + 1]):
            f = work[it].tolist()
            b, h, r0, nr = f[ws.W_REQ], f[ws.W_KV_HEAD], f[ws.W_ROW_START], f[ws.W_NUM_ROWS]
            ks, ke, dest = f[ws.W_KV_START], f[ws.W_KV_END], f[ws.W_DEST]
            qoff, qlen, klen = f[ws.W_QO_OFFSET], f[ws.W_QO_LEN], f[ws.W_KV_LEN]
            assert qlen == 1 and 1 <= nr <= TILE_Q and 0 <= ks <= ke <= klen
            rows = torch.arange(r0, r0 + nr)
            heads = h * group + rows % group
            kvh = heads // (hq // hk)
            qv = q[qoff, heads].double()  # [nr, d]
            pos = torch.arange(ks, ke)
            page = kv_indices.long()[kvp[b] + pos // ps]
            kk = k4[page[None, :], (pos % ps)[None, :], kvh[:, None]].double()  # [nr, n, d]
            vv = v4[page[None, :], (pos % ps)[None, :], kvh[:, None]].double()
            s = torch.einsum("rd,rnd->rn", qv, kk) * sm_scale
            if cap > 0:
                s = cap * torch.tanh(s / cap)
            if window >= 0:
                s = s.masked_fill(pos[None, :] < klen - 1 - window, -math.inf)
            m = s.amax(1, keepdim=True) if s.shape[1] else torch.full((nr, 1), -math.inf, dtype=torch.float64)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            e = torch.exp(s - m)
            l_ = e.sum(1, keepdim=True)
            o = torch.where(l_ > 0, torch.einsum("rn,rnd->rd", e, vv) / l_.clamp_min(1e-300), torch.zeros(1).double())
            row_lse = ((m + torch.log(l_)) / math.log(2)).squeeze(1)
            if dest < 0:
                out[qoff, heads] = o.to(out.dtype)
                lse[qoff, heads] = row_lse.float()
            else:
                part_o[dest * TILE_Q : dest * TILE_Q + nr] = o.float()
                part_lse[dest * TILE_Q : dest * TILE_Q + nr] = row_lse.float()


class Emulated:
    """A kernel module stand-in: the real argument packer, then the emulation; every launch is
    recorded as (family, spec params, plain arguments)."""

    def __init__(self, family, params, calls, replayable=None):
        from cute_attn.families.base import get_family
        from cute_attn.runtime.loader import make_packer

        self.family, self.params, self.calls = family, params, calls
        self.replayable = replayable if replayable is not None else []
        self.pack = make_packer(get_family(family).abi(params))
        self.emulate = {
            "paged_decode": emulate_decode,
            "batch_prefill_sm90": _emulate_prefill,
            "batch_prefill_mma": _emulate_prefill,
            "merge_partials": _emulate_merge,
            "kv_pass": _emulate_kv_pass,
        }[family]

    def __call__(self, *args):
        args = [_plain(a) for a in args]
        self.pack(*args)
        self.calls.append((self.family, dict(self.params), args))
        self.replayable.append((self, args))
        if self.family == "merge_partials":
            p = dict(self.params)
            self.emulate(p, *args)
        else:
            self.emulate(self.params, *args)


def _merge_in_place(v, s, v_o, s_o, mask=None):
    from cute_attn.testing import merge_state_reference

    o, lse = merge_state_reference(v.float(), s, v_o.float(), s_o)
    v.copy_(o.to(v.dtype))
    s.copy_(lse)


@pytest.fixture
def demu(monkeypatch):
    """Decode + prefill wrappers on the CPU: GPU queries patched, kernels emulated; returns an
    object with ``calls`` (launches), ``loads`` (kernels requested: family, params) and ``state``
    (``arch``, ``capturing``)."""
    import cute_attn.wrappers.cascade as C
    import cute_attn.wrappers.compat as X
    import cute_attn.wrappers.decode as D
    import cute_attn.wrappers.decode_engine as E
    import cute_attn.wrappers.prefill_base as P

    calls, loads, replayable = [], [], []
    state = {"arch": "sm_90a", "capturing": False}

    def kernel(family, arch, **params):
        loads.append((family, dict(params)))
        return Emulated(family, params, calls, replayable)

    for m in (D, E, P):
        monkeypatch.setattr(m, "arch_of_index", lambda i: state["arch"])
        monkeypatch.setattr(m, "sm_count_of_index", lambda i: NUM_SMS)
    monkeypatch.setattr(D, "kernel", kernel)
    monkeypatch.setattr(P, "kernel", kernel)
    monkeypatch.setattr(X, "_RUN_MODULES", {})
    monkeypatch.setattr(C, "merge_state_in_place", _merge_in_place)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return type("Emu", (), {"calls": calls, "loads": loads, "state": state, "replayable": replayable})()


def paged_batch(kv_lens, page_size, hk, d, dtype, gen, layout="NHD"):
    """A shuffled paged cache (NaN where no request owns a slot) as a (k, v) tuple; returns
    (cache, indptr, indices, last_page_len) with CPU int32 index arrays."""
    cache, indptr, indices, last, _, _ = make_paged(kv_lens, page_size, hk, d, dtype, layout, False, gen, "cpu")
    as_t = lambda x: torch.as_tensor(x, dtype=torch.int32)  # noqa: E731
    return cache, as_t(indptr), as_t(indices), as_t(last)


def launches(emu, family):
    return [c for c in emu.calls if c[0] == family]


def nan_like(q):
    return torch.full_like(q, float("nan"))
