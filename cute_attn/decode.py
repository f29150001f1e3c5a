"""Batch decode, FlashInfer's ``flashinfer.decode`` names: ``BatchDecodeWithPagedKVCacheWrapper``,
``CUDAGraphBatchDecodeWithPagedKVCacheWrapper``, ``fast_decode_plan`` and
``single_decode_with_kv_cache`` (the code: ``cute_attn.wrappers``), and the module names engines
import beside them (``get_seq_lens``, ``_get_range_buf``, and ``trtllm_batch_decode_with_kv_cache``,
which raises: ``wrappers/engine_names.py``)."""

from .wrappers.common import workspace_bytes
from .wrappers.decode import (
    MIN_PACKED_ITEMS_PER_CTA,
    SUPPORTED_HEAD_DIMS,
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
)
from .wrappers.decode_engine import fast_decode_plan
from .wrappers.engine_names import _get_range_buf, get_seq_lens, trtllm_batch_decode_with_kv_cache
from .wrappers.single import single_decode_with_kv_cache

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
    "single_decode_with_kv_cache",
    "get_seq_lens",
    "_get_range_buf",
    "trtllm_batch_decode_with_kv_cache",
    "MIN_PACKED_ITEMS_PER_CTA",
    "SUPPORTED_HEAD_DIMS",
    "workspace_bytes",
]
