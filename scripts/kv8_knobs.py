#!/usr/bin/env python3
"""A/B of the ways a ragged fp8 cache reaches the prefill kernel, in one GPU visit, on the fp8-KV
bench's cases (ragged 2 x 8192, 16 heads, hd128, bf16 queries, e4m3 K / V, causal and not),
timed in turns (``bench.common.interleaved``) beside the bf16 cache of the same values:

* ``kv_pass``: the standalone KV pass, then the kernel (``families.backends.KV8_PASS_IN_KERNEL`` off);
* ``in_kernel``: the kernel's own widening (``kernels/prefill_sm90_kv8.py``, ``kv_pass=False``);
* ``pass_in_kernel``: the pass run by the kernel's producer warps (``kernels/prefill_sm90_kv8_pass.py``);
* where the pass-in-kernel time goes, by what its state holds at launch: ``no_waits`` (every
  flag set, the counter at 0: the helpers convert everything while the consumers never wait)
  and ``idle_helpers`` (every task claimed and published: nobody converts or checks a flag);
  ``end_order``: its tasks nearest a request's end first instead of in the order the plan's
  CTAs need them (``sched.pass_order``);
* the knob variants (spec parameters over a path's kernel, ``KNOBS``).

Every fp8 output must equal the standalone pass's bit for bit (all convert exactly) before it
is timed.

    python scripts/kv8_knobs.py compile           # CPU box: the knob kernels into $CUTE_ATTN_CACHE_DIR
    python scripts/kv8_knobs.py run [--json f]    # GPU machine

A development tool; ``python -m cute_attn bench --only fp8prefill`` is the benchmark of record."""

from __future__ import annotations

import argparse
import json
import sys

# (name, the path whose kernel it modifies, spec parameters over it)
KNOBS = [
    ("kv8_cvt=1", "in_kernel", dict(kv8_cvt=1)),  # widening by cvt (F2FP) instead of integer ops
    ("regs24", "pass_in_kernel", dict(producer_regs=24)),  # producer 24 registers, consumers 240
]
PATH_KW = {"in_kernel": dict(kv_pass=False), "pass_in_kernel": dict(kv_pass=True)}


def specs():
    from cute_attn.families.spec import Spec

    kw = dict(dtype="bf16", head_dim=128, tile_q=128, paged=False, soft_cap=False, window=False, kv_dtype="e4m3")
    pass_kw = {"in_kernel": {}, "pass_in_kernel": {"kv8_pass": 1}}
    return [
        Spec.make("batch_prefill_sm90", "sm_90a", **kw, causal=c, **knob, **pass_kw[path])
        for c in (True, False)
        for _, path, knob in KNOBS
    ]


def _preset_state(call, all_done: bool) -> None:
    """Make ``call``'s run() start its pass-in-kernel launch with every flag set and the counter
    at 0 (helpers convert, nobody waits) or every task claimed and published (``all_done``)."""
    import torch

    state, plan = call.wrapper._state.kv8_pass
    pattern = torch.ones_like(state)
    n = int(plan[0].item())
    pattern[0] = pattern[1] = n if all_done else 0  # the claim counter, the published count
    state.zero_ = lambda: state.copy_(pattern)  # what run() calls before each launch: one copy


def _end_order(call, S: int) -> None:
    """Reorder ``call``'s pass tasks: nearest a request's end first (requests of S keys)."""
    import torch

    plan = call.wrapper._state.kv8_pass[1]
    n = int(plan[0].item())
    tasks = plan[3 : 3 + 2 * n].view(-1, 2)
    blocks = -(-S // 128)
    left = (blocks - 1 - tasks[:, 0].long() % blocks) * 1000 + tasks[:, 0].long()
    plan[3 : 3 + 2 * n].copy_(tasks[torch.argsort(left, stable=True)].reshape(-1))


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
        fp8_call = lambda path: peers.ragged_prefill(  # noqa: E731
            lib, ws(), ind, q, k8, v8, causal, 128, kv_data_type=fp8, **PATH_KW[path]
        )
        backends.KV8_PASS_IN_KERNEL = False
        runs = {
            "bf16": peers.ragged_prefill(lib, ws(), ind, q, k8.to(DT), v8.to(DT), causal, 128),
            "kv_pass": fp8_call("pass_in_kernel"),
            "in_kernel": fp8_call("in_kernel"),
        }
        backends.KV8_PASS_IN_KERNEL = True
        for name in ("pass_in_kernel", "no_waits", "idle_helpers", "end_order"):
            runs[name] = fp8_call("pass_in_kernel")  # each planned and run once as it is
            if name in ("no_waits", "idle_helpers"):
                _preset_state(runs[name], name == "idle_helpers")
            elif name == "end_order":
                _end_order(runs[name], S)
        assert runs["in_kernel"].wrapper._spec_kw.get("kv_dtype") == "e4m3", runs["in_kernel"].wrapper._spec_kw
        assert runs["pass_in_kernel"].wrapper._spec_kw.get("kv8_pass") == 1, runs["pass_in_kernel"].wrapper._spec_kw
        assert "kv_dtype" not in runs["kv_pass"].wrapper._spec_kw
        for name, path, kn in KNOBS:
            call = fp8_call(path)
            try:
                call.wrapper._binding.module = kernel("batch_prefill_sm90", "sm_90a", **call.wrapper._spec_kw, **kn)
            except KernelNotAvailable:
                print(f"{name}: not compiled, left out")
                continue
            runs[name] = call
        for r in runs.values():
            r()
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
            print(f"{tag:<10} {n:<16} {us:9.1f} us {_tflops(flops, us):7.1f} TFLOP/s  vs bf16 {us / t['bf16']:6.3f}")
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
