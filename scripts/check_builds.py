#!/usr/bin/env python3
"""List the kernels of a cache directory whose build went wrong for speed: wgmma issued but not
asynchronous in the SASS (ptxas serialized it, "C7512 ... insufficient register resources"), or
local memory / stack in use (spills).  Exit status 1 if any.

    python scripts/check_builds.py build/aot [FAMILY_SUBSTRING ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list) -> int:
    root, keys = Path(argv[0]), argv[1:]
    bad = 0
    for meta in sorted(root.glob("*/*/meta.json")):
        m = json.loads(meta.read_text())
        name = m.get("describe", meta.parent.name)
        if keys and not any(k in name for k in keys):
            continue
        ins, res = m.get("instructions", {}), m.get("resources", {})
        why = []
        if ins.get("wgmma (PTX)") and ins.get("wgmma async (SASS)") is False:
            why.append("wgmma serialized")
        if res.get("local") or res.get("stack"):
            why.append(f"local {res.get('local')} B, stack {res.get('stack')} B")
        if why:
            bad += 1
            print(f"{name}: {'; '.join(why)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
