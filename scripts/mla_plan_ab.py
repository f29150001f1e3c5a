"""MLA decode under other planner settings, timed in turns with the default (GPU machine).

    python scripts/mla_plan_ab.py [--kv 4096 32768] [--batch 128] [--heads 16]

Each variant is its own CUDA-graph wrapper (own workspace) on the same inputs, its output
checked against the fp32 reference on the first requests; one replay each in turns
(``bench.common.interleaved``).  Prints time, TB/s of latent bytes, items and merges."""

import argparse
import dataclasses

import torch

import cute_attn.wrappers.mla as wm
from cute_attn import mla
from cute_attn.bench.common import interleaved
from cute_attn.bench.mla import MlaRun, latent_bytes, make_inputs, reference_error

# the default (balance_tol 0.05) leaves bs128 x 4k / 32k unsplit on 132 CTAs (128 busy); at 0.01
# the planner splits them (4k: 250 items, 122 merges, the same modelled makespan; 32k: 256 / 128,
# 2.5 % lower)
VARIANTS = {"default": {}, "tol0.01": {"balance_tol": 0.01}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--page", type=int, default=64)
    a = ap.parse_args()
    base_for = wm.backend_for
    for kv in a.kv:
        kv_lens = [kv] * a.batch
        inputs = make_inputs(kv_lens, 1, a.heads, a.page)
        runs, info = {}, {}
        for name, over in VARIANTS.items():

            def patched(op, arch, over=over):
                b = base_for(op, arch)
                return dataclasses.replace(b, planner={**b.planner, **over})

            wm.backend_for = patched
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
            r = MlaRun(mla, ws, inputs, a.heads, a.page, False)
            wm.backend_for = base_for
            r.replay()
            err = reference_error(inputs, r.out, 1, False)
            p = r.wrapper._plan
            info[name] = f"items {p.num_work_items:4d} merges {p.num_merge_tasks:4d} err {err:.1e}"
            if err < 2e-2:
                runs[name] = r.replay
        times = interleaved(runs, calls=30)
        nbytes = latent_bytes(kv_lens, a.page)
        for name in VARIANTS:
            t = times.get(name)
            tb = f"{t:8.1f} us {nbytes / t / 1e6:6.3f} TB/s" if t else "   (wrong output: not timed)"
            print(f"mla h{a.heads} bs{a.batch} kv{kv} page{a.page} {name:<8} {tb}  {info[name]}")
        del runs, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
