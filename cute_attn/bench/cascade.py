"""Shared-prefix (cascade) attention: ``MultiLevelCascadeAttentionWrapper`` against the same
batch run flat -- every request's page table lists the shared prefix pages, so a flat kernel
reads the prefix once per request (from L2 where it stays there) -- and against torch SDPA
(cuDNN) on the batch laid out dense.

Decode cases (one query per request) are timed as serving engines run them: CUDA-graph
wrappers, ``run()`` captured once and replayed.  The cascade runs its own-tokens level on the
decode kernel (the default); the same cascade with the prefill kernel at every level
(``decode_kernel=False``) is timed beside it.  Each output is checked against the flat decode
kernel's before it is timed.

FlashInfer (impl ``flashinfer``, where ``import flashinfer`` works; ``bench/peers.py``): its
``MultiLevelCascadeAttentionWrapper`` on the same levels and cache (CUDA graph, its default
backend: fa3 prefill per level + its merge), recorded on the cascade case, and its flat decode
(``use_tensor_cores=True``) on the flat case; each output checked against ours first.
"""

from __future__ import annotations

import torch

from . import peers
from .common import cudnn_time, do_bench
from .decode import HK, HQ, D

PAGE = 16


def _cache(num_pages):
    k = torch.randn(num_pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16)
    return k, torch.randn_like(k)


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _fi_time(make, ref, what):
    """FlashInfer's run (``make()`` builds it: a CascadeRun / DecodeRun), its output checked
    against ``ref``: (time, max abs diff, None) or (None, None, why).  Never raises."""
    run, why = peers.fi_call(make)
    if run is None:
        return None, None, why
    try:
        if run.graph is None:
            print(f"  {what}: CUDA-graph capture failed ({run.graph_why}); its eager run() timed instead")
        run.replay()
        torch.cuda.synchronize()
        diff, ok = peers.check_output(what, run.out, ref)
        if not ok:
            return None, None, peers.DIFFERS
        return do_bench(run.replay), diff, None
    except Exception as e:
        return None, None, peers.why_failed(e)


