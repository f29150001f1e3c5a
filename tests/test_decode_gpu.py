"""Paged decode on the GPU against the fp32 reference (cute_attn.testing.paged_reference).

Unused pages and the slack at the end of every last page are filled with NaN, and outputs are
pre-filled with NaN: reading a wrong page or leaving a row unwritten fails the test.
Tolerances: relative L2 error of the output vs the fp32 reference (inputs in the test dtype):
bf16 2e-2, fp16 4e-3 (the kernel rounds P to the input dtype for the PV product, as FlashInfer
and FA do); LSE (base 2) absolute 2e-3 where finite, and -inf exactly where the reference has it.
"""

import random

import pytest
import torch

from cute_attn import BatchDecodeWithPagedKVCacheWrapper, single_decode_with_kv_cache
from cute_attn.testing import paged_reference, single_reference

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def make_paged(kv_lens, page_size, hk, d, dtype, layout, single_tensor, gen):
    """A paged cache with shuffled pages, NaN in every slot that no request owns."""
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages_per) + 3  # a few pages nobody owns
    perm = torch.randperm(total, generator=gen)
    indptr = [0]
    for p in pages_per:
        indptr.append(indptr[-1] + p)
    indices = perm[: indptr[-1]].to(torch.int32)
    last = [(n - (p - 1) * page_size) if p else 0 for n, p in zip(kv_lens, pages_per)]
    shape = (total, page_size, hk, d) if layout == "NHD" else (total, hk, page_size, d)
    k = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    v = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    for b, _n in enumerate(kv_lens):
        for t in range(pages_per[b]):
            fill = page_size if t < pages_per[b] - 1 else last[b]
            pg = int(indices[indptr[b] + t])
            kk = torch.randn(fill, hk, d, generator=gen).to(dtype).cuda()
            vv = torch.randn(fill, hk, d, generator=gen).to(dtype).cuda()
            if layout == "NHD":
                k[pg, :fill], v[pg, :fill] = kk, vv
            else:
                k[pg, :, :fill], v[pg, :, :fill] = kk.transpose(0, 1), vv.transpose(0, 1)
    cache = torch.stack([k, v], dim=1) if single_tensor else (k, v)
    last_t = torch.tensor([max(x, 1) if p else 0 for x, p in zip(last, pages_per)], dtype=torch.int32)
    return cache, torch.tensor(indptr, dtype=torch.int32), indices, last_t


def check(out, lse, ref_o, ref_lse, dtype):
    assert not torch.isnan(out).any(), "NaN in output (unwritten row or a wrong page read)"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    err = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
    assert err < TOL[dtype], f"relative error {err:.3e} >= {TOL[dtype]}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3
    assert (out[~fin] == 0).all()


def run_case(
    batch,
    kv_lens,
    page_size,
    hq,
    hk,
    d,
    dtype,
    layout="NHD",
    single_tensor=False,
    soft_cap=None,
    window_left=-1,
    seed=None,
    heads_per_item=None,
    ctas_per_sm=None,
):
    gen = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    cache, indptr, indices, last = make_paged(kv_lens, page_size, hk, d, dtype, layout, single_tensor, gen)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype).cuda()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout=layout, ctas_per_sm=ctas_per_sm)
    w.plan(
        indptr,
        indices,
        last,
        hq,
        hk,
        d,
        page_size,
        q_data_type=dtype,
        logits_soft_cap=soft_cap,
        window_left=window_left,
        heads_per_item=heads_per_item,
    )
    if heads_per_item is not None:
        assert w._hpi == heads_per_item
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq), float("nan"), device="cuda")
    w.run(q, cache, out=out, lse=lse)
    ref_o, ref_lse = paged_reference(
        q, cache, None, indptr, indices, last, kv_layout=layout, logits_soft_cap=soft_cap, window_left=window_left
    )
    check(out, lse, ref_o, ref_lse, dtype)
    return w, q, cache, out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk", [(8, 8), (32, 8), (16, 2)])
