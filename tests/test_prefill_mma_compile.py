"""The portable prefill kernel (``kernels/prefill_mma.py``; the ``prefill_mma`` preset: its GPU
tests' and bench's specs -- the three tiles, ragged / paged, causal, head dims 64 / 128 / 256,
soft-cap / window, the variants, the ``warps_m`` knob -- and their merges) compiles for sm_90a
and sm_100a without a GPU, holds the instructions the family promises (mma.sync, cp.async,
ldmatrix; no Hopper-only instruction, so the sm_100a binary is the same code), uses no local
memory, and its modules pass the launch ABI check against the stub CUDA runtime
(``tests/test_abi.py``'s check, on these specs).  The sm_100a build has never run on
Blackwell hardware."""

import json
import os
import subprocess
import sys

import pytest
from test_abi import CHILD, stub_lib  # noqa: F401  (the fixture)

from cute_attn.presets import preset_specs
from cute_attn.runtime.build import find_tool
from cute_attn.runtime.cache import lookup

# one worker builds the module-scoped cache (under xdist each worker would build its own)
pytestmark = [pytest.mark.compile, pytest.mark.xdist_group("prefill_mma_aot")]


@pytest.fixture(scope="module")
def mma_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefill_mma_aot")
    cmd = [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--arch", "sm_100a", "--preset",
           "prefill_mma", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_portable_prefill_compiles(mma_cache, arch):
    assert find_tool("cuobjdump"), "cuobjdump is needed to check SASS (pip install nvidia-cuda-cuobjdump)"
    specs = preset_specs("prefill_mma", arch)
    assert {s.family for s in specs} == {"batch_prefill_mma", "merge_partials"}
    for spec in specs:
        found = lookup(spec, mma_cache)
        assert found.meta is not None, f"{spec.describe()}: {found.problem}"
        missing = [k for k, v in found.meta["instructions"].items() if v is not True]
        assert not missing, f"{spec.describe()} lacks {missing}"
        res = found.meta["resources"]
        assert res.get("local", 0) == 0 and 0 < res["registers"] <= 255, f"{spec.describe()}: {res}"
        if spec.family == "batch_prefill_mma":
            ptx = (found.path / "kernel.ptx").read_text()
            assert "wgmma" not in ptx and "cp.async.bulk" not in ptx and "setmaxnreg" not in ptx, spec.describe()


def test_portable_prefill_abi(stub_lib, mma_cache):  # noqa: F811
    """The launch ABI of every ``prefill_mma`` module (sm_90a) against the stub runtime."""
    env = dict(os.environ, CUTE_ATTN_CUDART=str(stub_lib), CUTE_ATTN_CACHE_DIR=str(mma_cache))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(stub_lib), str(int.from_bytes(os.urandom(4), "little")), "prefill_mma"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["checked"] == len(preset_specs("prefill_mma", "sm_90a"))
