"""One eager ragged-prefill call of ours or FlashInfer's (fa3) between ``cudaProfilerStart`` /
``Stop``, for Nsight Compute on the same inputs: batch 2 x 8192, 16 / 16 heads, bf16 (the
bench's ``prefill/hd{D}/{causal,noncausal}/s8192``).  ``KNOBS``: spec parameters over the plan's
kernel (ours only), e.g. ``tile_n=128,pin_p=0``.

    ncu --profile-from-start off --section SpeedOfLight ... \
        python scripts/profile_prefill.py {ours|flashinfer} [causal|noncausal] [HEAD_DIM] [KNOBS]
"""

from __future__ import annotations

import sys

import torch

from cute_attn.bench import peers


def main():
    impl = sys.argv[1]
    causal = (sys.argv[2] if len(sys.argv) > 2 else "noncausal") == "causal"
    d = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    knobs = dict(kv.split("=") for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 and sys.argv[4] else {}
    b, s, h = 2, 8192, 16
    ind = torch.arange(0, b + 1, dtype=torch.int32) * s
    q = torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    lib = peers.flashinfer() if impl == "flashinfer" else peers.ours()
    call = peers.ragged_prefill(lib, lib.workspace(256), ind, q, k, v, causal, d)
    if knobs:
        from cute_attn.runtime.loader import kernel

        w = next(c.cell_contents for c in call.fn.__closure__ if hasattr(c.cell_contents, "_spec_kw"))
        kw = {**w._spec_kw, **{a: int(x) for a, x in knobs.items()}}
        w._binding.module = kernel("batch_prefill_sm90", "sm_90a", **kw)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(impl, "causal" if causal else "noncausal", d, knobs or "", "done")


if __name__ == "__main__":
    main()
