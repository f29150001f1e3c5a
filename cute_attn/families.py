"""The attention kernel families: name, builder, ABI and build expectations of each.

Kept apart from the wrappers on purpose. A family's cache key hashes the builder module, the
module that defines its ABI (this one) and the ``cute_attn`` modules they import
(``runtime.spec.source_fingerprint``).  The wrappers import the planner; with the ABIs defined
there, every planner edit recompiled every kernel.  Nothing here imports ``cute_attn.sched``
beyond its ``workspace`` record layout, which the kernels do depend on.
"""

from __future__ import annotations

import functools

from .merge import MERGE_EXPECT
from .runtime.abi import ScalarArg, TensorArg
from .runtime.family import KernelFamily, register
from .sched.workspace import MERGE_FIELDS, META_FIELDS, META_NUM_MERGE_TASKS, WORK_FIELDS
from .variants import base as vbase

DECODE_ARCHS = ("sm_90a", "sm_100a")
PREFILL_ARCH = "sm_90a"  # wgmma: Hopper only (no sm_100a specializations, see presets.py)


# ---- variants in spec parameters ------------------------------------------------------------
@functools.cache
def _variant_from(text: str, fp: str):
    v = vbase.decode(text)
    got = vbase.fingerprint(v)
    if got != fp:
        raise ValueError(
            f"variant {text}: its code or static parameters changed since the spec was made "
            f"(fingerprint {got}, spec says {fp}); make the spec again from the variant object"
        )
    return v


_NO_VARIANT_FP = vbase.fingerprint(None)


def spec_variant(p):
    """The variant object of a spec's parameters (checked against its fingerprint)."""
    return _variant_from(p.get("variant", "none"), p.get("variant_fp", _NO_VARIANT_FP))


_FP_CACHE: dict = {}


def variant_params(v) -> dict:
    """Spec parameters naming a variant: ``variant`` (:func:`variants.encode`) and ``variant_fp``
    (:func:`variants.fingerprint`, cached per class and static parameters for this process)."""
    text = vbase.encode(v)
    key = (text, tuple(type(c) for c in vbase.components(v)))
    fp = _FP_CACHE.get(key)
    if fp is None:
        fp = _FP_CACHE[key] = vbase.fingerprint(v)
    return {"variant": text, "variant_fp": fp}


# ---- argument shapes several families share ---------------------------------------------------
def _cache(name, p):
    """K or V: ``[pages or 1, tokens, kv_heads, head_dim]``, any strides, head_dim contiguous."""
    return TensorArg(name, p["dtype"], (None, None, None, p["head_dim"]), (None, None, None, 1), 8, 16)


def _i32(name):
    return TensorArg(name, "i32", (None,), (1,), 1, 4)


# ---- paged decode ---------------------------------------------------------------------------
def decode_abi_fixed(p):
    d, dt = p["head_dim"], p["dtype"]
    row = lambda name: TensorArg(name, dt, (None, None, d), (None, None, 1), 8, 16)  # noqa: E731
    return [
        row("mQ"),
        _cache("mK", p),
        _cache("mV", p),
        _i32("mKvIndptr"),
        _i32("mKvIndices"),
        row("mO"),
        TensorArg("mLse", "f32", (None, None), (None, None), 1, 4),
        TensorArg("mWork", "i32", (None, WORK_FIELDS), (WORK_FIELDS, 1), 1, 4),
        _i32("mWorkIndptr"),
        TensorArg("mPartO", "f32", (None, d), (d, 1), 1, 16),
        TensorArg("mPartLse", "f32", (None,), (1,), 1, 4),
        ScalarArg("group", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("num_ctas", "i32"),
    ]


def decode_abi(p):
    """The family's arguments, then the variant's (``variants.base.abi_args``)."""
    return decode_abi_fixed(p) + vbase.abi_args(spec_variant(p))


def _merge_partials_abi(p):
    d, dt = p["head_dim"], p["dtype"]
    return [
        TensorArg("mPartO", "f32", (None, d), (d, 1), 1, 16),
        TensorArg("mPartLse", "f32", (None,), (1,), 1, 4),
        TensorArg("mTasks", "i32", (None, MERGE_FIELDS), (MERGE_FIELDS, 1), 1, 4),
        TensorArg("mMeta", "i32", (META_FIELDS,), (1,), 1, 4),
        TensorArg("mO", dt, (None, None, d), (None, None, 1), 4, 8),
        TensorArg("mLse", "f32", (None, None), (None, None), 1, 4),
        ScalarArg("group", "i32"),
        ScalarArg("num_ctas", "i32"),
    ]


PAGED_DECODE = register(
    KernelFamily(
        name="paged_decode",
        builder="cute_attn.kernels.decode:build_paged_decode",
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
            for a in DECODE_ARCHS
        },
    )
)

MERGE_PARTIALS = register(
    KernelFamily(
        name="merge_partials",
        builder="cute_attn.kernels.merge:build_merge_partials",
        abi=_merge_partials_abi,
        # launched as a programmatic dependent: it must wait for the attention grid before reading
        expect={a: {**e, "griddepcontrol.wait (PTX)": r"ptx:griddepcontrol\.wait"} for a, e in MERGE_EXPECT.items()},
    )
)

assert META_NUM_MERGE_TASKS == 1, "kernels/merge.py reads the merge-task count at meta[1]"


# ---- batch prefill (Hopper) -----------------------------------------------------------------
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


# The contract with kernels/prefill_sm90.py: the ABI above, spec params dtype, head_dim,
# tile_q, paged, causal, soft_cap, window and, for a traced variant, variant / variant_fp.
BATCH_PREFILL_SM90 = register(
    KernelFamily(
        name="batch_prefill_sm90",
        builder="cute_attn.kernels.prefill_sm90:build_batch_prefill_sm90",
        abi=prefill_abi,
        expect={
            PREFILL_ARCH: {
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


# ---- the KV pass (prefill: a paged cache gathered, keys transformed) -------------------------
def kv_pass_abi_fixed(p):
    """K, V (the cache), their contiguous outputs, qo / kv (tokens) / page indptr, page ids."""
    return [
        _cache("mK", p),
        _cache("mV", p),
        _cache("mKout", p),
        _cache("mVout", p),
        _i32("mQoIndptr"),
        _i32("mKvIndptr"),
        _i32("mPageIndptr"),
        _i32("mPageIndices"),
        ScalarArg("batch", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("num_ctas", "i32"),
    ]


def kv_pass_abi(p):
    return kv_pass_abi_fixed(p) + vbase.abi_args(spec_variant(p))


# Spec params dtype, head_dim, paged and, for a key transform, variant / variant_fp
# (kernels/kv_pass.py).  Plain SIMT: it would build for sm_100a too, but only the (Hopper)
# prefill wrappers launch it.
KV_PASS = register(
    KernelFamily(
        name="kv_pass",
        builder="cute_attn.kernels.kv_pass:build_kv_pass",
        abi=kv_pass_abi,
        expect={
            PREFILL_ARCH: {
                "16B ld.global (PTX)": r"ptx:ld\.global(\.\w+)*\.v4\.[bu]32",
                "LDG.E.128 (SASS)": r"sass:LDG\.E\.128",
                "STG.E.128 (SASS)": r"sass:STG\.E\.128",
            }
        },
    )
)