def test_decode_head_dims_gqa(d, dtype, hq, hk):
    kv = [1, 17, 300, 64, 1000, 129, 5]
    run_case(len(kv), kv, 16, hq, hk, d, dtype)


# head dim 96 (Phi-3-mini's 32 / 32; 192-byte rows): pages, layouts, GQA (one and two kv heads per
# item), soft-cap / window, split + merge (the 33k request), lengths 0 / 1 / odd
HD96 = [
    (16, "NHD", 32, 32, None, None, -1),
    (1, "HND", 32, 32, None, None, -1),
    (64, "NHD", 32, 8, 2, None, -1),
    (16, "HND", 16, 2, 1, 30.0, -1),
    (16, "NHD", 32, 32, 2, None, 100),
    (1, "NHD", 32, 8, None, 50.0, 7),
]


# head dim 80 (Phi-2's 32 / 32; 160-byte rows in five 32-byte atom columns): the same, with up to
# four kv heads per item
HD80 = [
    (16, "NHD", 32, 32, 1, None, -1),
    (16, "NHD", 32, 32, 4, None, -1),
    (1, "HND", 32, 32, 2, None, -1),
    (64, "NHD", 32, 8, None, None, -1),
    (16, "HND", 16, 2, 1, 30.0, -1),
    (1, "NHD", 32, 32, 4, 50.0, 7),
]


HD80_96 = [(96, *c) for c in HD96] + [(80, *c) for c in HD80]


@pytest.mark.parametrize("d,page_size,layout,hq,hk,hpi,soft_cap,window", HD80_96)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_head_dim_80_96(d, page_size, layout, hq, hk, hpi, soft_cap, window, dtype):
    rng = random.Random()
    kv = [0, 1, 17, 300, 64, 129, 5, 2048 + rng.randrange(64), 33000]
    rng.shuffle(kv)
    w = run_case(len(kv), kv, page_size, hq, hk, d, dtype, layout, soft_cap=soft_cap, window_left=window,
                 heads_per_item=hpi)[0]  # fmt: skip
    assert not w._routed and w._state.decode is not None and (window >= 0 or w._state.plan.has_split)


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single_tensor", [False, True])
def test_decode_pages_layouts(page_size, layout, single_tensor):
    rng = random.Random()
    kv = [rng.choice([1, 2, 63, 64, 65, 777, 2048 + rng.randrange(100)]) for _ in range(12)]
    run_case(len(kv), kv, page_size, 32, 8, 128, torch.bfloat16, layout, single_tensor)


@pytest.mark.parametrize("group", [1, 4, 5, 7, 8, 16])
def test_decode_group_sizes(group):
    kv = [33, 250, 1, 1024]
    run_case(len(kv), kv, 16, 2 * group, 2, 128, torch.float16)


@pytest.mark.parametrize("soft_cap,window", [(30.0, -1), (None, 100), (50.0, 7), (None, 0)])
def test_decode_softcap_window(soft_cap, window):
    kv = [1, 99, 500, 3000, 16]
    run_case(len(kv), kv, 16, 32, 8, 128, torch.bfloat16, soft_cap=soft_cap, window_left=window)


def test_decode_empty_and_long_and_skewed():
    # kv_len 0 (no pages), a 32k+ request beside short ones: the long one is split across CTAs
    kv = [0, 33000, 3, 1, 0, 4096]
    run_case(len(kv), kv, 16, 32, 8, 128, torch.bfloat16)


