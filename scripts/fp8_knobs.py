#!/usr/bin/env python3
"""A/B of fp8-attention kernel knobs (``tile_n``, ``stages``, ``pingpong``: spec parameters of
``batch_prefill_fp8_sm90``) in one GPU visit, on the fp8 bench's cases (ragged 2 x 8192, 16
heads, hd128, bf16 output, causal and not).  A knob kernel replaces the planned wrapper's module,
so plan and data are the same; each output is checked against the bf16 prefill on the same
values (relative L2 < 5e-2), and all are timed in turns with the bf16 run; then each one's
error on peaked rows (``peaked``).

    python scripts/fp8_knobs.py compile            # CPU box: the knob kernels into $CUTE_ATTN_CACHE_DIR
    python scripts/fp8_knobs.py run [--json f] [--timing-only]    # GPU machine

A development tool; ``python -m cute_attn bench --only fp8attn`` is the benchmark of record."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

try:
    import torch as _torch

    FP8_T = _torch.float8_e4m3fn
except ImportError:  # the compile step needs no torch
    FP8_T = None

# not yet measured with the default kernel: 3 stages, 224 keys (256 serializes the wgmmas), the
# lazy max and no ping-pong (f53ff88 measured them with 2 of 8 columns' 2^x on a polynomial)
KNOBS = [dict(stages=3), dict(tile_n=224), dict(lazy_rescale=1), dict(pingpong=0)]


def specs():
    from cute_attn.families.prefill_fp8 import prefill_fp8_spec

    return [prefill_fp8_spec("sm_90a", "bf16", 128, 128, c, **k) for c in (True, False) for k in KNOBS]


def run(json_path=None, timing_only=False) -> int:
    import torch

    from cute_attn.bench import peers
    from cute_attn.bench.common import interleaved
    from cute_attn.bench.fp8_attention import FP8, D, _fp8_run, _rel
    from cute_attn.bench.prefill import DT, B, H, S, _flops, _indptr, _tflops
    from cute_attn.runtime.loader import kernel

    lib = peers.ours()
    gen = torch.Generator().manual_seed(1)
    lens = [S] * B
    ind = _indptr(lens)
    out = {}
    for causal in (True, False):
        q8, k8, v8 = (torch.randn(B * S, H, D, generator=gen).to(DT).to(FP8).cuda() for _ in range(3))
        ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        runs = {"bf16": peers.ragged_prefill(lib, ws, ind, q8.to(DT), k8.to(DT), v8.to(DT), causal, D)}
        w, runs["default"] = _fp8_run(lib, ind, q8, k8, v8, causal)
        st = w._state
        for kn in KNOBS:
            name = ",".join(f"{k}={v}" for k, v in kn.items())
            w2, call = _fp8_run(lib, ind, q8, k8, v8, causal)
            w2._state = dataclasses.replace(w2._state, attn=kernel(st.family, st.arch, **st.spec_kw, **kn))
            call()
            runs[name] = call
        errs = {n: _rel(r.out, runs["bf16"].out) for n, r in runs.items() if n != "bf16"}
        ok = {n for n, e in errs.items() if e < 5e-2}
        t = interleaved({n: r for n, r in runs.items() if n == "bf16" or n in ok}, calls=15)
        flops = _flops(lens, H, D, causal)
        tag = "causal" if causal else "noncausal"
        for n, us in t.items():
            out[f"{tag}/{n}"] = dict(us=us, tflops=_tflops(flops, us), x_bf16=t["bf16"] / us, err=errs.get(n, 0.0))
            print(f"{tag:<10} {n:<24} {us:9.1f} us {_tflops(flops, us):7.1f} TFLOP/s  x bf16 {t['bf16'] / us:6.3f}"
                  f"  rel err {errs.get(n, 0.0):.2e}")  # fmt: skip
        for n in set(errs) - ok:
            print(f"{tag:<10} {n:<24} WRONG: rel err {errs[n]:.3e}")
    steps = (lambda: peaked(lib, kernel), lambda: pass_knobs(lib, kernel), lambda: test_checks(kernel), large_logits)
    for step in () if timing_only else steps:
        try:
            out.update(step())
        except Exception as e:  # report and go on: the timings above are kept
            import traceback

            traceback.print_exc()
            print(f"step failed: {type(e).__name__}: {e}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def peaked(lib, kernel) -> dict:
    """Accuracy on peaked rows (q, k ~ 4 N(0, 1): logits of ~+-60), where the lazily kept max
    leaves a row's largest weight to e4m3 rounding: each knob's relative L2 error against the
    fp32 reference on the dequantized values (tests/test_fp8_attention.py's large-logits case)."""
    import torch

    from cute_attn.bench.fp8_attention import FP8, D, _rel
    from cute_attn.testing import ragged_reference

    gen = torch.Generator().manual_seed(2)
    qo = torch.tensor([0, 500, 1500], dtype=torch.int32)
    kv = torch.tensor([0, 700, 3700], dtype=torch.int32)
    q8 = (4 * torch.randn(1500, 16, D, generator=gen)).to(FP8).cuda()
    k8, v8 = ((s * torch.randn(3700, 4, D, generator=gen)).to(FP8).cuda() for s in (4, 1))
    ref, _ = ragged_reference(q8.float(), k8.float(), v8.float(), qo, kv, causal=True)
    out = {}
    for kn in [{}] + KNOBS:
        w = lib.mod.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(qo, kv, 16, 4, D, causal=True, q_data_type=FP8, kv_data_type=FP8, o_data_type=torch.bfloat16)
        if kn:
            st = w._state
            w._state = dataclasses.replace(st, attn=kernel(st.family, st.arch, **st.spec_kw, **kn))
        err = _rel(w.run(q8, k8, v8), ref)
        name = ",".join(f"{k}={v}" for k, v in kn.items()) or "default"
        out[f"peaked/{name}"] = dict(err=err)
        print(f"peaked     {name:<24} rel err vs fp32 reference {err:.3e}")
    return out


PASS_GROUPS = (1, 2, 4)  # kernels/vt_pass.VtPassPrmt: groups of 32 keys per CTA


def pass_knobs(lib, kernel) -> dict:
    """The V^T pass variants (``vt_pass`` spec knob ``groups``) on the bench case's V (ragged
    2 x 8192, 16 heads, hd128): each one's V^T checked bytewise against the default pass's, then
    all timed in turns."""
    import torch

    from cute_attn.bench.common import interleaved
    from cute_attn.bench.fp8_attention import D, _fp8_run
    from cute_attn.bench.prefill import DT, B, H, S, _indptr
    from cute_attn.families.prefill_fp8 import vt_pass_spec

    gen = torch.Generator().manual_seed(3)
    q8, k8, v8 = (torch.randn(B * S, H, D, generator=gen).to(DT).to(FP8_T).cuda() for _ in range(3))
    w, _ = _fp8_run(lib, _indptr([S] * B), q8, k8, v8, False)
    st = w._state
    f = st.fp8
    vt, _ = f.views(st.hk, st.head_dim)
    ind = st.inputs.kv_indptr

    def runner(mod, buf):
        return lambda: mod(
            k8[None], v8[None], k8[None], buf, ind, ind, st.inputs.kv_indices, f.groups, f.groups.shape[0]
        )

    runs = {"default": runner(f.vt_pass, vt)}
    runs["default"]()
    torch.cuda.synchronize()
    want = vt.view(torch.uint8).clone()
    out = {}
    for g in PASS_GROUPS:
        s = vt_pass_spec("sm_90a", D, False, groups=g)
        try:
            mod = kernel(s.family, "sm_90a", **s.pdict)
        except Exception as e:  # not compiled
            print(f"pass       groups={g}  n/a: {type(e).__name__}")
            continue
        buf = torch.full_like(vt.view(torch.uint8), 0x7F).view(vt.dtype)  # e4m3 NaN everywhere first
        runs[f"groups={g}"] = runner(mod, buf)
        runs[f"groups={g}"]()
        torch.cuda.synchronize()
        same = torch.equal(buf.view(torch.uint8), want)
        print(f"pass       groups={g}  V^T {'identical to' if same else 'DIFFERS from'} the default pass's")
        if not same:
            del runs[f"groups={g}"]
    t = interleaved(runs, calls=25)
    mb = 2 * v8.numel() / 1e6
    for n, us in t.items():
        out[f"pass/{n}"] = dict(us=us, tb_s=mb / us)
        print(f"pass       {n:<10} {us:7.1f} us  {mb / us:5.2f} TB/s ({mb:.0f} MB read + written)")
    return out


def _tests():
    """tests/test_fp8_attention.py as a module (its plan_case / references / checks)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import test_fp8_attention as T

    return T


CHECK_CASES = {  # hd128 bf16 cases that plan tile 128 (the knob kernels compiled)
    "ragged-4k-causal": (("ragged", [4096], [4096], 32, 8, 128), dict(causal=True)),
    "ragged-append-noncausal": (("ragged", [1500, 700], [3700, 700], 16, 4, 128), dict(causal=False)),
    "large-logits": (("ragged", [500, 1000], [700, 3000], 16, 4, 128), dict(causal=True, scale=4.0)),
}


def _checks(T, c, out, lse) -> dict:
    """Each of check_fp8's conditions on its own (which one fails, by how much)."""
    import torch

    qf, kf, vf = c.ref
    from cute_attn.testing import ragged_reference

    ref_o, ref_lse = ragged_reference(qf, kf, vf, c.qo, c.kv_tok, causal=c.causal, sm_scale=c.sm_scale)
    pq = T.pq_reference(qf, kf, vf, c.qo, c.kv_tok, c.causal, c.sm_scale)
    fin = torch.isfinite(ref_lse)
    d = dict(
        out_err=T.rel(out, ref_o),
        out_tol=1.5 * T.rel(pq, ref_o) + T.OUT_SLACK,
        pq_err=T.rel(pq, ref_o),
        lse_err=(lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0,
        lse_tol=T.LSE_TOL,
        inf_pattern_ok=float(torch.equal(torch.isfinite(lse), fin)),
        nan=float(torch.isnan(out).any().item() or torch.isnan(lse).any().item()),
    )
    d["pass"] = float(
        d["out_err"] <= d["out_tol"] and d["lse_err"] < d["lse_tol"] and d["inf_pattern_ok"] and not d["nan"]
    )
    return d


def test_checks(kernel) -> dict:
    """tests/test_fp8_attention.py's checks, each reported, for the default and every knob on
    the hd128 cases of CHECK_CASES (fresh inputs per case, the same for all knobs)."""
    import torch

    T = _tests()
    out = {}
    for name, (args, kw) in CHECK_CASES.items():
        c = T.plan_case(*args, seed=11, **kw)
        st = c.w._state
        for kn in [{}] + KNOBS:
            kname = ",".join(f"{k}={v}" for k, v in kn.items()) or "default"
            try:
                c.w._state = dataclasses.replace(st, attn=kernel(st.family, st.arch, **st.spec_kw, **kn)) if kn else st
            except Exception as e:  # a knob spec not compiled for this case's tile
                print(f"check      {name:<24} {kname:<14} n/a: {type(e).__name__}")
                continue
            o, lse = c.run(check=False)
            d = _checks(T, c, o, lse)
            out[f"check/{name}/{kname}"] = d
            print(f"check      {name:<24} {kname:<14} out {d['out_err']:.3e} (tol {d['out_tol']:.3e}, P-rounded ref "
                  f"{d['pq_err']:.3e})  LSE {d['lse_err']:.3e} (tol {d['lse_tol']:.0e})"
                  f"  -inf ok {bool(d['inf_pattern_ok'])}  nan {bool(d['nan'])}"
                  f"  {'PASS' if d['pass'] else 'FAIL'}")  # fmt: skip
        c.w._state = st
        torch.cuda.synchronize()
    return out


def large_logits() -> dict:
    """Where the large-logits case's LSE error comes from: the kernel's LSE against the fp32
    reference and against the same attention with S from cuBLAS's fp8 GEMM
    (``torch._scaled_mm``) with and without its fast (reduced-precision, the wgmma's own)
    accumulation; per-row error against the row's largest logit."""
    import math

    import torch

    T = _tests()
    args, kw = CHECK_CASES["large-logits"]
    c = T.plan_case(*args, seed=11, **kw)
    o, lse = c.run(check=False)
    q8 = c.q
    qf, kf, vf = c.ref
    k8 = kf.to(FP8_T)
    hq, hk = q8.shape[1], k8.shape[1]
    g = hq // hk
    one = torch.ones((), device="cuda")
    res = {}
    errs = {"exact": [], "fast": [], "slow": [], "rowmax": [], "fast_vs_exact": []}
    qo, kv = c.qo.tolist(), c.kv_tok.tolist()
    for b in range(len(qo) - 1):
        m, n = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        mp, np_ = -(-m // 16) * 16, -(-n // 16) * 16
        for h in range(hq):
            qa = torch.zeros(mp, 128, dtype=FP8_T, device="cuda")
            qa[:m] = q8[qo[b] : qo[b + 1], h]
            ka = torch.zeros(np_, 128, dtype=FP8_T, device="cuda")
            ka[:n] = k8[kv[b] : kv[b + 1], h // g]
            s = {}
            for mode, fast in (("fast", True), ("slow", False)):
                s[mode] = torch._scaled_mm(qa, ka.t(), one, one, out_dtype=torch.float32, use_fast_accum=fast)[:m, :n]
            s["exact"] = qa[:m].float() @ ka[:n].float().t()
            qpos = torch.arange(m, device="cuda")[:, None] + (n - m)
            mask = torch.arange(n, device="cuda")[None, :] > qpos
            sc = c.sm_scale * math.log2(math.e)
            ls = {
                k: torch.logsumexp((v * sc).masked_fill(mask, -math.inf) * math.log(2), -1) / math.log(2)
                for k, v in s.items()
            }
            kl = lse[qo[b] : qo[b + 1], h]
            for k in ("exact", "fast", "slow"):
                errs[k].append((kl - ls[k]).abs())
            errs["fast_vs_exact"].append((ls["fast"] - ls["exact"]).abs())
            errs["rowmax"].append((s["exact"] * sc).masked_fill(mask, -math.inf).amax(-1))
    e = {k: torch.cat(v) for k, v in errs.items()}
    for k in ("exact", "fast", "slow", "fast_vs_exact"):
        res[f"large_logits/lse_err_vs_{k}"] = dict(max=e[k].max().item(), mean=e[k].mean().item())
    print("large-logits: kernel LSE (base 2) error against the LSE of S from")
    for k, what in (("exact", "fp32 products (the tests' reference)"), ("slow", "cuBLAS fp8 GEMM, full accumulation"),
                    ("fast", "cuBLAS fp8 GEMM, fast accumulation (the wgmma's)")):  # fmt: skip
        print(f"  {what:<52} max {e[k].max().item():.3e}  mean {e[k].mean().item():.3e}")
    k = "fast_vs_exact"
    print(f"  cuBLAS fast accumulation's own LSE against the reference's: max {e[k].max().item():.3e}"
          f"  mean {e[k].mean().item():.3e}")  # fmt: skip
    rm = e["rowmax"]
    for lo, hi in ((0, 10), (10, 20), (20, 40), (40, 1e9)):
        sel = (rm >= lo) & (rm < hi)
        if sel.any():
            print(f"  rows with max logit (base 2) in [{lo}, {hi}): {int(sel.sum())} rows, LSE error max "
                  f"{e['exact'][sel].max().item():.3e} mean {e['exact'][sel].mean().item():.3e}")  # fmt: skip
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["compile", "run"])
    ap.add_argument("--json")
    ap.add_argument("--timing-only", action="store_true", help="run: the knob timings only")
    a = ap.parse_args()
    if a.what == "compile":
        import subprocess

        args = []
        for s in specs():
            args += ["--spec", f"{s.family}:" + ",".join(f"{k}={v}" for k, v in s.pdict.items())]
        return subprocess.call([sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--jobs", "2", *args])
    return run(a.json, a.timing_only)


if __name__ == "__main__":
    sys.exit(main())
