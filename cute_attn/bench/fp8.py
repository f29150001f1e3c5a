"""fp8 KV cache vs the 16-bit cache of the same batch, ours and FlashInfer's (where it runs).

Decode: the bf16 decode cases' batches (32 q / 8 kv heads, head dim 128, bf16 queries) with
the cache in ``float8_e4m3fn``; CUDA-graph-enabled wrappers, ``LAYERS`` calls of ``run()``
captured in one graph as one engine step and replayed, the time divided by ``LAYERS`` as in the
decode bench (what runs once per step, our kept-plan update, is not charged to every layer), the
four graphs (ours bf16 / fp8, FlashInfer bf16 / fp8) timed in turns (``interleaved``).
Records go under the bf16 case name plus ``/fp8_e4m3``: ``us``, ``TB/s`` of fp8 cache bytes,
``vs_bf16`` = fp8 time / bf16 time of the same implementation (the ideal is 0.5: half the
bytes), and FlashInfer's ``ratio`` = its time / ours.  FlashInfer's fp8 output is checked
against ours (same quantized inputs) before it is recorded.  fp8 decode needs a module the
trimmed FlashInfer does not prebuild: ``CUTE_ATTN_BENCH_FI_JIT=1`` lets it compile (about a
minute on the GPU machine).
"""

from __future__ import annotations

import torch

from . import peers
from .common import interleaved
from .decode import HK, HQ, LAYERS, D, decode_cases, paged_cache

FP8 = torch.float8_e4m3fn


def _run(lib, ws, q, cache, indptr, indices, last, ps, kv_dtype):
    plan_kw = {"kv_data_type": kv_dtype} if kv_dtype is not None else None
    make = lambda: peers.DecodeRun(
        lib, ws, q, cache, indptr, indices, last, HQ, HK, D, ps, plan_kw=plan_kw, layers=LAYERS
    )
    if lib.ours:
        return make(), None
    return peers.fi_call(make)


def bench_fp8_decode(res, quick: bool) -> None:
    lib_ours, fi = peers.ours(), peers.flashinfer()
    gen = torch.Generator().manual_seed(0)
    cases = decode_cases()[:3]
    print(f"{'fp8 e4m3 decode (bf16 q, 32/8 heads, d128)':<44} {'bf16 us':>8} {'fp8 us':>8} {'x bf16':>7} "
          f"{'TB/s':>6} {'fi bf16':>8} {'fi fp8':>8} {'fi/ours':>8}")  # fmt: skip
    for name, kv_lens, ps in cases:
        cache, indptr, indices, last = paged_cache(kv_lens, ps, gen)
        cache8 = tuple(t.to(FP8) for t in cache)
        q = torch.randn(len(kv_lens), HQ, D, device="cuda", dtype=torch.bfloat16)
        runs = {}
        for impl, lib in (("ours", lib_ours), ("fi", fi)):
            if lib is None:
                continue
            for tag, c, kvd in (("bf16", cache, None), ("fp8", cache8, FP8)):
                run, why = _run(lib, lib.workspace(256), q, c, indptr, indices, last, ps, kvd)
                if run is None:
                    peers.say("flashinfer", why, f"{name} {tag}")
                    continue
                runs[f"{impl}_{tag}"] = run
        fi_fp8 = runs.get("fi_fp8")
        if fi_fp8 is not None:
            runs["ours_fp8"].replay()
            fi_fp8.replay()
            torch.cuda.synchronize()
            _, ok = peers.check_output("flashinfer fp8 decode", fi_fp8.out, runs["ours_fp8"].out)
            if not ok:
                runs.pop("fi_fp8")
        steps = interleaved({k: r.replay for k, r in runs.items()}, calls=10 if quick else 40)
        t = {k: v / LAYERS for k, v in steps.items()}
        fp8_bytes = sum(kv_lens) * HK * D * 2
        case = f"decode/hd{D}/gqa{HQ // HK}/{name}/fp8_e4m3"
        res.add(case, "cute_attn", "us", t["ours_fp8"])
        res.add(case, "cute_attn", "TB/s", fp8_bytes / t["ours_fp8"] / 1e6)
        res.add(case, "cute_attn", "vs_bf16", t["ours_fp8"] / t["ours_bf16"])
        res.add(case + "/bf16_same_run", "cute_attn", "us", t["ours_bf16"])
        cols = ["n/a"] * 3
        if "fi_fp8" in t:
            res.add(case, "flashinfer", "us", t["fi_fp8"])
            res.add(case, "flashinfer", "ratio", t["fi_fp8"] / t["ours_fp8"])
            if "fi_bf16" in t:
                res.add(case, "flashinfer", "vs_bf16", t["fi_fp8"] / t["fi_bf16"])
            cols[1:] = [f"{t['fi_fp8']:8.1f}", f"{t['fi_fp8'] / t['ours_fp8']:7.2f}x"]
        if "fi_bf16" in t:
            cols[0] = f"{t['fi_bf16']:8.1f}"
        print(f"{name:<44} {t['ours_bf16']:8.1f} {t['ours_fp8']:8.1f} {t['ours_fp8'] / t['ours_bf16']:7.3f} "
              f"{fp8_bytes / t['ours_fp8'] / 1e6:6.2f} {cols[0]:>8} {cols[1]:>8} {cols[2]:>8}")  # fmt: skip
        del runs, cache, cache8


def bench_fp8(res, quick: bool) -> None:
    """The fp8 group: decode, then prefill (``bench/fp8_prefill.py``: the KV pass's fp8 path)."""
    from .fp8_prefill import bench_fp8_prefill

    bench_fp8_decode(res, quick)
    bench_fp8_prefill(res, quick)
