"""Batch prefill at the head dims beyond 64 / 128 / 256: head_dim_qk 192 with head_dim_vo 128
(DeepSeek-V3/R1's prefill: ``plan(head_dim_qk=192, head_dim_vo=128)``, as FlashInfer) and head
dim 96, ragged and paged, against the fp32 reference (``cute_attn.testing``, whose v may have
its own head dim).

GPU tests (marked ``gpu``; their specs are in the ``all`` preset: the 192 / 128 set ships in
``default``, head dim 96 comes from ``testing.matrices.head_dim_test_specs``): causal and not,
lengths 0 / 1 / odd / long, GQA groups 1 and 4, 128 heads, 64- and 128-row tiles, page sizes 1
/ 16 / 64 (the in-kernel gather and the TMA page boxes; at 96 also the KV pass), NHD / HND,
split-KV (``fixed_split_size`` and a long request the planner cuts, merged at head_dim_vo).
Inputs fresh per test, outputs and LSE pre-filled with NaN, every cache slot no request owns
NaN; tolerances as ``test_prefill_gpu`` (relative L2 bf16 2e-2, fp16 4e-3; LSE 2e-3).

CPU tests (no mark): the same wrappers against the kernel contract's emulation
(``test_prefill_gpu``'s ``emu``): spec parameters (``head_dim_vo`` only where it differs), the
ABI's V / O / partial widths, the merge at head_dim_vo, the clear errors; and every spec the GPU
grid asks for is in the ``all`` preset.
"""

import random

import pytest
import torch
from test_prefill_gpu import (  # noqa: F401  (emu: the fixture)
    DEV,
    _append_lens,
    _cpu_ws,
    _cumsum,
    _gen,
    _ws,
    check,
    emu,
    make_paged,
    make_ragged,
)

from cute_attn.testing import ragged_reference

gpu = pytest.mark.gpu
BF, F16 = torch.bfloat16, torch.float16
QK, VO = 192, 128  # DeepSeek-V3/R1 prefill


def run_ragged_vo(qo_lens, kv_lens, hq, hk, d, dv, dtype=BF, *, causal=False, layout="NHD", device=None,
                  workspace=None, seed=None, tail=0, **plan_kw):  # fmt: skip
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    q, k, v, qo, kv, (k_ref, v_ref) = make_ragged(qo_lens, kv_lens, hq, hk, d, dtype, layout, gen, device, tail, dv)
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace if workspace is not None else _ws(device), kv_layout=layout)
    w.plan(qo, kv, hq, hk, d, head_dim_vo=dv, causal=causal, q_data_type=dtype, **plan_kw)
    out = torch.full((q.shape[0], hq, dv), float("nan"), dtype=dtype, device=device)
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    w.run(q, k, v, out=out, lse=lse)
    ref_o, ref_lse = ragged_reference(q, k_ref, v_ref, qo, kv, causal=causal)
    check(out, lse, ref_o, ref_lse, dtype)
    return w, out


def run_paged_vo(qo_lens, kv_lens, page_size, hq, hk, d, dv, dtype=BF, *, causal=False, layout="NHD",
                 device=None, workspace=None, seed=None, **plan_kw):  # fmt: skip
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    cache, indptr, indices, last, (k_ref, v_ref), kv_tok = make_paged(
        kv_lens, page_size, hk, d, dtype, layout, False, gen, device, dv=dv
    )
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
    qo = torch.tensor(_cumsum(qo_lens), dtype=torch.int32)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace if workspace is not None else _ws(device), kv_layout=layout)
    w.plan(qo, indptr, indices, last, hq, hk, d, page_size, head_dim_vo=dv, causal=causal, q_data_type=dtype,
           **plan_kw)  # fmt: skip
    out = torch.full((q.shape[0], hq, dv), float("nan"), dtype=dtype, device=device)
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    w.run(q, cache, out=out, lse=lse)
    ref_o, ref_lse = ragged_reference(q, k_ref, v_ref, qo, kv_tok, causal=causal)
    check(out, lse, ref_o, ref_lse, dtype)
    return w, out


