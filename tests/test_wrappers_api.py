"""CPU tests of the FlashInfer surface the engines use (issue 21, wrapper side): decode plan()'s
legacy positional order, ``data_type``, ``fixed_split_size=-1``, ``window_right``, the q / k / v
scales, ``kv_cache_sf``, ``forward`` semantics, 3-D caches, ``workspace_size``, the private
attributes, ``fast_decode_plan`` / ``_cached_module.plan``, ``q_len_per_req``, the deprecated
shared-prefix wrappers, causal with qo_len > kv_len and plans in 16 MiB.  Kernels emulated on
the CPU (``tests/engines/emu_helpers.py``); fresh random inputs per test."""

import math
import os
import random
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))

from emu_helpers import NUM_SMS, _cpu_ws, _fake_cuda, _gen, demu, launches, nan_like, paged_batch  # noqa: E402,F401

from cute_attn import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper,
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
)
from cute_attn.testing import paged_reference, ragged_reference, single_reference  # noqa: E402

BF16 = torch.bfloat16
HQ, HK, D, PS = 8, 2, 64, 16


def _seed():
    return random.randrange(1 << 30)


def _decode_setup(kv_lens=None, page_size=PS, **ctor):
    g = _gen(_seed())
    kv_lens = kv_lens or [random.randint(1, 90) for _ in range(random.randint(2, 6))]
    cache, indptr, indices, last = paged_batch(kv_lens, page_size, HK, D, BF16, g)
    q = torch.randn(len(kv_lens), HQ, D, generator=g).to(BF16)
    return q, cache, indptr, indices, last


def _ref_decode(q, cache, indptr, indices, last, **kw):
    qo = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_reference(q, cache, qo, indptr, indices, last, **kw)


def _close(out, ref, tol=2e-2):
    assert not torch.isnan(out).any()
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    assert err < tol, err


def _decode_launch(emu):
    return launches(emu, "paged_decode")[-1]


# ---- decode plan() ----------------------------------------------------------------------------
def test_legacy_positional_order(demu):
    """vLLM's fast_plan_decode calls plan() with 15 positional optionals (FlashInfer's legacy order)."""
    q, cache, indptr, indices, last = _decode_setup()
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16), "NHD", use_tensor_cores=True)
    sm = 0.3
    with pytest.warns(DeprecationWarning):
        w.plan(
            indptr,
            indices,
            last,
            HQ,
            HK,
            D,
            PS,
            "NONE",
            7,
            20.0,
            BF16,
            BF16,
            BF16,
            None,
            sm,
            None,
            None,
            True,
            None,
            None,
            -1,
            False,
        )
    assert w._sm_scale == sm and w._window_left == 7 and w._logits_soft_cap == 20.0 and w.dtype == BF16
    out = w.run(q, cache)
    ref, _ = _ref_decode(q, cache, indptr, indices, last, sm_scale=sm, window_left=7, logits_soft_cap=20.0)
    _close(out, ref)
    with pytest.raises(TypeError, match="multiple values"), pytest.warns(DeprecationWarning):
        w.plan(indptr, indices, last, HQ, HK, D, PS, "NONE", -1, window_left=3)
    with pytest.raises(TypeError, match="at most 16"):
        w.plan(indptr, indices, last, HQ, HK, D, PS, *([None] * 17))
    with pytest.raises(TypeError):  # extensions are keyword-only
        w.plan(indptr, indices, last, HQ, HK, D, PS, *([None] * 16), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, heads_per_item=1)  # no warning


def test_data_type_fills_unset(demu):
    q, cache, indptr, indices, last = _decode_setup()
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    w.plan(indptr, indices, last, HQ, HK, D, PS, data_type=BF16)
    assert w.dtype == BF16
    with pytest.raises(ValueError, match="equal"):  # data_type fills kv only: q stays float16
        w.plan(indptr, indices, last, HQ, HK, D, PS, data_type=BF16, q_data_type=torch.float16)
    w.begin_forward(indptr, indices, last, HQ, HK, D, PS, data_type=BF16, q_data_type=BF16)  # SGLang's call
    w.end_forward()
    _close(w.run(q, cache), _ref_decode(q, cache, indptr, indices, last)[0])


def test_fixed_split_size_minus_one_is_off(demu):
    q, cache, indptr, indices, last = _decode_setup([300, 700, 5])
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, fixed_split_size=-1)
    a = w._plan.work_items.copy()
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
    assert np.array_equal(a, w._plan.work_items)
    g = _gen(_seed())
    qo = torch.tensor([0, 3, 10, 12], dtype=torch.int32)
    p = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(16))
    p.plan(qo, indptr, indices, last, HQ, HK, D, PS, causal=True, q_data_type=BF16, fixed_split_size=-1)
    r = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(16))
    r.plan(qo, qo, HQ, HK, D, causal=True, q_data_type=BF16, fixed_split_size=-1)
    qq = torch.randn(12, HQ, D, generator=g).to(BF16)
    assert p.run(qq, cache).shape == qq.shape