def test_decode_batch_256():
    rng = random.Random()
    kv = [rng.randrange(1, 1500) for _ in range(256)]
    run_case(256, kv, 16, 32, 8, 128, torch.bfloat16)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).multi_processor_count > 134,
    reason="the packing thresholds below are for a 132-SM GPU",
)
@pytest.mark.parametrize(
    "lens,want",
    [
        ((900, 1100, 256, 1100), 4),  # 512 packed items of about equal length: pack four heads
        ((1800, 2200, 128, 2200), 2),  # four would leave fewer items than CTAs: two
        ((3500, 4500, 64, 4500), 1),  # two would too: none
        ((1, 1000, 256, 1600), 2),  # four heads of the longest request (~6400) exceed a CTA's share (~3900)
    ],
)
def test_decode_default_head_packing(lens, want):
    """The default rule (decode.MIN_PACKED_ITEMS_PER_CTA): pack while the items stay at least
    1.9 per CTA and none exceeds a CTA's fair share; outputs checked as everywhere."""
    lo, hi, b, longest = lens
    rng = random.Random()
    kv = [rng.randrange(lo, hi) for _ in range(b)]
    kv[rng.randrange(b)] = longest
    w = run_case(b, kv, 16, 32, 8, 128, torch.bfloat16)[0]
    assert w._hpi == want


# Head packing: 2 or 4 kv heads per work item (kernels/decode.py), forced.  Each case mixes
# empty, one-token, odd, page-straddling and long (split across CTAs) requests.
@pytest.mark.parametrize(
    "h,hq,hk,d,dtype,page_size,layout,soft_cap,window",
    [
        (4, 32, 8, 128, torch.bfloat16, 16, "NHD", None, -1),
        (4, 32, 8, 128, torch.float16, 1, "HND", None, -1),
        (4, 8, 8, 64, torch.float16, 16, "HND", None, -1),  # group 1: 4 of the tile's 16 rows used
        (4, 16, 4, 256, torch.bfloat16, 64, "NHD", None, -1),
        (4, 64, 16, 64, torch.bfloat16, 128, "NHD", None, -1),
        (2, 64, 8, 128, torch.bfloat16, 16, "NHD", None, -1),  # group 8: the tile is full
        (2, 16, 8, 256, torch.float16, 1, "NHD", None, -1),
        (2, 24, 4, 64, torch.bfloat16, 16, "HND", None, -1),  # group 6: 12 rows
        (2, 10, 2, 128, torch.float16, 64, "NHD", None, -1),  # group 5
        (4, 32, 8, 128, torch.bfloat16, 16, "NHD", 30.0, -1),  # the shipped packed variants
        (4, 32, 8, 64, torch.float16, 1, "HND", None, 100),
        (2, 64, 8, 256, torch.bfloat16, 16, "NHD", 50.0, 7),
        (2, 16, 8, 128, torch.float16, 16, "NHD", None, 0),
    ],
)
def test_decode_head_packing(h, hq, hk, d, dtype, page_size, layout, soft_cap, window):
    rng = random.Random()
    kv = [0, 1, 17, 300, 64, 129, 5, 2048 + rng.randrange(64), 1000 + rng.randrange(64), 33000]
    rng.shuffle(kv)
    run_case(len(kv), kv, page_size, hq, hk, d, dtype, layout, soft_cap=soft_cap, window_left=window, heads_per_item=h)


@pytest.mark.parametrize("h", [1, 2, 4])
def test_decode_head_packing_batch(h):
    """Many items per CTA, one of them split: every (request, head group) item of a big batch."""
    rng = random.Random()
    kv = [rng.randrange(1, 1500) for _ in range(300)] + [20000]
    run_case(len(kv), kv, 16, 32, 8, 128, torch.bfloat16, heads_per_item=h)


