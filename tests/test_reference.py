"""Tests of the reference attention (cute_attn.testing.reference) on the CPU.

The reference is checked against torch SDPA and against direct formulas written here
independently (masks built element by element from FlashInfer's conventions).

Tolerances: fp64 vs fp64 comparisons use rtol=atol=1e-10; the default fp32 compute
path vs fp64 truth uses rtol=atol=2e-5. Paged vs ragged must be bitwise identical
(same core, same KV values).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn.testing import (
    LOG2E,
    merge_state_reference,
    merge_states_reference,
    paged_kv_to_ragged,
    paged_reference,
    ragged_reference,
    single_reference,
)

F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------- helpers


def gen():
    """A fresh random generator per test (seeded from torch's global RNG)."""
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    return g


def make_batch(g, qo_lens, kv_lens, hq, hk, d, dv=None, dtype=torch.float64):
    dv = d if dv is None else dv
    tq, tk = sum(qo_lens), sum(kv_lens)
    q = torch.randn(tq, hq, d, generator=g, dtype=dtype)
    k = torch.randn(tk, hk, d, generator=g, dtype=dtype)
    v = torch.randn(tk, hk, dv, generator=g, dtype=dtype)
    qo_indptr = torch.tensor([0] + list(_cumsum(qo_lens)), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + list(_cumsum(kv_lens)), dtype=torch.int32)
    return q, k, v, qo_indptr, kv_indptr


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def keep_mask(qo_len, kv_len, causal=False, window_left=-1, custom=None):
    """[qo_len, kv_len] bool, element by element from FlashInfer's definitions."""
    m = torch.ones(qo_len, kv_len, dtype=torch.bool)
    for i in range(qo_len):
        aligned = i + kv_len - qo_len  # bottom-right aligned query position
        for j in range(kv_len):
            ok = True
            if causal and j > aligned:
                ok = False
            if window_left >= 0 and j < aligned - window_left:
                ok = False
            if custom is not None and not bool(custom[i, j]):
                ok = False
            m[i, j] = ok
    return m


def sdpa_request(q, k, v, keep, scale):
    """SDPA on one request; q [L,H,D], k/v [S,Hk,D] (kv heads expanded), keep [L,S] or None."""
    group = q.shape[1] // k.shape[1]
    kx = k.repeat_interleave(group, dim=1)
    vx = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), kx.transpose(0, 1), vx.transpose(0, 1), attn_mask=keep, scale=scale
    )
    return o.transpose(0, 1)


def lse_request(q, k, keep, scale, cap=0.0):
    """Base-2 LSE from torch.logsumexp of the explicit logits; [L, H]."""
    group = q.shape[1] // k.shape[1]
    kx = k.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return (torch.logsumexp(s, dim=-1) * LOG2E).transpose(0, 1)


def check_batch_vs_sdpa(q, k, v, qo_indptr, kv_indptr, masks, out, lse, tol, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    for b in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        keep = masks[b] if masks is not None else None
        ref_o = sdpa_request(q[qs:qe], k[ks:ke], v[ks:ke], keep, scale)
        ref_l = lse_request(q[qs:qe], k[ks:ke], keep, scale)
        torch.testing.assert_close(out[qs:qe].double(), ref_o, **tol)
        torch.testing.assert_close(lse[qs:qe].double(), ref_l, **tol)


def flat_mask(masks):
    return torch.cat([m.reshape(-1) for m in masks])


# ------------------------------------------------------------------ vs SDPA


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_noncausal_vs_sdpa(hq, hk, dtype):
    g = gen()
    qo, kv = [1, 7, 33, 16], [5, 40, 33, 100]
    q, k, v, qi, ki = make_batch(g, qo, kv, hq, hk, 64)
    out, lse = ragged_reference(q, k, v, qi, ki, dtype=dtype)
    assert out.dtype == dtype and lse.dtype == dtype
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    check_batch_vs_sdpa(q, k, v, qi, ki, None, out, lse, F64 if dtype == torch.float64 else F32)


def test_causal_equal_lengths_vs_sdpa_is_causal():
    g = gen()
    lens = [1, 17, 64]
    q, k, v, qi, ki = make_batch(g, lens, lens, 4, 4, 32)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True, dtype=torch.float64)
    for b, n in enumerate(lens):
        s, e = int(qi[b]), int(qi[b + 1])
        ref = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e], ref, **F64)
        tri = torch.ones(n, n, dtype=torch.bool).tril()
        torch.testing.assert_close(lse[s:e], lse_request(q[s:e], k[s:e], tri, 1 / math.sqrt(32)), **F64)


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_causal_kv_longer_bottom_right(hq, hk):
    g = gen()
    qo, kv = [1, 5, 20, 8], [9, 37, 21, 8]
    q, k, v, qi, ki = make_batch(g, qo, kv, hq, hk, 64)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True, dtype=torch.float64)
    masks = [keep_mask(a, b, causal=True) for a, b in zip(qo, kv)]
    # sanity on the convention: the last query row sees every key
    assert all(m[-1].all() for m in masks)
    check_batch_vs_sdpa(q, k, v, qi, ki, masks, out, lse, F64)


