"""FlashInfer's module-level names that engines import beside the wrappers, so that pointing an
engine's ``flashinfer`` imports at ``cute_attn`` also gets past its module's first lines.  vLLM's
FlashInfer backend imports, when the module loads: ``_get_range_buf`` and
``trtllm_batch_decode_with_kv_cache`` from ``flashinfer.decode``,
``trtllm_batch_context_with_kv_cache`` from ``flashinfer.prefill`` and ``FP4Tensor`` from
``flashinfer.utils``; older versions also ``get_seq_lens`` (``flashinfer.page``, re-exported by
its ``decode``).

The two small helpers are implemented.  The TensorRT-LLM (``trtllm-gen``) kernels and NVFP4
tensors are FlashInfer's Blackwell paths, which cute_attn does not have: calling them raises
``NotImplementedError`` naming what to use instead.  An engine reaches them only where it
chose them (vLLM: ``use_trtllm_attention`` on sm_100 with FlashInfer's cubins present, or an
NVFP4 output), so importing them costs nothing."""

from __future__ import annotations

import torch

__all__ = [
    "FP4Tensor",
    "_get_range_buf",
    "get_seq_lens",
    "trtllm_batch_context_with_kv_cache",
    "trtllm_batch_decode_with_kv_cache",
]

_RANGES: dict = {}  # device -> int32 arange; its prefixes are what _get_range_buf returns


def _get_range_buf(seq_len: int, device) -> torch.Tensor:
    """``torch.arange(seq_len, dtype=int32)`` on ``device`` as a view of one buffer per device,
    grown to the next power of two when too short (vLLM's CUDA-graph decode path slices it per
    batch size while capturing, so a slice must not be a fresh allocation each time; a grown
    buffer leaves earlier views valid: they keep their own storage)."""
    n = int(seq_len)
    if n < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    dev = torch.device(device)
    buf = _RANGES.get(dev)
    if buf is None or buf.numel() < n:
        buf = torch.arange(1 << max(n - 1, 0).bit_length(), dtype=torch.int32, device=dev)
        _RANGES[dev] = buf
    return buf[:n]


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """The kv length of each request of a paged batch: its full pages times ``page_size`` plus
    the tokens of its last page (``kv_indptr``: ``[batch + 1]`` page offsets,
    ``kv_last_page_len``: ``[batch]``); a request with no page has its ``kv_last_page_len``."""
    if kv_indptr.dim() != 1 or kv_last_page_len.shape != (kv_indptr.numel() - 1,):
        raise ValueError(
            f"kv_indptr must be [batch + 1] and kv_last_page_len [batch], got {tuple(kv_indptr.shape)} / "
            f"{tuple(kv_last_page_len.shape)}"
        )
    full_pages = (kv_indptr[1:] - kv_indptr[:-1] - 1).clamp(min=0)
    return full_pages * page_size + kv_last_page_len


def _absent(name: str, what: str, instead: str):
    def absent(*args, **kwargs):
        raise NotImplementedError(f"{name}: {what}, which cute_attn does not have; {instead}")

    absent.__name__ = absent.__qualname__ = name
    absent.__doc__ = f"FlashInfer's ``{name}`` ({what}): not in cute_attn; calling it raises NotImplementedError."
    return absent


_TRTLLM = "FlashInfer's TensorRT-LLM (trtllm-gen) kernels for Blackwell"
trtllm_batch_decode_with_kv_cache = _absent(
    "trtllm_batch_decode_with_kv_cache", _TRTLLM, "use BatchDecodeWithPagedKVCacheWrapper (every arch)"
)
trtllm_batch_context_with_kv_cache = _absent(
    "trtllm_batch_context_with_kv_cache", _TRTLLM, "use BatchPrefillWithPagedKVCacheWrapper (every arch)"
)


class FP4Tensor:
    """FlashInfer's NVFP4 tensor (packed 4-bit values + fp8 block scales), the output type of its
    trtllm-gen kernels' fused quantization.  No cute_attn kernel reads or writes NVFP4:
    constructing one raises ``NotImplementedError`` (the name exists so that an engine module
    importing it loads)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "FP4Tensor: NVFP4 outputs (FlashInfer's trtllm-gen fused quantization) are not supported by cute_attn; "
            "leave the output in the query dtype (or o_data_type)"
        )
