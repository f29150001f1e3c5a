"""SGLang's FlashInfer backend, call for call (``python/sglang/srt/layers/attention/
flashinfer_backend.py`` at commit 0005834cdb2a5b7472789ccbf0d3361b5cf853b8; build/dev/
engine_calls.md §2): a decode step (``begin_forward`` with CUDA index arrays, ``forward`` with
sm_scale / logits_soft_cap / k_scale / v_scale on a 3-D page-size-1 pool), an extend step (paged
only, ``forward(causal=True)`` on a plan made without causal; ragged without prefix; ragged +
paged ``forward_return_lse`` merged by ``merge_state``), and a CUDA-graph decode: capture after a
real plan and a warm-up, then ``begin_forward = partial(fast_decode_plan, w)`` with
``global_override_indptr_cpu`` before each replay, the index buffers written in place.  A plain,
a sliding-window (SGLang's decode: the KV shortened to the window, run without window) and a
soft-cap model, bf16.  CPU: fake-CUDA buffers, kernels emulated; GPU (``gpu``): for real, 32 / 8
heads, head_dim 128 (specs the ``all`` preset compiles)."""

import functools
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from emu_helpers import demu, launches  # noqa: E402,F401
from replay import BF16, Env, check, check_lse, models  # noqa: E402

from cute_attn import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    fast_decode_plan,
)
from cute_attn.testing import ragged_reference  # noqa: E402

CPU_MODELS = models(8, 2, 64)
GPU_MODELS = models(32, 8, 128)


class Pool:
    """SGLang's token pool: page size 1, k / v buffers ``[slots, hk, d]`` (a tuple of 3-D tensors),
    req_to_token rows of slot ids."""

    def __init__(self, env, m, slots=4096):
        self.env, self.m = env, m
        self.k, self.v = env.randn(slots, m.hk, m.d), env.randn(slots, m.hk, m.d)
        self.free = list(range(slots))
        random.shuffle(self.free)

    def alloc(self, n):
        return [self.free.pop() for _ in range(n)]

    def kv(self, slots):
        idx = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        return self.k[idx], self.v[idx]


def _window_lens(m, seq_lens):
    """SGLang's SWA decode: clamp(seq_lens, max=window + 1), the last tokens."""
    if m.window_left < 0:
        return list(seq_lens)
    return [min(n, m.window_left + 1) for n in seq_lens]


def _decode_ref(env, pool, q, reqs, m, sm_scale=None, k_scale=1.0, v_scale=1.0):
    outs = []
    for b, slots in enumerate(reqs):
        k, v = pool.kv(slots)
        ro, _ = ragged_reference(
            q[b : b + 1].cpu(),
            k.cpu(),
            v.cpu(),
            torch.tensor([0, 1]),
            torch.tensor([0, len(slots)]),
            sm_scale=(sm_scale or m.sm_scale) * k_scale,
            logits_soft_cap=m.cap_or_none,
            window_left=m.window_left,
        )
        outs.append(ro * v_scale)
    return torch.cat(outs)


def _indices(env, reqs, m, extra=0):
    """call_begin_forward: kv_indptr = cumsum(paged_kernel_lens) (CUDA), kv_indices by the Triton
    kernel (CUDA), for the SWA wrapper the window's tail of each request."""
    lens = _window_lens(m, [len(r) for r in reqs])
    flat = [s for r, n in zip(reqs, lens) for s in r[len(r) - n :]]
    indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return indptr, torch.tensor(flat + [0] * extra, dtype=torch.int32), lens