def test_gqa_head_mapping():
    """qo head h reads kv head h // group: equal to MHA on explicitly expanded KV."""
    g = gen()
    q, k, v, qi, ki = make_batch(g, [3, 11], [13, 11], 8, 2, 32)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True, dtype=torch.float64)
    out2, lse2 = ragged_reference(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), qi, ki, causal=True, dtype=torch.float64
    )
    torch.testing.assert_close(out, out2, **F64)
    torch.testing.assert_close(lse, lse2, **F64)
    # a wrong mapping (h % num_kv_heads) would differ
    out3, _ = ragged_reference(q, k.repeat(1, 4, 1), v.repeat(1, 4, 1), qi, ki, causal=True, dtype=torch.float64)
    assert not torch.allclose(out, out3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_left", [0, 1, 7, 100])
def test_sliding_window(causal, window_left):
    g = gen()
    qo, kv = [1, 12, 30], [40, 12, 45]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 2, 32)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=causal, window_left=window_left, dtype=torch.float64)
    masks = [keep_mask(a, b, causal=causal, window_left=window_left) for a, b in zip(qo, kv)]
    if causal:  # at most w+1 keys per row
        assert all(int(m.sum(1).max()) <= window_left + 1 for m in masks)
    check_batch_vs_sdpa(q, k, v, qi, ki, masks, out, lse, F64)


@pytest.mark.parametrize("causal", [False, True])
def test_custom_mask(causal):
    g = gen()
    qo, kv = [4, 9, 1], [4, 25, 30]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 4, 32)
    customs = []
    for a, b in zip(qo, kv):
        c = torch.rand(a, b, generator=g) < 0.5
        for i in range(a):
            c[i, i + b - a] = True  # every row keeps its (bottom-right) diagonal key
        customs.append(c)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=causal, custom_mask=flat_mask(customs), dtype=torch.float64)
    masks = [keep_mask(a, b, causal=causal, custom=c) for a, b, c in zip(qo, kv, customs)]
    for m in masks:
        assert m.any(1).all()
    check_batch_vs_sdpa(q, k, v, qi, ki, masks, out, lse, F64)


def test_sm_scale_and_dv():
    g = gen()
    qo, kv = [3, 10], [20, 10]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 2, 32, dv=48)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True, sm_scale=0.3, dtype=torch.float64)
    assert out.shape == (13, 4, 48)
    masks = [keep_mask(a, b, causal=True) for a, b in zip(qo, kv)]
    check_batch_vs_sdpa(q, k, v, qi, ki, masks, out, lse, F64, scale=0.3)


def test_soft_cap_direct_formula():
    g = gen()
    qo, kv = [5, 16], [30, 16]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 2, 64)
    q = q * 4  # large logits so the cap matters
    cap, scale = 5.0, 0.2
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True, logits_soft_cap=cap, sm_scale=scale, dtype=torch.float64)
    out_nocap, _ = ragged_reference(q, k, v, qi, ki, causal=True, sm_scale=scale, dtype=torch.float64)
    assert not torch.allclose(out, out_nocap)
    for b in range(2):
        qs, qe, ks, ke = int(qi[b]), int(qi[b + 1]), int(ki[b]), int(ki[b + 1])
        keep = keep_mask(qe - qs, ke - ks, causal=True)
        kx = k[ks:ke].repeat_interleave(2, dim=1)
        vx = v[ks:ke].repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], kx)
        s = cap * torch.tanh(s * scale / cap)  # FlashInfer: cap * tanh(q.k * sm_scale / cap)
        s = s.masked_fill(~keep, -math.inf)
        p = torch.softmax(s, dim=-1)
        ref = torch.einsum("hqk,khd->qhd", p, vx)
        torch.testing.assert_close(out[qs:qe], ref, **F64)
        torch.testing.assert_close(lse[qs:qe], lse_request(q[qs:qe], k[ks:ke], keep, scale, cap), **F64)
    # the capped logits never exceed cap: lse2 <= log2(kv_len) + cap*log2(e)
    assert (lse <= math.log2(30) + cap * LOG2E + 1e-9).all()


