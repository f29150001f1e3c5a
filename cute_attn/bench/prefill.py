"""Batch prefill vs torch SDPA (cuDNN / flash backends) and FlexAttention, bf16, side by side.

Metric: TFLOP/s of the attention itself, 4·h·d·s² per request of s tokens (two GEMMs), half of
it when causal (FA's convention: 4·b·h·s²·d/2); a padded baseline is charged only the useful
FLOPs, so padding shows as a lower rate.  Times are medians (``common.do_bench``) of eager
calls; ours is ``run()`` of a planned wrapper (``plan()`` is per batch, not per layer).

Cases (records as docs/design.md §10; ``ratio`` under a baseline's impl = its time over ours, i.e. our
speed-up over it; under ``cute_attn`` = our time over the reference case's: paged over ragged,
soft-cap over plain attention):

* ``prefill/hd{128,256}/{causal,noncausal}/s8192``: batch 2 x 16 heads (no GQA, as FA's
  benchmarks), ragged KV; ``.../page16`` and ``.../page1``: the same shapes from a paged cache
  (pages in random order) as the wrapper runs them (the KV pass gathering the cache first where
  its model says so), and with ``kv_pass=False``: ``.../page16/page_boxes`` (the kernel's TMA
  page boxes), ``.../page1/in_kernel_gather`` (its cp.async gather);
* ``prefill/hd128/causal/varlen32_lognormal2k``: 32 requests of lognormal lengths (mean ~2k,
  fixed seed), ragged, vs FlexAttention over the packed tokens with a document (block-diagonal
  causal) mask and SDPA on padded dense tensors;
* ``variant/softcap/prefill/hd128/causal/s8192``: soft-cap 30 (ours and FlexAttention with a
  tanh score_mod).

A baseline that is unavailable (backend missing, shape unsupported) is reported as a skip.
Ours (ragged, the four paged rows, soft-cap) and the SDPA baselines of the s8192 cases are timed
one call at a time in turns (ragged, page 16, ..., cuDNN, flash, ragged, ...; 25 calls each,
CUDA events per call, medians): the H200's clocks drift by up to ~15 % within seconds (boost
first, lower under sustained load), so times taken apart -- even best-of-N in alternating rounds
-- gave paged / ragged ratios from 1.03 to 1.14 for the same kernels.
Each wrapper plans once on a workspace of its own, so all stay planned through the turns.
"""

from __future__ import annotations

import random

import torch

from .common import do_bench, interleaved

B, H, S = 2, 16, 8192
DT = torch.bfloat16
SOFT_CAP = 30.0


def _flops(lens, h, d, causal):
    return sum(4.0 * h * d * s * s * (0.5 if causal else 1.0) for s in lens)


def _tflops(flops, t_us):
    return flops / t_us / 1e6


