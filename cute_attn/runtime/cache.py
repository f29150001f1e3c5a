"""The on-disk module cache: ``<root>/<arch>/<key>/{module.so, kernel.ptx, kernel.cubin, kernel.h, meta.json}``.

Rules (docs/design.md §4):
- An entry appears atomically: it is built in a temporary directory next to its final place
  and renamed into place, so a reader never sees half an entry.
- Several processes compiling the same key serialize on a lock file; the second one finds the
  first one's entry and does not compile again.
- ``meta.json`` records a sha256 of every file.  An entry whose files do not match (truncated
  copy, disk error, someone editing it) is reported as corrupt, moved aside and rebuilt —
  never loaded.
- An entry built by another DSL version is stale when the DSL is installed (rebuilt); on a
  run-only machine without the DSL it is used as is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..families.spec import Spec

META = "meta.json"
FORMAT_VERSION = 1


def cache_root() -> Path:
    """``$CUTE_ATTN_CACHE_DIR``, else ``~/.cache/cute_attn``."""
    env = os.environ.get("CUTE_ATTN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cute_attn"


def entry_dir(spec: Spec, root: Optional[Path] = None) -> Path:
    return Path(root or cache_root()) / spec.arch / spec.key


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def installed_dsl_version() -> Optional[str]:
    """Version of nvidia-cutlass-dsl if installed (read from metadata; does not import the DSL)."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return None


@dataclass
class Lookup:
    meta: Optional[dict]  # set when the entry is valid
    path: Path
    problem: Optional[str] = None  # why the entry is unusable ("missing", "corrupt: ...", "stale: ...")


def lookup(spec: Spec, root: Optional[Path] = None) -> Lookup:
    d = entry_dir(spec, root)
    meta_path = d / META
    if not meta_path.exists():
        return Lookup(None, d, "missing")
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        if meta.get("format") != FORMAT_VERSION or meta.get("key") != spec.key:
            return Lookup(None, d, "corrupt: metadata does not describe this key")
        for name, digest in files.items():
            p = d / name
            if not p.exists():
                return Lookup(None, d, f"corrupt: {name} is missing")
            if sha256_file(p) != digest:
                return Lookup(None, d, f"corrupt: {name} does not match its checksum")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Lookup(None, d, f"corrupt: unreadable metadata ({e})")
    dsl = installed_dsl_version()
    if dsl is not None and meta.get("dsl_version") != dsl:
        return Lookup(None, d, f"stale: built by DSL {meta.get('dsl_version')}, installed {dsl}")
    return Lookup(meta, d)


@contextmanager
def key_lock(spec: Spec, root: Optional[Path] = None):
    """Inter-process lock for building one key (advisory ``flock`` on a lock file)."""
    lock_dir = Path(root or cache_root()) / spec.arch / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{spec.key}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def publish(spec: Spec, build_fn, root: Optional[Path] = None) -> Lookup:
    """Build ``spec`` with ``build_fn(tmpdir) -> meta`` and move it into place atomically.

    Must be called holding :func:`key_lock`.  ``build_fn`` writes the entry's files into the
    directory it is given and returns the metadata (without checksums, added here).
    """
    final = entry_dir(spec, root)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.key}-", dir=final.parent))
    try:
        meta = dict(build_fn(tmp))
        meta.update(format=FORMAT_VERSION, key=spec.key, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        meta["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        _write_durable(tmp / META, json.dumps(meta, indent=1, sort_keys=True))
        if final.exists():  # a corrupt or stale entry: move it aside, then replace
            trash = final.parent / f".trash-{spec.key}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return lookup(spec, root)


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
