"""A/B on the GPU: decode of GQA groups above 16 (MQA) on the decode kernel (16-row items: each
token's keys read once per 16 query heads) against the routed plan on the prefill kernels
(``wrappers/decode_engine.MAX_DECODE_GROUP``), CUDA-graph replays timed in turns, outputs
compared with each other and with the fp32 reference on the first requests.

    python scripts/mqa_decode_ab.py [--json OUT.json]
"""

from __future__ import annotations

import argparse

import torch

from cute_attn.bench import peers
from cute_attn.bench.common import Results, interleaved
from cute_attn.bench.decode import paged_cache

CASES = [  # (name, kv lengths, page size, q heads, kv heads, head dim)
    ("bs64/kv4096/page16", [4096] * 64, 16, 32, 1, 128),
    ("bs64/kv4096/page16", [4096] * 64, 16, 64, 2, 128),
    ("bs256/kv1024/page16", [1024] * 256, 16, 32, 1, 128),
    ("bs64/kv4096/page1", [4096] * 64, 1, 32, 1, 128),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    import cute_attn.wrappers.decode as D

    res = Results()
    ours, fi = peers.ours(), peers.flashinfer()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ws_fi = fi.workspace(256) if fi is not None else None
    gen = torch.Generator().manual_seed(0)
    routed_rule = D.decodes_on_prefill
    for name, lens, ps, hq, hk, d in CASES:
        cache, indptr, indices, last = paged_cache(lens, ps, gen, hk, d)
        q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
        runs = {"routed": peers.DecodeRun(ours, ws, q, cache, indptr, indices, last, hq, hk, d, ps)}
        assert runs["routed"].wrapper._routed
        D.decodes_on_prefill = lambda hd, kv, *heads, plain=True: routed_rule(hd, kv)  # noqa: E731
        try:
            ws2 = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            runs["decode_kernel"] = peers.DecodeRun(ours, ws2, q, cache, indptr, indices, last, hq, hk, d, ps)
        finally:
            D.decodes_on_prefill = routed_rule
        assert not runs["decode_kernel"].wrapper._routed
        if fi is not None:
            run, why = peers.fi_call(peers.DecodeRun, fi, ws_fi, q, cache, indptr, indices, last, hq, hk, d, ps)
            if run is not None:
                runs["flashinfer"] = run
            else:
                print(f"  flashinfer: {why}")
        for r in runs.values():
            r.replay()
        torch.cuda.synchronize()
        a, b = runs["routed"].out.float(), runs["decode_kernel"].out.float()
        diff = ((a - b).norm() / b.norm()).item()
        assert diff < 1e-2, diff
        t = interleaved({k: r.replay for k, r in runs.items()}, 25)
        kv_bytes = sum(lens) * hk * d * 2 * 2
        case = f"decode/hd{d}/gqa{hq // hk}/{name}" if hk == 1 else f"decode/hd{d}/gqa{hq // hk}/kvh{hk}/{name}"
        line = [f"{case:36s} rel diff {diff:.1e}"]
        for k, us in t.items():
            impl = "cute_attn" if k == "routed" else "cute_attn_decode_kernel" if k == "decode_kernel" else k
            res.add(case, impl, "us", us)
            res.add(case, impl, "TB/s", kv_bytes / us / 1e6)
            line.append(f"{k} {us:7.1f} us {kv_bytes / us / 1e6:5.2f} TB/s")
        if "flashinfer" in t:
            res.add(case, "flashinfer", "ratio", t["flashinfer"] / t["routed"])
        print("  ".join(line), flush=True)
        del runs, cache
        torch.cuda.empty_cache()
    if args.json:
        res.merge_into(args.json)


if __name__ == "__main__":
    main()
