"""Specializations: what one compiled kernel module is, and its stable cache key.

A *specialization* fixes everything a kernel is compiled for: the target arch, the kernel
family, and the family's static parameters (dtypes, head dim, tile sizes, layout, variant
fingerprint, ...).  Shapes that change every step (batch, lengths, heads) stay dynamic, so
one module serves them all.

The key is a hash of (arch, family, params, package version, kernel source fingerprint).
The kernel source fingerprint hashes every file under ``cute_attn/kernels`` and
``cute_attn/variants``: editing a kernel invalidates its cache entries without anyone having
to remember to bump a version.  The DSL version is *not* in the key, because a GPU machine
that only runs kernels has no DSL to ask; it is recorded in the entry's metadata instead, and
a process that has the DSL treats an entry built by another DSL version as stale
(see ``cache.py``).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")

_PKG_ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over the DSL kernel and variant sources (path + bytes), computed once per process."""
    h = hashlib.sha256()
    for sub in ("kernels", "variants"):
        for p in sorted((_PKG_ROOT / sub).rglob("*.py")):
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
    def make(family: str, arch: str, **params: Any) -> "Spec":
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {arch!r}; cute_attn compiles for {', '.join(SUPPORTED_ARCHS)}")
        for k, v in params.items():
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
    def parse(text: str, arch: str) -> "Spec":
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
        from .. import __version__

        blob = json.dumps(
            {
                "family": self.family,
                "arch": self.arch,
                "params": [[k, _canon(v)] for k, v in self.params],
                "cute_attn": __version__,
                "sources": source_fingerprint(),
            },
            sort_keys=True,
        )
        return f"{self.family}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"
