"""Named sets of specializations for ``python -m cute_attn compile --preset NAME``.

``default`` is what a GPU machine needs for the shipped ops at the common head dims; later
kernel families add themselves here.  ``smoke`` is a tiny set for quick checks.
"""
from __future__ import annotations

from itertools import product
from typing import Dict, Iterable, List

from .merge import LOAD_BATCH
from .runtime.spec import Spec

_VALUE_DTYPES = ("f16", "bf16", "f32")
_HEAD_DIMS = (64, 128, 256)


def _merge(arch: str, dtypes: Iterable[str], head_dims: Iterable[int]) -> List[Spec]:
    specs = []
    for dt, d in product(dtypes, head_dims):
        specs.append(Spec.make("merge_states", arch, dtype=dt, head_dim=d, load_batch=LOAD_BATCH))
        for masked in (False, True):
            specs.append(Spec.make("merge_pair", arch, dtype=dt, head_dim=d, masked=masked))
    return specs


def _decode(arch: str) -> List[Spec]:
    from .decode import decode_specs

    return decode_specs(arch)


PRESETS: Dict[str, callable] = {
    "default": lambda arch: _merge(arch, _VALUE_DTYPES, _HEAD_DIMS) + _decode(arch),
    "decode": _decode,
    "smoke": lambda arch: _merge(arch, ("bf16",), (128,)),
    # tuning sweep for `python -m cute_attn bench --only merge_sweep`
    "merge_sweep": lambda arch: [Spec.make("merge_states", arch, dtype="bf16", head_dim=128, load_batch=b)
                                 for b in (1, 2, 4, 8)],
}


def preset_specs(name: str, arch: str) -> List[Spec]:
    try:
        return PRESETS[name](arch)
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
