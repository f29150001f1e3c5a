#!/usr/bin/env python3
"""Copy a module cache keeping only what a GPU machine needs to *run* (module.so, kernel.h,
meta.json), for the device machine's 64 MiB carry limit: the SASS/PTX/cubin dumps are ~90 % of
a cache's bytes.  The copy's meta.json lists only the files kept, so its checksums still hold.

    python scripts/slim_cache.py build/aot build/aot_run
"""

import json
import shutil
import sys
from pathlib import Path

KEEP = ("module.so", "kernel.h", "meta.json")


def main(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    n = 0
    for meta_path in src.glob("*/*/meta.json"):
        entry = meta_path.parent
        out = dst / entry.relative_to(src)
        out.mkdir(parents=True)
        meta = json.loads(meta_path.read_text())
        meta["files"] = {k: v for k, v in meta["files"].items() if k in KEEP}
        for name in meta["files"]:
            shutil.copy2(entry / name, out / name)
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
        n += 1
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"{n} entries, {size / 2**20:.1f} MiB -> {dst}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