# ------------------------------------------------------------- empty rows


def _assert_empty(out, lse, rows):
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    assert torch.isneginf(lse[rows]).all()


def test_empty_rows_no_nan():
    g = gen()
    # req0: kv_len 0; req1: causal with qo_len > kv_len (first 4 rows see nothing);
    # req2: custom mask hides row 0 and 2 entirely; req3: qo_len 0
    qo, kv = [3, 7, 4, 0], [0, 3, 6, 5]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 2, 32)
    customs = [
        torch.zeros(3, 0, dtype=torch.bool),
        torch.ones(7, 3, dtype=torch.bool),
        torch.ones(4, 6, dtype=torch.bool),
        torch.zeros(0, 5, dtype=torch.bool),
    ]
    customs[2][0] = False
    customs[2][2] = False
    for dtype in (torch.float32, torch.float64):
        out, lse = ragged_reference(q, k, v, qi, ki, causal=True, custom_mask=flat_mask(customs), dtype=dtype)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        _assert_empty(out, lse, slice(0, 3))  # kv_len 0
        _assert_empty(out, lse, slice(3, 7))  # causal, rows 0..3 of req1
        _assert_empty(out, lse, [10, 12])  # custom mask rows
        masks = [None, keep_mask(7, 3, causal=True), keep_mask(4, 6, causal=True, custom=customs[2])]
        tol = F64 if dtype == torch.float64 else F32
        for b, rows in [(1, range(7, 10)), (2, [11, 13])]:
            ks, ke = int(ki[b]), int(ki[b + 1])
            local = [r - int(qi[b]) for r in rows]
            keep = masks[b][local]
            ref_o = sdpa_request(q[list(rows)], k[ks:ke], v[ks:ke], keep, 1 / math.sqrt(32))
            ref_l = lse_request(q[list(rows)], k[ks:ke], keep, 1 / math.sqrt(32))
            torch.testing.assert_close(out[list(rows)].double(), ref_o, **tol)
            torch.testing.assert_close(lse[list(rows)].double(), ref_l, **tol)


def test_window_hides_everything():
    """causal + window with qo_len > kv_len: early rows see nothing, later rows see <= w+1 keys."""
    g = gen()
    q, k, v, qi, ki = make_batch(g, [10], [4], 2, 2, 16)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True, window_left=1, dtype=torch.float64)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _assert_empty(out, lse, slice(0, 6))
    keep = keep_mask(10, 4, causal=True, window_left=1)
    assert keep[6:].sum(1).tolist() == [1, 2, 2, 2]
    torch.testing.assert_close(out[6:], sdpa_request(q[6:], k, v, keep[6:], 0.25), **F64)
    torch.testing.assert_close(lse[6:], lse_request(q[6:], k, keep[6:], 0.25), **F64)


def test_padding_rows_not_in_qo_indptr():
    g = gen()
    q, k, v, _, _ = make_batch(g, [8], [5], 2, 1, 16)
    out, lse = ragged_reference(q, k, v, torch.tensor([0, 5]), torch.tensor([0, 5]), dtype=torch.float64)
    _assert_empty(out, lse, slice(5, 8))
    torch.testing.assert_close(out[:5], sdpa_request(q[:5], k, v, None, 0.25), **F64)


# --------------------------------------------------------- paged vs ragged


