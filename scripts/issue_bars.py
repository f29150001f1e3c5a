"""Where the open issues' "must show" bars stand, read from ``benchmarks/results.json``: for each
bar the latest record of its case (a ratio of two records only when both come from one run:
same commit and date), the device and commit it was measured on, and whether it is met.  Only
records of the device the bars are stated for count (``--device``, a part of its name: H200).

    python scripts/issue_bars.py [--json benchmarks/results.json] [--markdown] [--device H200]

Ratios follow the bench's records: a peer's ``ratio`` is its time over ours (> 1: we are
faster); ``vs_bf16`` / ``x_bf16`` compare with the bf16 run of the same turns; the portable
kernel's ``cute_attn`` ``ratio`` is its time over the wgmma kernel's.  CPU only."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

Ref = Tuple[str, str, str]  # (case, impl, metric)


@dataclass(frozen=True)
class Bar:
    issue: int
    what: str
    ref: Ref
    op: str  # ">=" or "<="
    bound: float
    over: Optional[Ref] = None  # the value is ref / over, both from one run


def _bars():
    out = []
    for batch in ("bs64/kv4096/page16", "bs64/kv4096/page1", "bs256/kv1024/page16"):
        case = f"decode/hd128/gqa4/{batch}/fp8_e4m3"
        out.append(Bar(23, f"fp8 KV decode {batch}, time vs bf16", (case, "cute_attn", "vs_bf16"), "<=", 0.55))
    for c in ("causal", "noncausal"):
        base = f"prefill/hd128/{c}/s8192"
        out.append(Bar(23, f"fp8-KV prefill {c}, time vs bf16", (f"{base}/fp8kv", "cute_attn", "vs_bf16"), "<=", 1.05))
        out.append(Bar(23, f"fp8 attention {c}, speed vs bf16", (f"{base}/fp8", "cute_attn", "x_bf16"), ">=", 1.4))
    for d in (128, 256):
        for c in ("causal", "noncausal"):
            case = f"prefill/hd{d}/{c}/s8192"
            out.append(
                Bar(24, f"ragged prefill hd{d} {c} vs FlashInfer fa3", (case, "flashinfer", "ratio"), ">=", 1.05)
            )
            out.append(Bar(24, f"ragged prefill hd{d} {c} vs cuDNN", (case, "sdpa_cudnn", "ratio"), ">=", 1.05))
            for page in ("page16", "page1"):
                ref = (f"{case}/{page}", "flashinfer", "ratio")
                out.append(Bar(24, f"paged prefill hd{d} {c} {page} vs FlashInfer", ref, ">=", 1.05))
    varlen = "prefill/hd128/causal/varlen32_lognormal2k"
    out.append(Bar(24, "mixed lognormal batch vs FlashInfer fa3", (varlen, "flashinfer", "ratio"), ">=", 1.05))
    hd64 = "decode/hd64/gqa8/bs64/kv4096/page16"
    out.append(Bar(24, "hd64 decode (64 / 8 heads, bs 64 x 4k) TB/s", (hd64, "cute_attn", "TB/s"), ">=", 4.1))
    out.append(Bar(24, "hd64 decode vs FlashInfer", (hd64, "flashinfer", "ratio"), ">=", 1.05))
    spec = "prefill_mma/hd128/gqa4/q4/bs64/kv4096/page16"
    out.append(
        Bar(24, "4-token batch TB/s (the kernel the planner picks)", (f"{spec}/wgmma", "cute_attn", "TB/s"), ">=", 4.1)
    )
    out.append(
        Bar(
            24,
            "4-token batch vs FlashInfer's best",
            (spec, "flashinfer", "us"),
            ">=",
            1.0,
            (f"{spec}/wgmma", "cute_attn", "us"),
        )
    )
    out.append(Bar(24, "portable kernel, 4-token batch, time vs wgmma", (spec, "cute_attn", "ratio"), "<=", 1.1))
    port = "prefill_mma/hd128/causal/s8192"
    out.append(Bar(24, "portable kernel, 2 x 8k causal, time vs wgmma", (port, "cute_attn", "ratio"), "<=", 1.6))
    for kv in (4096, 32768):
        case = f"mla/decode/h16/bs128/kv{kv}/page64"
        out.append(Bar(25, f"MLA decode h16 kv{kv} TB/s", (case, "cute_attn", "TB/s"), ">=", 4.0))
        out.append(Bar(25, f"MLA decode h16 kv{kv} vs FlashInfer", (case, "flashinfer", "ratio"), ">=", 1.05))
    mla = "mla/decode/h128/q2/bs64/kv8192/page64"
    out.append(Bar(25, "MLA h128 q2 (compute-bound) TFLOP/s", (mla, "cute_attn", "TFLOP/s"), ">=", 660.0))
    out.append(Bar(25, "MLA h128 q2 vs FlashInfer", (mla, "flashinfer", "ratio"), ">=", 1.05))
    return out


def _latest(records, ref: Ref, run=None, device=None):
    """The last record of ``ref`` by date (file order within a date); ``run``: (commit, date,
    device); ``device``: a part of the device's name (None: any)."""
    hits = [r for r in records if (r["case"], r["impl"], r["metric"]) == ref]
    if device is not None:
        hits = [r for r in hits if device in r["device"]]
    if run is not None:
        hits = [r for r in hits if (r["commit"], r["date"], r["device"]) == run]
    return max(enumerate(hits), key=lambda ir: (ir[1]["date"], ir[0]))[1] if hits else None


def evaluate(records, bar: Bar, device=None):
    """(value, record of the bar's ref, met) or (None, None, None) when not measured (on a
    device whose name contains ``device``, if given)."""
    rec = _latest(records, bar.ref, device=device)
    if rec is None:
        return None, None, None
    value = rec["value"]
    if bar.over is not None:
        den = _latest(records, bar.over, (rec["commit"], rec["date"], rec["device"]))
        if den is None:
            return None, None, None
        value = value / den["value"]
    met = value >= bar.bound if bar.op == ">=" else value <= bar.bound
    return value, rec, met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--json", default=os.path.join(here, "..", "benchmarks", "results.json"))
    ap.add_argument("--markdown", action="store_true", help="a Markdown table (BENCHMARKS.md)")
    ap.add_argument("--device", default="H200", help="the bars' device, a part of its name")
    args = ap.parse_args()
    with open(args.json) as f:
        records = json.load(f)
    rows = []
    for bar in _bars():
        value, rec, met = evaluate(records, bar, args.device)
        got = "not measured" if value is None else f"{value:.3f}"
        where = "" if rec is None else f"{rec['device']}, `{rec['commit']}`, {rec['date']}"
        verdict = "" if met is None else ("met" if met else "**not met**")
        rows.append((f"#{bar.issue}", bar.what, f"{bar.op} {bar.bound:g}", got, where, verdict))
    if args.markdown:
        print("| issue | bar | target | measured | run | |")
        print("| --- | --- | ---: | ---: | --- | --- |")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in rows:
            print(f"{r[0]:4} {r[1]:55} {r[2]:>8} {r[3]:>12}  {r[5]:12} {r[4]}")
    n_met = sum(r[5] == "met" for r in rows)
    print(f"\n{n_met} of {len(rows)} bars met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
