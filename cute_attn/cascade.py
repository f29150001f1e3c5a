"""Cascade (shared-prefix) attention, FlashInfer's ``flashinfer.cascade`` names:
``MultiLevelCascadeAttentionWrapper``, the deprecated shared-prefix wrappers and the ⊕ merge
ops (the code: ``cute_attn.wrappers``)."""

from .wrappers.cascade import (
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from .wrappers.merge import merge_state, merge_state_in_place, merge_states

__all__ = [
    "MultiLevelCascadeAttentionWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]
