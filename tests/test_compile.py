"""Every kernel geometry of the default preset (the ``ci`` preset: each geometry, modes pairwise;
``CUTE_ATTN_COMPILE_TEST_PRESET=default`` for all of it) compiles for sm_90a and sm_100a without
a GPU, and its PTX/SASS holds the instructions its family promises (CI runs this on a CPU
machine)."""

import subprocess
import sys

import pytest
from conftest import COMPILE_TEST_PRESET

from cute_attn.presets import covering, preset_specs
from cute_attn.runtime.build import find_tool
from cute_attn.runtime.cache import lookup

# the tests that share the compiled preset run on one xdist worker (--dist loadgroup), so it is built once
pytestmark = [pytest.mark.compile, pytest.mark.xdist_group("aot_cache")]


def test_covering_keeps_every_geometry_and_pair():
    from itertools import combinations

    for arch in ("sm_90a", "sm_100a"):
        full = preset_specs("default", arch)
        sub = covering(full)
        assert set(sub) <= set(full) and len(sub) < len(full) / 2
        assert preset_specs("ci", arch) == sub

        def pairs(specs):
            return {(s.family, a, b) for s in specs for a, b in combinations(sorted(s.params), 2)}

        def geometries(specs):
            modes = ("variant", "variant_fp", "causal", "soft_cap", "window", "dtype")
            return {(s.family, tuple(kv for kv in sorted(s.params) if kv[0] not in modes)) for s in specs}

        assert pairs(sub) == pairs(full)
        assert geometries(sub) == geometries(full)
        assert {s.family for s in sub} == {s.family for s in full}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_preset_compiles_with_expected_instructions(aot_cache, arch):
    root, table = aot_cache
    assert find_tool("cuobjdump"), "cuobjdump is needed to check SASS (pip install nvidia-cuda-cuobjdump)"
    specs = preset_specs(COMPILE_TEST_PRESET, arch)
    assert specs
    for spec in specs:
        found = lookup(spec, root)
        assert found.meta is not None, f"{spec.describe()}: {found.problem}"
        missing = [k for k, v in found.meta["instructions"].items() if v is not True]
        assert not missing, f"{spec.describe()} lacks {missing}"
        assert found.meta["instructions"], f"{spec.describe()} declares no expected instructions"
        assert found.meta["resources"].get("local", 0) == 0, f"{spec.describe()} spills to local memory"
        assert (found.path / "module.so").stat().st_size > 0
        assert spec.describe() in table or spec.describe().split("@")[0] in table


def test_recompile_is_a_cache_hit(aot_cache):
    root, _ = aot_cache
    spec = preset_specs("smoke", "sm_90a")[0]
    before = lookup(spec, root).meta["created"]
    proc = subprocess.run(
        [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--spec", spec.cli(), "--out", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert lookup(spec, root).meta["created"] == before
