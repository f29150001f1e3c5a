"""What an engine's FlashInfer backend touches beyond the wrappers' methods, with its
``flashinfer`` imports pointed at ``cute_attn``: the module-level names vLLM's backend imports
when it loads (``vllm/v1/attention/backends/flashinfer.py``), the helpers among them, the
Blackwell-only kernels among them failing loudly when called, and the prefill wrappers'
``_custom_mask_buf`` that vLLM's grouped prefill path reads.  CPU only."""

import importlib
import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from emu_helpers import _fake_cuda, demu  # noqa: E402,F401

from cute_attn import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper  # noqa: E402

# (module under flashinfer / cute_attn, names) as vLLM's backend imports them at load time
VLLM_IMPORTS = [
    (
        "",
        (
            "BatchDecodeWithPagedKVCacheWrapper",
            "BatchPrefillWithPagedKVCacheWrapper",
            "MultiLevelCascadeAttentionWrapper",
        ),
    ),
    ("decode", ("_get_range_buf", "trtllm_batch_decode_with_kv_cache", "get_seq_lens")),
    ("prefill", ("trtllm_batch_context_with_kv_cache",)),
    ("utils", ("FP4Tensor",)),
    ("page", ("get_seq_lens",)),
]


@pytest.mark.parametrize("mod,names", VLLM_IMPORTS)
def test_vllm_module_imports_resolve(mod, names):
    m = importlib.import_module("cute_attn" + (f".{mod}" if mod else ""))
    for name in names:
        assert hasattr(m, name), f"cute_attn{'.' + mod if mod else ''} lacks {name}"


def test_blackwell_only_names_raise_when_used():
    from cute_attn.decode import trtllm_batch_decode_with_kv_cache
    from cute_attn.prefill import trtllm_batch_context_with_kv_cache
    from cute_attn.utils import FP4Tensor

    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="BatchDecodeWithPagedKVCacheWrapper"):
        trtllm_batch_decode_with_kv_cache(query=q, kv_cache=q, workspace_buffer=None, block_tables=None, seq_lens=None)
    with pytest.raises(NotImplementedError, match="BatchPrefillWithPagedKVCacheWrapper"):
        trtllm_batch_context_with_kv_cache(q, q, None, None, None)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        FP4Tensor(torch.zeros(4, dtype=torch.uint8), torch.zeros(1))


def test_get_range_buf():
    from cute_attn.decode import _get_range_buf

    sizes = [random.randrange(0, 3000) for _ in range(20)] + [0, 1, 1024, 1025]
    views = []
    for n in sizes:
        r = _get_range_buf(n, "cpu")
        assert r.dtype == torch.int32 and r.shape == (n,)
        assert torch.equal(r, torch.arange(n, dtype=torch.int32))
        views.append((n, r))
    for n, r in views:  # views handed out before the buffer grew still hold their range
        assert torch.equal(r, torch.arange(n, dtype=torch.int32))
    a, b = _get_range_buf(7, "cpu"), _get_range_buf(5, "cpu")
    assert a.data_ptr() == b.data_ptr()  # one buffer, not an allocation per call
    with pytest.raises(ValueError, match="seq_len"):
        _get_range_buf(-1, "cpu")


def test_get_seq_lens():
    from cute_attn import get_seq_lens

    for _ in range(10):
        batch, ps = random.randrange(1, 40), random.choice([1, 16, 64])
        pages = [random.randrange(0, 9) for _ in range(batch)]
        last = [random.randrange(1, ps + 1) if n else 0 for n in pages]
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
        got = get_seq_lens(indptr, torch.tensor(last, dtype=torch.int32), ps)
        want = [(n - 1) * ps + lp if n else lp for n, lp in zip(pages, last)]
        assert got.tolist() == want
    with pytest.raises(ValueError, match="kv_last_page_len"):
        get_seq_lens(torch.tensor([0, 1, 2]), torch.tensor([1, 1, 1]), 16)


def _packed(mask_rows, qo, kv):
    """FlashInfer's packed layout: each request's [qo, kv] bits row-major, little bit order,
    padded to a whole byte."""
    out, off = [], 0
    for q, k in zip(qo, kv):
        bits = mask_rows[off : off + q * k]
        off += q * k
        out.append(np.packbits(bits.numpy().astype(np.uint8), bitorder="little"))
    return np.concatenate(out)


