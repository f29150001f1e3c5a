"""A/B of the Hopper wgmma MLA kernel (``kernels/mla_decode_sm90.py``) on the GPU machine: each
variant runs through its own CUDA-graph-captured wrapper on the same inputs, is checked against the
fp32 reference (the diagnostic ``no_loads`` knob excepted: it computes on stale stages), and all
are timed in turns (``bench.common.interleaved``).

    python scripts/mla_sm90_knobs.py [all] [no_loads] [row_pages]   # the mla preset in the cache,
    # and the knob's spec: mla_decode_sm90:dtype=bf16,head_dim_ckv=512,head_dim_kpe=64,tile_q=64,
    # stages=2,no_loads=1 (or block_pages=0)
    python scripts/mla_sm90_knobs.py h16        # the 16-head memory-bound decode, planner variants
    python scripts/mla_sm90_knobs.py check row_pages   # first: five small mixed batches (lengths
    # 0 / 1 / odd / long, pages 1 / 16 / 64, 16-128 heads, 1-4 tokens, causal, split items), each
    # variant against the fp32 reference and bitwise against the default

Cases: the compute-bound bench case -- the default against the planner splitting for balance
(``alpha`` 2, ``balance_tol`` 0.01: no CTA left with half the work), the planner's exact cost
order (``order_block=1``: a request's causal tiles, a key apart, are dealt in different rounds)
and with ``no_loads`` the diagnostic knob (no KV copies after block 0: what the copies cost) --,
and with ``all`` two memory-bound decodes with the kernel choice forced both ways (16 heads: the
mma.sync kernel's 16-row items against the wgmma kernel's 64-row items; 64 heads: wgmma against
mma.sync's 32).  The kernel's earlier variants (one CTA barrier per block and one P tile, P by
2-byte stores, page-id prefetch, skipping O *= 1, 32-key blocks in 4 stages) were measured with
this script as knobs and dropped or adopted: BENCHMARKS.md, session 20."""

from __future__ import annotations

import sys
import types

import torch

import cute_attn.wrappers.mla as M
from cute_attn import mla as ours_mla
from cute_attn.bench.common import interleaved
from cute_attn.bench.mla import REF_TOL, MlaRun, latent_bytes, make_inputs, mla_flops, reference_error
from cute_attn.families.spec import Spec


def knobs(**kn):
    orig = M.mla_sm90_spec

    def spec(arch, dt):
        s = orig(arch, dt)
        return Spec.make(s.family, arch, **{**s.pdict, **kn})

    return {"mla_sm90_spec": spec}


def planner(**over):
    """The wrapper's planner made with these parameters over its backend's (``balance_tol``,
    ``order_block``)."""
    orig = M.common.install_planner
    shim = types.SimpleNamespace(**vars(M.common))
    shim.install_planner = lambda w, lim, sms, per_sm, cost, desc=None: orig(
        w, lim, sms, per_sm, {**cost, **over}, desc
    )
    return {"common": shim}


FORCE_WGMMA = {"TILES": (16, 8)}  # every plan past 8 rows takes the wgmma kernel
NO_WGMMA = {"backends_for": lambda op, arch: []}


def patched_run(patch, inputs, heads, ps, causal):
    """An MlaRun (its own workspace) planned with ``patch``'s attributes set on the wrapper module."""
    saved = {k: getattr(M, k) for k in patch}
    for k, v in patch.items():
        setattr(M, k, v)
    try:
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # a workspace per wrapper
        return MlaRun(ours_mla, ws, inputs, heads, ps, causal)
    finally:
        for k, v in saved.items():
            setattr(M, k, v)


