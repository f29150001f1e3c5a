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
- A build holds its key's lock for at most ``$CUTE_ATTN_LOCK_TIMEOUT`` seconds of waiting
  (default 900): a hung holder makes the others fail with an error naming it, not wait forever.
  Temporary and trash directories left by killed builds are removed by the next build of the
  same key (which holds the lock, so no live build owns them).
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
# what the loader reads from an entry's metadata, with the type it must have
_META_FIELDS = {"format": int, "key": str, "files": dict, "symbols": dict, "abi": list, "spec": dict}
_SYMBOLS = ("init", "load", "launch", "num_args")
LOCK_TIMEOUT_S = 900.0


class CacheError(RuntimeError):
    """The cache cannot be used as asked (not writable, a lock held too long)."""


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
        bad = _meta_problem(meta)
        if bad:
            return Lookup(None, d, f"corrupt: {bad}")
        files = meta["files"]
        if meta.get("format") != FORMAT_VERSION or meta.get("key") != spec.key:
            return Lookup(None, d, "corrupt: metadata does not describe this key")
        for name, digest in files.items():
            if "/" in name or name.startswith("."):
                return Lookup(None, d, f"corrupt: file name {name!r} in the metadata")
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


def _meta_problem(meta) -> Optional[str]:
    """Why a parsed meta.json cannot describe an entry (None: its shape is right)."""
    if not isinstance(meta, dict):
        return f"metadata is a {type(meta).__name__}, not an object"
    for name, typ in _META_FIELDS.items():
        if not isinstance(meta.get(name), typ):
            return f"metadata field {name!r} is missing or not a {typ.__name__}"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta["files"].items()):
        return "metadata 'files' is not a map of names to checksums"
    if any(s not in meta["symbols"] for s in _SYMBOLS):
        return f"metadata 'symbols' lacks one of {_SYMBOLS}"
    return None


def _writable_dir(path: Path, what: str) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(
            f"cannot create the {what} {path} ({e.strerror}): point CUTE_ATTN_CACHE_DIR at a writable "
            f"directory, or build the missing kernels elsewhere (`python -m cute_attn compile --out DIR`)"
        ) from None
    return path


@contextmanager
def key_lock(spec: Spec, root: Optional[Path] = None, timeout: Optional[float] = None):
    """Inter-process lock for building one key (advisory ``flock`` on a lock file that holds
    its holder's pid), waiting at most ``timeout`` seconds (default ``$CUTE_ATTN_LOCK_TIMEOUT``
    or ``LOCK_TIMEOUT_S``)."""
    if timeout is None:
        timeout = float(os.environ.get("CUTE_ATTN_LOCK_TIMEOUT", LOCK_TIMEOUT_S))
    lock_dir = _writable_dir(Path(root or cache_root()) / spec.arch / ".locks", "cache lock directory")
    path = lock_dir / f"{spec.key}.lock"
    try:
        f = open(path, "a+")
    except OSError as e:
        raise CacheError(f"cannot open the cache lock {path} ({e.strerror}): is the cache writable?") from None
    with f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise CacheError(
                        f"waited {timeout:.0f} s for the build lock {path} (held by pid {holder}); a build "
                        f"that hangs holds it -- end that process, or raise CUTE_ATTN_LOCK_TIMEOUT"
                    ) from None
                time.sleep(0.05)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(parent: Path, key: str) -> None:
    """Temporary / trash directories of ``key`` from builds that died (we hold the key's lock,
    so none belongs to a live build)."""
    for pattern in (f".tmp-{key}-*", f".trash-{key}-*"):
        for p in parent.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def publish(spec: Spec, build_fn, root: Optional[Path] = None) -> Lookup:
    """Build ``spec`` with ``build_fn(tmpdir) -> meta`` and move it into place atomically.

    Must be called holding :func:`key_lock`.  ``build_fn`` writes the entry's files into the
    directory it is given and returns the metadata (without checksums, added here).
    """
    final = entry_dir(spec, root)
    _writable_dir(final.parent, "cache directory")
    _remove_leftovers(final.parent, spec.key)
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
