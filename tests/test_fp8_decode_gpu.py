"""Paged decode over an fp8 KV cache (e4m3 / e5m2) on the GPU, against the fp32 reference
computed on the *dequantized* cache (fp8 -> fp32 is exact), so the test measures the kernel,
not the quantization.

The cache is built in fp32 with NaN in every slot no request owns and converted to fp8 (NaN
stays NaN), outputs are pre-filled with NaN.  Tolerances (relative L2 error of the output):
bf16 queries 2e-2, fp16 4e-3 -- the kernel multiplies in fp16 (a bf16 query is rounded to
fp16, exact for |q| in [2^-14, 65504]) and rounds P to fp16, as the 16-bit kernels round P to
their dtype; LSE (base 2) absolute 2e-3 where finite, -inf exactly where the reference has it.
``k_scale`` multiplies the logits, ``v_scale`` the output (FlashInfer's / vLLM's semantics).
"""

import math
import random
import sys
from pathlib import Path

import pytest
import torch

from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.decode import fast_decode_plan
from cute_attn.testing import paged_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode_gpu import TOL, check  # noqa: E402  (the 16-bit decode tests' output check and tolerances)

pytestmark = pytest.mark.gpu

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def make_cache(kv_lens, page_size, hk, d, kv_dtype, layout="NHD", single=False, gen=None):
    """(fp8 cache, its fp32 dequantization, indptr, indices, last_page_len)."""
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages_per) + 3
    perm = torch.randperm(total, generator=gen)
    indptr = [0]
    for p in pages_per:
        indptr.append(indptr[-1] + p)
    indices = perm[: indptr[-1]].to(torch.int32)
    last = [(n - (p - 1) * page_size) if p else 0 for n, p in zip(kv_lens, pages_per)]
    shape = (total, page_size, hk, d) if layout == "NHD" else (total, hk, page_size, d)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    for b in range(len(kv_lens)):
        for t in range(pages_per[b]):
            fill = page_size if t < pages_per[b] - 1 else last[b]
            pg = int(indices[indptr[b] + t])
            kk, vv = torch.randn(2, fill, hk, d, generator=gen) * 1.5
            if layout == "NHD":
                k[pg, :fill], v[pg, :fill] = kk, vv
            else:
                k[pg, :, :fill], v[pg, :, :fill] = kk.transpose(0, 1), vv.transpose(0, 1)
    k8, v8 = k.to(kv_dtype).cuda(), v.to(kv_dtype).cuda()
    cache = torch.stack([k8, v8], dim=1) if single else (k8, v8)
    deq = (k8.float(), v8.float())
    last_t = torch.tensor([max(x, 1) if p else 0 for x, p in zip(last, pages_per)], dtype=torch.int32)
    return cache, deq, torch.tensor(indptr, dtype=torch.int32), indices, last_t


def _scaled(k_scale, v_scale, deq, layout):
    """(scalar k scale, scalar v scale, the dequantized cache with the per-head scales applied):
    a per-head scale multiplies its kv head's K or V in the reference (what it means)."""
    out, flat = list(deq), []
    for i, x in enumerate((k_scale, v_scale)):
        if isinstance(x, torch.Tensor) and x.numel() > 1:
            shape = (1, 1, -1, 1) if layout == "NHD" else (1, -1, 1, 1)
            out[i] = out[i] * x.float().view(shape)
            x = None
        flat.append(1.0 if x is None else float(x))
    return flat[0], flat[1], tuple(out)


