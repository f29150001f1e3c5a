"""Our decode alone on the bench's cases and a few split-KV ones (bf16, 32/8 heads, d128):
CUDA-graph replay of ``run()`` as ``python -m cute_attn bench`` does, best of 3 medians, one
JSON line per case.  For A/B of two builds, run it alternately under each checkout (the
PYTHONPATH and ``CUTE_ATTN_CACHE_DIR`` pick the build) in one GPU session:

    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=build/aot python scripts/decode_cases.py --tag new
"""
import argparse
import json

import torch
from triton.testing import do_bench

from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.bench.decode import HK, HQ, D, _paged, decode_cases


def cases():
    """The bench's cases, then page 1 at 256 x 1k and split-KV ones (with and without RoPE)."""
    return decode_cases() + [("bs256/kv1024/page1", [1024] * 256, 1), ("bs1/kv32768/page16", [32768], 16),
                             ("bs8/kv8192/page16", [8192] * 8, 16), ("rope/bs64/kv4096/page16", [4096] * 64, 16),
                             ("rope/bs1/kv32768/page16", [32768], 16)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="ours")
    tag = ap.parse_args().tag
    gen = torch.Generator().manual_seed(0)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name, lens, ps in cases():
        cache, indptr, indices, last = _paged(lens, ps, gen)
        q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
        w = BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, paged_kv_indptr_buffer=indptr.cuda(),
                                               paged_kv_indices_buffer=indices.cuda(),
                                               paged_kv_last_page_len_buffer=last.cuda())
        kw = {"pos_encoding_mode": "ROPE_LLAMA"} if name.startswith("rope") else {}
        w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=torch.bfloat16, **kw)
        out = torch.empty_like(q)
        w.run(q, cache, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, cache, out=out)
        g.replay()
        torch.cuda.synchronize()
        t = min(do_bench(g.replay, warmup=25, rep=200) for _ in range(3))
        kv_bytes = sum(lens) * HK * D * 2 * 2
        print(json.dumps(dict(tag=tag, case=name, us=round(t * 1e3, 2), tbs=round(kv_bytes / t / 1e9, 3),
                              split=bool(w._plan.has_split))), flush=True)


if __name__ == "__main__":
    main()
