"""Every kernel of the default preset compiles for sm_90a and sm_100a without a GPU, and its
PTX/SASS holds the instructions its family promises (CI runs this on a CPU machine)."""

import subprocess
import sys

import pytest

from cute_attn.presets import preset_specs
from cute_attn.runtime.build import find_tool
from cute_attn.runtime.cache import lookup

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_preset_compiles_with_expected_instructions(aot_cache, arch):
    root, table = aot_cache
    assert find_tool("cuobjdump"), "cuobjdump is needed to check SASS (pip install nvidia-cuda-cuobjdump)"
    specs = preset_specs("default", arch)
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
