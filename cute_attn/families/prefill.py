"""The Hopper batch prefill family (``kernels/prefill_sm90.py``: wgmma, TMA, one persistent CTA
per SM; sm_90a only): its ABI, the instructions its binary must hold, its specializations.

Spec parameters: ``dtype``, ``head_dim`` (of q and k), ``head_dim_vo`` (of v and the output;
absent when it equals ``head_dim``, so the symmetric specs keep their parameters), ``tile_q``
(64 or 128 packed rows: one or two consumer warpgroups), ``paged``, the static flags
``causal`` / ``soft_cap`` / ``window`` (the kernel's fast paths), ``page_box`` (paged K/V by
TMA boxes of 16 rows, for page sizes k*16), ``keys_transformed`` (K already rotated by the KV
pass) and the traced variant."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import HOPPER
from ..abi.args import ScalarArg, TensorArg
from ..variants import base as vbase
from .base import KernelFamily, cache_arg, i32_arg, register, spec_variant, variant_params
from .decode import decode_abi_fixed
from .spec import Spec

ARCH = HOPPER
HEAD_DIMS = (64, 80, 96, 128, 256)  # head_dim_qk = head_dim_vo
SHIPPED_HEAD_DIMS = (64, 128, 256)  # the default grid (80, 96: the test matrix and model sets)
# (head_dim_qk, head_dim_vo) pairs besides the equal ones: DeepSeek-V3/R1's prefill (MLA in its
# non-absorbed form: q/k 128 nope + 64 rope dims, v 128)
HEAD_DIM_PAIRS = ((192, 128),)
KV8_HEAD_DIMS = (128,)  # an fp8 cache widened in the kernel (kernels/prefill_sm90_kv8.py says why only 128)
TILES = (64, 128)  # packed query rows per work item: one or two consumer warpgroups
FIXED_SPLIT_TILE = 128  # fixed_split_size: a tile that does not depend on the batch
PAGE_BOX = 16  # paged K/V by TMA, one box per 16 rows of a page (page sizes k*16)


def head_dim_vo(p) -> int:
    """The v / output head dim of a spec's parameters."""
    return p.get("head_dim_vo", p["head_dim"])


def prefill_abi_fixed(p):
    """decode's fixed tensor arguments (one host signature for both kernels; V, O and the
    partial rows at ``head_dim_vo``), then the prefill kernel's scalars (spelled out: decode's
    scalars differ).  ``kv8_pass``: K and V are the 16-bit copy the kernel writes."""
    if p.get("kv8_pass"):
        p = {k: v for k, v in p.items() if k != "kv_dtype"}
    qk = [a for a in decode_abi_fixed(p) if isinstance(a, TensorArg)]
    vo = [a for a in decode_abi_fixed(dict(p, head_dim=head_dim_vo(p))) if isinstance(a, TensorArg)]
    return [b if a.name in ("mV", "mO", "mPartO") else a for a, b in zip(qk, vo)] + [
        ScalarArg("group", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("soft_cap", "f32"),
        ScalarArg("window_left", "i32"),
        ScalarArg("num_ctas", "i32"),
    ]


KV8_PASS_RAGGED, KV8_PASS_PAGED = 1, 2  # spec ``kv8_pass``: the fp8 cache the kernel's pass reads


def prefill_extra_abi(p):
    """The tensors ahead of the variant's: with ``kv8_pass`` the fp8 cache the kernel reads, the
    pass's state (zeroed before each launch) and plan (``kernels/prefill_sm90_kv8_pass.py``),
    and for a paged cache its page table (page indptr, page ids)."""
    if not p.get("kv8_pass"):
        return []
    fp8 = [cache_arg(n, p, p["kv_dtype"]) for n in ("mK8", "mV8")]
    pages = [i32_arg("mPassPageIndptr"), i32_arg("mPassPageIds")] if p["kv8_pass"] == KV8_PASS_PAGED else []
    return fp8 + [i32_arg("mPassState"), i32_arg("mPassPlan")] + pages


def prefill_abi(p):
    """The fixed arguments, the extra tensors, then the variant's (``variants.base.abi_args``:
    tensors, then scalars)."""
    return prefill_abi_fixed(p) + prefill_extra_abi(p) + vbase.abi_args(spec_variant(p))


def _sm90_known_gaps(p) -> dict:
    """The prefill kernel's specializations known to miss a promised instruction, with why: each
    an open performance gap (the kernel is correct), found by compiling every preset (``python -m
    cute_attn compile`` fails on any other)."""
    plain = len(p) == 7 + ("page_box" in p)  # no variant, fp8 cache or other extra parameter
    tma = not p["paged"] or bool(p.get("page_box"))  # K / V by TMA, not the cp.async gather
    shape = (p["head_dim"], p["tile_q"], p["causal"], p["dtype"])
    gaps = {}
    if plain and tma and shape == (64, 64, True, "bf16"):
        gaps["uniform descriptors (SASS)"] = (
            "hd64, 64-row tiles, causal bf16, K / V by TMA (ragged or page boxes): ptxas rebuilds the "
            "P V wgmmas' V descriptors per wgmma (R2UR); open"
        )
    if plain and not tma and (p["head_dim"], p["tile_q"], p["dtype"]) == (80, 128, "bf16"):
        gaps["wgmma async (SASS)"] = (
            "hd80, 128-row tiles, cp.async gather, bf16: at 128 keys ptxas serializes the wgmmas "
            "(registers; fp16 stays async); 112 keys compile async, as at hd96, not yet run; open"
        )
    if p.get("variant") == "FlashSigmoid" and shape == (64, 128, True, "f16"):
        gaps["uniform descriptors (SASS)"] = "hd64 FlashSigmoid, 128-row tiles, causal fp16: R2UR per P V wgmma; open"
    return gaps


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
                # the warpgroup's wgmma descriptors in uniform registers: computed per thread,
                # ptxas moves each into place (R2UR) before every wgmma of a batch (3-10 %)
                "uniform descriptors (SASS)": r"sass!(?s)WARPGROUP\.ARRIVE(?:(?!gsb0).)*?R2UR",
            }
        },
        known_gaps=_sm90_known_gaps,
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


