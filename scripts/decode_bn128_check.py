"""Issue 24: is the 128-row-stage hd64 decode right on the bench's lognormal batch?  The
``5e50dad`` sweep (``decode_hd64_sweep.py``) once saw its output differ from the 64-row
kernel's by 2.4.  Here every setting is checked against the fp32 reference, eagerly and by
CUDA-graph replay (the sweep's path: kept plans and their device update), over several page
orders, and the max error of each run is printed.  ``racecheck`` runs one small batch eagerly,
for ``compute-sanitizer --tool racecheck``.

    python scripts/decode_hd64_sweep.py specs | xargs python -m cute_attn compile --arch sm_90a
    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/decode_bn128_check.py [runs] [racecheck]
"""

from __future__ import annotations

import functools
import gc
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from decode_hd64_sweep import _lognormal, _set  # noqa: E402

D, HQ, HK = 64, 64, 8
# (block_n, stages, CTAs per SM, heads per item or None = the default rule, balance_tol or None)
SETTINGS = [(64, 4, 2, None, None), (128, 3, 2, None, None), (128, 3, 2, 1, 0.01), (128, 3, 2, 2, None)]


def _wrapper(st, indptr, indices, last, graph: bool):
    import torch

    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.bench.common import decode_balance_tol

    bn, s, c, h, tol = st
    _set(D, bn, s)
    kw = {}
    if graph:
        kw = dict(
            use_cuda_graph=True, paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.cuda(),
            paged_kv_last_page_len_buffer=last.cuda(),
        )  # fmt: skip
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), ctas_per_sm=c, **kw
    )
    with decode_balance_tol(2 * D, tol):  # 16-bit rows
        w.plan(indptr, indices, last, HQ, HK, D, 16, q_data_type=torch.bfloat16, heads_per_item=h)
    return w


def check(lens, seed: int, graph_replays: int = 3):
    import torch

    from cute_attn.bench.decode import paged_cache
    from cute_attn.bench.peers import capture
    from cute_attn.testing.reference import paged_reference

    gen = torch.Generator().manual_seed(seed)
    cache, indptr, indices, last = paged_cache(lens, 16, gen, HK, D)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    ref, _ = paged_reference(q, cache, None, indptr, indices, last)
    for st in SETTINGS:
        row = {"seed": seed, "setting": st}
        try:
            w = _wrapper(st, indptr, indices, last, graph=False)
            out = torch.full_like(q, float("nan"))
            w.run(q, cache, out=out)
            torch.cuda.synchronize()
            plan = w._state.plan
            row["items"], row["merges"], row["hpi"] = len(plan.work_items), len(plan.merge_tasks), w._hpi
            err = (out.float() - ref).abs()
            row["eager"] = err.max().item()
            row["eager_bad_rows"] = int((err.amax(-1) > 0.05).sum().item())
            del w
            gc.collect()
            wg = _wrapper(st, indptr, indices, last, graph=True)
            outg = torch.full_like(q, float("nan"))
            wg.run(q, cache, out=outg)
            torch.cuda.synchronize()
            g, why = capture(functools.partial(wg.run, q, cache, out=outg))
            assert g is not None, why
            errs = []
            for _ in range(graph_replays):
                outg.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                errs.append((outg.float() - ref).abs().max().item())
            row["graph"] = errs
            del g, wg
        except Exception as e:  # noqa: BLE001 -- report and go on to the next setting
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
        gc.collect()
        torch.cuda.synchronize()


def racecheck():
    import torch

    from cute_attn.bench.decode import paged_cache

    lens = [max(1, min(3000, n)) for n in _lognormal()[:12]] + [5000]
    gen = torch.Generator().manual_seed(1)
    cache, indptr, indices, last = paged_cache(lens, 16, gen, HK, D)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    for st in SETTINGS[1:3]:
        w = _wrapper(st, indptr, indices, last, graph=False)
        w.run(q, cache)
        torch.cuda.synchronize()
        print("ran", st, len(w._state.plan.work_items), "items", flush=True)


if __name__ == "__main__":
    if "racecheck" in sys.argv:
        racecheck()
    else:
        runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
        for seed in range(runs):
            check(_lognormal(), seed)
