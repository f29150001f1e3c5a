"""Batch prefill / append, FlashInfer's ``flashinfer.prefill`` names:
``BatchPrefillWithRaggedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper``,
``single_prefill_with_kv_cache`` (and ``_return_lse``), plus ``pack_custom_mask`` (FlashInfer's
``segment_packbits`` layout) and ``trtllm_batch_context_with_kv_cache`` (FlashInfer's Blackwell
TensorRT-LLM kernel, which engines import: it raises, ``wrappers/engine_names.py``).  The code:
``cute_attn.wrappers`` (``prefill_base``: planning and launch, ``prefill``: the two wrappers,
``single``, ``masks``)."""

from .wrappers.engine_names import trtllm_batch_context_with_kv_cache
from .wrappers.masks import pack_custom_mask
from .wrappers.options import POS_MODES, resolve_variant
from .wrappers.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from .wrappers.single import single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse

__all__ = [
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "pack_custom_mask",
    "trtllm_batch_context_with_kv_cache",
    "POS_MODES",
    "resolve_variant",
]
