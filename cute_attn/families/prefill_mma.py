"""The portable batch prefill family (``kernels/prefill_mma.py``: ``mma.sync`` + ``cp.async``,
every arch; the prefill of Blackwell, and of Hopper where it beats the wgmma kernel): its ABI
(the Hopper prefill's, so both kernels take the same launch), the instructions its binary must
hold, its specializations.

Spec parameters: ``dtype``, ``head_dim``, ``tile_q`` (16, 32, 64 or 128 packed rows: 1 x 4,
2 x 2, 4 x 1 or 4 x 1 warps of 32 rows, by rows x keys; 128 at head dims 64 / 128), ``paged``
(the cache's pages gathered in-kernel, any page size; else ragged KV), the static flags
``causal`` / ``soft_cap`` / ``window``, the knobs ``stages`` / ``warps_m`` / ``groups`` /
``pingpong`` / ``defer`` (absent for the kernel's defaults; ``groups=2, pingpong=1``: two 4-warp
groups per CTA taking turns at the tensor pipe, ``kernels/prefill_mma_turns.py``; ``defer=1``:
the same block order in one group) and the traced variant (an
in-kernel key transform, RoPE, with 16-row tiles only; no Q transform on the 128-row tile)."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import ARCHS
from .base import KernelFamily, register, variant_params
from .decode import WIDE_HEAD_DIMS
from .prefill import prefill_abi
from .spec import Spec

# decode's geometry (kernels/decode.py): 128-, 64- or 32-byte swizzle atoms (96: three 64-byte atom
# columns; 80: five 32-byte ones)
HEAD_DIMS = (64, 80, 96, 128, 256, 512)
SHIPPED_HEAD_DIMS = (64, 128, 256)  # the default grid (80, 96: the test matrix and model sets, as the wgmma kernel's)
# WIDE_HEAD_DIMS (decode's): served by kernels/decode_wide.py, 16- or 32-row tiles (one or two
# warp groups), no soft-cap / window / variant; its stages of 32 K + 32 V rows (64 KB) that fit
# shared memory beside Q and the score exchange
WIDE_TILES = (16, 32)
WIDE_STAGES = {16: 3, 32: 2}  # 216 / 176 KB

TILES = (16, 32, 64, 128)  # packed query rows per work item
# the 128-row tile's 32-row warps hold O of these head dims only (kernels/prefill_mma.py)
TILE128_HEAD_DIMS = (64, 128)
TILES_BY_HEAD_DIM = {d: (16, 32, 64) for d in HEAD_DIMS if d not in TILE128_HEAD_DIMS} | {
    d: WIDE_TILES for d in WIDE_HEAD_DIMS
}
Q_SMEM_TILES = (128,)  # tiles that read Q from shared memory per k16 step: no Q transform (RoPE)
CTAS_PER_SM = {64: 2, 80: 2, 96: 2, 128: 2, 256: 1, 512: 1}  # what shared memory allows (kernels/prefill_mma.py STAGES)

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
    static flags (None: the plain kernel); ``knobs``: ``stages`` / ``warps_m`` / ``groups`` /
    ``pingpong`` / ``defer`` (absent: the kernel's defaults)."""
    if head_dim in WIDE_HEAD_DIMS:
        if soft_cap or window or variant is not None:
            raise NotImplementedError(
                f"batch_prefill_mma: soft-cap, a window or a variant at head dim {head_dim} (kernels/decode_wide.py "
                "serves plain causal / non-causal attention)"
            )
        if tile_q not in WIDE_TILES:
            raise ValueError(f"batch_prefill_mma: tile_q {tile_q} at head dim {head_dim} (tiles {WIDE_TILES})")
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
    """Specializations over a grid; ``variants``: the (soft_cap, window) pairs (at head dim 512
    only its tiles and the plain kernel)."""
    return [
        prefill_mma_spec(arch, dt, d, t, p, c, cap, win)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
        if t in TILES_BY_HEAD_DIM.get(d, TILES)
        for p in paged
        for c in causal
        for cap, win in variants
        if d not in WIDE_HEAD_DIMS or not (cap or win)
    ]


def merge_specs(arch: str, dtype_names=dtypes.ATTENTION, head_dims=HEAD_DIMS, tiles=TILES) -> list:
    """The ``merge_partials`` specializations of the tiles."""
    return [
        Spec.make("merge_partials", arch, dtype=dt, head_dim=d, tile_q=t)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
        if t in TILES_BY_HEAD_DIM.get(d, TILES)
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


def wide_specs(arch: str) -> list:
    """Head dim 512 (every arch's only prefill there): both tiles, ragged and paged, causal or
    not, and their merges."""
    return prefill_mma_specs(arch, head_dims=WIDE_HEAD_DIMS, tiles=WIDE_TILES) + merge_specs(
        arch, head_dims=WIDE_HEAD_DIMS, tiles=WIDE_TILES
    )
