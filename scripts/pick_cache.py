#!/usr/bin/env python3
"""Copy the cache entries of some specs from one module cache to another, keyed by this
checkout's code (a cache entry's key hashes the kernel sources): for packing a GPU visit from a
larger cache already built, where the checkout's kernels match the one that built it.

    PYTHONPATH=. python scripts/pick_cache.py SRC DST ARCH SPEC [SPEC ...]
"""

import shutil
import sys
from pathlib import Path

from cute_attn.families.spec import Spec
from cute_attn.runtime.cache import entry_dir, lookup


def main(src: str, dst: str, arch: str, texts) -> None:
    for text in texts:
        spec = Spec.parse(text, arch)
        found = lookup(spec, Path(src))
        if found.meta is None:
            sys.exit(f"{text}: {found.problem} in {src} ({found.path.name})")
        out = entry_dir(spec, Path(dst))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(found.path, out)
        print(out.name)


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
