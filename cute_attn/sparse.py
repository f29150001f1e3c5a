"""Block-sparse attention, FlashInfer's ``flashinfer.sparse`` names: ``BlockSparseAttentionWrapper``,
``VariableBlockSparseAttentionWrapper`` and ``convert_bsr_mask_layout`` (the code:
``cute_attn.wrappers.sparse``)."""

from .wrappers.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper, convert_bsr_mask_layout

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "convert_bsr_mask_layout"]