def _decode_case(res, batch, prefix, unique, gen, ws, fi, ws_fi):
    ours = peers.ours()
    p_pages, u_pages = prefix // PAGE, unique // PAGE
    cache = _cache(p_pages + batch * u_pages)
    perm = torch.randperm(p_pages + batch * u_pages, generator=gen).to(torch.int32)
    shared, own = perm[:p_pages], perm[p_pages:].view(batch, u_pages)
    i32 = dict(dtype=torch.int32)
    # cascade: level 0 = the prefix (one request owning every query), level 1 = own pages
    qo = [torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)]
    indptr = [torch.tensor([0, p_pages], **i32), torch.arange(batch + 1, **i32) * u_pages]
    indices = [shared.clone(), own.reshape(-1).clone()]
    last = [torch.tensor([PAGE], **i32), torch.full((batch,), PAGE, **i32)]
    levels = (qo, indptr, indices, last, HQ, HK, D, PAGE)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cw = peers.CascadeRun(ours, ws[0], q, cache, *levels)
    # flat: every request's table is prefix + own pages
    f_indptr = torch.arange(batch + 1, **i32) * (p_pages + u_pages)
    f_indices = torch.cat([shared.expand(batch, p_pages), own], dim=1).reshape(-1).contiguous()
    f_last = torch.full((batch,), PAGE, **i32)
    flat = (f_indptr, f_indices, f_last, HQ, HK, D, PAGE)
    fw = peers.DecodeRun(ours, ws[1], q, cache, *flat, with_lse=False)
    for run, what in ((cw, "cascade"), (fw, "flat decode")):
        if run.graph is None:
            print(f"  cute_attn {what}: CUDA-graph capture failed ({run.graph_why}); eager run() timed")
    cw.replay()
    fw.replay()
    torch.cuda.synchronize()
    err = _rel_err(cw.out, fw.out)
    assert err < 2e-2, f"cascade and flat decode disagree: relative error {err:.3e}"
    t_c, t_f = do_bench(cw.replay), do_bench(fw.replay)
    # the same cascade with the prefill kernel at every level (plan(decode_kernel=False))
    pw = peers.CascadeRun(ours, ws[2], q, cache, *levels, plan_kw=dict(decode_kernel=False))
    pw.replay()
    torch.cuda.synchronize()
    err_p = _rel_err(pw.out, fw.out)
    assert err_p < 2e-2, f"cascade (prefill kernel) and flat decode disagree: relative error {err_p:.3e}"
    t_p = do_bench(pw.replay)
    del pw
    # FlashInfer: its cascade on the same levels, its flat decode on the same flat table
    fi_c = fi_f = (None, None, None)
    if fi is not None:
        cw.replay()
        fw.replay()
        torch.cuda.synchronize()
        fi_c = _fi_time(lambda: peers.CascadeRun(fi, ws_fi[0], q, cache, *levels), cw.out, "flashinfer cascade")
        fi_f = _fi_time(lambda: peers.DecodeRun(fi, ws_fi[1], q, cache, *flat), fw.out, "flashinfer flat decode")
    del cw, fw
    # cuDNN on the batch laid out dense (the prefix copied into every request)
    kd = torch.randn(batch, HK, prefix + unique, D, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    qd = q.view(batch, HQ, 1, D)
    t_cudnn = cudnn_time(qd, kd, vd)
    del kd, vd
    case = f"cascade/decode/hd128/gqa4/bs{batch}/prefix{prefix}/unique{unique}/page{PAGE}"
    res.add(case, "cute_attn", "us", t_c)
    res.add(case + "/flat", "cute_attn", "us", t_f)
    res.add(case + "/flat", "cute_attn", "ratio", t_f / t_c)
    if t_cudnn is not None:
        res.add(case, "sdpa_cudnn", "us", t_cudnn)
        res.add(case, "sdpa_cudnn", "ratio", t_cudnn / t_c)
    fi_cols, notes = [], ""
    for (tf, diff, why), c, t_ref, what in ((fi_c, case, t_c, "cascade"), (fi_f, case + "/flat", t_f, "flat")):
        if tf is not None:
            res.add(c, "flashinfer", "us", tf)
            res.add(c, "flashinfer", "ratio", tf / t_ref)
            fi_cols.append(f"{tf:9.1f} ({tf / t_ref:5.2f}x)")
            notes += f"  fi {what} maxdiff {diff:.1e}"
        else:
            if why is not None:
                peers.say("flashinfer", why, f"{case} ({what})")
            fi_cols.append(peers.column(why) if why is not None else "n/a")
    name = f"bs{batch} prefix {prefix} + {unique}"
    cud = f"{t_cudnn:9.1f} ({t_cudnn / t_c:5.2f}x)" if t_cudnn is not None else "n/a"
    res.add(case + "/prefill_kernel_only", "cute_attn", "us", t_p)
    print(
        f"{name:<32} {t_c:9.1f} {t_f:9.1f} ({t_f / t_c:5.2f}x) {cud:>20} {t_p:9.1f} {fi_cols[0]:>18} "
        f"{fi_cols[1]:>18}   err {err:.1e}{notes}"
    )


def cascade_cases(quick: bool):
    cases = [(64, 8192, 512), (64, 32768, 256), (256, 4096, 256)]
    return cases[:1] if quick else cases


def bench_cascade(res, quick: bool) -> None:
    fi = peers.flashinfer()
    gen = torch.Generator().manual_seed(0)  # page order
    ws = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    ws_fi = [fi.workspace(256) for _ in range(2)] if fi is not None else None
    print(
        f"{'cascade decode (bf16, 32/8 heads, d128)':<32} {'ours us':>9} {'flat us (x)':>17} {'cudnn dense (x)':>20} "
        f"{'prefill-kernel us':>9} {'flashinfer us (x)':>18} {'fi flat us (x)':>18}"
    )
    for batch, prefix, unique in cascade_cases(quick):
        _decode_case(res, batch, prefix, unique, gen, ws, fi, ws_fi)
