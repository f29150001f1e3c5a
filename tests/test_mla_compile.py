"""The MLA kernels (the ``mla`` preset: both tiles, fp16 / bf16, and their merges) compile for
sm_90a and sm_100a without a GPU, hold the instructions the family promises, and keep every
value in registers (no local memory: a spill would put the 16 x 128 fp32 accumulator of each
warp through L1 on every block)."""

import subprocess
import sys

import pytest

from cute_attn.presets import preset_specs
from cute_attn.runtime.build import find_tool
from cute_attn.runtime.cache import lookup

# one worker builds the module-scoped cache (under xdist each worker would build its own)
pytestmark = [pytest.mark.compile, pytest.mark.xdist_group("mla_aot")]


@pytest.fixture(scope="module")
def mla_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla_aot")
    cmd = [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--arch", "sm_100a", "--preset", "mla",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_mla_compiles_without_spills(mla_cache, arch):
    assert find_tool("cuobjdump"), "cuobjdump is needed to check SASS (pip install nvidia-cuda-cuobjdump)"
    specs = preset_specs("mla", arch)
    want = {"mla_decode", "merge_partials"} | ({"mla_decode_sm90"} if arch == "sm_90a" else set())
    assert {s.family for s in specs} == want
    for spec in specs:
        found = lookup(spec, mla_cache)
        assert found.meta is not None, f"{spec.describe()}: {found.problem}"
        missing = [k for k, v in found.meta["instructions"].items() if v is not True]
        assert not missing, f"{spec.describe()} lacks {missing}"
        res = found.meta["resources"]
        assert res.get("local", 0) == 0 and res.get("stack", 0) == 0, f"{spec.describe()} spills: {res}"
        assert 0 < res["registers"] <= 255, res
        if spec.family == "mla_decode":
            sass = (found.path / "kernel.sass").read_text()
            # per block: 36 score MMAs (9 k16 steps x 4 n8 tiles) + 32 output MMAs (2 x 16) per warp
            assert sass.count("HMMA.16816") >= 68, spec.describe()
        if spec.family == "mla_decode_sm90":
            sass = (found.path / "kernel.sass").read_text()
            # per block: 36 score wgmmas (m64n64k16) + 4 output wgmmas (m64n256k16) per warpgroup,
            # asynchronous (ptxas serializes wgmma by one WARPGROUP.ARRIVE per HGMMA)
            assert sass.count("HGMMA.64x64x16") >= 36 and sass.count("HGMMA.64x256x16") >= 8, spec.describe()
            assert sass.count("HGMMA") >= 3 * sass.count("WARPGROUP.ARRIVE"), spec.describe()