def run_decode_step(env, m, k_scale=None, v_scale=None):
    pool = Pool(env, m)
    bs = 5
    reqs = [pool.alloc(random.randint(1, 150)) for _ in range(bs)]
    ws = env.ws()
    w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2", use_tensor_cores=m.hq // m.hk >= 4)
    kv_last_page_len = env.buf(torch.ones(16, dtype=torch.int32))
    indptr, indices, _ = _indices(env, reqs, m)
    w.begin_forward(
        env.buf(indptr),
        env.buf(indices),
        kv_last_page_len[:bs],
        m.hq,
        m.hk,
        m.d,
        1,
        data_type=BF16,
        q_data_type=BF16,
        non_blocking=True,
        fixed_split_size=None,
        disable_split_kv=False,
    )
    q = env.randn(bs, m.hq * m.d)
    o = w.forward(
        q.contiguous().view(-1, m.hq, m.d),
        (pool.k, pool.v),
        sm_scale=m.sm_scale,
        logits_soft_cap=m.soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    m_ref = m if m.window_left < 0 else type(m)(m.name, m.hq, m.hk, m.d, m.window_left, m.soft_cap)
    ref = _decode_ref(env, pool, q.view(-1, m.hq, m.d), reqs, m_ref, k_scale=k_scale or 1.0, v_scale=v_scale or 1.0)
    check(o, ref, f"sglang decode {m.name}")


def run_extend(env, m, shape):
    """shape "paged": paged-only (KV saved first, forward(causal=True) on a causal=False plan);
    "ragged": no prefix; "merge": a prefix, ragged (new vs new) + paged (new vs prefix) merged."""
    pool = Pool(env, m)
    bs = 3
    prefix = [0, 0, 0] if shape == "ragged" else [random.randint(1, 60) for _ in range(bs)]
    extend = [random.randint(1, 40) for _ in range(bs)]
    reqs = [pool.alloc(p + e) for p, e in zip(prefix, extend)]
    ws = env.ws()
    qo = torch.tensor([0] + list(torch.tensor(extend).cumsum(0)), dtype=torch.int32)
    q = env.randn(int(qo[-1]), m.hq, m.d)
    kv_last = env.buf(torch.ones(16, dtype=torch.int32))
    seq = [p + e for p, e in zip(prefix, extend)]
    kv_all = [pool.kv(r) for r in reqs]
    k_all = torch.cat([k for k, _ in kv_all]).cpu()
    v_all = torch.cat([v for _, v in kv_all]).cpu()
    seq_indptr = torch.tensor([0] + list(torch.tensor(seq).cumsum(0)), dtype=torch.int32)
    ref, ref_lse = ragged_reference(
        q.cpu(),
        k_all,
        v_all,
        qo,
        seq_indptr,
        causal=True,
        sm_scale=m.sm_scale,
        logits_soft_cap=m.cap_or_none,
        window_left=m.window_left,
    )
    paged = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    if shape == "paged":
        lens = seq
    else:
        lens = prefix
    flat = [s for r, n in zip(reqs, lens) for s in r[:n]]
    kv_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    kv_indices = env.buf(torch.tensor(flat + [0] * 256, dtype=torch.int32))  # +256 slack
    if shape != "ragged":
        paged.begin_forward(
            env.buf(qo),
            env.buf(kv_indptr),
            kv_indices,
            kv_last[:bs],
            m.hq,
            m.hk,
            m.d,
            1,
            q_data_type=BF16,
            kv_data_type=BF16,
            custom_mask=None,
            non_blocking=True,
            fixed_split_size=None,
            prefix_len_ptr=None,
            token_pos_in_items_ptr=None,
            token_pos_in_items_len=0,
            max_item_len_ptr=None,
        )
    if shape == "paged":
        o = paged.forward(
            q,
            (pool.k, pool.v),
            causal=True,
            sm_scale=m.sm_scale,
            window_left=m.window_left,
            logits_soft_cap=m.soft_cap,
            k_scale=None,
            v_scale=None,
        )
        check(o, ref, f"sglang extend paged {m.name}")
        return
    ragged = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="auto")
    ragged.begin_forward(env.buf(qo), env.buf(qo), m.hq, m.hk, m.d, q_data_type=BF16)
    k_new = torch.cat([pool.kv(r[p:])[0] for r, p in zip(reqs, prefix)])
    v_new = torch.cat([pool.kv(r[p:])[1] for r, p in zip(reqs, prefix)])
    if shape == "ragged":
        o = ragged.forward(q, k_new, v_new, causal=True, sm_scale=m.sm_scale, logits_soft_cap=m.soft_cap)
        check(o, ref, f"sglang extend ragged {m.name}")
        return
    o1, s1 = ragged.forward_return_lse(
        q, k_new, v_new, causal=True, sm_scale=m.sm_scale, window_left=-1, logits_soft_cap=m.soft_cap
    )
    o2, s2 = paged.forward_return_lse(
        q, (pool.k, pool.v), causal=False, sm_scale=m.sm_scale, window_left=-1, logits_soft_cap=m.soft_cap
    )
    assert s1.dtype == torch.float32 and s1.shape == (q.shape[0], m.hq)
    o, s = env.merge_state(o1, s1, o2, s2)
    check(o, ref, f"sglang extend ragged+paged {m.name}")
    check_lse(s, ref_lse, f"sglang extend merged lse {m.name}")


