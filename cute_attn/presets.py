"""Named sets of specializations for ``python -m cute_attn compile --preset NAME``.

``default`` is what a GPU machine needs for the shipped ops at the common head dims; later
kernel families add themselves here.  ``smoke`` is a tiny set for quick checks.
"""

from __future__ import annotations

import importlib.util
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


def _prefill(arch: str) -> List[Spec]:
    """Batch prefill, sm_90a only (the kernel is built on wgmma; for sm_100a the family is
    skipped: there is no Blackwell prefill kernel yet).  Per dtype f16/bf16 x head_dim
    64/128/256 x tile_q 64/128 x ragged/paged x causal: the plain kernel (48); soft-cap,
    window and both at bf16/f16, head_dim 128, tile 128, ragged, causal or not: what the GPU
    tests and the variant benchmark run (12); merge_partials for the prefill tiles (12); the
    KV pass's gather of a paged cache per dtype x head_dim (6)."""
    from .prefill import kv_pass_specs, prefill_merge_specs, prefill_specs

    variants = prefill_specs(
        arch, head_dims=(128,), tiles=(128,), paged=(False,), variants=((True, False), (False, True), (True, True))
    )
    return prefill_specs(arch) + variants + prefill_merge_specs(arch) + kv_pass_specs(arch)


def _prefill_kernel_present() -> bool:
    # CI compiles `default` (tests/test_compile.py): until kernels/prefill_sm90.py exists its
    # builder cannot be imported, so `default` lists the prefill specs only once it does.
    return importlib.util.find_spec("cute_attn.kernels.prefill_sm90") is not None


def _variants(arch: str) -> List[Spec]:
    """Everything tests/test_variants_gpu.py, tests/test_prefill_variants_gpu.py and the
    ``variants`` bench run: the decode variant specs and the decode bench's plain rows (both
    arches, with the merge), and on sm_90a the prefill variant specs (tile 128; the plain specs
    of the same shapes included), the prefill bench's plain / soft-cap / window rows and the
    prefill merge for tile 128."""
    from .decode import decode_specs, variant_decode_specs

    # the decode bench's plain / soft-cap / window rows (bf16 d128) and the merges
    specs = (
        variant_decode_specs(arch)
        + decode_specs(arch, dtypes=("bf16",), head_dims=(128,))
        + [s for s in decode_specs(arch, dtypes=("f16",), head_dims=(64,)) if s.family == "merge_partials"]
    )
    if _prefill_kernel_present():
        from .prefill import prefill_merge_specs, prefill_specs, variant_prefill_specs

        # + the prefill bench's plain / soft-cap / window rows (bf16 d128 ragged tile 128)
        specs += (
            variant_prefill_specs(arch)
            + prefill_merge_specs(arch, tiles=(128,))
            + prefill_specs(
                arch,
                dtypes=("bf16",),
                head_dims=(128,),
                tiles=(128,),
                paged=(False,),
                variants=((False, False), (True, False), (False, True)),
            )
        )
    return list(dict.fromkeys(specs))


def _default(arch: str) -> List[Spec]:
    specs = _merge(arch, _VALUE_DTYPES, _HEAD_DIMS) + _decode(arch)
    if arch == "sm_90a":  # the decode variants (what the variant tests and bench need) on Hopper
        from .decode import variant_decode_specs

        specs += variant_decode_specs(arch)
    return specs + _prefill(arch) if _prefill_kernel_present() else specs


def _all(arch: str) -> List[Spec]:
    """``default`` and ``variants``: everything the GPU tests and ``python -m cute_attn bench``
    load (what a GPU machine without the DSL needs)."""
    return list(dict.fromkeys(_default(arch) + _variants(arch)))


PRESETS: Dict[str, callable] = {
    "default": _default,
    "all": _all,
    "decode": _decode,
    "prefill": _prefill,
    "variants": _variants,
    "smoke": lambda arch: _merge(arch, ("bf16",), (128,)),
    # tuning sweep for `python -m cute_attn bench --only merge_sweep`
    "merge_sweep": lambda arch: [
        Spec.make("merge_states", arch, dtype="bf16", head_dim=128, load_batch=b) for b in (1, 2, 4, 8)
    ],
}


def preset_specs(name: str, arch: str) -> List[Spec]:
    try:
        return PRESETS[name](arch)
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
