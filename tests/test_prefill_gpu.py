"""Batch prefill (``cute_attn.prefill``) against the fp32 reference (``cute_attn.testing``).

GPU tests (marked ``gpu``; they also need the prefill modules in the cache, e.g.
``python -m cute_attn compile --arch sm_90a --preset prefill``): the H200 runs the kernel on
fresh random inputs over batch 1-32, query lengths 1-8192 (odd ones included), kv = qo and
kv > qo (append), page sizes 1/16/64, ragged and paged KV, NHD/HND, head dims 64/128/256, GQA
groups 1/4/8, causal on/off, sliding window, soft-cap, fp16/bf16, forced split-KV (partial
slots + merge), bitwise determinism, batch invariance with ``fixed_split_size`` and CUDA-graph
capture + replay under new plans.  Outputs and LSE are pre-filled with NaN and every cache
slot that no request owns (spare pages, the slack of last pages, rows past the ragged KV) holds
NaN: a missed row or a wrong read fails the test.

CPU tests (no mark, run in CI): ``plan()`` / ``run()`` of both wrappers against a Python
emulation of the kernel contract (``cute_attn/sched/__init__.py``): the emulated kernels
execute exactly the work items, partial slots and merge tasks the wrapper uploaded, on the
tensors it passes (after the real ABI packer has checked them), so the tile choice, the KV
views (ragged / paged, NHD / HND), the index arrays, the split + merge path and the errors are
all checked without a GPU.

Tolerances (as the decode tests): relative L2 error of the output vs the fp32 reference, bf16
2e-2, fp16 4e-3 (the kernel rounds P to the input dtype for the PV product, as FlashInfer and
FA do); LSE (base 2) absolute 2e-3 where finite, and -inf exactly where the reference has it
(with o = 0 there).
"""

import math
import random

import pytest
import torch

from cute_attn.testing import ragged_reference

gpu = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = 2e-3
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
DEV = "cuda"  # where the GPU tests put their tensors


# --------------------------------------------------------------------------- inputs


