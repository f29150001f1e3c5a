"""One eager ragged-prefill call of ours or FlashInfer's (fa3) between ``cudaProfilerStart`` /
``Stop``, for Nsight Compute on the same inputs: batch 2 x 8192, 16 / 16 heads, bf16 (the
bench's ``prefill/hd{D}/{causal,noncausal}/s8192``).  ``KNOBS``: spec parameters over the plan's
kernel (ours only), e.g. ``tile_n=128,pin_p=0``; ``kv=e4m3`` (or ``e5m2``) makes K / V an fp8
cache of the same values (ours: the kernel widens it at hd128, ``kernels/prefill_sm90_kv8.py``).

    ncu --profile-from-start off --section SpeedOfLight ... \
        python scripts/profile_prefill.py {ours|flashinfer|portable|fa2} [MODE] [HEAD_DIM] [KNOBS]

MODE: causal, noncausal (default), varlen or bimodal.

``portable``: ours on the portable kernel (``prefill_backend="prefill_mma_sync"``, the planner's
tile; knob ``tile=64`` forces the tile); ``fa2``: FlashInfer's fa2 backend (its mma.sync kernel).

``varlen``: the bench's ``prefill/hd128/causal/varlen32_lognormal2k`` batch (32 lognormal lengths,
causal); ``bimodal``: its ``prefill/hd128/causal/bimodal48`` (8 long prompts among 40 short turns).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from cute_attn.bench import peers
from cute_attn.bench.portable import tile_rule
from cute_attn.bench.prefill import bimodal_lengths, varlen32_lengths


def main():
    impl = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "noncausal"
    causal = mode in ("causal", "varlen", "bimodal")
    d = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    knobs = dict(kv.split("=") for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 and sys.argv[4] else {}
    kv = knobs.pop("kv", None)
    h = 16
    lens = {"varlen": varlen32_lengths, "bimodal": bimodal_lengths}.get(mode, lambda: [8192] * 2)()
    ind = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    q = torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    lib = peers.flashinfer() if impl in ("flashinfer", "fa2") else peers.ours()
    if impl == "fa2":
        lib = peers.Lib(lib.impl, lib.mod, prefill_kw=dict(backend="fa2"))
    plan_kw = {"prefill_backend": "prefill_mma_sync"} if impl == "portable" else {}
    tile = int(knobs.pop("tile", 0))
    if kv:
        f8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv]
        k, v = k.to(f8), v.to(f8)
        plan_kw["kv_data_type"] = f8
    with tile_rule(tile) if tile else contextlib.nullcontext():
        call = peers.ragged_prefill(lib, lib.workspace(256), ind, q, k, v, causal, d, **plan_kw)
    if knobs:
        from cute_attn.runtime.loader import kernel

        w = call.wrapper
        kw = {**w._spec_kw, **{a: int(x) for a, x in knobs.items()}}
        w._binding.module = kernel("batch_prefill_sm90", "sm_90a", **kw)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(impl, mode, d, knobs or "", kv or "", "done")


if __name__ == "__main__":
    main()
