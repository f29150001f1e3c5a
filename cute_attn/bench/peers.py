"""The peer libraries timed beside ours through the same wrapper API (FlashInfer; cute_attn
mirrors its wrappers), written once and parameterized by the library.

``Lib``: a wrapper library -- its module, the record name of its numbers, and the constructor
keywords the bench gives it (FlashInfer: ``use_tensor_cores=True`` decode, its fastest for GQA;
``backend="fa3"`` prefill; ours: none).  ``flashinfer()``: FlashInfer's ``Lib`` where ``import
flashinfer`` works, else None (the reason printed once).

FlashInfer JIT-compiles a module on first use where its package holds no prebuilt one (the
GPU machine's trimmed FlashInfer has sm_90a bf16 head dims 128 / 256: fa2 decode, fa2 and fa3
batch prefill, cascade; see shared/tools/flashinfer).  Such a compile takes minutes, so every
FlashInfer call of the bench runs under ``fi_call``, which sets FlashInfer's own
``FLASHINFER_DISABLE_JIT=1`` (then a missing module raises ``MissingJITCacheError`` at once)
unless ``CUTE_ATTN_BENCH_FI_JIT=1``: those cases print ``n/a (not prebuilt)`` and record nothing.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .common import FLEX_UNFUSED

FI_JIT_ENV = "CUTE_ATTN_BENCH_FI_JIT"
NOT_PREBUILT = "n/a (not prebuilt)"
DIFFERS = "n/a (differs)"  # its output is not ours: a WARNING line says by how much
# head dims FlashInfer 0.7.2's attention kernels are written for: its JIT builds a module for
# others, but the head-dim-80 decode one it built on the H200 hit an illegal memory access,
# which leaves the process's CUDA context unusable for every case after it
FI_HEAD_DIMS = (64, 128, 256, 512)
NO_HEAD_DIM = "n/a (no such head dim)"
ATOL = RTOL = 2e-2  # a peer's output must match ours to this (allclose) before its time is recorded


@dataclass
class Lib:
    """A library with FlashInfer's wrapper API: ``mod`` is ``cute_attn`` or ``flashinfer``."""

    impl: str
    mod: Any
    decode_kw: dict = field(default_factory=dict)
    prefill_kw: dict = field(default_factory=dict)  # ragged and paged prefill (page 16)
    prefill_page1_kw: dict = field(default_factory=dict)  # paged prefill at page size 1
    ours: bool = False

    def workspace(self, mib: int = 256) -> torch.Tensor:
        # FlashInfer: "float workspace ... must be initialized to 0 for its first use"; its int
        # workspace (8 MiB + a pinned twin) each wrapper allocates itself
        return torch.zeros(mib << 20, dtype=torch.uint8, device="cuda")


def ours() -> Lib:
    import cute_attn

    return Lib("cute_attn", cute_attn, ours=True)


_FI: dict = {}


def fi_jit_allowed() -> bool:
    return os.environ.get(FI_JIT_ENV, "") not in ("", "0")


def flashinfer() -> Optional[Lib]:
    """FlashInfer as a baseline, or None where ``import flashinfer`` fails (said once)."""
    if "lib" not in _FI:
        try:
            import flashinfer as fi

            _FI["lib"] = Lib(
                "flashinfer",
                fi,
                decode_kw=dict(use_tensor_cores=True),
                prefill_kw=dict(backend="fa3"),
                prefill_page1_kw=dict(backend="fa2"),
            )
            jit = "JIT allowed" if fi_jit_allowed() else f"prebuilt modules only; {FI_JIT_ENV}=1 allows its JIT"
            print(f"baseline flashinfer {getattr(fi, '__version__', '?')} from {os.path.dirname(fi.__file__)} ({jit})")
        except Exception as e:  # ImportError, or a broken install
            _FI["lib"] = None
            print(f"baseline flashinfer: n/a (import flashinfer: {type(e).__name__}: {str(e)[:120]})")
    return _FI["lib"]


@contextlib.contextmanager
def _no_jit():
    """FlashInfer's ``FLASHINFER_DISABLE_JIT`` (read when a module is loaded) for the block,
    unless ``CUTE_ATTN_BENCH_FI_JIT=1``."""
    if fi_jit_allowed():
        yield
        return
    old = os.environ.get("FLASHINFER_DISABLE_JIT")
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASHINFER_DISABLE_JIT", None)
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = old


