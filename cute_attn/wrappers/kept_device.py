"""Kept decode plans updated on the device: the per-step re-plan of a CUDA-graph decode wrapper
without host work (``sched/reuse.py`` says what a kept plan is; ``kernels/kept_update.py`` is
the update).

Each full plan of a CUDA-graph decode wrapper also uploads its items keyed by length rank
(``KeptPlan.device_records``).  A per-step re-plan (``fast_decode_plan``, vLLM's
``_cached_module.plan``) then only marks the records stale: the first ``run()`` after it --
in a captured graph, the first layer's -- launches the update, which reads the lengths the
engine wrote into the index buffers and rewrites the records before the attention kernel reads
them.  The update models the CTAs' balance too and writes a status word into pinned host
memory; the step after one found out of balance plans anew on the host (a late re-plan costs
time, never correctness: kept items are a correct plan of any lengths).

Every capture of ``run()`` holds one update (its first ``run()`` of each capture), so a graph
replayed after any number of per-step re-plans updates its own records.  A plan that is not
kept (a batch-invariant split, more than ``MAX_BATCH`` requests) switches the update off: the
host then writes the records, and the captured update returns at once.
"""

from __future__ import annotations

import torch

from ..abi.kept import K_ON, KEPT_ITEM_FIELDS, KEPT_PARAMS
from ..runtime.hostcopy import Event, capture_id, copy_h2d

_EPOCHS = 1 << 29  # the status word holds epoch * 4 + bits in an int32


class DeviceKeep:
    """The device half of one plan buffer's kept plans: the records, their pinned staging, the
    status word and the update's launch."""

    def __init__(self, plan_buf: torch.Tensor, max_items: int, max_merges: int, module):
        self.plan_buf = plan_buf  # the plan records these belong to (made anew with them)
        self._module = module
        n = KEPT_PARAMS + KEPT_ITEM_FIELDS * max_items + max_merges
        self._buf = torch.zeros(n, dtype=torch.int32, device=plan_buf.device)
        self._params = self._buf[:KEPT_PARAMS]
        self._items = self._buf[KEPT_PARAMS : KEPT_PARAMS + KEPT_ITEM_FIELDS * max_items].view(-1, KEPT_ITEM_FIELDS)
        self._merge_rank = self._buf[KEPT_PARAMS + KEPT_ITEM_FIELDS * max_items :]
        self._max = (max_items, max_merges)
        # two pinned stagings used in turn, each reused once its upload has passed
        self._staging = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0
        self._status = torch.full((1,), -1, dtype=torch.int32, pin_memory=True)
        self._status_np = self._status.numpy()
        self.epoch = 0
        self.on = False  # the device holds a kept plan that the update follows
        self.pending = False  # the records on the device are stale until the next update
        self._capture = None  # id of the last capture that holds an update

    def _upload(self, words: int, fill) -> None:
        i = self._turn
        self._turn ^= 1
        ev = self._events[i]
        if ev is not None and not ev.query():
            ev.synchronize()
        host = self._staging[i].numpy()
        fill(host)
        if ev is None:
            ev = self._events[i] = Event()
        ev.record(copy_h2d(self._buf.data_ptr(), self._staging[i].data_ptr(), 4 * words, self._buf.device.index))

    def load(self, kept, page_size: int, max_kv_len: int) -> bool:
        """Upload a full plan's kept records (``KeptPlan``; None: the plan is not kept). False
        where the update cannot follow it (then it is off)."""
        got = None if kept is None else kept.device_records(self.epoch + 1, page_size, max_kv_len)
        if got is None or got[1].shape[0] > self._max[0] or got[2].shape[0] > self._max[1]:
            self.off()
            return False
        params, items, merge_rank = got
        self.epoch = (self.epoch + 1) % _EPOCHS
        n, m = items.shape[0], merge_rank.shape[0]
        lo = KEPT_PARAMS + KEPT_ITEM_FIELDS * self._max[0]

        def fill(h):
            h[:KEPT_PARAMS] = params
            h[KEPT_PARAMS : KEPT_PARAMS + KEPT_ITEM_FIELDS * n] = items.reshape(-1)
            h[lo : lo + m] = merge_rank

        # merge ranks sit past the items' capacity: one copy up to them when there are any
        self._upload(lo + m if m else KEPT_PARAMS + KEPT_ITEM_FIELDS * n, fill)
        self.on = self.pending = True
        return True

    def off(self) -> None:
        if self.on:

            def fill(h):
                h[K_ON] = 0

            self._upload(1, fill)
        self.on = self.pending = False

    def status(self) -> int:
        """The update's status bits for the current kept plan (0 before its first update)."""
        v = int(self._status_np[0])
        return v & 3 if v >= 0 and v >> 2 == self.epoch else 0

    def before_run(self, kv_indptr, last_page_len, views) -> None:
        """Launch the update where the records may be stale for what runs next: after a
        per-step re-plan, and once in every capture."""
        if not self.on:
            return
        if torch.cuda.is_current_stream_capturing():
            cid = capture_id(self._buf.device.index)
            if cid == self._capture:
                return
            self._capture = cid
        elif not self.pending:
            return
        self.launch(kv_indptr, last_page_len, views)
        self.pending = False

    def launch(self, kv_indptr, last_page_len, views) -> None:
        """One update on the current stream (``before_run`` decides when)."""
        self._module(
            kv_indptr,
            last_page_len,
            self._params,
            self._items,
            self._merge_rank,
            views["work_items"],
            views["work_indptr"],
            views["merge_tasks"],
            self._status,
        )

    def __del__(self):
        for ev in self._events:  # the pinned stagings must outlive their copies
            if ev is not None:
                ev.finish()
