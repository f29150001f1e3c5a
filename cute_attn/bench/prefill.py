"""Batch prefill vs FlashInfer (where importable), torch SDPA (cuDNN / flash backends) and
FlexAttention, bf16, side by side.

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
  causal) mask and SDPA on padded dense tensors; ``prefill/hd128/causal/bimodal48`` the same for
  a bimodal mix: 8 long prompts (4-8k tokens) among 40 short turns (64-512), shuffled;
* ``variant/softcap/prefill/hd128/causal/s8192``: soft-cap 30 (ours and FlexAttention with a
  tanh score_mod).

FlashInfer (impl ``flashinfer``; ``bench/peers.py``): the same wrappers on the same tensors --
ragged and page 16 with ``backend="fa3"``, page 1 with ``backend="fa2"`` -- in the same turns as
ours, its ``ratio`` over our matching row (ragged / page 16 / page 1 as the wrapper runs it),
its output checked against ours first; a module FlashInfer would have to JIT-compile (soft-cap,
other head dims) is ``n/a (not prebuilt)`` unless ``CUTE_ATTN_BENCH_FI_JIT=1``.  FlexAttention is
compiled afresh for every shape (``common.flex_bench``); an unfused fallback is a skip.

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

from . import peers
from .common import do_bench, flex_bench, interleaved

B, H, S = 2, 16, 8192
DT = torch.bfloat16
SOFT_CAP = 30.0
IMPLS = ("sdpa_cudnn", "sdpa_flash", "flex", "flashinfer")  # the table's baseline columns


def _flops(lens, h, d, causal):
    return sum(4.0 * h * d * s * s * (0.5 if causal else 1.0) for s in lens)


def _tflops(flops, t_us):
    return flops / t_us / 1e6


def varlen32_lengths() -> list:
    """The lengths of ``prefill/hd128/causal/varlen32_lognormal2k``: 32 lognormal lengths (mean
    ~2k, 232-5672 tokens), the same every run."""
    rng = random.Random(0)
    return [max(64, min(16384, int(rng.lognormvariate(7.3, 0.8)))) for _ in range(32)]


def bimodal_lengths() -> list:
    """The lengths of ``prefill/hd128/causal/bimodal48``: 8 long prompts (4096-8192 tokens) among 40
    short turns (64-512), shuffled, the same every run (~60k tokens, as the lognormal batch)."""
    rng = random.Random(1)
    lens = [rng.randint(4096, 8192) for _ in range(8)] + [rng.randint(64, 512) for _ in range(40)]
    rng.shuffle(lens)
    return lens


def _indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _ragged_runner(lens, q, k, v, causal, d, soft_cap=None):
    """A planned ragged wrapper's ``run()`` (one warm-up call done), on its own workspace;
    ``.out``: its output."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    return peers.ragged_prefill(peers.ours(), ws, _indptr(lens), q, k, v, causal, d, logits_soft_cap=soft_cap)