def serves(head_dim: int, head_dim_vo: int) -> bool:
    """Whether the kernel serves q/k of ``head_dim`` with v/o of ``head_dim_vo``."""
    if head_dim == head_dim_vo:
        return head_dim in HEAD_DIMS
    return (head_dim, head_dim_vo) in HEAD_DIM_PAIRS


def kv8_serves(
    dtype: str, kv_dtype: str, head_dim: int, head_dim_vo: int, paged: bool, variant, page_box: int = 0
) -> bool:
    """Whether the kernel reads an fp8 cache itself (``kernels/prefill_sm90_kv8.py``): f16 /
    bf16 queries, K / V by TMA (ragged, or paged in page boxes: page sizes k*16) at head dim 128,
    no key transform (that takes the KV pass, which then dequantizes as well).  Other fp8
    prefills take the pass."""
    return (
        dtype in dtypes.ATTENTION
        and kv_dtype in dtypes.FP8
        and head_dim == head_dim_vo
        and head_dim in KV8_HEAD_DIMS
        and (not paged or bool(page_box))
        and not (variant is not None and vbase.Hooks(variant).has_transform_k)
    )


KV8_PASS_BLOCK = 128  # keys per task of the pass inside the kernel: the kv8_pass kernel's block


def kv8_pass_serves(dtype: str, kv_dtype: str, head_dim: int, head_dim_vo: int, tile_q: int) -> bool:
    """Whether the kernel can run an fp8 cache's pass itself (``kv8_pass``, ragged or paged: it
    reads the 16-bit copy as a ragged cache either way): the widening kernel's cases
    (:func:`kv8_serves`, ragged, no variant) at 128-row tiles (items back to back: the staging
    tiles live in the output's)."""
    return tile_q == 128 and kv8_serves(dtype, kv_dtype, head_dim, head_dim_vo, False, None)


