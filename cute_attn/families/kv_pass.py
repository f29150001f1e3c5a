"""The KV pass family (``kernels/kv_pass.py``): one memory-bound sweep before the prefill
kernel that gathers a paged cache into contiguous K / V, dequantizes an fp8 cache to the
query dtype and / or applies a variant's ``transform_k`` (RoPE) once per key.  Plain SIMT;
only the (Hopper) prefill launches it.

Spec parameters: ``dtype`` (the outputs', = the queries'), ``kv_dtype`` (an fp8 cache,
``e4m3`` / ``e5m2``, read as such and written in ``dtype``; absent for a cache of ``dtype``,
so the 16-bit specs keep their parameters), ``head_dim``, ``paged`` and, for a key transform,
the variant."""

from __future__ import annotations

from ..abi import dtypes
from ..abi.archs import HOPPER
from ..abi.args import ScalarArg
from ..variants import base as vbase
from .base import KernelFamily, cache_arg, i32_arg, register, spec_variant, variant_params
from .spec import Spec

ARCH = HOPPER  # only the Hopper prefill launches it
HEAD_DIMS = (64, 128, 256)
# the pass's grid per SM (256 threads each; 64 or 80 registers: 3-4 resident; fp8: 74-150, 3-1)
CTAS_PER_SM = 8


def kv_pass_abi_fixed(p):
    """K, V (the cache, of ``kv_dtype`` when given), their contiguous outputs (of ``dtype``),
    qo / kv (tokens) / page indptr, page ids."""
    return [
        cache_arg("mK", p, p.get("kv_dtype")),
        cache_arg("mV", p, p.get("kv_dtype")),
        cache_arg("mKout", p),
        cache_arg("mVout", p),
        i32_arg("mQoIndptr"),
        i32_arg("mKvIndptr"),
        i32_arg("mPageIndptr"),
        i32_arg("mPageIndices"),
        ScalarArg("batch", "i32"),
        ScalarArg("sm_scale", "f32"),
        ScalarArg("num_ctas", "i32"),
    ]


def kv_pass_abi(p):
    return kv_pass_abi_fixed(p) + vbase.abi_args(spec_variant(p))


KV_PASS = register(
    KernelFamily(
        name="kv_pass",
        builder="cute_attn.kernels.kv_pass:build_kv_pass",
        abi=kv_pass_abi,
        expect={
            ARCH: {
                "16B ld.global (PTX)": r"ptx:ld\.global(\.\w+)*\.v4\.[bu]32",
                "LDG.E.128 (SASS)": r"sass:LDG\.E\.128",
                "STG.E.128 (SASS)": r"sass:STG\.E\.128",
            }
        },
        known_gaps=lambda p: (
            {
                "16B ld.global (PTX)": "fp8 rows of 80 bytes: 8-byte loads (16-byte chunk pairs do not tile them)",
                "LDG.E.128 (SASS)": "fp8 rows of 80 bytes: 8-byte loads",
            }
            if "kv_dtype" in p and p["head_dim"] % 32
            else {}
        ),
    )
)


def kv_params(dtype: str, kv_dtype: str | None) -> dict:
    """The spec parameter of the cache dtype: absent for a cache of the output dtype."""
    if kv_dtype is None or kv_dtype == dtype:
        return {}
    if kv_dtype not in dtypes.FP8 or dtype not in dtypes.ATTENTION:
        raise ValueError(f"kv_pass: a {kv_dtype} cache into {dtype} (only an fp8 cache may differ from f16 / bf16)")
    return {"kv_dtype": kv_dtype}


def kv_pass_spec(
    arch: str, dtype: str, head_dim: int, paged: bool, variant, kv_dtype: str | None = None
) -> Spec | None:
    """The KV pass for a plan: ``paged`` gathers the cache (K and V), an fp8 ``kv_dtype``
    dequantizes K and V to ``dtype`` (paged or ragged), a ``variant`` with ``transform_k``
    transforms K (the plan's variant, without run()'s sinks); None when there is nothing to
    do (ragged, a cache of ``dtype``, no key transform)."""
    transform = variant is not None and vbase.Hooks(variant).has_transform_k
    kv = kv_params(dtype, kv_dtype)
    if not (paged or transform or kv):
        return None
    return Spec.make(
        "kv_pass",
        arch,
        dtype=dtype,
        head_dim=head_dim,
        paged=bool(paged),
        **kv,
        **(variant_params(variant) if transform else {}),
    )


def shipped_specs(
    arch: str, dtype_names=dtypes.ATTENTION, head_dims=HEAD_DIMS, kv_names=dtypes.FP8, layouts=(True, False)
) -> list:
    """The plain gathers of a 16-bit paged cache (no key transform), and the dequantizing
    passes of an fp8 cache, paged and ragged (``layouts``: the ``paged`` values), into each
    output dtype: an fp8 plan always runs the pass."""
    if arch != ARCH:
        return []
    out = [kv_pass_spec(arch, dt, d, True, None) for dt in dtype_names for d in head_dims]
    out += [
        kv_pass_spec(arch, dt, d, paged, None, kv)
        for dt in dtype_names
        for d in head_dims
        for kv in kv_names
        for paged in layouts
    ]
    return out