def test_window_right_and_unsupported(demu):
    q, cache, indptr, indices, last = _decode_setup()
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, window_right=0)
    with pytest.raises(NotImplementedError, match="window_right"):
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, window_right=4)
    with pytest.raises(NotImplementedError, match="fp8 queries"):
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="RoPE"):  # fp8 caches take no in-kernel RoPE
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn,
               pos_encoding_mode="ROPE_LLAMA")  # fmt: skip
    with pytest.raises(NotImplementedError, match="block_tables"):
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, block_tables=torch.zeros(1, 1))
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
    n = len(demu.calls)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        w.run(q, cache, kv_cache_sf=torch.zeros(1))
    r = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(16))
    with pytest.raises(ValueError, match="head_dim_vo 32 is not supported"):  # served pairs: 192 / 128
        r.plan(torch.tensor([0, 2]), torch.tensor([0, 2]), HQ, HK, D, 32, q_data_type=BF16)
    r.plan(torch.tensor([0, 2]), torch.tensor([0, 2]), HQ, HK, D, q_data_type=BF16)
    kk = torch.randn(2, HK, D).to(BF16)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        r.run(torch.randn(2, HQ, D).to(BF16), kk, kk, kv_cache_sf=torch.zeros(1))
    assert len(demu.calls) == n  # nothing launched


# ---- scales ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["decode", "paged"])
def test_scales(demu, kind):
    q, cache, indptr, indices, last = _decode_setup()
    if kind == "decode":
        w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
        fam, sm_pos = "paged_decode", 12
    else:
        w = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(16))
        w.plan(torch.arange(q.shape[0] + 1, dtype=torch.int32), indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
        fam, sm_pos = "batch_prefill_sm90", 12
    base = 1 / math.sqrt(D)
    o1, l1 = w.run(q, cache, return_lse=True, out=nan_like(q))
    o2, l2 = w.run(q, cache, q_scale=1.5, k_scale=torch.tensor(2.0), v_scale=0.5, return_lse=True, out=nan_like(q))
    assert launches(demu, fam)[-1][2][sm_pos] == pytest.approx(base * 3.0)
    ref, rl = _ref_decode(q, cache, indptr, indices, last, sm_scale=base * 3.0)
    _close(o2.float() / 0.5, ref)
    assert torch.allclose(l2, rl, atol=1e-3)  # the LSE is not scaled by v_scale
    o3 = w.run(q, cache, v_scale=1.0, k_scale=1.0)
    assert torch.equal(o3, o1)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="k_scale|v_scale"):
            w.run(q, cache, k_scale=bad, v_scale=bad)
    demu.state["capturing"] = True
    try:
        with pytest.raises(ValueError, match="pass a Python float"):
            w.run(q, cache, k_scale=torch.tensor(2.0))
    finally:
        demu.state["capturing"] = False


@pytest.mark.parametrize("kind", ["decode", "paged", "decode_fp8", "paged_fp8"])
def test_per_head_scales(demu, kind):
    """Per-head q_scale [HQ] and k_scale / v_scale [HK] (cute_attn's extension, wrappers/scales.py)
    against the reference on the per-head-scaled q and cache (fp64), with scalars beside them;
    the launch's softmax scale holds only the scalar part."""
    q, cache, indptr, indices, last = _decode_setup()
    g = _gen(_seed())
    qs, ks, vs = (torch.rand(n, generator=g) * 1.5 + 0.25 for n in (HQ, HK, HK))
    qo = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    kv_dtype = torch.float8_e4m3fn if kind.endswith("fp8") else BF16
    cache = tuple(c.to(kv_dtype) for c in cache)  # the reference reads the same (dequantized) values
    if kind.startswith("decode"):
        w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, kv_data_type=kv_dtype)
        fam = "paged_decode"
    else:
        w = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(16))
        w.plan(qo, indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, kv_data_type=kv_dtype)
        fam = "batch_prefill_sm90"
    heads = torch.arange(HQ) // (HQ // HK)
    q_ref = (q.double() * (qs.double() * ks.double()[heads])[:, None]).float()
    out, lse = w.run(q, cache, q_scale=qs, k_scale=ks, v_scale=vs, return_lse=True)
    assert launches(demu, fam)[-1][2][12] == pytest.approx(1 / math.sqrt(D))
    ref, rl = _ref_decode(q_ref, cache, indptr, indices, last)
    _close(out.float() / vs[heads][:, None], ref)
    assert torch.allclose(lse, rl, atol=2e-2), (lse - rl).abs().max()  # the logits' scales, not v's
    # a scalar q scale with per-head k / v ones: a factor 2 on the logits, 3 on the output
    o2 = w.run(q, cache, q_scale=2.0, k_scale=ks, v_scale=vs * 3.0)
    q_k = (q.double() * ks.double()[heads][:, None]).float()
    ref2, _ = _ref_decode(q_k, cache, indptr, indices, last, sm_scale=2.0 / math.sqrt(D))
    _close(o2.float() / (3.0 * vs[heads][:, None]), ref2)
    assert launches(demu, fam)[-1][2][12] == pytest.approx(2.0 / math.sqrt(D))
    o3 = w.run(q, cache, q_scale=qs, k_scale=ks, v_scale=torch.tensor(3.0))  # no per-head v scale
    _close(o3.float() / 3.0, ref)


def test_per_head_scales_refused_with_fp8_queries(demu):
    from cute_attn.wrappers import scales

    sc = scales.resolve(torch.device("cpu"), HQ, HK, k_scale=torch.ones(HK))
    with pytest.raises(ValueError, match="fp8 queries"):
        sc.query(torch.zeros(3, HQ, D).to(torch.float8_e4m3fn))
    assert scales.resolve(torch.device("cpu"), HQ, HK, v_scale=torch.ones(HK)).query(q := torch.ones(2, HQ, D)) is q


