"""GPU tests of the MLA wrapper and kernel (issue 25) against the fp32 reference of the absorbed
form (``cute_attn.testing.mla_reference``): batch sizes, kv lengths 0 / 1 / odd / long, page
sizes 1 / 16 / 64, 16-128 heads, 1 / 2 / 4 tokens per request and chunked prefill, causal,
split-KV, SGLang's strided views, CUDA-graph replay across re-plans, bitwise determinism and
page ids the host cannot check; an fp8 (e4m3 / e5m2) latent cache over the same grids.
Outputs are pre-filled with NaN and every cache slot no request owns holds NaN, so an
unwritten row or a stray read shows.

Needs the ``mla`` preset's modules in the cache (``python -m cute_attn compile --preset mla
--arch sm_90a``)."""

import math
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_helpers import CKV, KPE, check, gen, make_batch, reference  # noqa: E402

from cute_attn.mla import BatchMLAPagedAttentionWrapper  # noqa: E402

pytestmark = pytest.mark.gpu
BF16, F16 = torch.bfloat16, torch.float16
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SM = 1.0 / math.sqrt(128 + 64)
DEV = "cuda"


def _ws(mb=256):
    return torch.empty(mb << 20, dtype=torch.uint8, device=DEV)


def device_batch(qo_lens, kv_lens, heads, page_size, dtype=BF16, *, packed=False, seed=None, scale=1.0, device=DEV,
                 kv_dtype=None):  # fmt: skip
    """``make_batch`` with q and the caches on ``device`` (index arrays on the host).  The
    576-wide buffers move whole and are sliced there: a per-tensor ``.to(device)`` of a strided
    view returns a contiguous copy, so SGLang's views would never reach the kernel."""
    return make_batch(qo_lens, kv_lens, heads, page_size, dtype, gen(seed), device, packed=packed, scale=scale,
                      kv_dtype=kv_dtype)  # fmt: skip


def run_case(qo_lens, kv_lens, heads, page_size, causal, dtype=BF16, *, packed=False, seed=None, sm_scale=SM,
             scale=1.0, w=None, kv_dtype=None):  # fmt: skip
    b = device_batch(qo_lens, kv_lens, heads, page_size, dtype, packed=packed, seed=seed, scale=scale,
                     kv_dtype=kv_dtype)  # fmt: skip
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w = w or BatchMLAPagedAttentionWrapper(_ws())
    w.plan(qo, kvp, idx, kvl, heads, CKV, KPE, page_size, causal, sm_scale, dtype, kv_dtype or dtype)
    out = torch.full((qn.shape[0], heads, CKV), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((qn.shape[0], heads), float("nan"), dtype=torch.float32, device=DEV)
    w.run(qn, qp, ckv, kpe, out=out, lse=lse, return_lse=True)
    return w, b, out, lse


def _lens(n, rng, lo=0, hi=2000):
    special = [0, 1, 31, 33, 257]
    return [special[i] if i < len(special) else rng.randint(lo, hi) for i in range(n)]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_len,causal", [(1, False), (2, True), (4, True), (4, False)])
def test_mla_matrix(dtype, heads, page_size, q_len, causal):
    rng = random.Random()
    kv = _lens(7, rng)
    w, b, out, lse = run_case([q_len] * len(kv), kv, heads, page_size, causal, dtype)
    check(out, lse, *reference(b, SM, causal), dtype)


@pytest.mark.parametrize("batch", [1, 3, 64, 128])
def test_mla_batch_sizes(batch):
    rng = random.Random()
    kv = [rng.randint(1, 4096) for _ in range(batch)]
    w, b, out, lse = run_case([1] * batch, kv, 16, 64, False)
    check(out, lse, *reference(b, SM, False), BF16)


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_long_split_kv(heads):
    """Few long requests: the planner splits them over the CTAs and the merge folds the partials."""
    w, b, out, lse = run_case([1, 2], [32768, 9001], heads, 64, True)
    assert w._plan.has_split
    check(out, lse, *reference(b, SM, True), BF16)


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_chunked_prefill(heads):
    """Long query chunks (many 32-row tiles per request), causal over a cached prefix."""
    w, b, out, lse = run_case([100, 37, 1], [300, 37, 5000], heads, 16, True)
    check(out, lse, *reference(b, SM, True), BF16)


def test_mla_causal_more_queries_than_keys():
    w, b, out, lse = run_case([4, 3], [2, 1], 16, 1, True)
    ref_o, ref_lse = reference(b, SM, True)
    assert (~torch.isfinite(ref_lse)).any()
    check(out, lse, ref_o, ref_lse, BF16)


def test_mla_sharp_softmax():
    """Large logits (queries x 8): the online softmax's rescaling is exercised."""
    w, b, out, lse = run_case([1, 2, 4], [3000, 700, 64], 32, 16, True, scale=8.0)
    check(out, lse, *reference(b, SM, True), BF16)


@pytest.mark.parametrize("page_size,heads", [(1, 16), (16, 16), (64, 16), (1, 128), (64, 128)])
def test_mla_sglang_views(page_size, heads):
    """q and the caches as views of 576-wide buffers (SGLang: q[..., :512], k_buffer[..., :512])."""
    w, b, out, lse = run_case([1] * 9 + [2], _lens(10, random.Random()), heads, page_size, True, packed=True)
    assert all(t.stride(-2) == CKV + KPE for t in b[:4])
    assert b[1].data_ptr() == b[0].data_ptr() + 2 * CKV and b[3].data_ptr() == b[2].data_ptr() + 2 * CKV
    check(out, lse, *reference(b, SM, True), BF16)
    out2 = w.run(query=torch.as_strided(b[0], (b[0].shape[0], heads, CKV + KPE), b[0].stride()), kv_cache=(b[2], b[3]))
    assert torch.equal(out2, out)


def test_mla_deterministic():
    kv = [20000, 17, 4000, 800, 1]
    w, b, out, lse = run_case([1, 2, 1, 4, 1], kv, 64, 16, True)
    for _ in range(3):
        out2, lse2 = w.run(*b[:4], return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_mla_lse_base_e():
    w, b, out, lse = run_case([1, 1], [100, 2000], 16, 16, False)
    _, lse_e = w.run(*b[:4], return_lse=True, return_lse_base_on_e=True)
    assert torch.allclose(lse_e, lse * math.log(2.0))


@pytest.mark.parametrize("heads", [16, 128])  # 128: Hopper's wgmma kernel (64-row items)
@pytest.mark.parametrize("q_len", [1, 2])
def test_mla_cuda_graph_replay_with_new_plans(q_len, heads):
    """Capture once, re-plan with other lengths (and fewer requests), replay: each replay gives
    the new plan's result, twice in a row the same bits."""
    _graph_replay_case(q_len, heads, None)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 2)])  # 128 x 2: tile 32 on every arch (no wgmma fp8)