def make_paged(g, k, v, kv_lens, page_size, layout, single_tensor, extra_pages=3):
    """Scatter ragged K/V into a shuffled paged cache with unused (garbage) pages."""
    hk, d = k.shape[1], k.shape[2]
    n_pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(total, generator=g)
    kc = torch.randn(total, page_size, hk, d, generator=g, dtype=k.dtype) * 100  # garbage
    vc = torch.randn(total, page_size, hk, v.shape[2], generator=g, dtype=v.dtype) * 100
    indices, indptr, last = [], [0], []
    p, t = 0, 0
    for n, np_ in zip(kv_lens, n_pages):
        for i in range(np_):
            pid = int(perm[p])
            p += 1
            indices.append(pid)
            cnt = min(page_size, n - i * page_size)
            kc[pid, :cnt] = k[t + i * page_size : t + i * page_size + cnt]
            vc[pid, :cnt] = v[t + i * page_size : t + i * page_size + cnt]
        t += n
        indptr.append(len(indices))
        last.append(n - (np_ - 1) * page_size if np_ else 0)
    if layout == "HND":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    cache = torch.stack([kc, vc], dim=1) if single_tensor else (kc, vc)
    return (
        cache,
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(indices, dtype=torch.int32),
        torch.tensor(last, dtype=torch.int32),
    )


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single_tensor", [False, True])
def test_paged_matches_ragged(page_size, layout, single_tensor):
    g = gen()
    qo, kv = [3, 1, 16, 2, 5], [35, 0, 16, 48, 1]  # kv 0, page multiples, partial pages
    q, k, v, qi, ki = make_batch(g, qo, kv, 8, 2, 32)
    cache, pi, pidx, last = make_paged(g, k, v, kv, page_size, layout, single_tensor)

    kr, vr, kti = paged_kv_to_ragged(cache, pi, pidx, last, kv_layout=layout)
    assert torch.equal(kr, k) and torch.equal(vr, v)
    assert kti.tolist() == ki.tolist()

    for kw in (dict(causal=True), dict(causal=False, window_left=5, logits_soft_cap=3.0)):
        ref = ragged_reference(q, k, v, qi, ki, dtype=torch.float64, **kw)
        got = paged_reference(q, cache, qi, pi, pidx, last, kv_layout=layout, dtype=torch.float64, **kw)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

    # decode: qo_indptr=None -> one row per request
    qd = q[: len(kv)]
    ref = ragged_reference(qd, k, v, torch.arange(len(kv) + 1), ki)
    got = paged_reference(qd, cache, None, pi, pidx, last, kv_layout=layout)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    _assert_empty(got[0], got[1], [1])


def test_paged_custom_mask_uses_token_lengths():
    g = gen()
    qo, kv = [4, 2], [10, 7]
    q, k, v, qi, ki = make_batch(g, qo, kv, 2, 2, 16)
    cache, pi, pidx, last = make_paged(g, k, v, kv, 4, "NHD", False)
    cm = flat_mask([torch.rand(a, b, generator=g) < 0.6 for a, b in zip(qo, kv)])
    ref = ragged_reference(q, k, v, qi, ki, custom_mask=cm)
    got = paged_reference(q, cache, qi, pi, pidx, last, custom_mask=cm)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_paged_validation():
    g = gen()
    q, k, v, qi, ki = make_batch(g, [2], [5], 2, 2, 16)
    cache, pi, pidx, last = make_paged(g, k, v, [5], 4, "NHD", False)
    with pytest.raises(ValueError, match="kv_last_page_len"):
        paged_kv_to_ragged(cache, pi, pidx, torch.tensor([5]))
    with pytest.raises(ValueError, match="kv_last_page_len"):
        paged_kv_to_ragged(cache, pi, pidx, torch.tensor([0]))
    with pytest.raises(ValueError, match="out of range"):
        paged_kv_to_ragged(cache, pi, torch.tensor([0, 99]), last)
    with pytest.raises(ValueError, match="kv_layout"):
        paged_kv_to_ragged(cache, pi, pidx, last, kv_layout="NDH")
    with pytest.raises(ValueError):
        paged_kv_to_ragged(torch.stack(cache, 1)[:, :1], pi, pidx, last)


# ------------------------------------------------------------ misc / API


def test_single_reference():
    g = gen()
    q, k, v, qi, ki = make_batch(g, [6], [11], 4, 2, 32)
    cm = torch.rand(6, 11, generator=g) < 0.7
    ref = ragged_reference(q, k, v, qi, ki, causal=True, custom_mask=cm.reshape(-1), dtype=torch.float64)
    got = single_reference(q, k, v, causal=True, custom_mask=cm, dtype=torch.float64)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    got = single_reference(
        q,
        k.transpose(0, 1).contiguous(),
        v.transpose(0, 1).contiguous(),
        kv_layout="HND",
        causal=True,
        custom_mask=cm,
        dtype=torch.float64,
    )
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    # decode: q [H, D] -> out [H, D], lse [H]; equals the last row of a causal prefill
    o, l = single_reference(q[-1], k, v, dtype=torch.float64)
    assert o.shape == (4, 32) and l.shape == (4,)
    ref = ragged_reference(q, k, v, qi, ki, causal=True, dtype=torch.float64)
    torch.testing.assert_close(o, ref[0][-1], **F64)
    torch.testing.assert_close(l, ref[1][-1], **F64)


