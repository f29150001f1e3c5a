"""fp8 (e4m3) KV decode settings on issue 23's three batches (32 q / 8 kv heads, hd128, bf16
queries): kv heads per work item (the default rule, 2, 4) x the planner's balance tolerance
(the backend's, or 0.05: items of about a CTA each stay whole, no merge), beside the bf16 decode
of the same values; each setting its own CUDA-graph wrapper with 8 ``run()`` calls captured as
one engine step (the bench's per-layer time), timed in turns (two rounds of 30, the lower
median), every fp8 output compared with the default fp8 setting's.  The kernels are the decode
preset's (no compile beyond it).

    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/decode_fp8_sweep.py
"""

from __future__ import annotations

import gc

import torch

from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.bench import peers
from cute_attn.bench.common import decode_balance_tol, interleaved
from cute_attn.bench.decode import HK, HQ, LAYERS, D, decode_cases, paged_cache

FP8 = torch.float8_e4m3fn
# (label, cache dtype, heads per item (None: the rule), balance_tol (None: the backend's))
SETTINGS = [
    ("bf16", None, None, None),
    ("fp8", FP8, None, None),
    ("fp8_h2", FP8, 2, None),
    ("fp8_h4", FP8, 4, None),
    ("fp8_tol05", FP8, None, 0.05),
    ("fp8_h2_tol05", FP8, 2, 0.05),
]


def _wrapper(q, cache, indptr, indices, last, ps, kv_dtype, h, tol):
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.cuda(),
        paged_kv_last_page_len_buffer=last.cuda(),
    )  # fmt: skip
    kw = {"kv_data_type": kv_dtype} if kv_dtype is not None else {}
    with decode_balance_tol(D * (1 if kv_dtype is not None else 2), tol):
        w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=torch.bfloat16, heads_per_item=h, **kw)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], HQ, device="cuda")
    w.run(q, cache, out=out, lse=lse)
    torch.cuda.synchronize()
    g, why = peers.capture(lambda: [w.run(q, cache, out=out, lse=lse) for _ in range(LAYERS)])
    if g is None:
        raise RuntimeError(why)
    return w, g, out, lse


def main():
    for name, lens, ps in decode_cases()[:3]:
        gc.collect()
        torch.cuda.synchronize()
        gen = torch.Generator().manual_seed(0)
        cache, indptr, indices, last = paged_cache(lens, ps, gen)
        cache8 = tuple(t.to(FP8) for t in cache)
        q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
        runs = {}
        for label, kvd, h, tol in SETTINGS:
            try:
                w, g, out, lse = _wrapper(q, cache8 if kvd else cache, indptr, indices, last, ps, kvd, h, tol)
            except Exception as e:
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:160]}")
                continue
            plan = w._state.plan
            print(f"{name} {label}: h {w._hpi}, {len(plan.work_items)} items, {len(plan.merge_tasks)} merges")
            runs[label] = (w, g, out, lse)
        ref = runs["fp8"][2]
        for label, (_, _, out, _) in runs.items():
            if label != "bf16":
                print(f"  {label} max |diff| vs fp8 default {(out.float() - ref.float()).abs().max().item():.2e}")
        fns = {k: r[1].replay for k, r in runs.items()}
        t1 = interleaved(fns, calls=30)
        t2 = interleaved(fns, calls=30)
        nbytes = sum(lens) * HK * D * 2
        tb = min(t1["bf16"], t2["bf16"]) / LAYERS
        for k in fns:
            t = min(t1[k], t2[k]) / LAYERS
            per = nbytes * (2 if k == "bf16" else 1)
            print(f"{name:<22} {k:<14} {t:8.1f} us {per / t / 1e6:6.3f} TB/s  x bf16 {t / tb:.3f}  "
                  f"rounds {t1[k] / LAYERS:.1f} / {t2[k] / LAYERS:.1f}")  # fmt: skip
        del runs, fns, cache, cache8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