def regular_gather(head_dim: int) -> bool:
    """Whether rows of ``head_dim`` suit the producer's and consumers' per-thread 16-byte chunk
    pairs (the key / query transforms: RoPE): 128-byte swizzle atoms and a chunk count that
    divides a warpgroup.  Other head dims serve no ``transform_k`` / ``transform_q``."""
    return head_dim % 64 == 0 and 128 % (head_dim // 8) == 0


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
    head_dim_vo: int | None = None,
    kv_dtype: str | None = None,
    kv8_pass: int = 0,
) -> Spec:
    """One ``batch_prefill_sm90`` specialization; ``variant``: the traced variant beyond the
    static flags, None for the plain kernel; ``page_box``: see :func:`page_box_for` (a
    parameter only when set); ``head_dim_vo``: v / output's head dim (a parameter only when it
    differs from ``head_dim``); ``kv_dtype``: an fp8 cache the kernel widens itself (a parameter
    only when set: :func:`kv8_serves`); ``kv8_pass``: the kernel dequantizes that cache itself
    (:data:`KV8_PASS_RAGGED`, or True, for a ragged cache, :data:`KV8_PASS_PAGED` for a paged
    one: the kernel itself still reads the ragged 16-bit copy, ``paged`` False);
    ``keys_transformed`` follows from the rest."""
    extra = variant_params(variant) if variant is not None else {}
    if kv_dtype is not None and kv_dtype != dtype:
        dv = head_dim if head_dim_vo is None else head_dim_vo
        if not kv8_serves(dtype, kv_dtype, head_dim, dv, paged, variant, page_box):
            raise ValueError(
                f"batch_prefill_sm90: a {kv_dtype} cache with {dtype} queries at head dims {head_dim} / {dv} "
                f"(paged={paged}, variant={variant!r}) is read through the KV pass, not by the kernel"
            )
        extra["kv_dtype"] = kv_dtype
        if kv8_pass:
            if paged or tile_q != 128 or variant is not None:
                raise ValueError("batch_prefill_sm90: kv8_pass is built for ragged 128-row kernels, no traced variant")
            if int(kv8_pass) not in (KV8_PASS_RAGGED, KV8_PASS_PAGED):
                raise ValueError(f"batch_prefill_sm90: kv8_pass={kv8_pass!r} (1: a ragged fp8 cache, 2: a paged one)")
            extra["kv8_pass"] = int(kv8_pass)
    if head_dim_vo is not None and head_dim_vo != head_dim:
        extra["head_dim_vo"] = int(head_dim_vo)
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
    kv_names=(None,),
) -> list:
    """Specializations over a grid; ``head_dims``: ints (q/k = v/o) or (qk, vo) pairs;
    ``variants``: the (soft_cap, window) pairs; ``page_boxes``: the paged kernels (TMA per
    16-row page box for page sizes k*16, the cp.async gather for the others); ``kv_names``:
    the cache dtypes (None: the query's; an fp8 one only where the kernel widens it,
    :func:`kv8_serves`).  Empty for any arch but sm_90a."""
    if arch != ARCH:
        return []
    pairs = [d if isinstance(d, tuple) else (d, d) for d in head_dims]
    return [
        prefill_spec(arch, dt, d, t, p, c, cap, win, page_box=pb, head_dim_vo=dv, kv_dtype=kv)
        for dt in dtype_names
        for d, dv in pairs
        for t in tiles
        for p in paged
        for c in causal
        for cap, win in variants
        for pb in (page_boxes if p else (0,))
        for kv in kv_names
        if kv is None or kv8_serves(dt, kv, d, dv, p, None, pb)
    ]


def merge_specs(arch: str, dtype_names=dtypes.ATTENTION, head_dims=SHIPPED_HEAD_DIMS, tiles=TILES) -> list:
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
    """Per dtype x head dim (64 / 128 / 256) x tile x ragged/paged (both page paths) x causal:
    the plain kernel; soft-cap, window and both at head dim 128, tile 128, ragged; the
    DeepSeek-style prefill (192 / 128, bf16) over the same grid; an fp8 cache (e4m3 / e5m2)
    widened in the kernel at head dim 128, ragged and in page boxes, both tiles, and with the
    flags at tile 128, and dequantized by the kernel's own pass (``kv8_pass``, ragged and paged
    caches); the merges of the tiles."""
    flags = ((True, False), (False, True), (True, True))
    extra = prefill_specs(arch, head_dims=(128,), tiles=(128,), paged=(False,), variants=flags)
    deepseek = prefill_specs(arch, dtype_names=("bf16",), head_dims=HEAD_DIM_PAIRS)
    kv8 = prefill_specs(arch, head_dims=KV8_HEAD_DIMS, page_boxes=(PAGE_BOX,), kv_names=dtypes.FP8)
    kv8 += prefill_specs(
        arch, head_dims=KV8_HEAD_DIMS, tiles=(128,), variants=flags, page_boxes=(PAGE_BOX,), kv_names=dtypes.FP8
    )
    kv8 += [  # the fp8 pass inside the kernel (128-row tiles; the flags: forward()'s overrides)
        prefill_spec(arch, dt, d, 128, False, c, cap, win, kv_dtype=kv, kv8_pass=src)
        for src in (KV8_PASS_RAGGED, KV8_PASS_PAGED)
        for dt in dtypes.ATTENTION
        for d in KV8_HEAD_DIMS
        for kv in dtypes.FP8
        for c in (False, True)
        for cap, win in ((False, False),) + flags
    ]
    return prefill_specs(arch, head_dims=SHIPPED_HEAD_DIMS) + extra + deepseek + kv8 + merge_specs(arch)
