"""Paged decode vs torch SDPA (cuDNN / flash backends, dense padded KV) and FlexAttention.

Metric: KV bytes that must be read (sum of kv_len x kv_heads x head_dim x 2 tensors x 2 bytes)
over time.  Baselines get the same data laid out dense [batch, kv_heads, max_len, head_dim]; a
skewed batch is padded to its longest request, which is what a non-ragged kernel pays.
"""

from __future__ import annotations

import random

import torch

from .common import do_bench

HQ, HK, D = 32, 8, 128


def _paged(kv_lens, page_size, gen):
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages)
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    k = torch.randn(total, page_size, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, page_size, HK, D, device="cuda", dtype=torch.bfloat16)
    return (k, v), indptr, indices, last


def _dense(kv_lens):
    b, lmax = len(kv_lens), max(kv_lens)
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, HK, lmax, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, HK, lmax, D, device="cuda", dtype=torch.bfloat16)
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
    rep = HQ // HK  # backend without GQA support: expanded KV (reads rep x the bytes)
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    try:
        with sdpa_kernel([be]):
            f(q, ke, ve)
            return do_bench(lambda: f(q, ke, ve)), "expanded"
    except Exception as e:
        return None, f"n/a ({type(e).__name__})"


def _flex_time(q, k, v, kv_lens):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    lens = torch.tensor(kv_lens, device="cuda")

    def mask(b, h, qi, kvi):
        return kvi < lens[b]

    try:
        bm = create_block_mask(mask, len(kv_lens), None, 1, k.shape[2], device="cuda")
        fa = torch.compile(flex_attention)
        fa(q, k, v, block_mask=bm, enable_gqa=True)
        return do_bench(lambda: fa(q, k, v, block_mask=bm, enable_gqa=True))
    except Exception as e:  # pragma: no cover
        print(f"  flex failed: {type(e).__name__}: {str(e)[:200]}")
        return None


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


def bench_decode(res, quick: bool) -> None:
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper

    gen = torch.Generator().manual_seed(0)
    cases = decode_cases()
    if quick:
        cases = cases[:3]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(
        f"{'decode case (bf16, 32/8 heads, d128)':<40} {'graph us':>8} {'TB/s':>6} {'eager us':>8} {'cudnn':>14} "
        f"{'flash':>14} {'flex':>12}"
    )
    for name, kv_lens, ps in cases:
        cache, indptr, indices, last = _paged(kv_lens, ps, gen)
        b = len(kv_lens)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        # as a serving engine runs decode: a CUDA-graph-enabled wrapper, run() captured once and
        # replayed (the eager run() time is recorded too)
        dev_bufs = dict(
            paged_kv_indptr_buffer=indptr.cuda(),
            paged_kv_indices_buffer=indices.cuda(),
            paged_kv_last_page_len_buffer=last.cuda(),
        )
        w = BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, **dev_bufs)
        w.plan(indptr, indices, last, HQ, HK, D, ps, q_data_type=torch.bfloat16)
        out = torch.empty_like(q)
        lse = torch.empty(b, HQ, device="cuda")
        w.run(q, cache, out=out, lse=lse)
        t_eager = do_bench(lambda: w.run(q, cache, out=out, lse=lse))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, cache, out=out, lse=lse)
        t = do_bench(g.replay)
        kv_bytes = sum(kv_lens) * HK * D * 2 * 2
        case = f"decode/hd128/gqa4/{name}"
        res.add(case, "cute_attn", "us", t)
        res.add(case, "cute_attn", "TB/s", kv_bytes / t / 1e6)
        res.add(case + "/eager", "cute_attn", "us", t_eager)
        del cache
        qd, kd, vd = _dense(kv_lens)
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
        tf = None if quick else _flex_time(qd, kd, vd, kv_lens)
        if tf is not None:
            res.add(case, "flex", "us", tf)
            res.add(case, "flex", "ratio", tf / t)
        del qd, kd, vd
        flex = f"{tf:9.1f}us" if tf else "n/a"
        print(f"{name:<40} {t:8.1f} {kv_bytes / t / 1e6:6.3f} {t_eager:8.1f} {cols[0]:>14} {cols[1]:>14} {flex:>12}")
