"""Summarize an Nsight Compute source-page export (``ncu -i R --page source --csv --print-source
sass > F``; the report needs ``--section SourceCounters``): warp-stall samples per reason over the
whole kernel, then the instructions with the most samples and what each waited on.

    python scripts/ncu_stalls.py F [TOP]"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def load(path):
    rows = list(csv.reader(open(path)))
    i = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[i]
    return hdr, [dict(zip(hdr, r)) for r in rows[i + 1 :] if len(r) == len(hdr)]


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(path, top=40):
    hdr, rows = load(path)
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    total = Counter()
    for r in rows:
        for h in reasons:
            total[h] += num(r[h])
    n = sum(total.values())
    print(f"{path}: {len(rows)} instructions, {n:.0f} samples")
    for h, v in total.most_common(12):
        print(f"  {h:<24} {v:10.0f}  {100 * v / n:5.1f} %")
    ops = Counter()
    for r in rows:
        op = r["Source"].split()[0] if r["Source"].split() else "?"
        op = op if not op.startswith("@") else (r["Source"].split()[1] if len(r["Source"].split()) > 1 else op)
        ops[op.split(".")[0]] += num(r["Warp Stall Sampling (All Samples)"])
    print("samples by opcode:", ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in ops.most_common(14)))
    print(f"top {top} instructions by samples:")
    for r in sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[:top]:
        s = num(r["Warp Stall Sampling (All Samples)"])
        why = sorted(((num(r[h]), h[6:]) for h in reasons), reverse=True)[:3]
        print(
            f"  {r['Address']:>6} {100 * s / n:5.2f}%  {r['Source'][:60]:<60} "
            + " ".join(f"{w}:{v:.0f}" for v, w in why if v)
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
