"""Named sets of specializations for ``python -m cute_attn compile --preset NAME``.

``default`` is what the backends ship (``families.backends.shipped_specs``: the public ops at
the common head dims and FlashInfer's plain / soft-cap / window options) plus, on Hopper, the
decode variants the variant tests and bench load; ``all`` adds every test matrix
(``cute_attn.testing.matrices``): what the GPU tests and ``python -m cute_attn bench`` load, so
what a GPU machine without the DSL needs for them.  ``ci`` is the part of ``default`` that CI
compiles (``covering``).  ``smoke`` is a tiny set for quick checks.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Dict, List

from .abi.archs import HOPPER
from .families import backends, decode, merge, prefill
from .families.spec import Spec


def _default(arch: str) -> List[Spec]:
    from .testing.matrices import variant_decode_specs

    specs = backends.shipped_specs(arch)
    if arch == HOPPER:  # the decode variants (what the variant tests and bench need) on Hopper
        specs += variant_decode_specs(arch)
    return list(dict.fromkeys(specs))


def _variants(arch: str) -> List[Spec]:
    """Everything tests/test_variants_gpu.py, tests/test_prefill_variants_gpu.py and the
    ``variants`` bench run: the decode variant specs and the decode bench's plain rows (both
    arches, with the merge), and on sm_90a the prefill variant specs (tile 128; the plain specs
    of the same shapes included), the prefill bench's plain / soft-cap / window rows, the
    prefill merge for tile 128, the RoPE passes over an fp8 cache of
    tests/test_fp8_prefill.py, the head-dim-96 prefill of tests/test_prefill_head_dims.py and the
    portable prefill's test grid."""
    from .testing.matrices import (
        fp8_prefill_test_specs,
        head_dim_test_specs,
        portable_prefill_test_specs,
        variant_decode_specs,
        variant_prefill_specs,
    )

    specs = (
        variant_decode_specs(arch)
        + decode.shipped_specs(arch, dtype_names=("bf16",), head_dims=(128,))
        + [merge.merge_partials_spec(arch, "f16", 64, decode.TILE_Q)]
    )
    specs += variant_prefill_specs(arch) + prefill.merge_specs(arch, tiles=(128,)) + fp8_prefill_test_specs(arch)
    specs += head_dim_test_specs(arch)
    specs += portable_prefill_test_specs(arch)
    specs += prefill.prefill_specs(
        arch,
        dtype_names=("bf16",),
        head_dims=(128,),
        tiles=(128,),
        paged=(False,),
        variants=((False, False), (True, False), (False, True)),
    )
    return list(dict.fromkeys(specs))


def _portable(arch: str) -> List[Spec]:
    from .testing.matrices import portable_prefill_test_specs

    return portable_prefill_test_specs(arch)


def _all(arch: str) -> List[Spec]:
    """``default`` and ``variants``: everything the GPU tests and ``python -m cute_attn bench``
    load (what a GPU machine without the DSL needs)."""
    return list(dict.fromkeys(_default(arch) + _variants(arch)))


# Parameters that select a mode of one kernel geometry (the traced variant, masks, the 16-bit
# dtype) rather than the geometry itself (head dim, tiles, stages, heads per item, cache dtype).
_MODE_KEYS = frozenset({"variant", "variant_fp", "causal", "soft_cap", "window", "dtype"})


def covering(specs: List[Spec]) -> List[Spec]:
    """A subset of ``specs`` that holds every kernel geometry of each family (the parameters
    but ``_MODE_KEYS``) and every pair of parameter values that occurs together in ``specs``.

    Compiling all of ``default`` takes most of an hour on a 2-core CI machine, and most of its
    specs differ from another only in a mode: registers, shared memory and the instructions
    used are set by the geometry, and a mode's code meets every geometry value it ships with.
    The whole preset is still compiled by every shipped cache (``scripts/compile_aot.sh``),
    which fails on any spec; ``CUTE_ATTN_COMPILE_TEST_PRESET=default`` makes the compile test
    take all of it.  Greedy (the spec that covers most of what is left), so deterministic.
    """

    def covers(s: Spec) -> set:
        items = sorted(s.params)
        geometry = (s.family, "geometry") + tuple(kv for kv in items if kv[0] not in _MODE_KEYS)
        return {geometry} | {(s.family, a) for a in items} | {(s.family, a, b) for a, b in combinations(items, 2)}

    specs = list(dict.fromkeys(specs))
    sets = {s: covers(s) for s in specs}
    need = set().union(*sets.values()) if sets else set()
    chosen = []
    while need:
        best = max(specs, key=lambda s: len(sets[s] & need))
        chosen.append(best)
        need -= sets[best]
    return chosen


def _backend(op: str) -> Callable[[str], List[Spec]]:
    def specs(arch: str) -> List[Spec]:
        return [s for b in backends.BACKENDS if b.op in op.split("+") and arch in b.archs for s in b.shipped(arch)]

    return specs


PRESETS: Dict[str, Callable[[str], List[Spec]]] = {
    "default": _default,
    "ci": lambda arch: covering(_default(arch)),
    "all": _all,
    "decode": _backend("decode"),
    "prefill": _backend("prefill+kv_pass"),
    # what the portable prefill's GPU tests, compile test and bench load (its shipped specs: default)
    "prefill_mma": lambda arch: _portable(arch),
    "mla": _backend("mla_decode"),
    "variants": _variants,
    "smoke": lambda arch: merge.shipped_specs(arch, ("bf16",), (128,)),
    # tuning sweep for `python -m cute_attn bench --only merge_sweep`
    "merge_sweep": lambda arch: [merge.merge_states_spec(arch, "bf16", 128, b) for b in (1, 2, 4, 8)],
}


def preset_specs(name: str, arch: str) -> List[Spec]:
    try:
        return PRESETS[name](arch)
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
