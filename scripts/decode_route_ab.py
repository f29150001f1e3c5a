"""Decode at head dim 96 (Phi-3-mini: 32 / 32 heads, bf16, page 16) or 80 (Phi-2: the same
heads): the decode kernel against one causal row per request on the paged prefill kernel (the
wgmma one on Hopper), and at 80 also the decode kernel with one kv head per item (the default
rule packs four there); ``--hnd``: the decode kernel on an HND
copy too.  CUDA-graph replays timed in turns (two rounds of 40 calls, medians), outputs checked
against the fp32 reference on 8 requests first.

    python -m cute_attn compile --arch sm_90a --model phi-3-mini   (or phi-2)
    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/decode_route_ab.py [--head-dim 96|80]
        [--json out.json] [--only SUBSTRING]
"""

from __future__ import annotations

import gc
import json
import sys

D = int(sys.argv[sys.argv.index("--head-dim") + 1]) if "--head-dim" in sys.argv else 96
HQ, HK, PS = 32, 32, 16
CASES = {  # name: (kv lengths, window_left)
    f"decode/hd{D}/mha/bs64/kv4096/page16": ([4096] * 64, -1),
    f"decode/hd{D}/mha/bs256/kv1024/page16": ([1024] * 256, -1),
}
if D == 96:
    CASES["decode/hd96/mha/bs64/kv4096/page16/window2047"] = ([4096] * 64, 2046)
ROUTES = ("decode_kernel", "prefill_path") + (("one_head",) if D == 80 else ())
if "--hnd" in sys.argv:  # the decode kernel on the same values stored HND ([pages, heads, page_size, D])
    ROUTES += ("decode_kernel_hnd",)


def _layout(route: str, cache):
    """(kv_layout, the cache in it)."""
    if route.endswith("_hnd"):
        return "HND", tuple(t.transpose(1, 2).contiguous() for t in cache)
    return "NHD", cache


def _wrapper(route: str, indptr, indices, last, window: int):
    import torch

    import cute_attn.wrappers.decode as wd
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper

    saved = wd.decodes_on_prefill
    if route == "prefill_path":  # the head dim not among the decode kernel's
        wd.decodes_on_prefill = lambda head_dim, kv_dtype, *a, **k: head_dim == D or saved(head_dim, kv_dtype, *a, **k)
    try:
        w = BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), "HND" if route.endswith("_hnd") else "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.cuda(),
            paged_kv_last_page_len_buffer=last.cuda(),
        )  # fmt: skip
        kw = dict(heads_per_item=1) if route == "one_head" else {}
        w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, window_left=window, **kw)
    finally:
        wd.decodes_on_prefill = saved
    assert w._routed == (route == "prefill_path"), route
    return w


def _check(route: str, window: int) -> float:
    """Max |out - ref| on 8 requests (lengths 0 / 1 / odd / past the window)."""
    import torch

    from cute_attn.bench.decode import paged_cache
    from cute_attn.testing import paged_reference

    lens = [0, 1, 37, 3001, 700, 2047, 5000, 16]
    cache, indptr, indices, last = paged_cache(lens, PS, torch.Generator().manual_seed(3), HK, D)
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    w = _wrapper(route, indptr, indices, last, window)
    out = w.run(q, _layout(route, cache)[1])
    ref, _ = paged_reference(q.float(), tuple(t.float() for t in cache), torch.arange(len(lens) + 1, dtype=torch.int32),
                             indptr, indices, last, causal=True, window_left=window)  # fmt: skip
    return (out.float() - ref).abs().max().item()


def run(json_path=None, only=None) -> None:
    import torch

    from cute_attn.bench.common import Results, interleaved
    from cute_attn.bench.decode import paged_cache
    from cute_attn.bench.peers import capture

    res = Results()
    for case, (lens, window) in CASES.items():
        if only is not None and only not in case:
            continue
        for route in ROUTES:
            print(json.dumps({"case": case, "route": route, "check_maxdiff": _check(route, window)}), flush=True)
        gc.collect()
        cache, indptr, indices, last = paged_cache(lens, PS, torch.Generator().manual_seed(0), HK, D)
        q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
        graphs, outs = {}, {}
        for route in ROUTES:
            w = _wrapper(route, indptr, indices, last, window)
            out = torch.empty_like(q)
            c = _layout(route, cache)[1]
            w.run(q, c, out=out)
            torch.cuda.synchronize()
            g, why = capture(lambda: w.run(q, c, out=out))  # noqa: B023
            assert g is not None, why
            graphs[route], outs[route] = (g, w), out
        fns = {k: g.replay for k, (g, _) in graphs.items()}
        t = interleaved(fns, calls=40)
        t2 = interleaved(fns, calls=40)
        diff = (outs["decode_kernel"].float() - outs["prefill_path"].float()).abs().max().item()
        read = sum(min(n, window + 1) if window >= 0 else n for n in lens)
        kv_bytes = read * HK * D * 2 * 2
        us = {k: min(t[k], t2[k]) for k in fns}
        for k in fns:
            row = {"case": case, "route": k, "us": round(us[k], 1), "rounds": [round(t[k], 1), round(t2[k], 1)],
                   "TB/s": round(kv_bytes / us[k] / 1e6, 3), "maxdiff_between": diff}  # fmt: skip
            print(json.dumps(row), flush=True)
            impl = "cute_attn" if k == "decode_kernel" else f"cute_attn_{k}"
            res.add(case, impl, "us", us[k])
            res.add(case, impl, "TB/s", kv_bytes / us[k] / 1e6)
            if k != "decode_kernel":
                res.add(case, impl, "ratio", us[k] / us["decode_kernel"])
        del graphs, fns
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res.records, f, indent=1)


if __name__ == "__main__":
    arg = lambda name: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None  # noqa: E731
    run(arg("--json"), arg("--only"))