def why_failed(e: BaseException) -> str:
    """One line for a failed peer call: ``n/a (not prebuilt)`` for a module FlashInfer would
    have to JIT-compile, else the exception."""
    names = {c.__name__ for c in type(e).__mro__}
    if "MissingJITCacheError" in names or "FLASHINFER_DISABLE_JIT" in str(e):
        return NOT_PREBUILT
    return f"failed ({type(e).__name__}: {' '.join(str(e).split())[:160]})"


_CELLS = {NOT_PREBUILT: NOT_PREBUILT, DIFFERS: DIFFERS, FLEX_UNFUSED: "n/a (unfused)", NO_HEAD_DIM: NO_HEAD_DIM}


def column(why: str) -> str:
    """A skipped peer's table cell; a failure's reason goes on a line of its own (``say``)."""
    return _CELLS.get(why, "n/a")


def say(impl: str, why: str, where: str = "") -> None:
    """Print a skipped peer's reason (one line) unless its cell says it all."""
    if why not in _CELLS:
        print(f"  {where + ': ' if where else ''}{impl} skipped: {why}")


def fi_call(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), None)`` run with FlashInfer's JIT off (see the module doc), or
    ``(None, why)``: never raises."""
    try:
        with _no_jit():
            return fn(*args, **kwargs), None
    except Exception as e:
        return None, why_failed(e)


def capture(fn):
    """``(graph, None)``: a CUDA graph of one ``fn()`` (warm it up first), or ``(None, why)``.
    The cycle collector is off meanwhile: a wrapper it frees releases pinned memory, which a
    capture forbids."""
    g = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(g):
            fn()
        return g, None
    except Exception as e:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    finally:
        if collecting:  # the caller's setting back
            gc.enable()


def max_diff(out: torch.Tensor, ref: torch.Tensor):
    """(max |out - ref|, whether out is within ATOL + RTOL |ref| everywhere)."""
    a, b = out.float(), ref.float()
    d = (a - b).abs()
    return d.max().item(), bool((d <= ATOL + RTOL * b.abs()).all().item())


def check_output(what: str, out: torch.Tensor, ref: torch.Tensor):
    """Max abs diff of a peer's output vs ours; a peer that does not match is not a baseline:
    ``(diff, ok)``, a warning printed when not ok."""
    try:
        diff, ok = max_diff(out, ref)
    except Exception as e:
        print(f"  WARNING {what}: output not comparable ({type(e).__name__}: {str(e)[:100]}); not recorded")
        return float("nan"), False
    if not ok:
        print(
            f"  WARNING {what}: output differs from ours (max abs diff {diff:.3e}, beyond {ATOL} + {RTOL}|ref|); "
            "not recorded"
        )
    return diff, ok


class Call:
    """A planned wrapper's ``run()`` as a zero-argument callable; ``out``: the tensor it writes
    (rewritten by every call / graph replay); ``wrapper``: the planned wrapper, where known (the
    scripts that swap its kernel read it)."""

    def __init__(self, fn, out, wrapper=None):
        self.fn, self.out, self.wrapper = fn, out, wrapper

    def __call__(self):
        return self.fn()


# -- the runners, once for every library ---------------------------------------------------------


class DecodeRun:
    """A CUDA-graph-enabled ``BatchDecodeWithPagedKVCacheWrapper`` of ``lib`` (its own index
    buffers), planned, warmed up, and ``layers`` calls of its ``run()`` captured in one graph
    (an engine step of that many layers: what runs once per step -- our kept-plan update --
    runs once): ``replay`` times the graph (``eager`` where the capture failed: ``graph_why``
    says why; divide by ``layers``), ``eager`` one plain call."""

    def __init__(
        self, lib: Lib, ws, q, cache, indptr, indices, last, hq, hk, d, page_size, plan_kw=None, with_lse=None,
        layers: int = 1,
    ):  # fmt: skip
        w = lib.mod.BatchDecodeWithPagedKVCacheWrapper(
            ws,
            kv_layout="NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=indptr.cuda(),
            paged_kv_indices_buffer=indices.cuda(),
            paged_kv_last_page_len_buffer=last.cuda(),
            **lib.decode_kw,
        )
        w.plan(indptr, indices, last, hq, hk, d, page_size, q_data_type=q.dtype, **(plan_kw or {}))
        self.wrapper, self.out = w, torch.empty_like(q)
        kw = dict(out=self.out)
        # ours writes the LSE too where its records always did (the decode bench); FlashInfer not
        # (its return_lse path adds a base-conversion pass)
        want_lse = lib.ours if with_lse is None else with_lse
        if want_lse:
            kw["lse"] = torch.empty(q.shape[0], q.shape[1], device="cuda")
        self.eager = lambda: w.run(q, cache, **kw)
        self.eager()  # loads the module outside the capture
        self.layers = layers
        step = lambda: [self.eager() for _ in range(layers)]  # noqa: E731
        self.graph, self.graph_why = capture(step)
        self.replay = self.graph.replay if self.graph is not None else step


def ragged_prefill(lib: Lib, ws, lens_indptr, q, k, v, causal, d, **plan_kw) -> Call:
    """A planned ``BatchPrefillWithRaggedKVCacheWrapper`` of ``lib`` (one warm-up call done)."""
    w = lib.mod.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", **lib.prefill_kw)
    ind = lens_indptr
    w.plan(ind, ind, q.shape[1], k.shape[1], d, causal=causal, q_data_type=q.dtype, **plan_kw)
    out = torch.empty_like(q)
    kw = dict(out=out)
    if lib.ours:
        kw["lse"] = torch.empty(q.shape[0], q.shape[1], device="cuda")
    call = Call(lambda: w.run(q, k, v, **kw), out, w)
    call()
    return call


def paged_prefill(lib: Lib, ws, qo_indptr, kv_indptr, indices, last, q, cache, causal, d, page_size, **plan_kw) -> Call:
    """A planned ``BatchPrefillWithPagedKVCacheWrapper`` of ``lib`` (one warm-up call done);
    FlashInfer: its page-1 backend at page size 1."""
    ctor_kw = lib.prefill_page1_kw if page_size == 1 else lib.prefill_kw
    w = lib.mod.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", **ctor_kw)
    w.plan(
        qo_indptr,
        kv_indptr,
        indices,
        last,
        q.shape[1],
        cache[0].shape[2],
        d,
        page_size,
        causal=causal,
        q_data_type=q.dtype,
        **plan_kw,
    )
    out = torch.empty_like(q)
    kw = dict(out=out)
    if lib.ours:
        kw["lse"] = torch.empty(q.shape[0], q.shape[1], device="cuda")
    call = Call(lambda: w.run(q, cache, **kw), out, w)
    call()
    return call


class CascadeRun:
    """A CUDA-graph-enabled ``MultiLevelCascadeAttentionWrapper`` of ``lib`` (fresh copies of
    the per-level index buffers), planned, warmed up and captured; ``out`` after a replay is the
    output.  FlashInfer's ``run()`` has no ``out=``: the tensor the captured call returned."""

    def __init__(self, lib: Lib, ws, q, cache, qo, indptr, indices, last, hq, hk, d, page_size, plan_kw=None):
        bufs = [[t.cuda() for t in arr] for arr in (qo, indptr, indices, last)]
        w = lib.mod.MultiLevelCascadeAttentionWrapper(
            len(qo),
            ws,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf_arr=bufs[0],
            paged_kv_indptr_buf_arr=bufs[1],
            paged_kv_indices_buf_arr=bufs[2],
            paged_kv_last_page_len_buf_arr=bufs[3],
        )
        w.plan(qo, indptr, indices, last, hq, hk, d, page_size, q_data_type=q.dtype, **(plan_kw or {}))
        self.wrapper, self._bufs = w, bufs
        if lib.ours:
            self.out = torch.empty_like(q)
            self.eager = lambda: w.run(q, cache, out=self.out)
            self.eager()
            self.graph, why = capture(self.eager)
        else:
            self.eager = lambda: w.run(q, cache)
            self.eager()
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph):
                    self.out = w.run(q, cache)
                why = None
            except Exception as e:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                self.graph, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        self.graph_why = why
        if self.graph is not None:
            self.replay = self.graph.replay
        else:  # eager (ours writes ``out`` in place; FlashInfer's returned tensor becomes ``out``)
            self.replay = self.eager if lib.ours else self._eager_out

    def _eager_out(self):
        self.out = self.eager()
        return self.out
