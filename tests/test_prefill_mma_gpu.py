"""The portable prefill kernel (``kernels/prefill_mma.py``, ``plan(prefill_backend=
"prefill_mma_sync")``) against the fp32 reference on the GPU, over the prefill grid: the three
tiles (16 / 32 / 64 / 128 packed rows, chosen by the planner's rule from the batch), ragged and paged
KV (page sizes 1 and 16, NHD and HND), causal and not (queries longer than keys included), GQA
groups 1 / 4 / 8, head dims 64 / 80 / 96 / 128 / 256, fp16 / bf16, query lengths 0 / 1 / odd / long,
soft-cap and the sliding window, traced variants (sinks on the register epilogue, a custom mask,
ALiBi, RoPE rotated in-kernel), a split by the planner, bitwise determinism and CUDA-graph
replay under new plans.  Outputs and LSE pre-filled with NaN, every unowned cache slot NaN
(``test_prefill_gpu``'s helpers); tolerances as there.

The specs these load are ``cute_attn.testing.matrices.portable_prefill_test_specs`` (in the
``all`` preset): ``test_gpu_cases_use_preset_specs`` runs every case on the CPU against the
emulated kernel and checks that.  On Hopper the H200 runs the very code Blackwell would get;
the sm_100a build has never run on Blackwell hardware."""

import random

import pytest
import torch
from test_prefill_gpu import (
    _cpu_ws,
    _gen,
    replay_ragged_plans,
    run_paged,
    run_ragged,
)
from test_prefill_variants_gpu import run_variant

from cute_attn.testing import ragged_reference

gpu = pytest.mark.gpu
PORTABLE = dict(prefill_backend="prefill_mma_sync")
BF, FP = torch.bfloat16, torch.float16

# (qo_lens, kv_lens) by the tile the planner's rule gives them at GQA 4 (32 / 8 heads)
LENS = {
    16: ([1, 4, 3, 1, 2, 4, 0, 1], [1, 5, 100, 3000, 64, 65, 1, 7]),  # decode-like, an empty request
    32: ([3, 5, 9, 2, 0, 13], [3, 700, 9, 50, 7, 2000]),  # short appends
    64: ([1, 17, 30, 9, 5, 12], [1, 117, 128, 333, 2005, 77]),  # longer appends
    128: ([1, 17, 128, 300, 5, 77], [1, 117, 128, 333, 2005, 77]),  # prefill, kv = qo and kv > qo
}


def _run(kv, qo, kvl, hq, hk, d, dtype, **kw):
    """ragged (kv = 0) or paged with page size kv; returns the wrapper."""
    if kv:
        return run_paged(qo, kvl, kv, hq, hk, d, dtype, **kw, **PORTABLE)[0]
    return run_ragged(qo, kvl, hq, hk, d, dtype, tail=3, **kw, **PORTABLE)[0]


def _portable(w, tile=None):
    assert w._state.family == "batch_prefill_mma"
    if tile is not None:
        assert w._tile == tile


# (test, args) of every GPU case, for the CPU check of their specs (test_gpu_cases_use_preset_specs)
GRID = [(t, kv, c) for t in (16, 32, 64, 128) for kv in (0, 16, 1) for c in (False, True)]
DIMS = [
    (64, FP, 8, 8, 128, 0, True),
    (64, FP, 8, 8, 128, 16, False),
    (256, BF, 16, 2, 64, 0, True),
    (256, BF, 16, 4, 32, 16, True),
]
FLAGS = [(64, 0, True, 30.0, 100), (128, 16, True, 30.0, 100), (32, 16, False, None, 7), (16, 1, True, 50.0, -1)]
# head dim 96 (192-byte rows in three 64-byte swizzle atom columns), 32 / 8 heads: every tile,
# ragged / page 16 / page 1, causal or not, f16 once; then soft-cap + window
HD96 = [
    (16, 16, False, BF),
    (16, 1, True, BF),
    (32, 0, True, BF),
    (32, 1, False, BF),
    (32, 16, True, FP),
    (64, 16, True, BF),
    (64, 0, False, BF),
]
HD96_FLAGS = [(64, 1, True, 30.0, 100), (16, 0, False, 50.0, 7)]
# head dim 80 (160-byte rows in five 32-byte swizzle atom columns), 32 / 8 heads
HD80 = [
    (16, 16, False, BF),
    (16, 1, True, BF),
    (32, 0, True, BF),
    (32, 16, True, FP),
    (64, 16, True, BF),
    (64, 0, False, BF),
]
VARIANTS = [("sink", 64, 0, True), ("custom_mask", 32, 16, False), ("alibi", 16, 16, True), ("rope", 16, 0, True)]