def test_dtypes_and_devices():
    g = gen()
    q, k, v, qi, ki = make_batch(g, [5], [9], 4, 2, 32, dtype=torch.bfloat16)
    out, lse = ragged_reference(q, k, v, qi, ki, causal=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and out.device == q.device
    out64, lse64 = ragged_reference(q, k, v, qi, ki, causal=True, dtype=torch.float64)
    assert out64.dtype == torch.float64
    # bf16 inputs are upcast exactly; fp32 vs fp64 compute agree to fp32 accuracy
    torch.testing.assert_close(out.double(), out64, **F32)
    torch.testing.assert_close(lse.double(), lse64, **F32)
    with pytest.raises(ValueError, match="dtype"):
        ragged_reference(q, k, v, qi, ki, dtype=torch.float16)


def test_chunking_equivalent():
    g = gen()
    qo, kv = [70, 3], [90, 200]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 2, 32)
    for kw in (dict(causal=True), dict(causal=False, window_left=10)):
        ref = ragged_reference(q, k, v, qi, ki, dtype=torch.float64, **kw)
        got = ragged_reference(q, k, v, qi, ki, dtype=torch.float64, max_chunk_elems=1000, **kw)
        torch.testing.assert_close(got[0], ref[0], **F64)
        torch.testing.assert_close(got[1], ref[1], **F64)


def test_fp32_matmul_precision_restored():
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        g = gen()
        q, k, v, qi, ki = make_batch(g, [3], [4], 2, 2, 16, dtype=torch.float32)
        ragged_reference(q, k, v, qi, ki)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(prev)


