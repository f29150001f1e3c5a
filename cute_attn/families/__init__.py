"""The kernel families: for each compiled kernel its ABI, builder path, expected instructions
and spec builders (``merge``, ``decode``, ``prefill``, ``prefill_fp8``, ``prefill_mma``,
``kv_pass``, ``mla``), and the arch -> backend table the wrappers choose from (``backends``).

A leaf: it imports ``abi`` and ``variants`` only, never the wrappers, the loader, the cache or
the planner, so a family's cache key (``spec.Spec.key``) hashes just what shapes its binary.
Importing the package registers every family."""

from . import decode, kept, kv_pass, merge, mla, prefill, prefill_fp8, prefill_mma  # noqa: F401  (registers the families)
from .base import KernelFamily, family_names, get_family, spec_variant, variant_params  # noqa: F401
from .spec import Spec  # noqa: F401
