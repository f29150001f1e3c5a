"""Cascade attention (``cute_attn.cascade.MultiLevelCascadeAttentionWrapper``) against the fp32
reference over each request's whole KV (its levels' tokens concatenated in level order).

GPU tests (marked ``gpu``; they use the paged prefill and merge modules of the ``all`` preset):
2 and 3 levels (a prefix shared by every request, prefixes shared by groups, each request's
own tokens), decode (one query per request) and append (several, causal at the last level),
page sizes 1 / 16, NHD / HND, GQA 1 / 4, head dims 64 / 128, fp16 / bf16, soft-cap, sinks,
an empty level, and CUDA-graph capture + replay under a new plan.  Outputs and LSE are
pre-filled with NaN and every cache slot no level owns holds NaN.  Tolerances as the prefill
tests (``test_prefill_gpu``): output relative L2 error bf16 2e-2 / fp16 4e-3; LSE (base 2)
absolute 2e-3.

CPU tests (run in CI): the wrapper's wiring with the prefill kernels emulated
(``test_prefill_gpu``'s ``emu`` fixture), the decode wrapper replaced by the reference and the
merge done by the reference ⊕: which kernel each level gets, causal at the last level only,
the merged output; and the argument errors.
"""

import random

import pytest
import torch
from test_prefill_gpu import DTYPES, _cpu_ws, _cumsum, _fake_cuda, _gen, check, emu, make_paged  # noqa: F401

from cute_attn.testing import merge_state_reference, paged_reference, ragged_reference

gpu = pytest.mark.gpu
DEV = "cuda"
LOG2E = 1.4426950408889634


def make_cascade(groups, seg_lens, qo_lens, page_size, hq, hk, d, dtype, layout, gen, device, single_tensor=False):
    """A cascade over one paged cache. ``groups[l]``: level l's requests as contiguous ranges
    ``[(first, stop), ...]`` covering every request; ``seg_lens[l][g]``: that group's kv tokens.
    Returns (q, cache, per-level plan arrays, (k_cat, v_cat, kv token indptr) per request)."""
    segs = [n for lens in seg_lens for n in lens]
    cache, indptr, indices, last, (k_rag, v_rag), kv_tok = make_paged(
        segs, page_size, hk, d, dtype, layout, single_tensor, gen, device, spare=2
    )
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
    qo_cum = _cumsum(qo_lens)
    levels, seg0 = [], 0
    per_req = [[] for _ in qo_lens]  # (start, stop) tokens of each request's segments, level order
    for _lvl, rng in enumerate(groups):
        ng = len(rng)
        p0, p1 = int(indptr[seg0]), int(indptr[seg0 + ng])
        levels.append(
            dict(
                qo=torch.tensor([qo_cum[a] for a, _ in rng] + [qo_cum[rng[-1][1]]], dtype=torch.int32),
                indptr=indptr[seg0 : seg0 + ng + 1] - p0,
                indices=indices[p0:p1].clone(),
                last=last[seg0 : seg0 + ng].clone(),
            )
        )
        for g, (a, b) in enumerate(rng):
            for r in range(a, b):
                per_req[r].append((int(kv_tok[seg0 + g]), int(kv_tok[seg0 + g + 1])))
        seg0 += ng
    idx = torch.cat([torch.arange(s, e) for segs_r in per_req for s, e in segs_r] or [torch.zeros(0, dtype=torch.long)])
    k_cat, v_cat = k_rag[idx.to(k_rag.device)], v_rag[idx.to(v_rag.device)]
    cat_tok = torch.tensor(_cumsum([sum(e - s for s, e in segs_r) for segs_r in per_req]), dtype=torch.int32)
    return q, cache, levels, (k_cat, v_cat, cat_tok)


def plan_args(levels):
    return (
        [lv["qo"] for lv in levels],
        [lv["indptr"] for lv in levels],
        [lv["indices"] for lv in levels],
        [lv["last"] for lv in levels],
    )


