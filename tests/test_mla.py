"""CPU tests of the MLA wrapper (issue 25): the reference, the family's specs / ABI / backend,
the wrapper's wiring with the kernel emulated on the exact tensors run() passes (after the real
argument packer) -- batch sizes, lengths 0 / 1 / odd / long, page sizes 1 / 16 / 64, 8-128
heads, 1-4 tokens per request, causal, split-KV, SGLang's strided views, the packed and
metadata forms, CUDA-graph re-plans and SGLang's fast re-plan -- and bad input, each a clear
error before any launch."""

import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_helpers import CKV, KPE, check, emulate_mla, gen, make_batch, reference  # noqa: E402
from test_prefill_gpu import _emulate_merge, _fake_cuda, _FakeEvent, _plain  # noqa: E402

from cute_attn.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # noqa: E402

BF16 = torch.bfloat16
NUM_SMS = 8
SM = 1.0 / math.sqrt(128 + 64)  # DeepSeek's scale: the head dim before absorption


class _Emulated:
    def __init__(self, family, params, calls):
        from cute_attn.families.base import get_family
        from cute_attn.runtime.loader import make_packer

        self.family, self.params, self.calls = family, dict(params), calls
        self.pack = make_packer(get_family(family).abi(params))

    def __call__(self, *args):
        args = [_plain(a) for a in args]
        self.pack(*args)  # the real ABI checks: shapes, strides, alignment
        self.calls.append((self.family, self.params, args))
        if self.family in ("mla_decode", "mla_decode_sm90"):
            emulate_mla(self.params, *args)
        else:
            _emulate_merge(self.params, *args)