def test_per_head_scales_under_capture(monkeypatch):
    """Per-head tensors need no synchronization: under a capture nothing is read back (a
    1-element tensor still is, and is refused)."""
    from cute_attn.wrappers import scales

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_sync(*a):
        raise AssertionError("synchronized under a capture")

    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    g = _gen(_seed())
    ks, vs = torch.rand(HK, generator=g) + 0.5, torch.rand(HK, generator=g) + 0.5
    sc = scales.resolve(torch.device("cpu"), HQ, HK, k_scale=ks, v_scale=vs)
    q = torch.randn(3, HQ, D, generator=g).to(BF16)
    heads = torch.arange(HQ) // (HQ // HK)
    assert torch.equal(sc.query(q), (q.float() * ks[heads][:, None]).to(BF16))  # one rounding, from fp32
    out = torch.randn(3, HQ, D, generator=g)
    want = out * vs[heads][:, None]
    sc.output(out)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="pass a Python float"):
        scales.resolve(torch.device("cpu"), HQ, HK, k_scale=torch.tensor(2.0))


def test_ragged_ignores_scales(demu):
    """FlashInfer 0.7.2's fa2/fa3 ragged run ignores q/k/v scales for fp16/bf16 K/V."""
    g = _gen(_seed())
    qo = torch.tensor([0, 5, 9], dtype=torch.int32)
    r = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(16))
    r.plan(qo, qo, HQ, HK, D, causal=True, q_data_type=BF16)
    q = torch.randn(9, HQ, D, generator=g).to(BF16)
    k, v = (torch.randn(9, HK, D, generator=g).to(BF16) for _ in range(2))
    a = r.run(q, k, v)
    b = r.run(q, k, v, q_scale=2.0, k_scale=3.0, v_scale=0.5, o_scale=2.0)
    assert torch.equal(a, b)


# ---- forward ------------------------------------------------------------------------------------
def test_decode_forward_applies_options(demu):
    q, cache, indptr, indices, last = _decode_setup([40, 90, 17])
    bufs = [_fake_cuda(torch.zeros(n, dtype=torch.int32)) for n in (4, 64, 3)]
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16), "NHD", True, False, *bufs)  # capturable
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
    plain = len(demu.loads)
    out = w.forward(q, cache, sm_scale=0.2, logits_soft_cap=30.0, k_scale=2.0, v_scale=None)
    fam, params, args = _decode_launch(demu)
    assert "SoftCap" in params["variant"] and args[12] == pytest.approx(0.4) and args[14] == pytest.approx(30.0)
    ref, _ = _ref_decode(q, cache, indptr, indices, last, sm_scale=0.4, logits_soft_cap=30.0)
    _close(out, ref)
    assert len(demu.loads) == plain + 1  # the soft-cap kernel, loaded once
    out2, lse = w.forward_return_lse(q, cache, sm_scale=0.2, logits_soft_cap=50.0, window_left=10)
    ref, rl = _ref_decode(q, cache, indptr, indices, last, sm_scale=0.2, logits_soft_cap=50.0, window_left=10)
    _close(out2, ref)
    assert w._logits_soft_cap == 0.0 and w._window_left == -1  # the plan's values stay
    w.forward(q, cache, sm_scale=0.2, logits_soft_cap=30.0)
    assert len(demu.loads) == plain + 2  # soft-cap reused; soft-cap + window loaded once
    demu.state["capturing"] = True
    try:
        with pytest.raises(ValueError, match="pass them to plan"):
            w.forward(q, cache, window_left=5)  # window alone: never loaded
        w.forward(q, cache, logits_soft_cap=30.0)  # loaded before the capture: reused
    finally:
        demu.state["capturing"] = False
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        w.forward(q, cache, pos_encoding_mode="ALIBI")


def test_prefill_forward_applies_options(demu):
    g = _gen(_seed())
    qo_lens, kv_lens = [3, 20], [30, 20]
    qo = torch.tensor([0, 3, 23], dtype=torch.int32)
    kv = torch.tensor([0, 30, 50], dtype=torch.int32)
    r = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(16))
    r.begin_forward(qo, kv, HQ, HK, D, q_data_type=BF16)  # SGLang: causal only at forward
    q = torch.randn(23, HQ, D, generator=g).to(BF16)
    k, v = (torch.randn(50, HK, D, generator=g).to(BF16) for _ in range(2))
    o, s = r.forward_return_lse(q, k, v, causal=True, sm_scale=0.1, logits_soft_cap=30.0)
    assert r._causal is True  # re-planned causal (as FlashInfer's forward switches its mask mode)
    fam, params, args = launches(demu, "batch_prefill_sm90")[-1]
    assert params["causal"] and params["soft_cap"] and args[13] == pytest.approx(30.0)
    ro, rl = ragged_reference(q, k, v, qo, kv, causal=True, sm_scale=0.1, logits_soft_cap=30.0)
    _close(o, ro)
    o = r.forward(q, k, v, causal=True, window_left=4)
    ro, _ = ragged_reference(q, k, v, qo, kv, causal=True, window_left=4)
    _close(o, ro)
    assert r._window_left == -1 and r._logits_soft_cap == 0.0
    del qo_lens, kv_lens


