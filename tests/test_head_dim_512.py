"""Head dim 512 (``kernels/decode_wide.py``) in decode and in both prefill wrappers, and decode
of GQA groups above 16, on the GPU against the fp32 reference (``test_decode_gpu``'s and
``test_prefill_gpu``'s cases and tolerances: relative L2 of the output bf16 2e-2 / fp16 4e-3,
LSE absolute 2e-3, -inf exactly where the reference has it; unused pages NaN, outputs
pre-filled with NaN)."""

import os
import random
import sys

import pytest
import torch

from cute_attn import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache
from cute_attn.testing import paged_reference, single_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_decode_gpu import TOL, check, run_case  # noqa: E402
from test_prefill_gpu import run_paged, run_ragged  # noqa: E402

gpu = pytest.mark.gpu
D = 512


def _lens():
    """Lengths 0 / 1 / odd / a block's edge / long (split and merged), shuffled."""
    rng = random.Random()
    kv = [0, 1, 17, 31, 32, 33, 129, 300 + 2 * rng.randrange(50) + 1, 4096 + rng.randrange(100)]
    rng.shuffle(kv)
    return kv


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hq,hk", [(8, 8), (32, 8), (16, 2), (64, 4)])
def test_decode_hd512_grid(page_size, layout, hq, hk):
    kv = _lens()
    w = run_case(len(kv), kv, page_size, hq, hk, D, torch.bfloat16, layout)[0]
    assert w._state.decode is not None and not w._routed and w._hpi == 1


@gpu
@pytest.mark.parametrize("single_tensor", [False, True])
def test_decode_hd512_f16(single_tensor):
    kv = _lens()
    run_case(len(kv), kv, 16, 32, 8, D, torch.float16, "NHD", single_tensor)


@gpu
@pytest.mark.parametrize("d", [128, D])
@pytest.mark.parametrize("hq,hk", [(32, 1), (64, 2)])
def test_decode_groups_above_16(d, hq, hk):
    """MQA / GQA 32: at 128 the plan runs on the prefill kernel (one 64-row tile per token and kv
    head, ``decode_engine.MAX_DECODE_GROUP``); at 512 on the decode kernel, a token's 32 rows
    as two 16-row items."""
    kv = _lens()
    w = run_case(len(kv), kv, 16, hq, hk, d, torch.bfloat16)[0]
    assert w._routed == (d == 128)
    if d == D:
        assert w._state.decode is not None and w._state.plan.has_split


@gpu
def test_decode_group_32_on_the_decode_kernel(monkeypatch):
    """The decode kernel's own path at GQA 32 (what a plan with a variant takes): forced by
    turning the routing off."""
    import cute_attn.wrappers.decode as W

    monkeypatch.setattr(W, "decodes_on_prefill", lambda *a, **k: False)
    kv = _lens()
    w = run_case(len(kv), kv, 16, 32, 1, 128, torch.bfloat16)[0]
    assert not w._routed and w._state.decode is not None


@gpu
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_decode_fp8_group_32(kv):
    """An fp8 cache at GQA 32 (kernels/decode_fp8.py, 16-row items), against the reference on the
    dequantized cache (test_fp8_decode_gpu's tolerances)."""
    from test_fp8_decode_gpu import run_case as run_fp8_case

    run_fp8_case([0, 1, 77, 3000, 129], 16, 32, 1, 128, torch.bfloat16, kv)


