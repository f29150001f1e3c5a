"""Record formats and the fixed-offset workspace layout (see the package docstring).

Everything here depends only on the limits fixed at wrapper creation, never on a batch:
that is what keeps the pointers baked into a captured CUDA graph valid from plan to plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ..abi.records import (  # noqa: F401  (the planner's record formats, re-exported)
    M_KV_HEAD,
    M_NUM_ROWS,
    M_NUM_SLOTS,
    M_QO_OFFSET,
    M_REQ,
    M_RESERVED,
    M_ROW_START,
    M_SLOT_START,
    MERGE_FIELDS,
    META_BATCH_SIZE,
    META_CAUSAL,
    META_CTA_TILE_Q,
    META_FIELDS,
    META_GROUP_SIZE,
    META_KV_CHUNK,
    META_NUM_CTAS,
    META_NUM_KV_HEADS,
    META_NUM_MERGE_TASKS,
    META_NUM_PARTIAL_SLOTS,
    META_NUM_QO_HEADS,
    META_NUM_WORK_ITEMS,
    META_TOTAL_QO_ROWS,
    W_CHUNK,
    W_DEST,
    W_KV_END,
    W_KV_HEAD,
    W_KV_LEN,
    W_KV_START,
    W_NUM_CHUNKS,
    W_NUM_ROWS,
    W_QO_LEN,
    W_QO_OFFSET,
    W_REQ,
    W_ROW_START,
    WORK_FIELDS,
)

ALIGN = 256
MIN_CTA_TILE_Q = 16
MAX_CTA_TILE_Q = 256
INT32_MAX = 2**31 - 1


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Limits:
    """Bounds fixed at wrapper creation; every plan must stay within them.

    ``max_partial_rows`` is the capacity of the partial-output section in packed rows (a
    partial slot holds ``cta_tile_q`` rows, so a plan may use ``max_partial_rows //
    cta_tile_q`` slots); None means ``4 * num_ctas * 128``.
    """

    max_batch: int
    max_total_q_tokens: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    max_partial_rows: Optional[int] = None
    max_kv_len: int = INT32_MAX
    max_qo_len: Optional[int] = None  # per request; None: max_total_q_tokens

    def __post_init__(self):
        for name in ("max_batch", "max_total_q_tokens", "num_qo_heads", "num_kv_heads", "head_dim", "max_kv_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {v!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"Limits.num_qo_heads ({self.num_qo_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("max_partial_rows", "max_qo_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"Limits.{name} must be a non-negative int or None, got {v!r}")
        if self.max_kv_len > INT32_MAX:
            raise ValueError(f"Limits.max_kv_len ({self.max_kv_len}) exceeds int32")
        # Worst-case packed rows must index in int32 as well.
        if self.max_total_q_tokens * self.num_qo_heads > INT32_MAX:
            raise ValueError("Limits.max_total_q_tokens * num_qo_heads exceeds int32")


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of every workspace section, fixed by (limits, num_ctas).

    int32 sections first (this prefix is what ``plan()`` uploads), then the fp32 sections
    the attention kernel writes and the merge kernel reads.
    """

    limits: Limits
    num_ctas: int
    max_work_items: int = field(init=False)
    max_merge_tasks: int = field(init=False)
    max_partial_rows: int = field(init=False)
    sections: Dict[str, Tuple[int, int]] = field(init=False)  # name -> (offset, nbytes)
    int_bytes: int = field(init=False)
    total_bytes: int = field(init=False)

    def __post_init__(self):
        lim, c = self.limits, self.num_ctas
        if not isinstance(c, int) or c < 1:
            raise ValueError(f"num_ctas must be a positive int, got {c!r}")
        rows = lim.max_partial_rows if lim.max_partial_rows is not None else 4 * c * 128
        max_slots = rows // MIN_CTA_TILE_Q
        # Tiles: sum_b ceil(q_b * G / T) <= total_q * G / T + batch, with the smallest T; each
        # tile runs once per kv head, and every extra chunk of a split tile owns a slot.
        max_tiles_x_heads = (
            lim.max_total_q_tokens * lim.num_qo_heads + MIN_CTA_TILE_Q - 1
        ) // MIN_CTA_TILE_Q + lim.max_batch * lim.num_kv_heads
        max_items = max_tiles_x_heads + max_slots
        max_merge = max_slots // 2  # a split tile owns >= 2 slots
        sizes = [
            ("meta", 4 * META_FIELDS),
            ("work_indptr", 4 * (c + 1)),
            ("merge_tasks", 4 * MERGE_FIELDS * max_merge),
            ("work_items", 4 * WORK_FIELDS * max_items),
            ("partial_lse", 4 * rows),
            ("partial_o", 4 * rows * lim.head_dim),
        ]
        off, sections = 0, {}
        for name, nbytes in sizes:
            sections[name] = (off, nbytes)
            off = _align(off + nbytes)
            if name == "work_items":
                int_bytes = off
        object.__setattr__(self, "max_work_items", max_items)
        object.__setattr__(self, "max_merge_tasks", max_merge)
        object.__setattr__(self, "max_partial_rows", rows)
        object.__setattr__(self, "sections", sections)
        object.__setattr__(self, "int_bytes", int_bytes)
        object.__setattr__(self, "total_bytes", off)

    def offset(self, name: str) -> int:
        return self.sections[name][0]

    def max_partial_slots(self, cta_tile_q: int) -> int:
        return self.max_partial_rows // cta_tile_q

    def views(self, workspace):
        """Typed torch views of the sections of a workspace tensor (for kernels and tests):
        meta [16], work_indptr [C+1], merge_tasks [max_merge, 8], work_items [max_items, 12],
        partial_lse [rows], partial_o [rows, head_dim]."""
        import torch

        ws = workspace.view(torch.uint8).reshape(-1)
        if ws.numel() < self.total_bytes:
            raise ValueError(f"workspace has {ws.numel()} bytes, the layout needs {self.total_bytes}")

        def sec(name, dtype, shape):
            o, n = self.sections[name]
            return ws[o : o + n].view(dtype).view(shape)

        return {
            "meta": sec("meta", torch.int32, (META_FIELDS,)),
            "work_indptr": sec("work_indptr", torch.int32, (self.num_ctas + 1,)),
            "merge_tasks": sec("merge_tasks", torch.int32, (self.max_merge_tasks, MERGE_FIELDS)),
            "work_items": sec("work_items", torch.int32, (self.max_work_items, WORK_FIELDS)),
            "partial_lse": sec("partial_lse", torch.float32, (self.max_partial_rows,)),
            "partial_o": sec("partial_o", torch.float32, (self.max_partial_rows, self.limits.head_dim)),
        }