def run_cascade(
    groups,
    seg_lens,
    qo_lens,
    page_size,
    hq,
    hk,
    d,
    dtype,
    *,
    causal=False,
    layout="NHD",
    soft_cap=None,
    device=DEV,
    workspace=None,
    seed=None,
    single_tensor=False,
    sinks=False,
    **plan_kw,
):
    from cute_attn import MultiLevelCascadeAttentionWrapper

    gen = _gen(seed)
    q, cache, levels, (k_cat, v_cat, cat_tok) = make_cascade(
        groups, seg_lens, qo_lens, page_size, hq, hk, d, dtype, layout, gen, device, single_tensor
    )
    ws = workspace if workspace is not None else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    w = MultiLevelCascadeAttentionWrapper(len(groups), ws, layout)
    w.plan(
        *plan_args(levels), hq, hk, d, page_size, causal=causal, logits_soft_cap=soft_cap, q_data_type=dtype, **plan_kw
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    sink = torch.randn(hq, generator=gen).to(device) if sinks else None
    got = w.run(q, cache, out=out, lse=lse, return_lse=True, sinks=sink)
    assert got[0] is out and got[1] is lse
    ref_o, ref_lse = ragged_reference(
        q, k_cat, v_cat, torch.tensor(_cumsum(qo_lens)), cat_tok, causal=causal, logits_soft_cap=soft_cap
    )
    if sinks:  # the sink joins each row's denominator once: o * l / (l + e^sink), lse ⊕ sink
        s2 = (sink.float() * LOG2E).view(1, hq).expand_as(ref_lse).to(ref_lse)
        new = torch.logaddexp2(ref_lse, s2)
        ref_o = ref_o * torch.exp2(ref_lse - new).unsqueeze(-1)
        ref_lse = new
    check(out, lse, ref_o, ref_lse, dtype)
    return w, (q, cache, levels), out, lse


def _two_level(batch, prefix, unique):
    return [[(0, batch)], [(r, r + 1) for r in range(batch)]], [[prefix], list(unique)]


def _three_level(batch, prefix, mid, unique):
    h = batch // 2
    return (
        [[(0, batch)], [(0, h), (h, batch)], [(r, r + 1) for r in range(batch)]],
        [[prefix], list(mid), list(unique)],
    )


# =========================================================================== GPU tests


@gpu
@pytest.mark.parametrize("decode_kernel", [None, False])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_two_level_decode(dtype, page_size, layout, decode_kernel):
    """A shared prefix + each request's own tokens, one query per request (batch decode): the
    own level on the decode kernel, or on the prefill kernel (decode_kernel=False)."""
    rng = random.Random()
    batch = 12
    groups, segs = _two_level(batch, 1000 + rng.randrange(200), [rng.randrange(1, 300) for _ in range(batch)])
    w = run_cascade(
        groups, segs, [1] * batch, page_size, 32, 8, 128, DTYPES[dtype], layout=layout, decode_kernel=decode_kernel
    )[0]
    assert w._kind == ["prefill", "prefill" if decode_kernel is False else "decode"]


@gpu
@pytest.mark.parametrize("sinks", [False, True])
def test_two_level_decode_head_packed(sinks):
    """256 requests x 8 kv heads: the own-tokens level's decode plan packs four kv heads per work
    item (decode.MIN_PACKED_ITEMS_PER_CTA), with and without sinks (the packed sink kernel)."""
    rng = random.Random()
    batch = 256
    groups, segs = _two_level(batch, 700 + rng.randrange(100), [rng.randrange(600, 700) for _ in range(batch)])
    w = run_cascade(groups, segs, [1] * batch, 16, 32, 8, 128, torch.bfloat16, sinks=sinks)[0]
    assert w._kind == ["prefill", "decode"]
    if torch.cuda.get_device_properties(0).multi_processor_count <= 134:
        assert w._decode[1]._hpi == 4


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,d", [(8, 8, 64), (32, 8, 128)])
def test_three_level_append(causal, hq, hk, d):
    """Shared prefix, two group prefixes, own tokens; several queries per request (causal at the
    last level: every own segment holds at least the request's queries)."""
    rng = random.Random()
    batch = 6
    qo = [rng.randrange(1, 40) for _ in range(batch)]
    unique = [q + rng.randrange(0, 100) for q in qo]
    groups, segs = _three_level(batch, 517, [rng.randrange(1, 400), rng.randrange(1, 400)], unique)
    run_cascade(groups, segs, qo, 16, hq, hk, d, torch.bfloat16, causal=causal, single_tensor=True)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_soft_cap(causal):
    """Soft-cap at every level (20 queries x group 4 per request: the 128-row tile whose soft-cap
    kernel the ``all`` preset has, for ragged KV: the KV pass gathers each level first)."""
    rng = random.Random()
    batch = 5
    groups, segs = _two_level(batch, 700, [20 + rng.randrange(0, 200) for _ in range(batch)])
    run_cascade(groups, segs, [20] * batch, 16, 16, 4, 128, torch.bfloat16, causal=causal, soft_cap=30.0, kv_pass=True)


@gpu
@pytest.mark.parametrize("qo", [20, 1])
def test_sinks_once(qo):
    """run(sinks=) enters each row's denominator once (at the last level), not once per level; the
    last level on the prefill kernel (20 queries per request) or the decode kernel (1)."""
    rng = random.Random()
    batch = 5
    groups, segs = _three_level(batch, 300, [50, 90], [rng.randrange(1, 200) for _ in range(batch)])
    w = run_cascade(groups, segs, [qo] * batch, 16, 16, 4, 128, torch.bfloat16, sinks=True, kv_pass=False)[0]
    assert w._kind[-1] == ("decode" if qo == 1 else "prefill")


@gpu
def test_empty_level_and_long_prefix():
    """A group level with no tokens for one group (LSE -inf there, merged away) and a prefix long
    enough for the planner to split it across CTAs."""
    rng = random.Random()
    batch = 4
    groups, segs = _three_level(batch, 20000, [0, 333], [rng.randrange(1, 64) for _ in range(batch)])
    run_cascade(groups, segs, [1] * batch, 16, 32, 8, 128, torch.bfloat16)


@gpu
def test_cuda_graph_replay_new_plan():
    """Capture run() once, re-plan with other lengths (same level shapes), replay: the output follows."""
    from cute_attn import MultiLevelCascadeAttentionWrapper

    batch, hq, hk, d, ps, dtype = 8, 32, 8, 128, 16, torch.bfloat16
    max_pages = [[128], [64] * batch]
    bufs = [
        [torch.zeros(len(m) + 1, dtype=torch.int32, device=DEV) for m in max_pages],
        [torch.zeros(len(m) + 1, dtype=torch.int32, device=DEV) for m in max_pages],
        [torch.zeros(sum(m), dtype=torch.int32, device=DEV) for m in max_pages],
        [torch.zeros(len(m), dtype=torch.int32, device=DEV) for m in max_pages],
    ]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    w = MultiLevelCascadeAttentionWrapper(
        2,
        ws,
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf_arr=bufs[0],
        paged_kv_indptr_buf_arr=bufs[1],
        paged_kv_indices_buf_arr=bufs[2],
        paged_kv_last_page_len_buf_arr=bufs[3],
    )
    gen = _gen()
    out = lse = graph = q = kv = None
    # the third plan has 6 requests: q stays at the captured 8 rows, rows 6-7 are ignored
    for prefix, unique in [
        (900, [5, 300, 17, 1, 64, 99, 250, 8]),
        (130, [1000, 2, 3, 700, 1, 1, 40, 512]),
        (2000, [33, 1, 900, 17, 4, 600]),
    ]:
        b = len(unique)
        groups, segs = _two_level(b, prefix, unique)
        q_new, cache, levels, (k_cat, v_cat, cat_tok) = make_cascade(
            groups, segs, [1] * b, ps, hq, hk, d, dtype, "NHD", gen, DEV
        )
        w.plan(*plan_args(levels), hq, hk, d, ps, q_data_type=dtype)
        if graph is None:
            q = q_new.clone()
            kv = [torch.full((600,) + c.shape[1:], float("nan"), dtype=dtype, device=DEV) for c in cache]
        else:
            q[:b].copy_(q_new)
        for dst, src in zip(kv, cache):  # the captured cache: this plan's pages first, NaN past them
            dst.fill_(float("nan"))
            dst[: src.shape[0]].copy_(src)
        if graph is None:
            out = torch.full_like(q, float("nan"))
            lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
            w.run(q, tuple(kv), out=out, lse=lse)  # warm-up outside the capture (module loads)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q, tuple(kv), out=out, lse=lse)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_lse = ragged_reference(q[:b], k_cat, v_cat, torch.arange(b + 1), cat_tok)
        check(out[:b], lse[:b], ref_o, ref_lse, dtype)


# =========================================================================== CPU tests


class _RefDecode:
    """Stands in for BatchDecodeWithPagedKVCacheWrapper on the CPU: run() is the reference."""

    made = []

    def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, **bufs):
        self.layout, self.plans = kv_layout, []
        _RefDecode.made.append(self)

    def plan(self, indptr, indices, last, hq, hk, d, page_size, **kw):
        self.plans.append(dict(kw, page_size=page_size))
        self.args = (indptr, indices, last, kw)
        self._dtype, self._dev = kw["q_data_type"], 0  # what the cascade reads after plan()

    def reset_workspace_buffer(self, ws, int_ws=None):
        pass

    def run(self, q, cache, *args, out=None, lse=None, return_lse=False, sinks=None):
        indptr, indices, last, kw = self.args
        o, s = paged_reference(
            q, cache, None, indptr, indices, last, kv_layout=self.layout, logits_soft_cap=kw.get("logits_soft_cap")
        )
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(q.shape[:2]) if lse is None else lse
        out.copy_(o.to(out.dtype))
        lse.copy_(s)
        return (out, lse) if return_lse else out