@gpu
def test_decode_hd512_deterministic():
    kv = [5000, 17, 40000, 800]
    w, q, cache, out, lse = run_case(len(kv), kv, 16, 32, 8, D, torch.bfloat16)
    assert w._state.plan.has_split
    out2, lse2 = w.run(q, cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@gpu
def test_decode_hd512_cuda_graph_replay():
    """One captured run() replayed over re-plans (plan() and fast_decode_plan), each replay
    checked against the reference."""
    from cute_attn.decode import fast_decode_plan

    hq, hk, ps, max_b = 16, 4, 16, 6
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    max_pages = 1200
    bufs = dict(
        paged_kv_indptr_buffer=torch.zeros(max_b + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.zeros(max_b, dtype=torch.int32, device="cuda"),
    )
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True, **bufs
    )
    k = torch.randn(max_pages, ps, hk, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(max_pages, ps, hk, D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(max_b, hq, D, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    g = None
    for t, kv_lens in enumerate(([100] * max_b, [3000, 1, 17, 9000, 64, 5], [1] * max_b, [2000] * max_b)):
        pages = [(n + ps - 1) // ps for n in kv_lens]
        indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
        indices = torch.randperm(max_pages, generator=gen)[: int(indptr[-1])].to(torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        # the caller writes the index buffers in place (fast_decode_plan copies nothing, as SGLang)
        bufs["paged_kv_indptr_buffer"].copy_(indptr)
        bufs["paged_kv_indices_buffer"][: indices.numel()].copy_(indices)
        bufs["paged_kv_last_page_len_buffer"].copy_(last)
        if t % 2 == 0:
            w.plan(indptr, indices, last, hq, hk, D, ps, q_data_type=torch.bfloat16)
        else:
            fast_decode_plan(w, indptr, bufs["paged_kv_indices_buffer"], last, hq, hk, D, ps,
                             q_data_type=torch.bfloat16, global_override_indptr_cpu=indptr)  # fmt: skip
        if g is None:
            w.run(q, (k, v), out=out)  # warm-up: loads the modules outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                w.run(q, (k, v), out=out)
        ref_o, _ = paged_reference(q, (k, v), None, indptr, indices, last)
        out.fill_(float("nan"))
        g.replay()
        err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
        assert not torch.isnan(out).any() and err < TOL[torch.bfloat16], (kv_lens, err)


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_len", [1, 77, 5000])
def test_single_decode_hd512(layout, kv_len):
    hq, hk = 16, 2
    q = torch.randn(hq, D, dtype=torch.bfloat16, device="cuda")
    shape = (kv_len, hk, D) if layout == "NHD" else (hk, kv_len, D)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    out, lse = single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True)
    ref_o, ref_lse = single_reference(q, k, v, kv_layout=layout)
    check(out.unsqueeze(0), lse.unsqueeze(0), ref_o.unsqueeze(0), ref_lse.unsqueeze(0), torch.bfloat16)


@gpu
def test_decode_hd512_unsupported_options_raise_before_launch():
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    ind = torch.tensor([0, 1], dtype=torch.int32)
    for kw in (dict(logits_soft_cap=30.0), dict(window_left=100)):
        with pytest.raises(NotImplementedError, match="head dim 512"):
            w.plan(ind, ind[:1], ind[1:], 8, 8, D, 16, q_data_type=torch.bfloat16, **kw)
    with pytest.raises((NotImplementedError, ValueError), match="512"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, D, 16, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="heads_per_item"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, D, 16, q_data_type=torch.bfloat16, heads_per_item=2)


# prefill (the portable family's wide kernel on every arch): qo / kv lengths with 0 / 1 / odd /
# causal queries longer than keys, GQA 1 / 4 / 8 (16- and 32-row tiles), split + merge
PREFILL = [
    ([1, 7, 33, 0, 300], [1, 40, 33, 5, 1200], 8, 8),
    ([64, 3, 17], [64, 900, 10], 16, 4),
    ([200, 1], [200, 3000], 32, 4),
]


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo,kv,hq,hk", PREFILL)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_prefill_hd512(qo, kv, hq, hk, causal, layout):
    w = run_ragged(qo, kv, hq, hk, D, torch.bfloat16, causal=causal, layout=layout)[0]
    assert w._state.family == "batch_prefill_mma" and w._tile in (16, 32)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qo,kv,hq,hk", PREFILL)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_prefill_hd512(qo, kv, hq, hk, causal, page_size):
    w = run_paged(qo, kv, page_size, hq, hk, D, torch.bfloat16, causal=causal)[0]
    assert w._state.family == "batch_prefill_mma"


@gpu
def test_prefill_hd512_f16_split_deterministic():
    qo, kv = [40, 2], [8000, 3000]
    w, (q, k, v), out, lse = run_ragged(qo, kv, 8, 2, D, torch.float16, causal=True, fixed_split_size=1024)
    assert w._plan.has_split
    out2, lse2 = w.run(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@gpu
def test_multi_token_decode_hd512():
    """q_len_per_req = 3 (speculative decoding) at 512: the decode wrapper's causal paged prefill."""
    from cute_attn.testing import ragged_reference

    hq, hk, ps, n = 16, 2, 16, 3
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    kv = [3, 50, 700]
    pages = [(x + ps - 1) // ps for x in kv]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
    indices = torch.randperm(int(indptr[-1]), generator=gen).to(torch.int32)
    last = torch.tensor([x - (p - 1) * ps for x, p in zip(kv, pages)], dtype=torch.int32)
    k = torch.randn(int(indptr[-1]), ps, hk, D, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(int(indptr[-1]), ps, hk, D, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(len(kv) * n, hq, D, generator=gen).to(torch.bfloat16).cuda()
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, hq, hk, D, ps, q_data_type=torch.bfloat16, q_len_per_req=n)
    out, lse = w.run(q, (k, v), return_lse=True)
    rows = [torch.cat([t[int(indices[j])] for j in range(int(indptr[b]), int(indptr[b + 1]))])[: kv[b]] for b in
            range(len(kv)) for t in (k, v)]  # fmt: skip
    k_r, v_r = torch.cat(rows[0::2]), torch.cat(rows[1::2])
    qo_ind = torch.arange(len(kv) + 1, dtype=torch.int32) * n
    kv_ind = torch.tensor([0] + list(torch.tensor(kv).cumsum(0)), dtype=torch.int32)
    ref_o, ref_lse = ragged_reference(q, k_r, v_r, qo_ind, kv_ind, causal=True)
    check(out, lse, ref_o, ref_lse, torch.bfloat16)


def test_cpu_hd512_specs():
    """The spec rules at 512 (no GPU): plain 16-bit decode ships on both arches; variants, fp8
    and head packing are refused by name; GQA above 16 is 16-row items."""
    from cute_attn.families import decode
    from cute_attn.variants.builtins import SoftCap

    for arch in ("sm_90a", "sm_100a"):
        got = [s for s in decode.shipped_specs(arch) if s.family == "paged_decode" and s.pdict["head_dim"] == D]
        assert len(got) == 2 and {s.pdict["dtype"] for s in got} == {"f16", "bf16"}
        assert all(s.pdict["variant"] == "none" and s.pdict["block_n"] == 32 for s in got)
    with pytest.raises(NotImplementedError, match="SoftCap"):
        decode.decode_spec("sm_90a", "bf16", D, SoftCap())
    with pytest.raises(NotImplementedError, match="fp8"):
        decode.decode_spec("sm_90a", "bf16", D, kv_dtype="e4m3")
    with pytest.raises(ValueError, match="kv heads per item"):
        decode.decode_spec("sm_90a", "bf16", D, heads_per_item=2)
    assert decode.decode_tile(1, 32) == 16 and decode.packed_ok(1, 32) and decode.decode_tile(4, 8) == 32
    assert not decode.packed_ok(2, 16) and not decode.packed_ok(2, 4, D)


def test_cpu_hd512_prefill_specs():
    """The portable family at 512: its two tiles ship on both arches (ragged and paged, causal or
    not, both dtypes, with their merges); what it does not serve is refused by name; the backend
    choice sends 512 to it on Hopper."""
    from cute_attn.families import prefill_mma
    from cute_attn.families.backends import backend_for, choose_prefill_backend, shipped_specs

    for arch in ("sm_90a", "sm_100a"):
        got = [s for s in shipped_specs(arch) if s.family == "batch_prefill_mma" and s.pdict["head_dim"] == D]
        assert len(got) == 16 and {s.pdict["tile_q"] for s in got} == {16, 32}
        merges = [s for s in shipped_specs(arch) if s.family == "merge_partials" and s.pdict["head_dim"] == D]
        assert {(s.pdict["dtype"], s.pdict["tile_q"]) for s in merges} >= {(dt, t) for dt in ("f16", "bf16") for t in
                                                                             (16, 32)}  # fmt: skip
        assert choose_prefill_backend(arch, 64.0, head_dims=(D, D)).name == "prefill_mma_sync"
    assert backend_for("prefill", "sm_90a", "prefill_mma_sync").tiles_for(D) == (16, 32)
    with pytest.raises(NotImplementedError, match="head dim 512"):
        prefill_mma.prefill_mma_spec("sm_90a", "bf16", D, 16, True, soft_cap=True)
    with pytest.raises(ValueError, match="tile_q 64"):
        prefill_mma.prefill_mma_spec("sm_90a", "bf16", D, 64, True)