# Head dim 64 geometries (issue 24, families/decode.BLOCK_N / STAGES; scripts/decode_hd64_sweep.py):
# 128-row stages and four kv heads per item at GQA 8 (32-row tiles, one kv head per warp), on
# the gpt-oss heads (64 / 8) and GQA 4, with the mixed lengths above (split requests included).
HD64_GEOMETRIES = [
    # block_n, stages, heads per item, hq, hk, page size, soft-cap, window
    (64, 4, 4, 64, 8, 16, None, -1),
    (64, 4, 4, 64, 8, 1, 30.0, -1),
    (64, 4, 4, 64, 8, 16, None, 100),
    (64, 3, 4, 64, 8, 16, None, -1),
    (128, 3, 2, 64, 8, 16, None, -1),
    (128, 2, 2, 64, 8, 1, None, -1),
    (128, 3, 4, 64, 8, 16, None, -1),
    (128, 3, 4, 64, 8, 16, 30.0, -1),
    (128, 3, 4, 64, 8, 16, None, 100),
    (128, 2, 4, 64, 8, 16, None, -1),
    (128, 3, 1, 64, 8, 16, None, -1),
    (128, 3, 4, 32, 8, 16, None, -1),  # GQA 4: four heads in one 16-row tile
    (128, 2, 4, 32, 8, 1, None, -1),
    # one CTA per SM, deep pipelines (the fifth field of the sweep's settings: CTAs per SM)
    (128, 6, 4, 64, 8, 16, None, -1, 1),
    (128, 5, 4, 64, 8, 1, None, -1, 1),
    (64, 8, 4, 64, 8, 16, None, -1, 1),
    (128, 4, 2, 64, 8, 16, None, -1, 1),
    (128, 4, 4, 32, 8, 16, None, -1, 1),
]


@pytest.mark.parametrize(
    "bn,stages,h,hq,hk,page_size,soft_cap,window,ctas", [g + (None,) * (9 - len(g)) for g in HD64_GEOMETRIES]
)
def test_decode_hd64_geometries(bn, stages, h, hq, hk, page_size, soft_cap, window, ctas, monkeypatch):
    from cute_attn.families import decode

    monkeypatch.setitem(decode.BLOCK_N, 64, bn)
    monkeypatch.setitem(decode.STAGES, 64, stages)
    rng = random.Random()
    kv = [0, 1, 17, 300, 64, 129, 5, 2048 + rng.randrange(64), 1000 + rng.randrange(64), 33000]
    rng.shuffle(kv)
    w = run_case(
        len(kv),
        kv,
        page_size,
        hq,
        hk,
        64,
        torch.bfloat16,
        soft_cap=soft_cap,
        window_left=window,
        heads_per_item=h,
        ctas_per_sm=ctas,
    )[0]
    assert w._state.decode is not None and w._state.plan.has_split  # the 33k request is split


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).multi_processor_count != 132,
    reason="the rule's thresholds below are for a 132-SM GPU",
)
def test_decode_hd64_default_packs_one_item_per_cta():
    """gpt-oss decode (64 / 8 heads, hd64, 64 x 4040-4096): the default rule packs two heads per item
    (``decode_packing.ONE_ITEM_ROW_BYTES``) and the 128-byte rows' balance tolerance keeps the 256
    items whole."""
    rng = random.Random()
    kv = [rng.randrange(4040, 4097) for _ in range(64)]
    w = run_case(64, kv, 16, 64, 8, 64, torch.bfloat16)[0]
    assert w._hpi == 2 and not w._state.plan.has_split


def test_decode_head_packing_errors():
    gen = torch.Generator().manual_seed(0)
    cache, indptr, indices, last = make_paged([10, 20], 16, 2, 128, torch.bfloat16, "NHD", False, gen)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="heads_per_item=3"):
        w.plan(indptr, indices, last, 8, 2, 128, 16, q_data_type=torch.bfloat16, heads_per_item=3)
    with pytest.raises(ValueError, match="without query/key transforms"):
        w.plan(
            indptr,
            indices,
            last,
            8,
            2,
            128,
            16,
            q_data_type=torch.bfloat16,
            pos_encoding_mode="ROPE_LLAMA",
            heads_per_item=2,
        )
    with pytest.raises(ValueError, match="h \\* group"):
        w.plan(indptr, indices, last, 32, 2, 128, 16, q_data_type=torch.bfloat16, heads_per_item=2)  # group 16
    with pytest.raises(ValueError, match="num_kv_heads"):
        w.plan(indptr, indices, last, 4, 2, 128, 16, q_data_type=torch.bfloat16, heads_per_item=4)  # 2 kv heads