@pytest.fixture
def emu_cascade(emu, monkeypatch):
    """The prefill emulation, the reference decode and the reference ⊕ for merge_state_in_place."""
    import cute_attn.wrappers.cascade as C

    merges = []

    def merge_in_place(v, s, v_o, s_o, mask=None):
        o, l = merge_state_reference(
            v.as_subclass(torch.Tensor),
            s.as_subclass(torch.Tensor),
            v_o.as_subclass(torch.Tensor),
            s_o.as_subclass(torch.Tensor),
        )
        v.copy_(o.to(v.dtype))
        s.copy_(l)
        merges.append(1)

    monkeypatch.setattr(C, "merge_state_in_place", merge_in_place)
    monkeypatch.setattr(C, "BatchDecodeWithPagedKVCacheWrapper", _RefDecode)
    monkeypatch.setattr(C, "merge_pair_module", lambda *a: emu.calls.append(("merge_pair", a)))
    _RefDecode.made.clear()
    emu.merges = merges
    return emu


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_cascade_wiring(emu_cascade, causal):
    batch = 4
    qo = [1, 3, 2, 5]
    groups, segs = _three_level(batch, 300, [40, 0], [9, 30, 2, 64])
    _, _, levels = run_cascade(
        groups, segs, qo, 16, 8, 2, 64, torch.bfloat16, causal=causal, device="cpu", workspace=_cpu_ws(96), seed=5
    )[1]
    prefill = [p for f, p in emu_cascade.calls if f == "batch_prefill_sm90"]
    assert len(prefill) == 3 and len(emu_cascade.merges) == 2
    # causal reaches the last level only (the queries follow every shared prefix)
    assert [p["causal"] for p in prefill] == [False, False, causal]  # run order: the shared levels, then the last
    assert [f for f, _ in emu_cascade.calls].index("merge_pair") < 3  # loaded by plan(), before any run()


