"""vLLM's FlashInfer backend, call for call (``vllm/v1/attention/backends/flashinfer.py``; the
version build/dev/engine_calls.md §1 reads -- index id 23711878, no commit given -- and the later
variant 54796307758 for its ``fast_decode_plan`` path): a decode step, a prefill (paged; ragged
as under DCP), a mixed step (prefill and decode planned on one workspace before either runs)
and a CUDA-graph capture + replay with re-plans through ``_cached_module.plan`` (vLLM's own
fast path) and FlashInfer's ``fast_decode_plan``, for a plain, a sliding-window and a soft-cap
model, bf16.  CPU: fake-CUDA buffers, kernels emulated (binding, arguments, launch scalars, and
the emulated results against the fp32 reference); GPU (``gpu`` marker): the same calls for
real, 32 / 8 heads, head_dim 128 (specs the ``all`` preset compiles)."""

import os
import random
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from emu_helpers import demu, launches  # noqa: E402,F401
from replay import BF16, Env, PagedPool, check, models  # noqa: E402

from cute_attn import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    fast_decode_plan,
)
from cute_attn.testing import ragged_reference  # noqa: E402

CPU_MODELS = models(8, 2, 64)
GPU_MODELS = models(32, 8, 128)
PS = 16


def _decode_plan(w, m, indptr_cpu, indices, last_cpu):
    """vLLM's fast_plan_decode on a first call / a non-graph wrapper: the full plan() with 15
    positional optionals (FlashInfer's legacy order; a DeprecationWarning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        w.plan(
            indptr_cpu,
            indices,
            last_cpu,
            m.hq,
            m.hk,
            m.d,
            PS,
            "NONE",
            m.window_left,
            m.cap_or_none,
            BF16,
            BF16,
            BF16,
            None,
            m.sm_scale,
            None,
            None,
            True,
            None,
            None,
            -1,
            False,
        )
    w.vllm_first_call = False


def _asserts(w, m, causal=None):
    """What FlashInferImpl.forward asserts before running."""
    assert w._window_left == m.window_left
    assert w._logits_soft_cap == (m.soft_cap or 0.0)
    assert w._sm_scale == m.sm_scale
    if causal is not None:
        assert w._causal == causal


def _step(env, m, pool, decode_lens, prefill):
    """A batch, decodes first: (pages per request, seq lens, q lens)."""
    qlens = [1] * len(decode_lens) + [q for q, _ in prefill]
    lens = list(decode_lens) + [kv for _, kv in prefill]
    return pool.pages_for(lens), lens, qlens


def run_decode_step(env, m):
    pool = PagedPool(env, m, PS, 64)
    pages, lens, _ = _step(env, m, pool, [random.randint(1, 120) for _ in range(5)], [])
    indptr, indices, last = pool.tables(pages, lens, PS)
    ws = env.ws()
    w = BatchDecodeWithPagedKVCacheWrapper(
        ws,
        "NHD",
        use_cuda_graph=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        use_tensor_cores=True,
    )
    _decode_plan(w, m, indptr, env.buf(indices), last)
    q = env.randn(len(lens), m.hq, m.d)
    output = env.nan(len(lens), m.hq, m.d)
    _asserts(w, m)
    w.run(q, pool.kv, k_scale=1.0, v_scale=1.0, out=output[: len(lens)])
    ref, _ = pool.reference(q, torch.arange(len(lens) + 1, dtype=torch.int32), pages, lens, m, False)
    check(output, ref, f"vllm decode {m.name}")


def run_prefill_and_mixed(env, m):
    """A mixed step: the prefill plan of requests [nd:] (paged_kv_indptr not rebased), the decode
    plan of [:nd], both on ONE workspace before either runs; then prefill.run, decode.run."""
    pool = PagedPool(env, m, PS, 96)
    nd = 3
    pages, lens, qlens = _step(env, m, pool, [random.randint(1, 80) for _ in range(nd)], [(17, 40), (30, 30), (5, 70)])
    indptr, indices, last = pool.tables(pages, lens, PS)
    qo = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    ws = env.ws()
    prefill = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    decode = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indices_dev = env.buf(indices)
    qo_prefill = qo[nd:] - qo[nd]
    prefill.plan(
        qo_prefill,
        indptr[nd:],
        indices_dev,
        last[nd:],
        m.hq,
        m.hk,
        m.d,
        PS,
        causal=True,
        sm_scale=m.sm_scale,
        window_left=m.window_left,
        logits_soft_cap=m.cap_or_none,
        q_data_type=BF16,
        kv_data_type=BF16,
        o_data_type=BF16,
        fixed_split_size=-1,
        disable_split_kv=False,
    )
    _decode_plan(decode, m, indptr[: nd + 1], indices_dev, last[:nd])
    total = int(qo[-1])
    query = env.randn(total, m.hq, m.d)
    output = env.nan(total, m.hq, m.d)
    _asserts(prefill, m, causal=True)
    prefill.run(query[nd:], pool.kv, k_scale=1.0, v_scale=1.0, out=output[nd:])
    _asserts(decode, m)
    decode.run(query[:nd], pool.kv, k_scale=1.0, v_scale=1.0, out=output[:nd])
    ref, _ = pool.reference(query, qo, pages, lens, m, True)
    check(output, ref, f"vllm mixed step {m.name}")

    # DCP's ragged prefill of the new tokens (_new_tokens.plan(qo, qo, ...), run(q, k, v, return_lse=True))
    rag = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    rag.plan(
        qo_indptr=qo_prefill,
        kv_indptr=qo_prefill,
        num_qo_heads=m.hq,
        num_kv_heads=m.hk,
        head_dim_qk=m.d,
        head_dim_vo=m.d,
        causal=True,
        sm_scale=m.sm_scale,
        window_left=m.window_left,
        logits_soft_cap=m.cap_or_none,
        q_data_type=BF16,
    )
    n = int(qo_prefill[-1])
    k, v = env.randn(n, m.hk, m.d), env.randn(n, m.hk, m.d)
    o, lse = rag.run(query[nd:], k, v, return_lse=True)
    ro, rl = ragged_reference(
        query[nd:].cpu(),
        k.cpu(),
        v.cpu(),
        qo_prefill,
        qo_prefill,
        causal=True,
        sm_scale=m.sm_scale,
        logits_soft_cap=m.cap_or_none,
        window_left=m.window_left,
    )
    check(o, ro, f"vllm ragged {m.name}")


def run_cuda_graph(env, m, via):
    """One CG wrapper per batch size over views of persistent buffers; capture after the first
    (full) plan, then re-plans before each replay: vLLM's fast path (``_cached_module.plan``
    after H2D copies of indptr / last_page_len) or, in the later variant, FlashInfer's
    ``fast_decode_plan`` by keyword (build() copied last_page_len to the GPU)."""
    bs, max_pages = 4, 64
    pool = PagedPool(env, m, PS, 400)  # never freed: 4 plans of up to 4 x 19 pages each
    persist_indptr = env.buf(torch.zeros(9, dtype=torch.int32))
    persist_indices = env.buf(torch.zeros(max_pages * 8, dtype=torch.int32))
    persist_last = env.buf(torch.zeros(8, dtype=torch.int32))
    ws = env.ws()
    w = BatchDecodeWithPagedKVCacheWrapper(
        ws,
        "NHD",
        use_cuda_graph=True,
        paged_kv_indptr_buffer=persist_indptr[: bs + 1],
        paged_kv_indices_buffer=persist_indices,
        paged_kv_last_page_len_buffer=persist_last[:bs],
        use_tensor_cores=True,
    )
    q = env.randn(bs, m.hq, m.d)
    out = env.nan(bs, m.hq, m.d)

    def build(lens):
        pages = pool.pages_for(lens)
        indptr, indices, last = pool.tables(pages, lens, PS)
        persist_indptr[: bs + 1].copy_(indptr.to(persist_indptr.device))
        persist_indices[: indices.numel()].copy_(indices.to(persist_indices.device))  # the Triton kernel
        return pages, indptr, indices, last

    lens = [random.randint(1, 150) for _ in range(bs)]
    pages, indptr, indices, last = build(lens)
    _decode_plan(w, m, indptr, persist_indices[: indices.numel()], last)  # first call: the full plan
    w.run(q, pool.kv, k_scale=1.0, v_scale=1.0, out=out)  # warm-up outside the graph
    with env.capture() as replay:
        _asserts(w, m)
        w.run(q, pool.kv, k_scale=1.0, v_scale=1.0, out=out)
    for step in range(3):
        lens = [random.randint(1, 300) for _ in range(bs)]
        pages, indptr, indices, last = build(lens)
        if via == "cached_module":
            w._paged_kv_indptr_buf.copy_(indptr.to(persist_indptr.device), non_blocking=True)
            w._paged_kv_last_page_len_buf.copy_(last.to(persist_last.device), non_blocking=True)
            qo_host = torch.arange(bs + 1, dtype=torch.int32)
            seq_lens_cpu = torch.tensor(lens, dtype=torch.int32)
            w._plan_info = w._cached_module.plan(
                w._float_workspace_buffer,
                w._int_workspace_buffer,
                w._pin_memory_int_workspace_buffer,
                qo_host,
                indptr,
                seq_lens_cpu,
                bs,
                bs,
                m.hq,
                m.hk,
                PS,
                w.is_cuda_graph_enabled,
                m.d,
                m.d,
                False,
                m.window_left,
                *([-1, False, 0] if w._backend == "fa2" else []),
            )
            # step 6: the run's scalars set on the wrapper
            w._pos_encoding_mode = "NONE"
            w._window_left = m.window_left
            w._logits_soft_cap = m.soft_cap or 0.0
            w._sm_scale = m.sm_scale
            w._rope_scale = None
            w._rope_theta = None
        else:
            persist_last[:bs].copy_(last.to(persist_last.device))
            fast_decode_plan(
                w,
                indptr=indptr,
                indices=persist_indices[: indices.numel()],
                last_page_len=last,
                num_qo_heads=m.hq,
                num_kv_heads=m.hk,
                head_dim=m.d,
                page_size=PS,
                pos_encoding_mode="NONE",
                window_left=m.window_left,
                logits_soft_cap=m.cap_or_none,
                q_data_type=BF16,
                kv_data_type=BF16,
                data_type=None,
                sm_scale=m.sm_scale,
                rope_scale=None,
                rope_theta=None,
                non_blocking=True,
                fixed_split_size=-1,
                disable_split_kv=False,
            )
        q.copy_(env.randn(bs, m.hq, m.d))
        out.fill_(float("nan"))
        replay()
        env.sync()
        ref, _ = pool.reference(q, torch.arange(bs + 1, dtype=torch.int32), pages, lens, m, False)
        check(out, ref, f"vllm graph replay {step} via {via} {m.name}")


# ---- CPU ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_cpu_decode_step(demu, m):
    run_decode_step(Env("cpu", demu), m)
    fam, params, args = launches(demu, "paged_decode")[-1]
    assert args[12] == pytest.approx(m.sm_scale)  # k_scale=1.0 folds to the plan's scale
    assert ("SoftCap" in params["variant"]) == bool(m.soft_cap)
    assert ("SlidingWindow" in params["variant"]) == (m.window_left >= 0)


@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_cpu_prefill_and_mixed_step(demu, m):
    run_prefill_and_mixed(Env("cpu", demu), m)
    fam, params, args = launches(demu, "batch_prefill_sm90")[-1]
    assert params["causal"] and params["soft_cap"] == bool(m.soft_cap) and params["window"] == (m.window_left >= 0)


@pytest.mark.parametrize("via", ["cached_module", "fast_decode_plan"])
@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_cpu_cuda_graph(demu, m, via):
    run_cuda_graph(Env("cpu", demu), m, via)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_MODELS, ids=lambda m: m.name)
def test_gpu_decode_step(m):
    run_decode_step(Env("gpu"), m)


@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_MODELS[:1], ids=lambda m: m.name)  # paged prefill: plain kernels ship
def test_gpu_prefill_and_mixed_step(m):
    run_prefill_and_mixed(Env("gpu"), m)


@pytest.mark.gpu
@pytest.mark.parametrize("via", ["cached_module", "fast_decode_plan"])
@pytest.mark.parametrize("m", GPU_MODELS, ids=lambda m: m.name)
def test_gpu_cuda_graph(m, via):
    run_cuda_graph(Env("gpu"), m, via)
