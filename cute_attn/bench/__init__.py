"""Side-by-side benchmarks for ``python -m cute_attn bench`` (GPU machines; not part of the tests)."""

from __future__ import annotations

import sys

from .common import Results

GROUPS = (
    "copy", "merge", "launch", "decode", "decode_shapes", "fp8", "fp8prefill", "fp8attn", "prefill", "head_dims",
    "hd80", "portable", "variants", "cascade", "sparse", "mla", "merge_sweep",
)  # fmt: skip


def run_benchmarks(only=None, json_path=None, quick=False) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    groups = only or [g for g in GROUPS if g != "merge_sweep"]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        print(f"unknown benchmark group(s) {sorted(unknown)}; known: {GROUPS}", file=sys.stderr)
        return 2
    res = Results()
    print(f"device: {res.device}  commit: {res.commit}  date: {res.date}")
    from . import decode, launch, merge, prefill

    ceiling = None
    if "copy" in groups or "merge" in groups:
        ceiling = merge.copy_bandwidth(res)
    if "merge" in groups:
        merge.bench_merge(res, ceiling, quick)
    if "merge_sweep" in groups:
        merge.sweep_merge(res)
    if "decode" in groups:
        decode.bench_decode(res, quick)
    elif "decode_shapes" in groups:
        decode.bench_decode(res, quick, shapes_only=True)
    if "fp8" in groups:
        from . import fp8

        fp8.bench_fp8(res, quick)
    if "fp8prefill" in groups and "fp8" not in groups:  # the fp8 group's prefill half alone
        from .fp8_prefill import bench_fp8_prefill

        bench_fp8_prefill(res, quick)
    if "fp8attn" in groups:
        from . import fp8_attention

        fp8_attention.bench_fp8_attention(res, quick)
    if "prefill" in groups:
        prefill.bench_prefill(res, quick)
    if "head_dims" in groups:
        from . import head_dims

        head_dims.bench_head_dims(res, quick)
    elif "hd80" in groups:  # head dim 80 alone: its prefill (in head_dims) and decode cases
        from . import head_dims

        head_dims.bench_hd80(res, quick)
        decode.bench_decode(res, quick, cases=[c for c in decode.shape_cases() if c[5] == 80])
    if "portable" in groups:
        from . import portable

        portable.bench_portable(res, quick)
    if "variants" in groups:
        from . import variants

        variants.bench_variants(res, quick)
    if "cascade" in groups:
        from . import cascade

        cascade.bench_cascade(res, quick)
    if "sparse" in groups:
        from . import sparse

        sparse.bench_sparse(res, quick)
    if "mla" in groups:
        from . import mla

        mla.bench_mla(res, quick)
    if "launch" in groups:
        launch.bench_launch(res, quick)
    if json_path:
        res.merge_into(json_path)
        print(f"records merged into {json_path}")
    return 0
