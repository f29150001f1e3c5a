"""Batch prefill / append, FlashInfer's ``flashinfer.prefill`` names:
``BatchPrefillWithRaggedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper``,
``single_prefill_with_kv_cache`` (and ``_return_lse``), plus ``pack_custom_mask`` (FlashInfer's
``segment_packbits`` layout).  The code: ``cute_attn.wrappers`` (``prefill_base``: planning and
launch, ``prefill``: the two wrappers, ``single``, ``masks``)."""

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
    "POS_MODES",
    "resolve_variant",
]