@gpu
@pytest.mark.parametrize("tile,kv,causal", GRID, ids=lambda x: str(x))
def test_portable_grid(tile, kv, causal):
    """bf16, head dim 128, 32 / 8 heads: every tile x ragged / page 16 / page 1 x causal."""
    qo, kvl = LENS[tile]
    _portable(_run(kv, qo, kvl, 32, 8, 128, BF, causal=causal), tile)


@gpu
@pytest.mark.parametrize("d,dtype,hq,hk,tile,kv,causal", DIMS, ids=lambda x: str(x))
def test_portable_head_dims(d, dtype, hq, hk, tile, kv, causal):
    """Head dims 64 (fp16, no GQA) and 256 (GQA 8); HND at 256."""
    qo, kvl = LENS[128] if hq == hk else LENS[32]
    layout = "HND" if d == 256 else "NHD"
    _portable(_run(kv, qo, kvl, hq, hk, d, dtype, causal=causal, layout=layout), tile)


@gpu
@pytest.mark.parametrize("d,tile,kv,causal,dtype", [(96, *c) for c in HD96] + [(80, *c) for c in HD80], ids=str)
def test_portable_head_dim_80_96(d, tile, kv, causal, dtype):
    """Head dims 96 (Phi-3-mini's) and 80 (Phi-2's): Blackwell's only prefill kernel there."""
    qo, kvl = LENS[tile]
    _portable(_run(kv, qo, kvl, 32, 8, d, dtype, causal=causal), tile)


@gpu
@pytest.mark.parametrize("tile,kv,causal,cap,window", HD96_FLAGS, ids=lambda x: str(x))
def test_portable_head_dim_96_softcap_window(tile, kv, causal, cap, window):
    qo, kvl = LENS[tile]
    _portable(_run(kv, qo, kvl, 32, 8, 96, BF, causal=causal, soft_cap=cap, window_left=window), tile)


@gpu
def test_portable_head_dim_80_softcap_window():
    qo, kvl = LENS[64]
    _portable(_run(16, qo, kvl, 32, 8, 80, BF, causal=True, soft_cap=30.0, window_left=100), 64)


@gpu
def test_portable_head_dim_96_split():
    w = _run(16, [40, 3000, 17], [20000, 3000, 5000], 8, 2, 96, BF, causal=True)
    _portable(w, 64)
    assert w._plan.has_split


@gpu
@pytest.mark.parametrize("tile,kv,causal,cap,window", FLAGS, ids=lambda x: str(x))
def test_portable_softcap_window(tile, kv, causal, cap, window):
    qo, kvl = LENS[tile]
    _portable(_run(kv, qo, kvl, 32, 8, 128, BF, causal=causal, soft_cap=cap, window_left=window), tile)


@gpu
@pytest.mark.parametrize("name,tile,kv,causal", VARIANTS, ids=lambda x: str(x))
def test_portable_variants(name, tile, kv, causal):
    """A traced variant per epilogue / fragment path: sinks (tile 64: the register epilogue),
    a custom mask (tile 32: the shared-memory ⊕ of two warps), ALiBi and RoPE (tile 16: keys
    rotated in-kernel, whole K fragments; RoPE plans always take 16-row tiles)."""
    qo, kvl = LENS[tile]
    w = run_variant(name, BF, 128, kv > 0, causal, 32, 8, kv, qo, kvl, packed=kv > 0, **PORTABLE)[0]
    _portable(w, tile)


@gpu
def test_portable_long_causal():
    """8k causal, no GQA (the compute-bound case) and a request of 8k queries over 8k - 1 keys."""
    _portable(_run(0, [8192], [8192], 8, 8, 128, BF, causal=True), 128)
    _portable(_run(16, [8192, 1], [8192, 8191], 8, 1, 64, BF, causal=True), 128)


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_portable_split(paged):
    """One long request over few kv heads: the planner cuts the KV (partial slots + merge)."""
    w = _run(16 if paged else 0, [40, 3000, 17], [20000, 3000, 5000], 8, 2, 128, BF, causal=True)
    _portable(w, 128)
    assert w._plan.has_split


@gpu
def test_portable_odd_batches():
    rng = random.Random()
    for batch in (1, 3, 33):
        qo = [rng.randrange(0, 400) | 1 for _ in range(batch)]
        kv = [q + rng.randrange(0, 600) for q in qo]
        _portable(_run(rng.choice([0, 1, 16]), qo, kv, 16, 4, 128, BF, causal=bool(rng.getrandbits(1))))


