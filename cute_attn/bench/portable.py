"""The portable prefill (``kernels/prefill_mma.py``: mma.sync + cp.async, what Blackwell runs
until a tcgen05 kernel exists) against our Hopper wgmma prefill on the same inputs, with
FlashInfer's fa2 prefill (its mma.sync kernel) beside them where importable.  bf16.

Each case plans one wrapper per kernel (``plan(prefill_backend=...)``), checks the portable
output against the wgmma one, and times all of them one call at a time in turns (CUDA events per
call, medians: ``common.interleaved``; the H200's clocks drift by up to ~15 % within seconds).

Cases (records as docs/design.md §10; the portable rows under ``prefill_mma/<case>``, the wgmma
kernel's of the same turns under ``prefill_mma/<case>/wgmma``; ``ratio`` under ``cute_attn`` on a
portable row = its time over the wgmma kernel's, under ``flashinfer`` = FlashInfer's time over
the portable kernel's):

* ``prefill_mma/hd128/gqa4/q{4,8,16}/bs64/kv4096/page{16,1}``: 64 requests of 4096 kv
  tokens, 4 / 8 / 16 query tokens each (causal, bottom-right: speculative verification and short
  appends), 32 / 8 heads, pages in random order; ``TB/s`` = K and V bytes (64 x 4096 x 8 x 128 x
  2 x 2) over the time -- the 4-token batch is bandwidth-bound;
* ``prefill_mma/hd128/causal/s8192``: 2 x 8192 causal, ragged, 16 heads (no GQA), the
  planner's 128-row tile; ``TFLOP/s`` = 4·h·d·s²/2 per request; ``prefill_mma/.../tile64``:
  the 64-row tile (16-row warps) on the same batch, its output checked as the default's.

The sm_100a build of the same code has never run on Blackwell hardware (we have none): these
are Hopper figures of the code Blackwell would get.
"""

from __future__ import annotations

import contextlib

import torch

from . import peers
from .common import interleaved
from .decode import paged_cache

HQ, HK, D = 32, 8, 128
BS, KV = 64, 4096
WGMMA, MMA = "prefill_sm90", "prefill_mma_sync"


def _close(name, out, ref) -> bool:
    diff, ok = peers.max_diff(out, ref)
    print(f"  {name}: max |diff| vs wgmma {diff:.3e}{'' if ok else '  MISMATCH'}")
    return ok


def _paged_case(res, fi, qlen, page_size, gen):
    case = f"hd{D}/gqa{HQ // HK}/q{qlen}/bs{BS}/kv{KV}/page{page_size}"
    cache, indptr, indices, last = paged_cache([KV] * BS, page_size, gen)
    qo = torch.arange(BS + 1, dtype=torch.int32) * qlen
    q = torch.randn(BS * qlen, HQ, D, device="cuda", dtype=torch.bfloat16)
    run = {}
    for name, be in (("wgmma", WGMMA), ("mma", MMA)):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        run[name] = peers.paged_prefill(
            peers.ours(), ws, qo, indptr, indices, last, q, cache, True, D, page_size, prefill_backend=be
        )
    ok = _close(f"prefill_mma/{case}", run["mma"].out, run["wgmma"].out)
    fns = {"wgmma": run["wgmma"], "mma": run["mma"]}
    fi_why = _fa2(fi, fns, case, run["wgmma"].out, peers.paged_prefill, qo, indptr, indices, last, q, cache, True, D,
                  page_size)  # fmt: skip
    med = interleaved(fns)
    kv_bytes = BS * KV * HK * D * 2 * 2
    tw, tm = med["wgmma"], med["mma"]
    res.add(f"prefill_mma/{case}/wgmma", "cute_attn", "us", tw)
    res.add(f"prefill_mma/{case}/wgmma", "cute_attn", "TB/s", kv_bytes / tw / 1e6)
    if ok:
        res.add(f"prefill_mma/{case}", "cute_attn", "us", tm)
        res.add(f"prefill_mma/{case}", "cute_attn", "TB/s", kv_bytes / tm / 1e6)
        res.add(f"prefill_mma/{case}", "cute_attn", "ratio", tm / tw)
    fi_txt = f"fa2 {peers.column(fi_why)}" if "fi" not in med else f"fa2 {med['fi']:.1f} us"
    if "fi" in med:
        res.add(f"prefill_mma/{case}", "flashinfer", "us", med["fi"])
        res.add(f"prefill_mma/{case}", "flashinfer", "ratio", med["fi"] / tm)
    print(
        f"{case:<40} wgmma {tw:8.1f} us {kv_bytes / tw / 1e6:5.2f} TB/s | portable {tm:8.1f} us "
        f"{kv_bytes / tm / 1e6:5.2f} TB/s ({tm / tw:.3f}x) | {fi_txt}"
    )


