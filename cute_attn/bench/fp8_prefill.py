"""fp8-KV batch prefill vs the 16-bit cache of the same batch (issue 23's bar: within 1.05x the
bf16 time), ours and FlashInfer's where it runs.

The s8192 prefill cases (``bench/prefill.py``: batch 2 x 16 heads, head dim 128, bf16 queries,
causal and not) with K / V in ``float8_e4m3fn``: ragged as the plan chooses, and each way
forced -- the kernel widening the fp8 blocks in shared memory (``kv_pass=False``,
``kernels/prefill_sm90_kv8.py``), the KV pass dequantizing K / V for the 16-bit kernel
(``kv_pass=True``: run by the kernel's own producer warps, ``kernels/prefill_sm90_kv8_pass.py``)
and the standalone pass before the kernel (``.../fp8kv/host_pass``) -- and paged at page 16
(the pass gathers and dequantizes: inside the kernel as the plan chooses, and before it,
``.../page16/fp8kv/host_pass``), beside the bf16 ragged and paged runs; all timed in turns
(``interleaved``: the H200's clocks drift).  Records
under the bf16 case name plus ``/fp8kv``: ``us``, ``TFLOP/s`` (the attention's FLOPs, as the
prefill bench) and ``vs_bf16`` = fp8 time / bf16 time of the same layout; ``.../fp8kv/in_kernel``
and ``.../fp8kv/kv_pass`` the forced ragged runs; ``.../page16/fp8kv`` against the bf16 page-16
run.  Then short queries over long keys (``SHORT_QUERIES``: a chunked prefill, a speculative-
decoding batch), where the widening is the plan's choice, the same three ways.
Our fp8 output is checked against our bf16 run on the dequantized
K / V before anything is recorded.  FlashInfer's fp8 prefill (its ``fa2`` paged wrapper, fp8 KV
with bf16 queries; JIT with ``CUTE_ATTN_BENCH_FI_JIT=1``) beside it, its output checked against
ours, ``ratio`` = its time / ours.
"""

from __future__ import annotations

import contextlib

import torch

from ..families import backends
from . import peers
from .common import interleaved
from .prefill import DT, B, H, S, _flops, _indptr, _paged_cache, _tflops

FP8 = torch.float8_e4m3fn
D = 128
PAGE = 16


def _paged(lib, ws, paged, q, causal, kv_dtype, ctor_kw=None):
    cache, qo, kvi, idx, last = paged
    w = lib.mod.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", **(ctor_kw or lib.prefill_kw))
    kw = {} if kv_dtype is None else {"kv_data_type": kv_dtype}
    w.plan(qo, kvi, idx, last, q.shape[1], cache[0].shape[2], D, PAGE, causal=causal, q_data_type=q.dtype, **kw)
    out = torch.empty_like(q)
    call = peers.Call(lambda: w.run(q, cache, out=out), out)
    call()
    return call


@contextlib.contextmanager
def _pass_in_kernel(on: bool):
    """Plans made inside take the fp8 pass in the kernel (``on``) or the standalone pass first."""
    was, backends.KV8_PASS_IN_KERNEL = backends.KV8_PASS_IN_KERNEL, on
    try:
        yield
    finally:
        backends.KV8_PASS_IN_KERNEL = was


