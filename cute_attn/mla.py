"""Multi-head latent attention, FlashInfer's ``flashinfer.mla`` names:
``BatchMLAPagedAttentionWrapper`` and ``MLAPlanMetadata`` (the code: ``cute_attn.wrappers.mla``)."""

from .wrappers.mla import BatchMLAPagedAttentionWrapper
from .wrappers.mla_inputs import MLAPlanMetadata

__all__ = ["BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"]