@pytest.mark.parametrize("decode_kernel", [None, False])
def test_cpu_cascade_decode_level(emu_cascade, decode_kernel):
    """One query per request at the own-tokens level: the decode kernel runs it (unless
    decode_kernel=False); the shared level (one request owning all queries) stays on prefill."""
    batch = 5
    groups, segs = _two_level(batch, 200, [3, 17, 1, 40, 9])
    run_cascade(
        groups,
        segs,
        [1] * batch,
        16,
        8,
        2,
        64,
        torch.bfloat16,
        causal=True,
        soft_cap=20.0,
        device="cpu",
        workspace=_cpu_ws(96),
        seed=6,
        decode_kernel=decode_kernel,
    )
    prefill = [p for f, p in emu_cascade.calls if f == "batch_prefill_sm90"]
    if decode_kernel is False:
        assert not _RefDecode.made and len(prefill) == 2
    else:
        assert len(_RefDecode.made) == 1 and len(prefill) == 1 and not prefill[0]["causal"]
        assert _RefDecode.made[0].plans[0]["logits_soft_cap"] == 20.0


def test_cpu_cascade_errors(emu_cascade):
    from cute_attn import MultiLevelCascadeAttentionWrapper
    from cute_attn.variants.builtins import AttentionSink, Causal, FlashSigmoid

    batch = 3
    groups, segs = _two_level(batch, 50, [4, 5, 6])
    q, cache, levels, _ = make_cascade(groups, segs, [1] * batch, 16, 4, 4, 64, torch.float16, "NHD", _gen(1), "cpu")
    qo, ind, idx, last = plan_args(levels)
    with pytest.raises(ValueError, match="num_levels"):
        MultiLevelCascadeAttentionWrapper(0, _cpu_ws(8))
    w = MultiLevelCascadeAttentionWrapper(2, _cpu_ws(64))
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, cache)
    with pytest.raises(ValueError, match="one entry per level"):
        w.plan(qo[:1], ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="same number of query rows"):
        w.plan(
            [qo[0], torch.tensor([0, 1, 2], dtype=torch.int32)], ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16
        )
    for v in (FlashSigmoid(), AttentionSink()):
        with pytest.raises(NotImplementedError, match="does not merge"):
            w.plan(qo, ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16, variant=v)
    with pytest.raises(ValueError, match="Causal"):
        w.plan(qo, ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16, variant=Causal())
    with pytest.raises(ValueError, match="level 1: qo_indptr and paged_kv_indptr must have the same length"):
        w.plan(qo, [ind[0], ind[1][:-1]], idx, last, 4, 4, 64, 16, q_data_type=torch.float16)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs qo_indptr_buf_arr"):
        MultiLevelCascadeAttentionWrapper(2, _cpu_ws(8), use_cuda_graph=True)
    # CUDA-graph mode: a level planned on the decode kernel stays there
    bufs = [[torch.zeros(n, dtype=torch.int32) for n in sizes] for sizes in ([2, 4], [2, 4], [64, 64], [1, 3])]
    bufs = [[_fake_cuda(t) for t in arr] for arr in bufs]
    g = MultiLevelCascadeAttentionWrapper(
        2,
        _cpu_ws(64),
        use_cuda_graph=True,
        qo_indptr_buf_arr=bufs[0],
        paged_kv_indptr_buf_arr=bufs[1],
        paged_kv_indices_buf_arr=bufs[2],
        paged_kv_last_page_len_buf_arr=bufs[3],
    )
    g.plan(qo, ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16)
    assert g._kind == ["prefill", "decode"]
    with pytest.raises(ValueError, match="decode kernel since the first plan"):
        g.plan(
            [torch.tensor([0, 4]), torch.tensor([0, 1, 2, 4])], ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16
        )
    small = MultiLevelCascadeAttentionWrapper(2, _cpu_ws(1))  # 512 KB per level
    with pytest.raises(ValueError, match="cascade level 0"):
        small.plan(qo, ind, idx, last, 4, 4, 64, 16, q_data_type=torch.float16)


def test_flashinfer_names():
    import cute_attn
    import cute_attn.cascade as C

    for name in (
        "MultiLevelCascadeAttentionWrapper",
        "BatchPrefillWithPagedKVCacheWrapper",
        "BatchPrefillWithRaggedKVCacheWrapper",
        "BatchDecodeWithPagedKVCacheWrapper",
        "single_prefill_with_kv_cache",
        "single_decode_with_kv_cache",
        "merge_state",
        "merge_state_in_place",
        "merge_states",
    ):
        assert getattr(cute_attn, name) is not None, name
    assert C.merge_state is cute_attn.merge_state and C.merge_states is cute_attn.merge_states
