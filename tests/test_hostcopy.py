"""``runtime/hostcopy``'s events and their owners' finalizers against a fake CUDA runtime (no
GPU): no failed call's code is left as the thread's last error for torch to find after its
next launch, a finished (destroyed) event is never queried or waited on again, the wait in a
finalizer runs in the relaxed capture mode, and an owner finalized after its events (a gc pass
over a reference cycle runs finalizers in any order) makes no call on their handles."""

import gc
import random

import pytest

from cute_attn.runtime import hostcopy, loader
from cute_attn.sched.staging import Staging
from cute_attn.wrappers.kept_device import DeviceKeep

NOT_READY, RELAXED, GLOBAL = 600, 2, 0


class FakeRuntime:
    """The runtime calls hostcopy makes, with the bookkeeping of the real one: live handles,
    pending events, the thread's last error and capture mode; misuse is recorded, not raised
    (finalizers swallow exceptions)."""

    def __init__(self):
        self.live, self.pending, self.misuse, self.log = set(), set(), [], []
        self.last_error, self.mode, self._next = 0, GLOBAL, random.randrange(1, 1 << 20) * 16

    def _use(self, name, h):
        self.log.append((name, h, self.mode))
        if h not in self.live:
            self.misuse.append((name, h))
            self.last_error = 709  # what the runtime said: cudaErrorContextIsDestroyed
            return 709
        return 0

    def cudaEventCreateWithFlags(self, ptr, flags):
        self._next += 16
        ptr._obj.value = self._next
        self.live.add(self._next)
        return 0

    def cudaEventRecord(self, h, stream):
        code = self._use("record", h)
        self.pending.add(h)
        return code

    def cudaEventQuery(self, h):
        code = self._use("query", h)
        if code == 0 and h in self.pending:
            self.last_error = code = NOT_READY
        return code

    def cudaEventSynchronize(self, h):
        code = self._use("synchronize", h)
        self.pending.discard(h)
        return code

    def cudaEventDestroy(self, h):
        code = self._use("destroy", h)
        self.live.discard(h)
        return code

    def cudaThreadExchangeStreamCaptureMode(self, pmode):
        self.mode, pmode._obj.value = pmode._obj.value, self.mode
        return 0

    def cudaGetLastError(self):
        e, self.last_error = self.last_error, 0
        return e

    def cudaGetErrorString(self, code):
        return b"fake error"


@pytest.fixture
def rt(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(hostcopy, "_RT", fake)
    monkeypatch.setattr(loader, "cudart", lambda: fake)
    return fake


def test_query_of_a_pending_event_leaves_no_error(rt):
    ev = hostcopy.Event()
    ev.record(0)
    assert ev.query() is False and rt.last_error == 0  # NotReady is recorded: cleared
    ev.synchronize()
    assert ev.query() is True and rt.last_error == 0 and not rt.misuse


def test_finish_waits_in_relaxed_mode_then_destroys_once(rt):
    ev = hostcopy.Event()
    h = ev.handle
    ev.record(0)
    ev.finish()
    assert [(n, m) for n, x, m in rt.log if x == h] == [
        ("record", GLOBAL),
        ("synchronize", RELAXED),
        ("destroy", RELAXED),
    ]
    assert rt.mode == GLOBAL and rt.last_error == 0 and h not in rt.live and ev.handle is None
    n = len(rt.log)
    ev.finish()
    del ev
    gc.collect()
    assert ev_calls_after(rt, n) == [] and not rt.misuse


def ev_calls_after(rt, n):
    return rt.log[n:]


def test_a_finished_event_reads_as_passed_without_a_call(rt):
    ev = hostcopy.Event()
    ev.record(0)
    ev.finish()
    n = len(rt.log)
    assert ev.query() is True
    ev.synchronize()
    assert rt.log[n:] == [] and not rt.misuse and rt.last_error == 0


def test_failed_calls_clear_the_last_error(rt):
    with pytest.raises(RuntimeError, match="CUDA error 709"):
        hostcopy._check(709, "cudaEventRecord")
    assert rt.last_error == 0

    class Mod:
        class spec:
            describe = staticmethod(lambda: "paged_decode[...]")

    rt.last_error = 719
    with pytest.raises(loader.LaunchError, match="CUDA error 719"):
        loader.Module._check(Mod(), 719, "launch")
    assert rt.last_error == 0


def _owner(cls, events):
    """A Staging / DeviceKeep holding only ``events`` (what their finalizers read)."""
    o = object.__new__(cls)
    o._events = events
    return o


@pytest.mark.parametrize("cls", [Staging, DeviceKeep])
@pytest.mark.parametrize("events_first", [True, False])
def test_owner_and_events_finalized_in_either_order(rt, cls, events_first):
    evs = [hostcopy.Event(), hostcopy.Event()]
    for ev in evs:
        ev.record(0)
    handles = [ev.handle for ev in evs]
    owner = _owner(cls, evs + ([None] if cls is Staging else []))
    if events_first:  # what a gc pass may do within a cycle: the events' finalizers first
        for ev in evs:
            ev.__del__()
    owner.__del__()
    for ev in evs:
        ev.__del__()
    for h in handles:  # each waited for (relaxed mode) before it was destroyed, once
        calls = [(n, m) for n, x, m in rt.log if x == h]
        assert calls == [("record", GLOBAL), ("synchronize", RELAXED), ("destroy", RELAXED)], calls
    assert not rt.misuse and rt.last_error == 0 and rt.mode == GLOBAL and not rt.live


def test_gc_of_a_cycle_of_owner_and_events(rt):
    evs = [hostcopy.Event() for _ in range(3)]
    for ev in evs:
        ev.record(0)
    owner = _owner(Staging, list(evs))
    owner.cycle = owner  # a reference cycle: only the collector frees it
    for ev in evs:
        ev.owner = owner
    del owner, ev, evs
    gc.collect()
    assert not rt.live and not rt.pending and not rt.misuse and rt.last_error == 0
