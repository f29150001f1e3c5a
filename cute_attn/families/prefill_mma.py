"""The portable batch prefill family (``kernels/prefill_mma.py``: ``mma.sync`` + ``cp.async``,
every arch; the prefill of Blackwell, and of Hopper where it beats the wgmma kernel): its ABI
(the Hopper prefill's, so both kernels take the same launch), the instructions its binary must
hold, its specializations.

Spec parameters: ``dtype``, ``head_dim``, ``tile_q`` (16, 32 or 64 packed rows: 1 x 4, 2 x 2
or 4 x 1 warps by rows x keys), ``paged`` (the cache's pages gathered in-kernel, any page
size; else ragged KV), the static flags ``causal`` / ``soft_cap`` / ``window``,
the knobs ``stages`` / ``warps_m`` (absent for the kernel's defaults) and the traced variant
(an in-kernel key transform, RoPE, with 16-row tiles only)."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import ARCHS
from .base import KernelFamily, register, variant_params
from .prefill import prefill_abi
from .spec import Spec

# decode's geometry (kernels/decode.py): 128- or 64-byte swizzle atoms (96: three 64-byte atom columns)
HEAD_DIMS = (64, 96, 128, 256)
SHIPPED_HEAD_DIMS = (64, 128, 256)  # the default grid (96: the test matrix and model sets, as the wgmma kernel's)

TILES = (16, 32, 64)  # packed query rows per work item
CTAS_PER_SM = {64: 2, 96: 2, 128: 2, 256: 1}  # what shared memory allows (kernels/prefill_mma.py STAGES)

BATCH_PREFILL_MMA = register(
    KernelFamily(
        name="batch_prefill_mma",
        builder="cute_attn.kernels.prefill_mma:build_batch_prefill_mma",
        abi=prefill_abi,
        expect={
            a: {
                "mma.sync m16n8k16 (PTX)": r"ptx:mma\.sync\.aligned\.m16n8k16",
                "cp.async (PTX)": r"ptx:cp\.async\.c[ag]\.shared",
                "HMMA.16816 (SASS)": r"sass:HMMA\.16816",
                "LDGSTS (SASS)": r"sass:LDGSTS",
                "ldmatrix (SASS)": r"sass:LDSM",
                # lets the split-KV merge (a programmatic dependent launch) start early
                "griddepcontrol.launch_dependents (PTX)": r"ptx:griddepcontrol\.launch_dependents",
            }
            for a in ARCHS
        },
    )
)


def prefill_mma_spec(
    arch: str,
    dtype: str,
    head_dim: int,
    tile_q: int,
    paged: bool,
    causal: bool = False,
    soft_cap: bool = False,
    window: bool = False,
    variant=None,
    **knobs,
) -> Spec:
    """One ``batch_prefill_mma`` specialization; ``variant``: the traced variant beyond the
    static flags (None: the plain kernel); ``knobs``: ``stages`` / ``warps_m`` (absent: the
    kernel's defaults)."""
    extra = variant_params(variant) if variant is not None else {}
    extra.update({k: int(v) for k, v in knobs.items() if v})
    return Spec.make(
        "batch_prefill_mma",
        arch,
        dtype=dtype,
        head_dim=head_dim,
        tile_q=tile_q,
        paged=bool(paged),
        causal=bool(causal),
        soft_cap=bool(soft_cap),
        window=bool(window),
        **extra,
    )


def prefill_mma_specs(
    arch: str,
    dtype_names=dtypes.ATTENTION,
    head_dims=HEAD_DIMS,
    tiles=TILES,
    paged=(False, True),
    causal=(False, True),
    variants=((False, False),),
) -> list:
    """Specializations over a grid; ``variants``: the (soft_cap, window) pairs."""
    return [
        prefill_mma_spec(arch, dt, d, t, p, c, cap, win)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
        for p in paged
        for c in causal
        for cap, win in variants
    ]


def merge_specs(arch: str, dtype_names=dtypes.ATTENTION, head_dims=HEAD_DIMS, tiles=TILES) -> list:
    """The ``merge_partials`` specializations of the tiles."""
    return [
        Spec.make("merge_partials", arch, dtype=dt, head_dim=d, tile_q=t)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
    ]


def shipped_specs(arch: str, tiles=TILES, paged=(False, True)) -> list:
    """Per dtype x shipped head dim x tile x ragged/paged x causal: the plain kernel; soft-cap,
    window and both at head dim 128; the merges of the tiles.  ``tiles`` / ``paged``: what the arch's
    plans use (``families.backends``)."""
    if not tiles:
        return []
    flags = ((True, False), (False, True), (True, True))
    extra = prefill_mma_specs(arch, head_dims=(128,), tiles=tiles, paged=paged, variants=flags)
    main = prefill_mma_specs(arch, head_dims=SHIPPED_HEAD_DIMS, tiles=tiles, paged=paged)
    return main + extra + merge_specs(arch, head_dims=SHIPPED_HEAD_DIMS, tiles=tiles)
