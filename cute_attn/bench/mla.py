"""MLA decode benchmarks (``python -m cute_attn bench --only mla``): cute_attn's
``BatchMLAPagedAttentionWrapper`` and, where ``import flashinfer`` has ``flashinfer.mla``,
FlashInfer's beside it on the same paged latent cache.

Cases (issue 25): ``mla/decode/h16/bs128/kv{4096,32768}/page64`` -- memory-bound: metric TB/s
of latent-cache bytes read (pages x page_size x (512 + 64) x 2 bytes per request) -- and
``mla/decode/h128/q2/bs64/kv8192/page64`` (two tokens per request, causal: MTP) -- compute-bound:
metric TFLOP/s, 2 x (576 + 512) x heads x attended (query, key) pairs -- and the memory-bound
cases over an fp8 (e4m3) latent cache (``.../fp8``: bytes counted at 1 per value; FlashInfer
beside it where its MLA takes an fp8 cache, else n/a).  Both wrappers run as a
serving engine runs them: CUDA-graph mode, run() captured once and the graph replayed; the two
are timed in turns (``common.interleaved``: one replay each, CUDA events, medians over 30
turns after warm-up), since the H200's clocks drift over seconds.  Our output must match the
fp32 reference on the first requests, and FlashInfer's ours (``peers.check_output``), before a
time is recorded."""

from __future__ import annotations

import math
import warnings

import torch

from .. import mla as ours_mla
from . import peers
from .common import interleaved

CKV, KPE = 512, 64
SM_SCALE = 1.0 / math.sqrt(128 + 64)  # DeepSeek-V3: the query head dim before absorption
REF_TOL = 2e-2  # bf16 output against the fp32 reference (the GPU tests' tolerance)


