"""The kept-plan update (``kernels/kept_update.py``): a CUDA-graph decode wrapper's per-step
re-plan on the device -- the last full plan's items put on the lengths the engine wrote into
the index buffers (``sched/reuse.py``).  One spec per arch: it depends on no dtype or head dim."""

from __future__ import annotations

from ..abi.archs import ARCHS
from ..abi.args import TensorArg
from ..abi.kept import KEPT_ITEM_FIELDS, KEPT_PARAMS, MAX_BATCH
from ..abi.records import MERGE_FIELDS, WORK_FIELDS
from .base import KernelFamily, i32_arg, register
from .spec import Spec


def _records(name: str, fields: int) -> TensorArg:
    return TensorArg(name, "i32", (None, fields), (fields, 1), 1, 4)


def kept_update_abi(p):
    return [
        i32_arg("mKvIndptr"),
        i32_arg("mLast"),
        TensorArg("mParams", "i32", (KEPT_PARAMS,), (1,), 1, 4),
        _records("mItems", KEPT_ITEM_FIELDS),
        i32_arg("mMergeRank"),
        _records("mWork", WORK_FIELDS),
        i32_arg("mWorkIndptr"),
        _records("mMerges", MERGE_FIELDS),
        TensorArg("mStatus", "i32", (1,), (1,), 1, 4),  # host memory (mapped pinned)
    ]


KEPT_UPDATE = register(
    KernelFamily(
        name="kept_update",
        builder="cute_attn.kernels.kept_update:build_kept_update",
        abi=kept_update_abi,
        expect={a: {"bar.sync (PTX)": r"ptx:bar\.sync"} for a in ARCHS},
    )
)


def kept_update_spec(arch: str) -> Spec:
    return Spec.make("kept_update", arch, max_batch=MAX_BATCH)