def bench_fp8_prefill(res, quick: bool) -> None:
    lib, fi = peers.ours(), peers.flashinfer()
    gen = torch.Generator().manual_seed(0)
    lens = [S] * B
    print(f"{'fp8 e4m3 KV prefill (bf16 q, 2 x 16 heads, d128, s8192)':<56} {'bf16 us':>8} {'fp8 us':>8} "
          f"{'x bf16':>7} {'TFLOP/s':>8} {'fi fp8':>8} {'fi/ours':>8}")  # fmt: skip
    for causal in (True, False):
        name = f"prefill/hd{D}/{'causal' if causal else 'noncausal'}/s{S}"
        q = torch.randn(B * S, H, D, generator=gen).to(DT).cuda()
        k8 = torch.randn(B * S, H, D, generator=gen).to(FP8).cuda()
        v8 = torch.randn(B * S, H, D, generator=gen).to(FP8).cuda()
        k16, v16 = k8.to(DT), v8.to(DT)  # exactly the fp8 values: the two runs attend the same K / V
        ind = _indptr(lens)
        runs = {}
        for tag, k, v, kw in (
            ("bf16", k16, v16, {}),
            ("fp8", k8, v8, {"kv_data_type": FP8}),
            ("fp8_kernel", k8, v8, {"kv_data_type": FP8, "kv_pass": False}),
            ("fp8_pass", k8, v8, {"kv_data_type": FP8, "kv_pass": True}),
            ("fp8_host_pass", k8, v8, {"kv_data_type": FP8, "kv_pass": True}),
        ):
            ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
            with _pass_in_kernel(tag != "fp8_host_pass"):
                runs[f"ragged_{tag}"] = peers.ragged_prefill(lib, ws, ind, q, k, v, causal, D, **kw)
        widened = runs["ragged_fp8"].wrapper._gathered is None  # the plan's choice
        paged16 = _paged_cache(lens, k16, v16, D, PAGE, gen)
        cache16 = paged16[0]
        paged8 = ((cache16[0].to(FP8), cache16[1].to(FP8)),) + paged16[1:]
        for tag, paged, kvd in (("bf16", paged16, None), ("fp8", paged8, FP8), ("fp8_host_pass", paged8, FP8)):
            with _pass_in_kernel(tag != "fp8_host_pass"):
                runs[f"page16_{tag}"] = _paged(lib, torch.empty(512 << 20, dtype=torch.uint8, device="cuda"), paged,
                                               q, causal, kvd)  # fmt: skip
        ref = runs["ragged_bf16"].out
        bad = [
            t
            for t in (
                "ragged_fp8",
                "ragged_fp8_kernel",
                "ragged_fp8_pass",
                "ragged_fp8_host_pass",
                "page16_fp8",
                "page16_fp8_host_pass",
            )  # fmt: skip
            if not peers.check_output(f"ours {t}", runs[t].out, ref)[1]
        ]
        if bad:
            print(f"  {name}: our fp8 output differs from the bf16 run on the same values ({bad}); not recorded")
            continue
        if fi is not None:
            ws = fi.workspace(512)
            run, why = peers.fi_call(_paged, fi, ws, paged8, q, causal, FP8, fi.prefill_page1_kw)
            if run is None:
                peers.say("flashinfer", why, f"{name} fp8")
            elif peers.check_output("flashinfer fp8 prefill", run.out, runs["page16_fp8"].out)[1]:
                runs["fi_fp8"] = run
        t = interleaved(dict(runs), calls=5 if quick else 15)
        flops = _flops(lens, H, D, causal)
        for layout, case in (("ragged", f"{name}/fp8kv"), ("page16", f"{name}/page16/fp8kv")):
            res.add(case, "cute_attn", "us", t[f"{layout}_fp8"])
            res.add(case, "cute_attn", "TFLOP/s", _tflops(flops, t[f"{layout}_fp8"]))
            res.add(case, "cute_attn", "vs_bf16", t[f"{layout}_fp8"] / t[f"{layout}_bf16"])
            res.add(case + "/bf16_same_run", "cute_attn", "us", t[f"{layout}_bf16"])
        for tag, sub in (("kernel", "in_kernel"), ("pass", "kv_pass"), ("host_pass", "host_pass")):
            res.add(f"{name}/fp8kv/{sub}", "cute_attn", "us", t[f"ragged_fp8_{tag}"])
            res.add(f"{name}/fp8kv/{sub}", "cute_attn", "vs_bf16", t[f"ragged_fp8_{tag}"] / t["ragged_bf16"])
        res.add(f"{name}/page16/fp8kv/host_pass", "cute_attn", "us", t["page16_fp8_host_pass"])
        res.add(f"{name}/page16/fp8kv/host_pass", "cute_attn", "vs_bf16", t["page16_fp8_host_pass"] / t["page16_bf16"])
        cols = ["n/a", "n/a"]
        if "fi_fp8" in t:
            res.add(f"{name}/page16/fp8kv", "flashinfer", "us", t["fi_fp8"])
            res.add(f"{name}/page16/fp8kv", "flashinfer", "ratio", t["fi_fp8"] / t["page16_fp8"])
            cols = [f"{t['fi_fp8']:8.1f}", f"{t['fi_fp8'] / t['page16_fp8']:7.2f}x"]
        for layout in ("ragged", "page16"):
            a, b = t[f"{layout}_bf16"], t[f"{layout}_fp8"]
            c = cols if layout == "page16" else ["", ""]
            tag = layout + ((" (widened)" if widened else " (KV pass)") if layout == "ragged" else "")
            print(f"{name + ' ' + tag:<56} {a:8.1f} {b:8.1f} {b / a:7.3f} {_tflops(flops, b):8.1f} "
                  f"{c[0]:>8} {c[1]:>8}")  # fmt: skip
        for tag, label in (("kernel", "ragged, kv_pass=False"), ("pass", "ragged, kv_pass=True"),
                           ("host_pass", "ragged, pass before the kernel")):  # fmt: skip
            a, b = t["ragged_bf16"], t[f"ragged_fp8_{tag}"]
            print(f"{name + ' ' + label:<56} {a:8.1f} {b:8.1f} {b / a:7.3f} {_tflops(flops, b):8.1f}")
        a, b = t["page16_bf16"], t["page16_fp8_host_pass"]
        print(f"{name + ' page16, pass before the kernel':<56} {a:8.1f} {b:8.1f} {b / a:7.3f} {_tflops(flops, b):8.1f}")
        del runs, paged8, paged16, k8, v8, k16, v16
    for case in SHORT_QUERIES:
        _short_queries(res, lib, gen, quick, *case)


# (case, query lengths, key lengths, q heads, kv heads): short queries over long keys, causal
SHORT_QUERIES = [
    ("prefill/hd128/causal/chunk512_kv8192", [512] * 8, [8192] * 8, 16, 16),  # chunked prefill
    ("prefill/hd128/causal/q4_kv4096_bs64", [4] * 64, [4096] * 64, 32, 8),  # speculative decoding
]