def test_paged_forward_scales_and_3d_cache(demu):
    g = _gen(_seed())
    kv_lens = [9, 33]
    cache, indptr, indices, last = paged_batch(kv_lens, 1, HK, D, BF16, g)
    k3, v3 = (c[:, 0] for c in cache)  # [tokens, heads, dim]: SGLang's page-size-1 pool
    qo = torch.tensor([0, 4, 9], dtype=torch.int32)
    p = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(16))
    p.begin_forward(qo, indptr, indices, last, HQ, HK, D, 1, q_data_type=BF16, kv_data_type=BF16)
    q = torch.randn(9, HQ, D, generator=g).to(BF16)
    o = p.forward(q, (k3, v3), causal=True, sm_scale=0.15, k_scale=2.0, v_scale=0.5, logits_soft_cap=20.0)
    ro, _ = paged_reference(q, cache, qo, indptr, indices, last, causal=True, sm_scale=0.3, logits_soft_cap=20.0)
    _close(o.float() / 0.5, ro)
    q1, cache1, ip1, ix1, l1 = _decode_setup(page_size=1)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    w.plan(ip1, ix1, l1, HQ, HK, D, 1, q_data_type=BF16)
    a = w.run(q1, cache1)
    b = w.run(q1, tuple(c[:, 0] for c in cache1))
    assert torch.equal(a, b)


# ---- attributes, workspace_size ------------------------------------------------------------------
def test_private_attributes(demu):
    q, cache, indptr, indices, last = _decode_setup([5, 6])
    bufs = [_fake_cuda(torch.zeros(n, dtype=torch.int32)) for n in (3, 64, 2)]
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16), "NHD", True, True, *bufs)
    assert w._backend == "auto" and w._cached_module is None and w.use_tensor_cores and w._use_tensor_cores
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, sm_scale=0.25, window_left=3)
    assert w._backend == "fa2" and w._fixed_batch_size == 2 and w._sm_scale == 0.25 and w._window_left == 3
    assert w._logits_soft_cap == 0.0 and w._q_len_per_req == 1 and w._cached_module is not None
    assert w._paged_kv_indptr_buf is bufs[0] and w._paged_kv_indices_buf is bufs[1]
    assert w._paged_kv_last_page_len_buf is bufs[2] and torch.equal(bufs[2], last)
    for name in ("_float_workspace_buffer", "_int_workspace_buffer", "_pin_memory_int_workspace_buffer"):
        assert isinstance(getattr(w, name), torch.Tensor)
    w._window_left = 4  # vLLM's fast path sets the run's scalars: they take effect (same kernel)
    w._sm_scale = 0.5
    assert w._window_left == 4 and w._sm_scale == 0.5
    with pytest.raises(ValueError, match="call plan"):
        w._logits_soft_cap = 30.0  # would need the soft-cap kernel
    with pytest.raises(ValueError, match="call plan"):
        w._pos_encoding_mode = "ALIBI"
    with pytest.raises(AttributeError):
        w._fixed_batch_size = 3
    with pytest.raises(AttributeError):
        w.use_tensor_cores = False
    p = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(16))
    p.plan(torch.tensor([0, 1, 2]), indptr, indices, last, HQ, HK, D, PS, causal=True, q_data_type=BF16)
    assert p._causal and p._window_left == -1 and p._logits_soft_cap == 0.0


def test_workspace_size(demu):
    q, cache, indptr, indices, last = _decode_setup()
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    f, i = w.workspace_size(indptr, indices, last, HQ, HK, D, PS)
    assert i == 0 and 0 < f <= 16 << 20 and w._state is None and w._planner is None
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
    assert w._planner.layout.total_bytes == f


# ---- fast re-plans ------------------------------------------------------------------------------
def test_fast_decode_plan_graph_mode(demu):
    bs = 3
    q, cache, indptr, indices, last = _decode_setup([20, 50, 9], page_size=1)
    ip_buf = _fake_cuda(torch.zeros(bs + 1, dtype=torch.int32))
    ix_buf = _fake_cuda(torch.zeros(256, dtype=torch.int32))
    lp_buf = _fake_cuda(torch.ones(bs, dtype=torch.int32))
    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16), ip_buf, ix_buf, lp_buf)
    with pytest.raises(RuntimeError, match="prior plan"):
        fast_decode_plan(w, indptr, indices, last, HQ, HK, D, 1)
    w.plan(indptr, indices, last, HQ, HK, D, 1, q_data_type=BF16)
    # new lengths, written in place by the caller (SGLang); fast_decode_plan copies nothing
    g = _gen(_seed())
    cache2, indptr2, indices2, last2 = paged_batch([7, 64, 33], 1, HK, D, BF16, g)
    ip_buf.copy_(indptr2)
    ix_buf[: indices2.numel()].copy_(indices2)
    before = ix_buf.clone()
    dev_indptr = _fake_cuda(torch.full((bs + 1,), 10**6, dtype=torch.int32))  # never read: the override wins
    fast_decode_plan(
        w,
        dev_indptr,
        ix_buf,
        lp_buf,
        HQ,
        HK,
        D,
        1,
        data_type=BF16,
        q_data_type=BF16,
        global_override_indptr_cpu=indptr2,
    )
    assert torch.equal(ix_buf, before) and torch.equal(ip_buf, indptr2)
    assert list(w._state.kv_lens) == [7, 64, 33]
    q2 = torch.randn(bs, HQ, D, generator=g).to(BF16)
    _close(w.run(q2, cache2), _ref_decode(q2, cache2, indptr2, indices2, last2)[0])
    with pytest.raises(ValueError, match="fixed in CUDA-graph mode"):
        fast_decode_plan(w, indptr2[:3], ix_buf, lp_buf[:2], HQ, HK, D, 1, global_override_indptr_cpu=indptr2[:3])
    with pytest.raises(ValueError, match="differs from the first plan"):
        fast_decode_plan(
            w, indptr2, ix_buf, lp_buf, HQ, HK, D, 1, q_data_type=torch.float16, global_override_indptr_cpu=indptr2
        )
    with pytest.raises(ValueError, match="cannot serve this window_left"):
        fast_decode_plan(
            w, indptr2, ix_buf, lp_buf, HQ, HK, D, 1, logits_soft_cap=30.0, global_override_indptr_cpu=indptr2
        )


