"""Our decode alone on the bench's cases and a few split-KV ones (bf16, 32/8 heads, d128):
CUDA-graph replay of ``run()`` as ``python -m cute_attn bench`` does, best of 3 medians, one
JSON line per case.  For A/B of two builds, run it alternately under each checkout (the
PYTHONPATH and ``CUTE_ATTN_CACHE_DIR`` pick the build) in one GPU session:

    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=build/aot python scripts/decode_cases.py --tag new

``--heads 1,2,4``: every case also with each forced head packing (kv heads per work item,
``plan(heads_per_item=)``), the settings timed alternately in one process (best of 3 medians),
each output compared with the first setting's; ``--cudnn``: SDPA-cuDNN on the same data laid
out dense, in the same process (the GPU's own reference for the uniform cases).
"""

import argparse
import json

import torch
from triton.testing import do_bench

import cute_attn.bench.decode as bench_decode
from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.bench.common import cudnn_time
from cute_attn.bench.decode import _dense, decode_cases, paged_cache


def cases():
    """The bench's cases, then page 1 at 256 x 1k and split-KV ones (with and without RoPE)."""
    return decode_cases() + [
        ("bs256/kv1024/page1", [1024] * 256, 1),
        ("bs1/kv32768/page16", [32768], 16),
        ("bs8/kv8192/page16", [8192] * 8, 16),
        ("bs128/kv2048/page16", [2048] * 128, 16),
        ("bs512/kv512/page16", [512] * 512, 16),
        ("bs192/kv1024/page16", [1024] * 192, 16),
        ("bs96/kv3072/page16", [3072] * 96, 16),
        ("uniform/bs256/512-1536/page16", [512 + (i * 977) % 1025 for i in range(256)], 16),
        ("uniform/bs256/1-2048/page16", [1 + (i * 1543) % 2048 for i in range(256)], 16),
        ("rope/bs64/kv4096/page16", [4096] * 64, 16),
        ("rope/bs1/kv32768/page16", [32768], 16),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="ours")
    ap.add_argument("--heads", default="auto", help="comma-separated kv heads per item to force, or auto")
    ap.add_argument("--cudnn", action="store_true")
    ap.add_argument("--only", default="", help="substring of the case names to run")
    ap.add_argument("--soft-cap", type=float, default=None, help="logits_soft_cap for every case but RoPE's")
    ap.add_argument("--shape", default="32,8,128", help="num_qo_heads,num_kv_heads,head_dim")
    a = ap.parse_args()
    settings = [None] if a.heads == "auto" else [int(h) for h in a.heads.split(",")]
    HQ, HK, D = (int(x) for x in a.shape.split(","))
    bench_decode.HQ, bench_decode.HK, bench_decode.D = HQ, HK, D  # what paged_cache / _dense build
    gen = torch.Generator().manual_seed(0)
    for name, lens, ps in cases():
        if a.only and a.only not in name:
            continue
        cache, indptr, indices, last = paged_cache(lens, ps, gen)
        q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
        kw = (
            {"pos_encoding_mode": "ROPE_LLAMA"}
            if name.startswith("rope")
            else ({"logits_soft_cap": a.soft_cap} if a.soft_cap else {})
        )
        runs = {}
        for h in settings:
            if h not in (None, 1) and "pos_encoding_mode" in kw:
                continue  # no head packing with RoPE (a key transform)
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # a plan per setting
            w = BatchDecodeWithPagedKVCacheWrapper(
                ws,
                use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr.cuda(),
                paged_kv_indices_buffer=indices.cuda(),
                paged_kv_last_page_len_buffer=last.cuda(),
            )
            try:
                w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=torch.bfloat16, heads_per_item=h, **kw)
            except ValueError as e:  # a packing this shape does not allow (h * group > 16)
                print(json.dumps(dict(tag=a.tag, shape=a.shape, case=name, heads=h, skipped=str(e))), flush=True)
                continue
            out = torch.full_like(q, float("nan"))
            w.run(q, cache, out=out)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                w.run(q, cache, out=out)
            g.replay()
            torch.cuda.synchronize()
            runs[h] = (g, w, out)
        if not runs:
            continue
        best = {h: float("inf") for h in runs}
        for _ in range(3):
            for h, (g, _, _) in runs.items():
                best[h] = min(best[h], do_bench(g.replay, warmup=25, rep=200))
        kv_bytes = sum(lens) * HK * D * 2 * 2
        base = next(iter(runs.values()))[2].float()
        for h, (_g, w, out) in runs.items():
            t = best[h]
            diff = ((out.float() - base).norm() / base.norm()).item()
            print(
                json.dumps(
                    dict(
                        tag=a.tag + ("/softcap" if "logits_soft_cap" in kw else ""),
                        shape=a.shape,
                        case=name,
                        heads=w._hpi,
                        us=round(t * 1e3, 2),
                        tbs=round(kv_bytes / t / 1e9, 3),
                        split=bool(w._plan.has_split),
                        items=w._plan.num_work_items,
                        merges=w._plan.num_merge_tasks,
                        nan=bool(torch.isnan(out).any()),
                        rel_vs_first=round(diff, 6),
                    )
                ),
                flush=True,
            )
        del runs, cache
        if a.cudnn and len(set(lens)) == 1:
            qd, kd, vd = _dense(lens)
            tc = cudnn_time(qd, kd, vd)
            if tc is not None:
                print(
                    json.dumps(dict(tag="cudnn", case=name, us=round(tc, 2), tbs=round(kv_bytes / tc / 1e6, 3))),
                    flush=True,
                )
            del qd, kd, vd


if __name__ == "__main__":
    main()
