"""A plan's work item as the kernels read it (contract: ``cute_attn.sched``; field order:
``cute_attn.abi.records.W_*``), and the per-launch values the variant hook helpers read.
Written once for every kernel that walks a work list.

Python objects in a kernel: the DSL carries a name through a ``cutlass.range`` loop (or a
runtime ``if``) when the loop body assigns it or calls a method on it, and only DSL values (or
objects with ``__extract_mlir_values__``) can be carried.  ``ItemInfo`` is made inside the
item loop and ``TraceCtx`` before it; both are only read (attributes, arguments) in the loops
below them, so neither is carried.  Keep it so: no assignment to them and no method call on
them inside a runtime loop; the helpers that need derived values are module functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..abi.records import (
    W_DEST,
    W_KV_END,
    W_KV_HEAD,
    W_KV_LEN,
    W_KV_START,
    W_NUM_ROWS,
    W_QO_LEN,
    W_QO_OFFSET,
    W_REQ,
    W_ROW_START,
)
from ..variants.base import Ctx


class WorkItem:
    """The fields of item ``i`` of ``mWork`` ([items, WORK_FIELDS] int32), loaded where the
    object is made (inside the kernel's item loop): a field a kernel never uses is a load the
    compiler drops."""

    def __init__(self, mWork, i):
        self.req = mWork[i, W_REQ]
        self.kv_head = mWork[i, W_KV_HEAD]
        self.row_start = mWork[i, W_ROW_START]
        self.num_rows = mWork[i, W_NUM_ROWS]
        self.kv_start = mWork[i, W_KV_START]
        self.kv_end = mWork[i, W_KV_END]
        self.dest = mWork[i, W_DEST]
        self.qo_offset = mWork[i, W_QO_OFFSET]
        self.qo_len = mWork[i, W_QO_LEN]
        self.kv_len = mWork[i, W_KV_LEN]

    @property
    def qpos_base(self):
        """Query token t of the request is at position qpos_base + t (causal bottom-right)."""
        return self.kv_len - self.qo_len


class ItemInfo:
    """Work item ``i`` as every helper of a kernel reads it, built once per item and passed on
    (in the spirit of FA4's SeqlenInfo / BlockInfo): the request (``req``), its kv head, its
    packed rows (``row_start``, ``num_rows`` and the plan's ``group``: packed row r is query
    token r // group of qo head kv_head * group + r % group), the query positions
    (``qpos_base``), the lengths (``qo_len``, ``kv_len``), the kv range (``kv_start``,
    ``kv_end``) and where the rows go (``dest``, ``qo_offset``).  ``group_div``: the group as a
    ``cute.FastDivmodDivisorV2`` (multiply-high + shift), for the kernels that map rows to
    (token, head) per item: a division by a runtime value is ~25 instructions, and an item's Q
    loads and output stores do one per row."""

    def __init__(self, mWork, i, group, group_div=None):
        w = WorkItem(mWork, i)
        self.req, self.kv_head = w.req, w.kv_head
        self.row_start, self.num_rows, self.group = w.row_start, w.num_rows, group
        self.group_div = group_div
        self.kv_start, self.kv_end = w.kv_start, w.kv_end
        self.dest, self.qo_offset = w.dest, w.qo_offset
        self.qo_len, self.kv_len = w.qo_len, w.kv_len
        # once, next to the loads (where the subtraction is emitted decides the PTX's order)
        self.qpos_base = w.qpos_base


def tok_head(info: ItemInfo, row):
    """(query token, qo head) of packed row ``row`` of an item (relative to the request)."""
    g = info.group
    if info.group_div is not None:
        tok, r = divmod(row, info.group_div)
        return info.qo_offset + tok, info.kv_head * g + r
    return info.qo_offset + row // g, info.kv_head * g + row % g


def row_token(info: ItemInfo, row):
    """Query token (relative to the request) of packed row ``row``."""
    return row // (info.group if info.group_div is None else info.group_div)


@dataclass(frozen=True)
class TraceCtx:
    """Per-launch values the variant hook helpers read while a kernel is traced, made once at
    the top of the kernel (or of a role) and passed to the helpers: kernel values, read-only."""

    vargs: Any  # per variant component: its runtime arguments (``Hooks.bind``)
    sm_scale: Any
    # column c of a thread's scores is key col0 + col_off[c] for every thread (thread 0's
    # coordinates are compile-time numbers): float positions cost one conversion per block
    col_off: tuple = ()
    o_col_off: tuple = ()  # the same for the columns of a thread's O accumulator
    o_stage: Optional[Any] = None  # the thread's stmatrix slice staging its O rows in one pass, or None
    inv_sm_scale: Optional[Any] = None  # 1 / sm_scale, for biases seeded in q·k's units
    inv_cap: Optional[Any] = None  # sm_scale / cap: the soft-cap's tanh argument per raw q·k
    fixed_shift: Optional[Any] = None  # the soft-cap's fixed shift (prefill ``_fixed_shift``)
    group: Optional[Any] = None  # the plan's GQA group (launch scalars of the prefill kernel)
    group_div: Optional[Any] = None  # the same as a FastDivmodDivisorV2 (ItemInfo.group_div)
    window_left: Optional[Any] = None
    scale_log2: Optional[Any] = None


def item_row_values(hooks, info: ItemInfo, tc: TraceCtx, tScS, n_rows: int, head_dim: int, heads_per_item: int = 1):
    """Per accumulator row r of this thread (packed row ``info.row_start + tScS[r, 0][0]``):
    (ctx, kv_range lo, hi, mask_bits) for the item (``Hooks.row_values``: once-values evaluated
    here, once per item, and reused by the per-block calls)."""
    out = []
    for r in range(n_rows):
        ctx = row_ctx(info, info.row_start + tScS[r, 0][0], head_dim, tc.sm_scale, heads_per_item)
        out.append((ctx, *hooks.row_values(ctx, tc.vargs)))
    return out


def row_ctx(info: ItemInfo, row, head_dim: int, sm_scale, heads_per_item: int = 1) -> Ctx:
    """The hook context of packed query row ``row`` of an item.  With head packing
    (``heads_per_item`` = H > 1) the plan's group is H x the model's and the row's own kv head
    is found by it."""
    g = info.group
    qo_head = info.kv_head * g + row % g
    kv_head = info.kv_head
    if heads_per_item > 1:
        kv_head = qo_head // (g // heads_per_item)
    return Ctx(
        batch=info.req,
        qo_head=qo_head,
        kv_head=kv_head,
        q_pos=info.qpos_base + row // g,
        qo_len=info.qo_len,
        kv_len=info.kv_len,
        head_dim=head_dim,
        sm_scale=sm_scale,
    )