@pytest.mark.parametrize("h", [None, 4])
def test_decode_deterministic(h):
    kv = [5000, 17, 40000, 800]
    w, q, cache, out, lse = run_case(len(kv), kv, 16, 32, 8, 128, torch.bfloat16, heads_per_item=h)
    out2, lse2 = w.run(q, cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("h", [None, 4, "first"])
def test_cuda_graph_replay_with_new_plans(h):
    """Capture once, re-plan, replay; h: packing passed to every plan, or ("first") only to the
    first one (later plans inherit it: the captured kernel is the packed one)."""
    first, later = (4, None) if h == "first" else (h, h)
    hq, hk, d, ps, max_b = 32, 8, 128, 16, 8
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    max_pages = 4096
    indptr_buf = torch.zeros(max_b + 1, dtype=torch.int32, device="cuda")
    indices_buf = torch.zeros(max_pages, dtype=torch.int32, device="cuda")
    last_buf = torch.zeros(max_b, dtype=torch.int32, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
        use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr_buf,
        paged_kv_indices_buffer=indices_buf,
        paged_kv_last_page_len_buffer=last_buf,
    )
    k = torch.randn(max_pages, ps, hk, d, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(max_pages, ps, hk, d, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(max_b, hq, d, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)

    def plan(kv_lens, h=later):
        pages = [(n + ps - 1) // ps for n in kv_lens]
        indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
        indices = torch.randperm(max_pages, generator=gen)[: int(indptr[-1])].to(torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=torch.bfloat16, heads_per_item=h)
        return indptr, indices, last

    plan([100] * max_b, first)
    assert w._hpi == (first or 1)
    w.run(q, (k, v), out=out)  # warm-up: loads the modules outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, (k, v), out=out)
    for kv_lens in ([3000, 1, 17, 20000, 64, 5, 900, 2], [1] * max_b, [8000] * max_b, [100] * max_b):
        indptr, indices, last = plan(kv_lens)
        ref_o, ref_lse = paged_reference(q, (k, v), None, indptr, indices, last)
        for _ in range(2):  # a second replay of the same plan gives the same result
            out.fill_(float("nan"))
            g.replay()
            err = ((out.float() - ref_o).norm() / ref_o.norm()).item()
            assert not torch.isnan(out).any() and err < TOL[torch.bfloat16], (kv_lens, err)
        assert w._hpi == (first or 1)  # later plans keep the captured kernel's packing
    if first is not None:
        with pytest.raises(ValueError, match="first plan fixed it"):
            w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=torch.bfloat16, heads_per_item=2)


def test_capture_without_cuda_graph_flag_is_an_error():
    kv = [10, 20]
    w, q, cache, out, lse = run_case(2, kv, 16, 8, 8, 64, torch.float16)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="use_cuda_graph"):
        with torch.cuda.graph(g):
            w.run(q, cache)


def test_validation_errors():
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    ind = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim 72"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, 72, 16)
    with pytest.raises(ValueError, match="bytes"):  # 1 MiB is too small for batch 1000 x 64 heads
        big = torch.arange(1001, dtype=torch.int32)
        w.plan(big, torch.arange(1000, dtype=torch.int32), torch.ones(1000, dtype=torch.int32), 64, 8, 128, 16)
    w2 = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    w2.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, q_data_type=torch.bfloat16)
    cache = torch.randn(2, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="q must be"):
        w2.run(torch.randn(1, 8, 128, dtype=torch.float16, device="cuda"), cache)
    with pytest.raises(ValueError, match="page_size"):
        w2.run(torch.randn(1, 8, 128, dtype=torch.bfloat16, device="cuda"), cache[:, :, :8])
    with pytest.raises(ValueError, match="multiple"):
        w2.plan(ind, ind[:1], ind[1:], 6, 4, 128, 16)
    w2.plan(ind, torch.tensor([5], dtype=torch.int32), ind[1:], 8, 8, 128, 16, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="page 5"):  # the cache has 2 pages
        w2.run(torch.randn(1, 8, 128, dtype=torch.bfloat16, device="cuda"), cache)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_len", [1, 77, 5000])
def test_single_decode(layout, kv_len):
    hq, hk, d = 32, 4, 128
    q = torch.randn(hq, d, dtype=torch.bfloat16, device="cuda")
    shape = (kv_len, hk, d) if layout == "NHD" else (hk, kv_len, d)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    out, lse = single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True)
    ref_o, ref_lse = single_reference(q, k, v, kv_layout=layout)
    check(out.unsqueeze(0), lse.unsqueeze(0), ref_o.unsqueeze(0), ref_lse.unsqueeze(0), torch.bfloat16)