def test_cached_module_plan(demu):
    """vLLM's fast path: wrapper._cached_module.plan(...) with 19 (fa2) or 20 arguments."""
    bs = 3
    q, cache, indptr, indices, last = _decode_setup([20, 50, 9])
    ip_buf = _fake_cuda(torch.zeros(bs + 1, dtype=torch.int32))
    ix_buf = _fake_cuda(torch.zeros(64, dtype=torch.int32))
    lp_buf = _fake_cuda(torch.zeros(bs, dtype=torch.int32))
    w = BatchDecodeWithPagedKVCacheWrapper(
        _cpu_ws(16),
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=ip_buf,
        paged_kv_indices_buffer=ix_buf,
        paged_kv_last_page_len_buffer=lp_buf,
    )
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, sm_scale=0.2)
    g = _gen(_seed())
    cache2, indptr2, indices2, last2 = paged_batch([70, 5, 40], PS, HK, D, BF16, g)
    ip_buf.copy_(indptr2)
    ix_buf[: indices2.numel()].copy_(indices2)
    seq = torch.tensor([70, 5, 40], dtype=torch.int32)
    qo_host = torch.arange(bs + 1, dtype=torch.int32)
    for extra in ([-1, False, 0], [-1, False, 0, 0]):
        info = w._cached_module.plan(
            w._float_workspace_buffer,
            w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer,
            qo_host,
            indptr2,
            seq,
            bs,
            bs,
            HQ,
            HK,
            PS,
            True,
            D,
            D,
            False,
            -1,
            *extra,
        )
        assert info is not None
        q2 = torch.randn(bs, HQ, D, generator=g).to(BF16)
        _close(w.run(q2, cache2), _ref_decode(q2, cache2, indptr2, indices2, last2, sm_scale=0.2)[0])


# ---- several query tokens per request -------------------------------------------------------------
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])  # Blackwell: the portable prefill kernel
def test_q_len_per_req(demu, graph, arch):
    demu.state["arch"] = arch
    n, kv_lens = 3, [9, 40, 3]
    bs = len(kv_lens)
    g = _gen(_seed())
    cache, indptr, indices, last = paged_batch(kv_lens, PS, HK, D, BF16, g)
    ctor = {}
    if graph:
        ctor = dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=_fake_cuda(torch.zeros(bs + 1, dtype=torch.int32)),
            paged_kv_indices_buffer=_fake_cuda(torch.zeros(32, dtype=torch.int32)),
            paged_kv_last_page_len_buffer=_fake_cuda(torch.zeros(bs, dtype=torch.int32)),
        )
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(32), "NHD", use_tensor_cores=True, **ctor)
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, q_len_per_req=n)
    assert w._q_len_per_req == n and launches(demu, "paged_decode") == []
    q = torch.randn(bs * n, HQ, D, generator=g).to(BF16)
    out, lse = w.run(q, cache, return_lse=True)
    fam, params, _ = launches(demu, "batch_prefill_sm90" if arch == "sm_90a" else "batch_prefill_mma")[-1]
    assert params["causal"]
    qo = torch.arange(bs + 1, dtype=torch.int32) * n
    ro, rl = paged_reference(q, cache, qo, indptr, indices, last, causal=True)
    _close(out, ro)
    o_fwd = w.forward(q, tuple(c for c in cache), sm_scale=0.1)  # forward on the multi-token plan
    _close(o_fwd, paged_reference(q, cache, qo, indptr, indices, last, causal=True, sm_scale=0.1)[0])
    if not graph:
        with pytest.raises(ValueError, match="tokens per request"):
            w.run(q[: bs * 2], cache)
    if not graph:
        with pytest.raises(ValueError, match="kv_len >= 4"):
            w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16, q_len_per_req=4)
    if graph:
        with pytest.raises(ValueError, match="q_len_per_req"):
            w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=BF16)
        fast_decode_plan(
            w,
            indptr,
            w._paged_kv_indices_buf,
            last,
            HQ,
            HK,
            D,
            PS,
            q_data_type=BF16,
            q_len_per_req=n,
            global_override_indptr_cpu=indptr,
        )
        out2 = w.run(q, cache)
        assert torch.equal(out2, out)