@gpu
def test_portable_deterministic():
    """A split plan run twice gives the same bits (no atomics; the merge folds in a fixed order)."""
    from test_prefill_gpu import make_ragged

    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    q, k, v, qo, kv, _ = make_ragged([512, 3000, 17], [20000, 3000, 5000], 8, 2, 128, BF, "NHD", _gen(), "cuda")

    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(qo, kv, 8, 2, 128, causal=True, q_data_type=BF, **PORTABLE)
    a = w.run(q, k, v, return_lse=True)
    b = w.run(q, k, v, return_lse=True)
    assert w._plan.has_split and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@gpu
def test_portable_cuda_graph_replay():
    replay_ragged_plans(
        32,
        8,
        128,
        1024,
        20000,
        ([500, 24, 300, 200], [2000, 1024, 1007, 4072]),  # tile 128, fixed for the replays
        [
            ([1, 1, 1, 1021], [1, 1, 1, 15000]),
            ([5, 77, 300, 1], [5, 77, 300, 1]),
            ([2, 2, 2], [2000, 1024, 1007]),
        ],
        lambda q, k, v, qo_t, kv_t: ragged_reference(q, k, v, qo_t, kv_t, causal=True),
        **PORTABLE,
    )


def test_gpu_cases_use_preset_specs(monkeypatch):
    """Every GPU case above, planned on the CPU (132 emulated SMs, as the H200) against the
    emulated kernel, loads only specs of the ``prefill_mma`` preset (in ``all``; a missing spec
    costs a GPU visit: the first run here carried that preset without the merges of the
    head-dim 64 / 256 tiles, and four cases failed to load them)."""
    import test_prefill_gpu as T
    from test_prefill_variants_gpu import _emulate_variant_prefill

    import cute_attn.wrappers.prefill_base as P
    from cute_attn.families.spec import Spec
    from cute_attn.presets import preset_specs

    have = set(preset_specs("prefill_mma", "sm_90a"))
    assert have <= set(preset_specs("all", "sm_90a"))
    missing = []

    def kernel(family, arch, **params):
        spec = Spec.make(family, arch, **params)
        if spec not in have:
            missing.append(spec.describe())
        return T._Emulated(family, params, [], _emulate_variant_prefill)  # (plain specs too)

    monkeypatch.setattr(P, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)
    monkeypatch.setattr(P, "kernel", kernel)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", T._FakeEvent)
    monkeypatch.setattr(T, "DEV", "cpu")
    cpu = dict(device="cpu", workspace=_cpu_ws(256), seed=1)

    def run(kv, qo, kvl, hq, hk, d, dtype, **kw):
        if kv:
            return run_paged(qo, kvl, kv, hq, hk, d, dtype, **kw, **cpu, **PORTABLE)[0]
        return run_ragged(qo, kvl, hq, hk, d, dtype, **kw, **cpu, **PORTABLE)[0]

    for tile, kv, causal in GRID:
        _portable(run(kv, *LENS[tile], 32, 8, 128, BF, causal=causal), tile)
    for d, dtype, hq, hk, tile, kv, causal in DIMS:
        _portable(run(kv, *(LENS[128] if hq == hk else LENS[32]), hq, hk, d, dtype, causal=causal), tile)
    for tile, kv, causal, cap, window in FLAGS:
        _portable(run(kv, *LENS[tile], 32, 8, 128, BF, causal=causal, soft_cap=cap, window_left=window), tile)
    for name, tile, kv, causal in VARIANTS:
        run_variant(name, BF, 128, kv > 0, causal, 32, 8, kv, *LENS[tile], packed=kv > 0, **cpu, **PORTABLE)
    for tile, kv, causal, dtype in HD96:
        _portable(run(kv, *LENS[tile], 32, 8, 96, dtype, causal=causal), tile)
    for tile, kv, causal, cap, window in HD96_FLAGS:
        _portable(run(kv, *LENS[tile], 32, 8, 96, BF, causal=causal, soft_cap=cap, window_left=window), tile)
    run(16, [40, 3000, 17], [20000, 3000, 5000], 8, 2, 96, BF, causal=True)
    for tile, kv, causal, dtype in HD80:
        _portable(run(kv, *LENS[tile], 32, 8, 80, dtype, causal=causal), tile)
    _portable(run(16, *LENS[64], 32, 8, 80, BF, causal=True, soft_cap=30.0, window_left=100), 64)
    run(0, [2048], [2048], 8, 8, 128, BF, causal=True)  # the 8k cases' tiles, shorter
    run(16, [2048, 1], [2048, 2047], 8, 1, 64, BF, causal=True)
    run(16, [40, 3000, 17], [20000, 3000, 5000], 8, 2, 128, BF, causal=True)
    assert not missing, sorted(set(missing))
