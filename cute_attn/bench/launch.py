"""Host overhead per launch from Python: CPU time per call, measured while the GPU keeps up.

Three levels: the raw module launch (pre-flattened arguments: pack + ctypes call), the module
called with torch tensors (argument checks + flattening + current stream), and the public op
(validation + output allocation + launch).  A tiny problem keeps GPU time per kernel below
the host time, and a synchronize between batches keeps the launch queue from filling.
"""

from __future__ import annotations

import statistics
import time

import torch


def _host_us(fn, calls: int = 200, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def bench_launch(res, quick: bool) -> None:
    import cute_attn
    from cute_attn.runtime.loader import current_stream, kernel, tensor_fields

    va, vb = (torch.randn(1, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sa, sb = (torch.randn(1, 1, device="cuda") for _ in range(2))
    out, lse = torch.empty_like(va), torch.empty_like(sa)
    mod = kernel(
        "merge_pair",
        "sm_90a" if torch.cuda.get_device_capability()[0] == 9 else "sm_100a",
        dtype="bf16",
        head_dim=128,
        masked=False,
    )
    tensors = (va, sa, vb, sb, out, lse, sa.as_strided((1,), (1,)), 132 * 16)
    flat = sum((tensor_fields(a, t) for a, t in zip(mod.args, tensors[:-1])), []) + [tensors[-1]]
    stream = current_stream(va.get_device())
    rows = [
        ("raw module launch (packed args)", "launch/raw", lambda: mod.launch(flat, stream)),
        ("module call with torch tensors", "launch/module", lambda: mod(*tensors)),
        (
            "public merge_state(out=...)",
            "launch/merge_state_out",
            lambda: cute_attn.merge_state(va, sa, vb, sb, out=out, lse=lse),
        ),
        ("public merge_state (allocating)", "launch/merge_state", lambda: cute_attn.merge_state(va, sa, vb, sb)),
        ("torch.add (for scale)", "launch/torch_add", lambda: torch.add(va, vb, out=out)),
    ]
    print(f"{'host overhead per call':<36} {'us':>7}")
    for name, case, fn in rows:
        us = _host_us(fn, reps=10 if quick else 30)
        res.add(case, "torch" if "torch" in case else "cute_attn", "us", us)
        print(f"{name:<36} {us:7.2f}")
