"""Run one decode case a few times, for profilers (ncu / nsys): bf16, 32/8 heads, d128 unless
``--hq / --hk / --d`` say otherwise, NHD unless ``--hnd``.

    ncu --clock-control none -k regex:PagedDecode --launch-skip 2 --launch-count 1 \
        python scripts/profile_decode.py --batch 64 --kv 4096 --page 16
"""

import argparse

import torch

from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.bench.decode import HK, HQ, D, paged_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ctas-per-sm", type=int, default=None)
    ap.add_argument("--hq", type=int, default=HQ)
    ap.add_argument("--hk", type=int, default=HK)
    ap.add_argument("--d", type=int, default=D)
    ap.add_argument("--hnd", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cache, indptr, indices, last = paged_cache([a.kv] * a.batch, a.page, gen, a.hk, a.d)
    if a.hnd:
        cache = tuple(t.transpose(1, 2).contiguous() for t in cache)
    q = torch.randn(a.batch, a.hq, a.d, device="cuda", dtype=torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "HND" if a.hnd else "NHD", ctas_per_sm=a.ctas_per_sm
    )
    w.plan(indptr, indices, last, a.hq, a.hk, a.d, a.page, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    for _ in range(a.iters):
        w.run(q, cache, out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
