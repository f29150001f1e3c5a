"""Shared-prefix (cascade) attention: ``MultiLevelCascadeAttentionWrapper`` against the same
batch run flat -- every request's page table lists the shared prefix pages, so a flat kernel
reads the prefix once per request (from L2 where it stays there) -- and against torch SDPA
(cuDNN) on the batch laid out dense.

Decode cases (one query per request) are timed as serving engines run them: CUDA-graph
wrappers, ``run()`` captured once and replayed.  The cascade runs its own-tokens level on the
decode kernel (the default); the same cascade with the prefill kernel at every level
(``decode_kernel=False``) is timed beside it.  Each output is checked against the flat decode
kernel's before it is timed.
"""

from __future__ import annotations

import torch

from .common import cudnn_time, do_bench
from .decode import HK, HQ, D

PAGE = 16


def _cache(num_pages):
    k = torch.randn(num_pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16)
    return k, torch.randn_like(k)


def _graph(fn):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _decode_case(res, batch, prefix, unique, gen, ws):
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper, MultiLevelCascadeAttentionWrapper

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
    bufs = [[t.cuda() for t in arr] for arr in (qo, indptr, indices, last)]
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cw = MultiLevelCascadeAttentionWrapper(
        2,
        ws[0],
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf_arr=bufs[0],
        paged_kv_indptr_buf_arr=bufs[1],
        paged_kv_indices_buf_arr=bufs[2],
        paged_kv_last_page_len_buf_arr=bufs[3],
    )
    cw.plan(qo, indptr, indices, last, HQ, HK, D, PAGE, q_data_type=torch.bfloat16)
    out_c = torch.empty_like(q)
    g_c = _graph(lambda: cw.run(q, cache, out=out_c))
    # flat: every request's table is prefix + own pages
    f_indptr = torch.arange(batch + 1, **i32) * (p_pages + u_pages)
    f_indices = torch.cat([shared.expand(batch, p_pages), own], dim=1).reshape(-1).contiguous()
    f_last = torch.full((batch,), PAGE, **i32)
    fw = BatchDecodeWithPagedKVCacheWrapper(
        ws[1],
        use_cuda_graph=True,
        paged_kv_indptr_buffer=f_indptr.cuda(),
        paged_kv_indices_buffer=f_indices.cuda(),
        paged_kv_last_page_len_buffer=f_last.cuda(),
    )
    fw.plan(f_indptr, f_indices, f_last, HQ, HK, D, PAGE, q_data_type=torch.bfloat16)
    out_f = torch.empty_like(q)
    g_f = _graph(lambda: fw.run(q, cache, out=out_f))
    g_c.replay()
    g_f.replay()
    torch.cuda.synchronize()
    err = ((out_c.float() - out_f.float()).norm() / out_f.float().norm()).item()
    assert err < 2e-2, f"cascade and flat decode disagree: relative error {err:.3e}"
    t_c, t_f = do_bench(g_c.replay), do_bench(g_f.replay)
    # the same cascade with the prefill kernel at every level (plan(decode_kernel=False))
    pbufs = [[t.clone() for t in arr] for arr in bufs]
    pw = MultiLevelCascadeAttentionWrapper(
        2,
        ws[2],
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf_arr=pbufs[0],
        paged_kv_indptr_buf_arr=pbufs[1],
        paged_kv_indices_buf_arr=pbufs[2],
        paged_kv_last_page_len_buf_arr=pbufs[3],
    )
    pw.plan(qo, indptr, indices, last, HQ, HK, D, PAGE, q_data_type=torch.bfloat16, decode_kernel=False)
    out_p = torch.empty_like(q)
    g_p = _graph(lambda: pw.run(q, cache, out=out_p))
    g_p.replay()
    torch.cuda.synchronize()
    err_p = ((out_p.float() - out_f.float()).norm() / out_f.float().norm()).item()
    assert err_p < 2e-2, f"cascade (prefill kernel) and flat decode disagree: relative error {err_p:.3e}"
    t_p = do_bench(g_p.replay)
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
    name = f"bs{batch} prefix {prefix} + {unique}"
    cud = f"{t_cudnn:9.1f} ({t_cudnn / t_c:5.2f}x)" if t_cudnn is not None else "n/a"
    res.add(case + "/prefill_kernel_only", "cute_attn", "us", t_p)
    print(f"{name:<32} {t_c:9.1f} {t_f:9.1f} ({t_f / t_c:5.2f}x) {cud:>20} {t_p:9.1f}   err {err:.1e}")


def cascade_cases(quick: bool):
    cases = [(64, 8192, 512), (64, 32768, 256), (256, 4096, 256)]
    return cases[:1] if quick else cases


def bench_cascade(res, quick: bool) -> None:
    gen = torch.Generator().manual_seed(0)  # page order
    ws = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    print(
        f"{'cascade decode (bf16, 32/8 heads, d128)':<32} {'ours us':>9} {'flat us (x)':>17} {'cudnn dense (x)':>20} "
        f"{'prefill kernel only us':>9}"
    )
    for batch, prefix, unique in cascade_cases(quick):
        _decode_case(res, batch, prefix, unique, gen, ws)