def test_mla_fp8_cuda_graph_replay_with_new_plans(q_len, heads, kv_dtype):
    _graph_replay_case(q_len, heads, kv_dtype)


def _graph_replay_case(q_len, heads, kv_dtype):
    ps, max_b, max_pages = 16, 8, 8192
    kv_dt = kv_dtype or BF16
    g = gen()
    bufs = dict(
        qo_indptr=torch.zeros(max_b + 1, dtype=torch.int32, device=DEV),
        kv_indptr=torch.zeros(max_b + 1, dtype=torch.int32, device=DEV),
        kv_indices=torch.zeros(max_pages, dtype=torch.int32, device=DEV),
        kv_len_arr=torch.zeros(max_b, dtype=torch.int32, device=DEV),
    )
    w = BatchMLAPagedAttentionWrapper(_ws(), use_cuda_graph=True, **bufs)
    tokens = max_b * q_len
    qn = torch.randn(tokens, heads, CKV, generator=g).to(BF16).to(DEV)
    qp = torch.randn(tokens, heads, KPE, generator=g).to(BF16).to(DEV)
    ckv = torch.randn(max_pages, ps, CKV, generator=g).to(BF16).to(DEV).to(kv_dt)
    kpe = torch.randn(max_pages, ps, KPE, generator=g).to(BF16).to(DEV).to(kv_dt)
    out = torch.empty(tokens, heads, CKV, dtype=BF16, device=DEV)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=DEV)

    def plan(kv_lens):
        n = len(kv_lens)
        pages = [(k + ps - 1) // ps for k in kv_lens]
        kvp = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32)
        idx = torch.randperm(max_pages, generator=g)[: int(kvp[-1])].to(torch.int32)
        qo = torch.arange(n + 1, dtype=torch.int32) * q_len
        kvl = torch.tensor(kv_lens, dtype=torch.int32)
        w.plan(qo, kvp, idx, kvl, heads, CKV, KPE, ps, q_len > 1, SM, BF16, kv_dt)
        return (qn[: n * q_len], qp[: n * q_len], ckv, kpe, qo, kvp, idx.to(DEV), kvl)

    plan([100] * max_b)
    w.run(qn, qp, ckv, kpe, out=out, lse=lse)  # warm-up: loads the modules outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(qn, qp, ckv, kpe, out=out, lse=lse)
    for kv_lens in ([3000, 1, 17, 20000, 64, 5, 900, 2], [1] * max_b, [30000, 7], [8000] * max_b, [100] * max_b):
        b = plan(kv_lens)
        rows = len(kv_lens) * q_len
        ref_o, ref_lse = reference(b, SM, q_len > 1)
        prev = None
        for _ in range(2):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(out, lse, ref_o, ref_lse, BF16, rows=rows)
            assert prev is None or torch.equal(out[:rows], prev)
            prev = out[:rows].clone()
        eager = BatchMLAPagedAttentionWrapper(_ws())
        eager.plan(b[4], b[5], b[6], b[7], heads, CKV, KPE, ps, q_len > 1, SM, BF16, kv_dt)
        assert (eager.run(*b[:4]).float() - out[:rows].float()).abs().max() < 2e-2


