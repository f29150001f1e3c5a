#!/usr/bin/env python3
"""Host time of decode re-planning without a GPU: ``bench_host.py``'s traces and calls (a
CUDA-graph decode wrapper, 32 / 8 heads, hd128, page 16, batch 64 / 256 / 1024) on an
H200-shaped grid (132 SMs x 2 CTAs, the decode backend's cost model), with what needs a GPU
stubbed: the device queries, the kernel loader, and the device buffers (CPU tensors that pass
the wrappers' ``is_cuda`` checks, so the upload is a host memcpy of the same bytes instead of
an async H2D copy).  What is timed is the Python / numpy work of one engine step.  One JSON
line per (call, trace, batch).  Pin it to one core:

    PYTHONPATH=. taskset -c 0 python scripts/bench_plan_host.py [--traces steady,churn]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HQ, HK, D, PS = 32, 8, 128, 16
NUM_SMS = 132  # H100 / H200


class _FakeCuda(torch.Tensor):
    """A CPU tensor that passes the wrappers' ``is_cuda`` checks (workspace, graph buffers),
    without a subclass's Python dispatch on every call (a real CUDA tensor has none)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True


class _Event:
    def record(self, *a):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _Module:
    """The kernel loader's stand-in: plan() only loads modules, nothing is launched."""

    def __call__(self, *a, **k):
        raise RuntimeError("bench_plan_host launches nothing")


def stub_gpu() -> None:
    import cute_attn.wrappers.decode as dec
    import cute_attn.wrappers.decode_engine as eng

    for m in (dec, eng):
        m.arch_of_index = lambda i: "sm_90a"
        m.sm_count_of_index = lambda i: NUM_SMS
    dec.kernel = lambda family, arch, **params: _Module()
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.Event = _Event


class _FakeKeep:
    """``kept_device.DeviceKeep`` without a device: every update found its plan balanced, so
    the host's per-step work is what it is on a GPU (the status read included)."""

    def __init__(self):
        import numpy as np

        self.on = self.pending = False
        self.epoch = 0
        self._status_np = np.zeros(1, np.int32)

    def load(self, kept, page_size, max_kv_len):
        self.on = kept is not None and kept.device_records(1, page_size, max_kv_len) is not None
        return self.on

    def off(self):
        self.on = False

    def status(self):
        return int(self._status_np[0])


def stub_device_keep() -> None:
    """Kept plans followed on the device (``wrappers/kept_device.py``), as on a GPU host."""
    import cute_attn.wrappers.decode as dec

    def keep(self, page_size, arch):
        if self._dev_keep is None:
            self._dev_keep = _FakeKeep()
        self._dev_keep.load(self._planner.kept(), page_size, self._planner.limits.max_kv_len)

    dec.BatchDecodeWithPagedKVCacheWrapper._keep_on_device = keep


def fake_cuda(t):
    return torch.Tensor._make_subclass(_FakeCuda, t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--traces", default="steady,churn,random")
    ap.add_argument("--host-keep", action="store_true", help="kept plans updated on the host (no device update)")
    a = ap.parse_args()
    # one core: torch's intra-op threads would make the host copy wait on a thread pool (a
    # pinned H2D copy on a GPU host is a cudaMemcpyAsync, no pool)
    torch.set_num_threads(1)
    stub_gpu()
    if not a.host_keep:
        stub_device_keep()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_host import ours, summary, traces

    for b in [int(x) for x in a.batches.split(",")]:
        for trace, steps in traces(b).items():
            if trace not in a.traces.split(","):
                continue
            for call, (ts, full) in ours(b, steps, fake_cuda).items():
                row = dict(call=call, trace=trace, batch=b, **summary(ts), full_plans=round(full, 3))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
