"""The loader's packed argument structs reach the kernel intact — checked without a GPU.

Each preset module is loaded against a stand-in CUDA runtime (abi_stub/cudart_stub.c) that
records the kernel parameters of a launch.  For tensors of random shapes and strides, the
kernel must receive exactly their data pointers, dynamic extents (int32) and dynamic strides
(int64), in ABI order; the stream must pass through.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import COMPILE_TEST_PRESET

pytestmark = pytest.mark.compile

HERE = Path(__file__).resolve().parent

CHILD = r"""
# argv: the stub runtime library, a random seed, the preset whose sm_90a modules are checked
import ctypes, json, random, re, sys
import torch
from cute_attn.presets import preset_specs
from cute_attn.abi.args import TensorArg
from cute_attn.runtime.loader import get_module, tensor_fields

stub = ctypes.CDLL(sys.argv[1])
stub.stub_param.restype = ctypes.POINTER(ctypes.c_ubyte * 512)
TORCH = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "u8": torch.uint8,
         "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # fp8 caches (decode, the KV pass)
rng = random.Random(int(sys.argv[2]))
checked = 0
for spec in preset_specs(sys.argv[3], "sm_90a"):
    mod = get_module(spec)
    ptx = (mod.path / "kernel.ptx").read_text()
    sizes = [int(x) for x in re.findall(r"\.param \.align \d+ \.b8 \w+\[(\d+)\]", ptx)]
    stub.stub_set_param_sizes(len(sizes), (ctypes.c_int * len(sizes))(*sizes))
    tensors = []
    for a in mod.args:
        if not isinstance(a, TensorArg):
            tensors.append(rng.randint(1, 3)); continue
        shape = [rng.randint(2, 9) if s is None else s for s in a.shape]
        # strides: a padded row-major layout, so every stride differs from the compact one
        strides, acc = [], 1
        for i in reversed(range(len(shape))):
            if a.stride[i] is not None:
                strides.insert(0, a.stride[i]); acc = max(acc, a.stride[i] * shape[i]); continue
            st = acc + a.stride_divisibility * rng.randint(1, 3)
            st -= st % a.stride_divisibility
            strides.insert(0, st); acc = st * shape[i]
        tensors.append(torch.empty_strided(shape, strides, dtype=TORCH[a.dtype]))
    flat = sum(([t] if not isinstance(a, TensorArg) else tensor_fields(a, t) for a, t in zip(mod.args, tensors)), [])
    before = stub.stub_launches()
    mod.launch(flat, 0xABC0)
    assert stub.stub_launches() == before + 1, spec.describe()
    grid, block, stream = (ctypes.c_uint * 3)(), (ctypes.c_uint * 3)(), ctypes.c_void_p()
    stub.stub_launch_config(grid, block, ctypes.byref(stream))
    assert stream.value == 0xABC0, spec.describe()
    assert list(block)[0] > 0 and list(grid)[0] > 0
    scalars = {a.name: t for a, t in zip(mod.args, tensors) if not isinstance(a, TensorArg)}
    # the grid scalars must arrive: persistent kernels launch exactly num_ctas CTAs,
    # the merge ops at most max_ctas
    if "num_ctas" in scalars:
        assert grid[0] == scalars["num_ctas"], (spec.describe(), list(grid), scalars)
    if "max_ctas" in scalars:
        assert grid[0] <= scalars["max_ctas"], (spec.describe(), list(grid), scalars)
    # Kernel params: the tensor params come first, in ABI order:
    # {void* data; int32 extents[k]; (pad to 8); int64 strides[m]}
    tensor_args = [(a, t) for a, t in zip(mod.args, tensors) if isinstance(a, TensorArg)]
    for i, (a, t) in enumerate(tensor_args):
        raw = bytes(stub.stub_param(i).contents)[:sizes[i]]
        k, m = len(a.dyn_shape_modes), len(a.dyn_stride_modes)
        got_ptr = int.from_bytes(raw[:8], "little")
        got_shape = [int.from_bytes(raw[8 + 4 * j: 12 + 4 * j], "little", signed=True) for j in range(k)]
        off = 8 + 4 * k + (-(8 + 4 * k)) % 8
        got_stride = [int.from_bytes(raw[off + 8 * j: off + 8 * j + 8], "little", signed=True) for j in range(m)]
        want = tensor_fields(a, t)
        assert [got_ptr] + got_shape + got_stride == want, (spec.describe(), a.name, raw.hex(), want)
        assert sizes[i] == off + 8 * m, (spec.describe(), a.name, sizes[i])
    checked += 1
print(json.dumps({"checked": checked}))
"""


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("stub") / "libcudart_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(HERE / "abi_stub" / "cudart_stub.c")], check=True)
    return out


@pytest.mark.xdist_group("aot_cache")  # with tests/test_compile.py: one build of the preset
def test_kernel_params_match_tensors(stub_lib, aot_cache):
    # Load from the prebuilt cache: a process that imports the DSL binds the modules' CUDA
    # runtime symbols to the DSL's own runtime instead of the stub.
    env = dict(os.environ, CUTE_ATTN_CUDART=str(stub_lib), CUTE_ATTN_CACHE_DIR=str(aot_cache[0]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(stub_lib), str(int.from_bytes(os.urandom(4), "little")), COMPILE_TEST_PRESET],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checked"] > 0
