"""``python -m cute_attn {compile,info,bench}``.

compile  build specializations for one or more arches into the module cache (no GPU needed;
         needs nvidia-cutlass-dsl): a preset, single specs, or a model's kernel set
         (``--model NAME_OR_CONFIG``, cute_attn/models.py).  ``--jobs`` workers at a time
         (default: the available cores), each compiling a chunk of one arch's specs (the DSL
         takes its target arch from the environment when it is imported).
info     versions, cache location and contents, CUDA runtime and GPU (if any).
bench    side-by-side benchmarks on a GPU machine (see cute_attn/bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _compile_worker(args) -> int:
    """Compile the given specs for one arch; one JSON line per spec on stdout."""
    from .families.spec import Spec
    from .runtime.build import build

    root = Path(args.out) if args.out else None
    rc = 0
    for text in args.specs:
        spec = Spec.parse(text, args.arch)
        t0 = time.perf_counter()
        try:
            entry = build(spec, root, force=args.force)
            meta = entry.meta
            rec = {
                "ok": True,
                "spec": spec.describe(),
                "seconds": round(time.perf_counter() - t0, 2),
                "size": (entry.path / "module.so").stat().st_size,
                "instructions": meta["instructions"],
                "resources": meta["resources"],
                "path": str(entry.path),
            }
        except Exception as e:  # report and go on with the other specs
            rc = 1
            rec = {"ok": False, "spec": spec.describe(), "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(rec), flush=True)
    return rc


def _cmd_compile(args) -> int:
    from .abi.archs import ARCHS
    from .families.spec import Spec
    from .presets import preset_specs

    archs = args.arch or list(ARCHS)
    per_arch = {}
    for arch in archs:
        if args.spec:
            per_arch[arch] = [Spec.parse(s, arch) for s in args.spec]
        elif args.model:
            from .models import model_specs, resolve_model, with_kv_cache_dtype

            per_arch[arch] = model_specs(with_kv_cache_dtype(resolve_model(args.model), args.kv_cache_dtype), arch)
        else:
            per_arch[arch] = preset_specs(args.preset, arch)
    if args.list:
        for arch, specs in per_arch.items():
            for s in specs:
                print(f"{arch} {s.cli()}")
        return 0
    n_jobs = args.jobs or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    # A worker process compiles for one arch (the DSL takes it from the environment at import).
    # Each arch's specs are dealt into chunks of a few dozen, and n_jobs workers take the chunks
    # as they free up: an arch with fewer specs does not leave a core idle while the other
    # finishes (a worker's start, the DSL import, costs a few seconds).
    total = sum(len(v) for v in per_arch.values())
    chunk = max(4, -(-total // (3 * n_jobs)))
    chunks = []
    for arch, specs in per_arch.items():
        texts = [s.cli() for s in specs]
        k = max(1, -(-len(texts) // chunk))
        chunks += [(arch, texts[i::k]) for i in range(k) if texts[i::k]]
    rows, failed_workers, lock, t0 = [], [], threading.Lock(), time.perf_counter()

    def run_chunk(job):
        arch, specs = job
        cmd = [sys.executable, "-m", "cute_attn", "_compile_worker", "--arch", arch]
        cmd += sum([["--spec", s] for s in specs], [])
        if args.out:
            cmd += ["--out", args.out]
        if args.force:
            cmd.append("--force")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, CUTE_DSL_ARCH=arch))
        for line in p.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            with lock:
                rows.append(rec)
                bar = "#" * (30 * len(rows) // max(total, 1))
                print(f"\r[{bar:<30}] {len(rows)}/{total} {rec['spec'][:70]:<70}", end="", file=sys.stderr, flush=True)
        if p.wait():
            failed_workers.append(arch)

    with ThreadPoolExecutor(max_workers=n_jobs) as pool:
        list(pool.map(run_chunk, chunks))
    print(file=sys.stderr)
    _print_table(rows)
    failed = [r for r in rows if not r["ok"]] or failed_workers
    print(
        f"{len(rows) - len([r for r in rows if not r['ok']])}/{total} specializations ready in "
        f"{time.perf_counter() - t0:.1f} s; cache: {args.out or _cache_root()}"
    )
    # a kernel that compiles but lacks what its family promises (ptxas serialized its wgmmas,
    # say) would run correct and slow: the build says so and fails
    lacking = _lacking(rows)
    for spec, labels in lacking:
        print(f"LACKS {', '.join(labels)}: {spec}")
    return 1 if failed or (lacking and not args.allow_lacking) or len(rows) < total else 0


def _lacking(rows) -> list:
    """(spec, [labels]) of the compiled rows whose PTX / SASS lacks a promised instruction."""
    return [
        (r["spec"], [k for k, v in r["instructions"].items() if v is False])
        for r in rows
        if r["ok"] and any(v is False for v in r["instructions"].values())
    ]


def _print_table(rows) -> None:
    print(f"{'kernel':<58} {'arch':<8} {'sec':>6} {'KB':>6} {'regs':>5} {'local':>5}  instructions")
    for r in rows:
        name, _, arch = r["spec"].rpartition("@")
        if not r["ok"]:
            print(f"{name:<58} {arch:<8} FAILED: {r['error'][:200]}")
            continue
        ins = ", ".join(f"{k} {'yes' if v else ('NO' if v is False else '?')}" for k, v in r["instructions"].items())
        res = r["resources"]
        print(
            f"{name:<58} {arch:<8} {r['seconds']:>6.2f} {r['size'] / 1024:>6.0f} {res.get('registers', '?'):>5} "
            f"{res.get('local', '?'):>5}  {ins}"
        )


def _cache_root():
    from .runtime.cache import cache_root

    return cache_root()


def _cmd_info(args) -> int:
    from . import __version__
    from .runtime.cache import installed_dsl_version

    root = _cache_root()
    print(f"cute_attn {__version__}")
    dsl = installed_dsl_version() or "not installed (kernels can run from the cache, not compile)"
    print(f"nvidia-cutlass-dsl: {dsl}")
    print(f"cache: {root}  (CUTE_ATTN_CACHE_DIR)")
    for arch_dir in sorted(root.glob("sm_*")) if root.exists() else []:
        n = len([d for d in arch_dir.iterdir() if d.is_dir() and not d.name.startswith(".")])
        print(f"  {arch_dir.name}: {n} modules")
    try:
        import torch

        if torch.cuda.is_available():
            from .runtime.arch import device_arch
            from .runtime.loader import cudart

            dev = torch.cuda.current_device()
            print(f"GPU: {torch.cuda.get_device_name(dev)} -> {device_arch(torch.device('cuda', dev))}")
            print(f"CUDA runtime: {cudart()._name}")
        else:
            print("GPU: none visible (compiling works without one)")
    except Exception as e:
        print(f"GPU: {type(e).__name__}: {e}")
    return 0


def _cmd_bench(args) -> int:
    from .bench import run_benchmarks

    return run_benchmarks(args.only, args.json, args.quick)


def main(argv=None) -> int:
    from .abi.archs import ARCHS

    ap = argparse.ArgumentParser(
        prog="python -m cute_attn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile specializations into the cache")
    c.add_argument("--arch", action="append", choices=list(ARCHS), help="repeatable; default all")
    c.add_argument("--preset", default="default", help="named set of specializations (cute_attn/presets.py)")
    c.add_argument(
        "--spec", action="append", help="one specialization, 'family:k=v,...' (repeatable; overrides --preset)"
    )
    c.add_argument("--out", help="cache directory (default $CUTE_ATTN_CACHE_DIR or ~/.cache/cute_attn)")
    c.add_argument("--force", action="store_true", help="rebuild even if cached")
    c.add_argument("--model", help="a model's kernel set: a built-in name or a config.json (cute_attn/models.py)")
    c.add_argument(
        "--kv-cache-dtype",
        help="with --model: the KV cache's dtype, vLLM's names (auto, fp8, fp8_e4m3, fp8_e5m2); default: the config's",
    )
    c.add_argument("--list", action="store_true", help="print the specializations, one per line, and stop")
    c.add_argument(
        "--allow-lacking",
        action="store_true",
        help="exit 0 even where a kernel lacks an instruction its family promises (still printed as LACKS)",
    )
    c.add_argument("--jobs", "-j", type=int, default=0, help="worker processes in all (default: available cores)")
    w = sub.add_parser("_compile_worker")
    w.add_argument("--arch", required=True)
    w.add_argument("--spec", dest="specs", action="append", default=[])
    w.add_argument("--out")
    w.add_argument("--force", action="store_true")
    sub.add_parser("info", help="versions, cache, GPU")
    b = sub.add_parser("bench", help="benchmarks on a GPU machine")
    b.add_argument("--only", action="append", help="benchmark group(s) to run (default all)")
    b.add_argument("--json", help="merge records into this results.json")
    b.add_argument("--quick", action="store_true", help="fewer sizes / repetitions")
    args = ap.parse_args(argv)
    return {"compile": _cmd_compile, "_compile_worker": _compile_worker, "info": _cmd_info, "bench": _cmd_bench}[
        args.cmd
    ](args)


if __name__ == "__main__":
    sys.exit(main())