def run_case(kv_lens, page_size, hq, hk, d, q_dtype, kv="e4m3", layout="NHD", single=False, soft_cap=None,
             window_left=-1, heads_per_item=None, k_scale=None, v_scale=None, seed=None):  # fmt: skip
    gen = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    cache, deq, indptr, indices, last = make_cache(kv_lens, page_size, hk, d, FP8[kv], layout, single, gen)
    batch = len(kv_lens)
    q = torch.randn(batch, hq, d, generator=gen).to(q_dtype).cuda()
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), kv_layout=layout)
    w.plan(indptr, indices, last, hq, hk, d, page_size, q_data_type=q_dtype, kv_data_type=FP8[kv],
           logits_soft_cap=soft_cap, window_left=window_left, heads_per_item=heads_per_item)  # fmt: skip
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq), float("nan"), device="cuda")
    w.run(q, cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
    ks, vs, deq = _scaled(k_scale, v_scale, deq, layout)
    ref_o, ref_lse = paged_reference(q.float(), deq, None, indptr, indices, last, kv_layout=layout,
                                     sm_scale=ks / math.sqrt(d), logits_soft_cap=soft_cap,
                                     window_left=window_left)  # fmt: skip
    check(out, lse, ref_o * vs, ref_lse, q_dtype)
    return w, q, cache, out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk", [(8, 8), (32, 8), (16, 2)])
def test_fp8_decode_head_dims_gqa(d, kv, q_dtype, hq, hk):
    run_case([1, 17, 300, 64, 1000, 129, 5], 16, hq, hk, d, q_dtype, kv)


@pytest.mark.parametrize("page_size,layout", [(16, "NHD"), (1, "HND")])
def test_fp8_decode_head_dim_80(page_size, layout):
    """Head dim 80 (Phi-2): the decode kernel does not read 80-byte fp8 rows, so the plan runs
    the KV pass (dequantizing, gathering) and the prefill kernel's causal row per request."""
    w = run_case([0, 1, 17, 300, 4097, 129], page_size, 32, 32, 80, torch.bfloat16, layout=layout)[0]
    assert w._routed


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single", [False, True])
def test_fp8_decode_pages_layouts(page_size, layout, single):
    rng = random.Random()
    kv = [rng.choice([1, 2, 63, 64, 65, 127, 128, 129, 777, 2048 + rng.randrange(100)]) for _ in range(12)]
    run_case(kv, page_size, 32, 8, 128, torch.bfloat16, layout=layout, single=single)


@pytest.mark.parametrize("group", [1, 4, 5, 8, 16])
def test_fp8_decode_group_sizes(group):
    run_case([3, 200, 4097], 16, 2 * group, 2, 128, torch.bfloat16)


@pytest.mark.parametrize("soft_cap,window", [(30.0, -1), (None, 100), (50.0, 7), (None, 0)])
@pytest.mark.parametrize("h", [None, 1, 2, 4])
def test_fp8_decode_variants_and_packing(soft_cap, window, h):
    run_case([1, 70, 513, 3000], 16, 32, 8, 128, torch.bfloat16, soft_cap=soft_cap, window_left=window,
             heads_per_item=h)  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).multi_processor_count != 132,
    reason="the rule's thresholds below are for a 132-SM GPU",
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_decode_hd128_packs_one_item_per_cta(page_size):
    """An e4m3 cache at head dim 128 has 128-byte rows, as a 16-bit one at 64: at 32 / 8 heads and
    64 x 4040-4096 the default rule packs two heads per item (``decode_packing.ONE_ITEM_ROW_BYTES``)
    and the 128-byte rows' balance tolerance keeps the 256 items whole; against the reference."""
    kv = [random.randrange(4040, 4097) for _ in range(64)]
    w = run_case(kv, page_size, 32, 8, 128, torch.bfloat16)[0]
    assert w._hpi == 2 and not w._state.plan.has_split


def test_fp8_decode_empty_long_skewed():
    """Length 0 rows (out 0, LSE -inf), one very long request among short ones (split-KV +
    merge)."""
    run_case([0, 1, 0, 60000, 3, 129, 0, 4096], 16, 32, 8, 128, torch.bfloat16)
    run_case([0, 0], 16, 8, 8, 64, torch.float16)


