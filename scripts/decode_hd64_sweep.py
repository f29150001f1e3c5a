"""Head-dim-64 decode (the gpt-oss shape: 64 q / 8 kv heads, bf16, 64 x 4k, page 16): pipeline
depth x CTAs per SM x head packing, CUDA-graph replays timed in turns, outputs compared with
the first setting's.  Bytes in flight per SM are stages-1 blocks of 16 KB per CTA at hd64 (half
of hd128's), so depth and residency are the first suspects of its lower bandwidth.

    # compile the stage variants first (CPU machine):
    python scripts/decode_hd64_sweep.py specs | xargs python -m cute_attn compile --arch sm_90a
    # GPU:
    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/decode_hd64_sweep.py run
"""

from __future__ import annotations

import json
import sys

import torch

HQ, HK, D, PS, B, KV = 64, 8, 64, 16, 64, 4096
# (stages, CTAs per SM): shared memory per CTA is about 18 KB x stages
CONFIGS = [(4, 2), (4, 3), (3, 4), (5, 2), (6, 2)]
HEADS = (1, 2)


def specs() -> None:
    from cute_attn.families import decode

    out = []
    for s, _ in CONFIGS:
        for h in HEADS:
            decode.STAGES[D] = s
            sp = decode.decode_spec("sm_90a", "bf16", D, None, h)
            out.append("--spec " + sp.describe().split("@")[0].replace("[", ":").rstrip("]"))
    print(" ".join(dict.fromkeys(out)))


def run() -> None:
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.bench.common import interleaved
    from cute_attn.bench.decode import paged_cache
    from cute_attn.families import decode

    gen = torch.Generator().manual_seed(0)
    cache, indptr, indices, last = paged_cache([KV] * B, PS, gen, HK, D)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    runs, ref = {}, None
    for s, c in CONFIGS:
        for h in HEADS:
            decode.STAGES[D] = s
            w = BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.cuda(),
                paged_kv_last_page_len_buffer=last.cuda(), ctas_per_sm=c,
            )  # fmt: skip
            try:
                w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, heads_per_item=h)
                out = torch.empty_like(q)
                w.run(q, cache, out=out)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    w.run(q, cache, out=out)
            except Exception as e:
                print(f"stages {s} ctas {c} heads {h}: {type(e).__name__}: {str(e)[:120]}")
                continue
            g.replay()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            diff = (out.float() - ref.float()).abs().max().item()
            runs[(s, c, h)] = (g, w, out, diff)
    t = interleaved({k: v[0].replay for k, v in runs.items()}, calls=40)
    kv_bytes = B * KV * HK * D * 2 * 2
    for k, us in t.items():
        s, c, h = k
        print(json.dumps({"stages": s, "ctas_per_sm": c, "heads_per_item": h, "us": round(us, 1),
                          "TB/s": round(kv_bytes / us / 1e6, 3), "maxdiff": runs[k][3]}))  # fmt: skip


if __name__ == "__main__":
    specs() if sys.argv[1] == "specs" else run()
