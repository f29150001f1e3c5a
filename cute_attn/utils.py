"""FlashInfer's ``flashinfer.utils`` names that engines import: ``FP4Tensor`` (NVFP4 is not
supported: constructing one raises) and ``_get_range_buf`` (the code:
``cute_attn.wrappers.engine_names``)."""

from .wrappers.engine_names import FP4Tensor, _get_range_buf

__all__ = ["FP4Tensor", "_get_range_buf"]
