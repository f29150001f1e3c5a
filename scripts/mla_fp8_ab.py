"""MLA decode over an fp8 (e4m3) latent cache at 16 rows per item: one CTA per SM with 10
stages against two CTAs per SM with 4 (``families/mla.CTAS_PER_SM_FP8`` / ``STAGES_FP8``),
beside the bf16 cache of the same values -- h16, batch 128, kv 4k / 32k, page 64, CUDA-graph
replays in turns (two rounds of 30, the lower median kept); every output checked against the
fp32 reference first.

    python -m cute_attn compile --arch sm_90a --preset mla
    python -m cute_attn compile --arch sm_90a \\
        --spec mla_decode:dtype=bf16,head_dim_ckv=512,head_dim_kpe=64,kv_dtype=e4m3,stages=10,tile_q=16
    PYTHONPATH=. CUTE_ATTN_CACHE_DIR=... python scripts/mla_fp8_ab.py [--json out.json]
"""

from __future__ import annotations

import json
import sys

CONFIGS = {"cute_attn_fp8_1cta_10stages": (1, 10), "cute_attn": (2, 4)}  # name: (CTAs per SM, stages)
HEADS, PAGE, BATCH = 16, 64, 128


def run(json_path=None) -> None:
    import torch

    from cute_attn import mla as ours_mla
    from cute_attn.bench.common import Results, interleaved
    from cute_attn.bench.mla import REF_TOL, MlaRun, latent_bytes, make_inputs, reference_error
    from cute_attn.families import mla as fam

    res = Results()
    saved = dict(fam.CTAS_PER_SM_FP8), dict(fam.STAGES_FP8)
    for kv in (4096, 32768):
        case = f"mla/decode/h{HEADS}/bs{BATCH}/kv{kv}/page{PAGE}/fp8"
        lens = [kv] * BATCH
        runs, nbytes = {}, {}
        bf16 = make_inputs(lens, 1, HEADS, PAGE)
        ws = lambda: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # noqa: E731
        runs["cute_attn_bf16_cache"] = MlaRun(ours_mla, ws(), bf16, HEADS, PAGE, False), bf16
        nbytes["cute_attn_bf16_cache"] = latent_bytes(lens, PAGE, 2)
        fp8 = make_inputs(lens, 1, HEADS, PAGE, kv_dtype=torch.float8_e4m3fn)
        for name, (ctas, stages) in CONFIGS.items():
            fam.CTAS_PER_SM_FP8[16], fam.STAGES_FP8[16] = ctas, stages
            try:
                runs[name] = MlaRun(ours_mla, ws(), fp8, HEADS, PAGE, False), fp8
            finally:
                fam.CTAS_PER_SM_FP8.update(saved[0])
                fam.STAGES_FP8.update(saved[1])
            nbytes[name] = latent_bytes(lens, PAGE, 1)
        for name, (r, inputs) in runs.items():
            assert r.graph is not None, (name, r.graph_why)
            r.replay()
            err = reference_error(inputs, r.out, 1, False)
            print(json.dumps({"case": case, "impl": name, "ref_rel_err": err}), flush=True)
            assert err < REF_TOL, (name, err)
        fns = {name: r.replay for name, (r, _) in runs.items()}
        t1, t2 = interleaved(fns, calls=30), interleaved(fns, calls=30)
        for name in fns:
            us = min(t1[name], t2[name])
            c = case if name != "cute_attn_bf16_cache" else case[: -len("/fp8")]
            row = {"case": c, "impl": name, "us": round(us, 1), "rounds": [round(t1[name], 1), round(t2[name], 1)],
                   "TB/s": round(nbytes[name] / us / 1e6, 3)}  # fmt: skip
            print(json.dumps(row), flush=True)
            res.add(c, name, "us", us)
            res.add(c, name, "TB/s", nbytes[name] / us / 1e6)
        del runs, fns, bf16, fp8
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res.records, f, indent=1)


if __name__ == "__main__":
    run(sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None)