@pytest.mark.parametrize("k_scale,v_scale", [(0.5, 2.0), (3.0, None), (None, 0.25), ("t", "t")])
def test_fp8_decode_scales(k_scale, v_scale):
    """Float scales and 1-element tensors (vLLM's layer._k_scale)."""
    if k_scale == "t":
        k_scale = torch.tensor([0.7], device="cuda")
        v_scale = torch.tensor(1.3, device="cuda")
    run_case([5, 700, 2100], 16, 32, 8, 128, torch.bfloat16, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("which", ["k", "v", "kv"])
def test_fp8_decode_per_head_scales(layout, which):
    """Per-kv-head k_scale / v_scale tensors (cute_attn's extension: ``wrappers/scales.py``)."""
    hk = 8
    # k: powers of 2, exact when multiplied into the query (test_fp8_prefill._per_head says why)
    ks = 2.0 ** torch.randint(-2, 3, (hk,), device="cuda").float() if "k" in which else 0.8
    vs = torch.rand(hk, device="cuda") * 1.5 + 0.25 if "v" in which else None
    run_case([5, 700, 2100, 1], 16, 32, hk, 128, torch.bfloat16, layout=layout, k_scale=ks, v_scale=vs)


def test_fp8_decode_deterministic():
    w, q, cache, out, lse = run_case([5000, 17, 40000, 800], 16, 32, 8, 128, torch.bfloat16)
    out2, lse2 = w.run(q, cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("scales", ["float", "per_head"])
@pytest.mark.parametrize("replan", ["plan", "fast_decode_plan"])
def test_fp8_cuda_graph_replay_with_new_plans(replan, scales):
    """Per-head scale tensors are captured by address: new values written into them take
    effect at the next replay."""
    hq, hk, d, ps, max_b, max_pages = 32, 8, 128, 16, 8, 4096
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    bufs = dict(
        paged_kv_indptr_buffer=torch.zeros(max_b + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.zeros(max_b, dtype=torch.int32, device="cuda"),
    )
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True, **bufs
    )
    k = (torch.randn(max_pages, ps, hk, d, generator=gen) * 2).to(torch.float8_e4m3fn).cuda()
    v = (torch.randn(max_pages, ps, hk, d, generator=gen) * 2).to(torch.float8_e4m3fn).cuda()
    q = torch.randn(max_b, hq, d, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)

    def plan(kv_lens, first=False):
        pages = [(n + ps - 1) // ps for n in kv_lens]
        indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
        indices = torch.randperm(max_pages, generator=gen)[: int(indptr[-1])].to(torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        if first or replan == "plan":
            w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
        else:  # as SGLang: the index buffers written in place, then the host-side re-plan
            bufs["paged_kv_indptr_buffer"][: max_b + 1].copy_(indptr)
            bufs["paged_kv_indices_buffer"][: indices.numel()].copy_(indices)
            bufs["paged_kv_last_page_len_buffer"].copy_(last)
            fast_decode_plan(w, indptr, indices, last, hq, hk, d, ps, q_data_type=torch.bfloat16,
                             kv_data_type=torch.float8_e4m3fn)  # fmt: skip
        return indptr, indices, last

    if scales == "float":
        ks, vs = 0.5, 2.0
    else:
        ks, vs = torch.full((hk,), 0.5, device="cuda"), torch.full((hk,), 2.0, device="cuda")
    plan([100] * max_b, first=True)
    w.run(q, (k, v), out=out, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, (k, v), out=out, k_scale=ks, v_scale=vs)
    for i, kv_lens in enumerate(
        ([3000, 1, 17, 20000, 64, 5, 900, 2], [1] * max_b, [8000] * max_b, [0, 5, 0, 9, 0, 1, 2, 3])
    ):
        indptr, indices, last = plan(kv_lens)
        if scales == "per_head" and i % 2:  # new values, same tensors
            ks.copy_(2.0 ** torch.randint(-2, 3, (hk,), generator=gen).float())
            vs.copy_(torch.rand(hk, generator=gen) + 0.25)
        k_s, v_s, deq = _scaled(ks, vs, (k.float(), v.float()), "NHD")
        ref_o, _ = paged_reference(q.float(), deq, None, indptr, indices, last, sm_scale=k_s / math.sqrt(d))
        for _ in range(2):
            out.fill_(float("nan"))
            g.replay()
            err = ((out.float() - v_s * ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
            assert not torch.isnan(out).any() and err < TOL[torch.bfloat16], (kv_lens, err)


def test_fp8_decode_bad_inputs():
    """Clear errors before any launch: the cache dtype differs from the plan's, RoPE in the
    kernel with an fp8 cache, fp8 queries, bad scales."""
    ind = torch.tensor([0, 1], dtype=torch.int32)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    c8 = torch.randn(2, 2, 16, 8, 128, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="RoPE"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
               pos_encoding_mode="ROPE_LLAMA")  # fmt: skip
    with pytest.raises(NotImplementedError, match="fp8 queries"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)
    w.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w.run(q, c8.to(torch.float8_e5m2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w.run(q, c8.float().to(torch.bfloat16))
    for bad in (float("nan"), -1.0, 0.0, torch.tensor([1.0, 2.0], device="cuda")):
        with pytest.raises(ValueError, match="k_scale"):
            w.run(q, c8, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale"):
            w.run(q, c8, v_scale=bad)
    out = w.run(q, c8)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
