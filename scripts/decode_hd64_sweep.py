"""Head-dim-64 decode (issue 24): stage size x pipeline depth x CTAs per SM x kv heads per item
x the planner's balance tolerance, CUDA-graph replays timed in turns (two rounds of 40 calls,
medians), FlashInfer 0.7.2's tensor-core decode among them on the gpt-oss shape, outputs compared
with the first setting's.  Shapes: gpt-oss (64 q / 8 kv heads, 64 x 4k, page 16), the GQA-4 one
of the head-dims table (32 / 8 heads, 256 x 1k) and the bench's lognormal batch of 128 with both
head configurations (the other hd64 cases the new rule and tolerance touch).

Settings are (block_n, stages, CTAs per SM, heads per item[, balance_tol]): block_n = KV rows per
stage (64: 16 KB stages at hd64; 128: 32 KB, hd128's stage bytes), heads per item None = the
default rule.  Four heads per item at GQA 8 is the 32-row tile (``PagedDecode.head_split``).

    python scripts/decode_hd64_sweep.py specs | xargs python -m cute_attn compile --arch sm_90a --jobs 1
    # GPU (FlashInfer: shared/tools/flashinfer's setup.sh, plus the hd64 module overlay):
    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/decode_hd64_sweep.py run [--json out.json]
    ncu ... python scripts/decode_hd64_sweep.py profile BLOCK_N STAGES CTAS HEADS"""

from __future__ import annotations

import gc
import json
import sys

D = 64
# (block_n, stages, CTAs per SM, heads per item); shared memory per CTA ~ block_n x 256 B x stages
# A fifth field, where present: the planner's balance_tol for the head dim (None: the decode
# backend's, 0.05 at head dim 64 since issue 24, else 0.01; 0.01 reproduces the plans before).
# At 0.05, items of about a CTA each stay whole (no split, no merge kernel).
GPTOSS = [
    (64, 4, 2, 1, 0.01),  # the default before issue 24 (its rule packs nothing here)
    (64, 4, 2, None),  # today's default: two heads per item, whole
    (128, 3, 2, None),  # the same with 128-row stages
    (64, 3, 4, 2, 0.01),  # the best setting before (BENCHMARKS.md)
    (64, 5, 2, 2),  # deeper pipelines, whole items
    (64, 6, 2, 2),
]
# the old default rule packs four heads here (512 items of 4k head-tokens)
GQA4 = [(64, 4, 2, 4, 0.01), (64, 4, 2, None), (128, 3, 2, None), (128, 3, 2, 4, 0.01)]
# the bench's lognormal batch of 128 (kv 1-32k), where the rule packs nothing: the tolerance's effect
LOGNORMAL = [(64, 4, 2, 1, 0.01), (64, 4, 2, None), (128, 3, 2, None), (128, 3, 2, 1, 0.01)]


def _lognormal():
    import random

    rng = random.Random(0)  # bench/decode.py's lognormal case
    return [max(1, min(32768, int(rng.lognormvariate(7.0, 1.0)))) for _ in range(128)]


SHAPES = {  # name: (head dim, hq, hk, kv lengths, settings, with FlashInfer)
    "decode/hd64/gqa8/bs64/kv4096/page16": (64, 64, 8, [4096] * 64, GPTOSS, True),
    "decode/hd64/gqa4/bs256/kv1024/page16": (64, 32, 8, [1024] * 256, GQA4, False),
    "decode/hd64/gqa8/lognormal/bs128/page16": (64, 64, 8, _lognormal(), LOGNORMAL, False),
    "decode/hd64/gqa4/lognormal/bs128/page16": (64, 32, 8, _lognormal(), LOGNORMAL, False),
}
OLD = {"block_n": 64, "stages": {64: 4, 128: 3}, "ctas": {64: 2, 128: 2}}


def _set(d, bn, stages):
    from cute_attn.families import decode

    decode.BLOCK_N[d], decode.STAGES[d] = bn, stages


