"""Host -> device copies and events through the CUDA runtime directly (ctypes), for the one
copy a plan upload makes per engine step.

``tensor.copy_(pinned, non_blocking=True)`` and ``torch.cuda.Event().record()`` cost ~20 us of
Python and dispatch per step on an H200 host core (``current_stream()`` alone walks the device
guards); ``cudaMemcpyAsync`` / ``cudaEventRecord`` on torch's current raw stream do the same work
in a few ctypes calls. The ordering is torch's: the copy is enqueued on the current stream of the
destination's device. Torch does not see these copies, so the caller keeps its host buffer alive
until the copy's event has passed (``sched.staging.Staging`` waits for its events before it lets
a buffer go).
"""

from __future__ import annotations

import ctypes

from .loader import cuda_error_string, cudart, current_stream

_H2D = 1  # cudaMemcpyHostToDevice
_NOT_READY = 600  # cudaErrorNotReady
_DISABLE_TIMING = 2  # cudaEventDisableTiming

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
        # (stream, status*, id*, then CUDA 13's optional graph / dependency outputs: NULL)
        rt.cudaStreamGetCaptureInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                                ctypes.POINTER(ctypes.c_ulonglong)] + [ctypes.c_void_p] * 4  # fmt: skip
        _RT = rt
    return _RT


def _check(code: int, what: str) -> None:
    if code:
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
        code = self._rt.cudaEventQuery(self.handle)
        if code == _NOT_READY:
            return False
        _check(code, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        _check(self._rt.cudaEventSynchronize(self.handle), "cudaEventSynchronize")

    def __del__(self):
        try:
            self._rt.cudaEventDestroy(self.handle)
        except Exception:  # noqa: BLE001 -- interpreter shutdown: the runtime may be gone
            pass


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