def _fa2(fi, fns, case, ref, runner, *args):
    """FlashInfer's fa2 prefill (``runner``: ``peers.paged_prefill`` / ``ragged_prefill`` on
    ``args`` after the workspace) into ``fns["fi"]`` where it runs and matches ``ref``; else why
    not (None: it is in ``fns``)."""
    if fi is None:
        return "n/a (no flashinfer)"
    lib = peers.Lib(fi.impl, fi.mod, prefill_kw=dict(backend="fa2"), prefill_page1_kw=dict(backend="fa2"))
    call, why = peers.fi_call(runner, lib, fi.workspace(256), *args)
    if call is None:
        return why
    if not peers.check_output(f"flashinfer fa2 {case}", call.out, ref)[1]:
        return peers.DIFFERS
    fns["fi"] = call
    return None


@contextlib.contextmanager
def tile_rule(tile: int):
    """plan() inside picks ``tile`` packed rows per query tile (the planner's rule replaced)."""
    import cute_attn.wrappers.prefill_base as P

    rule = P.choose_cta_tile_q
    P.choose_cta_tile_q = lambda *a: tile
    try:
        yield
    finally:
        P.choose_cta_tile_q = rule


def _prefill_case(res, fi, gen):
    B, H, S = 2, 16, 8192
    case = f"hd{D}/causal/s{S}"
    q = torch.randn(B * S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    ind = torch.arange(B + 1, dtype=torch.int32) * S
    run = {}
    for name, be in (("wgmma", WGMMA), ("mma", MMA)):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        run[name] = peers.ragged_prefill(peers.ours(), ws, ind, q, k, v, True, D, prefill_backend=be)
    ok = _close(f"prefill_mma/{case}", run["mma"].out, run["wgmma"].out)
    fns = dict(run)
    # the 64-row tile (4 warps of 16 rows) on the same batch: what the planner's 128-row tile gains
    ws2 = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    with tile_rule(64):
        run64 = peers.ragged_prefill(peers.ours(), ws2, ind, q, k, v, True, D, prefill_backend=MMA)
    if _close(f"prefill_mma/{case}/tile64", run64.out, run["wgmma"].out):
        fns["tile64"] = run64
    fi_why = _fa2(fi, fns, case, run["wgmma"].out, peers.ragged_prefill, ind, q, k, v, True, D)
    med = interleaved(fns, calls=15)
    flops = B * 4.0 * H * D * S * S * 0.5
    tw, tm = med["wgmma"], med["mma"]
    res.add(f"prefill_mma/{case}/wgmma", "cute_attn", "us", tw)
    res.add(f"prefill_mma/{case}/wgmma", "cute_attn", "TFLOP/s", flops / tw / 1e6)
    line = f"{case:<40} wgmma {tw:8.1f} us {flops / tw / 1e6:5.0f} TFLOP/s"
    if ok:
        res.add(f"prefill_mma/{case}", "cute_attn", "us", tm)
        res.add(f"prefill_mma/{case}", "cute_attn", "TFLOP/s", flops / tm / 1e6)
        res.add(f"prefill_mma/{case}", "cute_attn", "ratio", tm / tw)
        line += f" | portable {tm:8.1f} us {flops / tm / 1e6:5.0f} TFLOP/s ({tm / tw:.3f}x)"
    if "tile64" in med:
        tk = med["tile64"]
        res.add(f"prefill_mma/{case}/tile64", "cute_attn", "us", tk)
        res.add(f"prefill_mma/{case}/tile64", "cute_attn", "TFLOP/s", flops / tk / 1e6)
        res.add(f"prefill_mma/{case}/tile64", "cute_attn", "ratio", tk / tw)
        line += f" | tile 64 {tk:8.1f} us ({tk / tw:.3f}x)"
    if "fi" in med:
        res.add(f"prefill_mma/{case}", "flashinfer", "us", med["fi"])
        res.add(f"prefill_mma/{case}", "flashinfer", "ratio", med["fi"] / tm)
        line += f" | fa2 {med['fi']:8.1f} us"
    else:
        line += f" | fa2 {peers.column(fi_why)}"
    print(line)


def bench_portable(res, quick: bool) -> None:
    fi = peers.flashinfer()
    gen = torch.Generator().manual_seed(0)
    print("portable prefill (mma.sync) vs our wgmma prefill, bf16, timed in turns")
    for qlen, ps in ((4, 16), (4, 1)) if quick else ((4, 16), (4, 1), (8, 16), (16, 16)):
        _paged_case(res, fi, qlen, ps, gen)
    _prefill_case(res, fi, gen)