def _cumsum(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return out


def make_ragged(qo_lens, kv_lens, hq, hk, d, dtype, layout, gen, device, tail=0, dv=None):
    """q [sum qo, hq, d]; k/v [sum kv + tail, hk, d] (NHD) or [hk, sum kv + tail, d] (HND), the
    ``tail`` rows past kv_indptr[-1] NaN; ``dv``: v's head dim (None: d). Returns q, k, v,
    qo_indptr, kv_indptr, (k_nhd, v_nhd)."""
    tq, tk, dv = sum(qo_lens), sum(kv_lens), dv or d
    q = torch.randn(tq, hq, d, generator=gen).to(dtype).to(device)
    k = torch.full((tk + tail, hk, d), float("nan"), dtype=dtype, device=device)
    v = torch.full((tk + tail, hk, dv), float("nan"), dtype=dtype, device=device)
    k[:tk] = torch.randn(tk, hk, d, generator=gen).to(dtype).to(device)
    v[:tk] = torch.randn(tk, hk, dv, generator=gen).to(dtype).to(device)
    ref_kv = (k[:tk], v[:tk])
    if layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    qo = torch.tensor(_cumsum(qo_lens), dtype=torch.int32)
    kv = torch.tensor(_cumsum(kv_lens), dtype=torch.int32)
    return q, k, v, qo, kv, ref_kv


def make_paged(kv_lens, page_size, hk, d, dtype, layout, single_tensor, gen, device, spare=3, dv=None):
    """A paged cache with shuffled pages; NaN in every slot no request owns; ``dv``: v's head dim
    (None: d; a (k, v) tuple then). Returns cache, page indptr, page indices, last_page_len,
    (k, v) ragged [sum kv, hk, d / dv], kv token indptr."""
    ps, dv = page_size, dv or d
    pages = [(n + ps - 1) // ps for n in kv_lens]
    total = sum(pages) + spare
    indptr = _cumsum(pages)
    indices = torch.randperm(total, generator=gen)[: indptr[-1]].to(torch.int32)
    tk = sum(kv_lens)
    k_rag = torch.randn(tk, hk, d, generator=gen).to(dtype)
    v_rag = torch.randn(tk, hk, dv, generator=gen).to(dtype)
    slots = []
    for b, n in enumerate(kv_lens):
        pos = torch.arange(n)
        slots.append(indices[indptr[b] + pos // ps].long() * ps + pos % ps)
    slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
    kc = torch.full((total * ps, hk, d), float("nan"), dtype=dtype)
    vc = torch.full((total * ps, hk, dv), float("nan"), dtype=dtype)
    kc[slots], vc[slots] = k_rag, v_rag
    kc, vc = kc.view(total, ps, hk, d), vc.view(total, ps, hk, dv)
    if layout == "HND":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    kc, vc = kc.to(device), vc.to(device)
    cache = torch.stack([kc, vc], dim=1) if single_tensor else (kc, vc)
    last = torch.tensor([n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    kv_tok = torch.tensor(_cumsum(kv_lens), dtype=torch.int32)
    return (cache, torch.tensor(indptr, dtype=torch.int32), indices, last, (k_rag.to(device), v_rag.to(device)), kv_tok)


def check(out, lse, ref_o, ref_lse, dtype, rows=None):
    if rows is not None:
        out, lse, ref_o, ref_lse = out[:rows], lse[:rows], ref_o[:rows], ref_lse[:rows]
    assert not torch.isnan(out).any(), "NaN in output (unwritten row or a wrong read)"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    err = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
    assert err < TOL[dtype], f"relative error {err:.3e} >= {TOL[dtype]}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs from the reference"
    if fin.any():
        e = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert e < LSE_TOL, f"LSE error {e:.3e}"
    assert (out[~fin] == 0).all(), "rows that see no key must be 0"


def _gen(seed=None):
    return torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))


def _ws(device, mb=128):
    return torch.empty(mb << 20, dtype=torch.uint8, device=device)


def run_ragged(
    qo_lens,
    kv_lens,
    hq,
    hk,
    d,
    dtype,
    *,
    causal=False,
    layout="NHD",
    soft_cap=None,
    window_left=-1,
    device=None,
    workspace=None,
    seed=None,
    tail=0,
    **plan_kw,
):
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    q, k, v, qo, kv, (k_ref, v_ref) = make_ragged(qo_lens, kv_lens, hq, hk, d, dtype, layout, gen, device, tail)
    w = BatchPrefillWithRaggedKVCacheWrapper(workspace if workspace is not None else _ws(device), kv_layout=layout)
    w.plan(
        qo,
        kv,
        hq,
        hk,
        d,
        causal=causal,
        q_data_type=dtype,
        logits_soft_cap=soft_cap,
        window_left=window_left,
        **plan_kw,
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    w.run(q, k, v, out=out, lse=lse)
    ref_o, ref_lse = ragged_reference(
        q, k_ref, v_ref, qo, kv, causal=causal, logits_soft_cap=soft_cap, window_left=window_left
    )
    check(out, lse, ref_o, ref_lse, dtype)
    return w, (q, k, v), out, lse


def run_paged(
    qo_lens,
    kv_lens,
    page_size,
    hq,
    hk,
    d,
    dtype,
    *,
    causal=False,
    layout="NHD",
    single_tensor=False,
    soft_cap=None,
    window_left=-1,
    device=None,
    workspace=None,
    seed=None,
    **plan_kw,
):
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    cache, indptr, indices, last, (k_ref, v_ref), kv_tok = make_paged(
        kv_lens, page_size, hk, d, dtype, layout, single_tensor, gen, device
    )
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
    qo = torch.tensor(_cumsum(qo_lens), dtype=torch.int32)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace if workspace is not None else _ws(device), kv_layout=layout)
    w.plan(
        qo,
        indptr,
        indices,
        last,
        hq,
        hk,
        d,
        page_size,
        causal=causal,
        q_data_type=dtype,
        logits_soft_cap=soft_cap,
        window_left=window_left,
        **plan_kw,
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    w.run(q, cache, out=out, lse=lse)
    ref_o, ref_lse = ragged_reference(
        q, k_ref, v_ref, qo, kv_tok, causal=causal, logits_soft_cap=soft_cap, window_left=window_left
    )
    check(out, lse, ref_o, ref_lse, dtype)
    return w, (q, cache), out, lse


def _append_lens(rng, n, qmax, extra_max):
    qo = [rng.randrange(1, qmax + 1) for _ in range(n)]
    kv = [x + (rng.randrange(0, extra_max + 1) if rng.random() < 0.6 else 0) for x in qo]
    return qo, kv


# =========================================================================== GPU tests


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_ragged_head_dims_gqa(d, dtype, hq, hk, causal):
    qo = [1, 17, 128, 300, 5, 77]
    kv = [1, 117, 128, 333, 2005, 77]  # kv = qo and kv > qo (append)
    run_ragged(qo, kv, hq, hk, d, DTYPES[dtype], causal=causal)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("single_tensor", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_pages_layouts(page_size, layout, single_tensor, causal):
    """The kernel reading the cache itself (TMA page boxes or the cp.async gather; kv_pass
    pinned off: at page 1 these lengths are near the KV pass's break-even)."""
    rng = random.Random()
    qo, kv = _append_lens(rng, 9, 700, 1500)
    w = run_paged(
        qo,
        kv,
        page_size,
        32,
        8,
        128,
        torch.bfloat16,
        causal=causal,
        layout=layout,
        single_tensor=single_tensor,
        kv_pass=False,
    )[0]
    assert w._gathered is None and w._spec_kw["paged"]


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_hnd_and_gqa8(layout, causal):
    qo, kv = [33, 250, 1, 1024], [40, 250, 900, 1024]
    run_ragged(qo, kv, 64, 8, 128, torch.float16, causal=causal, layout=layout)


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 32])
def test_batch_sizes_odd_lengths(batch, paged):
    rng = random.Random()
    qo, kv = _append_lens(rng, batch, 999, 777)
    qo = [x | 1 for x in qo]  # odd query lengths
    kv = [max(a, b) for a, b in zip(qo, kv)]
    if paged:
        run_paged(qo, kv, 16, 16, 4, 128, torch.bfloat16, causal=True)
    else:
        run_ragged(qo, kv, 16, 4, 128, torch.bfloat16, causal=True)


@gpu
@pytest.mark.parametrize("case", ["ragged_8k_causal_hd128", "paged16_append_hd256", "ragged_8k_plus_1_hd64"])
def test_long_sequences(case):
    if case == "ragged_8k_causal_hd128":
        run_ragged([8192], [8192], 8, 8, 128, torch.bfloat16, causal=True)
    elif case == "paged16_append_hd256":
        run_paged([4097, 3], [6000, 4000], 16, 16, 4, 256, torch.float16)
    else:
        run_ragged([8192, 1], [8192, 8191], 8, 1, 64, torch.bfloat16, causal=True)


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", ["decode_like", "short"])
def test_small_query_tiles(lens, causal, paged):
    """Batches the planner gives 16- or 64-row tiles: the wrapper runs them with 64-row tiles."""
    if lens == "decode_like":
        qo, kv, hq, hk = [1] * 8, [1, 5, 100, 3000, 64, 65, 1, 7], 32, 8
    else:
        qo, kv, hq, hk = [3, 5, 9, 2], [3, 700, 9, 50], 64, 8
    fn = (lambda *a, **k: run_paged(qo, kv, 16, *a, **k)) if paged else (lambda *a, **k: run_ragged(qo, kv, *a, **k))
    w = fn(hq, hk, 128, torch.bfloat16, causal=causal)[0]
    assert w._tile == 64


@gpu
@pytest.mark.parametrize("causal", [False, True])
# caps 30 / 50: the fixed shift; 60 (cap·log2 e 86.6): the running max, with the window
@pytest.mark.parametrize("soft_cap,window", [(30.0, -1), (None, 100), (50.0, 7), (60.0, 7), (None, 0)])
def test_softcap_window(soft_cap, window, causal):
    qo, kv = [100, 333, 1, 1000, 64], [100, 900, 50, 1000, 2000]
    w = run_ragged(qo, kv, 32, 8, 128, torch.bfloat16, causal=causal, soft_cap=soft_cap, window_left=window)[0]
    assert w._tile == 128  # the variant specializations are compiled for 128-row tiles


@gpu
# cap·log2 e 57.7, 72.1 (Gemma 2's 50), 80.8: the fixed shift (bias 15 / 44 / 62); 86.6: the running max
@pytest.mark.parametrize("soft_cap", [40.0, 50.0, 56.0, 60.0])
def test_softcap_saturated(soft_cap):
    """Logits far past the cap (sm_scale 3: q·k·sm_scale ~ ±34 per std): tanh saturates at ±1, so
    the logits spread 2·cap·log2 e in base 2 -- the range the kernel's fixed shift (and its bias)
    must keep normal."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    gen = _gen()
    qo_lens, kv_lens = [77, 300, 5], [500, 300, 2000]
    q, k, v, qo, kv, (k_ref, v_ref) = make_ragged(qo_lens, kv_lens, 16, 4, 128, torch.bfloat16, "NHD", gen, DEV)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(DEV))
    w.plan(qo, kv, 16, 4, 128, causal=True, q_data_type=torch.bfloat16, logits_soft_cap=soft_cap, sm_scale=3.0)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], 16), float("nan"), device=DEV)
    w.run(q, k, v, out=out, lse=lse)
    ref_o, ref_lse = ragged_reference(q, k_ref, v_ref, qo, kv, causal=True, logits_soft_cap=soft_cap, sm_scale=3.0)
    check(out, lse, ref_o, ref_lse, torch.bfloat16)


@gpu
@pytest.mark.parametrize("soft_cap", [30.0, 50.0, 56.0])
def test_softcap_all_logits_near_minus_cap(soft_cap):
    """Every logit of every row near -cap (q·k·sm_scale = -120: tanh at -0.97 .. -1): with the
    soft-cap's fixed shift the weights sit at the bottom of their range, where an underflow to
    0 would leave a row with l = 0 (o = 0, LSE -inf) or lose P V products.  Keys all equal, so
    every row's answer is the mean of its values."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    gen = _gen()
    qo_lens, kv_lens = [3, 130], [500, 257]
    q, k, v, qo, kv, (k_ref, v_ref) = make_ragged(qo_lens, kv_lens, 8, 2, 128, torch.bfloat16, "NHD", gen, DEV)
    u = torch.randn(128, generator=gen).to(DEV)
    u = u / u.norm()
    k[:] = u.to(k.dtype)  # k_ref is a view of k
    q[:] = (-40.0 * 128**0.5 * u).to(q.dtype)  # q·k·sm_scale = -40 · 3 = -120 with sm_scale 3 / sqrt(128)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(DEV))
    w.plan(
        qo, kv, 8, 2, 128, causal=False, q_data_type=torch.bfloat16, logits_soft_cap=soft_cap, sm_scale=3.0 * 128**-0.5
    )  # x3: q.k * sm_scale ~ -120, far past every cap here
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], 8), float("nan"), device=DEV)
    w.run(q, k, v, out=out, lse=lse)
    ref_o, ref_lse = ragged_reference(
        q, k_ref, v_ref, qo, kv, causal=False, logits_soft_cap=soft_cap, sm_scale=3.0 * 128**-0.5
    )
    assert torch.isfinite(ref_lse).all()
    check(out, lse, ref_o, ref_lse, torch.bfloat16)


@gpu
@pytest.mark.parametrize("soft_cap,window", [(30.0, -1), (None, 100)])
def test_softcap_window_fp16(soft_cap, window):
    qo, kv = [100, 333, 1000], [100, 900, 1000]
    run_ragged(qo, kv, 32, 8, 128, torch.float16, causal=True, soft_cap=soft_cap, window_left=window)


@gpu
def test_empty_requests():
    # qo_len 0 requests, kv_len 0 requests (non-causal: o = 0, lse = -inf), both, and a normal one
    qo, kv = [0, 5, 0, 300, 7], [10, 0, 0, 500, 7]
    run_ragged(qo, kv, 8, 8, 128, torch.bfloat16)
    run_paged(qo, kv, 16, 8, 8, 128, torch.bfloat16)
    run_ragged([4, 9], [0, 0], 8, 8, 64, torch.float16)  # no KV at all


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "page_size,layout,single_tensor,d,dtype",
    [
        (1, "NHD", False, 128, "bf16"),
        (1, "HND", True, 64, "f16"),
        (3, "NHD", True, 256, "bf16"),
        (16, "HND", False, 128, "f16"),
        (64, "NHD", False, 64, "bf16"),
        (5, "HND", False, 256, "f16"),
    ],
)
def test_paged_kv_pass(page_size, layout, single_tensor, d, dtype, causal):
    """plan(kv_pass=True): the KV pass gathers the cache (NaN in every slot no request owns)
    into the workspace and the ragged kernel reads it by TMA; a second run is bitwise equal."""
    rng = random.Random()
    qo, kv = _append_lens(rng, 7, 600, 1500)
    if not causal:  # requests without queries / without keys
        qo, kv = qo + [0, 4], kv + [33, 0]
    w, (q, cache), out, lse = run_paged(
        qo,
        kv,
        page_size,
        16,
        4,
        d,
        DTYPES[dtype],
        causal=causal,
        layout=layout,
        single_tensor=single_tensor,
        kv_pass=True,
    )
    assert w._gathered is not None and not w._spec_kw["paged"]
    out2, lse2 = w.run(q, cache, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@gpu
def test_paged_kv_pass_auto():
    """Long queries per key at page 1: plan() picks the KV pass by itself (kv_pass_pays); at
    page 16 the kernel reads the pages by TMA; kv_pass=False keeps the in-kernel gather."""
    qo, kv = [2048, 700], [2048, 3000]
    w = run_paged(qo, kv, 1, 16, 4, 128, torch.bfloat16, causal=True)[0]
    assert w._gathered is not None
    w = run_paged(qo, kv, 16, 16, 4, 128, torch.bfloat16, causal=True)[0]
    assert w._gathered is None and w._spec_kw["paged"]
    w = run_paged(qo, kv, 1, 16, 4, 128, torch.bfloat16, causal=True, kv_pass=False)[0]
    assert w._gathered is None and w._spec_kw["paged"]


@gpu
def test_kv_pass_replans_one_wrapper():
    """One wrapper re-planned across the two paths (pass, in-kernel, pass again), page ids on
    the GPU, one kv head: each run against the reference (NaN in unowned slots)."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    hq, hk, d, ps, dt = 8, 1, 128, 1, torch.bfloat16
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(DEV))
    gen = _gen()
    for qo, kv, kv_pass, gathered in (
        ([3000, 64], [3000, 900], None, True),
        ([5, 9], [700, 40], None, False),
        ([3000], [3100], False, False),
        ([1200, 7, 300], [4000, 7, 300], True, True),
    ):
        cache, indptr, indices, last, (k_ref, v_ref), kv_tok = make_paged(kv, ps, hk, d, dt, "NHD", False, gen, DEV)
        q = torch.randn(sum(qo), hq, d, generator=gen).to(dt).to(DEV)
        qo_t = torch.tensor(_cumsum(qo), dtype=torch.int32)
        w.plan(qo_t, indptr, indices.to(DEV), last, hq, hk, d, ps, causal=True, q_data_type=dt, kv_pass=kv_pass)
        assert (w._gathered is not None) == gathered, (qo, kv, kv_pass)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], hq), float("nan"), device=DEV)
        w.run(q, cache, out=out, lse=lse)
        check(out, lse, *ragged_reference(q, k_ref, v_ref, qo_t, kv_tok, causal=True), dt)


@gpu
def test_ragged_nan_past_the_kv():
    """k/v with NaN rows after kv_indptr[-1]: never reach the output."""
    run_ragged([300, 77], [1000, 77], 16, 4, 128, torch.bfloat16, causal=True, tail=300)


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_split_kv_by_the_planner(paged):
    """One long request over few kv heads: fewer tiles than SMs, so the planner cuts the KV
    (partial slots + merge)."""
    if paged:
        w = run_paged([512], [30000], 16, 4, 2, 128, torch.bfloat16, causal=True)[0]
    else:
        w = run_ragged([512], [30000], 4, 2, 128, torch.bfloat16, causal=True)[0]
    assert w._plan.has_split


@gpu
@pytest.mark.parametrize("paged,ps", [(False, 0), (True, 16), (True, 1)], ids=["ragged", "page16", "page1"])
def test_fixed_split_size_is_batch_invariant(paged, ps):
    """fixed_split_size forces partial slots + merge, and a request's output is bitwise the
    same whatever else is batched with it (at page 1 too, where the KV pass's model -- which
    weighs the whole batch -- must stay out of it); disable_split_kv still gives the right
    answer."""
    hq, hk, d = 16, 4, 128
    dev = DEV
    gen = _gen()
    q_r = torch.randn(300, hq, d, generator=gen).to(torch.bfloat16).to(dev)
    k_r = torch.randn(2300, hk, d, generator=gen).to(torch.bfloat16).to(dev)
    v_r = torch.randn(2300, hk, d, generator=gen).to(torch.bfloat16).to(dev)
    outs = []
    # the second batch would make the KV pass's model pay at page 1 (its 1600-token prefill), the
    # first not
    for others in ([(17, 800)], [(3, 3), (64, 64), (1600, 1600)]):
        qo = [300] + [a for a, _ in others]
        kv = [2300] + [b for _, b in others]
        q = torch.cat([q_r] + [torch.randn(a, hq, d, generator=gen).to(torch.bfloat16).to(dev) for a, _ in others])
        k = torch.cat([k_r] + [torch.randn(b, hk, d, generator=gen).to(torch.bfloat16).to(dev) for _, b in others])
        v = torch.cat([v_r] + [torch.randn(b, hk, d, generator=gen).to(torch.bfloat16).to(dev) for _, b in others])
        qo_t, kv_t = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(kv), dtype=torch.int32)
        ref_o, ref_lse = ragged_reference(q, k, v, qo_t, kv_t, causal=True)
        for disable in (False, True):
            if paged:
                from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

                # pages: request b's tokens in pages of its own, in order
                pages = [(n + ps - 1) // ps for n in kv]
                kc = torch.zeros(sum(pages), ps, hk, d, dtype=torch.bfloat16, device=dev)
                vc = torch.zeros_like(kc)
                off = 0
                for b, n in enumerate(kv):
                    p0 = sum(pages[:b])
                    kc.view(-1, hk, d)[p0 * ps : p0 * ps + n] = k[off : off + n]
                    vc.view(-1, hk, d)[p0 * ps : p0 * ps + n] = v[off : off + n]
                    off += n
                last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv, pages)], dtype=torch.int32)
                w = BatchPrefillWithPagedKVCacheWrapper(_ws(dev))
                kw = dict(disable_split_kv=True) if disable else dict(fixed_split_size=1024 // ps)  # 1024 tokens
                w.plan(
                    qo_t,
                    torch.tensor(_cumsum(pages), dtype=torch.int32),
                    torch.arange(sum(pages), dtype=torch.int32),
                    last,
                    hq,
                    hk,
                    d,
                    ps,
                    causal=True,
                    q_data_type=torch.bfloat16,
                    **kw,
                )
                out, lse = w.run(q, (kc, vc), return_lse=True)
            else:
                from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

                w = BatchPrefillWithRaggedKVCacheWrapper(_ws(dev))
                kw = dict(disable_split_kv=True) if disable else dict(fixed_split_size=1024)
                w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=torch.bfloat16, **kw)
                out, lse = w.run(q, k, v, return_lse=True)
            check(out, lse, ref_o, ref_lse, torch.bfloat16)
            if disable:
                assert not w._plan.has_split
            else:
                assert w._plan.has_split
                outs.append((out[:300].clone(), lse[:300].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_deterministic(paged):
    qo, kv = [512, 3000, 17], [20000, 3000, 5000]  # the first one is split
    if paged:
        w, (q, cache), out, lse = run_paged(qo, kv, 16, 8, 2, 128, torch.bfloat16, causal=True)
        out2, lse2 = w.run(q, cache, return_lse=True)
    else:
        w, (q, k, v), out, lse = run_ragged(qo, kv, 8, 2, 128, torch.bfloat16, causal=True)
        out2, lse2 = w.run(q, k, v, return_lse=True)
    assert w._plan.has_split
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def replay_ragged_plans(hq, hk, d, t_max, kv_max, first, cases, reference, **plan_kw):
    """A CUDA-graph ragged wrapper (indptr buffers for len(first) requests): plan ``first`` (it
    fixes the query tokens), capture run(), then per (qo_lens, kv_lens) of ``cases`` plan again,
    replay into NaN-filled outputs and check the first qo_indptr[-1] rows against
    ``reference(q, k, v, qo_indptr, kv_indptr)`` (causal, bf16)."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    gen = _gen()
    qo_buf = torch.zeros(len(first[0]) + 1, dtype=torch.int32, device="cuda")
    kv_buf = torch.zeros(len(first[0]) + 1, dtype=torch.int32, device="cuda")
    w = BatchPrefillWithRaggedKVCacheWrapper(
        _ws("cuda"), use_cuda_graph=True, qo_indptr_buf=qo_buf, kv_indptr_buf=kv_buf
    )
    q = torch.randn(t_max, hq, d, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(kv_max, hk, d, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(kv_max, hk, d, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(t_max, hq, device="cuda")

    def plan(qo, kv):
        qo_t, kv_t = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(kv), dtype=torch.int32)
        w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=torch.bfloat16, **plan_kw)
        return qo_t, kv_t

    plan(*first)
    w.run(q, k, v, out=out, lse=lse)  # warm-up: modules loaded outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out, lse=lse)
    for qo, kv in cases:
        qo_t, kv_t = plan(qo, kv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        n = int(qo_t[-1])
        ref_o, ref_lse = reference(q[:n], k, v, qo_t, kv_t)
        check(out, lse, ref_o, ref_lse, torch.bfloat16, rows=n)


@gpu
def test_cuda_graph_ragged_replay_with_new_plans():
    replay_ragged_plans(
        16,
        4,
        128,
        4096,
        40000,
        ([2000, 24, 1000, 1072], [2000, 1024, 1007, 4072]),  # fixes 4096 query tokens
        [
            ([1, 1, 1, 4093], [1, 1, 1, 30000]),  # split by the planner
            ([1000, 1000, 1000, 1000], [1000, 5000, 1000, 9000]),
            ([5, 77, 300, 1], [5, 77, 300, 1]),
            ([2000, 24, 1000], [2000, 1024, 1007]),
        ],  # a smaller batch
        lambda q, k, v, qo_t, kv_t: ragged_reference(q, k, v, qo_t, kv_t, causal=True),
    )


@gpu
def test_cuda_graph_paged_replay_with_new_plans():
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    hq, hk, d, ps, max_b, t_max, max_pages = 32, 8, 128, 16, 4, 2048, 4096
    gen = _gen()
    bufs = dict(
        qo_indptr_buf=torch.zeros(max_b + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indptr_buf=torch.zeros(max_b + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buf=torch.zeros(max_b, dtype=torch.int32, device="cuda"),
    )
    w = BatchPrefillWithPagedKVCacheWrapper(_ws("cuda"), kv_layout="HND", use_cuda_graph=True, **bufs)
    kc = torch.randn(max_pages, hk, ps, d, generator=gen).to(torch.bfloat16).cuda()
    vc = torch.randn(max_pages, hk, ps, d, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(t_max, hq, d, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(t_max, hq, device="cuda")

    def plan(qo, kv):
        pages = [(n + ps - 1) // ps for n in kv]
        indices = torch.randperm(max_pages, generator=gen)[: sum(pages)].to(torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv, pages)], dtype=torch.int32)
        qo_t, indptr = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(pages), dtype=torch.int32)
        w.plan(qo_t, indptr, indices, last, hq, hk, d, ps, q_data_type=torch.bfloat16)
        return qo_t, indptr, indices, last

    plan([1024, 1024, 0, 0], [1024, 3000, 5, 16])
    w.run(q, (kc, vc), out=out, lse=lse)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, (kc, vc), out=out, lse=lse)
    for qo, kv in (
        ([1, 2047, 0, 0], [9000, 2047, 1, 1]),
        ([500, 500, 500, 500], [500, 30000, 700, 900]),
        ([3, 1, 4, 1], [3, 1, 4, 1]),
    ):
        qo_t, indptr, indices, last = plan(qo, kv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        from cute_attn.testing import paged_reference

        n = int(qo_t[-1])
        ref_o, ref_lse = paged_reference(q[:n], (kc, vc), qo_t, indptr, indices, last, kv_layout="HND")
        check(out, lse, ref_o, ref_lse, torch.bfloat16, rows=n)


@gpu
def test_capture_without_cuda_graph_flag_is_an_error():
    w, (q, k, v), out, lse = run_ragged([10, 20], [10, 30], 8, 8, 64, torch.float16)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="use_cuda_graph"):
        with torch.cuda.graph(g):
            w.run(q, k, v)


@gpu
def test_plan_during_capture_is_an_error():
    w = run_ragged([10], [10], 8, 8, 64, torch.float16)[0]
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="plan"):
        with torch.cuda.graph(g):
            w.plan(torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 8, 8, 64)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill(layout, causal):
    from cute_attn.prefill import single_prefill_with_kv_cache
    from cute_attn.testing import single_reference

    qo_len, kv_len, hq, hk, d = 777, 1500, 32, 4, 128
    q = torch.randn(qo_len, hq, d, dtype=torch.bfloat16, device="cuda")
    shape = (kv_len, hk, d) if layout == "NHD" else (hk, kv_len, d)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=causal, kv_layout=layout, return_lse=True)
    ref_o, ref_lse = single_reference(q, k, v, kv_layout=layout, causal=causal)
    check(out, lse, ref_o, ref_lse, torch.bfloat16)
    out2 = single_prefill_with_kv_cache(q, k, v, causal=causal, kv_layout=layout)
    assert torch.equal(out, out2)


@gpu
def test_gpu_validation_errors():
    """What needs the real device (the rest is checked by the CPU tests below)."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    big = torch.arange(0, 1001 * 512, 512, dtype=torch.int32)
    with pytest.raises(ValueError, match="bytes"):  # 1 MiB is too small for 512k tokens x 64 heads
        w.plan(big, big, 64, 8, 128, q_data_type=torch.bfloat16)
    w = run_ragged([10], [10], 8, 8, 64, torch.float16)[0]
    with pytest.raises(ValueError, match="q must be"):
        w.run(
            torch.randn(10, 8, 64, dtype=torch.bfloat16, device="cuda"),
            torch.randn(10, 8, 64, dtype=torch.float16, device="cuda"),
            torch.randn(10, 8, 64, dtype=torch.float16, device="cuda"),
        )


# =========================================================================== CPU tests
# The wrappers on the CPU: CUDA-only queries patched, the kernels replaced by an emulation of
# the contract that runs on the exact tensors run() passes (after the real ABI packer).


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that passes the wrappers' ``is_cuda`` checks (workspace, graph buffers)."""

    @property
    def is_cuda(self):
        return True


def _fake_cuda(t):
    return torch.Tensor._make_subclass(_FakeCudaTensor, t)


class _FakeEvent:
    def record(self, *a):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t


def _emulate_kv8_pass(k4, v4, kv_indptr, work, work_indptr, k8, v8, state, plan, *pages):
    """``kernels/prefill_sm90_kv8_pass.py``'s contract: the state zeroed, every (block of 128
    rows of the whole ragged cache, kv head) in the plan's tasks exactly once, with the request
    of its first row, in the order the CTAs first need them (each CTA walks its items' blocks
    from last to first, one per step: counted here item by item); then K / V dequantized into
    the 16-bit copy, from a ragged cache or (``pages``: page indptr, page ids) a paged one."""
    from cute_attn.sched import workspace as ws

    assert (state == 0).all() and state.numel() >= 4
    plan, ind = plan.long(), kv_indptr.long()
    n, toff, total, hk = int(plan[0]), int(plan[1]), int(plan[2]), k4.shape[2]
    assert total == int(ind[-1])
    blocks = -(-total // 128)
    fields = plan[toff : toff + 3 * n].view(-1, 3).tolist()
    assert all(ind[r] <= 128 * g < ind[r + 1] for g, _, r in fields)
    tasks = [f[:2] for f in fields]
    want = {(g, h) for g in range(blocks) for h in range(hk)}
    assert len(tasks) == len(want) and {tuple(t) for t in tasks} == want and state.numel() - 4 == len(want)
    need = {}
    ip = work_indptr.tolist()
    for c in range(len(ip) - 1):
        step = 0
        for it in range(ip[c], ip[c + 1]):
            f = work[it].tolist()
            ks, ke = f[ws.W_KV_START], f[ws.W_KV_END]
            for b in reversed(range(-(-(ke - ks) // 128))):
                row = int(ind[f[ws.W_REQ]]) + ks + 128 * b
                for g in {row // 128, (min(row + 128, total) - 1) // 128}:
                    key = (g, f[ws.W_KV_HEAD])
                    need[key] = min(need.get(key, step), step)
                step += 1
    steps = [need.get(tuple(t), 1 << 40) for t in tasks]
    assert steps == sorted(steps)
    if not pages:
        k4[0, :total] = k8[0, :total].to(k4.dtype)
        v4[0, :total] = v8[0, :total].to(v4.dtype)
        return
    page_indptr, page_ids = (t.long() for t in pages)
    ps = k8.shape[1]
    for r in range(ind.numel() - 1):
        t = torch.arange(int(ind[r + 1] - ind[r]))
        page, slot = page_ids[page_indptr[r] + t // ps], t % ps
        k4[0, ind[r] : ind[r + 1]] = k8[page, slot].to(k4.dtype)
        v4[0, ind[r] : ind[r + 1]] = v8[page, slot].to(v4.dtype)


def _emulate_prefill(
    p,
    q,
    k4,
    v4,
    kv_indptr,
    kv_indices,
    out,
    lse,
    work,
    work_indptr,
    part_o,
    part_lse,
    group,
    sm_scale,
    soft_cap,
    window_left,
    num_ctas,
    *extra,
):
    """What kernels/prefill_sm90.py must compute, item by item (fp64)."""
    from cute_attn.sched import workspace as ws

    tile = p["tile_q"]
    assert work_indptr.numel() == num_ctas + 1
    if p.get("kv8_pass"):  # the kernel's own pass: fp8 cache -> the 16-bit K / V it then reads
        _emulate_kv8_pass(k4, v4, kv_indptr, work, work_indptr, *extra)
    # an fp8 cache reaches the kernel only where its spec widens it (kv_dtype), else the KV pass's output
    assert k4.dtype == v4.dtype and q.dtype == out.dtype, (q.dtype, k4.dtype, out.dtype)
    assert (k4.dtype != q.dtype) == ("kv_dtype" in p and not p.get("kv8_pass")), (k4.dtype, p)
    part_o.fill_(float("nan"))  # stale partials must never be read
    part_lse.fill_(float("nan"))
    ip = work_indptr.tolist()
    kvp = kv_indptr.long()
    for c in range(num_ctas):
        for it in range(ip[c], ip[c + 1]):
            f = work[it].tolist()
            b, h, r0, nr = f[ws.W_REQ], f[ws.W_KV_HEAD], f[ws.W_ROW_START], f[ws.W_NUM_ROWS]
            ks, ke, dest = f[ws.W_KV_START], f[ws.W_KV_END], f[ws.W_DEST]
            qoff, qlen, klen = f[ws.W_QO_OFFSET], f[ws.W_QO_LEN], f[ws.W_KV_LEN]
            assert 1 <= nr <= tile and 0 <= ks <= ke <= klen
            rows = torch.arange(r0, r0 + nr)
            tok, heads = rows // group, h * group + rows % group
            qv = q[qoff + tok, heads].double()
            pos = torch.arange(ks, ke)
            if p["paged"]:
                ps = k4.shape[1]
                page = kv_indices.long()[kvp[b] + pos // ps]
                assert (page < k4.shape[0]).all()
                kk, vv = k4[page, pos % ps, h].double(), v4[page, pos % ps, h].double()
            else:
                assert k4.shape[0] == 1 and (ke == ks or int(kvp[b]) + ke <= k4.shape[1])
                kk, vv = k4[0, kvp[b] + pos, h].double(), v4[0, kvp[b] + pos, h].double()
            s = qv @ kk.T * sm_scale
            if p["soft_cap"]:
                s = soft_cap * torch.tanh(s / soft_cap)
            qpos = (klen - qlen + tok)[:, None]
            keep = torch.ones_like(s, dtype=torch.bool)
            if p["causal"]:
                keep &= pos[None, :] <= qpos
            if p["window"]:
                keep &= pos[None, :] >= qpos - window_left
            s = s.masked_fill(~keep, -math.inf)
            m = s.amax(1, keepdim=True) if s.shape[1] else torch.full((nr, 1), -math.inf, dtype=torch.float64)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            e = torch.exp(s - m)
            l_ = e.sum(1, keepdim=True)
            o = torch.where(l_ > 0, (e @ vv) / l_.clamp_min(1e-300), torch.zeros(1, dtype=torch.float64))
            row_lse = ((m + torch.log(l_)) / math.log(2)).squeeze(1)
            if dest < 0:
                out[qoff + tok, heads] = o.to(out.dtype)
                lse[qoff + tok, heads] = row_lse.float()
            else:
                part_o[dest * tile : dest * tile + nr] = o.float()
                part_lse[dest * tile : dest * tile + nr] = row_lse.float()


def _emulate_merge(p, part_o, part_lse, tasks, meta, out, lse, group, num_ctas):
    from cute_attn.sched import workspace as ws

    tile = p["tile_q"]
    for t in range(int(meta[ws.META_NUM_MERGE_TASKS])):
        f = tasks[t].tolist()
        h, r0, nr, qoff = f[ws.M_KV_HEAD], f[ws.M_ROW_START], f[ws.M_NUM_ROWS], f[ws.M_QO_OFFSET]
        s0, ns = f[ws.M_SLOT_START], f[ws.M_NUM_SLOTS]
        rows = torch.arange(r0, r0 + nr)
        idx = (s0 + torch.arange(ns))[:, None] * tile + torch.arange(nr)[None, :]  # [ns, nr]
        s, o = part_lse[idx].double(), part_o[idx].double()
        m = s.amax(0)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        wgt = torch.exp2(s - m)
        tot = wgt.sum(0)
        num = (wgt[..., None] * o).sum(0)  # a slot the attention kernel did not write is NaN
        merged = torch.where(
            tot[:, None] > 0, num / tot.clamp_min(1e-300)[:, None], torch.zeros(1, dtype=torch.float64)
        )
        tok, heads = qoff + rows // group, h * group + rows % group
        out[tok, heads] = merged.to(out.dtype)
        lse[tok, heads] = (m + torch.log2(tot)).float()


def _emulate_kv_pass(
    p, k, v, k_out, v_out, qo_indptr, kv_indptr, page_indptr, page_indices, batch, sm_scale, num_ctas, *vargs
):
    """kernels/kv_pass.py: ``paged``: request b's tokens gathered from its pages into rows
    ``kv_indptr[b]..`` of the outputs (K and V); ``kv_dtype`` (fp8): K and V converted to the
    output dtype (exact); a variant: its keys through ``transform_k`` (RoPE: key j of a request
    at position j), rounded to the output dtype; other rows left alone."""
    from cute_attn.abi.dtypes import to_torch
    from cute_attn.families.base import spec_variant as _spec_variant
    from cute_attn.testing.reference import rope_reference
    from cute_attn.variants import RoPE, abi_args, components

    v_ = _spec_variant(p)
    val = dict(zip([a.name for a in abi_args(v_)], vargs))
    assert num_ctas > 0 and batch <= kv_indptr.numel() - 1
    # the packer checks no dtypes: the emulation does (a cache the kernel would misread)
    assert k.dtype == v.dtype == to_torch(p.get("kv_dtype", p["dtype"])), (k.dtype, p)
    assert k_out.dtype == v_out.dtype == to_torch(p["dtype"]), (k_out.dtype, p)
    ps = k.shape[1]
    for r in range(batch):
        a, b = int(kv_indptr[r]), int(kv_indptr[r + 1])
        if p["paged"]:
            pos = torch.arange(b - a)
            pages = page_indices[int(page_indptr[r]) + pos // ps].long()
            kk, vv = k[pages, pos % ps], v[pages, pos % ps]
            v_out[0, a:b] = vv
        else:
            kk = k[0, a:b]
            if "kv_dtype" in p:
                v_out[0, a:b] = v[0, a:b].to(v_out.dtype)
        kk = kk.float()
        for i, comp in enumerate(components(v_)):
            if isinstance(comp, RoPE):
                kk = rope_reference(
                    kk, torch.arange(b - a), float(val[f"v{i}_rope_scale"]), float(val[f"v{i}_rope_theta"])
                )
        k_out[0, a:b] = kk.to(k_out.dtype)


class _Emulated:
    """A kernel module stand-in: the real argument packer (ranks, static extents/strides,
    divisibility, alignment, variant arguments), then ``prefill`` (the attention emulation; the
    variant tests pass their own) or the merge emulation."""

    def __init__(self, family, params, calls, prefill=None):
        from cute_attn.families.base import get_family
        from cute_attn.runtime.loader import make_packer

        self.family, self.params, self.calls = family, params, calls
        self.pack = make_packer(get_family(family).abi(params))
        self.emulate = {
            "batch_prefill_sm90": prefill or _emulate_prefill,
            "batch_prefill_mma": prefill or _emulate_prefill,  # the same contract (kernels/prefill_mma.py)
            "merge_partials": _emulate_merge,
            "kv_pass": _emulate_kv_pass,
        }[family]

    def __call__(self, *args):
        args = [_plain(a) for a in args]
        self.pack(*args)
        self.calls.append((self.family, dict(self.params)))
        self.emulate(self.params, *args)


@pytest.fixture
def emu(monkeypatch):
    """Patch what needs a GPU; returns the list of emulated launches (family, spec params)."""
    import cute_attn.wrappers.prefill_base as P

    calls = []
    state = {"arch": "sm_90a", "capturing": False}
    monkeypatch.setattr(P, "arch_of_index", lambda i: state["arch"])
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 8)
    monkeypatch.setattr(P, "kernel", lambda family, arch, **params: _Emulated(family, params, calls))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return type("Emu", (), {"calls": calls, "state": state})()


def _cpu_ws(mb=64):
    return _fake_cuda(torch.empty(mb << 20, dtype=torch.uint8))


@pytest.mark.parametrize(
    "hq,hk,causal,soft_cap,window,layout",
    [
        (4, 4, False, None, -1, "NHD"),
        (8, 2, True, None, -1, "HND"),
        (8, 2, True, 30.0, 5, "NHD"),
        (4, 4, False, None, 40, "HND"),
        (8, 2, False, 20.0, -1, "NHD"),
        (4, 4, True, None, 0, "NHD"),
    ],
)
def test_cpu_ragged_wiring(emu, hq, hk, causal, soft_cap, window, layout):
    qo, kv = [1, 17, 130, 0, 64], [1, 40, 500, 9, 64]
    w = run_ragged(
        qo,
        kv,
        hq,
        hk,
        64,
        torch.bfloat16,
        causal=causal,
        soft_cap=soft_cap,
        window_left=window,
        layout=layout,
        device="cpu",
        workspace=_cpu_ws(),
        seed=1,
        tail=5,
    )[0]
    fam, params = emu.calls[0]
    assert fam == "batch_prefill_sm90"
    assert params == dict(
        dtype="bf16",
        head_dim=64,
        tile_q=w._tile,
        paged=False,
        causal=causal,
        soft_cap=soft_cap is not None,
        window=window >= 0,
    )
    assert w._tile in (64, 128)


@pytest.mark.parametrize(
    "page_size,layout,single_tensor",
    [(1, "NHD", False), (1, "HND", True), (16, "HND", False), (16, "NHD", True), (64, "NHD", False), (64, "HND", True)],
)
def test_cpu_paged_wiring(emu, page_size, layout, single_tensor):
    qo, kv = [1, 17, 130, 0, 3], [1, 40, 500, 9, 3]
    run_paged(
        qo,
        kv,
        page_size,
        8,
        2,
        64,
        torch.float16,
        causal=True,
        layout=layout,
        single_tensor=single_tensor,
        device="cpu",
        workspace=_cpu_ws(),
        seed=2,
    )
    assert emu.calls[0][1]["paged"] is True


@pytest.mark.parametrize("paged", [False, True])
def test_cpu_split_and_merge(emu, paged):
    """8 emulated SMs and one tile x 2 kv heads over long KV: the planner splits, the merge runs; fixed_split_size
    forces cuts; disable_split_kv forbids them."""
    for kw, split in (
        (dict(), True),
        (dict(fixed_split_size=64 if paged else 1024), True),
        (dict(disable_split_kv=True), False),
    ):
        emu.calls.clear()
        if paged:
            w = run_paged(
                [64], [3000], 16, 4, 2, 64, torch.bfloat16, causal=True, device="cpu", workspace=_cpu_ws(), seed=3, **kw
            )[0]
        else:
            w = run_ragged(
                [64], [3000], 4, 2, 64, torch.bfloat16, causal=True, device="cpu", workspace=_cpu_ws(), seed=3, **kw
            )[0]
        assert w._plan.has_split == split, kw
        assert [c[0] for c in emu.calls] == ["batch_prefill_sm90"] + (["merge_partials"] if split else [])
        if split:
            assert emu.calls[1][1] == dict(dtype="bf16", head_dim=64, tile_q=w._tile)
        if "fixed_split_size" in kw:
            assert w._tile == 128


def test_cpu_tile_choice(emu):
    w = run_ragged([1] * 6, [5] * 6, 8, 8, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
    assert w._tile == 64  # the planner's 16-row decode tile -> 64
    w = run_ragged([40, 50], [50, 50], 8, 8, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
    assert w._tile == 64
    w = run_ragged([40, 50], [50, 50], 16, 2, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
    assert w._tile == 128  # 8 heads per group: 45 tokens -> 360 packed rows


def test_kv_pass_pays_model():
    from cute_attn.families.backends import kv_pass_pays

    # queries per key x group decides: ~1800 for the gather alone, ~360 with a key transform
    assert kv_pass_pays([8192], [8192], 16, 16, 128, True, False)  # 8k causal, no GQA
    assert not kv_pass_pays([256], [8192], 32, 8, 128, False, False)  # 256-token chunk on 8k: 1024
    assert kv_pass_pays([256], [8192], 32, 8, 128, False, True)  # ... unless K is rotated too
    assert kv_pass_pays([512], [8192], 32, 8, 128, False, False)  # 2048
    assert not kv_pass_pays([1] * 64, [4096] * 64, 32, 8, 128, False, True)  # decode-like
    assert not kv_pass_pays([0, 0], [0, 0], 8, 8, 64, False, False)  # nothing to read
    # where the kernel reads the pages by TMA boxes, the pass pays only from ~4500
    assert not kv_pass_pays([1024], [8192], 32, 8, 128, False, False, page_boxes=True)  # 4096
    assert kv_pass_pays([2048], [8192], 32, 8, 128, False, False, page_boxes=True)  # 8192
    assert kv_pass_pays([2048], [8192], 32, 8, 128, False, True, page_boxes=True)  # RoPE: the gather's
    # a window bounds the keys per query
    assert not kv_pass_pays([8192], [8192], 16, 16, 128, True, False, window_left=511)
    # causal halves the pairs: the same lengths can stop paying
    assert kv_pass_pays([800], [800], 32, 8, 128, False, False) and not kv_pass_pays(
        [800], [800], 32, 8, 128, True, False
    )


def test_cpu_kv_pass_choice(emu):
    """Who gathers a paged cache: the KV pass when it pays and fits past the plan's sections
    (never in CUDA-graph mode), else the kernel; kv_pass=True / False force it."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    long_qo, long_kv = [400, 5], [400, 20]  # 8 query rows per key row x 381 queries per key
    w = run_paged(long_qo, long_kv, 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
    assert w._gathered is not None and [c[0] for c in emu.calls][:2] == ["kv_pass", "batch_prefill_sm90"]
    assert emu.calls[0][1] == dict(dtype="bf16", head_dim=64, paged=True) and not emu.calls[1][1]["paged"]
    off = w._gathered[0].data_ptr() - w._workspace.data_ptr()
    assert off >= w._planner.layout.total_bytes and off % 256 == 0
    # page 16 (TMA boxes: the pass pays from ~4500 query rows per key row) and short queries:
    # the kernel reads the cache itself
    for ps, qo, kv in ((16, long_qo, long_kv), (1, [3, 50], [40, 900])):
        emu.calls.clear()
        w = run_paged(qo, kv, ps, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
        assert w._gathered is None and [c[0] for c in emu.calls] == ["batch_prefill_sm90"]
    w = run_paged([800, 5], [800, 20], 16, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
    assert w._gathered is not None  # 8 x 780 query rows per key row: past the page-box threshold
    # forced either way
    emu.calls.clear()
    w = run_paged([3, 50], [40, 900], 16, 32, 4, 64, torch.float16, device="cpu", workspace=_cpu_ws(), kv_pass=True)[0]
    assert w._gathered is not None and emu.calls[0][0] == "kv_pass"
    w = run_paged(long_qo, long_kv, 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws(), kv_pass=False)[0]
    assert w._gathered is None
    # fixed_split_size (batch-invariant output): the model, which weighs the whole batch, is off
    w = run_paged(
        long_qo, long_kv, 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws(), fixed_split_size=1024
    )[0]
    assert w._gathered is None
    w = run_paged(
        long_qo,
        long_kv,
        1,
        32,
        4,
        64,
        torch.bfloat16,
        device="cpu",
        workspace=_cpu_ws(),
        fixed_split_size=1024,
        kv_pass=True,
    )[0]
    assert w._gathered is not None
    # a workspace with room for the plan but not for K / V: the kernel gathers; forced: an error
    gathered = 2 * sum(long_kv) * 4 * 64 * 2
    small = _fake_cuda(torch.empty(w._planner.layout.total_bytes + gathered // 2, dtype=torch.uint8))
    w = run_paged(long_qo, long_kv, 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=small)[0]
    assert w._gathered is None
    with pytest.raises(ValueError, match="kv_pass=True: float_workspace_buffer has"):
        run_paged(long_qo, long_kv, 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=small, kv_pass=True)
    # CUDA-graph mode: never by itself, an error when forced
    bufs = [_fake_cuda(torch.zeros(n, dtype=torch.int32)) for n in (3, 3, 500, 2)]
    wg = BatchPrefillWithPagedKVCacheWrapper(
        _cpu_ws(),
        use_cuda_graph=True,
        qo_indptr_buf=bufs[0],
        paged_kv_indptr_buf=bufs[1],
        paged_kv_indices_buf=bufs[2],
        paged_kv_last_page_len_buf=bufs[3],
    )
    args = (
        torch.tensor([0, 400, 405]),
        torch.tensor([0, 400, 420]),
        torch.arange(420, dtype=torch.int32),
        torch.tensor([1, 1]),
        32,
        4,
        64,
        1,
    )
    wg.plan(*args, q_data_type=torch.bfloat16)
    assert wg._gathered is None
    with pytest.raises(ValueError, match="kv_pass=True is not available with use_cuda_graph"):
        wg.plan(*args, q_data_type=torch.bfloat16, kv_pass=True)


def test_cpu_kv_pass_missing_kernels(emu, monkeypatch):
    """A cache without the KV pass's kernels: the model's choice falls back to the in-kernel
    gather; an explicit kv_pass=True fails with the loader's error."""
    import cute_attn.wrappers.prefill_base as P
    from cute_attn.runtime.loader import KernelNotAvailable

    load = P.kernel

    def no_pass(family, arch, **params):
        if family == "kv_pass":
            raise KernelNotAvailable("kv_pass is not in this cache")
        return load(family, arch, **params)

    monkeypatch.setattr(P, "kernel", no_pass)
    w = run_paged([400, 5], [400, 20], 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws())[0]
    assert w._gathered is None and w._spec_kw["paged"] and w._spec_kw.get("page_box") is None
    with pytest.raises(KernelNotAvailable):
        run_paged([400, 5], [400, 20], 1, 32, 4, 64, torch.bfloat16, device="cpu", workspace=_cpu_ws(), kv_pass=True)


def test_cpu_kv_pass_empty_requests(emu):
    """The gathered path with requests without queries / keys, and a batch without any key."""
    run_paged(
        [0, 5, 0, 300, 7],
        [10, 0, 0, 500, 7],
        1,
        8,
        8,
        64,
        torch.bfloat16,
        device="cpu",
        workspace=_cpu_ws(),
        kv_pass=True,
    )
    emu.calls.clear()
    run_paged([4, 9], [0, 0], 1, 8, 8, 64, torch.float16, device="cpu", workspace=_cpu_ws(), kv_pass=True)
    assert emu.calls == []  # o = 0, lse = -inf without a kernel


def test_cpu_cuda_graph_mode(emu):
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    hq, hk, d = 8, 2, 64
    qo_buf, kv_buf = _fake_cuda(torch.zeros(5, dtype=torch.int32)), _fake_cuda(torch.zeros(5, dtype=torch.int32))
    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(), use_cuda_graph=True, qo_indptr_buf=qo_buf, kv_indptr_buf=kv_buf)
    gen = _gen(4)
    q = torch.randn(600, hq, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(4000, hk, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(4000, hk, d, generator=gen).to(torch.bfloat16)
    views = None
    for qo, kv in (([300, 100, 200, 0], [300, 1000, 200, 0]), ([1, 1, 598], [1, 1, 3998]), ([50], [50])):
        qo_t, kv_t = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(kv), dtype=torch.int32)
        w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=torch.bfloat16)
        assert w._kv_indptr is kv_buf and torch.equal(qo_buf[: len(qo) + 1], qo_t)
        if views is None:
            views = {n: t.data_ptr() for n, t in w._views.items()}
        assert {n: t.data_ptr() for n, t in w._views.items()} == views  # fixed offsets
        emu.calls.clear()
        out = torch.full_like(q, float("nan"))
        lse = torch.full((600, hq), float("nan"))
        w.run(q, k, v, out=out, lse=lse)  # full-size q/k/v, as captured
        assert [c[0] for c in emu.calls] == ["batch_prefill_sm90", "merge_partials"]  # merge always
        n = int(qo_t[-1])
        ref_o, ref_lse = ragged_reference(q[:n], k, v, qo_t, kv_t, causal=True)
        check(out, lse, ref_o, ref_lse, torch.bfloat16, rows=n)
        assert w._tile == 128  # fixed by the first plan
    with pytest.raises(ValueError, match="query tokens"):
        w.plan(torch.tensor([0, 601]), torch.tensor([0, 601]), hq, hk, d, causal=True, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="changed"):
        w.plan(torch.tensor([0, 5]), torch.tensor([0, 5]), hq, hk, d, causal=False, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="capacity"):
        w.plan(torch.arange(6), torch.arange(6), hq, hk, d, causal=True, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_indptr_buf"):
        BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(), use_cuda_graph=True, qo_indptr_buf=qo_buf)


def test_cpu_validation_errors(emu):
    from cute_attn.prefill import (
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
        single_prefill_with_kv_cache,
    )

    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws())
    ind = torch.tensor([0, 8], dtype=torch.int32)
    plan = lambda **kw: w.plan(
        **dict(
            dict(
                qo_indptr=ind,
                kv_indptr=ind,
                num_qo_heads=8,
                num_kv_heads=2,  # noqa: E731
                head_dim_qk=128,
                q_data_type=torch.bfloat16,
            ),
            **kw,
        )
    )
    with pytest.raises(ValueError, match="head_dim 72"):
        plan(head_dim_qk=72)
    with pytest.raises(ValueError, match="head_dim_vo 64 is not supported"):
        plan(head_dim_vo=64)
    with pytest.raises(ValueError, match="head_dim_vo must be a positive int"):
        plan(head_dim_qk=192, head_dim_vo=128.0)
    # custom masks, pos_encoding_mode, sinks and variant=: tests/test_prefill_variants_gpu.py
    with pytest.raises(ValueError, match="custom_mask"):
        plan(custom_mask=torch.ones(63, dtype=torch.bool))
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        plan(pos_encoding_mode="ROPE")
    with pytest.raises(NotImplementedError, match="fp8 attention"):  # fp8 KV: tests/test_fp8_prefill.py
        plan(q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="o_data_type"):
        plan(o_data_type=torch.float32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        plan(q_data_type=torch.float32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        plan(kv_data_type=torch.float16)
    with pytest.raises(ValueError, match="multiple"):
        plan(num_qo_heads=6, num_kv_heads=4)
    # kv shorter than qo with causal: FlashInfer's bottom-right rule (fully masked rows 0 / -inf)
    plan(kv_indptr=torch.tensor([0, 7], dtype=torch.int32), causal=True)
    plan(kv_indptr=torch.tensor([0, 7], dtype=torch.int32), causal=False)
    with pytest.raises(ValueError, match="same length"):
        plan(kv_indptr=torch.tensor([0, 8, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="window_left"):
        plan(window_left=-2)
    with pytest.raises(ValueError, match="fixed_split_size"):
        plan(fixed_split_size=0)
    with pytest.raises(NotImplementedError, match="prefix_len_ptr"):
        plan(prefix_len_ptr=torch.zeros(1))
    with pytest.raises(ValueError, match="bytes"):
        BatchPrefillWithRaggedKVCacheWrapper(_fake_cuda(torch.empty(1 << 20, dtype=torch.uint8))).plan(
            torch.tensor([0, 1 << 19]), torch.tensor([0, 1 << 19]), 64, 8, 128, q_data_type=torch.bfloat16
        )
    emu.state["arch"] = "sm_100a"  # Blackwell: the portable kernel; the wgmma one does not exist there
    plan()
    assert w._state.family == "batch_prefill_mma"
    with pytest.raises(RuntimeError, match="prefill_sm90 for sm_100a"):
        plan(prefill_backend="prefill_sm90")
    with pytest.raises(NotImplementedError, match="fp8 KV cache"):
        plan(kv_data_type=torch.float8_e4m3fn)
    emu.state["arch"] = "sm_90a"
    with pytest.raises(RuntimeError, match="prefill_nothing"):
        plan(prefill_backend="prefill_nothing")
    emu.state["capturing"] = True
    with pytest.raises(RuntimeError, match="captured"):
        plan()
    emu.state["capturing"] = False

    with pytest.raises(RuntimeError, match="before plan"):
        BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws()).run(
            torch.zeros(8, 8, 128), torch.zeros(8, 2, 128), torch.zeros(8, 2, 128)
        )
    plan()
    bf = dict(dtype=torch.bfloat16)
    q, k = torch.zeros(8, 8, 128, **bf), torch.zeros(8, 2, 128, **bf)
    with pytest.raises(ValueError, match="q must be"):
        w.run(q.half(), k, k)
    with pytest.raises(ValueError, match="q must be"):
        w.run(q[:7], k, k)
    with pytest.raises(ValueError, match="k/v"):
        w.run(q, k[:7], k[:7])
    with pytest.raises(ValueError, match="k/v"):
        w.run(q, k.half(), k.half())
    with pytest.raises(ValueError, match="out must be"):
        w.run(q, k, k, out=q[:, :4])
    with pytest.raises(ValueError, match="lse must be"):
        w.run(q, k, k, lse=torch.zeros(8, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="positional"):
        w.run(q, k, k, torch.zeros(1))  # no variant: nothing takes extra arguments
    emu.state["capturing"] = True
    with pytest.raises(RuntimeError, match="use_cuda_graph"):
        w.run(q, k, k)
    emu.state["capturing"] = False
    w.run(q, k, k)

    with pytest.raises(ValueError, match="kv_layout"):
        BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(), kv_layout="NDH")
    with pytest.raises(ValueError, match="CUDA"):
        BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(NotImplementedError, match="jit_args"):
        BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(), jit_args=["x"])

    pw = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws())
    pages = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="last_page_len"):
        pw.plan(ind, pages, torch.tensor([5]), torch.tensor([17]), 8, 2, 128, 16)
    with pytest.raises(NotImplementedError, match="block_tables"):
        pw.plan(ind, pages, torch.tensor([5]), torch.tensor([8]), 8, 2, 128, 16, block_tables=torch.zeros(1, 1))
    pw.plan(ind, pages, torch.tensor([5]), torch.tensor([8]), 8, 2, 128, 16, q_data_type=torch.bfloat16)
    cache = torch.zeros(3, 2, 16, 2, 128, **bf)
    with pytest.raises(ValueError, match="page 5"):
        pw.run(q, cache)
    with pytest.raises(ValueError, match="page_size"):
        pw.run(q, torch.zeros(8, 2, 8, 2, 128, **bf))
    with pytest.raises(ValueError, match="window_left"):
        pw.run(q, torch.zeros(8, 2, 16, 2, 128, **bf), window_left=3)
    with pytest.raises(ValueError, match="sinks"):
        pw.run(q, torch.zeros(8, 2, 16, 2, 128, **bf), sinks=torch.zeros(4))
    pw.run(q, torch.zeros(8, 2, 16, 2, 128, **bf))
    with pytest.raises(ValueError, match="paged_kv_indices_buf"):
        BatchPrefillWithPagedKVCacheWrapper(
            _cpu_ws(),
            use_cuda_graph=True,
            qo_indptr_buf=_fake_cuda(torch.zeros(2, dtype=torch.int32)),
            paged_kv_indptr_buf=_fake_cuda(torch.zeros(2, dtype=torch.int32)),
        )

    with pytest.raises(ValueError, match="CUDA"):
        single_prefill_with_kv_cache(q, k, k)
