"""fp8 attention for prefill on Hopper (``kernels/prefill_fp8.py``: fp8 Q, K and V on the fp8
wgmma, P quantized to e4m3 for the second GEMM) and the pass that lays V out for it
(``kernels/vt_pass.py``): their ABIs, expected instructions and specializations; and the V^T
layout both sides of that contract use (``vt_key``, ``vt_groups``).

Why V^T.  The fp8 wgmma takes its B operand from shared memory K-major only, and in P·V the
contraction runs over the keys: V must be stored with the keys contiguous (V^T, ``[kv_heads,
head_dim, keys]``).  The pass writes it once per run (1 byte read + 1 written per element);
the attention kernel reads it by TMA like K.

Why permuted.  P comes from registers, and the fp8 A fragment is not the layout of the fp32
accumulator S it is made of: a thread holds S columns 2t, 2t+1 (+8, +16, +24) of each 32 keys,
while the k32 A fragment wants k positions 4t .. 4t+3 and 16+4t .. 16+4t+3.  A GEMM does not care
in which order it sums its k terms as long as both operands agree, so each thread packs its own
S values, unmoved, into its A registers, and V^T is written with its keys in the order the
A fragment then has: column p of every 32-key group holds key ``vt_key(p)``.  No shuffle in the
kernel.  The kernel checks at trace time, for every thread, that its fragments realize exactly
this map.

Why padded.  The permutation works on groups of 32 keys that must start where the kernel's KV
blocks start: each request's V^T columns start at a multiple of 32 (``vt_indptr``), and the
plan cuts split-KV chunks at multiples of 32 keys (``VT_GROUP``, the planner's page size for
these plans).  The pad columns hold zeros (finite: a masked key's P = 0 must not meet a NaN).

Spec parameters.  Attention: ``dtype`` (the output's: f16 / bf16), ``qkv_dtype`` (e4m3),
``head_dim`` (64 / 128), ``tile_q`` (64 / 128), ``causal``.  The pass: ``qkv_dtype``,
``head_dim``, ``paged`` (gather a paged cache: K into contiguous rows too)."""

from __future__ import annotations

from ..abi.archs import HOPPER
from ..abi.args import ScalarArg, TensorArg
from ..abi.records import WORK_FIELDS
from .base import KernelFamily, cache_arg, i32_arg, register
from .spec import Spec

ARCH = HOPPER
HEAD_DIMS = (64, 128)
TILES = (64, 128)
QKV_DTYPES = ("e4m3",)
OUT_DTYPES = ("f16", "bf16")
VT_GROUP = 32  # keys per permuted V^T group (the k extent of one fp8 wgmma)


def vt_key(p: int) -> int:
    """The key (0..31, within its group of 32) that V^T column p (0..31) of a group holds:
    bits (b4, b3, b2, b1, b0) of p -> key bits (b4, b1, b3, b2, b0).  Column p is k position p of
    the A fragment, which thread t = (p >> 2) & 3 fills from its S columns 2t, 2t + 1 of the
    n8 tile 2 (p >> 4) + ((p >> 1) & 1)."""
    return (p & 16) | ((p & 2) << 2) | (((p >> 2) & 3) << 1) | (p & 1)