def _short_queries(res, lib, gen, quick, name, qo, kv, hq, hk) -> None:
    """A ragged batch of short queries over long keys (causal, bottom-right aligned): the plan's
    choice and both forced paths against the bf16 cache of the same values, all on the wgmma
    kernel (a 16-bit batch this short would take the portable one: another kernel's speed)."""
    q = torch.randn(sum(qo), hq, D, generator=gen).to(DT).cuda()
    k8 = torch.randn(sum(kv), hk, D, generator=gen).to(FP8).cuda()
    v8 = torch.randn(sum(kv), hk, D, generator=gen).to(FP8).cuda()
    qi, ki = _indptr(qo), _indptr(kv)
    runs = {}
    for tag, k, v, kw in (
        ("bf16", k8.to(DT), v8.to(DT), {}),
        ("fp8", k8, v8, {"kv_data_type": FP8}),
        ("fp8_kernel", k8, v8, {"kv_data_type": FP8, "kv_pass": False}),
        ("fp8_pass", k8, v8, {"kv_data_type": FP8, "kv_pass": True}),
    ):
        w = lib.mod.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(qi, ki, hq, hk, D, causal=True, q_data_type=DT, prefill_backend="prefill_sm90", **kw)
        out = torch.empty_like(q)
        runs[tag] = peers.Call(lambda w=w, k=k, v=v, out=out: w.run(q, k, v, out=out), out, w)
        runs[tag]()
    # the same keys in pages of 16 (a serving cache): the plan's choice and the pass, fp8 and bf16
    (kc, vc), _, kvi, idx, last = _paged_cache(kv, k8.to(DT), v8.to(DT), D, PAGE, gen)
    for tag, cache, kw in (
        ("page16_bf16", (kc, vc), {}),
        ("page16_fp8", (kc.to(FP8), vc.to(FP8)), {"kv_data_type": FP8}),
        ("page16_fp8_pass", (kc.to(FP8), vc.to(FP8)), {"kv_data_type": FP8, "kv_pass": True}),
    ):
        w = lib.mod.BatchPrefillWithPagedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(qi, kvi, idx, last, hq, hk, D, PAGE, causal=True, q_data_type=DT, prefill_backend="prefill_sm90", **kw)
        out = torch.empty_like(q)
        runs[tag] = peers.Call(lambda w=w, c=cache, out=out: w.run(q, c, out=out), out, w)
        runs[tag]()
    bad = [n for n in runs if n != "bf16" and not peers.check_output(f"ours {n}", runs[n].out, runs["bf16"].out)[1]]
    if bad:
        print(f"  {name}: fp8 output differs from the bf16 run ({bad}); not recorded")
        return
    t = interleaved(runs, calls=5 if quick else 15)
    flops = sum(4.0 * hq * D * (a * b - a * (a - 1) / 2) for a, b in zip(qo, kv))
    widened = runs["fp8"].wrapper._gathered is None
    res.add(f"{name}/fp8kv", "cute_attn", "us", t["fp8"])
    res.add(f"{name}/fp8kv", "cute_attn", "TFLOP/s", _tflops(flops, t["fp8"]))
    res.add(f"{name}/fp8kv", "cute_attn", "vs_bf16", t["fp8"] / t["bf16"])
    res.add(f"{name}/fp8kv/bf16_same_run", "cute_attn", "us", t["bf16"])
    for tag, sub in (("kernel", "in_kernel"), ("pass", "kv_pass")):
        res.add(f"{name}/fp8kv/{sub}", "cute_attn", "us", t[f"fp8_{tag}"])
        res.add(f"{name}/fp8kv/{sub}", "cute_attn", "vs_bf16", t[f"fp8_{tag}"] / t["bf16"])
    for tag, label in (("fp8", "widened" if widened else "KV pass"), ("fp8_kernel", "kv_pass=False"),
                       ("fp8_pass", "kv_pass=True")):  # fmt: skip
        a, b = t["bf16"], t[tag]
        print(f"{name + ' ' + label:<56} {a:8.1f} {b:8.1f} {b / a:7.3f} {_tflops(flops, b):8.1f}")
    pw = runs["page16_fp8"].wrapper._gathered is None
    for tag, sub in (("page16_fp8", "page16/fp8kv"), ("page16_fp8_pass", "page16/fp8kv/kv_pass")):
        res.add(f"{name}/{sub}", "cute_attn", "us", t[tag])
        res.add(f"{name}/{sub}", "cute_attn", "vs_bf16", t[tag] / t["page16_bf16"])
    res.add(f"{name}/page16/fp8kv/bf16_same_run", "cute_attn", "us", t["page16_bf16"])
    for tag, label in (
        ("page16_fp8", "page16 " + ("widened" if pw else "KV pass")),
        ("page16_fp8_pass", "page16 kv_pass=True"),
    ):
        a, b = t["page16_bf16"], t[tag]
        print(f"{name + ' ' + label:<56} {a:8.1f} {b:8.1f} {b / a:7.3f} {_tflops(flops, b):8.1f}")
