"""Merge the records of a device run's results.json into benchmarks/results.json (the latest
record of a (case, impl, metric) on a device replaces that device's older one, as ``bench
--json`` does; another device's records stay).

    python scripts/merge_results.py /path/to/run/results.json [benchmarks/results.json]
"""

from __future__ import annotations

import json
import sys

from cute_attn.bench.common import Results


def main() -> None:
    src = sys.argv[1]
    dst = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/results.json"
    res = Results.__new__(Results)
    res.records = json.load(open(src))
    res.merge_into(dst)
    print(f"{len(res.records)} records from {src} merged into {dst}")


if __name__ == "__main__":
    main()
