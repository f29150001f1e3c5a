"""A plan's work item as the kernels read it (contract: ``cute_attn.sched``; field order:
``cute_attn.abi.records.W_*``).  Written once for every kernel that walks a work list."""

from __future__ import annotations

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
