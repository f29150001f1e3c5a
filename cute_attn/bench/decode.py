"""Paged decode vs FlashInfer (where importable), torch SDPA (cuDNN / flash backends, dense
padded KV) and FlexAttention.

Metric: KV bytes that must be read (sum of kv_len x kv_heads x head_dim x 2 tensors x 2 bytes)
over time.  Ours and FlashInfer (``use_tensor_cores=True``, its fastest decode for GQA) run the
same paged cache as serving engines run decode: CUDA-graph-enabled wrappers, ``LAYERS`` calls of
``run()`` captured in one graph as one engine step of that many layers and replayed, the time
divided by ``LAYERS`` (what runs once per step -- our kept-plan update, ~6 us on the H200 --
then counts once per step, as in an engine, not once per layer; eager ``run()`` recorded as
``.../eager``); FlashInfer's output is checked
against ours before its time is recorded.  The other baselines get the same data laid out dense
[batch, kv_heads, max_len, head_dim]; a skewed batch is padded to its longest request, which is
what a non-ragged kernel pays.  Cases: 32 q / 8 kv heads, head dim 128 (``decode_cases()``), and
(full runs) the gpt-oss shape, 64 q / 8 kv heads, head dim 64 (``shape_cases()``).
"""

from __future__ import annotations

import random

import torch

from . import peers
from .common import do_bench, flex_bench

HQ, HK, D = 32, 8, 128
LAYERS = 8  # run() calls per captured step (timings are per call)


def paged_cache(kv_lens, page_size, gen, hk=None, d=None):
    hk, d = hk or HK, d or D
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages)
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    k = torch.randn(total, page_size, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, page_size, hk, d, device="cuda", dtype=torch.bfloat16)
    return (k, v), indptr, indices, last


