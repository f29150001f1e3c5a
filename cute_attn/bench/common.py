"""Timing and result records shared by the benchmarks (GPU machines only)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import warnings
from pathlib import Path


def do_bench(fn, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of ``fn`` in microseconds, CUDA events via triton.testing.do_bench."""
    from triton.testing import do_bench as tdb

    return tdb(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def interleaved(fns: dict, calls: int = 25) -> dict:
    """Median time (us) of one call of each fn, the calls taken in turns (a, b, c, a, b, c, ...)
    and each bracketed by CUDA events: the H200's clocks drift by up to ~15 % over seconds (boost
    at first, lower under sustained load), and turns give every fn the same drift."""
    import torch

    for fn in fns.values():
        fn()
    events = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events[name].append((a, b))
    torch.cuda.synchronize()
    out = {}
    for name, ev in events.items():
        ts = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
        out[name] = ts[len(ts) // 2]
    return out


def cudnn_time(q, k, v) -> float | None:
    """Median time (us) of SDPA pinned to cuDNN on q / k / v ``[batch, heads, seq, dim]`` (GQA
    allowed), or None (printed why) where cuDNN does not take the case."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            f(q, k, v, enable_gqa=True)
            return do_bench(lambda: f(q, k, v, enable_gqa=True))
    except Exception as e:  # pragma: no cover
        print(f"  cudnn failed: {type(e).__name__}: {str(e)[:200]}")
        return None


FLEX_UNFUSED = "n/a (unfused fallback)"


def compiled_flex():
    """A freshly compiled ``flex_attention`` for one shape: dynamo's caches reset first and its
    recompile limit raised.  One compiled object reused across shapes / score mods passes
    dynamo's recompile limit (8) and then silently runs the unfused eager path (70x slower):
    those numbers are not FlexAttention's speed.  Raises ImportError without FlexAttention."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if isinstance(getattr(cfg, name, None), int):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):  # an error, not a silent eager fallback
        cfg.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention)


def _rearm_flex_warning() -> None:
    """flex_attention warns "... unfused implementation ..." once per process (and marks the
    warning as shown while it is being compiled, without warning): forget that it was shown."""
    try:
        import torch.nn.attention.flex_attention as fa_mod
    except ImportError:
        return
    shown = getattr(fa_mod, "_WARNINGS_SHOWN", None)
    if isinstance(shown, set):
        shown.clear()


def _unfused(caught) -> bool:
    return any("unfused" in str(w.message) for w in caught)


def flex_bench(call, timer=None):
    """Time FlexAttention freshly compiled for this shape: ``call(fa)`` makes one call of the
    compiled ``fa`` and returns its output.  ``(time_us, first output, None)``, or ``(None, None,
    why)``: ``"n/a (unfused fallback)"`` where flex_attention warned that it ran unfused (not
    compiled), ``"n/a (...)"`` for a compile error or no FlexAttention.  Never raises."""
    import torch

    timer = timer or do_bench
    if os.environ.get("CUTE_ATTN_BENCH_NO_FLEX"):  # a short visit: skip the compiles (~10-30 s each)
        return None, None, "n/a (CUTE_ATTN_BENCH_NO_FLEX)"
    try:
        fa = compiled_flex()
    except Exception as e:
        return None, None, f"n/a (no FlexAttention: {type(e).__name__}: {str(e)[:100]})"
    try:
        _rearm_flex_warning()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call(fa)
            torch.cuda.synchronize()
    except Exception as e:
        return None, None, f"n/a (compile error: {type(e).__name__}: {' '.join(str(e).split())[:120]})"
    if _unfused(caught):
        return None, None, FLEX_UNFUSED
    try:
        _rearm_flex_warning()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = timer(lambda: call(fa))
        if _unfused(caught):
            return None, None, FLEX_UNFUSED
        return t, out, None
    except Exception as e:
        return None, None, f"n/a (failed: {type(e).__name__}: {' '.join(str(e).split())[:120]})"


def commit() -> str:
    """The commit measured: $CUTE_ATTN_COMMIT when set (a snapshot run from another checkout,
    e.g. on the GPU machine, would otherwise report that checkout's HEAD), else git's HEAD."""
    if os.environ.get("CUTE_ATTN_COMMIT"):
        return os.environ["CUTE_ATTN_COMMIT"]
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else os.environ.get("CUTE_ATTN_COMMIT", "unknown")
    except OSError:
        return os.environ.get("CUTE_ATTN_COMMIT", "unknown")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class Results:
    """Collects {"case","impl","metric","value","device","commit","date"} records (docs/design.md §10)."""

    def __init__(self):
        self.records: list = []
        self.device, self.commit = device_name(), commit()
        self.date = datetime.date.today().isoformat()

    def add(self, case: str, impl: str, metric: str, value: float) -> None:
        self.records.append(
            {
                "case": case,
                "impl": impl,
                "metric": metric,
                "value": round(float(value), 4),
                "device": self.device,
                "commit": self.commit,
                "date": self.date,
            }
        )

    def merge_into(self, path: str) -> None:
        """The latest run of a (case, impl, metric) on a device replaces that device's older
        record; another device's stays (an H100 run must not erase the H200 figures the issues'
        bars are stated for)."""
        p = Path(path)
        old = json.loads(p.read_text()) if p.exists() else []
        key = lambda r: (r["case"], r["impl"], r["metric"], r.get("device", ""))  # noqa: E731
        new_keys = {key(r) for r in self.records}
        merged = [r for r in old if key(r) not in new_keys] + self.records
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(sorted(merged, key=key), indent=1) + "\n")


@contextlib.contextmanager
def decode_balance_tol(row_bytes: int, tol):
    """The decode planner's balance tolerance for caches of ``row_bytes``-byte kv rows set to
    ``tol`` while the block runs (None: left as it is) -- for the A/B scripts, around a plan()."""
    from ..families.backends import backend_for

    over = backend_for("decode", "sm_90a").planner_by_row_bytes
    saved = dict(over)
    if tol is not None:
        over[row_bytes] = {**over.get(row_bytes, {}), "balance_tol": tol}
    try:
        yield
    finally:
        over.clear()
        over.update(saved)
