"""Specializations: what one compiled kernel module is, and its stable cache key.

A *specialization* fixes everything a kernel is compiled for: the target arch, the kernel
family, and the family's static parameters (dtypes, head dim, tile sizes, layout, variant
fingerprint, ...).  Shapes that change every step (batch, lengths, heads) stay dynamic, so
one module serves them all.

The key is a hash of (arch, family, params, package version, kernel source fingerprint).
The kernel source fingerprint hashes the family's builder module, every ``cute_attn`` module it
imports (transitively) and ``cute_attn/variants``: editing a kernel invalidates its cache
entries -- and only its own family's -- without anyone having to remember to bump a version.
The DSL version is *not* in the key, because a GPU machine that only runs kernels has no DSL
to ask; it is recorded in the entry's metadata instead, and a process that has the DSL treats
an entry built by another DSL version as stale (see ``cache.py``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")

_PKG_ROOT = Path(__file__).resolve().parent.parent


def _module_file(name: str) -> Path | None:
    """The source file of a ``cute_attn`` module name (package ``__init__`` included)."""
    parts = name.split(".")[1:]
    if not parts:
        return _PKG_ROOT / "__init__.py"
    rel = Path(*parts)
    for cand in (_PKG_ROOT / rel.with_suffix(".py"), _PKG_ROOT / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(path: Path, name: str) -> set:
    """``cute_attn`` modules imported by one source file (parsed, never executed)."""
    tree = ast.parse(path.read_bytes())
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "cute_attn")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg[: len(pkg) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "cute_attn":
                continue
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # "from . import x" names modules
    return out


@functools.cache
def source_fingerprint(modules: tuple = ()) -> str:
    """sha256 over the sources a kernel is built from: the given modules (a family's builder
    module and the module that defines its ABI), every ``cute_attn`` module they import
    (transitively; parsed, not executed) and all of ``cute_attn/variants`` (variants are traced
    into kernels).  Editing one family's kernel leaves the other families' cache keys alone.
    Without modules: every kernel and variant source."""
    files = set((_PKG_ROOT / "variants").rglob("*.py"))
    if not modules:
        files |= set((_PKG_ROOT / "kernels").rglob("*.py"))
    todo, seen = list(modules), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        files.add(path)
        todo.extend(_imports(path, name) - seen)
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(str(p.relative_to(_PKG_ROOT)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _canon(value: Any) -> Any:
    """Params must be plain JSON data so the key is stable across processes and machines."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return [_canon(v) for v in value]
    raise TypeError(f"specialization parameter of type {type(value).__name__} is not allowed: {value!r}")


@dataclass(frozen=True)
class Spec:
    """One kernel specialization.  ``params`` is a sorted tuple of (name, value) pairs."""

    family: str
    arch: str
    params: tuple = field(default=())

    @staticmethod
    def make(family: str, arch: str, **params: Any) -> Spec:
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {arch!r}; cute_attn compiles for {', '.join(SUPPORTED_ARCHS)}")
        for v in params.values():
            _canon(v)  # validate early
        return Spec(family, arch, tuple(sorted(params.items())))

    def param(self, name: str) -> Any:
        for k, v in self.params:
            if k == name:
                return v
        raise KeyError(f"{self.family} specialization has no parameter {name!r}")

    @property
    def pdict(self) -> dict:
        return dict(self.params)

    def cli(self) -> str:
        """The ``--spec`` string that ``python -m cute_attn compile`` takes for this spec."""
        return self.family + ":" + ",".join(f"{k}={v}" for k, v in self.params)

    @staticmethod
    def parse(text: str, arch: str) -> Spec:
        """Inverse of :meth:`cli`: ``family:k=v,k=v`` (ints and true/false are converted)."""
        family, _, rest = text.partition(":")
        params = {}
        for item in filter(None, rest.split(",")):
            k, sep, v = item.partition("=")
            if not sep:
                raise ValueError(f"bad --spec item {item!r} in {text!r}; expected name=value")
            if v.lstrip("-").isdigit():
                params[k] = int(v)
            elif v in ("true", "True", "false", "False"):
                params[k] = v in ("true", "True")
            else:
                params[k] = v
        return Spec.make(family, arch, **params)

    def describe(self) -> str:
        """Human-readable form, used in error messages and the compile table."""
        ps = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.family}[{ps}]@{self.arch}"

    @functools.cached_property
    def key(self) -> str:
        from .._version import __version__
        from .family import get_family

        fam = get_family(self.family)
        roots = tuple(sorted({fam.builder.split(":")[0], getattr(fam.abi, "__module__", "")} - {""}))

        blob = json.dumps(
            {
                "family": self.family,
                "arch": self.arch,
                "params": [[k, _canon(v)] for k, v in self.params],
                "cute_attn": __version__,
                "sources": source_fingerprint(roots),
            },
            sort_keys=True,
        )
        return f"{self.family}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"