# ---- head dims 80 / 96: 160- / 192-byte rows on the decode kernel; an fp8 cache on the prefill path -----
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("d", [80, 96])
def test_decode_head_dim_80_96(demu, d, graph):
    """Decode at head dim 96 (Phi-3-mini's) or 80 (Phi-2's) runs the decode kernel (a length-0
    request gives out 0, LSE -inf; fast_decode_plan re-plans in graph mode), packs at most two
    (96) or four (80) kv heads per item, and with an fp8 cache -- which the decode kernel does not
    read at 80 / 96 -- plans the paged prefill of one causal row per request (FlashInfer's
    tensor-core decode)."""
    kv_lens = [9, 40, 0, 70]
    bs = len(kv_lens)
    g = _gen(_seed())
    cache, indptr, indices, last = paged_batch(kv_lens, PS, HK, d, BF16, g)
    ctor = {}
    if graph:
        ctor = dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=_fake_cuda(torch.zeros(bs + 1, dtype=torch.int32)),
            paged_kv_indices_buffer=_fake_cuda(torch.zeros(32, dtype=torch.int32)),
            paged_kv_last_page_len_buffer=_fake_cuda(torch.zeros(bs, dtype=torch.int32)),
        )
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(32), "NHD", **ctor)
    w.plan(indptr, indices, last, HQ, HK, d, PS, q_data_type=BF16, logits_soft_cap=30.0)
    assert not w._routed
    q = torch.randn(bs, HQ, d, generator=g).to(BF16)
    out, lse = w.run(q, cache, return_lse=True)
    fam, params, _ = launches(demu, "paged_decode")[-1]
    assert params["head_dim"] == d and params["stages"] == 4 and "kv_dtype" not in params
    ro, rl = paged_reference(q, cache, None, indptr, indices, last, logits_soft_cap=30.0)
    _close(out, ro)
    assert torch.equal(out[2].float(), torch.zeros_like(out[2].float())) and torch.isinf(lse[2]).all()
    if graph:
        kv2 = [10, 41, 1, 71]
        cache2, indptr2, indices2, last2 = paged_batch(kv2, PS, HK, d, BF16, g)
        for buf, t in ((w._paged_kv_indptr_buf, indptr2), (w._paged_kv_last_page_len_buf, last2)):
            buf.copy_(t)  # in graph mode the engine writes the index buffers in place
        w._paged_kv_indices_buf[: indices2.numel()].copy_(indices2)
        fast_decode_plan(w, indptr2, w._paged_kv_indices_buf, last2, HQ, HK, d, PS, q_data_type=BF16,
                         logits_soft_cap=30.0, global_override_indptr_cpu=indptr2)  # fmt: skip
        ro2, _ = paged_reference(q, cache2, None, indptr2, indices2, last2, logits_soft_cap=30.0)
        _close(w.run(q, cache2), ro2)
        return
    w.plan(indptr, indices, last, HQ, HK, d, PS, q_data_type=BF16, heads_per_item=2)
    _close(w.run(q, cache), paged_reference(q, cache, None, indptr, indices, last)[0])
    assert launches(demu, "paged_decode")[-1][1]["heads_per_item"] == 2
    if d == 96:
        with pytest.raises(ValueError, match="head dim 96 packs at most 2"):
            w.plan(indptr, indices, last, 8 * HK, HK, d, PS, q_data_type=BF16, heads_per_item=4)
    # an fp8 cache at 80 / 96: the paged prefill kernel, after the KV pass
    f8 = tuple(t.to(torch.float8_e4m3fn) for t in cache)
    w.plan(indptr, indices, last, HQ, HK, d, PS, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
    assert w._routed
    out8 = w.run(q, f8)
    assert launches(demu, "batch_prefill_sm90")[-1][1]["head_dim"] == d
    qo = torch.arange(bs + 1, dtype=torch.int32)
    _close(out8, paged_reference(q, tuple(t.to(BF16) for t in f8), qo, indptr, indices, last, causal=True)[0])
    demu.state["arch"] = "sm_100a"  # Blackwell: the same decode kernel
    w.plan(indptr, indices, last, HQ, HK, d, PS, q_data_type=BF16)
    _close(w.run(q, cache), paged_reference(q, cache, None, indptr, indices, last)[0])
    assert not w._routed and launches(demu, "paged_decode")[-1][1]["head_dim"] == d


# ---- deprecated shared-prefix wrappers --------------------------------------------------------------
def test_shared_prefix_wrappers(demu, monkeypatch):
    import cute_attn.wrappers.single as S

    cpu = torch.device("cpu")  # single_prefill's private wrappers, on fake-CUDA workspaces
    monkeypatch.setattr(S, "_PREFILL", {(cpu, dt): S._GrowingRaggedWrapper(_cpu_ws(16)) for dt in (BF16, torch.half)})
    g = _gen(_seed())
    bs, prefix = 3, 37
    k_s, v_s = (torch.randn(prefix, HK, D, generator=g).to(BF16) for _ in range(2))
    unique = [5, 18, 1]
    cache, indptr, indices, last = paged_batch(unique, PS, HK, D, BF16, g)
    q = _fake_cuda(torch.randn(bs, HQ, D, generator=g).to(BF16))  # single_prefill checks q.is_cuda
    w = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_cpu_ws(16))
    w.begin_forward(indptr, indices, last, HQ, HK, D, PS, data_type=BF16)
    # FlashInfer's deprecated wrapper leaves q_data_type at float16: pass bf16 q after planning bf16
    out = w.forward(q, k_s, v_s, cache)
    w.end_forward()
    ref = _shared_ref(q, k_s, v_s, cache, indptr, indices, last, torch.arange(bs + 1, dtype=torch.int32), False)
    _close(out, ref)
    qo_lens = [2, 4, 1]
    qo = torch.tensor([0, 2, 6, 7], dtype=torch.int32)
    q = _fake_cuda(torch.randn(7, HQ, D, generator=g).to(BF16))
    cache, indptr, indices, last = paged_batch([6, 9, 4], PS, HK, D, BF16, g)
    p = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_cpu_ws(16))
    p.begin_forward(qo, indptr, indices, last, HQ, HK, D, PS)
    out = p.forward(q.half(), k_s.half(), v_s.half(), tuple(c.half() for c in cache), causal=True)
    ref = _shared_ref(q.half(), k_s.half(), v_s.half(), tuple(c.half() for c in cache), indptr, indices, last, qo, True)
    _close(out, ref)
    del qo_lens


