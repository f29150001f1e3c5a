"""The jit entry of the ``paged_decode`` family: the kernel class for the spec's cache dtype
(``decode.PagedDecode`` for a 16-bit cache, ``decode_fp8.PagedDecodeFp8`` for fp8,
``decode_wide.WideDecode`` at head dim 512)."""

from __future__ import annotations

from ..variants.trace import make_entry
from .decode import DecodeConfig, PagedDecode
from .decode_fp8 import PagedDecodeFp8
from .decode_wide import HEAD_DIM as WIDE_HEAD_DIM
from .decode_wide import WideDecode


def build_paged_decode(spec):
    """The jit entry for a ``paged_decode`` spec: its variant is re-created from the spec's
    ``variant`` text and must still have the spec's fingerprint (else the class changed since
    the spec was made and the module would be cached under the wrong key).  An fp8 cache
    (``kv_dtype``) gets ``decode_fp8.PagedDecodeFp8``."""
    from ..families.decode import decode_abi_fixed
    from ..variants.base import abi_args

    cfg = DecodeConfig.from_spec(spec.pdict)
    if cfg.head_dim == WIDE_HEAD_DIM:
        kernel = WideDecode.for_decode(cfg)
    elif cfg.kv_dtype is not None:
        kernel = PagedDecodeFp8(cfg)
    else:  # tile_q 32: two row groups of 16 (``PagedDecode.head_split``)
        kernel = PagedDecode(cfg, cfg.tile_q, cfg.tile_q // 16)
    return make_entry(kernel, decode_abi_fixed(spec.pdict), abi_args(cfg.variant))
