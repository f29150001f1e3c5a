"""A/B of builds (checkouts, each with its own kernel cache) on the decode and prefill
bench cases, through the public API only, so that an older checkout runs it too.

    PYTHONPATH=<checkout> CUTE_ATTN_CACHE_DIR=<its cache> python scripts/ab_builds.py run TAG OUT.json [FIRST.json]
    python scripts/ab_builds.py compare A.json B.json [C.json ...]

``scripts/pack_ab.sh`` packs several checkouts with their caches for one visit and
``scripts/ab_on_device.sh`` runs them in turns there.

Run the builds alternately (A, B, A, B, ...: the H200's clocks drift within seconds); each run
records, per case, the median of ``do_bench`` (decode: CUDA-graph replay of ``run()``, as the
bench; prefill: ``run()``), and ``compare`` prints per case the median over each tag's runs and
each later tag's ratio to the first.  ``AB_ONLY``: a comma-separated list of case
names; only those run.  Every output is checked against the first run's
(saved beside OUT.json) so the two builds are seen to compute the same thing.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
from collections import defaultdict

HQ, HK = 32, 8


def _decode_cases():
    return [
        ("decode/hd128/bs64/kv4096/page16", [4096] * 64, 16, 128),
        ("decode/hd128/bs64/kv4096/page1", [4096] * 64, 1, 128),
        ("decode/hd128/bs256/kv1024/page16", [1024] * 256, 16, 128),
        ("decode/hd128/skewed/page16", [32768] + [512] * 63, 16, 128),
    ]


PORTABLE = {"prefill_backend": "prefill_mma_sync"}  # the portable (mma.sync) prefill


def _prefill_cases():
    # (name, lengths, causal, head_dim, heads, page size or 0 for ragged[, plan kwargs])
    return [
        ("prefill/hd128/causal/s8192", [8192] * 2, True, 128, 16, 0),
        ("prefill/hd128/noncausal/s8192", [8192] * 2, False, 128, 16, 0),
        ("prefill/hd256/causal/s8192", [8192] * 2, True, 256, 16, 0),
        ("prefill/hd128/causal/s8192/page16", [8192] * 2, True, 128, 16, 16),
        ("prefill/hd128/causal/s8192/page1", [8192] * 2, True, 128, 16, 1),
        ("prefill/hd128/causal/varlen32_lognormal2k", _lognormal_lens(), True, 128, 16, 0),
        ("prefill/hd128/causal/bimodal48", _bimodal_lens(), True, 128, 16, 0),
        # GQA, ragged (kwarg _kv_heads: the kv heads): packed rows of 4, 8 and 7 heads per kv head, so
        # a build's row addressing is checked against the first's where the group divides 8 and not
        ("prefill/hd128/causal/gqa4_varlen", _lognormal_lens()[:12], True, 128, 32, 0, {"_kv_heads": 8}),
        ("prefill/hd128/noncausal/gqa8_s2000", [2000, 1234, 77], False, 128, 64, 0, {"_kv_heads": 8}),
        ("prefill/hd128/causal/gqa7_s1500", [1500, 777, 1001], True, 128, 28, 0, {"_kv_heads": 4}),
        ("prefill_mma/hd128/causal/s8192", [8192] * 2, True, 128, 16, 0, PORTABLE),
        ("prefill_mma/hd128/causal/s8192/page16", [8192] * 2, True, 128, 16, 16, PORTABLE),
    ]


def _lognormal_lens():
    # bench/prefill.varlen32_lengths, repeated: an older checkout on PYTHONPATH may lack it
    rng = random.Random(0)
    return [max(64, min(16384, int(rng.lognormvariate(7.3, 0.8)))) for _ in range(32)]


def _bimodal_lens():
    # bench/prefill.bimodal_lengths, repeated (as _lognormal_lens)
    rng = random.Random(1)
    lens = [rng.randint(4096, 8192) for _ in range(8)] + [rng.randint(64, 512) for _ in range(40)]
    rng.shuffle(lens)
    return lens


def _only(cases):
    """The cases named in $AB_ONLY (comma-separated case names), else all."""
    keys = [k for k in os.environ.get("AB_ONLY", "").split(",") if k]
    return [c for c in cases if not keys or c[0] in keys]


def run(tag: str, out_path: str) -> None:
    import torch
    from triton.testing import do_bench

    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    dev, bf = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    recs, outs = [], {}
    for name, lens, ps, d in _only(_decode_cases()):
        pages = [(n + ps - 1) // ps for n in lens]
        total = sum(pages)
        indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
        indices = torch.randperm(total, generator=gen).to(torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, pages)], dtype=torch.int32)
        k = torch.randn(total, ps, HK, d, generator=gen).to(dev, bf)
        v = torch.randn(total, ps, HK, d, generator=gen).to(dev, bf)
        q = torch.randn(len(lens), HQ, d, generator=gen).to(dev, bf)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        b = len(lens)
        w = BatchDecodeWithPagedKVCacheWrapper(
            ws,
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.empty(total, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev),
        )
        w.plan(indptr, indices, last, HQ, HK, d, ps, q_data_type=bf)
        out = torch.empty_like(q)
        w.run(q, (k, v), out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, (k, v), out=out)
        g.replay()
        torch.cuda.synchronize()
        t = do_bench(g.replay, warmup=50, rep=300, return_mode="median")
        nbytes = 2 * sum(lens) * HK * d * 2
        recs.append({"case": name, "tag": tag, "us": t * 1e3, "TB/s": nbytes / (t * 1e-3) / 1e12})
        outs[name] = out.float().cpu()
        del k, v, ws
    for name, lens, causal, d, h, ps, *kw in _only(_prefill_cases()):
        kw = dict(kw[0]) if kw else {}
        hk = kw.pop("_kv_heads", h)
        n = sum(lens)
        q = torch.randn(n, h, d, generator=gen).to(dev, bf)
        k = torch.randn(n, hk, d, generator=gen).to(dev, bf)
        v = torch.randn(n, hk, d, generator=gen).to(dev, bf)
        ind = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        out = torch.empty_like(q)
        if ps == 0:
            w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
            w.plan(ind, ind, h, hk, d, causal=causal, q_data_type=bf, **kw)
            call = lambda w=w, q=q, k=k, v=v, out=out: w.run(q, k, v, out=out)
        else:
            n_pages = n // ps
            perm = torch.randperm(n_pages, generator=gen)
            kc = torch.empty(n_pages, ps, h, d, dtype=bf, device=dev)
            vc = torch.empty_like(kc)
            kc[perm.to(dev)] = k.view(n_pages, ps, h, d)
            vc[perm.to(dev)] = v.view(n_pages, ps, h, d)
            w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8, device=dev))
            pind = torch.tensor([0] + torch.tensor([m // ps for m in lens]).cumsum(0).tolist(), dtype=torch.int32)
            w.plan(ind, pind, perm.to(torch.int32), torch.full((len(lens),), ps, dtype=torch.int32), h, h, d, ps,
                   causal=causal, q_data_type=bf, **kw)  # fmt: skip
            call = lambda w=w, q=q, kc=kc, vc=vc, out=out: w.run(q, (kc, vc), out=out)
        call()
        torch.cuda.synchronize()
        t = do_bench(call, warmup=25, rep=200, return_mode="median")
        pairs = sum(m * (m + 1) / 2 if causal else m * m for m in lens)
        recs.append({"case": name, "tag": tag, "us": t * 1e3, "TFLOP/s": 4 * d * h * pairs / (t * 1e-3) / 1e12})
        outs[name] = out.float().cpu()
    ref_path = out_path + ".outputs.pt"
    try:
        ref = torch.load(ref_path.replace(out_path, sys.argv[4]) if len(sys.argv) > 4 else ref_path)
    except FileNotFoundError:
        ref = None
    for r in recs:
        if ref is not None and r["case"] in ref:
            r["max_abs_diff_vs_ref"] = float((outs[r["case"]] - ref[r["case"]]).abs().max())
    if ref is None:
        torch.save(outs, ref_path)
    with open(out_path, "w") as f:
        json.dump(recs, f)
    for r in recs:
        print(json.dumps(r))


def compare(paths) -> None:
    """Per case: each tag's median time over its runs, and each later tag's ratio to the first."""
    by = defaultdict(lambda: defaultdict(list))
    tags = []
    for p in paths:
        for r in json.load(open(p)):
            by[r["case"]][r["tag"]].append(r["us"])
            if r["tag"] not in tags:
                tags.append(r["tag"])
    a = tags[0]
    head = "".join(f"{t + ' us':>12s}" for t in tags) + "".join(f"{t + '/' + a:>12s}" for t in tags[1:])
    print(f"{'case':42s}{head}")
    for case, t in by.items():
        med = {k: statistics.median(t[k]) for k in tags if t[k]}
        cols = "".join(f"{med[k]:12.1f}" if k in med else f"{'-':>12s}" for k in tags)
        ratios = "".join(f"{med[k] / med[a]:12.4f}" if k in med and a in med else f"{'-':>12s}" for k in tags[1:])
        print(f"{case:42s}{cols}{ratios}   ({'; '.join(f'{k}: {t[k]}' for k in tags)})")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        compare(sys.argv[2:])
