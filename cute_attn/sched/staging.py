"""Host staging of plans and their upload: pinned buffers used in turn, one copy per plan.

A plan is written into the staging buffer in turn and copied from there to the device with one
non-blocking copy, so ``plan()`` never waits on the GPU. With ``num_staging`` buffers a plan
never overwrites bytes an earlier upload may still be reading: each upload records a CUDA
event, and a buffer is reused only once its event has passed (a wait happens only if the CPU
is that many plans ahead of the copies). A kept plan (``reuse``) rewrites only the changed columns of
the work items and merge tasks, and its upload carries only those when the device already holds the rest of its
full plan.
"""

from __future__ import annotations

import numpy as np

from . import workspace as ws

assert ws.W_KV_END == ws.W_KV_START + 1  # stage_kept writes both in one slice


def _host_buffer(nbytes: int, pin: bool):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class Staging:
    def __init__(self, layout, num_ctas: int, num_staging: int, pin_memory: bool):
        self.layout = layout
        self._buffers = [_host_buffer(layout.int_bytes, pin_memory) for _ in range(num_staging)]
        self._events = [None] * num_staging
        self._views = [self._section_views(t.numpy(), num_ctas) for t in self._buffers]
        self._holds = [None] * num_staging  # the full plan whose meta / CTA lists / merges each holds
        self._turn = 0
        self._staged = None  # (buffer index, first byte, end byte) of the last staged plan
        self._uploaded = None  # (device pointer, full plan) of the last upload
        self._items_at = layout.offset("work_items")
        self._merges_at = layout.offset("merge_tasks")
        assert 0 < self._merges_at < self._items_at  # one copy from the merge tasks to the items
        self._copies = {}  # (buffer, range, destination) -> the upload as a call

    def _section_views(self, buf: np.ndarray, num_ctas: int):
        lay = self.layout

        def sec(name, shape):
            o, n = lay.sections[name]
            return buf[o : o + n].view(np.int32).reshape(shape)

        return dict(
            meta=sec("meta", (ws.META_FIELDS,)),
            work_indptr=sec("work_indptr", (num_ctas + 1,)),
            merge_tasks=sec("merge_tasks", (lay.max_merge_tasks, ws.MERGE_FIELDS)),
            work_items=sec("work_items", (lay.max_work_items, ws.WORK_FIELDS)),
        )

    def _next(self):
        i = self._turn
        self._turn = (i + 1) % len(self._buffers)
        ev = self._events[i]
        if ev is not None and not ev.query():
            ev.synchronize()  # an upload from this buffer is still queued
        return i, self._views[i]

    def _put_full(self, i, v, p) -> None:
        v["meta"][:] = p.meta
        v["work_indptr"][:] = p.work_indptr
        v["merge_tasks"][: p.num_merge_tasks] = p.merge_tasks
        self._holds[i] = p

    def stage(self, p) -> None:
        """Stage a full plan (every section)."""
        i, v = self._next()
        self._put_full(i, v, p)
        v["work_items"][: p.num_work_items] = p.work_items
        # Work items are the last int32 section, so one prefix covers everything in use.
        self._staged = (i, 0, self._items_at + 4 * ws.WORK_FIELDS * p.num_work_items)

    def stage_kept(self, full, req, bounds, lens, merge_req):
        """Stage a kept plan of ``full`` (``reuse``: the same items and CTA lists, new requests
        and lengths): only its changed columns are written, into a buffer that holds ``full``;
        returns (work items, merge tasks) as views of that buffer."""
        i, v = self._next()
        n, m = req.shape[0], merge_req.shape[0]
        w, mt = v["work_items"][:n], v["merge_tasks"][:m]
        if self._holds[i] is not full:
            self._put_full(i, v, full)
            w[:] = full.work_items
        w[:, ws.W_REQ] = req
        w[:, ws.W_QO_OFFSET] = req  # one query token per request
        w[:, ws.W_KV_START : ws.W_KV_END + 1] = bounds
        w[:, ws.W_KV_LEN] = lens
        lo = self._items_at
        if m:
            mt[:, ws.M_REQ] = merge_req
            mt[:, ws.M_QO_OFFSET] = merge_req
            lo = self._merges_at
        self._staged = (i, lo, self._items_at + 4 * ws.WORK_FIELDS * n)
        return w, mt

    def upload(self, workspace) -> None:
        if self._staged is None:
            raise RuntimeError("upload() before any plan()")
        i, lo, hi = self._staged
        full, ptr = self._holds[i], workspace.data_ptr()
        last = self._uploaded
        if lo and (last is None or last[0] != ptr or last[1] is not full):
            lo = 0  # the device does not hold this plan's other sections: copy them too
        key = (i, lo, hi, ptr, workspace.dtype, workspace.numel())
        copy = self._copies.get(key)
        if copy is None:  # decode steps copy the same ranges of the same buffers every time
            if len(self._copies) >= 8:
                self._copies.clear()
            copy = self._copies[key] = self._copy_of(workspace, i, lo, hi)
        copy()
        self._uploaded = (ptr, full)

    def _copy_of(self, workspace, i: int, lo: int, hi: int):
        """The upload of bytes [lo, hi) of buffer i into ``workspace``, as a call: on a CUDA
        device through the runtime directly (``runtime.hostcopy``: ~20 us less host time a step
        than torch's copy_ and Event), else (CPU tests) torch's copy."""
        import torch

        dst = workspace.view(torch.uint8).reshape(-1) if workspace.dtype != torch.uint8 else workspace.reshape(-1)
        if dst.numel() < self.layout.int_bytes:
            raise ValueError(f"workspace has {dst.numel()} bytes, the plan's sections need {self.layout.int_bytes}")
        src = self._buffers[i]
        if dst.device.type == "cuda" and src.is_pinned():
            from ..runtime.hostcopy import Event, copy_h2d

            ev = self._events[i]
            if not isinstance(ev, Event):  # one per buffer, recorded again at each upload from it
                ev = self._events[i] = Event()
            args = (dst.data_ptr() + lo, src.data_ptr() + lo, hi - lo, dst.device.index)
            return lambda: ev.record(copy_h2d(*args))
        d, s = dst[lo:hi], src[lo:hi]

        def copy():
            d.copy_(s, non_blocking=True)
            if d.is_cuda:
                ev = self._events[i] = torch.cuda.Event()
                ev.record()

        return copy

    def __del__(self):
        # torch does not see the runtime's copies: hold the pinned buffers until they are done
        for ev in self._events:
            if hasattr(ev, "finish"):  # runtime.hostcopy.Event: waits, never raises
                ev.finish()
            elif ev is not None:  # torch's event (the copy_ path)
                try:
                    ev.synchronize()
                except Exception:  # noqa: BLE001 -- interpreter shutdown: the runtime may be gone
                    pass
