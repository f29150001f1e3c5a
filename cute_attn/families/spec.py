"""Specializations: what one compiled kernel module is, and its stable cache key.

A *specialization* fixes everything a kernel is compiled for: the target arch, the kernel
family, and the family's static parameters (dtypes, head dim, tile sizes, layout, variant
fingerprint, ...).  Shapes that change every step (batch, lengths, heads) stay dynamic, so
one module serves them all.

The key is a hash of (arch, family, params, package version, source fingerprint of what the
family's binary is built from: ``sources.source_fingerprint``): editing a kernel invalidates
its own family's entries and no others, without anyone bumping a version.  The DSL version is
*not* in the key, because a GPU machine that only runs kernels has no DSL to ask; it is
recorded in the entry's metadata instead, and a process that has the DSL treats an entry
built by another DSL version as stale (see ``runtime/cache.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..abi.archs import check_arch
from .base import get_family
from .sources import source_fingerprint


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
        check_arch(arch)
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
        fam = get_family(self.family)

        blob = json.dumps(
            {
                "family": self.family,
                "arch": self.arch,
                "params": [[k, _canon(v)] for k, v in self.params],
                "cute_attn": __version__,
                "sources": source_fingerprint(fam.source_modules),
            },
            sort_keys=True,
        )
        return f"{self.family}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"
