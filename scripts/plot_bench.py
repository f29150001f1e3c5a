"""Plot our speed-up over each peer from the bench's records, one PNG per op group.

    python scripts/plot_bench.py [OUT_DIR] [--json benchmarks/results.json] [--commit SHA] [--device H200]

For each group (decode, prefill, cascade, sparse, variants) it takes the commit whose run
compared the most cases of that group with a peer (ties: the newest, by the records' date, then
git's history order; a later run of a few cases does not hide the last full one; ``--commit``
picks one) and plots, per case, every peer's time over ours (``flashinfer``, ``sdpa_cudnn``, ``flex``, ...:
its ``us`` record over ``cute_attn``'s ``us`` of the same case and commit, or its ``ratio``
record where a ``us`` is missing): > 1 = we are faster.  Only one device's records count
(``--device``, a part of its name; default H200, the GPU the figures are stated for).  Writes
``OUT_DIR/bench_<group>.png`` (default OUT_DIR: benchmarks/plots).  Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

GROUPS = {
    "decode": ("decode/",),
    "prefill": ("prefill/", "variant/"),  # variant/softcap/prefill/...: the prefill bench's soft-cap row
    "cascade": ("cascade/",),
    "sparse": ("sparse/", "sparse_variable/"),
    "variants": ("variants/",),
}
OURS = "cute_attn"
COLORS = {
    "flashinfer": "#d62728",
    "sdpa_cudnn": "#1f77b4",
    "sdpa_flash": "#17becf",
    "flex": "#2ca02c",
    "separate_rope_pass+plain": "#9467bd",
}


# the decode geometry sweeps' records (scripts/decode_hd64_sweep.py: block rows, stages, CTAs,
# heads per item): development A/Bs, not the bench's cases
SWEEP = re.compile(r"/bn\d+_s\d+_c\d+_h\d+")


def group_of(case: str):
    if SWEEP.search(case):
        return None
    for g, prefixes in GROUPS.items():
        if case.startswith(prefixes):
            return g
    return None


def _git_order(repo: Path) -> list:
    """Full hashes, newest first (empty where git is unavailable)."""
    try:
        out = subprocess.run(
            ["git", "log", "--all", "--format=%H"], cwd=repo, capture_output=True, text=True, timeout=30
        ).stdout
        return out.split()
    except (OSError, subprocess.SubprocessError):
        return []


def newest_commit(records: list, order: list) -> str:
    """The newest commit among the records: latest date, then latest in git's history."""

    def rank(commit: str):
        sha = commit.split("+")[0]
        for i, full in enumerate(order):
            if sha and full.startswith(sha):
                return -i
        return -math.inf

    dates = defaultdict(str)
    for r in records:
        dates[r["commit"]] = max(dates[r["commit"]], r.get("date", ""))
    return max(dates, key=lambda c: (dates[c], rank(c)))


def fullest_commit(records: list, order: list) -> str:
    """The commit whose records compare the most cases with a peer; ties: the newest."""
    by_commit = defaultdict(list)
    for r in records:
        by_commit[r["commit"]].append(r)
    cases = {c: len(ratios(rs)) for c, rs in by_commit.items()}
    most = max(cases.values())
    return newest_commit([r for c, rs in by_commit.items() if cases[c] == most for r in rs], order)


def ratios(records: list) -> dict:
    """{case: {peer: peer time / our time}} from one commit's records."""
    us = defaultdict(dict)
    rec_ratio = defaultdict(dict)
    for r in records:
        if r["metric"] == "us":
            us[r["case"]][r["impl"]] = r["value"]
        elif r["metric"] == "ratio" and r["impl"] != OURS:
            rec_ratio[r["case"]][r["impl"]] = r["value"]
    out = defaultdict(dict)
    for case in sorted(set(us) | set(rec_ratio)):
        ours = us[case].get(OURS)
        for impl in sorted((set(us[case]) | set(rec_ratio[case])) - {OURS}):
            if ours and us[case].get(impl):
                out[case][impl] = us[case][impl] / ours
            elif impl in rec_ratio[case]:
                out[case][impl] = rec_ratio[case][impl]
    return dict(out)


def plot_group(plt, group: str, data: dict, commit: str, meta: str, path: Path) -> None:
    cases = list(data)
    peers = sorted({p for v in data.values() for p in v}, key=lambda p: (p != "flashinfer", p))
    prefix = "" if group == "sparse" else group + "/"
    labels = [c[len(prefix) :] if prefix and c.startswith(prefix) else c for c in cases]
    n, k = len(cases), len(peers)
    width = 0.8 / k
    fig_w = min(40.0, max(8.0, 0.28 * n * max(k, 2) + 2.0))
    fig, ax = plt.subplots(figsize=(fig_w, 6.5))
    values = [v for d in data.values() for v in d.values() if v > 0]
    lo, hi = min(values), max(values)
    log = hi / lo > 20
    # each case's bars centred on its tick, in the legend's order, for the peers it has
    pos = {}
    for i, c in enumerate(cases):
        have = [p for p in peers if p in data[c]]
        for j, p in enumerate(have):
            pos[c, p] = i + (j - (len(have) - 1) / 2) * width
    for peer in peers:
        xs = [pos[c, peer] for c in cases if peer in data[c]]
        ys = [data[c][peer] for c in cases if peer in data[c]]
        bars = ax.bar(xs, ys, width=width * 0.95, label=peer, color=COLORS.get(peer))
        if n * k <= 80:
            for b, y in zip(bars, ys):
                ax.annotate(
                    f"{y:.2f}",
                    (b.get_x() + b.get_width() / 2, y),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
    ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--")
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(lo, 1.0) / 1.5, max(hi, 1.0) * 2.5)
    else:
        ax.set_ylim(0, max(hi, 1.0) * 1.18)
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("peer time / cute_attn time  (> 1: cute_attn faster)")
    ax.set_title(f"{group}: cute_attn's speed-up over each peer -- commit {commit} ({meta})", fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default="benchmarks/plots", help="where the PNGs go")
    ap.add_argument("--json", default="benchmarks/results.json", help="the bench's records")
    ap.add_argument("--commit", help="plot this commit's records (default: each group's newest)")
    ap.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    ap.add_argument("--device", default="H200", help="plot this device's records (a part of its name)")
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench.py needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    records = json.loads(Path(a.json).read_text())
    order = _git_order(Path(a.json).resolve().parent)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_group = defaultdict(list)
    for r in records:
        if a.device not in r.get("device", ""):
            continue
        g = group_of(r["case"])
        if g is not None:
            by_group[g].append(r)
    wrote = 0
    for group in a.groups:
        recs = by_group.get(group, [])
        if a.commit:
            recs = [r for r in recs if r["commit"].startswith(a.commit)]
        if not recs:
            print(f"{group}: no records")
            continue
        commit = a.commit or fullest_commit(recs, order)
        recs = [r for r in recs if r["commit"] == commit] if not a.commit else recs
        data = ratios(recs)
        if not data:
            print(f"{group}: commit {commit} has no peer to compare with")
            continue
        meta = ", ".join(sorted({r.get("device", "?") for r in recs}) + sorted({r.get("date", "?") for r in recs}))
        path = out / f"bench_{group}.png"
        plot_group(plt, group, data, commit, meta, path)
        n_peers = len({p for v in data.values() for p in v})
        print(f"{group}: {len(data)} cases x {n_peers} peers (commit {commit}) -> {path}")
        wrote += 1
    return 0 if wrote else 1


if __name__ == "__main__":
    sys.exit(main())