def vt_columns(n_keys: int) -> int:
    """V^T columns a request of ``n_keys`` keys takes: rounded up to a whole group."""
    return -(-int(n_keys) // VT_GROUP) * VT_GROUP


def prefill_fp8_abi(p):
    d, dt, qd = p["head_dim"], p["dtype"], p["qkv_dtype"]
    return [
        TensorArg("mQ", qd, (None, None, d), (None, None, 1), 16, 16),
        cache_arg("mK", p, qd),
        TensorArg("mVt", qd, (None, d, None), (None, None, 1), 16, 16),  # [kv_heads, head_dim, columns]
        i32_arg("mKvIndptr"),  # K's rows per request (tokens)
        i32_arg("mVtIndptr"),  # V^T's columns per request (multiples of VT_GROUP)
        TensorArg("mO", dt, (None, None, d), (None, None, 1), 8, 16),
        TensorArg("mLse", "f32", (None, None), (None, None), 1, 4),
        TensorArg("mWork", "i32", (None, WORK_FIELDS), (WORK_FIELDS, 1), 1, 4),
        i32_arg("mWorkIndptr"),
        TensorArg("mPartO", "f32", (None, d), (d, 1), 1, 16),
        TensorArg("mPartLse", "f32", (None,), (1,), 1, 4),
        ScalarArg("group", "i32"),
        ScalarArg("sm_scale", "f32"),  # with q_scale and k_scale folded in
        ScalarArg("v_scale", "f32"),
        ScalarArg("num_ctas", "i32"),
    ]


BATCH_PREFILL_FP8_SM90 = register(
    KernelFamily(
        name="batch_prefill_fp8_sm90",
        builder="cute_attn.kernels.prefill_fp8:build_batch_prefill_fp8",
        abi=prefill_fp8_abi,
        expect={
            ARCH: {
                "fp8 wgmma (PTX)": r"ptx:wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                "QGMMA (SASS)": r"sass:QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3",
                "P to e4m3 (PTX)": r"ptx:cvt\.rn\.satfinite\.e4m3x2\.f32",
                "setmaxnreg (PTX)": r"ptx:setmaxnreg",
                "wgmma async (SASS)": r"sass%QGMMA/WARPGROUP\.ARRIVE>=3",
                # the warpgroup's wgmma descriptors in uniform registers: computed per thread,
                # ptxas moves each into place (R2UR) before every wgmma of a batch (3-10 %)
                "uniform descriptors (SASS)": r"sass!(?s)WARPGROUP\.ARRIVE(?:(?!gsb0).)*?R2UR",
            }
        },
    )
)


def vt_pass_abi(p):
    d, qd = p["head_dim"], p["qkv_dtype"]
    return [
        cache_arg("mK", p, qd),  # the cache: [pages, page_size, kv_heads, d] or [1, tokens, kv_heads, d]
        cache_arg("mV", p, qd),
        cache_arg("mKout", p, qd),  # paged: K gathered into [1, tokens, kv_heads, d] (else unused)
        TensorArg("mVt", qd, (None, d, None), (None, None, 1), 16, 16),
        i32_arg("mKvIndptr"),  # tokens per request (prefix sums): ragged rows / K's output rows
        i32_arg("mPageIndptr"),  # paged: pages per request (prefix sums)
        i32_arg("mPageIndices"),
        TensorArg("mGroups", "i32", (None, 3), (3, 1), 1, 4),  # per group: request, first key, V^T column
        ScalarArg("num_groups", "i32"),
    ]


VT_PASS = register(
    KernelFamily(
        name="vt_pass",
        builder="cute_attn.kernels.vt_pass:build_vt_pass",
        abi=vt_pass_abi,
        expect={
            ARCH: {
                "16B ld.global (PTX)": r"ptx:ld\.global(\.\w+)*\.v4\.[bu]32",
                "STG.E.128 (SASS)": r"sass:STG\.E\.128",
            }
        },
    )
)


def prefill_fp8_spec(
    arch: str, dtype: str, head_dim: int, tile_q: int, causal: bool, qkv_dtype: str = "e4m3", **knobs
) -> Spec:
    """``knobs`` (tuning, absent by default): ``tile_n`` (keys per block, a multiple of
    VT_GROUP), ``stages`` (K / V^T stages), ``pingpong`` (0 / 1), ``lazy_rescale`` (1: the 16-bit
    kernel's lazy running max; the default follows every new maximum, so each row's largest
    weight is exactly 1 in e4m3), ``pin_p`` (1: P's conversion pinned where it is written, see
    ``kernels/fragments.pin_fragment``), ``trace`` (1: clock stamps into the partial-output
    buffer, a diagnostic: ``kernels/prefill_fp8._stamp``)."""
    assert set(knobs) <= {"tile_n", "stages", "pingpong", "lazy_rescale", "pin_p", "trace"}, knobs
    assert knobs.get("tile_n", VT_GROUP) % VT_GROUP == 0
    return Spec.make(
        "batch_prefill_fp8_sm90",
        arch,
        dtype=dtype,
        qkv_dtype=qkv_dtype,
        head_dim=int(head_dim),
        tile_q=int(tile_q),
        causal=bool(causal),
        **{k: int(v) for k, v in knobs.items()},
    )


def vt_pass_spec(arch: str, head_dim: int, paged: bool, qkv_dtype: str = "e4m3", **knobs) -> Spec:
    """``knobs``: ``groups`` (1 / 2 / 4: the PRMT variant with that many groups per CTA; absent:
    the default pass)."""
    assert set(knobs) <= {"groups"}, knobs
    return Spec.make(
        "vt_pass",
        arch,
        qkv_dtype=qkv_dtype,
        head_dim=int(head_dim),
        paged=bool(paged),
        **{k: int(v) for k, v in knobs.items()},
    )


def shipped_specs(arch: str, dtype_names=OUT_DTYPES, head_dims=HEAD_DIMS, tiles=TILES) -> list:
    """Per output dtype x head dim x tile x causal: the attention kernel; per head dim the
    ragged and paged passes."""
    if arch != ARCH:
        return []
    out = [
        prefill_fp8_spec(arch, dt, d, t, c)
        for dt in dtype_names
        for d in head_dims
        for t in tiles
        for c in (False, True)
    ]
    return out + [vt_pass_spec(arch, d, paged) for d in head_dims for paged in (False, True)]