# lengths 0 / 1 / odd / append (kv > qo) / a long request
LENS = {
    "mixed": ([1, 17, 128, 300, 5, 77], [1, 117, 128, 333, 2005, 77]),
    "zero_one_odd": ([0, 1, 1, 3, 0, 129], [5, 1, 0, 3, 0, 1001]),
    "long": ([4097, 3], [6000, 4001]),
}
DIMS = {"192_128": (QK, VO), "96": (96, 96), "80": (80, 80)}


# =========================================================================== GPU tests


@gpu
@pytest.mark.parametrize("lens", list(LENS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(8, 8), (16, 4)])
@pytest.mark.parametrize("dims", list(DIMS))
def test_ragged(dims, hq, hk, causal, lens):
    d, dv = DIMS[dims]
    run_ragged_vo(*LENS[lens], hq, hk, d, dv, causal=causal, tail=3)


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dims", list(DIMS))
def test_paged(dims, page_size, causal, layout):
    """The kernel reading the pages itself (page boxes at 16 / 64, the cp.async gather at 1)."""
    d, dv = DIMS[dims]
    qo, kv = _append_lens(random.Random(), 7, 600, 1200)
    w = run_paged_vo(qo + [0, 1], kv + [3, 1], page_size, 16, 4, d, dv, causal=causal, layout=layout, kv_pass=False)[0]
    assert w._gathered is None and w._spec_kw["paged"]
    assert w._spec_kw.get("page_box", 0) == (16 if page_size % 16 == 0 else 0)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [80, 96])
def test_paged_kv_pass(d, causal):
    """Head dims 80 / 96 through the KV pass (rows of 5 / 6 thread pairs: threads past the
    CTA's whole rows idle)."""
    qo, kv = [300, 1, 77], [1000, 9, 4000]
    w = run_paged_vo(qo, kv, 1, 16, 4, d, d, causal=causal, kv_pass=True)[0]
    assert w._gathered is not None and not w._spec_kw["paged"]


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dims", list(DIMS))
def test_split_kv(dims, paged):
    """Split KV: fixed_split_size cuts every request (partial rows of head_dim_vo, the merge at
    head_dim_vo), and one long request with a short query the planner cuts by itself."""
    d, dv = DIMS[dims]
    qo, kv = [64, 1, 20], [3000, 2500, 1700]
    ps = 16
    if paged:
        w = run_paged_vo(qo, kv, ps, 4, 2, d, dv, causal=True, fixed_split_size=64)[0]
    else:
        w = run_ragged_vo(qo, kv, 4, 2, d, dv, causal=True, fixed_split_size=1000)[0]
    assert w._plan.has_split
    w = run_ragged_vo([128], [30000], 16, 4, d, dv, causal=False)[0]
    assert w._plan.has_split


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dims", list(DIMS))
def test_small_query_tiles(dims, paged):
    """Decode-like batches: 64-row tiles."""
    d, dv = DIMS[dims]
    qo, kv = [1] * 8, [1, 5, 100, 3000, 64, 65, 1, 7]
    w = (run_paged_vo(qo, kv, 16, 32, 8, d, dv, causal=True) if paged else
         run_ragged_vo(qo, kv, 32, 8, d, dv, causal=True))[0]  # fmt: skip
    assert w._tile == 64


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_deepseek_128_heads(causal):
    """DeepSeek-V3/R1's prefill: 128 heads, MHA, 192 / 128, a long chunk and an append."""
    run_ragged_vo([2048, 37], [2048, 1037], 128, 128, QK, VO, causal=causal)


@gpu
@pytest.mark.parametrize("dims", list(DIMS))
def test_long_causal_8k(dims):
    d, dv = DIMS[dims]
    if dims == "192_128":
        run_ragged_vo([8192], [8192], 16, 16, d, dv, causal=True)
    else:
        run_ragged_vo([8192, 1], [8192, 8191], 8, 2, d, dv, causal=True)


@gpu
@pytest.mark.parametrize("d", [80, 96])
def test_f16(d):
    run_ragged_vo(*LENS["mixed"], 16, 4, d, d, F16, causal=True)
    run_ragged_vo(*LENS["mixed"], 16, 4, d, d, F16, causal=False)