def run_cuda_graph(env, m):
    pool = Pool(env, m)
    bs, max_bs, ctx = 4, 8, 400
    kv_indptr = env.buf(torch.zeros(max_bs + 1, dtype=torch.int32))
    kv_last = env.buf(torch.ones(max_bs, dtype=torch.int32))
    cg_indices = env.buf(torch.zeros(max_bs * ctx, dtype=torch.int32))
    ws = env.ws()
    w = BatchDecodeWithPagedKVCacheWrapper(
        ws,
        "NHD",
        backend="fa2",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=kv_indptr[: bs + 1],
        paged_kv_indices_buffer=cg_indices,
        paged_kv_last_page_len_buffer=kv_last[:bs],
    )

    def update(reqs):
        indptr, indices, lens = _indices(env, reqs, m)
        kv_indptr[: bs + 1].copy_(indptr.to(kv_indptr.device))  # cumsum in place
        w._paged_kv_indices_buf[: indices.numel()].copy_(indices.to(cg_indices.device))  # Triton, in place
        return indptr

    reqs = [pool.alloc(1) for _ in range(bs)]  # capture: seq_len fill value 1
    update(reqs)
    w.begin_forward(
        kv_indptr[: bs + 1],
        w._paged_kv_indices_buf,
        kv_last[:bs],
        m.hq,
        m.hk,
        m.d,
        1,
        data_type=BF16,
        q_data_type=BF16,
        non_blocking=True,
        fixed_split_size=None,
        disable_split_kv=False,
    )
    q = env.randn(bs, m.hq, m.d)
    holder = {}

    def run_once():
        holder["o"] = w.forward(
            q, (pool.k, pool.v), sm_scale=m.sm_scale, logits_soft_cap=m.soft_cap, k_scale=None, v_scale=None
        )

    for _ in range(2):  # SGLang's warm-up runs before the capture
        run_once()
    with env.capture() as replay:
        run_once()
    w.begin_forward = functools.partial(fast_decode_plan, w)
    for step in range(3):
        reqs = [pool.alloc(random.randint(1, 300)) for _ in range(bs)]
        indptr_cpu = update(reqs)
        w.begin_forward(
            kv_indptr[: bs + 1],
            w._paged_kv_indices_buf,
            kv_last[:bs],
            m.hq,
            m.hk,
            m.d,
            1,
            data_type=BF16,
            q_data_type=BF16,
            non_blocking=True,
            fixed_split_size=None,
            disable_split_kv=False,
            global_override_indptr_cpu=indptr_cpu,
        )
        q.copy_(env.randn(bs, m.hq, m.d))
        holder["o"].fill_(float("nan"))
        replay()
        env.sync()
        check(holder["o"], _decode_ref(env, pool, q, reqs, m), f"sglang graph replay {step} {m.name}")


# ---- CPU ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_cpu_decode_step(demu, m):
    run_decode_step(Env("cpu", demu), m, k_scale=0.5, v_scale=2.0)
    fam, params, args = launches(demu, "paged_decode")[-1]
    assert args[12] == pytest.approx(m.sm_scale * 0.5)  # k_scale folds into the softmax scale
    if m.soft_cap:  # forward(logits_soft_cap=30) on a plan without it: the soft-cap kernel, cap 30
        assert "SoftCap" in params["variant"] and args[14] == pytest.approx(30.0)
    else:
        assert params["variant"] == "none"  # SWA decode: shortened KV, no window kernel


@pytest.mark.parametrize("shape", ["paged", "ragged", "merge"])
@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_cpu_extend(demu, m, shape):
    if shape == "merge" and m.window_left >= 0:
        pytest.skip("SGLang's SWA prefix needs its custom mask (not replayed here)")
    if shape == "ragged" and m.window_left >= 0:
        pytest.skip("SGLang's ragged no-prefix forward passes no window_left")
    run_extend(Env("cpu", demu), m, shape)
    fam, params, args = launches(demu, "batch_prefill_sm90")[-1]
    assert params["soft_cap"] == bool(m.soft_cap)
    if m.soft_cap:
        assert args[13] == pytest.approx(m.soft_cap)


@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_cpu_cuda_graph(demu, m):
    run_cuda_graph(Env("cpu", demu), m)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_MODELS, ids=lambda m: m.name)
def test_gpu_decode_step(m):
    run_decode_step(Env("gpu"), m, k_scale=0.5, v_scale=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["ragged", "merge"])
@pytest.mark.parametrize("m", [GPU_MODELS[0]], ids=lambda m: m.name)  # paged prefill: plain kernels ship
def test_gpu_extend(m, shape):
    run_extend(Env("gpu"), m, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_MODELS, ids=lambda m: m.name)
def test_gpu_cuda_graph(m):
    run_cuda_graph(Env("gpu"), m)
