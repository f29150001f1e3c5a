"""Build FlashInfer 0.7.2.post1's sm_90a MLA module on this CPU machine and pack it with the
Python / template files ``flashinfer.mla`` needs into an overlay of the trimmed FlashInfer tree
(``shared/tools/flashinfer``), so the MLA bench has its FlashInfer baseline on the GPU machine
without JIT-building there.

    python scripts/fi_mla_overlay.py build/fi          # ~3 min of nvcc on one core

Steps, in ``WORK`` (an ignored folder):
 1. ``pip download`` the wheel, unpack it (``full/``), put the trimmed tree's ``__init__.py``
    in (it does not import every op family);
 2. generate and compile FlashInfer's own ``fa3`` MLA module (bf16, ckv 512, kpe 64: what its
    ``backend="auto"`` plans on sm_90a) with its ``build_jit_specs``; link against an empty
    ``libcuda`` stub where the toolkit has none (the module uses no driver symbol: ld drops it)
    and install the ``.so`` where FlashInfer looks for prebuilt modules (``data/aot``);
 3. record every file of the wheel that ``import flashinfer.mla`` and the module's source
    generation open, with and without the CUTLASS DSL importable (the GPU machine lacks it),
    plus every module of ``flashinfer.mla._batch_mla`` and ``flashinfer.jit``;
 4. pack those the trimmed tree lacks (or has different), plus the ``.so``, into
    ``WORK/fi_mla_overlay.tar.xz`` (~1 MiB).

On the GPU machine: unpack it over the trimmed tree after ``setup.sh``'s own tarballs (add its
name to setup.sh's list, or ``tar -xJf`` it into ``$FI_WORK/site``)."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SHARED = Path("/work/shared/tools/flashinfer")
WHEEL = "flashinfer-python==0.7.2.post1"
TVM = "apache-tvm-ffi==0.1.15.post2"
EXTRA = ["tqdm", "einops", "requests", "tabulate", "click", "nvidia-ml-py", "ninja"]
HIDDEN = ("nvidia_cutlass_dsl", "cutlass", "cuda_tile", "nvidia_cudnn_frontend", "cudnn", "nccl4py")

GEN_HEAD = """
import json, os, sys, torch
ROOT = os.path.realpath(sys.argv[1]); opened = set()
def hook(ev, a):
    if ev == "open" and a and isinstance(a[0], (str, bytes, os.PathLike)):
        p = os.path.realpath(os.fsdecode(a[0]))
        if p.startswith(ROOT + os.sep): opened.add(os.path.relpath(p, ROOT))
sys.addaudithook(hook)
"""
GEN_TAIL = """
if sys.argv[3] == "build" and not spec.aot_path.exists():
    import shutil
    from flashinfer.jit.core import build_jit_specs
    build_jit_specs([spec])
    spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(spec.jit_library_path, spec.aot_path)
mods = [m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
py = [os.path.relpath(os.path.realpath(f), ROOT) for f in mods if os.path.realpath(f).startswith(ROOT + os.sep)]
json.dump(dict(files=sorted(set(py) | opened), so=os.path.relpath(spec.aot_path, ROOT)), open(sys.argv[2], "w"))
"""


def gen_script(module: str) -> str:
    """The generator script run in ``WORK`` (``python gen.py FULL OUT build|scan``): ``module``
    imports FlashInfer's Python side and sets ``spec`` (the module's JitSpec); the script records
    every file of the wheel that this opens and, with ``build``, compiles the module into
    FlashInfer's prebuilt-module folder."""
    return GEN_HEAD + module.strip() + "\n" + GEN_TAIL.lstrip("\n")


GEN = gen_script("""
import flashinfer, flashinfer.mla
from flashinfer.jit import gen_batch_mla_module
spec = gen_batch_mla_module("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 512, 64, False)
""")


def sh(*a, **kw):
    subprocess.run(a, check=True, **kw)


def main(gen: str = GEN, out_name: str = "fi_mla_overlay.tar.xz"):
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "build/fi").resolve()
    full, tvm, extra, shadow, stubs = (work / n for n in ("full", "tvm", "extra", "shadow", "stubs"))
    work.mkdir(parents=True, exist_ok=True)
    if not full.exists():
        sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(work / "whl"))
        whl = next((work / "whl").glob("flashinfer_python-*.whl"))
        zipfile.ZipFile(whl).extractall(full)
        (full / "flashinfer/__init__.py").write_bytes((SHARED / "patches/flashinfer/__init__.py").read_bytes())
    if not tvm.exists():
        sh(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tvm), TVM)
        sh(sys.executable, "-m", "pip", "install", "-q", "--target", str(extra), *EXTRA)
    if not shadow.exists():  # this Python's packages without the ones the GPU machine lacks
        shadow.mkdir()
        for e in Path(site.getsitepackages()[0]).iterdir():
            if not e.name.startswith(HIDDEN + ("__editable__", "_distutils_hack", "distutils-precedence")):
                (shadow / e.name).symlink_to(e)
    stubs.mkdir(exist_ok=True)
    (stubs / "empty.c").write_text("")
    sh("gcc", "-shared", "-fPIC", "-o", str(stubs / "libcuda.so"), "-Wl,-soname,libcuda.so.1", str(stubs / "empty.c"))
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    # CUTLASS's tensor_fill.h (pulled in by the fp8 prefill) wants <curand_kernel.h>, which this
    # machine's toolkit lacks: the trimmed tree carries NVIDIA's redistributable copies
    fallback = work / "curand"
    if not (fallback / "_fallback_include").exists():
        with tarfile.open(SHARED / "dist/fi_site.tar.xz") as t:
            t.extractall(fallback, members=[m for m in t.getmembers() if m.name.startswith("_fallback_include/")])
    cpath = ":".join(filter(None, [str(fallback / "_fallback_include"), os.environ.get("CPATH", "")]))
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(work / "ws"), FLASHINFER_CUDA_ARCH_LIST="9.0a",
               CUDA_HOME=cuda, MAX_JOBS=os.environ.get("MAX_JOBS", "1"), PATH=f"{extra / 'bin'}:{os.environ['PATH']}",
               FLASHINFER_EXTRA_LDFLAGS=f"-L{stubs}", CPATH=cpath)  # fmt: skip
    (work / "gen.py").write_text(gen)
    found, so = set(), None
    for mode, path in (("build", [full, tvm, extra]), ("scan", [full, tvm, extra, shadow])):
        out = work / f"files_{mode}.json"
        args = [sys.executable] + (["-S"] if mode == "scan" else []) + [str(work / "gen.py"), str(full), str(out), mode]
        sh(*args, env=dict(env, PYTHONPATH=":".join(map(str, path))))
        got = json.loads(out.read_text())
        found |= set(got["files"])
        so = got["so"]
    for pkg in ("flashinfer/mla/_batch_mla", "flashinfer/jit"):  # modules plan() / run() may import late
        found |= {str(f.relative_to(full)) for f in (full / pkg).rglob("*.py")}
    trimmed = tarfile.open(SHARED / "dist/fi_site.tar.xz")
    have = {m.name: m for m in trimmed.getmembers() if m.isfile()}
    add = [so]
    for f in sorted(found):
        if "__pycache__" in f or f == "flashinfer/__init__.py" or f == so:
            continue
        if f not in have or trimmed.extractfile(have[f]).read() != (full / f).read_bytes():
            add.append(f)
    dst = work / out_name
    with tarfile.open(dst, "w:xz") as t:
        for f in add:
            t.add(full / f, arcname=f)
    print(f"{len(add)} files ({so}) -> {dst} ({dst.stat().st_size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
