"""FlashInfer's ``flashinfer.page`` name that engines use: ``get_seq_lens`` (the code:
``cute_attn.wrappers.engine_names``)."""

from .wrappers.engine_names import get_seq_lens

__all__ = ["get_seq_lens"]