def specs() -> None:
    from cute_attn.families import decode, merge

    out = []
    for d, hq, hk, _, settings, _ in SHAPES.values():
        for bn, s, _, h in (st[:4] for st in settings):
            _set(d, bn, s)
            for hh in [h] if h is not None else [1, 2, 4]:
                if not decode.packed_ok(hh, hq // hk):
                    continue
                sp = decode.decode_spec("sm_90a", "bf16", d, None, hh, None, decode.decode_tile(hh, hq // hk))
                out.append("--spec " + sp.cli())
        for t in (16, 32):
            out.append("--spec " + merge.merge_partials_spec("sm_90a", "bf16", d, t).cli())
    print(" ".join(dict.fromkeys(out)))


def run(json_path=None) -> None:
    import torch

    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.bench import peers
    from cute_attn.bench.common import Results, decode_balance_tol, interleaved
    from cute_attn.bench.decode import paged_cache

    res = Results()
    fi = peers.flashinfer()
    for case, (D, hq, hk, lens, settings, with_fi) in SHAPES.items():
        gc.collect()  # a collected wrapper frees pinned memory: never inside a capture
        torch.cuda.synchronize()
        gen = torch.Generator().manual_seed(0)
        b = len(lens)
        cache, indptr, indices, last = paged_cache(lens, 16, gen, hk, D)
        q = torch.randn(b, hq, D, device="cuda", dtype=torch.bfloat16)
        graphs, outs, names = {}, {}, {}
        for st in settings:
            bn, s, c, h = st[:4]
            tol = st[4] if len(st) > 4 else None
            _set(D, bn, s)
            w = BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.cuda(),
                paged_kv_last_page_len_buffer=last.cuda(), ctas_per_sm=c,
            )  # fmt: skip
            key = st
            try:
                with decode_balance_tol(2 * D, tol):  # 16-bit rows
                    w.plan(indptr, indices, last, hq, hk, D, 16, q_data_type=torch.bfloat16, heads_per_item=h)
                out = torch.empty_like(q)
                lse = torch.empty(b, hq, device="cuda")
                w.run(q, cache, out=out, lse=lse)
                torch.cuda.synchronize()  # a failing setting is named by the last line printed
                g, why = peers.capture(lambda: w.run(q, cache, out=out, lse=lse))  # noqa: B023
                if g is None:
                    raise RuntimeError(why)
            except Exception as e:
                print(f"{case} {key}: {type(e).__name__}: {str(e)[:160]}")
                continue
            plan = w._state.plan
            names[key] = f"bn{bn}_s{s}_c{c}_h{w._hpi}" + ("_rule" if h is None else "") + (f"_tol{tol}" if tol else "")
            print(f"{case} {names[key]}: {len(plan.work_items)} items, {len(plan.merge_tasks)} merges")
            # the graph writes into out and lse at replay: both must live as long as it (a freed
            # lse's memory, reused by the next setting's plan records, once made graphs of the
            # 5e50dad and session-18 sweeps run on corrupted plans: wrong, and "fast")
            graphs[key], outs[key] = (g, w, lse), out
        # FlashInfer on the gpt-oss shape only (its hd64 module is an overlay built here)
        if fi is not None and with_fi:
            run_fi, why = peers.fi_call(
                peers.DecodeRun, fi, fi.workspace(256), q, cache, indptr, indices, last, hq, hk, D, 16
            )
            if run_fi is None:
                print(f"{case} flashinfer: {why}")
            else:
                graphs["fi"], outs["fi"], names["fi"] = (run_fi, None, None), run_fi.out, "flashinfer"
        torch.cuda.synchronize()
        ref = outs[next(iter(outs))]
        fns = {k: g.replay for k, (g, _, _) in graphs.items()}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        diffs = {k: (o.float() - ref.float()).abs().max().item() for k, o in outs.items()}
        t = interleaved(fns, calls=40)
        t2 = interleaved(fns, calls=40)  # a second round: drift shows as a difference between the two
        kv_bytes = sum(lens) * hk * D * 2 * 2
        tfi = min(t.get("fi", 0), t2.get("fi", 0)) or None
        for k in fns:
            us = min(t[k], t2[k])
            rounds = [round(t[k], 1), round(t2[k], 1)]
            row = {"case": case, "setting": names[k], "us": round(us, 1), "us_rounds": rounds,
                   "TB/s": round(kv_bytes / us / 1e6, 3), "maxdiff": diffs[k]}  # fmt: skip
            if tfi and k != "fi":
                row["fi_over_ours"] = round(tfi / us, 3)
            print(json.dumps(row))
            impl = "flashinfer" if k == "fi" else "cute_attn"
            sub = case if k == "fi" else f"{case}/{names[k]}"
            res.add(sub, impl, "us", us)
            res.add(sub, impl, "TB/s", kv_bytes / us / 1e6)
            if tfi and k != "fi":
                res.add(sub, "flashinfer", "ratio", tfi / us)
        del graphs, fns
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res.records, f, indent=1)


def profile(bn: int, stages: int, ctas: int, h: int, iters: int = 4) -> None:
    """One setting on the gpt-oss shape, run eagerly ``iters`` times (for ncu: ``-k
    regex:PagedDecode --launch-skip 2 --launch-count 1``)."""
    import torch

    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.bench.decode import paged_cache

    d, hq, hk, lens, _, _ = SHAPES["decode/hd64/gqa8/bs64/kv4096/page16"]
    b = len(lens)
    _set(d, bn, stages)
    cache, indptr, indices, last = paged_cache(lens, 16, torch.Generator().manual_seed(0), hk, d)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), ctas_per_sm=ctas)
    w.plan(indptr, indices, last, hq, hk, d, 16, q_data_type=torch.bfloat16, heads_per_item=h)
    out = torch.empty_like(q)
    for _ in range(iters):
        w.run(q, cache, out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1] == "specs":
        specs()
    elif sys.argv[1] == "profile":
        profile(*map(int, sys.argv[2:6]))
    else:
        run(sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None)