def _plan_args(qo, kv):
    ind = lambda x: torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32)  # noqa: E731
    return ind(qo), ind(kv)


def test_custom_mask_buf_follows_the_plan(demu):
    qo, kv = [3, 5, 1], [5, 7, 9]
    qo_i, kv_i = _plan_args(qo, kv)
    w = BatchPrefillWithRaggedKVCacheWrapper(_fake_cuda(torch.zeros(64 << 20, dtype=torch.uint8)))
    assert w._custom_mask_buf is None  # before any plan
    w.plan(qo_i, kv_i, 4, 2, 64, q_data_type=torch.bfloat16)
    assert w._custom_mask_buf is None
    mask = torch.rand(sum(q * k for q, k in zip(qo, kv))) < 0.5
    w.plan(qo_i, kv_i, 4, 2, 64, custom_mask=mask, q_data_type=torch.bfloat16)
    want = _packed(mask, qo, kv)
    got = w._custom_mask_buf
    assert got.dtype == torch.uint8 and got.numel() >= want.size
    assert np.array_equal(got[: want.size].cpu().numpy(), want) and not got[want.size :].any()
    w.plan(qo_i, kv_i, 4, 2, 64, q_data_type=torch.bfloat16)
    assert w._custom_mask_buf is None  # a plan without a mask drops it, as FlashInfer's
    with pytest.raises(AttributeError):  # the plan owns it: assigning a mask is an error, not ignored
        w._custom_mask_buf = torch.zeros(4, dtype=torch.uint8)


def test_custom_mask_buf_in_graph_mode_holds_the_planned_bytes(demu):
    qo, kv = [2, 4], [6, 3]
    qo_i, kv_i = _plan_args(qo, kv)
    mbuf = _fake_cuda(torch.full((64,), 0xAA, dtype=torch.uint8))
    w = BatchPrefillWithRaggedKVCacheWrapper(
        _fake_cuda(torch.zeros(64 << 20, dtype=torch.uint8)),
        use_cuda_graph=True,
        qo_indptr_buf=_fake_cuda(torch.zeros(3, dtype=torch.int32)),
        kv_indptr_buf=_fake_cuda(torch.zeros(3, dtype=torch.int32)),
        custom_mask_buf=mbuf,
        mask_indptr_buf=_fake_cuda(torch.zeros(3, dtype=torch.int32)),
    )
    mask = torch.rand(sum(q * k for q, k in zip(qo, kv))) < 0.5
    w.plan(qo_i, kv_i, 4, 2, 64, custom_mask=mask, q_data_type=torch.bfloat16)
    want = _packed(mask, qo, kv)
    assert w._custom_mask_buf is mbuf
    assert np.array_equal(mbuf[: want.size].numpy(), want)


def test_custom_mask_buf_must_be_bytes(demu):
    qo_i, kv_i = _plan_args([2], [6])
    w = BatchPrefillWithPagedKVCacheWrapper(
        _fake_cuda(torch.zeros(64 << 20, dtype=torch.uint8)),
        use_cuda_graph=True,
        qo_indptr_buf=_fake_cuda(torch.zeros(2, dtype=torch.int32)),
        paged_kv_indptr_buf=_fake_cuda(torch.zeros(2, dtype=torch.int32)),
        paged_kv_indices_buf=_fake_cuda(torch.zeros(8, dtype=torch.int32)),
        paged_kv_last_page_len_buf=_fake_cuda(torch.zeros(1, dtype=torch.int32)),
        custom_mask_buf=_fake_cuda(torch.zeros(16, dtype=torch.bool)),
        mask_indptr_buf=_fake_cuda(torch.zeros(2, dtype=torch.int32)),
    )
    with pytest.raises(ValueError, match="custom_mask_buf must be uint8"):
        w.plan(
            qo_i,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
            4,
            2,
            64,
            16,
            custom_mask=torch.ones(12, dtype=torch.bool),
            q_data_type=torch.bfloat16,
        )