def _shared_ref(q, k_s, v_s, cache, indptr, indices, last, qo, causal):
    from cute_attn.testing import merge_state_reference

    o1, l1 = single_reference(q, k_s, v_s)
    o2, l2 = paged_reference(q, cache, qo, indptr, indices, last, causal=causal)
    return merge_state_reference(o1, l1, o2, l2)[0]


# ---- causal with qo_len > kv_len ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_causal_qo_longer_than_kv(demu, kind):
    """Bottom-right aligned: query i of a request with qo > kv sees keys <= kv - qo + i; the
    leading qo - kv rows see none -> out 0, lse -inf (as FlashInfer)."""
    g = _gen(_seed())
    qo_lens, kv_lens = [7, 3, 130, 2], [2, 3, 40, 0]
    qo = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    q = torch.randn(int(qo[-1]), HQ, D, generator=g).to(BF16)
    if kind == "ragged":
        kv = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)
        k, v = (torch.randn(int(kv[-1]), HK, D, generator=g).to(BF16) for _ in range(2))
        w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(16))
        w.plan(qo, kv, HQ, HK, D, causal=True, q_data_type=BF16)
        out, lse = w.run(q, k, v, out=nan_like(q), return_lse=True)
        ro, rl = ragged_reference(q, k, v, qo, kv, causal=True)
    else:
        cache, indptr, indices, last = paged_batch(kv_lens, 4, HK, D, BF16, g)
        w = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(16))
        w.plan(qo, indptr, indices, last, HQ, HK, D, 4, causal=True, q_data_type=BF16)
        out, lse = w.run(q, cache, out=nan_like(q), return_lse=True)
        ro, rl = paged_reference(q, cache, qo, indptr, indices, last, causal=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    dead = torch.isinf(rl)
    assert dead.any() and torch.equal(torch.isinf(lse), dead) and (lse[dead] < 0).all()
    assert (out[dead[:, :, None].expand_as(out)] == 0).all()
    _close(out, ro)
    assert (lse[~dead] - rl[~dead]).abs().max() < 1e-2


# ---- 16 MiB -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [128, 256])
def test_plans_fit_16mib(demu, monkeypatch, d):
    """FlashInfer's tests' cases run in its usual 16 MiB workspace here too (an H200's 132 SMs)."""
    import cute_attn.wrappers.decode as Dm
    import cute_attn.wrappers.prefill_base as P
    from cute_attn.sched import WorkspaceLayout

    for m in (Dm, P):
        monkeypatch.setattr(m, "sm_count_of_index", lambda i: 132)
    ws = 16 << 20
    g = _gen(_seed())
    # 1 request x 8 tokens, prefill
    r = BatchPrefillWithRaggedKVCacheWrapper(_fake_cuda(torch.empty(ws, dtype=torch.uint8)))
    r.plan(torch.tensor([0, 8]), torch.tensor([0, 8]), 32, 8, d, causal=True, q_data_type=BF16)
    assert WorkspaceLayout(r._planner.limits, r._planner.num_ctas).total_bytes <= ws
    q = torch.randn(8, 32, d, generator=g).to(BF16)
    k, v = (torch.randn(8, 8, d, generator=g).to(BF16) for _ in range(2))
    _close(r.run(q, k, v), ragged_reference(q, k, v, torch.tensor([0, 8]), torch.tensor([0, 8]), causal=True)[0])
    # batch 1-8 decode
    for bs in (1, 2, 4, 8):
        w = BatchDecodeWithPagedKVCacheWrapper(_fake_cuda(torch.empty(ws, dtype=torch.uint8)))
        kv_lens = [random.randint(1, 300) for _ in range(bs)]
        cache, indptr, indices, last = paged_batch(kv_lens, PS, 8, d, BF16, g)
        assert w.workspace_size(indptr, indices, last, 32, 8, d, PS)[0] <= ws
        w.plan(indptr, indices, last, 32, 8, d, PS, q_data_type=BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_gpu_causal_qo_longer_than_kv(kind):
    """The kernel's rows that see no key (qo_len > kv_len, causal): out 0, lse -inf; bf16, 32 / 8
    heads, head_dim 128, page size 16 (tile 128 specs of the ``all`` preset)."""
    g = _gen(_seed())
    hq, hk, d = 32, 8, 128
    qo_lens, kv_lens = [70, 3, 130, 2], [20, 3, 40, 0]
    qo = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    q = torch.randn(int(qo[-1]), hq, d, generator=g).to(BF16).cuda()
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    if kind == "ragged":
        kv = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)
        k, v = (torch.randn(int(kv[-1]), hk, d, generator=g).to(BF16).cuda() for _ in range(2))
        w = BatchPrefillWithRaggedKVCacheWrapper(ws)
        w.plan(qo, kv, hq, hk, d, causal=True, q_data_type=BF16)
        out, lse = w.run(q, k, v, out=nan_like(q), return_lse=True)
        ro, rl = ragged_reference(q, k, v, qo, kv, causal=True)
    else:
        cache, indptr, indices, last = paged_batch(kv_lens, 16, hk, d, BF16, g)
        cache = tuple(c.cuda() for c in cache)
        w = BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(qo, indptr, indices.cuda(), last, hq, hk, d, 16, causal=True, q_data_type=BF16)
        out, lse = w.run(q, cache, out=nan_like(q), return_lse=True)
        ro, rl = paged_reference(q, cache, qo, indptr, indices, last, causal=True)
    out, lse, ro, rl = out.cpu(), lse.cpu(), ro.cpu(), rl.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    dead = torch.isinf(rl)
    assert dead.any() and torch.equal(torch.isinf(lse), dead)
    assert (out[dead[:, :, None].expand_as(out)] == 0).all()
    _close(out, ro)


@pytest.mark.parametrize(
    "lens,hq,hk,d,kv,want",
    [
        ([4096] * 64, 64, 8, 64, None, 2),  # gpt-oss 64 x 4k: 256 items of two heads, about one per CTA
        ([4096] * 63, 64, 8, 64, None, 2),
        ([4096] * 60, 64, 8, 64, None, 1),  # 240 items: under 0.95 of the 264 CTAs
        ([4096] * 66, 64, 8, 64, None, 2),  # 264 items: one each
        ([4096] * 67, 64, 8, 64, None, 1),  # 268: more items than CTAs (and under 1.9 per CTA)
        ([4096] * 64, 64, 8, 128, None, 1),  # head dim 128, 16-bit: 256-byte rows, the rule before
        ([4096] * 64, 64, 8, 64, "e4m3", 1),  # head dim 64 fp8: 64-byte rows, the rule before
        ([4096] * 64, 32, 8, 128, "e4m3", 2),  # head dim 128 fp8: 128-byte rows, as 16-bit hd64
        ([4096] * 60, 32, 8, 128, "e4m3", 1),  # 240 items: under 0.95 of the 264 CTAs
        ([1024] * 256, 32, 8, 64, None, 4),  # 512 items of four heads: the 1.9-per-CTA rule
        ([4096] * 63 + [6000], 64, 8, 64, None, 1),  # one item 1.5x a CTA's share
        ([1024] * 256, 64, 8, 64, None, 2),  # GQA 8: four heads (32-row tiles) only when asked for
    ],
)
def test_128_byte_rows_pack_one_whole_item_per_cta(lens, hq, hk, d, kv, want):
    """The default head packing for 128-byte cache rows (``decode_packing.ONE_ITEM_ROW_BYTES``:
    head dim 64 16-bit, 128 fp8): also where the packed items are 0.95-1 per CTA and none is
    longer than 5 % over a CTA's share (264 CTAs)."""
    from cute_attn.wrappers.decode import BatchDecodeWithPagedKVCacheWrapper as W

    w = W.__new__(W)
    w._use_cuda_graph, w._graph_hpi = False, None
    got = w._heads_per_item(None, np.array(lens), hq, hk, 264, False, True, None, kv, d)
    assert got == want


# ---- fp8 KV in the single-request functions ---------------------------------------------------------
def test_single_decode_fp8_kv(demu, monkeypatch):
    """single_decode_with_kv_cache on an e4m3 K / V: plans the fp8 decode kernel (kv_data_type
    from k) and applies k_scale to the logits and v_scale to the output, as FlashInfer; against
    the reference on the dequantized K / V."""
    import cute_attn.wrappers.single as S
    from cute_attn import single_decode_with_kv_cache

    cpu = torch.device("cpu")  # its private wrapper, on a fake-CUDA workspace
    monkeypatch.setattr(S, "_DECODE", {(cpu, BF16): BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))})
    g = _gen(_seed())
    kv_len, hq, hk = 77, HQ, HK
    q = _fake_cuda(torch.randn(hq, D, generator=g).to(BF16))
    k8 = (torch.randn(kv_len, hk, D, generator=g) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(kv_len, hk, D, generator=g) * 2).to(torch.float8_e4m3fn)
    out, lse = single_decode_with_kv_cache(q, k8, v8, k_scale=0.5, v_scale=1.5, return_lse=True)
    fam, params, _ = launches(demu, "paged_decode")[-1]
    assert params.get("kv_dtype") == "e4m3"
    ro, rl = single_reference(q.float(), k8.float() * 0.5, v8.float() * 1.5)
    _close(out.unsqueeze(0), ro.unsqueeze(0))
    # per-kv-head scales (cute_attn's extension): the reference scales each kv head's K / V
    ks, vs = (torch.rand(hk, generator=g) + 0.25 for _ in range(2))
    out2 = single_decode_with_kv_cache(q, k8, v8, k_scale=ks, v_scale=vs)
    assert launches(demu, "paged_decode")[-1][2][12] == pytest.approx(1 / math.sqrt(D))
    ro2, _ = single_reference(q.float(), k8.float() * ks[:, None], v8.float() * vs[:, None])
    _close(out2.unsqueeze(0), ro2.unsqueeze(0))
