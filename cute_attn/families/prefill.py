"""The Hopper batch prefill family (``kernels/prefill_sm90.py``: wgmma, TMA, one persistent CTA
per SM; sm_90a only): its ABI, the instructions its binary must hold, its specializations.

Spec parameters: ``dtype``, ``head_dim``, ``tile_q`` (64 or 128 packed rows: one or two
consumer warpgroups), ``paged``, the static flags ``causal`` / ``soft_cap`` / ``window`` (the
kernel's fast paths), ``page_box`` (paged K/V by TMA boxes of 16 rows, for page sizes k*16),
``keys_transformed`` (K already rotated by the KV pass) and the traced variant."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import HOPPER
from ..abi.args import ScalarArg, TensorArg
from ..variants import base as vbase
from .base import KernelFamily, register, spec_variant, variant_params
from .decode import decode_abi_fixed
from .spec import Spec

ARCH = HOPPER
HEAD_DIMS = (64, 128, 256)
TILES = (64, 128)  # packed query rows per work item: one or two consumer warpgroups
FIXED_SPLIT_TILE = 128  # fixed_split_size: a tile that does not depend on the batch
PAGE_BOX = 16  # paged K/V by TMA, one box per 16 rows of a page (page sizes k*16)


def prefill_abi_fixed(p):
    """decode's fixed tensor arguments (one host signature for both kernels), then the prefill
    kernel's scalars (spelled out: decode's scalars differ)."""
    return [a for a in decode_abi_fixed(p) if isinstance(a, TensorArg)] + [
        ScalarArg("group", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("soft_cap", "f32"),
        ScalarArg("window_left", "i32"),
        ScalarArg("num_ctas", "i32"),
    ]


def prefill_abi(p):
    """The fixed arguments, then the variant's (``variants.base.abi_args``: tensors, then scalars)."""
    return prefill_abi_fixed(p) + vbase.abi_args(spec_variant(p))


BATCH_PREFILL_SM90 = register(
    KernelFamily(
        name="batch_prefill_sm90",
        builder="cute_attn.kernels.prefill_sm90:build_batch_prefill_sm90",
        abi=prefill_abi,
        expect={
            ARCH: {
                "wgmma (PTX)": r"ptx:wgmma\.mma_async",
                "HGMMA (SASS)": r"sass:HGMMA\.64x",
                "setmaxnreg (PTX)": r"ptx:setmaxnreg",
                # ptxas silently serializes every wgmma when registers run short (C7512):
                # then each HGMMA gets its own WARPGROUP.ARRIVE
                "wgmma async (SASS)": r"sass%HGMMA/WARPGROUP\.ARRIVE>=3",
            }
        },
    )
)


def page_box_for(paged: bool, page_size: int) -> int:
    """The kernel's ``page_box`` spec parameter: PAGE_BOX for a paged cache whose page size is a
    multiple of it (K/V by TMA), 0 otherwise (the cp.async gather; ragged KV: not paged)."""
    return PAGE_BOX if paged and page_size % PAGE_BOX == 0 else 0


def keys_pretransformed(paged: bool, variant) -> bool:
    """Whether the KV pass (``kernels/kv_pass.py``) applies the variant's ``transform_k`` before
    a prefill kernel that reads ``paged`` KV (spec ``keys_transformed``: the kernel reads K by
    TMA and leaves it alone): ragged KV, which includes a paged cache the pass gathered first.
    A kernel that reads the paged cache itself transforms each K block its producer gathers."""
    return not paged and variant is not None and vbase.Hooks(variant).has_transform_k


def prefill_spec(
    arch: str,
    dtype: str,
    head_dim: int,
    tile_q: int,
    paged: bool,
    causal: bool = False,
    soft_cap: bool = False,
    window: bool = False,
    variant=None,
    page_box: int = 0,
) -> Spec:
    """One ``batch_prefill_sm90`` specialization; ``variant``: the traced variant beyond the
    static flags, None for the plain kernel; ``page_box``: see :func:`page_box_for` (a
    parameter only when set); ``keys_transformed`` follows from the rest."""
    extra = variant_params(variant) if variant is not None else {}
    if paged and page_box:
        extra["page_box"] = int(page_box)
    if keys_pretransformed(paged, variant):
        extra["keys_transformed"] = True
    return Spec.make(
        "batch_prefill_sm90",
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


def prefill_specs(
    arch: str,
    dtype_names=dtypes.ATTENTION,
    head_dims=HEAD_DIMS,
    tiles=TILES,
    paged=(False, True),
    causal=(False, True),
    variants=((False, False),),
    page_boxes=(PAGE_BOX, 0),
) -> list:
    """Specializations over a grid; ``variants``: the (soft_cap, window) pairs; ``page_boxes``:
    the paged kernels (TMA per 16-row page box for page sizes k*16, the cp.async gather for the
    others).  Empty for any arch but sm_90a."""
    if arch != ARCH:
        return []
    return [
        prefill_spec(arch, dt, d, t, p, c, cap, win, page_box=pb)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
        for p in paged
        for c in causal
        for cap, win in variants
        for pb in (page_boxes if p else (0,))
    ]


def merge_specs(arch: str, dtype_names=dtypes.ATTENTION, head_dims=HEAD_DIMS, tiles=TILES) -> list:
    """The ``merge_partials`` specializations for the prefill tiles."""
    if arch != ARCH:
        return []
    return [
        Spec.make("merge_partials", arch, dtype=dt, head_dim=d, tile_q=t)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
    ]


def shipped_specs(arch: str) -> list:
    """Per dtype x head dim x tile x ragged/paged (both page paths) x causal: the plain kernel;
    soft-cap, window and both at head dim 128, tile 128, ragged; the merges of the tiles."""
    flags = ((True, False), (False, True), (True, True))
    extra = prefill_specs(arch, head_dims=(128,), tiles=(128,), paged=(False,), variants=flags)
    return prefill_specs(arch) + extra + merge_specs(arch)
