"""Host -> device copies and events through the CUDA runtime directly (ctypes), for the one
copy a plan upload makes per engine step.

``tensor.copy_(pinned, non_blocking=True)`` and ``torch.cuda.Event().record()`` cost ~20 us of
Python and dispatch per step on an H200 host core (``current_stream()`` alone walks the device
guards); ``cudaMemcpyAsync`` / ``cudaEventRecord`` on torch's current raw stream do the same work
in a few ctypes calls. The ordering is torch's: the copy is enqueued on the current stream of the
destination's device. Torch does not see these copies, so the caller keeps its host buffer alive
until the copy's event has passed (``sched.staging.Staging`` waits for its events before it lets
a buffer go).

Two rules keep these calls from disturbing torch:
- **The last error.** The runtime records every failed call's code, ``cudaErrorNotReady`` of a
  pending event's query included, as the thread's last error, and torch reads it after its
  own kernel launches (``cudaGetLastError``): a code left there surfaces as torch's error on
  an unrelated op.  Every call here that does not return success is followed by
  ``cudaGetLastError()`` (torch's own ``Event.query`` does the same).
- **Finalizers.** An event is finished (waited for, destroyed) once: by its owner's finalizer
  or its own, whichever a gc pass runs first (the order within a reference cycle is
  arbitrary), and afterwards it reads as passed -- a destroyed handle is never queried.  A
  finalizer may run while a stream is being captured (any thread, global capture mode, where
  a synchronizing call would invalidate the capture), so it switches its thread to the
  relaxed capture mode around the wait.
"""

from __future__ import annotations

import ctypes

from .loader import cuda_error_string, cudart, current_stream

_H2D = 1  # cudaMemcpyHostToDevice
_NOT_READY = 600  # cudaErrorNotReady
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed

_RT = None


def _rt():
    global _RT
    if _RT is None:
        rt = cudart()
        rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        rt.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        rt.cudaEventQuery.argtypes = [ctypes.c_void_p]
        rt.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
        rt.cudaEventDestroy.argtypes = [ctypes.c_void_p]
        rt.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        rt.cudaThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
        rt.cudaGetLastError.argtypes = []
        # (stream, status*, id*, then CUDA 13's optional graph / dependency outputs: NULL)
        rt.cudaStreamGetCaptureInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                                ctypes.POINTER(ctypes.c_ulonglong)] + [ctypes.c_void_p] * 4  # fmt: skip
        _RT = rt
    return _RT


def _check(code: int, what: str) -> None:
    if code:
        _rt().cudaGetLastError()  # not torch's to find later
        raise RuntimeError(f"{what} failed: CUDA error {code} ({cuda_error_string(code)})")


class Event:
    """A CUDA event without timing (``cudaEventDisableTiming``)."""

    def __init__(self):
        self._rt = _rt()
        h = ctypes.c_void_p()
        _check(self._rt.cudaEventCreateWithFlags(ctypes.byref(h), _DISABLE_TIMING), "cudaEventCreateWithFlags")
        self.handle = h.value

    def record(self, stream: int) -> None:
        _check(self._rt.cudaEventRecord(self.handle, stream), "cudaEventRecord")

    def query(self) -> bool:
        """Whether the recorded work has passed (a finished event has)."""
        if self.handle is None:
            return True
        code = self._rt.cudaEventQuery(self.handle)
        if code == _NOT_READY:
            self._rt.cudaGetLastError()  # recorded as the last error: clear it
            return False
        _check(code, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        if self.handle is not None:
            _check(self._rt.cudaEventSynchronize(self.handle), "cudaEventSynchronize")

    def finish(self) -> None:
        """Wait for the recorded work, then destroy the event; once, never raising (finalizers
        call it: the module doc's rules)."""
        h, self.handle = self.handle, None
        if h is None:
            return
        try:
            rt = self._rt
            mode = ctypes.c_int(_CAPTURE_RELAXED)
            rt.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))
            try:
                rt.cudaEventSynchronize(h)
                rt.cudaEventDestroy(h)
            finally:
                rt.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))  # the thread's mode back
                rt.cudaGetLastError()
        except Exception:  # noqa: BLE001 -- interpreter shutdown: the runtime may be gone
            pass

    def __del__(self):
        self.finish()


def copy_h2d(dst_ptr: int, src_ptr: int, nbytes: int, device_index: int) -> int:
    """Enqueue ``nbytes`` from pinned host memory to device memory on torch's current stream of
    ``device_index``; returns that stream (for the caller's event)."""
    stream = current_stream(device_index)
    _check(_rt().cudaMemcpyAsync(dst_ptr, src_ptr, nbytes, _H2D, stream), "cudaMemcpyAsync")
    return stream


def capture_id(device_index: int) -> int:
    """The id of the capture under way on torch's current stream of ``device_index`` (unique per
    capture in the process), or 0 where none is."""
    status, cid = ctypes.c_int(0), ctypes.c_ulonglong(0)
    code = _rt().cudaStreamGetCaptureInfo(current_stream(device_index), ctypes.byref(status), ctypes.byref(cid),
                                          None, None, None, None)  # fmt: skip
    _check(code, "cudaStreamGetCaptureInfo")
    return int(cid.value) if status.value else 0
