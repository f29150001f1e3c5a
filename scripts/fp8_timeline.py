#!/usr/bin/env python3
"""Where the fp8 attention kernel's time per block goes: the ``trace`` knob of
``batch_prefill_fp8_sm90`` (``kernels/prefill_fp8._stamp``) has lane 0 of every consumer warp
write ``%clock`` at nine events of each block of its CTA's first item; this prints the mean
length of each phase and how the two warpgroups' phases sit against each other (warp w of WG 0
and warp w of WG 1 share a scheduler).  Case: the fp8 bench's ragged 2 x 8192, 16 heads, hd128.

    python scripts/fp8_timeline.py compile      # CPU box, into $CUTE_ATTN_CACHE_DIR
    python scripts/fp8_timeline.py run [--json f]   # GPU machine

A development tool (diagnostic kernels; their output is checked against the default's)."""

from __future__ import annotations

import argparse
import json
import sys

TRACE_BLOCKS, TRACE_EVENTS = 48, 16  # kernels/prefill_fp8.py's (that module needs the DSL)
KNOBS = [{}, {"pingpong": 0}]
EVENTS = ["top", "k_ready", "turn", "qk_issued+v_ready", "pv_issued", "s_ready", "softmax_done", "pv_done", "p_stored"]


def specs():
    from cute_attn.families.merge import merge_partials_spec
    from cute_attn.families.prefill_fp8 import prefill_fp8_spec, vt_pass_spec

    kns = [dict(kn, **t) for kn in KNOBS for t in ({}, {"trace": 1})]
    fp8 = [prefill_fp8_spec("sm_90a", "bf16", 128, 128, c, **k) for c in (False, True) for k in kns]
    return fp8 + [vt_pass_spec("sm_90a", 128, False), merge_partials_spec("sm_90a", "bf16", 128, 128)]


def analyze(st, n_ctas: int, blocks: int, events: int) -> dict:
    """``st``: int64 array [cta, warp, block, event] of clocks (0 = not written)."""
    import numpy as np

    phases = {f"{EVENTS[e]}->{EVENTS[e + 1]}": [] for e in range(len(EVENTS) - 1)}
    period, offset = [], []
    for c in range(n_ctas):
        for w in range(8):
            for j in range(8, blocks - 2):
                row, nxt = st[c, w, j], st[c, w, j + 1]
                if not (row[: len(EVENTS)].all() and nxt[0]):
                    continue
                for e in range(len(EVENTS) - 1):
                    phases[f"{EVENTS[e]}->{EVENTS[e + 1]}"].append((row[e + 1] - row[e]) % (1 << 32))
                period.append((nxt[0] - row[0]) % (1 << 32))
                if w < 4 and st[c, w + 4, j, 2]:
                    offset.append((st[c, w + 4, j, 2] - row[2]) % (1 << 32))
    out = {k: float(np.median(v)) for k, v in phases.items() if v}
    out["period"] = float(np.median(period)) if period else 0.0
    out["wg1_turn_minus_wg0_turn"] = float(np.median(offset)) if offset else 0.0
    out["samples"] = len(period)
    return out


def run(json_path=None) -> int:
    import numpy as np
    import torch

    from cute_attn.bench import peers
    from cute_attn.bench.common import interleaved
    from cute_attn.bench.fp8_attention import FP8, D, _fp8_run, _rel
    from cute_attn.bench.prefill import B, H, S, _indptr
    from cute_attn.runtime.loader import kernel

    lib = peers.ours()
    gen = torch.Generator().manual_seed(3)
    ind = _indptr([S] * B)
    res = {}
    for causal in (False, True):
        tag = "causal" if causal else "noncausal"
        q8, k8, v8 = (torch.randn(B * S, H, D, generator=gen).to(torch.bfloat16).to(FP8).cuda() for _ in range(3))
        w, call = _fp8_run(lib, ind, q8, k8, v8, causal)
        st = w._state
        ref = call.out.clone()
        if st.plan.has_split:
            print(f"{tag}: the plan splits; the stamps would overwrite partials: skipped")
            continue
        n_ctas = st.num_ctas
        words = n_ctas * 8 * TRACE_BLOCKS * TRACE_EVENTS
        stamps = torch.zeros((words + 127) // 128, 128, dtype=torch.float32, device="cuda")
        vw = w._views
        vt, _ = st.fp8.views(st.hk, st.head_dim)
        lse = torch.empty(q8.shape[0], H, device="cuda")

        def attn(kern, out, part):
            args = (q8, k8[None], vt, st.inputs.kv_indptr, st.fp8.vt_indptr, out, lse, vw["work_items"])
            rest = (vw["work_indptr"], part, vw["partial_lse"], st.group, st.sm_scale, 1.0, st.num_ctas)
            return lambda: kern(*args, *rest)

        call()  # the V^T pass of these values is in the workspace now
        runs, outs = {}, {}
        for kn in KNOBS:
            name = ",".join(f"{k}={v}" for k, v in kn.items()) or "default"
            for tr in (0, 1):
                key = name + (" traced" if tr else "")
                outs[key] = torch.full_like(ref, float("nan"))
                kern = kernel(st.family, st.arch, **st.spec_kw, **kn, **({"trace": 1} if tr else {}))
                runs[key] = attn(kern, outs[key], stamps if tr else vw["partial_o"])
                runs[key]()
        torch.cuda.synchronize()
        t = interleaved(runs, calls=9)
        for kn in KNOBS:
            name = ",".join(f"{k}={v}" for k, v in kn.items()) or "default"
            stamps.zero_()
            runs[name + " traced"]()
            torch.cuda.synchronize()
            a = np.frombuffer(stamps.cpu().numpy().tobytes(), dtype=np.uint32)[:words].astype(np.int64)
            a = a.reshape(n_ctas, 8, TRACE_BLOCKS, TRACE_EVENTS)
            r = analyze(a, n_ctas, TRACE_BLOCKS, TRACE_EVENTS)
            r.update(err_vs_run=max(_rel(outs[k], ref) for k in (name, name + " traced")), us=t[name],
                     us_traced=t[name + " traced"])  # fmt: skip
            res[f"{tag}/{name}"] = r
            print(f"== {tag} {name}: attention alone {t[name]:.1f} us, traced {t[name + ' traced']:.1f} us, output "
                  f"rel err vs run() {r['err_vs_run']:.2e}; {r['samples']} samples (clk, medians)")  # fmt: skip
            for k, v in r.items():
                if k not in ("samples", "err_vs_run", "us", "us_traced"):
                    print(f"  {k:<34} {v:10.1f}")
            c = n_ctas // 2
            print(f"  raw, CTA {c}, blocks 20-22, warps 0 / 4 (same scheduler), clk from warp 0's block-20 top:")
            base = a[c, 0, 20, 0]
            for j in (20, 21, 22):
                for wp in (0, 4):
                    print(
                        f"   j={j} w={wp}: " + " ".join(f"{(a[c, wp, j, e] - base) % (1 << 32):6d}" for e in range(9))
                    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["compile", "run"])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.step == "compile":
        import subprocess

        args = []
        for s in specs():
            args += ["--spec", f"{s.family}:" + ",".join(f"{k}={v}" for k, v in s.pdict.items())]
        return subprocess.call([sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--jobs", "2", *args])
    return run(a.json)


if __name__ == "__main__":
    sys.exit(main())
