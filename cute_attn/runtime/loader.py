"""Load cached kernel modules with ``ctypes`` and launch them on the current torch stream.

Only the CUDA runtime is needed (``libcudart.so.13``): the one PyTorch ships in its
``nvidia-*`` wheels is enough, or a CUDA toolkit's; ``$CUTE_ATTN_CUDART`` overrides the
search.  It is opened with ``RTLD_GLOBAL`` before any module, so the runtime symbols that a
module leaves undefined resolve against it.

The launch path is kept short because ``run()`` is called every decode step: one
``struct.pack_into`` of all arguments into a per-thread buffer whose pointer array was built
once, then one ctypes call.  ``cute_attn/bench/launch.py`` measures it.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

from ..abi.args import TensorArg, abi_from_json
from ..families.spec import Spec
from .cache import cache_root, lookup
from .header import args_format

_CUDART = None
_CUDART_LOCK = threading.Lock()
_LOCK = threading.Lock()  # guards _MODULES


class KernelNotAvailable(RuntimeError):
    """A specialization is neither cached nor compilable here."""


class LaunchError(RuntimeError):
    pass


def _cudart_candidates() -> list:
    env = os.environ.get("CUTE_ATTN_CUDART")
    if env:
        return [env]
    cands = []
    # Already mapped into this process (e.g. by torch): reuse that exact file.
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "libcudart.so.13" in os.path.basename(p):
                    cands.append(p)
    except OSError:
        pass
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "cu13", "lib", "libcudart.so.13*")))
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so.13*")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += sorted(glob.glob(os.path.join(home, "lib*", "libcudart.so.13*")))
    cands.append("libcudart.so.13")  # whatever the dynamic loader finds
    return cands


def cudart() -> ctypes.CDLL:
    """The CUDA runtime, opened RTLD_GLOBAL once per process."""
    global _CUDART
    if _CUDART is None:
        with _CUDART_LOCK:
            if _CUDART is None:
                errors = []
                for c in _cudart_candidates():
                    try:
                        _CUDART = ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
                        _CUDART.cudaGetErrorString.restype = ctypes.c_char_p
                        break
                    except OSError as e:
                        errors.append(f"{c}: {e}")
                else:
                    raise KernelNotAvailable(
                        "libcudart.so.13 (CUDA 13 runtime) not found; install PyTorch's CUDA build or a CUDA 13 "
                        "toolkit, or set CUTE_ATTN_CUDART to its path. Tried: " + "; ".join(errors)
                    )
    return _CUDART


def cuda_error_string(code: int) -> str:
    return cudart().cudaGetErrorString(code).decode()


class Module:
    """One loaded kernel module.  ``launch(values, stream)`` takes the flattened argument values."""

    def __init__(self, spec: Spec, path: Path, meta: dict):
        self.spec, self.path, self.meta = spec, path, meta
        self.args = abi_from_json(meta["abi"])
        rt = cudart()
        self._lib = ctypes.CDLL(str(path / "module.so"), mode=ctypes.RTLD_LOCAL)
        sym = meta["symbols"]
        self._launch = getattr(self._lib, sym["launch"])
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32]
        self._launch.restype = None
        self._nargs = sym["num_args"]
        fmt, offsets = args_format(self.args)
        self._struct = struct.Struct(fmt)
        self._offsets = offsets
        self._tls = threading.local()
        # Load the cubin into the CUDA library and onto every device (outside graph capture).
        lib_handle = ctypes.c_void_p()
        lib_ptr = ctypes.pointer(lib_handle)
        ret = ctypes.c_int32(0)
        init_args = (ctypes.c_void_p * 2)(ctypes.addressof(lib_ptr), ctypes.addressof(ret))
        getattr(self._lib, sym["init"])(init_args)
        self._check(ret.value, "module init")
        ndev = ctypes.c_int32(0)
        self._check(rt.cudaGetDeviceCount(ctypes.byref(ndev)), "cudaGetDeviceCount")
        dev = ctypes.c_int32(0)
        load_args = (ctypes.c_void_p * 3)(ctypes.addressof(lib_ptr), ctypes.addressof(dev), ctypes.addressof(ret))
        for i in range(ndev.value):
            dev.value = i
            getattr(self._lib, sym["load"])(load_args)
            self._check(ret.value, f"module load on device {i}")
        self._library = lib_handle  # keep alive

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            # the runtime keeps the code as the thread's last error, which torch would read after
            # its next launch and report as its own: the error is this raise's
            cudart().cudaGetLastError()
            raise LaunchError(f"{self.spec.describe()}: {what} failed: CUDA error {code} ({cuda_error_string(code)})")

    def _buffers(self):
        """This thread's argument buffer, pointer array and return slot (made once per thread)."""
        tls = self._tls
        buf = getattr(tls, "buf", None)
        if buf is None:
            buf = tls.buf = ctypes.create_string_buffer(self._struct.size)
            base = ctypes.addressof(buf)
            tls.ptrs = (ctypes.c_void_p * self._nargs)(*[base + o for o in self._offsets])
            tls.ret = ctypes.c_int32.from_buffer(buf, self._offsets[-1])
        return buf, tls.ptrs, tls.ret

    def launch(self, values: Sequence, stream: int) -> None:
        """``values``: the flattened struct fields of every argument, in ABI order."""
        buf, ptrs, ret = self._buffers()
        self._struct.pack_into(buf, 0, *values, stream, 0)
        self._launch(ptrs, self._nargs)
        if ret.value:
            self._check(ret.value, "launch")

    def __call__(self, *values, stream: Optional[int] = None) -> None:
        """Launch with torch tensors / Python scalars in ABI order, on the current stream of
        the first tensor's device unless ``stream`` (a raw ``cudaStream_t``) is given.
        (``launch`` inlined: this is the per-launch hot path.)"""
        flat = self._pack(*values)
        if stream is None:
            stream = current_stream(values[0].get_device())
        buf, ptrs, ret = self._buffers()
        self._struct.pack_into(buf, 0, *flat, stream, 0)
        self._launch(ptrs, self._nargs)
        if ret.value:
            self._check(ret.value, "launch")

    @functools.cached_property
    def _pack(self):
        return make_packer(self.args)


