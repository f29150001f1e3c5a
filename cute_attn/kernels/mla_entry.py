"""The jit entry of an ``mla_decode`` spec: ``kernels/mla_decode.py``, or
``kernels/mla_decode_fp8.py`` for a spec with an fp8 ``kv_dtype``."""

from __future__ import annotations

from .mla_decode import MlaConfig, MlaDecode
from .mla_decode_fp8 import MlaDecodeFp8


def build_mla_decode(spec):
    cfg = MlaConfig.from_spec(spec.pdict)
    return MlaDecodeFp8(cfg) if cfg.kv_dtype is not None else MlaDecode(cfg)
