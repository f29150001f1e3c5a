"""Put an Nsight Compute profile's per-instruction counters on Python source lines: warp-stall
samples by line and reason, and -- given a second profile of the same kernel on another batch --
each line's executed instructions split into a part per KV block and a part per work item.

The kernel must come from a ``CUTE_DSL_LINEINFO=1`` build (its own cache directory: the key does
not see the flag; docs/DEVELOPING.md), which the GPU run loads; here, ``nvdisasm -g`` of that
build's ``kernel.cubin`` maps each SASS offset to the innermost Python line.  The profile is the
source page exported as CSV (``ncu -i R.ncu-rep --page source --csv --print-source sass > F``,
from a report taken with ``--section SourceCounters``).

    python scripts/ncu_lines.py CUBIN F.csv [TOP]
    python scripts/ncu_lines.py CUBIN A.csv B.csv BLOCKS_A ITEMS_A BLOCKS_B ITEMS_B [TOP]

BLOCKS / ITEMS: the KV blocks and work items of each profiled call (all CTAs), e.g. 2 x 8k causal
hd128 (66,560 / 2,048 at 16 heads) and the varlen32 batch (82,256 / 7,520): where the second batch
has more items per block, the item's own cost shows (``scripts/profile_prefill.py``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from ncu_stalls import load, num  # the same export, read the same way (scripts/ is on the path)

STALLS = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import nvidia.cu13  # the CUDA 13 wheel the DSL installs

    return str(Path(nvidia.cu13.__path__[0]) / "bin" / "nvdisasm")


def line_map(cubin: str) -> dict:
    """SASS offset -> 'file.py:line' of the instruction (the innermost inlined frame)."""
    sass = subprocess.run([_nvdisasm(), "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    out, cur = {}, "?"
    for text in sass.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if m:
            cur = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s", text)
        if m:
            out[int(m.group(1), 16)] = cur
    return out


def per_line(csv_path: str, lines: dict):
    """(counter name -> Counter by line, stall reason -> Counter by line) of a source-page CSV."""
    hdr, recs = load(csv_path)
    base = min(int(r["Address"], 16) for r in recs)  # the export's addresses are absolute
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    totals, why = defaultdict(Counter), defaultdict(Counter)
    for r in recs:
        where = lines.get(int(r["Address"], 16) - base, "?")
        for key in (STALLS, EXECUTED):
            totals[key][where] += num(r[key])
        for h in reasons:
            why[h[6:]][where] += num(r[h])
    return totals, why


def stalls(cubin: str, path: str, top: int) -> None:
    totals, why = per_line(path, line_map(cubin))
    samples = totals[STALLS]
    n = sum(samples.values())
    print(f"{path}: {n:.0f} stall samples")
    for where, s in samples.most_common(top):
        reasons = sorted(((c[where], r) for r, c in why.items() if c[where]), reverse=True)[:3]
        print(f"{100 * s / n:6.2f}%  {where:<36} " + " ".join(f"{r}:{100 * v / n:.1f}" for v, r in reasons))


def split(cubin: str, a: str, b: str, blocks_a: float, items_a: float, blocks_b: float, items_b: float, top: int):
    """Solve, per line, executed = x * blocks + y * items over the two profiles: x, y are the
    line's warp instructions per KV block and per work item (of a CTA, all its warps)."""
    import numpy as np

    lines = line_map(cubin)
    ea, eb = per_line(a, lines)[0][EXECUTED], per_line(b, lines)[0][EXECUTED]
    m = np.array([[blocks_a, items_a], [blocks_b, items_b]])
    rows = []
    for where in set(ea) | set(eb):
        x, y = np.linalg.solve(m, np.array([ea[where], eb[where]]))
        rows.append((y, x, where))
    print(f"warp instructions per KV block {sum(r[1] for r in rows):.0f}, per item {sum(r[0] for r in rows):.0f}")
    for y, x, where in sorted(rows, reverse=True)[:top]:
        print(f"  {where:<36} per item {y:9.1f}   per block {x:8.1f}")


def main(argv) -> None:
    if len(argv) >= 7:
        split(argv[0], argv[1], argv[2], *map(float, argv[3:7]), int(argv[7]) if len(argv) > 7 else 25)
    else:
        stalls(argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 40)


if __name__ == "__main__":
    main(sys.argv[1:])