def case(name, heads, q_len, kv_lens, ps, variants):
    causal = q_len > 1
    inputs = make_inputs(kv_lens, q_len, heads, ps)
    runs = {label: patched_run(patch, inputs, heads, ps, causal) for label, patch in variants.items()}
    fns = {}
    for label, r in runs.items():
        r.replay()
        torch.cuda.synchronize()
        err = reference_error(inputs, r.out, q_len, causal)
        ok = err < REF_TOL
        st = r.wrapper._state
        items = len(st.plan.work_items)
        print(f"  {label:<14} tile {st.tile}, {items} items, split {st.plan.has_split}, rel err {err:.2e} {ok}")
        if ok or "no_loads" in label:
            fns[label] = r.replay
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = interleaved(fns, calls=20)
    nbytes, flops = latent_bytes(kv_lens, ps), mla_flops(kv_lens, q_len, heads, causal)
    base = next(iter(times.values()))
    for label, t in times.items():
        print(f"{name:<40} {label:<14} {t:9.1f} us {nbytes / t / 1e6:6.3f} TB/s {flops / t / 1e6:7.1f} TFLOP/s "
              f"{t / base:5.3f}x the first")  # fmt: skip
    del runs, fns, inputs
    torch.cuda.empty_cache()


def check(name, heads, q_len, kv_lens, ps, variants):
    """Correctness of each variant on a small batch: every request against the fp32 reference,
    and bitwise against the first variant."""
    causal = q_len > 1
    inputs = make_inputs(kv_lens, q_len, heads, ps, gen_seed=len(kv_lens) + ps)
    outs = {}
    for label, patch in variants.items():
        r = patched_run(patch, inputs, heads, ps, causal)
        r.out.fill_(float("nan"))
        r.replay()
        torch.cuda.synchronize()
        err = reference_error(inputs, r.out, q_len, causal, requests=len(kv_lens))
        outs[label] = r.out.clone()
        first = next(iter(outs.values()))
        same = torch.equal(outs[label], first)
        st = r.wrapper._state
        print(f"CHECK {name:<36} {label:<12} tile {st.tile} split {st.plan.has_split} rel err {err:.2e} "
              f"{'ok' if err < REF_TOL else 'WRONG'} bitwise-equal-first {same}")  # fmt: skip
        del r
    torch.cuda.empty_cache()


def main():
    if "h16" in sys.argv:  # the memory-bound 16-head decode: 128 items on 132 CTAs, or split finer
        hv = {
            "default": {},
            "tol0.01": planner(balance_tol=0.01),
            "alpha2_tol0.01": planner(alpha=2, balance_tol=0.01),
        }
        for kv in (4096, 4096, 32768):
            case(f"h16/bs128/kv{kv}/page64", 16, 1, [kv] * 128, 64, hv)
        return
    variants = {
        "default": {},
        "alpha2": planner(alpha=2, balance_tol=0.01),
        "exact_order": planner(order_block=1),
    }
    if "no_loads" in sys.argv:
        variants["no_loads"] = knobs(no_loads=1)
    if "row_pages" in sys.argv:  # a page lookup per token where one page holds the block
        variants["row_pages"] = knobs(block_pages=0)
    if "check" in sys.argv:  # the kernel's knobs (no_loads excepted: wrong by design) on small batches
        cv = {k: {**FORCE_WGMMA, **v} for k, v in variants.items() if k != "no_loads"}
        lens = [0, 1, 5, 63, 64, 65, 127, 200, 1000, 333, 2049, 7]
        check("h128/q2/page1/mixed", 128, 2, lens, 1, cv)
        check("h64/q1/page16/mixed", 64, 1, lens, 16, cv)
        check("h128/q4/page64/mixed", 128, 4, lens, 64, cv)
        check("h16/q1/page64/long", 16, 1, [5000, 9000, 1, 130], 64, cv)
        check("h32/q3/page16/long", 32, 3, [3000, 6001, 2, 64], 16, cv)
    case("h128/q2/bs64/kv8192/page64", 128, 2, [8192] * 64, 64, variants)
    if "all" in sys.argv:
        case("h16/bs128/kv4096/page64", 16, 1, [4096] * 128, 64, {"mma.sync": {}, "wgmma": FORCE_WGMMA})
        case("h64/bs128/kv4096/page64", 64, 1, [4096] * 128, 64, {"wgmma": {}, "mma.sync": NO_WGMMA})


if __name__ == "__main__":
    main()
