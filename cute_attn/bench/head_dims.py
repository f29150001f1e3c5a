"""Prefill at the head dims beyond 64 / 128 / 256: DeepSeek-V3/R1's prefill (head_dim_qk 192,
head_dim_vo 128, 128 heads, MHA, causal) and head dim 96, ragged, bf16.

Metric: TFLOP/s of the two GEMMs, 2·h·(d_qk + d_vo)·s² per request of s tokens, half of it when
causal (with d_qk = d_vo = d this is ``bench/prefill.py``'s 4·h·d·s²).  Cases:

* ``prefill/hd192_128/causal/h128/s{S}``: batch 2 x S tokens, 128 heads;
* ``prefill/hd128/causal/h128/s{S}``: the same shape at 128 / 128, timed in the same turns (its
  ``ratio`` under ``cute_attn``: the 192/128 time over it; the FLOP ratio is 320 / 256 = 1.25);
* ``prefill/hd96/causal/h32/s8192``: batch 2 x 8k, 32 heads;
* ``prefill/hd80/{causal,noncausal}/h32/s8192``: batch 2 x 8k, 32 heads (Phi-2's), against torch's
  SDPA (cuDNN and flash backends, pinned: a backend that cannot run the case raises) and
  FlashInfer where importable, all timed in turns;
* ``prefill/hd512/causal/h8/s4096``: batch 2 x 4k, 8 heads, on the wide ``mma.sync`` kernel
  (``kernels/decode_wide.py``; torch's SDPA backends stop at head dim 256).

FlashInfer's fa3 / fa2 at 192 / 128 are not prebuilt in the trimmed tree (they would JIT-compile
for minutes on the GPU machine): reported as a skip.  Outputs of each case are checked against
the fp32 reference on the first 1024 queries of request 0 before timing.
"""

from __future__ import annotations

import torch

from .common import interleaved

DT = torch.bfloat16


def _flops(lens, h, d_qk, d_vo, causal=True):
    return sum(2.0 * h * (d_qk + d_vo) * s * s * (0.5 if causal else 1.0) for s in lens)


def _indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _case(lens, h, d_qk, d_vo, gen):
    """A planned ragged wrapper (its own workspace) and its inputs: (call, q, k, v, out)."""
    from ..prefill import BatchPrefillWithRaggedKVCacheWrapper

    n = sum(lens)
    q = torch.randn(n, h, d_qk, generator=gen, device="cuda").to(DT)
    k = torch.randn(n, h, d_qk, generator=gen, device="cuda").to(DT)
    v = torch.randn(n, h, d_vo, generator=gen, device="cuda").to(DT)
    out = torch.empty(n, h, d_vo, dtype=DT, device="cuda")
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    ind = _indptr(lens)
    w.plan(ind, ind, h, h, d_qk, head_dim_vo=d_vo, causal=True, q_data_type=DT)
    call = lambda: w.run(q, k, v, out=out)  # noqa: E731
    call()
    return call, q, k, v, out


