"""The paged MLA families: ``mla_decode`` (``kernels/mla_decode.py``: absorbed multi-head latent
attention on ``mma.sync`` + ``cp.async``, both arches, 16 / 32-row items) and ``mla_decode_sm90``
(``kernels/mla_decode_sm90.py``: both GEMMs on ``wgmma``, Hopper, 64-row items); their ABI (one
for both), the instructions their binaries must hold, and the specializations that ship.

Spec parameters: ``dtype`` (queries, caches and output: ``f16`` / ``bf16``), ``kv_dtype`` (an
fp8 latent cache, ``e4m3`` / ``e5m2``, ``mla_decode`` only: ``kernels/mla_decode_fp8.py``;
absent for a cache of ``dtype``, so the 16-bit specs' parameters are unchanged), ``head_dim_ckv``
(512) and ``head_dim_kpe`` (64) -- the only widths the kernel is built for, named in the spec
so a key says what it serves --, ``tile_q`` (packed query rows per work item: 16, or 32 with
two warp groups for plans whose requests have more rows than one tile) and ``stages`` (the
KV pipeline depth that fits shared memory).  Causal masking and the softmax scale are launch
scalars: one module serves both."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import ARCHS, HOPPER
from ..abi.args import ScalarArg, TensorArg
from ..abi.records import WORK_FIELDS
from .base import KernelFamily, i32_arg, register
from .spec import Spec

HEAD_DIM_CKV = 512  # the latent width (DeepSeek-V2/V3's kv_lora_rank): V and the output
HEAD_DIM_KPE = 64  # the RoPE width of the key (qk_rope_head_dim)
TILES = (16, 32)  # packed query rows per work item: one or two warp groups of 16 rows
STAGES = {16: 5, 32: 4}  # 36 KB stages + Q staging (18 / 36 KB) + scores (8 / 16 KB): 206 / 196 KB
CTAS_PER_SM = 1  # what shared memory allows
# An fp8 cache: 18 KB byte stages + Q staging + scores.  At 16 rows two CTAs share an SM (4
# stages: 2 x 98 KB; 2 x 128 threads x 235 registers): a block's bytes arrive in half the
# 16-bit time, and one CTA's chain of loads, barriers and MMAs per block no longer keeps up
# (measured: 1 CTA x 10 stages ran at the 16-bit kernel's time).  At 32 rows (256 threads)
# the registers allow one CTA: 9 stages, 214 KB.
STAGES_FP8 = {16: 4, 32: 9}
CTAS_PER_SM_FP8 = {16: 2, 32: 1}


def ctas_per_sm(tile_q: int, fp8: bool) -> int:
    """CTAs per SM (the persistent grid) of the MLA kernel that serves a tile (``TILES``, or the
    wgmma kernel's ``TILE_SM90``) and cache: the one place both MLA backends take it from."""
    return CTAS_PER_SM_FP8[tile_q] if fp8 else CTAS_PER_SM


TILE_SM90 = 64  # the wgmma kernel's packed query rows per item (one wgmma M)
STAGES_SM90 = 2  # its 64-key stages: Q (72 KB) + 2 x 72 KB (P goes into a stage) = 216 KB
MAX_HEADS = 128  # DeepSeek-V3's 128 query heads (16 / 32 / 64 at tensor-parallel 8 / 4 / 2)


def mla_abi(p):
    """q_nope / q_pe ``[tokens, heads, 512 | 64]`` and the caches ``[pages, page_size, 512 |
    64]``, any strides with the last dim contiguous (SGLang passes views of one 576-wide
    buffer: q ``[..., :512]`` / ``[..., 512:]``), whole 16-byte vectors."""
    dt = p["dtype"]
    kv = p.get("kv_dtype", dt)
    ckv, kpe = p["head_dim_ckv"], p["head_dim_kpe"]
    rows = lambda name, d, t=dt: TensorArg(name, t, (None, None, d), (None, None, 1), dtypes.vec_elems(t), 16)  # noqa: E731
    return [
        rows("mQn", ckv),
        rows("mQp", kpe),
        rows("mCkv", ckv, kv),
        rows("mKpe", kpe, kv),
        i32_arg("mKvIndptr"),
        i32_arg("mKvIndices"),
        rows("mO", ckv),
        TensorArg("mLse", "f32", (None, None), (None, None), 1, 4),
        TensorArg("mWork", "i32", (None, WORK_FIELDS), (WORK_FIELDS, 1), 1, 4),
        i32_arg("mWorkIndptr"),
        TensorArg("mPartO", "f32", (None, ckv), (ckv, 1), 1, 16),
        TensorArg("mPartLse", "f32", (None,), (1,), 1, 4),
        ScalarArg("group", "i32"),
        ScalarArg("causal", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("num_ctas", "i32"),
    ]


MLA_DECODE = register(
    KernelFamily(
        name="mla_decode",
        builder="cute_attn.kernels.mla_entry:build_mla_decode",
        abi=mla_abi,
        expect={
            a: {
                "mma.sync m16n8k16 (PTX)": r"ptx:mma\.sync\.aligned\.m16n8k16",
                "cp.async (PTX)": r"ptx:cp\.async\.c[ag]\.shared",
                "ldmatrix (PTX)": r"ptx:ldmatrix\.sync\.aligned",
                "HMMA.16816 (SASS)": r"sass:HMMA\.16816",
                "LDGSTS (SASS)": r"sass:LDGSTS",
                # lets the merge kernel (a programmatic dependent launch) start early
                "griddepcontrol.launch_dependents (PTX)": r"ptx:griddepcontrol\.launch_dependents",
            }
            for a in ARCHS
        },
    )
)


MLA_DECODE_SM90 = register(
    KernelFamily(
        name="mla_decode_sm90",
        builder="cute_attn.kernels.mla_decode_sm90:build_mla_decode_sm90",
        abi=mla_abi,
        expect={
            HOPPER: {
                "wgmma (PTX)": r"ptx:wgmma\.mma_async",
                "cp.async (PTX)": r"ptx:cp\.async\.c[ag]\.shared",
                "HGMMA (SASS)": r"sass:HGMMA",
                # ptxas serializes every wgmma of the kernel (C7515) when an accumulator may be
                # written while one is in flight -- a wait_group inside a branch was enough
                "wgmma async (SASS)": r"sass%HGMMA/WARPGROUP\.ARRIVE>=3",
                "LDGSTS (SASS)": r"sass:LDGSTS",
                "griddepcontrol.launch_dependents (PTX)": r"ptx:griddepcontrol\.launch_dependents",
            }
        },
    )
)


def mla_sm90_spec(arch: str, dtype: str) -> Spec:
    """The ``mla_decode_sm90`` specialization for a dtype (64-row items, 2 stages)."""
    return Spec.make(
        "mla_decode_sm90",
        arch,
        dtype=dtype,
        head_dim_ckv=HEAD_DIM_CKV,
        head_dim_kpe=HEAD_DIM_KPE,
        tile_q=TILE_SM90,
        stages=STAGES_SM90,
    )


def shipped_specs_sm90(arch: str, dtype_names=dtypes.ATTENTION) -> list:
    """The wgmma kernel for fp16 and bf16 on Hopper, and the merge of its 64-row tile."""
    if arch != HOPPER:
        return []
    out = []
    for dt in dtype_names:
        out += [mla_sm90_spec(arch, dt), mla_merge_spec(arch, dt, TILE_SM90)]
    return out


def mla_spec(arch: str, dtype: str, tile_q: int = TILES[0], kv_dtype: str | None = None) -> Spec:
    """The ``mla_decode`` specialization for a dtype (``"f16"`` / ``"bf16"``), tile and cache
    dtype (None or ``dtype``: a 16-bit cache; ``"e4m3"`` / ``"e5m2"``: fp8)."""
    if tile_q not in TILES:
        raise ValueError(f"mla_decode: tile_q {tile_q} is not one of {TILES}")
    kvp, stages = {}, STAGES[tile_q]
    if kv_dtype is not None and kv_dtype != dtype:
        if kv_dtype not in dtypes.FP8:
            raise ValueError(f"mla_decode: a {kv_dtype} latent cache with {dtype} queries (only fp8 caches may differ)")
        kvp, stages = {"kv_dtype": kv_dtype}, STAGES_FP8[tile_q]
    return Spec.make(
        "mla_decode",
        arch,
        dtype=dtype,
        head_dim_ckv=HEAD_DIM_CKV,
        head_dim_kpe=HEAD_DIM_KPE,
        tile_q=tile_q,
        stages=stages,
        **kvp,
    )


def mla_merge_spec(arch: str, dtype: str, tile_q: int) -> Spec:
    """The split-KV partials' merge at the latent width (``merge_partials``; spelled out here so
    this module need not import the merge family's, whose edits would then change MLA keys)."""
    return Spec.make("merge_partials", arch, dtype=dtype, head_dim=HEAD_DIM_CKV, tile_q=tile_q)


def shipped_specs(arch: str, dtype_names=dtypes.ATTENTION, tiles=TILES, kv_names=None) -> list:
    """Both tiles for fp16 and bf16 (for each cache dtype of ``kv_names``: None is the query's,
    or fp8; default: the 16-bit cache and both fp8 ones), and the merge of each tile."""
    if kv_names is None:
        kv_names = (None,) + dtypes.FP8
    out = []
    for dt in dtype_names:
        for t in tiles:
            out += [mla_spec(arch, dt, t, kv) for kv in kv_names] + [mla_merge_spec(arch, dt, t)]
    return out