@gpu
def test_asym_cuda_graph_replay():
    """A captured run() at 192 / 128 replays later plans (new lengths) correctly."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    hq = hk = 8
    cap = 4
    qo_buf = torch.zeros(cap + 1, dtype=torch.int32, device=DEV)
    kv_buf = torch.zeros(cap + 1, dtype=torch.int32, device=DEV)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(DEV), use_cuda_graph=True, qo_indptr_buf=qo_buf, kv_indptr_buf=kv_buf)
    gen = _gen()
    rows, toks = 600, 3000
    q = torch.randn(rows, hq, QK, generator=gen).to(BF).to(DEV)
    k = torch.randn(toks, hk, QK, generator=gen).to(BF).to(DEV)
    v = torch.randn(toks, hk, VO, generator=gen).to(BF).to(DEV)
    out = torch.full((rows, hq, VO), float("nan"), dtype=BF, device=DEV)
    lse = torch.full((rows, hq), float("nan"), device=DEV)

    def plan(qo_lens, kv_lens):
        w.plan(torch.tensor(_cumsum(qo_lens), dtype=torch.int32), torch.tensor(_cumsum(kv_lens), dtype=torch.int32),
               hq, hk, QK, head_dim_vo=VO, causal=True, q_data_type=BF)  # fmt: skip
        return torch.tensor(_cumsum(qo_lens)), torch.tensor(_cumsum(kv_lens))

    plan([rows], [toks])
    w.run(q, k, v, out=out, lse=lse)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out, lse=lse)
    for qo_lens, kv_lens in (([100, 400, 3], [1000, 1500, 3]), ([rows], [toks]), ([1, 1], [2999, 1])):
        qo, kv = plan(qo_lens, kv_lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        n = int(qo[-1])
        ref_o, ref_lse = ragged_reference(q[:n], k, v, qo, kv, causal=True)
        check(out[:n], lse[:n], ref_o, ref_lse, BF)


# =========================================================================== CPU tests


@pytest.mark.parametrize("paged,page_size", [(False, 0), (True, 1), (True, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_asym_wiring(emu, paged, page_size, causal):
    qo, kv = [1, 17, 130, 0, 64], [1, 40, 500, 9, 64]
    kw = dict(device="cpu", workspace=_cpu_ws(), seed=1, causal=causal)
    if paged:
        w = run_paged_vo(qo, kv, page_size, 8, 2, QK, VO, **kw)[0]
    else:
        w = run_ragged_vo(qo, kv, 8, 2, QK, VO, tail=5, **kw)[0]
    fam, params = emu.calls[0]
    assert fam == "batch_prefill_sm90" and params["head_dim"] == QK and params["head_dim_vo"] == VO
    assert params["paged"] == paged and params.get("page_box", 0) == (16 if page_size == 16 else 0)
    assert w._state.head_dim_vo == VO and w._planner.limits.head_dim == VO  # partial rows of 128


@pytest.mark.parametrize("paged", [False, True])
def test_cpu_asym_split_merge(emu, paged):
    """A split plan: partial rows of head_dim_vo, merged by merge_partials at head_dim_vo."""
    qo, kv = [64, 1, 20], [3000, 2500, 1700]
    kw = dict(device="cpu", workspace=_cpu_ws(), seed=2, causal=True)
    if paged:
        w = run_paged_vo(qo, kv, 16, 4, 2, QK, VO, fixed_split_size=64, **kw)[0]
    else:
        w = run_ragged_vo(qo, kv, 4, 2, QK, VO, fixed_split_size=1000, **kw)[0]
    assert w._plan.has_split
    merges = [p for f, p in emu.calls if f == "merge_partials"]
    assert merges and all(p["head_dim"] == VO for p in merges)


@pytest.mark.parametrize("page_size,kv_pass", [(0, None), (1, False), (1, True), (16, None)])
@pytest.mark.parametrize("d", [80, 96])
def test_cpu_head_dim(emu, d, page_size, kv_pass):
    qo, kv = [1, 17, 130, 0, 64], [1, 40, 500, 9, 64]
    kw = dict(device="cpu", workspace=_cpu_ws(), seed=3, causal=True)
    if page_size:
        run_paged_vo(qo, kv, page_size, 8, 2, d, d, kv_pass=kv_pass, **kw)
    else:
        run_ragged_vo(qo, kv, 8, 2, d, d, **kw)
    fams = [f for f, _ in emu.calls]
    assert ("kv_pass" in fams) == bool(kv_pass)
    p = [p for f, p in emu.calls if f == "batch_prefill_sm90"][0]
    assert p["head_dim"] == d and "head_dim_vo" not in p


def test_cpu_specs_and_abi():
    from cute_attn.families.base import get_family
    from cute_attn.families.prefill import prefill_spec, shipped_specs

    sym = prefill_spec("sm_90a", "bf16", 128, 128, False, True)
    assert "head_dim_vo" not in sym.pdict
    assert prefill_spec("sm_90a", "bf16", 128, 128, False, True, head_dim_vo=128) == sym  # same key
    asym = prefill_spec("sm_90a", "bf16", QK, 128, True, True, page_box=16, head_dim_vo=VO)
    abi = {a.name: a for a in get_family("batch_prefill_sm90").abi(asym.pdict)}
    assert abi["mQ"].shape[-1] == abi["mK"].shape[-1] == QK
    assert abi["mV"].shape[-1] == abi["mO"].shape[-1] == abi["mPartO"].shape[-1] == VO
    assert abi["mPartO"].stride[0] == VO
    shipped = shipped_specs("sm_90a")
    ds = [s for s in shipped if s.pdict.get("head_dim_vo") == VO]
    assert len(ds) == 12 and {s.pdict["head_dim"] for s in ds} == {QK}  # tiles x ragged/box/gather x causal


def test_cpu_errors(emu):
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    gen = _gen()
    q, k, v, qo, kv, _ = make_ragged([5, 9], [5, 30], 8, 2, QK, BF, "NHD", gen, "cpu", dv=VO)
    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws())

    def plan(**kw):
        w.plan(**dict(dict(qo_indptr=qo, kv_indptr=kv, num_qo_heads=8, num_kv_heads=2, head_dim_qk=QK,
                           head_dim_vo=VO, q_data_type=BF), **kw))  # fmt: skip

    with pytest.raises(ValueError, match="head_dim_qk 192 with head_dim_vo 192 is not supported|head_dim 192"):
        plan(head_dim_vo=None)
    with pytest.raises(ValueError, match="head_dim_vo 64 is not supported"):
        plan(head_dim_vo=64)
    with pytest.raises(ValueError, match="head_dim 72"):
        plan(head_dim_qk=72, head_dim_vo=72)
    with pytest.raises(NotImplementedError, match="RoPE"):
        plan(pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(NotImplementedError, match="RoPE"):
        plan(head_dim_qk=96, head_dim_vo=96, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(NotImplementedError, match="fp8 KV cache with head_dim_vo"):
        plan(kv_data_type=torch.float8_e4m3fn)
    plan(causal=True)
    n = len(emu.calls)
    with pytest.raises(ValueError, match="k/v must be 3-D tensors equal but for the head dim"):
        w.run(q, k, k[:, :1])
    with pytest.raises(ValueError, match=r"192 \(k\) / 128 \(v\)"):
        w.run(q, k, k)  # v of the qk head dim
    with pytest.raises(ValueError, match=r"out must be .*\(14, 8, 128\)"):
        w.run(q, k, v, out=torch.empty_like(q))
    with pytest.raises(ValueError, match="q must be"):
        w.run(q[..., :VO].contiguous(), k, v)
    assert len(emu.calls) == n  # nothing launched
    out = w.run(q, k, v)
    assert out.shape == (14, 8, VO)

    cache, indptr, indices, last, _, _ = make_paged([5, 30], 16, 2, QK, BF, "NHD", False, gen, "cpu", dv=VO)
    p = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws())
    pargs = (qo, indptr, indices, last, 8, 2, QK, 16)
    with pytest.raises(NotImplementedError, match="kv_pass=True"):
        p.plan(*pargs, head_dim_vo=VO, q_data_type=BF, kv_pass=True)
    p.plan(*pargs, head_dim_vo=VO, q_data_type=BF)
    n = len(emu.calls)
    kc, vc = cache
    with pytest.raises(ValueError, match="v: head_dim 192"):
        p.run(q, torch.stack([kc, kc], 1))  # one [pages, 2, ...] tensor: k and v of one head dim
    with pytest.raises(ValueError, match="v: head_dim 192"):
        p.run(q, (kc, kc))
    with pytest.raises(ValueError, match="equal but for the head dim"):
        p.run(q, (kc, vc[:, :, :1]))
    assert len(emu.calls) == n
    assert p.run(q, cache).shape == (14, 8, VO)


def test_cpu_gpu_grid_specs_in_all_preset(emu, monkeypatch):
    """Every spec the GPU tests above load (on 132 SMs: tiles and splits change) is in ``all``:
    a missing one would cost a device visit."""
    import sys

    import cute_attn.wrappers.prefill_base as P
    from cute_attn.families.spec import Spec
    from cute_attn.presets import preset_specs

    have = {(s.family, s.params) for s in preset_specs("all", "sm_90a")}
    missing = set()

    def lookup(family, arch, **params):
        s = Spec.make(family, arch, **params)
        if (s.family, s.params) not in have:
            missing.add(s.describe())
        return lambda *args: None  # only the lookups matter here: no emulation, no reference

    monkeypatch.setattr(P, "kernel", lookup)
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "check", lambda *a, **k: None)
    monkeypatch.setattr(here, "ragged_reference", lambda *a, **k: (None, None))
    kw = dict(device="cpu", workspace=_cpu_ws(256))
    for dims in DIMS:
        d, dv = DIMS[dims]
        for causal in (False, True):
            for lens in LENS.values():
                run_ragged_vo(*lens, 16, 4, d, dv, causal=causal, **kw)
            for ps in (1, 16, 64):
                run_paged_vo([300, 0, 1], [700, 3, 1], ps, 16, 4, d, dv, causal=causal, kv_pass=False, **kw)
        run_paged_vo([64, 1, 20], [3000, 2500, 1700], 16, 4, 2, d, dv, causal=True, fixed_split_size=64, **kw)
        run_ragged_vo([64, 1, 20], [3000, 2500, 1700], 4, 2, d, dv, causal=True, fixed_split_size=1000, **kw)
        run_ragged_vo([128], [30000], 16, 4, d, dv, **kw)
        run_ragged_vo([1] * 8, [1, 5, 100, 3000, 64, 65, 1, 7], 32, 8, d, dv, causal=True, **kw)
        run_paged_vo([1] * 8, [1, 5, 100, 3000, 64, 65, 1, 7], 16, 32, 8, d, dv, causal=True, **kw)
    for d in (80, 96):
        for causal in (False, True):
            run_paged_vo([300, 1, 77], [1000, 9, 4000], 1, 16, 4, d, d, causal=causal, kv_pass=True, **kw)
            run_ragged_vo(*LENS["mixed"], 16, 4, d, d, F16, causal=causal, **kw)
    assert not missing, sorted(missing)


def test_cpu_models_deepseek():
    """compile --model deepseek-v3 (or a DeepSeek config.json): the ragged prefill at 192 / 128,
    the MLA decode kernels, merges at 128; a head dim no kernel serves is an error naming it."""
    from dataclasses import replace

    from cute_attn.models import from_config, model_specs, resolve_model, with_kv_cache_dtype
    from cute_attn.presets import preset_specs

    cfg = dict(num_attention_heads=128, num_key_value_heads=128, hidden_size=7168, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, torch_dtype="bfloat16")  # fmt: skip
    m = from_config(cfg)
    assert (m.head_dim, m.dv, m.num_kv_heads, m.mla) == (QK, VO, 128, True)
    assert model_specs(m, "sm_90a") == model_specs(resolve_model("deepseek-r1"), "sm_90a")
    specs = model_specs(m, "sm_90a")
    pre = [s.pdict for s in specs if s.family == "batch_prefill_sm90"]
    assert len(pre) == 4 and all(p["head_dim_vo"] == VO and not p["paged"] for p in pre)
    assert {s.family for s in specs} >= {"mla_decode", "merge_partials", "merge_states", "batch_prefill_sm90"}
    assert "paged_decode" not in {s.family for s in specs}
    assert set(pre_s for pre_s in specs if pre_s.family == "batch_prefill_sm90") <= set(
        preset_specs("default", "sm_90a")
    )
    assert not any(s.family == "batch_prefill_sm90" for s in model_specs(m, "sm_100a"))
    # an fp8 latent cache: the fp8 mla_decode kernels instead of the 16-bit ones, the rest the same
    for kv in ("e4m3", "e5m2"):
        f8 = model_specs(replace(m, kv_dtype=kv), "sm_100a")
        mla_f8 = [s.pdict for s in f8 if s.family == "mla_decode"]
        assert len(mla_f8) == 2 and all(p.get("kv_dtype") == kv and p["dtype"] == "bf16" for p in mla_f8)
        same = lambda ss: [s for s in ss if s.family != "mla_decode"]  # noqa: E731
        assert same(f8) == same(model_specs(m, "sm_100a"))
    ds8 = model_specs(with_kv_cache_dtype(resolve_model("deepseek-v3"), "fp8"), "sm_90a")  # compile --model ... fp8
    assert {s.pdict.get("kv_dtype") for s in ds8 if s.family == "mla_decode"} == {"e4m3"}
    with pytest.raises(ValueError, match="head_dim_qk 256 / head_dim_vo 128"):
        model_specs(from_config(dict(cfg, qk_nope_head_dim=192)), "sm_90a")
    with pytest.raises(ValueError, match="head_dim 72 is not served"):
        model_specs(from_config(dict(num_attention_heads=32, hidden_size=2304)), "sm_90a")
    # head dim 96 (Phi-3-mini): decode on the decode kernel (one or two kv heads per item), prefill
    # on the wgmma kernel on Hopper (never the portable one there: HOPPER_WGMMA_ONLY_HEAD_DIMS),
    # the portable one elsewhere
    for arch in ("sm_90a", "sm_100a"):
        hd96 = model_specs(from_config(dict(num_attention_heads=32, hidden_size=3072)), arch)
        dec = [s.pdict for s in hd96 if s.family == "paged_decode"]
        assert sorted(p.get("heads_per_item", 1) for p in dec) == [1, 2] and all(p["head_dim"] == 96 for p in dec)
    hd96 = model_specs(from_config(dict(num_attention_heads=32, hidden_size=3072)), "sm_90a")
    assert any(s.family == "batch_prefill_sm90" and s.pdict["paged"] and s.pdict["causal"] for s in hd96)
    assert "batch_prefill_mma" not in {s.family for s in hd96}
    # an fp8 cache at 96: no decode kernel (96-byte rows); decode runs on the prefill path
    hd96_f8 = model_specs(from_config(dict(num_attention_heads=32, hidden_size=3072, kv_cache_dtype="fp8")), "sm_90a")
    assert "paged_decode" not in {s.family for s in hd96_f8}
    hd96 = model_specs(from_config(dict(num_attention_heads=32, hidden_size=3072)), "sm_100a")
    assert {s.family for s in hd96} == {
        "paged_decode", "kept_update", "batch_prefill_mma", "merge_partials", "merge_pair", "merge_states"
    }  # fmt: skip
    assert {(s.pdict["tile_q"], s.pdict["paged"], s.pdict["causal"]) for s in hd96 if "paged" in s.pdict} == {
        (t, p, c) for t in (16, 32, 64) for p in (False, True) for c in (False, True)
    }
    # head dim 80 (Phi-2: 32 / 32 heads): as 96, with up to four kv heads per decode item
    phi2 = from_config(dict(num_attention_heads=32, hidden_size=2560))
    assert phi2.head_dim == 80 and model_specs(phi2, "sm_90a") == model_specs(resolve_model("phi-2"), "sm_90a")
    for arch in ("sm_90a", "sm_100a"):
        hd80 = model_specs(phi2, arch)
        dec = [s.pdict for s in hd80 if s.family == "paged_decode"]
        assert dec and all(p["head_dim"] == 80 for p in dec)
        assert sorted({p.get("heads_per_item", 1) for p in dec}) == [1, 2, 4]
        pre = {s.family for s in hd80} & {"batch_prefill_sm90", "batch_prefill_mma"}
        assert pre == ({"batch_prefill_sm90"} if arch == "sm_90a" else {"batch_prefill_mma"})
    hd80_f8 = model_specs(with_kv_cache_dtype(resolve_model("phi-2"), "fp8"), "sm_90a")
    assert "paged_decode" not in {s.family for s in hd80_f8}
    assert any(s.family == "kv_pass" and s.pdict.get("kv_dtype") == "e4m3" for s in hd80_f8)


@gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("d,window", [(96, 2046), (80, -1)])
def test_decode_model_head_dims(d, window, graph):
    """Decode at head dim 96 (Phi-3-mini: 32 / 32 heads, a 2047-token window; 192-byte rows) and
    80 (Phi-2: 32 / 32 heads, no window; 160-byte rows) on the decode kernel, one query row per
    request: lengths 0 / 1 / odd / past the window, and in graph mode one captured run()
    replayed over re-plans by ``fast_decode_plan``; against the fp32 reference (relative L2
    2e-2, LSE 2e-3, -inf where the reference has it).  Its specs are ``compile --model
    phi-3-mini`` / ``phi-2``'s."""
    import numpy as np

    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.decode import fast_decode_plan
    from cute_attn.testing import paged_reference

    hq = hk = 32
    ps = 16
    rng = np.random.default_rng(random.randrange(1 << 30))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    steps = [np.array([0, 1, 37, 3001, 700, 2047, 5000, 16])]
    for _ in range(4):
        steps.append(rng.permutation(steps[-1] + rng.integers(0, 3, size=8)))
    bs = steps[0].shape[0]
    max_pages = max(int(((k + ps - 1) // ps).sum()) for k in steps) + 4
    k = torch.randn(max_pages, ps, hk, d, generator=gen).to(BF).to(DEV)
    v = torch.randn(max_pages, ps, hk, d, generator=gen).to(BF).to(DEV)
    q = torch.randn(bs, hq, d, generator=gen).to(BF).to(DEV)
    bufs = {}
    if graph:
        bufs = dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=DEV),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=DEV),
            paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=DEV),
        )
    w = BatchDecodeWithPagedKVCacheWrapper(_ws(DEV), "NHD", **bufs)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((bs, hq), float("nan"), device=DEV)
    g = None
    for t, kv in enumerate(steps):
        pages = (kv + ps - 1) // ps
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
        indices = torch.randperm(max_pages, generator=gen)[: int(indptr[-1])].to(torch.int32)
        last = torch.tensor(np.where(pages > 0, kv - (pages - 1) * ps, 0), dtype=torch.int32)
        if graph:
            bufs["paged_kv_indptr_buffer"].copy_(indptr)
            bufs["paged_kv_indices_buffer"][: indices.numel()].copy_(indices)
            bufs["paged_kv_last_page_len_buffer"].copy_(last)
        if t == 0 or not graph:
            w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=BF, window_left=window)
            assert not w._routed and w._state.decode is not None  # the decode kernel, not the prefill one
        else:
            fast_decode_plan(w, indptr, bufs["paged_kv_indices_buffer"], last, hq, hk, d, ps, q_data_type=BF,
                             window_left=window, global_override_indptr_cpu=indptr)  # fmt: skip
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if graph and g is None:
            w.run(q, (k, v), out=out, lse=lse)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                w.run(q, (k, v), out=out, lse=lse)
        if graph:
            g.replay()
        else:
            w.run(q, (k, v), out=out, lse=lse)
        torch.cuda.synchronize()
        ref_o, ref_lse = paged_reference(q.float(), (k.float(), v.float()), torch.arange(bs + 1, dtype=torch.int32),
                                         indptr, indices, last, causal=True, window_left=window)  # fmt: skip
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), t
        err = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
        assert err < 2e-2, (t, err)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), fin), t
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3, t
        assert (out[~fin] == 0).all(), t