def _check(q, k, v, out, s):
    """The first 1024 queries of request 0 (length ``s``) against the fp32 reference."""
    from ..testing import ragged_reference

    r = min(1024, s)
    ind = torch.tensor([0, r], dtype=torch.int32)  # query i of request 0 sees keys 0 .. i
    ref, _ = ragged_reference(q[:r], k[:r], v[:r], ind, ind, causal=True)
    err = ((out[:r].float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"relative error {err:.3e}"
    return err


def bench_head_dims(res, quick: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = 4096 if quick else 8192
    lens = [s, s]
    calls = 5 if quick else 15
    fa = _case(lens, 128, 192, 128, gen)
    fb = _case(lens, 128, 128, 128, gen)
    for c in (fa, fb):
        _check(*c[1:], s)
    t = interleaved({"asym": fa[0], "sym": fb[0]}, calls)
    del fa, fb
    torch.cuda.empty_cache()
    f_a, f_b = _flops(lens, 128, 192, 128), _flops(lens, 128, 128, 128)
    ca, cb = f"prefill/hd192_128/causal/h128/s{s}", f"prefill/hd128/causal/h128/s{s}"
    for case, key, f in ((ca, "asym", f_a), (cb, "sym", f_b)):
        res.add(case, "cute_attn", "us", t[key])
        res.add(case, "cute_attn", "TFLOP/s", f / t[key] / 1e6)
        print(f"{case:44s} {t[key]:10.1f} us  {f / t[key] / 1e6:6.1f} TFLOP/s")
    res.add(ca, "cute_attn", "ratio", t["asym"] / t["sym"])
    print(f"{ca} / {cb}: {t['asym'] / t['sym']:.3f} (FLOPs 1.25); flashinfer: n/a (not prebuilt)")
    c96 = _case([8192, 8192], 32, 96, 96, gen)
    _check(*c96[1:], 8192)
    t96 = interleaved({"hd96": c96[0]}, calls)["hd96"]
    f96 = _flops([8192, 8192], 32, 96, 96)
    case = "prefill/hd96/causal/h32/s8192"
    res.add(case, "cute_attn", "us", t96)
    res.add(case, "cute_attn", "TFLOP/s", f96 / t96 / 1e6)
    print(f"{case:44s} {t96:10.1f} us  {f96 / t96 / 1e6:6.1f} TFLOP/s")
    del c96
    torch.cuda.empty_cache()
    bench_hd80(res, quick)
    bench_hd512(res, quick)


def bench_hd80(res, quick: bool) -> None:
    """Head dim 80, ragged 2 x 8k (``quick``: 2 x 4k), 32 heads, causal and not: ours, SDPA's
    cuDNN / flash backends and FlashInfer's ragged prefill in turns."""
    from . import peers
    from .prefill import _row, _sdpa_runner, _turns

    gen = torch.Generator(device="cuda").manual_seed(2)
    s, h, d = (4096 if quick else 8192), 32, 80
    lens = [s, s]
    q, k, v = (torch.randn(2 * s, h, d, generator=gen, device="cuda").to(DT) for _ in range(3))
    q4, k4, v4 = (x.view(2, s, h, d).transpose(1, 2).contiguous() for x in (q, k, v))
    fi = peers.flashinfer()
    for causal in (True, False):
        case = f"prefill/hd80/{'causal' if causal else 'noncausal'}/h{h}/s{s}"
        ours = peers.ragged_prefill(peers.ours(), torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                    _indptr(lens), q, k, v, causal, d)  # fmt: skip
        if causal:
            _check(q, k, v, ours.out, s)
        fns, why = {"ours": ours}, {}
        for be in ("cudnn", "flash"):
            fn, why[f"sdpa_{be}"] = _sdpa_runner(be, q4, k4, v4, causal)
            if fn is not None:
                fns[f"sdpa_{be}"] = fn
        fi_call = None
        if d not in peers.FI_HEAD_DIMS:
            why["flashinfer"] = peers.NO_HEAD_DIM
        elif fi is not None:
            fi_call, why["flashinfer"] = peers.fi_call(
                lambda: peers.ragged_prefill(fi, fi.workspace(128), _indptr(lens), q, k, v, causal, d)
            )
            if fi_call is not None:
                fns["flashinfer"] = fi_call
        med = _turns(fns, {"flashinfer"})
        base = [(i, (med[i], None) if i in med else (None, why[i])) for i in why]
        if fi_call is not None and "flashinfer" in med:
            _, ok = peers.check_output(f"flashinfer {case}", fi_call.out, ours.out)
            if not ok:
                base = [(i, (None, peers.DIFFERS) if i == "flashinfer" else tw) for i, tw in base]
        _row(res, case, _flops(lens, h, d, d, causal), med["ours"], base)
        del ours, fi_call, fns
        torch.cuda.empty_cache()


def bench_hd512(res, quick: bool) -> None:
    """Head dim 512: a causal 2 x 4k ragged prefill, 8 heads, TFLOP/s."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    calls = 5 if quick else 15
    s512 = 2048 if quick else 4096
    c512 = _case([s512, s512], 8, 512, 512, gen)
    _check(*c512[1:], s512)
    t512 = interleaved({"hd512": c512[0]}, calls)["hd512"]
    f512 = _flops([s512, s512], 8, 512, 512)
    case = f"prefill/hd512/causal/h8/s{s512}"
    res.add(case, "cute_attn", "us", t512)
    res.add(case, "cute_attn", "TFLOP/s", f512 / t512 / 1e6)
    print(f"{case:44s} {t512:10.1f} us  {f512 / t512 / 1e6:6.1f} TFLOP/s")