def _dense(kv_lens, hq=None, hk=None, d=None):
    hq, hk, d = hq or HQ, hk or HK, d or D
    b, lmax = len(kv_lens), max(kv_lens)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hk, lmax, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hk, lmax, d, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def _sdpa_time(backend, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel([be]):
            f(q, k, v, enable_gqa=True)
            return do_bench(lambda: f(q, k, v, enable_gqa=True)), "gqa"
    except Exception:
        pass
    rep = q.shape[1] // k.shape[1]  # backend without GQA support: expanded KV (reads rep x the bytes)
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    try:
        with sdpa_kernel([be]):
            f(q, ke, ve)
            return do_bench(lambda: f(q, ke, ve)), "expanded"
    except Exception as e:
        return None, f"n/a ({type(e).__name__})"


def _flex_time(q, k, v, kv_lens):
    """(time, None) or (None, why): FlexAttention compiled for this shape, a length mask."""
    lens = torch.tensor(kv_lens, device="cuda")

    def mask(b, h, qi, kvi):
        return kvi < lens[b]

    try:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(mask, len(kv_lens), None, 1, k.shape[2], device="cuda")
    except Exception as e:  # pragma: no cover
        return None, f"n/a ({type(e).__name__}: {str(e)[:100]})"
    t, _, why = flex_bench(lambda fa: fa(q, k, v, block_mask=bm, enable_gqa=True))
    return t, why


def decode_cases():
    """The bench's decode cases: (name, kv lengths, page size); the first three are the quick set."""
    rng = random.Random(0)
    return [
        ("bs64/kv4096/page16", [4096] * 64, 16),
        ("bs64/kv4096/page1", [4096] * 64, 1),
        ("bs256/kv1024/page16", [1024] * 256, 16),
        ("skew/1x32768+63x512/page16", [32768] + [512] * 63, 16),
        ("lognormal/bs128/page16", [max(1, min(32768, int(rng.lognormvariate(7.0, 1.0)))) for _ in range(128)], 16),
    ]


def shape_cases():
    """Decode cases of other head shapes: (name, kv lengths, page size, q heads, kv heads, head dim):
    gpt-oss (64 q / 8 kv heads, d64), head dim 512 (kernels/decode_wide.py; 16 q / 2 kv heads),
    MQA (32 q heads on one kv head: two 16-row items per token) and Phi-2 (32 / 32 heads, d80)."""
    return [
        ("bs64/kv4096/page16", [4096] * 64, 16, 64, 8, 64),
        ("bs64/kv4096/page16", [4096] * 64, 16, 16, 2, 512),
        ("bs64/kv4096/page16", [4096] * 64, 16, 32, 1, 128),
        ("bs64/kv4096/page16", [4096] * 64, 16, 32, 32, 80),
    ]


def _fi_decode(fi, ws, q, cache, indptr, indices, last, hq, hk, d, ps, ours_run):
    """FlashInfer's run of the case, its output checked against ours: (DecodeRun, eager time,
    max abs diff) or (None, why, None)."""
    if d not in peers.FI_HEAD_DIMS:
        return None, peers.NO_HEAD_DIM, None
    run, why = peers.fi_call(peers.DecodeRun, fi, ws, q, cache, indptr, indices, last, hq, hk, d, ps, layers=LAYERS)
    if run is None:
        return None, why, None
    if run.graph is None:
        print(f"  flashinfer: CUDA-graph capture failed ({run.graph_why}); its eager run() timed instead")
    try:
        ours_run.replay()
        run.replay()
        torch.cuda.synchronize()
        diff, ok = peers.check_output("flashinfer decode", run.out, ours_run.out)
        if not ok:
            return None, peers.DIFFERS, None
        return run, do_bench(run.eager), diff
    except Exception as e:
        return None, peers.why_failed(e), None


def _decode_case(res, lib_ours, fi, ws, ws_fi, gen, name, kv_lens, ps, hq, hk, d, quick):
    cache, indptr, indices, last = paged_cache(kv_lens, ps, gen, hk, d)
    b = len(kv_lens)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    # as a serving engine runs decode: a CUDA-graph-enabled wrapper, run() captured once and
    # replayed (the eager run() time is recorded too)
    ours = peers.DecodeRun(lib_ours, ws, q, cache, indptr, indices, last, hq, hk, d, ps, layers=LAYERS)
    if ours.graph is None:
        print(f"  cute_attn: CUDA-graph capture failed ({ours.graph_why}); eager run()s timed")
    t_eager = do_bench(ours.eager)
    t = do_bench(ours.replay) / LAYERS
    kv_bytes = sum(kv_lens) * hk * d * 2 * 2
    case = f"decode/hd{d}/gqa{hq // hk}/{name}"
    res.add(case, "cute_attn", "us", t)
    res.add(case, "cute_attn", "TB/s", kv_bytes / t / 1e6)
    res.add(case + "/eager", "cute_attn", "us", t_eager)
    # FlashInfer on the same paged cache, graph replay timed right after ours
    fi_col, note = "n/a", ""
    if fi is not None:
        run, fi_eager, diff = _fi_decode(fi, ws_fi, q, cache, indptr, indices, last, hq, hk, d, ps, ours)
        if run is None:  # fi_eager: why
            fi_col = peers.column(fi_eager)
            peers.say("flashinfer", fi_eager)
        else:
            tf = do_bench(run.replay) / LAYERS
            res.add(case, "flashinfer", "us", tf)
            res.add(case, "flashinfer", "TB/s", kv_bytes / tf / 1e6)
            res.add(case, "flashinfer", "ratio", tf / t)
            res.add(case + "/eager", "flashinfer", "us", fi_eager)
            res.add(case + "/eager", "flashinfer", "ratio", fi_eager / t_eager)
            fi_col = f"{tf:7.1f} ({tf / t:4.2f}x)"
            note = f"  fi maxdiff {diff:.1e}" + ("" if run.graph is not None else " (fi eager)")
        del run
    del ours, cache
    qd, kd, vd = _dense(kv_lens, hq, hk, d)
    cols = []
    for be in ("cudnn", "flash"):
        tb, how = _sdpa_time(be, qd, kd, vd)
        if tb is not None:
            res.add(case, f"sdpa_{be}", "us", tb)
            res.add(case, f"sdpa_{be}", "TB/s", kv_bytes / tb / 1e6)
            res.add(case, f"sdpa_{be}", "ratio", tb / t)
            cols.append(f"{tb:7.1f}us {kv_bytes / tb / 1e6:4.2f}")
        else:
            cols.append(f"{how:>14}")
    tf, why = (None, None) if quick else _flex_time(qd, kd, vd, kv_lens)
    if tf is not None:
        res.add(case, "flex", "us", tf)
        res.add(case, "flex", "ratio", tf / t)
    elif why is not None:
        print(f"  flex: {why}")
    del qd, kd, vd
    flex = f"{tf:9.1f}us" if tf else "n/a"
    label = name if (hq, hk, d) == (HQ, HK, D) else f"{hq}/{hk}h d{d} {name}"
    print(
        f"{label:<40} {t:8.1f} {kv_bytes / t / 1e6:6.3f} {t_eager:8.1f} {cols[0]:>14} {cols[1]:>14} {flex:>12} "
        f"{fi_col:>18}{note}"
    )


def bench_decode(res, quick: bool, shapes_only: bool = False, cases=None) -> None:
    """The decode cases (``quick``: the first three), then the other head shapes; ``shapes_only``
    (group ``decode_shapes``): those alone; ``cases``: these ``shape_cases()`` rows alone."""
    lib_ours, fi = peers.ours(), peers.flashinfer()
    gen = torch.Generator().manual_seed(0)
    if cases is None and shapes_only:
        cases = shape_cases()
    elif cases is None:
        cases = [(n, lens, ps, HQ, HK, D) for n, lens, ps in decode_cases()]
        cases = cases[:3] if quick else cases + shape_cases()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ws_fi = fi.workspace(256) if fi is not None else None
    print(
        f"{'decode case (bf16, 32/8 heads, d128)':<40} {'graph us':>8} {'TB/s':>6} {'eager us':>8} {'cudnn':>14} "
        f"{'flash':>14} {'flex':>12} {'flashinfer us (x)':>18}"
    )
    for name, kv_lens, ps, hq, hk, d in cases:
        if (hq, hk, d) == (HQ, HK, D):
            _decode_case(res, lib_ours, fi, ws, ws_fi, gen, name, kv_lens, ps, hq, hk, d, quick)
            continue
        try:  # the extra shapes: a kernel this build lacks is a skip, not the end of the bench
            _decode_case(res, lib_ours, fi, ws, ws_fi, gen, name, kv_lens, ps, hq, hk, d, quick)
        except Exception as e:
            print(f"{hq}/{hk}h d{d} {name}: failed ({type(e).__name__}: {' '.join(str(e).split())[:160]})")
