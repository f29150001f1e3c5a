"""Decode planner A/B on the GPU (docs/history/benchmarks-notebook.md, decode): planner settings (alpha,
min_kv_chunk) with the same kernel on the bench's batches, CUDA-graph replay, the settings
measured alternately (best of 3 medians), each output compared with the default's.

Run on the GPU machine: CUTE_ATTN_CACHE_DIR=<cache> PYTHONPATH=. python scripts/decode_planner_ab.py out.json
"""

import json
import random
import sys

import torch
from triton.testing import do_bench

import cute_attn.wrappers.decode as Dm
from cute_attn.bench.decode import HK, HQ, D, paged_cache

Orig = Dm.Planner
SETTINGS = [("a8/m256", 8, 256), ("a4/m64", 4, 64), ("a4/m128", 4, 128), ("a2/m64", 2, 64)]


def make(alpha, mk):
    def P(limits, sms, per_sm, **kw):
        kw.update(alpha=alpha, min_kv_chunk=mk)
        return Orig(limits, sms, per_sm, **kw)

    return P


def main(out_path):
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    cases = [
        ("bs256/kv1024", [1024] * 256),
        ("bs64/kv4096", [4096] * 64),
        ("lognormal/bs128", [max(1, min(32768, int(rng.lognormvariate(7.0, 1.0)))) for _ in range(128)]),
        ("skew", [32768] + [512] * 63),
    ]
    res = []
    for name, lens in cases:
        cache, indptr, indices, last = paged_cache(lens, 16, gen)
        b = len(lens)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        kv_bytes = sum(lens) * HK * D * 2 * 2
        graphs, outs = {}, {}
        for tag, a, mk in SETTINGS:
            Dm.Planner = make(a, mk)
            # a workspace per setting: the plan lives in it, and a shared one would make every
            # captured graph replay the last plan written
            ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            w = Dm.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr.cuda(),
                paged_kv_indices_buffer=indices.cuda(),
                paged_kv_last_page_len_buffer=last.cuda(),
            )
            w.plan(indptr, indices, last, HQ, HK, D, 16, q_data_type=torch.bfloat16)
            out = torch.full_like(q, float("nan"))
            w.run(q, cache, out=out)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                w.run(q, cache, out=out)
            g.replay()
            torch.cuda.synchronize()
            graphs[tag] = (g, w)
            outs[tag] = out
            info = dict(items=int(w._plan.num_work_items), merges=int(w._plan.num_merge_tasks))
            res.append(dict(case=name, tag=tag, **info))
        base = outs[SETTINGS[0][0]]
        best = {t: 1e9 for t, _, _ in SETTINGS}
        for _ in range(3):
            for tag, _, _ in SETTINGS:
                best[tag] = min(best[tag], do_bench(graphs[tag][0].replay, warmup=25, rep=200))
        for tag, _, _ in SETTINGS:
            d = (outs[tag].float() - base.float()).abs().max().item()
            r = dict(
                case=name,
                tag=tag,
                us=round(best[tag] * 1e3, 1),
                tbs=round(kv_bytes / best[tag] / 1e9, 3),
                maxdiff=d,
                nan=int(torch.isnan(outs[tag]).sum()),
            )
            print(json.dumps(r), flush=True)
            res.append(r)
        del cache
    Dm.Planner = Orig
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