# ---- an fp8 latent cache (kernels/mla_decode_fp8.py; the reference reads the dequantized cache) ----
@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_len,causal", [(1, False), (2, True), (4, True)])
def test_mla_fp8_matrix(kv_dtype, dtype, heads, page_size, q_len, causal):
    kv = _lens(7, random.Random())
    w, b, out, lse = run_case([q_len] * len(kv), kv, heads, page_size, causal, dtype, kv_dtype=kv_dtype)
    assert w._state.attn is not None and w._state.tile in (16, 32)  # never the wgmma kernel's 64
    check(out, lse, *reference(b, SM, causal), dtype)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("batch", [1, 3, 64, 128])
def test_mla_fp8_batch_sizes(kv_dtype, batch):
    rng = random.Random()
    kv = [rng.randint(1, 4096) for _ in range(batch)]
    w, b, out, lse = run_case([1] * batch, kv, 16, 64, False, kv_dtype=kv_dtype)
    check(out, lse, *reference(b, SM, False), BF16)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_mla_fp8_long_split_kv_and_views(kv_dtype):
    w, b, out, lse = run_case([1, 2], [32768, 9001], 128, 64, True, kv_dtype=kv_dtype)
    assert w._plan.has_split
    check(out, lse, *reference(b, SM, True), BF16)
    w, b, out, lse = run_case([1] * 9 + [2], _lens(10, random.Random()), 16, 1, True, packed=True, kv_dtype=kv_dtype)
    assert b[3].data_ptr() == b[2].data_ptr() + CKV  # SGLang's views of one 576-byte-wide fp8 buffer
    check(out, lse, *reference(b, SM, True), BF16)


def test_mla_fp8_deterministic_and_sharp():
    w, b, out, lse = run_case([1, 2, 4], [3000, 700, 64], 32, 16, True, scale=8.0, kv_dtype=FP8[0])
    check(out, lse, *reference(b, SM, True), BF16)
    for _ in range(3):
        out2, lse2 = w.run(*b[:4], return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_mla_capture_without_graph_flag_is_an_error():
    w, b, out, lse = run_case([1, 1], [10, 20], 16, 16, False)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="use_cuda_graph"):
        with torch.cuda.graph(graph):
            w.run(*b[:4])


def test_mla_bad_device_page_ids(monkeypatch):
    """GPU-resident page ids beyond the cache: clamped in the kernel (no fault, the other
    requests right); with CUTE_ATTN_CHECK_INDICES=1 run() names the bad id."""
    b = list(device_batch([1, 1], [40, 50], 16, 16))
    b[6] = b[6].to(DEV)
    b[6][0] = b[2].shape[0] + 100
    w = BatchMLAPagedAttentionWrapper(_ws())
    w.plan(b[4], b[5], b[6], b[7], 16, CKV, KPE, 16, False, SM, BF16, BF16)
    out = w.run(*b[:4])
    torch.cuda.synchronize()
    good = list(b)
    good[6] = b[6].clone()
    good[6][0] = 0
    ref_o, _ = reference(tuple(good), SM, False)
    assert torch.isfinite(out[1]).all()
    assert ((out[1].float() - ref_o[1]).norm() / ref_o[1].norm()) < 2e-2
    monkeypatch.setenv("CUTE_ATTN_CHECK_INDICES", "1")
    with pytest.raises(ValueError, match="page id"):
        w.run(*b[:4])
