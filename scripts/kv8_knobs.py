#!/usr/bin/env python3
"""A/B of the ways a ragged fp8 cache reaches the prefill kernel, in one GPU visit, on the fp8-KV
bench's cases (ragged 2 x 8192, 16 heads, hd128, bf16 queries, e4m3 K / V, causal and not): the
kernel's own widening (``kernels/prefill_sm90_kv8.py``, ``kv_pass=False``) and its knob variants
(spec parameters over it, e.g. ``kv8_cvt=1``), the standalone KV pass (``kv_pass=True`` with
``families.backends.KV8_PASS_IN_KERNEL`` off), the pass inside the kernel
(``kernels/prefill_sm90_kv8_pass.py``) and the bf16 cache of the same values, timed in turns
(``bench.common.interleaved``).  Every fp8 output must equal the pass's bit for bit
(both widen exactly) before it is timed.

    python scripts/kv8_knobs.py compile           # CPU box: the knob kernels into $CUTE_ATTN_CACHE_DIR
    python scripts/kv8_knobs.py run [--json f]    # GPU machine

A development tool; ``python -m cute_attn bench --only fp8prefill`` is the benchmark of record."""

from __future__ import annotations

import argparse
import json
import sys

KNOBS = [dict(kv8_cvt=1)]  # widening by cvt (F2FP) instead of integer ops


def _spec_kw(causal):
    return dict(dtype="bf16", head_dim=128, tile_q=128, paged=False, causal=causal, soft_cap=False, window=False)


def specs():
    from cute_attn.families.spec import Spec

    return [
        Spec.make("batch_prefill_sm90", "sm_90a", **_spec_kw(c), kv_dtype="e4m3", **k)
        for c in (True, False)
        for k in KNOBS
    ]


def run(json_path=None) -> int:
    import torch

    from cute_attn.bench import peers
    from cute_attn.bench.common import interleaved
    from cute_attn.bench.prefill import DT, B, H, S, _flops, _indptr, _tflops
    from cute_attn.families import backends
    from cute_attn.runtime.loader import KernelNotAvailable, kernel

    lib = peers.ours()
    gen = torch.Generator().manual_seed(1)
    lens = [S] * B
    ind = _indptr(lens)
    fp8 = torch.float8_e4m3fn
    out = {}
    for causal in (True, False):
        q = torch.randn(B * S, H, 128, generator=gen).to(DT).cuda()
        k8, v8 = (torch.randn(B * S, H, 128, generator=gen).to(fp8).cuda() for _ in range(2))
        ws = lambda: torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
        pass_kw = dict(kv_data_type=fp8, kv_pass=True)
        backends.KV8_PASS_IN_KERNEL = False
        runs = {
            "bf16": peers.ragged_prefill(lib, ws(), ind, q, k8.to(DT), v8.to(DT), causal, 128),
            "kv_pass": peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, **pass_kw),
            "in_kernel": peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, kv_data_type=fp8, kv_pass=False),
        }
        backends.KV8_PASS_IN_KERNEL = True
        runs["pass_in_kernel"] = peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, **pass_kw)
        assert runs["in_kernel"].wrapper._spec_kw.get("kv_dtype") == "e4m3", runs["in_kernel"].wrapper._spec_kw
        assert runs["pass_in_kernel"].wrapper._spec_kw.get("kv8_pass") == 1, runs["pass_in_kernel"].wrapper._spec_kw
        assert "kv_dtype" not in runs["kv_pass"].wrapper._spec_kw
        for kn in KNOBS:
            name = ",".join(f"{k}={v}" for k, v in kn.items())
            call = peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, kv_data_type=fp8, kv_pass=False)
            try:
                call.wrapper._binding.module = kernel("batch_prefill_sm90", "sm_90a", **call.wrapper._spec_kw, **kn)
            except KernelNotAvailable:
                print(f"{name}: not compiled, left out")
                continue
            call()
            runs[name] = call
        torch.cuda.synchronize()
        ref = runs["kv_pass"].out
        same = {n: torch.equal(r.out, ref) for n, r in runs.items() if n not in ("bf16", "kv_pass")}
        for n, ok in same.items():
            if not ok:
                print(f"{n}: output DIFFERS from the KV pass's ({(runs[n].out.float() - ref.float()).abs().max()})")
        t = interleaved({n: r for n, r in runs.items() if same.get(n, True)}, calls=15)
        flops = _flops(lens, H, 128, causal)
        tag = "causal" if causal else "noncausal"
        for n, us in t.items():
            out[f"{tag}/{n}"] = dict(us=us, tflops=_tflops(flops, us), vs_bf16=us / t["bf16"])
            print(f"{tag:<10} {n:<14} {us:9.1f} us {_tflops(flops, us):7.1f} TFLOP/s  vs bf16 {us / t['bf16']:6.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("compile", "run"))
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.step == "compile":
        import subprocess

        cmd = [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "-j", "2"]
        return subprocess.call(cmd + sum([["--spec", s.cli()] for s in specs()], []))
    return run(a.json)


if __name__ == "__main__":
    sys.exit(main())
