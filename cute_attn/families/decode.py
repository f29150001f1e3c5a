"""The paged decode family (``kernels/decode.py``, ``decode_fp8.py`` for an fp8 cache,
``decode_wide.py`` at head dim 512: ``mma.sync`` + ``cp.async``, both arches): its ABI, the
instructions its binary must hold, and the specializations that ship.

Spec parameters: ``dtype`` (query and output), ``kv_dtype`` (an fp8 cache, ``e4m3`` /
``e5m2``; absent for a cache of ``dtype``: ``kernels/decode_fp8.py``), ``head_dim``, ``stages``
(the KV pipeline depth, fixed by the head dim: an fp8 stage holds twice the tokens in the same
bytes), ``heads_per_item`` (head packing: kv heads per work item; absent for one),
``block_n`` (KV rows per stage of a 16-bit cache; absent for 64), ``tile_q`` (packed rows per
item: 32 for four kv heads of GQA 8, one per warp; absent for 16) and the variant (``variant`` /
``variant_fp``)."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import ARCHS
from ..abi.args import ScalarArg, TensorArg
from ..abi.records import WORK_FIELDS
from ..variants import base as vbase
from ..variants.builtins import SlidingWindow, SoftCap
from .base import KernelFamily, cache_arg, i32_arg, register, spec_variant, variant_params
from .spec import Spec

HEAD_DIMS = (64, 80, 96, 128, 256, 512)
# served by kernels/decode_wide.py (the MLA kernel's geometry: warps split the contraction and
# the output columns): a 16-bit cache, no variant, one kv head per 16-row item
WIDE_HEAD_DIMS = (512,)
# an fp8 cache's rows are head_dim bytes: 80 / 96 would leave 80- / 96-byte rows, which the fp8
# kernel's 64- / 128-byte swizzle atoms do not tile (such a cache decodes on the prefill path)
FP8_HEAD_DIMS = (64, 128, 256)
TILE_Q = 16  # packed rows per work item: the kernel's m16 MMA tile
PACKED_HEADS = (4, 2)  # kv heads per work item the kernel is built for, besides 1
# head dim 96 gathers a 192-byte row as 64-byte atom rows, 32 rows per pass of the 128 threads:
# a stage's 64 rows then hold at most two heads' 32 tokens (four would leave 16, fewer than a pass)
MAX_PACKED_HEADS = {96: 2, 512: 1}
STAGES = {64: 3, 80: 4, 96: 4, 128: 3, 256: 2, 512: 3}  # KV pipeline depth of a 16-bit cache's BLOCK_N-row stages
FP8_STAGES = {64: 4, 128: 3, 256: 2}  # of an fp8 cache's (64 rows of D 16-bit pairs: 16 KB at hd128)
# KV rows (tokens x packed heads) per stage, 16-bit caches.  Head dim 64: 128-row stages (32 KB,
# hd128's stage bytes) at 3 stages ran 0.5-5 % faster than 64-row ones at 4 on all four hd64
# batches of the H200 sweeps (scripts/decode_hd64_sweep.py: gpt-oss 64 x 4k 130.0 against 131.1
# us, 4.13 TB/s; the lognormal batches 118.5-119.6 against 124.4-126.1 us)
# head dim 512: 32 rows of K and of V per stage (64 KB; 3 stages + Q + scores: 216 KB)
BLOCK_N = {64: 128, 80: 64, 96: 64, 128: 64, 256: 64, 512: 32}
CTAS_PER_SM = {64: 2, 80: 2, 96: 2, 128: 2, 256: 1, 512: 1}  # what shared memory (and 248 registers/thread) allow
# the variants whose kernels ship for FlashInfer's plain / soft-cap / window options, packed
# and unpacked (so the wrapper's default packing rule packs only those)
SHIPPED_VARIANTS = (None, SoftCap(), SlidingWindow(), SoftCap() + SlidingWindow())


def decode_abi_fixed(p):
    d, dt = p["head_dim"], p["dtype"]
    row = lambda name: TensorArg(name, dt, (None, None, d), (None, None, 1), 8, 16)
    return [
        row("mQ"),
        cache_arg("mK", p, p.get("kv_dtype")),
        cache_arg("mV", p, p.get("kv_dtype")),
        i32_arg("mKvIndptr"),
        i32_arg("mKvIndices"),
        row("mO"),
        TensorArg("mLse", "f32", (None, None), (None, None), 1, 4),
        TensorArg("mWork", "i32", (None, WORK_FIELDS), (WORK_FIELDS, 1), 1, 4),
        i32_arg("mWorkIndptr"),
        TensorArg("mPartO", "f32", (None, d), (d, 1), 1, 16),
        TensorArg("mPartLse", "f32", (None,), (1,), 1, 4),
        ScalarArg("group", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("num_ctas", "i32"),
    ]


def decode_abi(p):
    """The family's arguments, then the variant's (``variants.base.abi_args``)."""
    return decode_abi_fixed(p) + vbase.abi_args(spec_variant(p))


PAGED_DECODE = register(
    KernelFamily(
        name="paged_decode",
        builder="cute_attn.kernels.decode_entry:build_paged_decode",
        abi=decode_abi,
        expect={
            a: {
                "mma.sync m16n8k16 (PTX)": r"ptx:mma\.sync\.aligned\.m16n8k16",
                "cp.async (PTX)": r"ptx:cp\.async\.c[ag]\.shared",
                "HMMA.16816 (SASS)": r"sass:HMMA\.16816",
                "LDGSTS (SASS)": r"sass:LDGSTS",
                # lets the merge kernel (a programmatic dependent launch) start early
                "griddepcontrol.launch_dependents (PTX)": r"ptx:griddepcontrol\.launch_dependents",
            }
            for a in ARCHS
        },
    )
)


def head_dims_for(fp8_cache: bool) -> tuple:
    """The head dims the kernel serves for a 16-bit or an fp8 cache."""
    return FP8_HEAD_DIMS if fp8_cache else HEAD_DIMS


def packing_params(heads_per_item: int) -> dict:
    """The spec parameter of head packing: absent for one kv head per item (the unpacked
    kernels' specs predate it, and their keys stay)."""
    return {"heads_per_item": heads_per_item} if heads_per_item != 1 else {}


def decode_tile(heads_per_item: int, group: int) -> int:
    """Packed rows per item of a plan with ``heads_per_item`` kv heads of GQA group ``group``:
    32 for four heads of GQA 8 (``tile_q``: one per warp), else 16 (one m16 tile; a token's
    rows beyond 16 -- GQA 32, MQA -- are the next items)."""
    return 2 * TILE_Q if heads_per_item * group > TILE_Q and heads_per_item > 1 else TILE_Q


def packed_ok(heads_per_item: int, group: int, head_dim: int = 0) -> bool:
    """Whether the kernel packs ``heads_per_item`` kv heads of GQA ``group`` (at ``head_dim``; 0:
    any): all rows in one 16-row tile, or four heads of 8 rows each, two per 16-row group
    (``tile_q`` 32); at most ``MAX_PACKED_HEADS`` of the head dim.  One kv head per item serves
    any group (a token's rows beyond 16 are the next items)."""
    if heads_per_item > MAX_PACKED_HEADS.get(head_dim, PACKED_HEADS[0]):
        return False
    return heads_per_item == 1 or heads_per_item * group <= TILE_Q or (heads_per_item == 4 and group == 8)


def kv_params(dtype: str, kv_dtype: str | None) -> dict:
    """The spec parameter of the cache dtype: absent for a cache of the query dtype."""
    if kv_dtype is None or kv_dtype == dtype:
        return {}
    if kv_dtype not in dtypes.FP8:
        raise ValueError(f"paged_decode: a {kv_dtype} cache with {dtype} queries (only fp8 caches may differ)")
    return {"kv_dtype": kv_dtype}


def decode_spec(
    arch: str,
    dtype: str,
    head_dim: int,
    variant=None,
    heads_per_item: int = 1,
    kv_dtype: str | None = None,
    tile_q: int = TILE_Q,
) -> Spec:
    """The ``paged_decode`` specialization for a query dtype (``"f16"``/``"bf16"``), head dim,
    variant, head packing (kv heads per work item; > 1 only for a variant with
    ``Hooks.packs_heads``), cache dtype (``kv_dtype``: None or ``dtype``, or fp8) and packed
    rows per item (``decode_tile``)."""
    kvp = kv_params(dtype, kv_dtype)
    if head_dim in WIDE_HEAD_DIMS and (vbase.components(variant) or kvp):
        what = "an fp8 cache" if kvp else f"the variant {variant!r}"
        raise NotImplementedError(
            f"paged_decode: {what} at head dim {head_dim} (kernels/decode_wide.py serves a 16-bit cache, no variant)"
        )
    if kvp and head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"paged_decode: an fp8 cache at head dim {head_dim} (fp8 head dims: {FP8_HEAD_DIMS})")
    if heads_per_item > MAX_PACKED_HEADS.get(head_dim, PACKED_HEADS[0]):
        raise ValueError(f"paged_decode: {heads_per_item} kv heads per item at head dim {head_dim}")
    extra = {}
    if not kvp and BLOCK_N[head_dim] != 64:
        extra["block_n"] = BLOCK_N[head_dim]
    if tile_q != TILE_Q:
        if kvp or tile_q != 2 * TILE_Q or heads_per_item != 4:
            raise ValueError(f"paged_decode: tile_q {tile_q} is for 4 kv heads per item of a 16-bit cache")
        extra["tile_q"] = tile_q
    return Spec.make(
        "paged_decode",
        arch,
        dtype=dtype,
        head_dim=head_dim,
        stages=(FP8_STAGES if kvp else STAGES)[head_dim],
        **kvp,
        **packing_params(heads_per_item),
        **extra,
        **variant_params(variant),
    )


def shipped_specs(arch: str, dtype_names=dtypes.ATTENTION, head_dims=HEAD_DIMS, kv_names=(None,) + dtypes.FP8) -> list:
    """What ``run()`` may need for FlashInfer's default options: plain, soft-cap, sliding window
    and both, with one, two and four kv heads per item, for a cache of the query dtype and the
    two fp8 ones, and the merge of the decode tile."""
    out = []
    for dt in dtype_names:
        for d in head_dims:
            heads = [h for h in PACKED_HEADS if h <= MAX_PACKED_HEADS.get(d, h)]
            variants = (None,) if d in WIDE_HEAD_DIMS else SHIPPED_VARIANTS
            for kv in kv_names if d in FP8_HEAD_DIMS else (None,):
                out += [decode_spec(arch, dt, d, v, kv_dtype=kv) for v in variants]
                out += [decode_spec(arch, dt, d, v, h, kv) for h in heads for v in SHIPPED_VARIANTS]
            out.append(Spec.make("merge_partials", arch, dtype=dt, head_dim=d, tile_q=TILE_Q))
    return out
