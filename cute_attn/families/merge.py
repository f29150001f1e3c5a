"""The ⊕ merge families: ``merge_states`` (n states per row), ``merge_pair`` (two, optionally
masked: the in-place form) and ``merge_partials`` (a plan's split-KV partial states, launched
after the attention kernel).  Kernels: ``kernels/merge.py``; the same code serves both arches."""

from __future__ import annotations

from itertools import product

from ..abi import dtypes
from ..abi.archs import ARCHS
from ..abi.args import ScalarArg, TensorArg
from ..abi.records import MERGE_FIELDS, META_FIELDS, META_NUM_MERGE_TASKS
from .base import KernelFamily, register
from .spec import Spec

HEAD_DIMS = (64, 128, 256)
LOAD_BATCH = 4  # merge_states: states whose loads each thread issues together

# PTX/SASS that the merge kernels must contain: 16-byte vector loads, on both arches.
MERGE_EXPECT = {
    arch: {
        "16B ld.global (PTX)": r"ptx:ld\.global(\.\w+)*\.(v4\.[bfu]32|v2\.[bfu]64)",
        "LDG.E.128 (SASS)": r"sass:LDG\.E\.128",
    }
    for arch in ARCHS
}


def _values(name: str, dtype: str, rank: int, head_dim: int) -> TensorArg:
    v = dtypes.vec_elems(dtype)
    shape = (None,) * (rank - 1) + (head_dim,)
    stride = (None,) * (rank - 1) + (1,)
    return TensorArg(name, dtype, shape, stride, stride_divisibility=v, align=16)


def _lse(name: str, rank: int) -> TensorArg:
    return TensorArg(name, "f32", (None,) * rank, (None,) * rank, 1, 4)


def merge_states_abi(p):
    dt, d = p["dtype"], p["head_dim"]
    return [
        _values("mV", dt, 4, d),
        _lse("mS", 3),
        _values("mO", dt, 3, d),
        _lse("mLse", 2),
        ScalarArg("max_ctas", "i32"),
    ]


def merge_pair_abi(p):
    dt, d = p["dtype"], p["head_dim"]
    mask = TensorArg("mMask", "u8", (None,) if p["masked"] else (1,), (1,), 1, 1)
    return [_values("mVa", dt, 3, d), _lse("mSa", 2), _values("mVb", dt, 3, d), _lse("mSb", 2),
            _values("mO", dt, 3, d), _lse("mLse", 2), mask, ScalarArg("max_ctas", "i32")]  # fmt: skip


def merge_partials_abi(p):
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


MERGE_STATES = register(
    KernelFamily("merge_states", "cute_attn.kernels.merge:build_merge_states", merge_states_abi, MERGE_EXPECT)
)
MERGE_PAIR = register(
    KernelFamily("merge_pair", "cute_attn.kernels.merge:build_merge_pair", merge_pair_abi, MERGE_EXPECT)
)
MERGE_PARTIALS = register(
    KernelFamily(
        name="merge_partials",
        builder="cute_attn.kernels.merge:build_merge_partials",
        abi=merge_partials_abi,
        # launched as a programmatic dependent: it must wait for the attention grid before reading
        expect={a: {**e, "griddepcontrol.wait (PTX)": r"ptx:griddepcontrol\.wait"} for a, e in MERGE_EXPECT.items()},
    )
)

assert META_NUM_MERGE_TASKS == 1, "kernels/merge.py reads the merge-task count at meta[1]"


def merge_states_spec(arch: str, dtype: str, head_dim: int, load_batch: int = LOAD_BATCH) -> Spec:
    return Spec.make("merge_states", arch, dtype=dtype, head_dim=head_dim, load_batch=load_batch)


def merge_pair_spec(arch: str, dtype: str, head_dim: int, masked: bool = False) -> Spec:
    return Spec.make("merge_pair", arch, dtype=dtype, head_dim=head_dim, masked=bool(masked))


def merge_partials_spec(arch: str, dtype: str, head_dim: int, tile_q: int) -> Spec:
    return Spec.make("merge_partials", arch, dtype=dtype, head_dim=head_dim, tile_q=tile_q)


def shipped_specs(arch: str, dtype_names=dtypes.MERGE_VALUES, head_dims=HEAD_DIMS) -> list:
    """The public ⊕ ops' kernels at the common head dims (the partials' merges ship with the
    attention families that launch them)."""
    out = []
    for dt, d in product(dtype_names, head_dims):
        out += [merge_states_spec(arch, dt, d), merge_pair_spec(arch, dt, d, False), merge_pair_spec(arch, dt, d, True)]
    return out
