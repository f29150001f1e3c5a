"""One eager MLA call of ours or FlashInfer's between ``cudaProfilerStart`` / ``Stop``, for Nsight
Compute on the same inputs (the bench's compute-bound case by default: 128 heads, 2 query tokens,
batch 64 x 8k, page 64, causal).

    ncu --profile-from-start off --section SpeedOfLight ... \
        python scripts/profile_mla.py {ours|flashinfer} [HEADS Q_LEN BATCH KV] [k=v ...]

``k=v`` arguments are knobs of the wgmma kernel's spec (``mla_decode_sm90``), as in
``scripts/mla_sm90_knobs.py``.
"""

from __future__ import annotations

import sys

import torch

from cute_attn import mla as ours_mla
from cute_attn.bench.mla import MlaRun, make_inputs


def main():
    impl = sys.argv[1]
    nums = [a for a in sys.argv[2:] if "=" not in a]
    kn = dict(a.split("=") for a in sys.argv[2:] if "=" in a)
    heads, q_len, batch, kv = (int(a) for a in nums) if nums else (128, 2, 64, 8192)
    if kn:
        from mla_sm90_knobs import knobs  # this script's folder is on sys.path

        import cute_attn.wrappers.mla as M

        for name, patch in knobs(**{k: int(v) for k, v in kn.items()}).items():
            setattr(M, name, patch)
    if impl == "flashinfer":
        import flashinfer.mla as mod
    else:
        mod = ours_mla
    inputs = make_inputs([kv] * batch, q_len, heads, 64)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    run = MlaRun(mod, ws, inputs, heads, 64, q_len > 1)
    for _ in range(3):
        run.eager()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run.eager()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(impl, "done")


if __name__ == "__main__":
    main()