def test_fixed_split_size_is_batch_invariant_and_disable_split_kv():
    """fixed_split_size (pages, as FlashInfer): a request's output is bitwise the same whatever
    else is in the batch; disable_split_kv: still correct, one item per request and kv head."""
    hq, hk, d, ps = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    k = torch.randn(4096, ps, hk, d, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(4096, ps, hk, d, generator=gen).to(torch.bfloat16).cuda()
    q_r = torch.randn(1, hq, d, generator=gen).to(torch.bfloat16).cuda()
    r_pages = torch.arange(0, 313, dtype=torch.int32)  # the request under test: 5000 tokens
    outs = []
    for others in ([17, 800], [40000, 3, 1, 64, 9000]):
        kv = [5000] + others
        pages = [(n + ps - 1) // ps for n in kv]
        indices = [r_pages] + [torch.randint(400, 4096, (p,), generator=gen, dtype=torch.int32) for p in pages[1:]]
        indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv, pages)], dtype=torch.int32)
        q = torch.cat([q_r, torch.randn(len(others), hq, d, generator=gen).to(torch.bfloat16).cuda()])
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(indptr, torch.cat(indices), last, hq, hk, d, ps, q_data_type=torch.bfloat16, fixed_split_size=64)
        out, lse = w.run(q, (k, v), return_lse=True)
        ref_o, ref_lse = paged_reference(q, (k, v), None, indptr, torch.cat(indices), last)
        check(out, lse, ref_o, ref_lse, torch.bfloat16)
        outs.append((out[0].clone(), lse[0].clone()))
        w.plan(indptr, torch.cat(indices), last, hq, hk, d, ps, q_data_type=torch.bfloat16, disable_split_kv=True)
        out2, lse2 = w.run(q, (k, v), return_lse=True)
        check(out2, lse2, ref_o, ref_lse, torch.bfloat16)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_single_decode_fp8(kv_dtype):
    """single_decode_with_kv_cache on an fp8 K / V with k_scale / v_scale (FlashInfer's
    semantics), against the fp32 reference on the dequantized K / V."""
    hq, hk, d, kv_len = 32, 8, 128, 3001
    q = torch.randn(hq, d, dtype=torch.bfloat16, device="cuda")
    k = (torch.randn(kv_len, hk, d, device="cuda") * 2).to(kv_dtype)
    v = (torch.randn(kv_len, hk, d, device="cuda") * 2).to(kv_dtype)
    out, lse = single_decode_with_kv_cache(q, k, v, k_scale=0.25, v_scale=3.0, return_lse=True)
    ref_o, ref_lse = single_reference(q, k.float() * 0.25, v.float() * 3.0)
    check(out.unsqueeze(0), lse.unsqueeze(0), ref_o.unsqueeze(0), ref_lse.unsqueeze(0), torch.bfloat16)