def current_stream(device_index: int) -> int:
    """Raw ``cudaStream_t`` of torch's current stream on a device."""
    return _raw_stream()(device_index)


@functools.lru_cache(maxsize=1)
def _raw_stream() -> Callable[[int], int]:
    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch
    return fast if fast is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)


def make_packer(args: Sequence) -> Callable:
    """Generate ``pack(*values) -> tuple`` that flattens tensors/scalars for ``Module.launch``.

    It is specialized to the ABI (no loops, no per-mode branching at run time) because it runs
    on every launch; the checks are the same as :func:`tensor_fields`, which is called on a
    failed check to produce the detailed error.
    """
    lines, out = [], []
    for i, a in enumerate(args):
        v = f"v{i}"
        if not isinstance(a, TensorArg):
            out.append(v)
            continue
        lines.append(f"sh{i} = {v}.shape; st{i} = {v}.stride(); p{i} = {v}.data_ptr()")
        bad = [f"len(sh{i}) != {len(a.shape)}"]
        for k, e in enumerate(a.shape):
            if e is not None:
                bad.append(f"sh{i}[{k}] != {e}")
        for k, e in enumerate(a.stride):
            if e is not None:
                bad.append(f"(st{i}[{k}] != {e} and sh{i}[{k}] != 1)")
            elif a.stride_divisibility > 1:
                bad.append(f"st{i}[{k}] % {a.stride_divisibility}")
        if a.align > 1:
            bad.append(f"p{i} % {a.align}")
        lines.append(f"if {' or '.join(bad)}: _slow(args[{i}], {v})")
        out += [f"p{i}"] + [f"sh{i}[{k}]" for k in a.dyn_shape_modes] + [f"st{i}[{k}]" for k in a.dyn_stride_modes]
    params = ", ".join(f"v{i}" for i in range(len(args)))
    src = f"def pack({params}):\n" + "".join(f"    {ln}\n" for ln in lines) + f"    return ({', '.join(out)},)\n"
    scope = {"args": list(args), "_slow": tensor_fields}
    exec(compile(src, "<cute_attn packer>", "exec"), scope)
    return scope["pack"]


def tensor_fields(arg: TensorArg, t) -> list:
    """[data_ptr, dynamic extents..., dynamic strides...] of ``t``, checked against the ABI.

    The kernel was compiled assuming the static extents/strides, the stride divisibility and
    the pointer alignment of ``arg``; a tensor that breaks one would be read wrongly, so it is
    rejected here (the public ops give friendlier errors first).
    """
    shape, stride, ptr = t.shape, t.stride(), t.data_ptr()
    if len(shape) != len(arg.shape):
        raise LaunchError(f"{arg.name}: expected {len(arg.shape)} dims, got shape {tuple(shape)}")
    out = [ptr]
    for i, (want, got) in enumerate(zip(arg.shape, shape)):
        if want is None:
            out.append(got)
        elif want != got:
            raise LaunchError(f"{arg.name}: dim {i} must be {want}, got shape {tuple(shape)}")
    for i, (want, got) in enumerate(zip(arg.stride, stride)):
        if want is None:
            if got % arg.stride_divisibility:
                raise LaunchError(f"{arg.name}: stride {i} ({got}) must be a multiple of {arg.stride_divisibility}")
            out.append(got)
        elif want != got and shape[i] != 1:
            raise LaunchError(f"{arg.name}: stride {i} must be {want}, got strides {tuple(stride)}")
    if ptr % arg.align:
        raise LaunchError(f"{arg.name}: data pointer must be {arg.align}-byte aligned")
    return out


_MODULES: Dict[str, Module] = {}


def get_module(spec: Spec, root: Optional[Path] = None) -> Module:
    """Memory cache -> disk cache -> compile (when the DSL is installed) -> load."""
    mod = _MODULES.get(spec.key)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _MODULES.get(spec.key)
        if mod is not None:
            return mod
        found = lookup(spec, root)
        if found.meta is None:
            from .build import build, dsl_available

            if not dsl_available():
                where = root or cache_root()
                raise KernelNotAvailable(
                    f"kernel {spec.describe()} is not in the cache at {where} ({found.problem}) and the CuTe DSL "
                    f"is not installed here to compile it. Build it on any machine with nvidia-cutlass-dsl "
                    f"(no GPU needed): python -m cute_attn compile --arch {spec.arch} --spec '{spec.cli()}' "
                    f"--out DIR (or a model's whole kernel set: compile --model NAME_OR_CONFIG_JSON --out "
                    f"DIR), then point CUTE_ATTN_CACHE_DIR at DIR."
                )
            found = build(spec, root)
        mod = Module(spec, found.path, found.meta)
        _MODULES[spec.key] = mod
        return mod


_BY_PARAMS: Dict[tuple, Module] = {}


def kernel(family: str, arch: str, **params) -> Module:
    """``get_module(Spec.make(family, arch, **params))``, a dict lookup after the first call
    (the ops call this on every plan; names are part of the lookup key, so two call sites that
    pass the same values under other names never share a module)."""
    key = (family, arch, *params.items())
    mod = _BY_PARAMS.get(key)
    if mod is None:
        mod = _BY_PARAMS[key] = get_module(Spec.make(family, arch, **params))
    return mod
