"""What a kernel binary is built from, found by reading source files (never executing them).

``source_fingerprint`` hashes a family's sources for its cache key: its builder module, the
module that declares the family, every ``cute_attn`` module those import (transitively), the
attention variants (traced into the kernels) and the build recipe (``runtime/build.py``).
Each file enters byte for byte (a syntax tree would not do: its dump differs between Python
versions, and a key must be the same on the machine that compiles and the one that runs); no
module outside that closure -- the loader, the cache, the planner, the wrappers -- can change a
key.  The import walk is also what the import-cycle test reads.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parent.parent
# the files every family's binary depends on besides its import closure: the variants (traced
# into the kernel, also through a spec's variant fingerprint) and how a module is compiled
ALWAYS = ("variants", "runtime/build.py")


def module_file(name: str) -> Path | None:
    """The source file of a ``cute_attn`` module name (package ``__init__`` included)."""
    parts = name.split(".")[1:]
    if not parts:
        return PKG_ROOT / "__init__.py"
    rel = Path(*parts)
    for cand in (PKG_ROOT / rel.with_suffix(".py"), PKG_ROOT / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def module_name(path: Path) -> str:
    rel = path.resolve().relative_to(PKG_ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["cute_attn", *parts])


def imports_of(path: Path) -> set:
    """``cute_attn`` modules one source file imports, at any depth of the file (a function's
    lazy import counts).  ``from P import n`` imports module ``P.n`` when that is a module,
    else ``P`` itself; the parent packages a submodule import executes are not counted."""
    name = module_name(path)
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
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if module_file(sub) is not None else base)
    return {m for m in out if module_file(m) is not None}


def closure(modules) -> set:
    """The source files of ``modules`` and of everything they import, transitively."""
    files, todo, seen = set(), list(modules), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            continue
        files.add(path)
        todo.extend(imports_of(path) - seen)
    return files


@functools.cache
def source_fingerprint(modules: tuple = ()) -> str:
    """sha256 over the code a kernel is built from: ``modules`` (a family's builder module and
    its declaring module) with their import closure, plus ``ALWAYS``.  Editing one family's
    kernel leaves the other families' keys alone.  Without modules: every kernel source."""
    files = closure(modules)
    for rel in ALWAYS:
        p = PKG_ROOT / rel
        files |= set(p.rglob("*.py")) if p.is_dir() else {p}
    if not modules:
        files |= set((PKG_ROOT / "kernels").rglob("*.py"))
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(str(p.relative_to(PKG_ROOT)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()[:16]
