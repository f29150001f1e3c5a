#!/usr/bin/env python3
"""Where the time of the fp8 pass inside the prefill kernel goes (``kernels/prefill_sm90_kv8_pass.py``),
on the fp8-KV bench's cases (ragged 2 x 8192, 16 heads, hd128, bf16 queries, e4m3 K / V), by
what the pass's state holds at launch -- no other kernel:

* ``pass_in_kernel``: zeroed (the real run);
* ``no_waits``: every flag already set, the counter at 0: the helpers convert everything while
  the consumers never wait (what the helpers' work costs the consumers);
* ``idle_helpers``: every task claimed and published: nobody converts, nobody checks a flag
  (the kernel's time without the pass: its registers, the output through the Q buffer);
* ``regs24``: the real run with the producer at 24 registers and the consumers at 240 (spec
  knob ``producer_regs=24``; the default gives the producer 40 and the consumers 232);
* ``end_order``: zeroed, the tasks nearest a request's end first instead of in the order the
  plan's CTAs first need them (``sched.pass_order``);

beside the bf16 cache and the standalone pass before the kernel, timed in turns
(``bench.common.interleaved``); each output checked against the standalone pass's first.  The
workspace copy holds the converted K / V from the first run, so every variant's output is right.

    python scripts/kv8_pass_probe.py compile              # CPU box: the knob kernels into $CUTE_ATTN_CACHE_DIR
    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/kv8_pass_probe.py [--json f]   # GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys


def run(json_path=None) -> int:
    import torch

    from cute_attn.bench import peers
    from cute_attn.bench.common import interleaved
    from cute_attn.bench.prefill import DT, B, H, S, _flops, _indptr, _tflops
    from cute_attn.families import backends
    from cute_attn.runtime.loader import KernelNotAvailable, kernel

    lib = peers.ours()
    gen = torch.Generator().manual_seed(2)
    lens = [S] * B
    ind = _indptr(lens)
    fp8 = torch.float8_e4m3fn
    ws = lambda: torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
    out = {}

    def with_state(call, counter, flags):
        """``call``'s wrapper launching with this state instead of a zeroed one."""
        state, plan = call.wrapper._state.kv8_pass
        pattern = torch.full_like(state, flags)
        n = int(plan[0].item())
        pattern[0] = n if counter == "done" else 0
        pattern[1] = n if counter == "done" else 0  # the published count: all, or none (flags checked)
        state.zero_ = lambda: state.copy_(pattern)  # what run() calls before each launch: one copy
        return call

    for causal in (True, False):
        q = torch.randn(B * S, H, 128, generator=gen).to(DT).cuda()
        k8, v8 = (torch.randn(B * S, H, 128, generator=gen).to(fp8).cuda() for _ in range(2))
        kw = dict(kv_data_type=fp8, kv_pass=True)
        backends.KV8_PASS_IN_KERNEL = False
        runs = {
            "bf16": peers.ragged_prefill(lib, ws(), ind, q, k8.to(DT), v8.to(DT), causal, 128),
            "host_pass": peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, **kw),
        }
        backends.KV8_PASS_IN_KERNEL = True
        for name, counter, flags in (("pass_in_kernel", 0, 0), ("no_waits", 0, 1), ("idle_helpers", "done", 1)):
            call = peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, **kw)  # a real run first
            assert call.wrapper._spec_kw.get("kv8_pass") == 1, call.wrapper._spec_kw
            runs[name] = with_state(call, counter, flags)
            runs[name]()
        # the producer at 24 registers, the consumers at 240 (the default gives the helpers 40: 232)
        call = peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, **kw)
        try:
            call.wrapper._binding.module = kernel("batch_prefill_sm90", "sm_90a", **call.wrapper._spec_kw,
                                                  producer_regs=24)  # fmt: skip
            call()
            runs["regs24"] = call
        except KernelNotAvailable:
            print("producer_regs=24: not compiled, left out")
        # the tasks nearest each request's end first (the plan's first order), not as needed
        call = peers.ragged_prefill(lib, ws(), ind, q, k8, v8, causal, 128, **kw)
        plan = call.wrapper._state.kv8_pass[1]
        n = int(plan[0].item())
        tasks = plan[3 : 3 + 2 * n].view(-1, 2)
        blocks = -(-S // 128)
        left = (blocks - 1 - tasks[:, 0].long() % blocks) * 1000 + tasks[:, 0].long()  # blocks from the end
        plan[3 : 3 + 2 * n].copy_(tasks[torch.argsort(left, stable=True)].reshape(-1))
        call()
        runs["end_order"] = call
        torch.cuda.synchronize()
        ref = runs["host_pass"].out
        for n, r in runs.items():
            if n != "bf16" and not torch.equal(r.out, ref):
                print(f"{n}: output DIFFERS from the standalone pass's ({(r.out.float() - ref.float()).abs().max()})")
                return 1
        t = interleaved(runs, calls=15)
        flops = _flops(lens, H, 128, causal)
        tag = "causal" if causal else "noncausal"
        for n, us in t.items():
            out[f"{tag}/{n}"] = dict(us=us, tflops=_tflops(flops, us), vs_bf16=us / t["bf16"])
            print(f"{tag:<10} {n:<16} {us:9.1f} us {_tflops(flops, us):7.1f} TFLOP/s  vs bf16 {us / t['bf16']:6.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", nargs="?", choices=("compile", "run"), default="run")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.step == "compile":
        import subprocess

        specs = [
            f"batch_prefill_sm90:causal={c},dtype=bf16,head_dim=128,kv8_pass=1,kv_dtype=e4m3,paged=False,"
            f"producer_regs=24,soft_cap=False,tile_q=128,window=False"
            for c in (True, False)
        ]
        cmd = [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "-j", "2"]
        return subprocess.call(cmd + sum([["--spec", s] for s in specs], []))
    return run(a.json)


if __name__ == "__main__":
    sys.exit(main())
