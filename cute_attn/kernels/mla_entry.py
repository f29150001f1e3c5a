"""The jit entries of the MLA families: an ``mla_decode`` spec builds ``kernels/mla_decode.py``,
or ``kernels/mla_decode_fp8.py`` for an fp8 ``kv_dtype``; an ``mla_decode_sm90`` spec
``kernels/mla_decode_sm90.py``, or with ``seesaw`` ``kernels/mla_decode_seesaw.py``."""

from __future__ import annotations

from .mla_decode import MlaConfig, MlaDecode
from .mla_decode_fp8 import MlaDecodeFp8
from .mla_decode_seesaw import MlaDecodeSeesaw
from .mla_decode_sm90 import MlaDecodeSm90, MlaSm90Config


def build_mla_decode(spec):
    cfg = MlaConfig.from_spec(spec.pdict)
    return MlaDecodeFp8(cfg) if cfg.kv_dtype is not None else MlaDecode(cfg)


def build_mla_decode_sm90(spec):
    cfg = MlaSm90Config.from_spec(spec.pdict)
    return MlaDecodeSeesaw(cfg) if cfg.seesaw else MlaDecodeSm90(cfg)