def mla_cases():
    """(case name, heads, tokens per request, kv lengths, page size, primary metric, cache
    dtype); the first is the quick set."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    return [
        ("mla/decode/h16/bs128/kv4096/page64", 16, 1, [4096] * 128, 64, "TB/s", bf16),
        ("mla/decode/h16/bs128/kv32768/page64", 16, 1, [32768] * 128, 64, "TB/s", bf16),
        ("mla/decode/h128/q2/bs64/kv8192/page64", 128, 2, [8192] * 64, 64, "TFLOP/s", bf16),
        ("mla/decode/h16/bs128/kv4096/page64/fp8", 16, 1, [4096] * 128, 64, "TB/s", e4m3),
        ("mla/decode/h16/bs128/kv32768/page64/fp8", 16, 1, [32768] * 128, 64, "TB/s", e4m3),
    ]


def latent_bytes(kv_lens, page_size, elem_bytes=2) -> int:
    """Bytes of latent cache the requests' pages hold (each page read once per request)."""
    return sum(-(-n // page_size) * page_size for n in kv_lens) * (CKV + KPE) * elem_bytes


def mla_flops(kv_lens, q_len, heads, causal) -> float:
    """2 x (576 + 512) x heads x attended pairs (causal: query i of q sees kv - q + i + 1 keys)."""
    pairs = sum(q_len * n - (q_len * (q_len - 1) // 2 if causal else 0) for n in kv_lens)
    return 2.0 * (CKV + KPE + CKV) * heads * pairs


def make_inputs(kv_lens, q_len, heads, page_size, gen_seed=0, kv_dtype=torch.bfloat16):
    """A paged latent cache of the requests' pages in shuffled order (``kv_dtype``: bf16 or fp8,
    rounded from bf16 values), the bf16 queries and the index arrays (CPU int32), on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    pages = [-(-n // page_size) for n in kv_lens]
    total = sum(pages)
    ckv = torch.randn(total, page_size, CKV, device="cuda", dtype=torch.bfloat16, generator=g)
    kpe = torch.randn(total, page_size, KPE, device="cuda", dtype=torch.bfloat16, generator=g)
    b = len(kv_lens)
    qn = torch.randn(b * q_len, heads, CKV, device="cuda", dtype=torch.bfloat16, generator=g)
    qp = torch.randn(b * q_len, heads, KPE, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    kv_indices = torch.randperm(total, generator=torch.Generator().manual_seed(gen_seed)).to(torch.int32)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32) * q_len
    kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32)
    ckv, kpe = ckv.to(kv_dtype), kpe.to(kv_dtype)
    return qn, qp, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len_arr


def reference_error(inputs, out, q_len, causal, requests=4) -> float:
    """Relative Frobenius error of our output for the first ``requests`` requests against the
    fp32 reference of the absorbed form (``cute_attn.testing``): the bench records no time for
    a kernel whose output is wrong."""
    from ..testing.mla_reference import mla_reference

    qn, qp, ckv, kpe, qo, kvp, idx, kvl = inputs
    ckv, kpe = ckv.to(qn.dtype), kpe.to(qn.dtype)  # an fp8 cache: its values, exactly
    n, rows = requests, requests * q_len
    ref, _ = mla_reference(qn[:rows], qp[:rows], ckv, kpe, qo[: n + 1], kvp[: n + 1], idx, kvl[:n], SM_SCALE, causal)
    return ((out[:rows].float() - ref).norm() / ref.norm()).item()


class MlaRun:
    """A CUDA-graph-enabled MLA wrapper of ``mod`` (``cute_attn.mla`` or ``flashinfer.mla``) with
    its own index buffers, planned, warmed up and its ``run()`` captured; ``replay`` replays the
    graph (the eager call where the capture failed: ``graph_why`` says why)."""

    def __init__(self, mod, ws, inputs, heads, page_size, causal):
        qn, qp, ckv, kpe, qo, kvp, idx, kvl = inputs
        bufs = dict(qo_indptr=qo.cuda(), kv_indptr=kvp.cuda(), kv_indices=idx.cuda(), kv_len_arr=kvl.cuda())
        w = mod.BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, backend="auto", **bufs)
        with warnings.catch_warnings():  # FlashInfer 0.7.2 deprecates the flat positional form
            warnings.simplefilter("ignore", DeprecationWarning)
            w.plan(qo, kvp, idx, kvl, heads, CKV, KPE, page_size, causal, SM_SCALE, torch.bfloat16, ckv.dtype)
        self.wrapper = w
        self.out = torch.empty_like(qn)
        self.eager = lambda: w.run(qn, qp, ckv, kpe, out=self.out)
        self.eager()  # loads the modules outside the capture
        torch.cuda.synchronize()
        self.graph, self.graph_why = peers.capture(self.eager)
        self.replay = self.graph.replay if self.graph is not None else self.eager


def _flashinfer_mla():
    """``flashinfer.mla`` or (None, why): the trimmed FlashInfer of the GPU machine may lack it."""
    fi = peers.flashinfer()
    if fi is None:
        return None, "import flashinfer failed"
    try:
        import flashinfer.mla as fim

        fim.BatchMLAPagedAttentionWrapper  # noqa: B018 (the attribute is what is checked)
        return fim, None
    except Exception as e:
        return None, f"import flashinfer.mla: {type(e).__name__}: {str(e)[:120]}"


def _case(res, fim, ws, ws_fi, name, heads, q_len, kv_lens, ps, metric, kv_dtype):
    causal = q_len > 1
    inputs = make_inputs(kv_lens, q_len, heads, ps, kv_dtype=kv_dtype)
    ours = MlaRun(ours_mla, ws, inputs, heads, ps, causal)
    if ours.graph is None:
        print(f"  cute_attn: CUDA-graph capture failed ({ours.graph_why}); eager run() timed")
    ours.replay()
    err = reference_error(inputs, ours.out, q_len, causal)
    if not err < REF_TOL:
        print(f"{name:<44} WRONG: relative error {err:.3e} against the fp32 reference (>= {REF_TOL}); not recorded")
        return
    fns = {"cute_attn": ours.replay}
    fi_run, fi_why = None, None
    if fim is not None:
        fi_run, fi_why = peers.fi_call(MlaRun, fim, ws_fi, inputs, heads, ps, causal)
        if fi_run is not None:
            ours.replay()
            fi_run.replay()
            torch.cuda.synchronize()
            _, ok = peers.check_output(f"flashinfer {name}", fi_run.out, ours.out)
            if ok:
                fns["flashinfer"] = fi_run.replay
            else:
                fi_why = peers.DIFFERS
    for fn in fns.values():  # warm-up beyond the capture's: clocks and caches settle
        for _ in range(3):
            fn()
    times = interleaved(fns, calls=30)
    nbytes, flops = latent_bytes(kv_lens, ps, kv_dtype.itemsize), mla_flops(kv_lens, q_len, heads, causal)
    for impl, t in times.items():
        res.add(name, impl, "us", t)
        res.add(name, impl, "TB/s", nbytes / t / 1e6)
        res.add(name, impl, "TFLOP/s", flops / t / 1e6)
    t = times["cute_attn"]
    res.add(name + "/eager", "cute_attn", "us", interleaved({"e": ours.eager}, calls=10)["e"])
    fi_col = "n/a"
    if "flashinfer" in times:
        tf = times["flashinfer"]
        res.add(name, "flashinfer", "ratio", tf / t)
        fi_col = f"{tf:9.1f} ({tf / t:4.2f}x)"
    elif fi_why is not None:
        fi_col = peers.column(fi_why)
        peers.say("flashinfer", fi_why, name)
    prim = nbytes / t / 1e6 if metric == "TB/s" else flops / t / 1e6
    splits = "split" if ours.wrapper._plan.has_split else "whole"
    print(f"{name:<44} {t:9.1f} {prim:8.3f} {metric:<8} {splits:>6} {fi_col:>20}")
    del ours, fi_run, inputs
    torch.cuda.empty_cache()


def bench_mla(res, quick: bool) -> None:
    fim, why = _flashinfer_mla()
    if fim is None:
        print(f"baseline flashinfer mla: n/a ({why})")
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    ws_fi = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") if fim is not None else None
    head = f"{'mla case (bf16, ckv 512 + kpe 64)':<44} {'graph us':>9} {'metric':>8} {'':<8} {'plan':>6}"
    print(f"{head} {'flashinfer us (x)':>20}")
    cases = mla_cases()[:1] if quick else mla_cases()
    for name, heads, q_len, kv_lens, ps, metric, kv_dtype in cases:
        try:
            _case(res, fim, ws, ws_fi, name, heads, q_len, kv_lens, ps, metric, kv_dtype)
        except Exception as e:  # a missing kernel (KernelNotAvailable) ends the case, not the bench
            print(f"{name:<44} failed: {type(e).__name__}: {str(e)[:200]}")
