#!/usr/bin/env python3
"""A/B of batch-prefill kernel knobs (spec parameters such as ``tile_n``, ``stages``,
``box_warps``, ``producer_regs``) in one GPU visit, against the default kernel of each case.

The knobs are spec parameters of ``batch_prefill_sm90`` (``kernels/prefill_sm90.py``); a knob
kernel replaces the wrapper's module after ``plan()``, so the plan, data and baseline are the
same for every variant of a case.  Every knob kernel's output is checked against the default
one (max |diff|, NaN count: a wrong knob shows).  Cases: bf16, batch 2 x 16 heads x 8192,
ragged, paged page 16 (random page order) and page 1, hd128 / hd256, causal or not.

    # CPU box (the DSL): compile the knob kernels into a cache
    python scripts/prefill_knobs.py compile build/aot
    # GPU machine (no DSL), with that cache (e.g. trimmed by scripts/slim_cache.py):
    CUTE_ATTN_CACHE_DIR=build/aot python scripts/prefill_knobs.py run [--json out.json]

Edit KNOBS below for the experiment at hand; this is a development tool, not a benchmark of
record (``python -m cute_attn bench`` is).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

B, H, S = 2, 16, 8192
# (head_dim, kv) -> list of knob dicts tried besides the default; kv: "page16" / "page1"
KNOBS = {
    (128, "page16"): [dict(page_box=16, box_warps=1), dict(page_box=16, producer_regs=24), dict(stages=2)],
    (128, "page1"): [dict(tile_n=112, producer_regs=40)],
    (256, "page16"): [dict(page_box=16, box_warps=1)],
    (256, "page1"): [],
}


def _spec_kw(d, causal, paged, **knob):
    return dict(dtype="bf16", head_dim=d, tile_q=128, paged=paged, causal=causal, soft_cap=False, window=False, **knob)


def specs():
    import cute_attn.prefill  # noqa: F401  (registers the family)
    from cute_attn.families.spec import Spec

    out = []
    for (d, _kv), knobs in KNOBS.items():
        for causal in (False, True):
            for kn in knobs:
                out.append(Spec.make("batch_prefill_sm90", "sm_90a", **_spec_kw(d, causal, True, **kn)))
    return out


def compile_all(cache_dir: str) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from pathlib import Path

    from cute_attn.runtime import build

    for s in specs():
        try:
            e = build.build(s, Path(cache_dir))
            print(s.describe(), e.meta.get("resources"), flush=True)
        except Exception as ex:  # a knob that does not fit (shared memory, registers) is reported
            print(s.describe(), "FAILED:", str(ex)[:300], flush=True)


def run(json_path) -> None:
    import torch
    from triton.testing import do_bench

    import cute_attn.prefill as P
    from cute_attn.runtime.loader import kernel

    res = []
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    ind = torch.arange(0, B + 1, dtype=torch.int32) * S
    gen = torch.Generator().manual_seed(0)

    def case(label, w, call, out, kw, ref, t_ref):
        try:
            w._binding.module = kernel("batch_prefill_sm90", "sm_90a", **kw)
        except Exception as e:  # not in the cache
            print(f"{label}: missing ({str(e)[:100]})", flush=True)
            return None
        out.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        r = dict(
            label=label,
            nan=int(torch.isnan(out).sum()),
            maxdiff=(out.float() - ref.float()).abs().max().item() if ref is not None else 0.0,
        )
        r["us"] = min(do_bench(call, warmup=25, rep=150) for _ in range(2)) * 1e3
        if t_ref:
            r["over_ragged"] = r["us"] / t_ref
        print(json.dumps(r), flush=True)
        res.append(r)
        return r["us"]

    for d in sorted({d for d, _ in KNOBS}):
        q = torch.randn(B * S, H, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        for causal in (False, True):
            tag = f"d{d}/{'causal' if causal else 'noncausal'}"
            w = P.BatchPrefillWithRaggedKVCacheWrapper(ws)
            w.plan(ind, ind, H, H, d, causal=causal, q_data_type=torch.bfloat16)
            out = torch.empty_like(q)
            t_r = case(f"{tag}/ragged", w, lambda: w.run(q, k, v, out=out), out, _spec_kw(d, causal, False), None, None)
            ref = out.clone()
            for kv in ("page16", "page1"):
                ps = 16 if kv == "page16" else 1
                n = B * S // ps
                perm = torch.randperm(n, generator=gen)
                kc = torch.empty(n, ps, H, d, dtype=q.dtype, device="cuda")
                vc = torch.empty_like(kc)
                kc[perm.cuda()] = k.view(n, ps, H, d)
                vc[perm.cuda()] = v.view(n, ps, H, d)
                wp = P.BatchPrefillWithPagedKVCacheWrapper(ws)
                wp.plan(
                    ind,
                    ind // ps,
                    perm.to(torch.int32),
                    torch.full((B,), ps, dtype=torch.int32),
                    H,
                    H,
                    d,
                    ps,
                    causal=causal,
                    q_data_type=torch.bfloat16,
                )
                outp = torch.empty_like(q)
                default = dict(wp._spec_kw)  # what plan() chose for this page size
                default.pop("head_dim"), default.pop("causal"), default.pop("paged")
                for kn in [default] + KNOBS.get((d, kv), []):
                    name = (
                        ",".join(
                            f"{a}={b}" for a, b in kn.items() if a not in ("dtype", "tile_q", "soft_cap", "window")
                        )
                        or "default"
                    )
                    case(
                        f"{tag}/{kv}/{name}",
                        wp,
                        lambda: wp.run(q, (kc, vc), out=outp),
                        outp,
                        _spec_kw(
                            d,
                            causal,
                            True,
                            **{a: b for a, b in kn.items() if a not in ("dtype", "tile_q", "soft_cap", "window")},
                        ),
                        ref,
                        t_r,
                    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile the knob kernels (needs the DSL)")
    c.add_argument("cache_dir")
    r = sub.add_parser("run", help="time them on the GPU (kernels from $CUTE_ATTN_CACHE_DIR)")
    r.add_argument("--json")
    a = ap.parse_args(argv)
    if a.cmd == "compile":
        compile_all(a.cache_dir)
    else:
        run(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
