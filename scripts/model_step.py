"""One serving step of a built-in model on the GPU, from a cache that holds only that model's
kernels -- the GPU half of issue 21's "a model's kernel set" (the CPU half is
``tests/engines/test_models.py``, which checks the same calls load only listed specs).

    # a cache of exactly the entries `compile --model NAME` builds, cut from a fuller cache:
    python scripts/model_step.py cut NAME FULL_CACHE OUT_CACHE
    # then, with no DSL installed (a missing kernel raises KernelNotAvailable):
    CUTE_ATTN_CACHE_DIR=OUT_CACHE python scripts/model_step.py run NAME

``run``: the wrapper calls of ``test_models`` -- decode at batch 64 and 256 (page 16), ragged
causal prefill (long and short requests), paged causal prefill at page 16 and 1, a
speculative-decoding tree mask, a two-level cascade -- for each of the model's layer kinds
(window / global, soft-cap, sinks), random bf16 inputs; decode and ragged prefill outputs
checked against the fp32 reference (relative L2 < 2e-2), every output checked finite.
Prints one line per model: calls made, checks passed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def cut(name: str, full: str, out: str) -> None:
    from cute_attn.models import model_specs, resolve_model
    from cute_attn.runtime.cache import entry_dir

    m = resolve_model(name)
    n = 0
    for spec in model_specs(m, "sm_90a"):
        src = entry_dir(spec, Path(full))
        if not src.exists():
            raise SystemExit(f"{name}: {spec.describe()} is not in {full}")
        dst = entry_dir(spec, Path(out))
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, dirs_exist_ok=True)
        n += 1
    print(f"{name}: {n} entries -> {out}")


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()


def run(name: str) -> None:
    import torch

    import cute_attn as ca
    from cute_attn.models import resolve_model
    from cute_attn.testing import paged_reference, ragged_reference

    m = resolve_model(name)
    hq, hk, d, bf = m.num_qo_heads, m.num_kv_heads, m.head_dim, torch.bfloat16
    windows = ([-1] if m.global_layers or m.sliding_window is None else []) + (
        [m.sliding_window - 1] if m.sliding_window else []
    )
    cap = m.logits_soft_cap
    sinks = torch.randn(hq, device="cuda") if m.sinks else None
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    ws = lambda mb=256: torch.zeros(mb << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
    ps, pages = 16, 8192
    cache = tuple(torch.randn(pages, ps, hk, d, device="cuda", dtype=bf) for _ in range(2))
    calls = checks = 0
    for window in windows:
        for b in (64, 256):
            lens = [1 + (i * 37) % 500 for i in range(b)]
            npg = [(n + ps - 1) // ps for n in lens]
            indptr = i32([0] + torch.tensor(npg).cumsum(0).tolist())
            indices = torch.randperm(pages)[: int(indptr[-1])].to(torch.int32)
            last = i32([n - (p - 1) * ps for n, p in zip(lens, npg)])
            w = ca.BatchDecodeWithPagedKVCacheWrapper(ws())
            w.plan(indptr, indices, last, hq, hk, d, ps, window_left=window, logits_soft_cap=cap, q_data_type=bf)
            q = torch.randn(b, hq, d, device="cuda", dtype=bf)
            out = w.run(q, cache, sinks=sinks)
            calls += 1
            if sinks is None:
                ref, _ = paged_reference(q, cache, None, indptr, indices, last, logits_soft_cap=cap, window_left=window)
                assert _rel(out, ref) < 2e-2, (name, "decode", b, _rel(out, ref))
                checks += 1
        for qo in ([600, 300], [3, 5, 2]):
            ind = i32([0] + torch.tensor(qo).cumsum(0).tolist())
            r = ca.BatchPrefillWithRaggedKVCacheWrapper(ws())
            r.plan(ind, ind, hq, hk, d, causal=True, window_left=window, logits_soft_cap=cap, q_data_type=bf)
            n = int(ind[-1])
            q, k, v = (torch.randn(n, h, d, device="cuda", dtype=bf) for h in (hq, hk, hk))
            out = r.run(q, k, v, sinks=sinks)
            calls += 1
            if sinks is None:
                ref, _ = ragged_reference(q, k, v, ind, ind, causal=True, logits_soft_cap=cap, window_left=window)
                assert _rel(out, ref) < 2e-2, (name, "ragged", qo, _rel(out, ref))
                checks += 1
        for page in (16, 1):
            kv = 240
            npg = (kv + page - 1) // page
            pc = tuple(torch.randn(npg, page, hk, d, device="cuda", dtype=bf) for _ in range(2))
            p = ca.BatchPrefillWithPagedKVCacheWrapper(ws())
            p.plan(i32([0, 40]), i32([0, npg]), i32(list(range(npg))), i32([kv - (npg - 1) * page]), hq, hk, d,
                   page, causal=True, window_left=window, logits_soft_cap=cap, q_data_type=bf)  # fmt: skip
            out = p.run(torch.randn(40, hq, d, device="cuda", dtype=bf), pc, sinks=sinks)
            assert torch.isfinite(out).all(), (name, "paged", page)
            calls += 1
        spec = ca.BatchPrefillWithPagedKVCacheWrapper(ws())
        spec.plan(i32([0, 4, 8]), i32([0, 4, 8]), i32(list(range(8))), i32([16, 16]), hq, hk, d, ps,
                  custom_mask=torch.ones(2 * 4 * 64, dtype=torch.bool), window_left=window, logits_soft_cap=cap,
                  q_data_type=bf)  # fmt: skip
        assert torch.isfinite(spec.run(torch.randn(8, hq, d, device="cuda", dtype=bf), cache)).all()
        c = ca.MultiLevelCascadeAttentionWrapper(2, ws(512))
        c.plan([i32([0, 8]), i32(list(range(9)))], [i32([0, 4]), i32(list(range(9)))],
               [i32([0, 1, 2, 3]), i32(list(range(4, 12)))], [i32([16]), i32([16] * 8)], hq, hk, d, ps,
               window_left=window, logits_soft_cap=cap, q_data_type=bf)  # fmt: skip
        assert torch.isfinite(c.run(torch.randn(8, hq, d, device="cuda", dtype=bf), cache)).all()
        calls += 2
    torch.cuda.synchronize()
    print(f"{name}: serving step OK from a --model-only cache: {calls} wrapper runs, {checks} checked vs fp32")


if __name__ == "__main__":
    if sys.argv[1] == "cut":
        cut(*sys.argv[2:5])
    else:
        run(sys.argv[2])
