"""Run the fp8 attention bench case (ragged 2 x 8192, 16 heads, hd128, e4m3 q / k / v, bf16 out) a
few times, for profilers (ncu / nsys); ``--knob k=v`` swaps in a knob kernel (as fp8_knobs.py).

    ncu --clock-control none -k regex:kernel_fp8 --launch-skip 1 --launch-count 1 \\
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis python scripts/profile_fp8.py [--causal] [--impl flashinfer]

``--impl flashinfer``: FlashInfer's fa3 fp8 prefill on the same inputs (its fp8 module: the
overlay of ``fi_fp8_overlay.py``); its kernel name is not ``kernel_fp8``: profile without ``-k``
(the script launches no other kernel) and skip the warm-up call's launch.

What to read: whether the tensor pipe is busy while the softmax runs (the kernel's 128 x 192 step
takes about the GEMMs' plus the softmax's time, BENCHMARKS.md "fp8 attention"), and the consumer
warps' stall reasons (barrier = the ping-pong / item barriers, long scoreboard / wait = wgmma
waits, MIO / math throttle = MUFU)."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from cute_attn.bench import peers
from cute_attn.bench.fp8_attention import FP8, _fp8_run
from cute_attn.bench.prefill import DT, B, H, S, _indptr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--knob", action="append", default=[], help="spec knob k=v (repeatable)")
    ap.add_argument("--impl", choices=("ours", "flashinfer"), default="ours")
    a = ap.parse_args()
    from cute_attn.runtime.loader import kernel

    gen = torch.Generator().manual_seed(0)
    q8, k8, v8 = (torch.randn(B * S, H, 128, generator=gen).to(DT).to(FP8).cuda() for _ in range(3))
    if a.impl == "flashinfer":  # unit scales, passed positionally as the bench does
        fi = peers.flashinfer()
        w, call = _fp8_run(fi, _indptr([S] * B), q8, k8, v8, a.causal, fi.prefill_kw, (1.0, 1.0, 1.0))
    else:
        w, call = _fp8_run(peers.ours(), _indptr([S] * B), q8, k8, v8, a.causal)
    if a.knob:
        kn = {k: int(v) for k, v in (x.split("=") for x in a.knob)}
        st = w._state
        w._state = dataclasses.replace(st, attn=kernel(st.family, st.arch, **st.spec_kw, **kn))
    for _ in range(a.iters):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