def test_validation():
    g = gen()
    q, k, v, qi, ki = make_batch(g, [3, 4], [5, 6], 6, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        ragged_reference(q, k, v, qi, ki)
    q, k, v, qi, ki = make_batch(g, [3, 4], [5, 6], 4, 2, 16)
    with pytest.raises(ValueError, match="custom_mask"):
        ragged_reference(q, k, v, qi, ki, custom_mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-decreasing"):
        ragged_reference(q, k, v, torch.tensor([0, 4, 3]), ki)
    with pytest.raises(ValueError, match="exceeds"):
        ragged_reference(q, k, v, qi, torch.tensor([0, 5, 12]))
    with pytest.raises(ValueError, match="batch"):
        ragged_reference(q, k, v, qi, torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="head_dim"):
        ragged_reference(q, k[..., :8], v, qi, ki)


# -------------------------------------------------- property test vs naive


def naive_row(q_row, k, v, keep_row, scale, cap):
    """Attention of one query row for one head in plain Python floats (fp64)."""
    logits = []
    for j in range(k.shape[0]):
        if not keep_row[j]:
            continue
        s = float(q_row @ k[j]) * scale
        if cap > 0:
            s = cap * math.tanh(s / cap)
        logits.append((s, j))
    if not logits:
        return torch.zeros(v.shape[1], dtype=torch.float64), -math.inf
    m = max(s for s, _ in logits)
    ws = [(math.exp(s - m), j) for s, j in logits]
    tot = sum(w for w, _ in ws)
    o = sum(w * v[j] for w, j in ws) / tot
    return o, (m + math.log(tot)) / math.log(2)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 3]),
    causal=st.booleans(),
    window_left=st.integers(-1, 4),
    cap=st.sampled_from([0.0, 2.0]),
    use_mask=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_vs_naive(lens, group, causal, window_left, cap, use_mask, seed):
    g = torch.Generator().manual_seed(seed)
    qo = [a for a, _ in lens]
    kv = [b for _, b in lens]
    hk = 2
    q, k, v, qi, ki = make_batch(g, qo, kv, hk * group, hk, 8)
    customs = [torch.rand(a, b, generator=g) < 0.7 for a, b in lens] if use_mask else None
    out, lse = ragged_reference(
        q,
        k,
        v,
        qi,
        ki,
        causal=causal,
        window_left=window_left,
        logits_soft_cap=cap,
        custom_mask=flat_mask(customs) if use_mask else None,
        dtype=torch.float64,
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    scale = 1 / math.sqrt(8)
    for b, (a, n) in enumerate(lens):
        keep = keep_mask(a, n, causal, window_left, customs[b] if use_mask else None)
        for i in range(a):
            r = int(qi[b]) + i
            for h in range(hk * group):
                kb = k[int(ki[b]) : int(ki[b + 1]), h // group]
                vb = v[int(ki[b]) : int(ki[b + 1]), h // group]
                o, l = naive_row(q[r, h], kb, vb, keep[i], scale, cap)
                torch.testing.assert_close(out[r, h], o, **F64)
                if l == -math.inf:
                    assert lse[r, h] == -math.inf
                else:
                    assert abs(float(lse[r, h]) - l) < 1e-10


# ------------------------------------------------------------------ merge


def test_merge_two_disjoint_key_sets():
    """Attention over A ∪ B equals ⊕ of the states over A and over B (random split, causal)."""
    g = gen()
    qo, kv = [6, 1, 9], [20, 13, 9]
    q, k, v, qi, ki = make_batch(g, qo, kv, 4, 2, 32)
    split = [torch.rand(a, b, generator=g) < 0.3 for a, b in zip(qo, kv)]
    a_mask = flat_mask(split)
    full = ragged_reference(q, k, v, qi, ki, causal=True, dtype=torch.float64)
    sa = ragged_reference(q, k, v, qi, ki, causal=True, custom_mask=a_mask, dtype=torch.float64)
    sb = ragged_reference(q, k, v, qi, ki, causal=True, custom_mask=~a_mask, dtype=torch.float64)
    assert torch.isneginf(sa[1]).any() or torch.isneginf(sb[1]).any()  # some rows are empty on one side
    v_m, s_m = merge_state_reference(sa[0], sa[1], sb[0], sb[1])
    assert v_m.dtype == torch.float64 and s_m.dtype == torch.float64
    torch.testing.assert_close(v_m, full[0], **F64)
    torch.testing.assert_close(s_m, full[1], **F64)
    # commutative
    v_m2, s_m2 = merge_state_reference(sb[0], sb[1], sa[0], sa[1])
    torch.testing.assert_close(v_m2, v_m, **F64)
    torch.testing.assert_close(s_m2, s_m, **F64)


def test_merge_states_kv_chunks():
    """Split-KV: states of n contiguous KV chunks merged with merge_states equal the full attention."""
    g = gen()
    q, k, v, qi, ki = make_batch(g, [5], [50], 8, 2, 32)
    full = ragged_reference(q, k, v, qi, ki, dtype=torch.float64)
    bounds = [0, 7, 8, 30, 30, 50]  # includes an empty chunk
    vs, ss = [], []
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, l = ragged_reference(q, k[s:e], v[s:e], qi, torch.tensor([0, e - s]), dtype=torch.float64)
        vs.append(o)
        ss.append(l)
    v_m, s_m = merge_states_reference(torch.stack(vs, 1), torch.stack(ss, 1))
    torch.testing.assert_close(v_m, full[0], **F64)
    torch.testing.assert_close(s_m, full[1], **F64)
    # associative: a left fold of pairwise merges gives the same
    v_f, s_f = vs[0], ss[0]
    for o, l in zip(vs[1:], ss[1:]):
        v_f, s_f = merge_state_reference(v_f, s_f, o, l)
    torch.testing.assert_close(v_f, full[0], **F64)
    torch.testing.assert_close(s_f, full[1], **F64)


def test_merge_inf_handling():
    g = gen()
    seq, h, d = 4, 3, 8
    v_a = torch.randn(seq, h, d, generator=g, dtype=torch.float64)
    v_b = torch.randn(seq, h, d, generator=g, dtype=torch.float64)
    s_a = torch.randn(seq, h, generator=g, dtype=torch.float64) * 5
    s_b = torch.randn(seq, h, generator=g, dtype=torch.float64) * 5
    ninf = -math.inf
    # row 0: both -inf (with NaN garbage in v); row 1: only a is -inf; row 2: only b; row 3: finite
    s_a[0], s_b[0] = ninf, ninf
    v_a[0] = float("nan")
    s_a[1] = ninf
    v_a[1] = float("nan")
    s_b[2] = ninf
    v_m, s_m = merge_state_reference(v_a, s_a, v_b, s_b)
    assert not torch.isnan(v_m).any() and not torch.isnan(s_m).any()
    assert torch.equal(v_m[0], torch.zeros(h, d, dtype=torch.float64)) and torch.isneginf(s_m[0]).all()
    torch.testing.assert_close(v_m[1], v_b[1], **F64)
    torch.testing.assert_close(s_m[1], s_b[1], **F64)
    torch.testing.assert_close(v_m[2], v_a[2], **F64)
    torch.testing.assert_close(s_m[2], s_a[2], **F64)
    # finite row: direct base-2 formula
    wa, wb = torch.exp2(s_a[3]), torch.exp2(s_b[3])
    torch.testing.assert_close(s_m[3], torch.log2(wa + wb), **F64)
    torch.testing.assert_close(v_m[3], (wa[:, None] * v_a[3] + wb[:, None] * v_b[3]) / (wa + wb)[:, None], **F64)
    # large LSEs must not overflow
    v_m, s_m = merge_state_reference(v_a[3:], s_a[3:] + 5000, v_b[3:], s_b[3:] + 5000)
    assert torch.isfinite(v_m).all() and torch.isfinite(s_m).all()
    # n-way: all -inf, and zero states
    v_n, s_n = merge_states_reference(
        torch.randn(2, 3, h, d, dtype=torch.float64), torch.full((2, 3, h), ninf, dtype=torch.float64)
    )
    assert torch.equal(v_n, torch.zeros_like(v_n)) and torch.isneginf(s_n).all()
    v_n, s_n = merge_states_reference(torch.empty(2, 0, h, d), torch.empty(2, 0, h))
    assert v_n.shape == (2, h, d) and torch.isneginf(s_n).all()
    # low-precision inputs are upcast to fp64
    v_lp, s_lp = merge_state_reference(v_a[3:].half(), s_a[3:].float(), v_b[3:].half(), s_b[3:].float())
    assert v_lp.dtype == torch.float64


# -------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    g = gen()
    qo, kv = [3, 1, 16], [35, 0, 40]
    q, k, v, qi, ki = make_batch(g, qo, kv, 8, 2, 64, dtype=torch.float32)
    cache, pi, pidx, last = make_paged(g, k, v, kv, 16, "HND", True)
    dev = torch.device("cuda")
    kw = dict(causal=True, window_left=20, logits_soft_cap=4.0)
    for dtype, tol in ((torch.float32, F32), (torch.float64, F64)):
        ref = paged_reference(q, cache, qi, pi, pidx, last, kv_layout="HND", dtype=dtype, **kw)
        got = paged_reference(
            q.to(dev),
            cache.to(dev),
            qi.to(dev),
            pi.to(dev),
            pidx.to(dev),
            last.to(dev),
            kv_layout="HND",
            dtype=dtype,
            **kw,
        )
        assert got[0].device.type == "cuda" and got[0].dtype == dtype
        torch.testing.assert_close(got[0].cpu(), ref[0], **tol)
        torch.testing.assert_close(got[1].cpu(), ref[1], **tol)
    # merge on the device
    v_m, s_m = merge_state_reference(got[0], got[1], got[0], got[1])
    assert v_m.device.type == "cuda"
    torch.testing.assert_close(s_m.cpu(), ref[1] + 1.0, **F64)


def test_variant_reference_rope_round_to_rounds_the_rotated_operands():
    """``rope_round_to``: q/k rotated in fp32 at their positions (query i at kv_len - qo_len + i),
    rounded to the dtype, then plain fp32 attention; without it the rotation is not rounded."""
    from cute_attn.testing.reference import rope_reference, variant_reference

    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 32, generator=g).to(torch.bfloat16)
    k = torch.randn(9, 2, 32, generator=g).to(torch.bfloat16)
    v = torch.randn(9, 2, 32, generator=g).to(torch.bfloat16)
    qo, kv = torch.tensor([0, 5]), torch.tensor([0, 9])
    qr = rope_reference(q, torch.arange(4, 9), 1.0, 1e4).to(torch.bfloat16)
    kr = rope_reference(k, torch.arange(9), 1.0, 1e4).to(torch.bfloat16)
    want_o, want_lse = variant_reference(qr, kr, v, qo, kv, causal=True)
    got_o, got_lse = variant_reference(q, k, v, qo, kv, causal=True, rope=(1.0, 1e4), rope_round_to=torch.bfloat16)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-6)
    raw_o, _ = variant_reference(q, k, v, qo, kv, causal=True, rope=(1.0, 1e4))
    assert not torch.equal(raw_o, got_o)  # the rounding is really applied