def _paged_cache(lens, k, v, d, page_size, gen):
    """The ragged k/v re-cut into pages of ``page_size`` tokens in random order (every request
    starts on a page boundary; the lengths are multiples of the page size here): (cache, qo
    indptr, kv page indptr, page indices, last page lengths)."""
    assert all(n % page_size == 0 for n in lens)
    n_pages = k.shape[0] // page_size
    perm = torch.randperm(n_pages, generator=gen)
    kc = torch.empty(n_pages, page_size, k.shape[1], d, dtype=DT, device="cuda")
    vc = torch.empty_like(kc)
    kc[perm.cuda()] = k.view(n_pages, page_size, k.shape[1], d)
    vc[perm.cuda()] = v.view(n_pages, page_size, k.shape[1], d)
    last = torch.full((len(lens),), page_size, dtype=torch.int32)
    return (kc, vc), _indptr(lens), _indptr([n // page_size for n in lens]), perm.to(torch.int32), last


def _paged_runner(paged, q, causal, d, page_size, kv_pass=None):
    """Our paged wrapper on ``_paged_cache``'s cache; ``kv_pass``: plan()'s option (None: the
    wrapper's choice).  Its own 512 MB workspace: room for the plan and the KV pass's contiguous
    K and V (268 MB at hd256)."""
    cache, qo, kvi, idx, last = paged
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    return peers.paged_prefill(peers.ours(), ws, qo, kvi, idx, last, q, cache, causal, d, page_size, kv_pass=kv_pass)


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


def _flex(q4, k4, v4, mask_mod=None, score_mod=None):
    """(time, None) or (None, why): FlexAttention compiled for this shape (``common.flex_bench``).
    ``mask_mod`` None: no block mask (dense)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = None
        if mask_mod is not None:
            bm = create_block_mask(mask_mod, None, None, q4.shape[2], k4.shape[2], device="cuda")
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:120]}"
    t, _, why = flex_bench(lambda fa: fa(q4, k4, v4, block_mask=bm, score_mod=score_mod))
    return t, why


def _causal_mask(b, h, qi, kvi):
    return qi >= kvi


def _softcap_mod(score, b, h, qi, kvi):
    return SOFT_CAP * torch.tanh(score / SOFT_CAP)


def _cell(impl, t, why, t_ours, flops):
    if t is None:
        return f"{peers.column(why):>18}"
    return f"{_tflops(flops, t):7.1f} ({t / t_ours:4.2f}x)".rjust(18)


def _row(res, case, flops, t_ours, baselines, extra=""):
    """Record ours + baselines (a list of (impl, (time, why))), print one line: a column per
    ``IMPLS`` entry ('-': not run)."""
    res.add(case, "cute_attn", "us", t_ours)
    res.add(case, "cute_attn", "TFLOP/s", _tflops(flops, t_ours))
    got = dict(baselines)
    for impl, (t, why) in baselines:
        if t is None:
            peers.say(impl, why, case)
            continue
        res.add(case, impl, "us", t)
        res.add(case, impl, "TFLOP/s", _tflops(flops, t))
        res.add(case, impl, "ratio", t / t_ours)
    cols = [_cell(i, *got[i], t_ours, flops) if i in got else f"{'-':>18}" for i in IMPLS]
    print(f"{case:<48} {_tflops(flops, t_ours):7.1f} {t_ours:9.1f}  " + " ".join(cols) + extra)


def _fi_runners(fi, lens, q, k, v, causal, d, paged, ours):
    """FlashInfer's runners of an s8192 case, keyed as ours ("" ragged, "/page16", "/page1", "softcap"
    where ours has the row): ({key: Call}, {key: why})."""
    ind = _indptr(lens)
    calls, why = {}, {}
    todo = [("", lambda: peers.ragged_prefill(fi, fi.workspace(128), ind, q, k, v, causal, d))]
    for ps in (16, 1):
        if f"/page{ps}" in ours:
            cache, qo, kvi, idx, last = paged[ps]

            def mk(cache=cache, qo=qo, kvi=kvi, idx=idx, last=last, ps=ps):
                return peers.paged_prefill(fi, fi.workspace(128), qo, kvi, idx, last, q, cache, causal, d, ps)

            todo.append((f"/page{ps}", mk))
    if "softcap" in ours:
        todo.append(
            (
                "softcap",
                lambda: peers.ragged_prefill(fi, fi.workspace(128), ind, q, k, v, causal, d, logits_soft_cap=SOFT_CAP),
            )
        )
    for key, make in todo:
        call, why[key] = peers.fi_call(make)
        if call is not None:
            calls[key] = call
    return calls, why


def _turns(fns, optional):
    """``interleaved(fns)``; where that fails, once more without the ``optional`` keys (the
    peers), their failure printed: a peer never stops the bench."""
    try:
        return interleaved(fns)
    except Exception as e:
        if not any(key in fns for key in optional):
            raise
        print(f"  timing in turns failed with the peers ({peers.why_failed(e)}); again without them")
        return interleaved({key: fn for key, fn in fns.items() if key not in optional})


def _fi_result(key, fi_calls, fi_why, med, ref, what):
    """(FlashInfer's time, None) for one key after the turns, its output checked against ``ref``
    (ours), or (None, why)."""
    if key not in fi_calls:
        return None, fi_why.get(key, "n/a")
    if "fi" + key not in med:
        return None, "failed (in the turns)"
    diff, ok = peers.check_output(what, fi_calls[key].out, ref)
    if not ok:
        return None, peers.DIFFERS
    return med["fi" + key], None


def bench_prefill(res, quick: bool) -> None:
    fi = peers.flashinfer()
    gen = torch.Generator().manual_seed(0)
    print(
        f"{'prefill case (bf16; TFLOP/s, ours/baseline)':<48} {'ours':>7} {'us':>9}  "
        + " ".join(f"{i:>18}" for i in IMPLS)
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
            # with kv_pass=False (page 16: TMA page boxes, page 1: the cp.async gather); soft-cap.
            # One paged cache per page size, shared by our rows and FlashInfer's.
            ours = {"": _ragged_runner(lens, q, k, v, causal, d)}
            rows = ((16, None, ""), (16, False, "/page_boxes"), (1, None, ""), (1, False, "/in_kernel_gather"))
            paged = {}
            for ps, kv_pass, tag in rows[: 1 if quick else None]:
                if ps not in paged:
                    paged[ps] = _paged_cache(lens, k, v, d, ps, gen)
                ours[f"/page{ps}{tag}"] = _paged_runner(paged[ps], q, causal, d, ps, kv_pass)
            if d == 128 and causal:
                ours["softcap"] = _ragged_runner(lens, q, k, v, causal, d, soft_cap=SOFT_CAP)
            fi_calls, fi_why = _fi_runners(fi, lens, q, k, v, causal, d, paged, ours) if fi else ({}, {})
            # all of them, FlashInfer's and the SDPA baselines timed in turns
            # (``common.interleaved``): ratios of times taken seconds apart would carry the clocks' drift
            fns, why = dict(ours), {}
            fns.update({"fi" + key: call for key, call in fi_calls.items()})
            for be in ("cudnn", "flash"):
                fn, why[f"sdpa_{be}"] = _sdpa_runner(be, q4, k4, v4, causal)
                if fn is not None:
                    fns[f"sdpa_{be}"] = fn
            med = _turns(fns, {"fi" + key for key in fi_calls})
            t = med[""]
            base = [(impl, (med[impl], None) if impl in med else (None, why[impl])) for impl in why]
            if not quick:
                base.append(("flex", _flex(q4, k4, v4, _causal_mask if causal else None)))
            fi_res = {}
            if fi is not None:
                for key in ("", "/page16", "/page1", "softcap"):
                    if key in ours:
                        ref = ours[key].out
                        fi_res[key] = _fi_result(key, fi_calls, fi_why, med, ref, f"flashinfer {case}{key}")
                base.append(("flashinfer", fi_res[""]))
            _row(res, case, flops, t, base, extra=_fi_diff_note(fi_calls, fi_res, ours, ""))
            for name in ours:
                if not name.startswith("/page"):
                    continue
                tp = med[name]
                pcase = case + name
                res.add(pcase, "cute_attn", "us", tp)
                res.add(pcase, "cute_attn", "TFLOP/s", _tflops(flops, tp))
                res.add(pcase, "cute_attn", "ratio", tp / t)
                fi_txt = ""
                if name in fi_res:
                    tf, wf = fi_res[name]
                    if tf is None:
                        peers.say("flashinfer", wf, pcase)
                        fi_txt = f"  flashinfer {peers.column(wf)}"
                    else:
                        res.add(pcase, "flashinfer", "us", tf)
                        res.add(pcase, "flashinfer", "TFLOP/s", _tflops(flops, tf))
                        res.add(pcase, "flashinfer", "ratio", tf / tp)
                        fi_txt = f"  flashinfer {_tflops(flops, tf):7.1f} ({tf / tp:4.2f}x)"
                        fi_txt += _fi_diff_note(fi_calls, fi_res, ours, name)
                print(f"{pcase:<48} {_tflops(flops, tp):7.1f} {tp:9.1f}  ({tp / t:4.2f}x the ragged time){fi_txt}")
            if "softcap" in ours:
                tc = med["softcap"]
                vcase = f"variant/softcap/{case}"
                res.add(vcase, "cute_attn", "ratio", tc / t)
                fl = [] if quick else [("flex", _flex(q4, k4, v4, _causal_mask, _softcap_mod))]
                if "softcap" in fi_res:
                    fl.append(("flashinfer", fi_res["softcap"]))
                _row(res, vcase, flops, tc, fl, extra=f"  ({tc / t:4.2f}x plain attention's time)")
            del ours, fi_calls, paged, fns
        del q, k, v, q4, k4, v4

    # mixed ragged batches, causal, hd128: 32 lognormal lengths (mean ~2k), and a bimodal mix of
    # a few long prompts among many short turns
    _mixed_case(res, fi, quick, "prefill/hd128/causal/varlen32_lognormal2k", varlen32_lengths())
    _mixed_case(res, fi, quick, "prefill/hd128/causal/bimodal48", bimodal_lengths())


def _mixed_case(res, fi, quick, case, lens) -> None:
    """One mixed ragged batch (causal, hd128, H heads): ours, FlashInfer's fa3 right after it,
    SDPA on the batch padded to its longest request, Flex with a document mask."""
    d, total = 128, sum(lens)
    flops = _flops(lens, H, d, True)
    q = torch.randn(total, H, d, device="cuda", dtype=DT)
    k = torch.randn(total, H, d, device="cuda", dtype=DT)
    v = torch.randn(total, H, d, device="cuda", dtype=DT)
    ours_call = _ragged_runner(lens, q, k, v, True, d)
    t = do_bench(ours_call)
    base = []
    note = ""
    if fi is not None:  # FlashInfer's fa3 ragged on the same batch, timed right after ours (do_bench each, as ours)
        call, wf = peers.fi_call(peers.ragged_prefill, fi, fi.workspace(128), _indptr(lens), q, k, v, True, d)
        tf = None
        if call is not None:
            try:
                ours_call()
                torch.cuda.synchronize()
                diff, ok = peers.check_output(f"flashinfer {case}", call.out, ours_call.out)
                if ok:
                    tf, note = do_bench(call), f"  fi maxdiff {diff:.1e}"
                else:
                    wf = peers.DIFFERS
            except Exception as e:
                wf = peers.why_failed(e)
        base.append(("flashinfer", (tf, wf)))
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
    qp, kp, vp = pad(q), pad(k), pad(v)  # [batch, H, lmax, d]; causal top-left = correct for valid rows
    base += [("sdpa_cudnn", _sdpa("cudnn", qp, kp, vp, True)), ("sdpa_flash", _sdpa("flash", qp, kp, vp, True))]
    del qp, kp, vp
    if not quick:
        doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))

        def doc_causal(b, h, qi, kvi):
            return (doc[qi] == doc[kvi]) & (qi >= kvi)

        q1, k1, v1 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, total, d]
        base.append(("flex", _flex(q1, k1, v1, doc_causal)))
        del q1, k1, v1
    _row(res, case, flops, t, base, extra=f"  (lengths {min(lens)}..{lmax}, {total} tokens; SDPA padded){note}")


def _fi_diff_note(fi_calls, fi_res, ours, key):
    """'  fi maxdiff X' for a FlashInfer row that was recorded."""
    if key not in fi_res or fi_res[key][0] is None:
        return ""
    diff, _ = peers.max_diff(fi_calls[key].out, ours[key].out)
    return f"  fi maxdiff {diff:.1e}"
