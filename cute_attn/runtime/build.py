"""Compile one specialization with the CuTe DSL, export it, link it into ``module.so``.

No GPU is touched: the target arch comes from the spec (``--gpu-arch``, and
``CUTE_DSL_ARCH`` for the DSL's trace-time checks), the arguments are fake tensors built
from the family's ABI.  The result only needs the CUDA runtime to run (see ``loader.py``):
the exported object is linked with the DSL's static ``libcuda_dialect_runtime_static.a``,
and the CUDA runtime symbols it calls are left undefined, to be resolved against the
``libcudart.so.13`` that the loader puts in the global namespace first.  So linking needs
only a C compiler — no CUDA toolkit.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..abi.args import ScalarArg, abi_to_json
from ..abi.dtypes import to_dsl
from ..families.base import get_family
from ..families.spec import Spec
from . import header
from .cache import installed_dsl_version, key_lock, lookup, publish


class BuildError(RuntimeError):
    pass


def dsl_available() -> bool:
    return installed_dsl_version() is not None


def _import_dsl(arch: str):
    # The DSL reads CUTE_DSL_ARCH when it is imported; a process compiles for one arch family
    # at a time in practice (the CLI uses one worker process per arch).
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    import cutlass  # noqa: F401
    import cutlass.cute as cute

    return cute


def _runtime_archive() -> Path:
    from cutlass.cute.export.aot_config import get_libdir

    libdir = get_libdir()
    for cand in (
        Path(libdir) / "libcuda_dialect_runtime_static.a",
        Path(libdir).parent.parent / "cu13" / "lib" / "libcuda_dialect_runtime_static.a",
    ):
        if cand.exists():
            return cand
    raise BuildError(
        f"libcuda_dialect_runtime_static.a not found near {libdir}; is nvidia-cutlass-dsl[cu13] installed?"
    )


def find_tool(name: str) -> Optional[str]:
    """cuobjdump/nvdisasm: on PATH, in the CUDA toolkit, or from the nvidia-cuda-* wheels."""
    hit = shutil.which(name)
    if hit:
        return hit
    cands = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / name]
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for base in nvidia.__path__:
            cands += sorted(Path(base).glob(f"cu*/bin/{name}"))
    except ImportError:
        pass
    for c in cands:
        if c.exists():
            return str(c)
    return None


def disassemble(cubin: Path) -> tuple[Optional[str], Optional[str]]:
    """(SASS text, resource usage text) via cuobjdump, or (None, None) when it is not installed."""
    tool = find_tool("cuobjdump")
    if tool is None:
        return None, None
    env = dict(os.environ)
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm:
        env["PATH"] = str(Path(nvdisasm).parent) + os.pathsep + env.get("PATH", "")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, env=env)
    return (sass.stdout if sass.returncode == 0 else None), (res.stdout if res.returncode == 0 else None)


def check_instructions(expect: dict, ptx: str, sass: Optional[str]) -> dict:
    """{label: True/False/None}; None when the SASS was needed but no disassembler is installed.
    A pattern is ``ptx:REGEX`` / ``sass:REGEX`` (must match), ``sass!REGEX`` (must not match) or
    ``sass%A/B>=R`` (at least R matches of regex A per match of regex B)."""
    found = {}
    for label, pattern in expect.items():
        ratio = pattern.startswith("sass%")  # "sass%A/B>=r": count(A) >= r * count(B), e.g. wgmma per batch
        absent = pattern.startswith("sass!")
        if ratio or absent:
            where, sep, rx = "sass", pattern[4], pattern[len("sass%") :]
        else:
            where, sep, rx = pattern.partition(":")
        if where not in ("ptx", "sass") or not sep:
            raise ValueError(
                f"instruction pattern {label!r}: {pattern!r} is not ptx:REGEX, sass:REGEX, sass!REGEX or sass%A/B>=R"
            )
        text = ptx if where == "ptx" else sass
        if text is None:
            found[label] = None
        elif ratio:
            num, _, rest = rx.partition("/")
            den, _, r_min = rest.partition(">=")
            n_den = len(re.findall(den, text))  # none at all: nothing was checked, not a pass
            found[label] = n_den > 0 and len(re.findall(num, text)) >= float(r_min) * n_den
        elif absent:
            found[label] = re.search(rx, text) is None
        else:
            found[label] = bool(re.search(rx, text))
    return found


def parse_resources(res: Optional[str]) -> dict:
    """Registers / shared / local bytes of the first kernel in ``cuobjdump -res-usage`` output."""
    if not res:
        return {}
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return {} if not m else dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups())))


def _fake_args(cute, args):
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor

    fakes = []
    for a in args:
        if isinstance(a, ScalarArg):
            fakes.append(cutlass.Int32(0) if a.dtype == "i32" else cutlass.Float32(0.0))
            continue
        shape = tuple(cute.sym_int() if s is None else s for s in a.shape)
        # 64-bit strides: the exported header always declares int64_t strides, and the host
        # code copies the struct as the fake tensor's stride width says — the two must agree
        # (32-bit sym_int strides are silently read as int32 pairs).  KV caches need 64 bits anyway.
        stride = tuple(cute.sym_int(64, divisibility=a.stride_divisibility) if s is None else s for s in a.stride)
        fakes.append(make_fake_tensor(to_dsl(a.dtype), shape, stride, assumed_align=a.align))
    return fakes


def compile_into(spec: Spec, out: Path) -> dict:
    """Compile ``spec`` and write module.so + kernel.{h,ptx,cubin[,sass]} into ``out``; return metadata."""
    family = get_family(spec.family)
    cute = _import_dsl(spec.arch)
    from cutlass.cute.runtime import make_fake_stream

    args = list(family.abi(spec.pdict))
    jit_fn = family.load_builder()(spec)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:  # --keep-* also writes files into the dump dir
        compiled = cute.compile(
            jit_fn,
            *_fake_args(cute, args),
            make_fake_stream(),
            options=f"--gpu-arch {spec.arch} --keep-ptx --keep-cubin --dump-dir {shlex.quote(dump)}",
        )
    compile_s = time.perf_counter() - t0

    prefix = "ca_" + re.sub(r"\W", "_", spec.key)
    compiled.export_to_c(file_path=str(out), file_name="kernel", function_prefix=prefix)
    header_text = (out / "kernel.h").read_text()
    habi = header.parse_header(header_text)
    header.check_header(habi, args, spec.family)
    ptx = compiled.artifacts.PTX
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    (out / "kernel.ptx").write_text(ptx)
    (out / "kernel.cubin").write_bytes(compiled.artifacts.CUBIN)

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError("no C compiler (gcc/cc, or $CC) to link the kernel module")
    link = subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(out / "module.so"), str(out / "kernel.o"), str(_runtime_archive())],
        capture_output=True,
        text=True,
    )
    if link.returncode != 0:
        raise BuildError(f"linking {spec.describe()} failed:\n{link.stderr}")
    (out / "kernel.o").unlink()
    link_s = time.perf_counter() - t0 - compile_s

    sass, res = disassemble(out / "kernel.cubin")
    if sass is not None:
        (out / "kernel.sass").write_text(sass)
    return {
        "spec": {"family": spec.family, "arch": spec.arch, "params": dict(spec.params)},
        "describe": spec.describe(),
        "dsl_version": installed_dsl_version(),
        "abi": abi_to_json(args),
        "symbols": {
            "init": habi.init_symbol,
            "load": habi.load_symbol,
            "launch": habi.launch_symbol,
            "num_args": habi.num_args,
        },
        "compile_seconds": round(compile_s, 3),
        "link_seconds": round(link_s, 3),
        "instructions": check_instructions(family.expect_for(spec.arch, spec.pdict), ptx, sass),
        "known_gaps": family.known_gaps(spec.pdict),
        "resources": parse_resources(res),
    }


def build(spec: Spec, root: Optional[Path] = None, force: bool = False):
    """Return a valid cache entry for ``spec``, compiling it unless a valid one exists."""
    if not dsl_available():
        raise BuildError(f"cannot compile {spec.describe()}: nvidia-cutlass-dsl is not installed")
    with key_lock(spec, root):
        found = lookup(spec, root)
        if found.meta is not None and not force:
            return found
        return publish(spec, lambda tmp: compile_into(spec, tmp), root)