@pytest.fixture
def memu(monkeypatch):
    """The MLA wrapper on the CPU: GPU queries patched, the kernels emulated; ``calls`` records
    the launches, ``loads`` the kernels requested, ``state`` the capture flag."""
    import cute_attn.wrappers.mla as M

    calls, loads = [], []
    state = {"capturing": False}

    def kernel(family, arch, **params):
        loads.append((family, dict(params)))
        return _Emulated(family, params, calls)

    monkeypatch.setattr(M, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(M, "sm_count_of_index", lambda i: NUM_SMS)
    monkeypatch.setattr(M, "kernel", kernel)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return type("Emu", (), {"calls": calls, "loads": loads, "state": state})()


@pytest.fixture
def nolaunch(memu, monkeypatch):
    """As ``memu``, but a launch is a test failure: bad input must raise before any."""
    import cute_attn.wrappers.mla as M

    class Fail:
        def __init__(self, family, arch, **p):
            self.family = family

        def __call__(self, *a):
            raise AssertionError(f"{self.family} launched on bad input")

    monkeypatch.setattr(M, "kernel", Fail)
    return memu


def _ws(mb=64):
    return _fake_cuda(torch.empty(mb << 20, dtype=torch.uint8))


def _plan(w, b, heads, page_size, causal=False, sm_scale=SM, dtype=BF16, **kw):
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w.plan(qo, kvp, idx, kvl, heads, CKV, KPE, page_size, causal, sm_scale, dtype, dtype, **kw)


def _run(qo_lens, kv_lens, heads, page_size, causal, *, packed=False, seed=None, mb=64):
    b = make_batch(qo_lens, kv_lens, heads, page_size, BF16, gen(seed), packed=packed)
    w = BatchMLAPagedAttentionWrapper(_ws(mb))
    _plan(w, b, heads, page_size, causal)
    out, lse = w.run(b[0], b[1], b[2], b[3], return_lse=True)
    return w, b, out, lse


# ---- the reference -------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_a_naive_loop(causal):
    g = gen()
    qo_lens, kv_lens, heads, ps = [1, 3, 0, 2], [5, 7, 4, 1], 3, 4
    b = make_batch(qo_lens, kv_lens, heads, ps, torch.float32, g)
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    out, lse = reference(b, 0.3, causal, torch.float64)
    for r in range(len(qo_lens)):
        for t in range(qo_lens[r]):
            tok = int(qo[r]) + t
            for h in range(heads):
                s, vs = [], []
                for j in range(kv_lens[r]):
                    if causal and j > kv_lens[r] - qo_lens[r] + t:
                        continue
                    page, slot = int(idx[int(kvp[r]) + j // ps]), j % ps
                    k = torch.cat([ckv[page, slot], kpe[page, slot]]).double()
                    s.append(float(torch.cat([qn[tok, h], qp[tok, h]]).double() @ k) * 0.3)
                    vs.append(ckv[page, slot].double())
                if not s:
                    assert lse[tok, h] == -math.inf and (out[tok, h] == 0).all()
                    continue
                p = torch.softmax(torch.tensor(s, dtype=torch.float64), 0)
                want = sum(pi * v for pi, v in zip(p, vs))
                assert torch.allclose(out[tok, h], want, atol=1e-9)
                lse_want = math.log2(sum(math.exp(x) for x in s))
                # the LSE is stored in fp32: 1e-6 relative (its rounding is 6e-8 relative)
                assert abs(float(lse[tok, h]) - lse_want) < 1e-6 * max(1.0, abs(lse_want))


# ---- the family ------------------------------------------------------------------------------
def test_specs_backend_and_abi():
    from cute_attn.families.backends import backend_for
    from cute_attn.families.base import get_family
    from cute_attn.families.mla import (
        STAGES,
        STAGES_FP8,
        TILES,
        mla_sm90_spec,
        mla_spec,
        shipped_specs,
        shipped_specs_sm90,
    )
    from cute_attn.presets import preset_specs

    for arch in ("sm_90a", "sm_100a"):
        b = backend_for("mla_decode", arch)
        # CTAs per SM come from families.mla.ctas_per_sm (test_shared_memory_budget), not the backend
        assert b.family == "mla_decode" and b.tiles == TILES and not b.ctas_per_sm
        specs = set(shipped_specs(arch))
        wg = set(shipped_specs_sm90(arch))
        assert specs | wg <= set(preset_specs("default", arch)) and specs | wg == set(preset_specs("mla", arch))
        # the wgmma kernel (64-row items) ships on Hopper only, with its merge
        if arch == "sm_90a":
            assert backend_for("mla_decode", arch, "mla_wgmma").family == "mla_decode_sm90"
            for dt in ("f16", "bf16"):
                assert mla_sm90_spec(arch, dt) in wg
                assert mla_sm90_spec(arch, dt).pdict == dict(dtype=dt, head_dim_ckv=CKV, head_dim_kpe=KPE, tile_q=64,
                                                              stages=2)  # fmt: skip
                assert any(m.family == "merge_partials" and m.pdict["tile_q"] == 64 for m in wg)
        else:
            assert not wg
        for dt in ("f16", "bf16"):
            for t in TILES:
                s = mla_spec(arch, dt, t)
                assert s.pdict == dict(dtype=dt, head_dim_ckv=CKV, head_dim_kpe=KPE, tile_q=t, stages=STAGES[t])
                assert s in specs
                assert any(m.family == "merge_partials" and m.pdict == dict(dtype=dt, head_dim=CKV, tile_q=t)
                           for m in specs)  # fmt: skip
        for kv in ("e4m3", "e5m2"):  # the fp8 latent cache: its own dtype and ring depth
            for t in TILES:
                s = mla_spec(arch, "bf16", t, kv)
                assert s.pdict == dict(dtype="bf16", head_dim_ckv=CKV, head_dim_kpe=KPE, tile_q=t, stages=STAGES_FP8[t],
                                       kv_dtype=kv)  # fmt: skip
                assert s in specs and s.key != mla_spec(arch, "bf16", t).key
                abi = {a.name: a for a in get_family("mla_decode").abi(s.pdict)}
                assert abi["mCkv"].dtype == abi["mKpe"].dtype == kv and abi["mQn"].dtype == abi["mO"].dtype == "bf16"
                assert abi["mCkv"].stride_divisibility == 16
    assert mla_spec("sm_90a", "bf16", 16, "bf16") == mla_spec("sm_90a", "bf16", 16)  # a cache of the q dtype
    with pytest.raises(ValueError, match="only fp8"):
        mla_spec("sm_90a", "bf16", 16, "f16")
    with pytest.raises(ValueError, match="tile_q"):
        mla_spec("sm_90a", "bf16", 64)
    names = [a.name for a in get_family("mla_decode").abi(mla_spec("sm_90a", "bf16").pdict)]
    assert names == ["mQn", "mQp", "mCkv", "mKpe", "mKvIndptr", "mKvIndices", "mO", "mLse", "mWork",
                     "mWorkIndptr", "mPartO", "mPartLse", "group", "causal", "sm_scale", "num_ctas"]  # fmt: skip


@pytest.mark.compile
def test_abi_order_is_the_kernel_signature():
    """The ABI lists the jit entry's parameters in order (the loader packs them so)."""
    import inspect

    from cute_attn.families.base import get_family
    from cute_attn.families.mla import mla_spec
    from cute_attn.kernels.mla_decode import MlaDecode

    params = list(inspect.signature(MlaDecode.__call__).parameters)[1:-1]  # self ... stream
    assert params == [a.name for a in get_family("mla_decode").abi(mla_spec("sm_90a", "bf16").pdict)]


# ---- wiring, emulated --------------------------------------------------------------------------
CASES = [
    # qo_lens, kv_lens, heads, page_size, causal
    ([1] * 5, [1, 17, 300, 0, 64], 16, 16, False),
    ([1] * 3, [1000, 33, 5], 16, 64, False),
    ([1] * 4, [7, 1, 129, 64], 128, 1, False),
    ([2, 2, 2], [9, 40, 130], 16, 16, True),
    ([4, 4], [4, 301], 32, 64, True),
    ([1, 2, 4, 3], [3, 70, 2, 33], 64, 16, True),
    ([3, 1], [2, 5], 8, 1, True),  # causal with qo_len > kv_len: rows that see nothing
    ([17, 0, 5], [60, 3, 5], 16, 16, True),  # a chunked prefill, an empty request
    ([1], [0], 16, 16, False),
]


@pytest.mark.parametrize("qo_lens,kv_lens,heads,page_size,causal", CASES)
def test_emulated_matches_reference(memu, qo_lens, kv_lens, heads, page_size, causal):
    w, b, out, lse = _run(qo_lens, kv_lens, heads, page_size, causal)
    ref_o, ref_lse = reference(b, SM, causal)
    check(out, lse, ref_o, ref_lse, BF16)
    fam = [c for c in memu.loads if c[0].startswith("mla_decode")]
    rows = max(q * heads for q in qo_lens)
    # past 32 rows, Hopper's wgmma kernel (64-row items)
    want = ("mla_decode_sm90", 64) if rows > 32 else ("mla_decode", 32 if rows > 16 else 16)
    assert (fam[-1][0], fam[-1][1]["tile_q"]) == want


def test_split_kv_is_merged(memu):
    """Few long requests on 8 CTAs: the planner splits them, the merge runs."""
    w, b, out, lse = _run([1, 1], [3000, 1700], 16, 16, False)
    assert w._plan.has_split
    assert [c[0] for c in memu.calls] == ["mla_decode", "merge_partials"]
    check(out, lse, *reference(b, SM, False), BF16)


@pytest.mark.parametrize("form", ["views", "query_kv_packed", "query_kv_pairs"])
def test_strided_and_packed_forms(memu, form):
    """SGLang's views of 576-wide buffers (q[..., :512], k_buffer[..., :512]) and FlashInfer's
    query= / kv_cache= forms all reach the kernel as strided views (no copy)."""
    b = make_batch([1, 2], [50, 77], 16, 1, BF16, gen(), packed=True)
    qn, qp, ckv, kpe = b[:4]
    w = BatchMLAPagedAttentionWrapper(_ws())
    _plan(w, b, 16, 1, causal=True)
    if form == "views":
        out = w.run(qn, qp, ckv, kpe)
    elif form == "query_kv_packed":
        q576 = torch.as_strided(qn, (qn.shape[0], 16, CKV + KPE), qn.stride())
        kv576 = torch.as_strided(ckv, (ckv.shape[0], 1, CKV + KPE), ckv.stride())
        out = w.run(query=q576, kv_cache=kv576)
    else:
        out = w.run(query=(qn, qp), kv_cache=(ckv, kpe))
    args = memu.calls[0][2]
    assert args[0].data_ptr() == qn.data_ptr() and args[2].data_ptr() == ckv.data_ptr()
    assert args[0].stride() == qn.stride()
    ref_o, _ = reference(b, SM, True)
    assert ((out.float() - ref_o).norm() / ref_o.norm()) < 2e-2


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_batches_keep_the_views(page_size):
    """test_mla_gpu's batches on a device keep SGLang's 576-wide views (shown on the meta device).
    Its first version moved each view with ``.to(device)``, which returns a contiguous copy of a
    strided view: the GPU test of the views then failed its stride check at every page size and
    never ran the kernel on strided tensors."""
    from test_mla_gpu import device_batch

    b = device_batch([1, 2], [5, 70], 16, page_size, packed=True, device="meta")
    assert all(t.device.type == "meta" and t.stride(-2) == CKV + KPE and t.stride(-1) == 1 for t in b[:4])
    assert b[0].stride(0) == 16 * (CKV + KPE) and b[2].stride(0) == page_size * (CKV + KPE)
    assert b[1].storage_offset() == b[0].storage_offset() + CKV and b[3].storage_offset() == CKV
    assert all(not t.is_cuda and t.device.type == "cpu" for t in b[4:])


def test_metadata_forms_agree(memu):
    """Flat CSR, MLAPlanMetadata.csr and the dense page table give the same result."""
    qo_lens, kv_lens, ps = [1, 1, 1], [40, 3, 17], 16
    b = make_batch(qo_lens, kv_lens, 16, ps, BF16, gen())
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w = BatchMLAPagedAttentionWrapper(_ws())
    _plan(w, b, 16, ps)
    want = w.run(qn, qp, ckv, kpe).clone()
    common = dict(num_heads=16, head_dim_ckv=CKV, head_dim_kpe=KPE, page_size=ps, causal=False, sm_scale=SM,
                  q_data_type=BF16, kv_data_type=BF16)  # fmt: skip
    w.plan(metadata=MLAPlanMetadata.csr(qo, kvp, idx, kvl), **common)
    assert torch.equal(w.run(qn, qp, ckv, kpe), want)
    width = max(int(kvp[i + 1] - kvp[i]) for i in range(3))
    tables = torch.zeros(3, width, dtype=torch.int32)
    for i in range(3):
        tables[i, : int(kvp[i + 1] - kvp[i])] = idx[int(kvp[i]) : int(kvp[i + 1])]
    w.plan(cum_seq_lens_q=qo, block_tables=tables, seq_lens=kvl, max_q_len=1, **common)
    assert torch.equal(w.run(qn, qp, ckv, kpe), want)
    w.plan(metadata=MLAPlanMetadata.dense(qo, tables, kvl), **common)
    assert torch.equal(w.run(qn, qp, ckv, kpe), want)


def test_lse_bases(memu):
    w, b, out, lse2 = _run([1, 1], [30, 9], 16, 16, False)
    _, lse_e = w.run(*b[:4], return_lse=True, return_lse_base_on_e=True)
    assert torch.allclose(lse_e, lse2 * math.log(2.0))
    _plan(w, b, 16, 16, lse_mode="basee")
    _, lse_e2 = w.run(*b[:4], return_lse=True)
    assert torch.allclose(lse_e2, lse_e)


def test_caller_out_and_lse(memu):
    w, b, out, lse = _run([1, 1, 1], [5, 60, 1], 16, 16, False)
    o2 = torch.full_like(out, float("nan"))
    l2 = torch.full_like(lse, float("nan"))
    r = w.run(*b[:4], out=o2, lse=l2, return_lse=True)
    assert r[0] is o2 and r[1] is l2 and torch.equal(o2, out) and torch.equal(l2, lse)


# ---- CUDA-graph mode ---------------------------------------------------------------------------
def _graph_wrapper(max_batch, max_pages):
    bufs = dict(
        qo_indptr=_fake_cuda(torch.zeros(max_batch + 1, dtype=torch.int32)),
        kv_indptr=_fake_cuda(torch.zeros(max_batch + 1, dtype=torch.int32)),
        kv_indices=_fake_cuda(torch.zeros(max_pages, dtype=torch.int32)),
        kv_len_arr=_fake_cuda(torch.zeros(max_batch, dtype=torch.int32)),
    )
    return BatchMLAPagedAttentionWrapper(_ws(), use_cuda_graph=True, **bufs), bufs


def test_cuda_graph_replans_keep_buffers(memu):
    """Re-plans with other lengths and fewer requests reuse the same buffers (what a captured
    run() baked); q keeps its captured rows; each plan's result is right; the merge always runs."""
    w, bufs = _graph_wrapper(8, 4096)
    g = gen()
    ptrs = None
    for kv_lens in ([100, 2000, 3, 64, 9, 1, 700, 33], [5, 17, 4000], [1] * 8):
        b = make_batch([1] * len(kv_lens), kv_lens, 16, 16, BF16, g)
        qn, qp, ckv, kpe = b[:4]
        pad = lambda t: torch.cat([t, torch.zeros(8 - t.shape[0], *t.shape[1:], dtype=t.dtype)])  # noqa: E731
        qn8, qp8 = pad(qn), pad(qp)
        _plan(w, b, 16, 16)
        memu.calls.clear()
        out = w.run(qn8, qp8, ckv, kpe)
        assert [c[0] for c in memu.calls] == ["mla_decode", "merge_partials"]
        args = memu.calls[0][2]
        now = (args[4].data_ptr(), args[5].data_ptr(), args[8].data_ptr(), args[9].data_ptr(), args[10].data_ptr())
        assert ptrs is None or now == ptrs
        ptrs = now
        assert (
            args[4].data_ptr() == bufs["kv_indptr"].data_ptr() and args[5].data_ptr() == bufs["kv_indices"].data_ptr()
        )
        n = len(kv_lens)
        _, lse = w.run(qn8, qp8, ckv, kpe, return_lse=True)
        check(out, lse, *reference(b, SM, False), BF16, rows=n)
        assert torch.equal(bufs["kv_len_arr"][:n], torch.tensor(kv_lens, dtype=torch.int32))


def test_cuda_graph_fixed_values(memu):
    w, bufs = _graph_wrapper(4, 1024)
    b = make_batch([1, 1], [10, 20], 16, 16, BF16, gen())
    _plan(w, b, 16, 16)
    for kw, what in (
        (dict(causal=True), "causal"),
        (dict(sm_scale=0.5), "sm_scale"),
        (dict(dtype=torch.float16), "dtype"),
    ):
        with pytest.raises(ValueError, match=what):
            _plan(w, b, 16, 16, **kw)
    big = make_batch([1] * 5, [1] * 5, 16, 16, BF16, gen())
    with pytest.raises(ValueError, match="exceeds the qo_indptr buffer"):
        _plan(w, big, 16, 16)
    more = make_batch([3, 3], [10, 20], 16, 16, BF16, gen())  # 6 tokens > the first plan's room (4)
    with pytest.raises(ValueError, match="query tokens"):
        _plan(w, more, 16, 16)


def test_sglang_fast_replan(memu):
    """SGLang's fast_mla_decode_plan: it sets _causal / _page_size / _sm_scale, writes the page
    ids into the kv_indices buffer itself, then calls _cached_module.plan.default(...) with host
    arrays."""
    w, bufs = _graph_wrapper(4, 1024)
    g = gen()
    b = make_batch([1] * 4, [30, 2, 90, 7], 16, 1, BF16, g)
    _plan(w, b, 16, 1)
    b2 = make_batch([1] * 4, [61, 5, 3, 200], 16, 1, BF16, g)
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b2
    bufs["kv_indices"][: idx.numel()] = idx
    w._causal, w._page_size, w._sm_scale = False, 1, SM
    w._cached_module.plan.default(w._float_workspace_buffer, w._int_workspace_buffer,
                                  w._pin_memory_int_workspace_buffer, qo, kvp, kvl, 16, CKV, False)  # fmt: skip
    out, lse = w.run(qn, qp, ckv, kpe, return_lse=True)
    check(out, lse, *reference(b2, SM, False), BF16)


def test_capture_needs_graph_mode(memu):
    w, b, out, lse = _run([1], [10], 16, 16, False)
    memu.state["capturing"] = True
    with pytest.raises(RuntimeError, match="use_cuda_graph"):
        w.run(*b[:4])


# ---- bad input: a clear error before any launch -----------------------------------------------
def _good():
    return make_batch([1, 2], [20, 40], 16, 16, BF16, gen())


PLAN_ERRORS = [
    (dict(head_dim_ckv=256), NotImplementedError, "head_dim_ckv=256"),
    (dict(head_dim_kpe=128), NotImplementedError, "head_dim_kpe=128"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(num_heads=129), ValueError, "num_heads"),
    (dict(q_data_type=torch.float16), ValueError, "the same or float8"),
    (dict(q_data_type=torch.float32, kv_data_type=torch.float32), ValueError, "float16 or bfloat16"),
    (dict(q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn), NotImplementedError, "fp8 queries"),
    (dict(q_data_type=torch.float8_e5m2), NotImplementedError, "fp8 queries"),
    (dict(kv_data_type=torch.float8_e4m3fnuz), ValueError, "float8_e4m3fn / float8_e5m2"),
    (dict(kv_data_type=torch.float32), ValueError, "the same or float8"),
    (dict(output_dtype=torch.float16), NotImplementedError, "output_dtype"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    (dict(sm_scale=None), TypeError, "sm_scale"),
    (dict(use_profiler=True), NotImplementedError, "use_profiler"),
    (dict(lse_mode="base10"), ValueError, "lse_mode"),
    (dict(query_layout="ragged"), ValueError, "query_layout"),
    (dict(use_sinks=True), NotImplementedError, "use_sinks"),
    (dict(scale_mode="kv-per-tensor"), NotImplementedError, "scale_mode"),
    (dict(kv_len_arr=torch.tensor([20, 400], dtype=torch.int32)), ValueError, "exceeds request 1"),
    (dict(kv_len_arr=torch.tensor([20], dtype=torch.int32)), ValueError, "length"),
    (dict(kv_len_arr=torch.tensor([-1, 40], dtype=torch.int32)), ValueError, "negative"),
    (dict(kv_indices=torch.tensor([0, 1], dtype=torch.int32)), ValueError, "kv_indices has 2 entries"),
    (dict(kv_indices=torch.tensor([0, -3, 4, 5, 6], dtype=torch.int32)), ValueError, "negative page id"),
    (dict(qo_indptr=torch.tensor([0, 2, 1], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(kv_indptr=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "kv_indptr has 2 entries"),
    (dict(kv_indices=None), TypeError, "kv_indices"),
    (dict(metadata=object()), ValueError, "Both metadata"),
]


@pytest.mark.parametrize("change,exc,match", PLAN_ERRORS)
def test_plan_errors(nolaunch, change, exc, match):
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = _good()
    args = dict(qo_indptr=qo, kv_indptr=kvp, kv_indices=idx, kv_len_arr=kvl, num_heads=16, head_dim_ckv=CKV,
                head_dim_kpe=KPE, page_size=16, causal=False, sm_scale=SM, q_data_type=BF16,
                kv_data_type=BF16)  # fmt: skip
    args.update(change)
    w = BatchMLAPagedAttentionWrapper(_ws())
    with pytest.raises(exc, match=match):
        w.plan(**args)
    with pytest.raises(RuntimeError, match="last plan"):
        w.run(qn, qp, ckv, kpe)


def _shifted(t):
    """``t``'s values in a tensor whose data starts 2 bytes past 16-byte alignment."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    v = buf[1:].view(t.shape)
    v.copy_(t)
    return v


def _bad_run_cases():
    def views(b):
        return list(b[:4])

    def f(i, fn):
        return lambda b: [fn(t) if j == i else t for j, t in enumerate(views(b))]

    return [
        ("q_nope heads", f(0, lambda t: t[:, :8]), ValueError, "q_nope must be"),
        ("q_nope dtype", f(0, lambda t: t.half()), ValueError, "q_nope must be"),
        ("q_nope width", f(0, lambda t: t[..., :256]), ValueError, "q_nope must be"),
        ("q_pe width", f(1, lambda t: torch.cat([t, t], -1)), ValueError, "q_pe must be"),
        ("q_pe tokens", f(1, lambda t: t[:2]), ValueError, "q_pe must be"),
        ("q tokens", lambda b: [b[0][:2], b[1][:2], b[2], b[3]], ValueError, "tokens"),
        ("ckv page size", f(2, lambda t: t[:, :8]), ValueError, "ckv_cache must be"),
        ("kpe pages", f(3, lambda t: t[:2]), ValueError, "kpe_cache must be"),
        ("kpe dtype", f(3, lambda t: t.half()), ValueError, "kpe_cache must be"),
        ("ckv device", f(2, lambda t: t.to("meta")), ValueError, "ckv_cache must be"),
        ("q_nope strided", f(0, lambda t: torch.cat([t, t], -1)[..., ::2]), ValueError, "16-byte vectors"),
        ("ckv misaligned", f(2, lambda t: _shifted(t)), ValueError, "aligned"),
        ("too few pages", f(2, lambda t: t[:1]), ValueError, "kpe_cache must be|reference page"),
    ]  # fmt: skip


@pytest.mark.parametrize("name,mutate,exc,match", _bad_run_cases(), ids=[c[0] for c in _bad_run_cases()])
def test_run_errors(nolaunch, name, mutate, exc, match):
    b = _good()
    w = BatchMLAPagedAttentionWrapper(_ws())
    _plan(w, b, 16, 16)
    with pytest.raises(exc, match=match):
        w.run(*mutate(b))


def test_run_option_errors(nolaunch):
    b = _good()
    w = BatchMLAPagedAttentionWrapper(_ws())
    _plan(w, b, 16, 16)
    for kw in (dict(kv_len=b[7]), dict(page_table=b[6]), dict(profiler_buffer=b[6]), dict(o_scale=2.0),
               dict(ckv_scale=1.0), dict(sinks=torch.zeros(16)), dict(bmm1_scale=1.0)):  # fmt: skip
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            w.run(*b[:4], **kw)
    with pytest.raises(ValueError, match="not both"):
        w.run(*b[:4], query=(b[0], b[1]))
    with pytest.raises(TypeError, match="needs both"):
        w.run(b[0], None, b[2], b[3])
    with pytest.raises(ValueError, match="packed query"):
        w.run(query=b[0], kv_cache=(b[2], b[3]))
    out = torch.empty(3, 16, CKV, dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        w.run(*b[:4], out=out)
    with pytest.raises(ValueError, match="lse must be"):
        w.run(*b[:4], lse=torch.empty(3, 8))


def test_page_id_beyond_cache(nolaunch):
    b = list(_good())
    b[6] = b[6].clone()
    b[6][1] = b[2].shape[0] + 5
    w = BatchMLAPagedAttentionWrapper(_ws())
    _plan(w, b, 16, 16)
    with pytest.raises(ValueError, match="reference page"):
        w.run(*b[:4])


def test_constructor_errors(nolaunch):
    with pytest.raises(NotImplementedError, match="cutlass"):
        BatchMLAPagedAttentionWrapper(_ws(), backend="cutlass")
    with pytest.raises(ValueError, match="backend must be"):
        BatchMLAPagedAttentionWrapper(_ws(), backend="bogus")
    with pytest.raises(ValueError, match="CUDA tensor"):
        BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="use_cuda_graph=True needs"):
        BatchMLAPagedAttentionWrapper(_ws(), use_cuda_graph=True)
    w = BatchMLAPagedAttentionWrapper(_ws())
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(*_good()[:4])


def test_small_workspace(nolaunch):
    b = make_batch([1] * 4, [9000, 10, 10, 10], 128, 64, BF16, gen())
    w = BatchMLAPagedAttentionWrapper(_fake_cuda(torch.empty(1 << 18, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="float_workspace_buffer has"):
        _plan(w, b, 128, 64)


def test_module_exports():
    import cute_attn
    import cute_attn.mla as mla

    assert "BatchMLAPagedAttentionWrapper" in cute_attn.__all__
    assert cute_attn.BatchMLAPagedAttentionWrapper is mla.BatchMLAPagedAttentionWrapper
    assert np.isclose(SM, 1 / math.sqrt(192))


def test_shared_memory_budget():
    """Each spec's stages fit one CTA per SM: the ring (stages x 32 tokens x 576 x 2 B), the Q
    staging tile and the partial scores (8 KB per 16-row group) within 227 KB."""
    from cute_attn.families.mla import CTAS_PER_SM_FP8, STAGES, STAGES_FP8, TILES, ctas_per_sm

    for t in TILES:
        ring = STAGES[t] * 32 * (CKV + KPE) * 2
        total = ring + t * (CKV + KPE) * 2 + (t // 16) * 16 * 32 * 4 * 4
        assert total + 2048 <= 232448, (t, total)  # 2 KB: alignment padding of the sections
        assert (STAGES[t] - 1) * 32 * (CKV + KPE) * 2 >= 64 << 10  # >= 64 KB of loads in flight per SM
        # fp8 (kernels/mla_decode_fp8.py): byte ring + Q staging + scores for each of the CTAs
        # an SM holds (1 KB of shared memory reserved per CTA), and >= 64 KB of loads in flight
        # per SM; the registers: 235 per thread, 128 threads per 16-row group
        per_sm = CTAS_PER_SM_FP8[t]
        total8 = STAGES_FP8[t] * 32 * (CKV + KPE) + t * (CKV + KPE) * 2 + (t // 16) * 16 * 32 * 4 * 4
        assert per_sm * (total8 + 2048 + 1024) <= 233472, (t, total8)
        assert per_sm * (STAGES_FP8[t] - 1) * 32 * (CKV + KPE) >= 64 << 10
        assert per_sm * (t // 16) * 128 * 240 <= 65536
        assert ctas_per_sm(t, True) == per_sm and ctas_per_sm(t, False) == 1


# ---- an fp8 latent cache ---------------------------------------------------------------------
FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@pytest.mark.parametrize("kv_dtype", list(FP8))
@pytest.mark.parametrize("qo_lens,kv_lens,dtype", [([1, 1, 1], [70, 300, 5], BF16), ([3, 2], [40, 90], torch.float16)])
def test_fp8_cache_emulated(memu, kv_dtype, qo_lens, kv_lens, dtype):
    """fp8 ckv / kpe, 16-bit q and out: the fp8 mla_decode kernel on sm_90a too (never the wgmma
    one, even past 32 packed rows), against the reference on the dequantized cache."""
    heads = 16
    b = make_batch(qo_lens, kv_lens, heads, 16, dtype, gen(), kv_dtype=kv_dtype)
    w = BatchMLAPagedAttentionWrapper(_ws())
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w.plan(qo, kvp, idx, kvl, heads, CKV, KPE, 16, True, SM, dtype, kv_dtype)
    out, lse = w.run(qn, qp, ckv, kpe, return_lse=True)
    check(out, lse, *reference(b, SM, True), dtype)
    attn = [p for f, p in memu.loads if f.startswith("mla_decode")]
    assert [f for f, _ in memu.loads if f.startswith("mla_decode")] == ["mla_decode"]
    assert attn[0]["kv_dtype"] == FP8[kv_dtype] and attn[0]["dtype"] == common_name(dtype)
    assert attn[0]["tile_q"] == (32 if max(qo_lens) * heads > 16 else 16)
    assert out.dtype == dtype and ckv.dtype == kv_dtype


def common_name(dtype):
    return {BF16: "bf16", torch.float16: "f16"}[dtype]


def _fp8_bad_run_cases():
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    return [
        ("16-bit ckv", lambda b: [b[0], b[1], b[2].to(BF16), b[3]], "ckv_cache must be"),
        ("16-bit kpe", lambda b: [b[0], b[1], b[2], b[3].to(BF16)], "kpe_cache must be"),
        ("e5m2 caches", lambda b: [b[0], b[1], b[2].to(BF16).to(e5), b[3].to(BF16).to(e5)], "ckv_cache must be"),
        ("fp8 q_nope", lambda b: [b[0].to(e4), b[1], b[2], b[3]], "q_nope must be"),
        ("fp8 kpe only", lambda b: [b[0], b[1], b[2].to(BF16), b[3]], "ckv_cache must be"),
    ]


@pytest.mark.parametrize("name,mutate,match", _fp8_bad_run_cases(), ids=[c[0] for c in _fp8_bad_run_cases()])
def test_fp8_run_errors(nolaunch, name, mutate, match):
    b = make_batch([1, 2], [20, 40], 16, 16, BF16, gen(), kv_dtype=torch.float8_e4m3fn)
    w = BatchMLAPagedAttentionWrapper(_ws())
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w.plan(qo, kvp, idx, kvl, 16, CKV, KPE, 16, False, SM, BF16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=match):
        w.run(*mutate(b))


def test_fp8_cache_on_a_16bit_plan(nolaunch):
    b = _good()
    w = BatchMLAPagedAttentionWrapper(_ws())
    _plan(w, b, 16, 16)
    for ckv, kpe in ((b[2].to(torch.float8_e4m3fn), b[3]), (b[2], b[3].to(torch.float8_e4m3fn))):
        with pytest.raises(ValueError, match="_cache must be torch.bfloat16"):
            w.run(b[0], b[1], ckv, kpe)


def test_fp8_cuda_graph_keeps_the_cache_dtype(memu):
    """A captured run() bakes the kernel: a re-plan to another cache dtype is an error."""
    w, _ = _graph_wrapper(4, 64)
    b = make_batch([1, 1], [20, 40], 16, 16, BF16, gen(), kv_dtype=torch.float8_e4m3fn)
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w.plan(qo, kvp, idx, kvl, 16, CKV, KPE, 16, False, SM, BF16, torch.float8_e4m3fn)
    out, lse = w.run(qn, qp, ckv, kpe, return_lse=True)
    check(out, lse, *reference(b, SM, False), BF16)
    with pytest.raises(ValueError, match="kv_dtype"):
        w.plan(qo, kvp, idx, kvl, 16, CKV, KPE, 16, False, SM, BF16, torch.float8_e5m2)
