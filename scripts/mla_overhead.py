"""Where the memory-bound MLA decode's fixed cost goes (GPU machine): h16, bs 128, page 64 over
several kv lengths, ours (CUDA-graph replay of one run()), ours with the merge launch left out of
the captured run (the plan splits nothing, so the output is the same), and FlashInfer's MLA
wrapper, timed in turns per length; then a least-squares line time = fixed + bytes / rate per
implementation.  A fixed cost well above FlashInfer's is time no kernel speed-up recovers.

    python scripts/mla_overhead.py [kv ...]      # default 1024 4096 16384 32768
    python scripts/mla_overhead.py --once 4096   # three replays of ours only (under ncu)
    python scripts/mla_overhead.py --pages 32768  # shuffled against in-order page ids (address
                                                  # translation: the same bytes, other pages)
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch

from cute_attn import mla as ours_mla
from cute_attn.bench import peers
from cute_attn.bench.common import interleaved
from cute_attn.bench.mla import REF_TOL, MlaRun, _flashinfer_mla, latent_bytes, make_inputs, reference_error

HEADS, BS, PS = 16, 128, 64


def _no_merge(run: MlaRun, inputs, heads) -> MlaRun:
    w = run.wrapper
    st = w._state
    assert not st.plan.has_split
    w._state = dataclasses.replace(st, merge=lambda *a, **k: None)
    qn, qp, ckv, kpe = inputs[:4]
    r = MlaRun.__new__(MlaRun)
    r.wrapper, r.out = w, torch.empty_like(qn)
    r.eager = lambda: w.run(qn, qp, ckv, kpe, out=r.out)
    r.eager()
    torch.cuda.synchronize()
    r.graph, r.graph_why = peers.capture(r.eager)
    r.replay = r.graph.replay if r.graph is not None else r.eager
    return r


def _checked(mod, inputs, label: str) -> MlaRun:
    """A graph-captured MLA run of ``mod`` on h16 / page 64 (its own workspace), replayed once
    and its relative error against the fp32 reference printed."""
    r = MlaRun(mod, torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), inputs, HEADS, PS, False)
    r.replay()
    torch.cuda.synchronize()
    print(f"  {label} rel err {reference_error(inputs, r.out, 1, False):.2e}")
    return r


def page_order(kvs, fim):
    """Ours and FlashInfer on the same cache with the bench's shuffled page ids and with the
    pages in order, timed in turns."""
    for kv in kvs:
        shuffled = make_inputs([kv] * BS, 1, HEADS, PS)
        in_order = list(shuffled)
        in_order[6] = torch.arange(len(shuffled[6]), dtype=torch.int32)
        fns = {}
        for label, inputs in (("shuffled", shuffled), ("in_order", in_order)):
            for impl, mod in (("ours", ours_mla), ("flashinfer", fim)):
                if mod is not None:
                    fns[f"{impl}/{label}"] = _checked(mod, inputs, f"{impl} {label}")
        times = interleaved({k: v.replay for k, v in fns.items()}, calls=30)
        nbytes = latent_bytes([kv] * BS, PS)
        for label, t in times.items():
            print(f"kv {kv:6d} {label:<22} {t:9.1f} us {nbytes / t / 1e6:6.3f} TB/s")
        del fns, shuffled, in_order
        torch.cuda.empty_cache()


def main():
    kvs = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [1024, 4096, 16384, 32768]
    if "--pages" in sys.argv:
        fim, _ = _flashinfer_mla()
        page_order(kvs, fim)
        return
    if "--once" in sys.argv:  # for ncu: a few replays of ours at the first length
        inputs = make_inputs([kvs[0]] * BS, 1, HEADS, PS)
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        r = MlaRun(ours_mla, ws, inputs, HEADS, PS, False)
        for _ in range(3):
            r.replay()
        torch.cuda.synchronize()
        return
    fim, why = _flashinfer_mla()
    print("flashinfer.mla:", "ok" if fim else why)
    rows = {}
    for kv in kvs:
        inputs = make_inputs([kv] * BS, 1, HEADS, PS)
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        ws2 = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        ours = MlaRun(ours_mla, ws, inputs, HEADS, PS, False)
        bare = _no_merge(MlaRun(ours_mla, ws2, inputs, HEADS, PS, False), inputs, HEADS)
        fns = {"ours": ours.replay, "ours_no_merge": bare.replay}
        for label, r in (("ours", ours), ("ours_no_merge", bare)):
            r.replay()
            torch.cuda.synchronize()
            err = reference_error(inputs, r.out, 1, False)
            assert err < REF_TOL, (label, err)
        if fim is not None:
            fns["flashinfer"] = _checked(fim, inputs, "flashinfer").replay
        for fn in fns.values():
            for _ in range(3):
                fn()
        times = interleaved(fns, calls=40)
        nbytes = latent_bytes([kv] * BS, PS)
        for label, t in times.items():
            rows.setdefault(label, []).append((nbytes, t))
            print(f"kv {kv:6d} {label:<14} {t:9.1f} us {nbytes / t / 1e6:6.3f} TB/s")
        del ours, bare, fns, inputs, ws, ws2
        torch.cuda.empty_cache()
    for label, pts in rows.items():
        b = np.array([p[0] for p in pts], dtype=np.float64)
        t = np.array([p[1] for p in pts], dtype=np.float64)
        slope, fixed = np.polyfit(b, t, 1)
        print(f"fit {label:<14} fixed {fixed:6.2f} us  rate {1 / slope / 1e6:6.3f} TB/s")


if __name__ == "__main__":
    main()
