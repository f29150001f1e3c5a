"""cute_attn: attention kernels for LLM serving in the CuTe DSL (Hopper sm_90a, Blackwell sm_100a).

Importing the package needs neither a GPU nor the CuTe DSL: the DSL is only needed to compile
kernels (see ``python -m cute_attn compile``); running them needs the CUDA runtime.
"""

from ._version import __version__  # noqa: F401
from .cascade import (  # noqa: E402,F401
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from .decode import (  # noqa: E402,F401
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
    get_seq_lens,
    single_decode_with_kv_cache,
)
from .merge import merge_state, merge_state_in_place, merge_states  # noqa: E402,F401
from .mla import BatchMLAPagedAttentionWrapper  # noqa: E402,F401
from .prefill import (  # noqa: E402,F401
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper  # noqa: E402,F401

# FlashInfer's top-level names that exist here: ``import cute_attn as flashinfer`` works for them
__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
    "single_decode_with_kv_cache",
    "get_seq_lens",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "MultiLevelCascadeAttentionWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "BlockSparseAttentionWrapper",
    "VariableBlockSparseAttentionWrapper",
    "BatchMLAPagedAttentionWrapper",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "__version__",
]
