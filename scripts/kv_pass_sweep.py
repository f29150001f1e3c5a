"""The paged prefill's two ways to read a cache the kernel cannot read by TMA boxes, side by
side per case: the KV pass (``plan(kv_pass=True)``: gather K/V -- and rotate K for RoPE --
into the workspace, then the TMA kernel) and the in-kernel cp.async gather
(``kv_pass=False``), with what the default (``families.backends.kv_pass_pays``) picks, and the pass
alone (its bandwidth: K and V read + written).  Checks the model's thresholds on the GPU.

    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=build/aot python scripts/kv_pass_sweep.py [--check]

``--check``: other head dims and group sizes (out of the sample the model's constants were
set from), page 1, causal.  ``--page16``: page 16 plain, where the kernel reads the pages by
TMA boxes and the model never picks the pass (is there something to gain?).
"""

import argparse
import json

import torch
from triton.testing import do_bench

from cute_attn.families.backends import kv_pass_pays
from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

DT = torch.bfloat16


def check_cases():
    """(name, qo lens, kv lens, hq, hk, head dim, page size, causal, RoPE), page 1 plain causal:
    hd64 and hd256, GQA 8, near and far from the break-even."""
    out = []
    for d, hq, hk, qo, kv, b in (
        (64, 32, 8, 256, 8192, 8),
        (64, 32, 8, 1024, 8192, 4),
        (64, 32, 8, 4096, 4096, 2),
        (256, 16, 4, 256, 8192, 4),
        (256, 16, 4, 1024, 8192, 2),
        (256, 16, 4, 4096, 4096, 2),
        (128, 64, 8, 128, 8192, 8),
        (128, 64, 8, 512, 8192, 4),
        (128, 64, 8, 4096, 4096, 2),
    ):
        out.append((f"check/hd{d}/{hq}x{hk}/{b}x{qo}on{kv}", [qo] * b, [kv] * b, hq, hk, d, 1, True, False))
    return out


def page16_cases():
    """Page 16 plain (TMA page boxes in the kernel), long prefills and appends."""
    out = []
    for d, hq, hk in ((128, 16, 16), (128, 32, 8), (256, 16, 16)):
        for causal in (False, True):
            for qo, kv, b in ((8192, 8192, 2), (1024, 8192, 2)):
                out.append(
                    (
                        f"page16/hd{d}/{hq}x{hk}/{'c' if causal else 'nc'}/{b}x{qo}on{kv}",
                        [qo] * b,
                        [kv] * b,
                        hq,
                        hk,
                        d,
                        16,
                        causal,
                        False,
                    )
                )
    return out


def cases():
    """(name, qo lens, kv lens, hq, hk, head dim, page size, causal, RoPE): page 1 plain, 32 / 8 heads,
    appends of growing query chunks onto 8k contexts and full prefills; page 16 with RoPE
    (16 / 2 heads, non-causal: the specs the variant tests compile)."""
    out = []
    for causal in (True, False):
        for qo, kv, b in (
            (128, 8192, 8),
            (512, 8192, 4),
            (1024, 8192, 4),
            (2048, 8192, 2),
            (4096, 8192, 2),
            (8192, 8192, 1),
        ):
            out.append(
                (f"page1/{'c' if causal else 'nc'}/{b}x{qo}on{kv}", [qo] * b, [kv] * b, 32, 8, 128, 1, causal, False)
            )
    for qo, kv, b in ((32, 8192, 8), (128, 8192, 8), (512, 8192, 4), (2048, 8192, 2)):
        out.append((f"rope/page16/nc/{b}x{qo}on{kv}", [qo] * b, [kv] * b, 16, 2, 128, 16, False, True))
    return out


def paged_cache(kv_lens, ps, hk, d, gen):
    pages = [(n + ps - 1) // ps for n in kv_lens]
    total = sum(pages)
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    kc = torch.randn(total, ps, hk, d, generator=gen).to(DT).cuda()
    vc = torch.randn(total, ps, hk, d, generator=gen).to(DT).cuda()
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return (kc, vc), indptr, perm, last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="the out-of-sample cases")
    ap.add_argument("--page16", action="store_true", help="page 16 plain: TMA page boxes vs the pass")
    a = ap.parse_args()
    todo = check_cases() if a.check else page16_cases() if a.page16 else cases()
    gen = torch.Generator().manual_seed(0)
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for name, qo, kv, hq, hk, d, ps, causal, rope in todo:
        cache, indptr, indices, last = paged_cache(kv, ps, hk, d, gen)
        q = torch.randn(sum(qo), hq, d, generator=gen).to(DT).cuda()
        qo_indptr = torch.tensor([0] + list(torch.tensor(qo).cumsum(0).tolist()), dtype=torch.int32)
        kw = dict(pos_encoding_mode="ROPE_LLAMA") if rope else {}
        rec = dict(case=name, model_picks_pass=kv_pass_pays(qo, kv, hq, hk, d, causal, rope))
        outs = {}
        for kv_pass in (True, False):
            w = BatchPrefillWithPagedKVCacheWrapper(ws)
            w.plan(
                qo_indptr, indptr, indices, last, hq, hk, d, ps, causal=causal, q_data_type=DT, kv_pass=kv_pass, **kw
            )
            out = torch.empty_like(q)
            w.run(q, cache, out=out)
            outs[kv_pass] = out.float()
            rec["pass_us" if kv_pass else "in_kernel_us"] = round(
                min(do_bench(lambda: w.run(q, cache, out=out), warmup=25, rep=100) for _ in range(2)) * 1e3, 1
            )
            if kv_pass:  # the pass alone (internal handles: a dev script)
                mod, vals = w._kv_pass.select(())
                k_g, v_g = w._gathered
                k4, v4 = cache
                args = (
                    k4,
                    v4,
                    k_g,
                    v_g,
                    w._qo_indptr,
                    w._kv_tok_indptr,
                    w._kv_indptr,
                    w._kv_indices,
                    w._batch,
                    w._sm_scale,
                    w._num_ctas * 8,
                    *vals,
                )
                t = do_bench(lambda: mod(*args), warmup=25, rep=100) * 1e3
                rec["pass_alone_us"] = round(t, 1)
                rec["pass_TBps"] = round(2 * 2 * sum(kv) * hk * d * 2 / t / 1e6, 2)
        rec["in_kernel_over_pass"] = round(rec["in_kernel_us"] / rec["pass_us"], 3)
        rec["max_abs_diff"] = round((outs[True] - outs[False]).abs().max().item(), 4)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