def _indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _ragged_runner(lens, q, k, v, causal, d, soft_cap=None):
    """A planned ragged wrapper's ``run()`` (one warm-up call done), on its own workspace."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    ind = _indptr(lens)
    w.plan(ind, ind, q.shape[1], k.shape[1], d, causal=causal, q_data_type=DT, logits_soft_cap=soft_cap)
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[1], device="cuda")
    w.run(q, k, v, out=out, lse=lse)
    return lambda: w.run(q, k, v, out=out, lse=lse)


def _paged_runner(lens, q, k, v, causal, d, page_size, gen, kv_pass=None):
    """The same for the ragged k/v re-cut into pages of ``page_size`` tokens in random order
    (every request starts on a page boundary; the lengths are multiples of the page size here);
    ``kv_pass``: plan()'s option (None: the wrapper's choice).  Its own 512 MB workspace: room
    for the plan and the KV pass's contiguous K and V (268 MB at hd256)."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    assert all(n % page_size == 0 for n in lens)
    n_pages = k.shape[0] // page_size
    perm = torch.randperm(n_pages, generator=gen)
    kc = torch.empty(n_pages, page_size, k.shape[1], d, dtype=DT, device="cuda")
    vc = torch.empty_like(kc)
    kc[perm.cuda()] = k.view(n_pages, page_size, k.shape[1], d)
    vc[perm.cuda()] = v.view(n_pages, page_size, k.shape[1], d)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(
        _indptr(lens),
        _indptr([n // page_size for n in lens]),
        perm.to(torch.int32),
        torch.full((len(lens),), page_size, dtype=torch.int32),
        q.shape[1],
        k.shape[1],
        d,
        page_size,
        causal=causal,
        q_data_type=DT,
        kv_pass=kv_pass,
    )
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[1], device="cuda")
    w.run(q, (kc, vc), out=out, lse=lse)
    return lambda: w.run(q, (kc, vc), out=out, lse=lse)


def _sdpa_runner(backend, q4, k4, v4, causal):
    """(a call of SDPA pinned to ``backend``, None) or (None, why it is unavailable)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    f = torch.nn.functional.scaled_dot_product_attention

    def call():
        with sdpa_kernel([be]):
            f(q4, k4, v4, is_causal=causal)

    try:
        call()
        return call, None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def _sdpa(backend, q4, k4, v4, causal):
    """(time, None) or (None, why); q4/k4/v4 [batch, heads, seq, dim]."""
    fn, why = _sdpa_runner(backend, q4, k4, v4, causal)
    return (do_bench(fn), None) if fn is not None else (None, why)


_FLEX = {}


def _flex_fn():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention)
    return _FLEX["fn"]


def _flex(q4, k4, v4, mask_mod=None, score_mod=None):
    """(time, None) or (None, why).  ``mask_mod`` None: no block mask (dense)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        fa = _flex_fn()
        bm = None
        if mask_mod is not None:
            bm = create_block_mask(mask_mod, None, None, q4.shape[2], k4.shape[2], device="cuda")
        fa(q4, k4, v4, block_mask=bm, score_mod=score_mod)
        return do_bench(lambda: fa(q4, k4, v4, block_mask=bm, score_mod=score_mod)), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def _causal_mask(b, h, qi, kvi):
    return qi >= kvi


def _softcap_mod(score, b, h, qi, kvi):
    return SOFT_CAP * torch.tanh(score / SOFT_CAP)


def _row(res, case, flops, t_ours, baselines, extra=""):
    """Record ours + baselines, print one line."""
    res.add(case, "cute_attn", "us", t_ours)
    res.add(case, "cute_attn", "TFLOP/s", _tflops(flops, t_ours))
    cols = []
    for impl, (t, why) in baselines:
        if t is None:
            print(f"  {case}: {impl} skipped ({why})")
            cols.append(f"{'n/a':>15}")
            continue
        res.add(case, impl, "us", t)
        res.add(case, impl, "TFLOP/s", _tflops(flops, t))
        res.add(case, impl, "ratio", t / t_ours)
        cols.append(f"{_tflops(flops, t):7.1f} ({t / t_ours:4.2f}x)")
    print(f"{case:<48} {_tflops(flops, t_ours):7.1f} {t_ours:9.1f}  " + " ".join(cols) + extra)


def bench_prefill(res, quick: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    impls = ("sdpa_cudnn", "sdpa_flash", "flex")
    print(
        f"{'prefill case (bf16; TFLOP/s, ours/baseline)':<48} {'ours':>7} {'us':>9}  "
        + " ".join(f"{i:>15}" for i in impls)
    )
    lens = [S] * B
    for d in (128,) if quick else (128, 256):
        q = torch.randn(B * S, H, d, device="cuda", dtype=DT)
        k = torch.randn(B * S, H, d, device="cuda", dtype=DT)
        v = torch.randn(B * S, H, d, device="cuda", dtype=DT)
        q4, k4, v4 = (x.view(B, S, H, d).transpose(1, 2).contiguous() for x in (q, k, v))
        for causal in (False, True):
            case = f"prefill/hd{d}/{'causal' if causal else 'noncausal'}/s{S}"
            flops = _flops(lens, H, d, causal)
            # ours: ragged; paged as the wrapper runs it (the KV pass where its model says so) and
            # with kv_pass=False (page 16: TMA page boxes, page 1: the cp.async gather); soft-cap
            ours = {"": _ragged_runner(lens, q, k, v, causal, d)}
            for ps, kv_pass, tag in (
                (16, None, ""),
                (16, False, "/page_boxes"),
                (1, None, ""),
                (1, False, "/in_kernel_gather"),
            )[: 1 if quick else None]:
                ours[f"/page{ps}{tag}"] = _paged_runner(lens, q, k, v, causal, d, ps, gen, kv_pass)
            if d == 128 and causal:
                ours["softcap"] = _ragged_runner(lens, q, k, v, causal, d, soft_cap=SOFT_CAP)
            # all of them and the SDPA baselines timed in turns (``common.interleaved``): ratios of
            # times taken seconds apart would carry the clocks' drift
            fns, why = dict(ours), {}
            for be in ("cudnn", "flash"):
                fn, why[f"sdpa_{be}"] = _sdpa_runner(be, q4, k4, v4, causal)
                if fn is not None:
                    fns[f"sdpa_{be}"] = fn
            med = interleaved(fns)
            t = med[""]
            base = [(impl, (med[impl], None) if impl in med else (None, why[impl])) for impl in why]
            if not quick:
                base.append(("flex", _flex(q4, k4, v4, _causal_mask if causal else None)))
            _row(res, case, flops, t, base)
            for name in ours:
                if not name.startswith("/page"):
                    continue
                tp = med[name]
                pcase = case + name
                res.add(pcase, "cute_attn", "us", tp)
                res.add(pcase, "cute_attn", "TFLOP/s", _tflops(flops, tp))
                res.add(pcase, "cute_attn", "ratio", tp / t)
                print(f"{pcase:<48} {_tflops(flops, tp):7.1f} {tp:9.1f}  ({tp / t:4.2f}x the ragged time)")
            if "softcap" in ours:
                tc = med["softcap"]
                vcase = f"variant/softcap/{case}"
                res.add(vcase, "cute_attn", "ratio", tc / t)
                fl = [] if quick else [("flex", _flex(q4, k4, v4, _causal_mask, _softcap_mod))]
                _row(res, vcase, flops, tc, fl, extra=f"  ({tc / t:4.2f}x plain attention's time)")
            del ours
        del q, k, v, q4, k4, v4

    # a skewed ragged batch: 32 lognormal lengths (mean ~2k), causal, hd128
    rng = random.Random(0)
    lens = [max(64, min(16384, int(rng.lognormvariate(7.3, 0.8)))) for _ in range(32)]
    d, total = 128, sum(lens)
    case = "prefill/hd128/causal/varlen32_lognormal2k"
    flops = _flops(lens, H, d, True)
    q = torch.randn(total, H, d, device="cuda", dtype=DT)
    k = torch.randn(total, H, d, device="cuda", dtype=DT)
    v = torch.randn(total, H, d, device="cuda", dtype=DT)
    t = do_bench(_ragged_runner(lens, q, k, v, True, d))
    base = []
    lmax = max(lens)
    pad = (
        lambda x: (
            torch.stack(
                [
                    torch.nn.functional.pad(x[s : s + n], (0, 0, 0, 0, 0, lmax - n))  # noqa: E731
                    for s, n in zip(_indptr(lens)[:-1].tolist(), lens)
                ]
            )
            .transpose(1, 2)
            .contiguous()
        )
    )
    qp, kp, vp = pad(q), pad(k), pad(v)  # [32, H, lmax, d]; causal top-left = correct for valid rows
    base += [("sdpa_cudnn", _sdpa("cudnn", qp, kp, vp, True)), ("sdpa_flash", _sdpa("flash", qp, kp, vp, True))]
    del qp, kp, vp
    if not quick:
        doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))

        def doc_causal(b, h, qi, kvi):
            return (doc[qi] == doc[kvi]) & (qi >= kvi)

        q1, k1, v1 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, total, d]
        base.append(("flex", _flex(q1, k1, v1, doc_causal)))
        del q1, k1, v1
    _row(res, case, flops, t, base, extra=f"  (lengths {min(lens)}..{lmax}, {total} tokens; SDPA padded)")
