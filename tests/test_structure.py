"""The package's structure, checked on the CPU: no import cycles, cache keys that hash only what
shapes a binary, and modules short enough to read in one sitting."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from cute_attn.families import sources
from cute_attn.families.spec import Spec
from cute_attn.presets import preset_specs

PKG = sources.PKG_ROOT


def _modules() -> dict:
    return {sources.module_name(p): p for p in PKG.rglob("*.py")}


def _edges(path: Path) -> set:
    """Static imports at any depth, plus ``importlib.import_module("literal")`` calls."""
    out = sources.imports_of(path)
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("cute_attn"):
                out.add(node.args[0].value)
    return out


def _find_cycle(graph: dict):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles():
    mods = _modules()
    graph = {name: {m for m in _edges(p) if m in mods and m != name} for name, p in mods.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_families_are_a_leaf():
    """The families import only abi, variants and themselves: never the wrappers, the loader,
    the cache or the planner (their keys would hash those)."""
    for p in (PKG / "families").glob("*.py"):
        for m in _edges(p):
            assert m.split(".")[1] in ("abi", "variants", "families", "_version"), (p.name, m)


def _keys(root: Path) -> dict:
    """Every default-preset spec's key when the package sources are read from ``root``."""
    old = sources.PKG_ROOT
    sources.PKG_ROOT = root
    sources.source_fingerprint.cache_clear()
    try:
        specs = preset_specs("default", "sm_90a") + preset_specs("default", "sm_100a")
        return {(s.family, s.arch, s.params): Spec(s.family, s.arch, s.params).key for s in specs}
    finally:
        sources.PKG_ROOT = old
        sources.source_fingerprint.cache_clear()


@pytest.fixture(scope="module")
def base_keys():
    return _keys(PKG)


def _edited(tmp_path: Path, rel: str, text: str) -> Path:
    root = tmp_path / "cute_attn"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    with open(root / rel, "a") as f:
        f.write(text)
    return root


# host-side modules: a code edit in any of them must rebuild nothing
HOST_MODULES = [
    "runtime/loader.py",
    "runtime/cache.py",
    "runtime/header.py",
    "sched/plan.py",
    "sched/cost.py",
    "families/backends.py",
    "presets.py",
    "decode.py",
    "prefill.py",
    "cascade.py",
    "sparse.py",
    "merge.py",
    "wrappers/options.py",
    "testing/matrices.py",
]


@pytest.mark.parametrize("rel", HOST_MODULES)
def test_host_edits_change_no_key(tmp_path, base_keys, rel):
    if not (PKG / rel).exists():
        pytest.skip(f"{rel} does not exist")
    root = _edited(tmp_path, rel, "\n# a comment\n_KEY_PROBE = 1\n")
    assert _keys(root) == base_keys


@pytest.mark.parametrize(
    "rel, families",
    [
        ("kernels/decode.py", {"paged_decode", "batch_prefill_mma"}),  # the portable prefill reuses its pieces
        ("kernels/prefill_mma.py", {"batch_prefill_mma"}),
        ("kernels/prefill_sm90_softmax.py", {"batch_prefill_sm90", "batch_prefill_fp8_sm90"}),  # fp8: a subclass
        ("kernels/kv_pass.py", {"kv_pass"}),
        # the wgmma kernel reuses its copy map; head dim 512 (kernels/decode_wide.py) its body
        ("kernels/mla_decode.py", {"mla_decode", "mla_decode_sm90", "paged_decode", "batch_prefill_mma"}),
        ("kernels/mla_decode_sm90.py", {"mla_decode_sm90"}),
        ("kernels/merge.py", {"merge_states", "merge_pair", "merge_partials"}),
        ("families/merge.py", {"merge_states", "merge_pair", "merge_partials"}),
        ("families/decode.py", {"paged_decode", "batch_prefill_sm90", "batch_prefill_fp8_sm90", "batch_prefill_mma"}),
        ("kernels/vt_pass.py", {"vt_pass"}),
    ],
)
def test_kernel_edits_change_only_their_keys(tmp_path, base_keys, rel, families):
    """Editing one family's kernel changes that family's keys and no other's (the prefill family
    extends decode's ABI, so its declaration is in prefill's keys too)."""
    root = _edited(tmp_path, rel, "\n_KEY_PROBE = 1\n")
    changed = {k[0] for k, v in _keys(root).items() if v != base_keys[k]}
    present = {k[0] for k in base_keys}
    assert changed == families & present


@pytest.mark.parametrize("rel", ["abi/records.py", "runtime/build.py", "variants/builtins.py"])
def test_shared_inputs_change_every_attention_key(tmp_path, base_keys, rel):
    """What every binary depends on -- the work records, the build recipe, the variants --
    does change the keys."""
    root = _edited(tmp_path, rel, "\n_KEY_PROBE = 1\n")
    new = _keys(root)
    assert all(new[k] != v for k, v in base_keys.items() if k[0] in ("paged_decode", "batch_prefill_sm90"))


def test_module_sizes():
    """No module over 700 lines; the DSL kernel files at most 900."""
    too_long = []
    for p in PKG.rglob("*.py"):
        n = len(p.read_text().splitlines())
        limit = 900 if p.parent.name == "kernels" else 700
        if n > limit:
            too_long.append(f"{p.relative_to(PKG)}: {n} > {limit}")
    assert not too_long, too_long
