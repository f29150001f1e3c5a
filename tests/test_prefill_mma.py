"""The portable prefill's wiring, on the CPU (CI): which kernel the arch -> backend table gives a
batch (``choose_prefill_backend``: Blackwell always the portable kernel, Hopper the wgmma one
unless its limits say otherwise), the tiles the planner's rule maps onto (16 / 32 / 64), what
the wrappers refuse with it (an fp8 cache, ``kv_pass=True``) or force (16-row tiles for an
in-kernel key transform), CUDA-graph mode keeping the first plan's kernel, batch invariance,
and what ships (presets, ``compile --model``).  The kernel itself: tests/test_prefill_mma_ptx.py
(its PTX interpreted on the CPU) and tests/test_prefill_mma_gpu.py (the H200)."""

import pytest
import torch
from test_prefill_gpu import _cpu_ws, _fake_cuda, emu, run_paged, run_ragged  # noqa: F401  (emu: the fixture)

from cute_attn.families import backends as B

BF = torch.bfloat16
CPU = dict(device="cpu", seed=3)


def test_choose_prefill_backend(monkeypatch):
    pick = lambda arch, rows, **kw: B.choose_prefill_backend(arch, rows, **kw).name  # noqa: E731
    assert pick("sm_100a", 1) == pick("sm_100a", 5000) == B.PORTABLE_PREFILL
    assert pick("sm_90a", 16) == "prefill_sm90"  # KV the wgmma kernel reads by TMA: limit 0 (BENCHMARKS.md)
    assert pick("sm_90a", 16, name=B.PORTABLE_PREFILL) == B.PORTABLE_PREFILL
    with pytest.raises(B.NoBackend, match="prefill_sm90 for sm_100a"):
        pick("sm_100a", 16, name="prefill_sm90")
    assert B.HOPPER_PORTABLE_MAX_ROWS == {"tma": 0, "gather": 16}
    assert pick("sm_90a", 16, gathers=True) == B.PORTABLE_PREFILL  # page 1: 0.937x the wgmma time
    assert pick("sm_90a", 0, gathers=True) == "prefill_sm90"  # no queries at all
    assert pick("sm_90a", 17, gathers=True) == "prefill_sm90"
    assert pick("sm_90a", 16, gathers=True, needs_pass=True) == "prefill_sm90"  # fp8 / kv_pass=True
    assert pick("sm_90a", 16, gathers=True, batch_invariant=True) == "prefill_sm90"
    assert B.portable_tiles("sm_90a") == (16,) and B.portable_tiles("sm_100a") == (16, 32, 64, 128)
    assert B.portable_tiles("sm_100a", 256) == (16, 32, 64)  # 32-row warps hold O of head dims <= 128
    # head dim 96: the portable kernel on sm_100a; Hopper keeps the wgmma kernel (never run on a GPU at 96)
    assert pick("sm_100a", 16, head_dims=(96, 96)) == B.PORTABLE_PREFILL
    assert pick("sm_90a", 16, gathers=True, head_dims=(96, 96)) == "prefill_sm90"
    assert pick("sm_90a", 16, gathers=True, head_dims=(128, 128)) == B.PORTABLE_PREFILL
    assert B.portable_tiles("sm_90a", 96) == () and B.portable_tiles("sm_100a", 96) == (16, 32, 64)
    monkeypatch.setitem(B.HOPPER_PORTABLE_MAX_ROWS, "tma", 40)
    assert B.portable_tiles("sm_90a") == (16, 32, 64)


@pytest.mark.parametrize("qo,tile", [([1, 1, 2], 16), ([5, 9, 3], 32), ([12, 17], 64), ([40, 17], 128), ([600], 128)])
@pytest.mark.parametrize("paged", [False, True])
def test_blackwell_tiles(emu, qo, tile, paged):  # noqa: F811
    """sm_100a: the portable kernel, the planner's tile rule (mean packed rows per request) mapped
    onto 16 / 32 / 64 / 128, the emulated kernel's output checked against the reference."""
    emu.state["arch"] = "sm_100a"
    kv = [q + 37 for q in qo]
    kw = dict(causal=True, workspace=_cpu_ws(), **CPU)
    w = (run_paged(qo, kv, 16, 8, 2, 64, BF, **kw) if paged else run_ragged(qo, kv, 8, 2, 64, BF, **kw))[0]
    assert w._state.family == "batch_prefill_mma" and w._tile == tile
    assert "page_box" not in w._spec_kw and "keys_transformed" not in w._spec_kw
    assert w._gathered is None  # it reads the pages itself: no KV pass


@pytest.mark.parametrize("paged", [False, True])
def test_blackwell_head_dim_96(emu, paged):  # noqa: F811
    """sm_100a at head dim 96: prefill on the portable kernel (the emulated kernel's output
    checked against the reference; decode at 96 runs the decode kernel there, as on Hopper:
    tests/test_wrappers_api.py)."""
    emu.state["arch"] = "sm_100a"
    qo, kv = [1, 9, 40], [70, 9, 300]
    kw = dict(causal=True, workspace=_cpu_ws(), **CPU)
    w = (run_paged(qo, kv, 1, 8, 2, 96, BF, **kw) if paged else run_ragged(qo, kv, 8, 2, 96, BF, **kw))[0]
    assert w._state.family == "batch_prefill_mma" and w._state.head_dim == 96


def test_blackwell_refusals_and_rope(emu):  # noqa: F811
    emu.state["arch"] = "sm_100a"
    kw = dict(workspace=_cpu_ws(), **CPU)
    with pytest.raises(NotImplementedError, match="kv_pass=True"):
        run_paged([64], [100], 16, 8, 2, 64, BF, kv_pass=True, **kw)
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws())
    ind = torch.tensor([0, 300], dtype=torch.int32)
    w.plan(ind, ind, 8, 2, 64, causal=True, q_data_type=BF, pos_encoding_mode="ROPE_LLAMA")
    assert w._tile == 16 and w._state.family == "batch_prefill_mma"  # keys rotated in-kernel: whole fragments
    assert w._kv_pass is None  # no key-transform pass before it
    w = run_ragged([70, 5], [900, 5], 8, 2, 64, BF, causal=True, fixed_split_size=256, **kw)[0]
    assert w._tile == 128 and w._plan.has_split  # batch-invariant: the kernel's largest tile


def test_cuda_graph_keeps_the_first_kernel(emu, monkeypatch):  # noqa: F811
    """Hopper, CUDA-graph mode: the first plan's kernel (here the portable one, by the rule) stays
    for later plans the rule would give the other kernel (a captured launch bakes it)."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    monkeypatch.setitem(B.HOPPER_PORTABLE_MAX_ROWS, "tma", 16)
    bufs = {n: _fake_cuda(torch.zeros(3, dtype=torch.int32)) for n in ("qo_indptr_buf", "kv_indptr_buf")}
    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(), use_cuda_graph=True, **bufs)
    for qo in ([4, 4], [8, 0]):  # 16, then 32 packed rows per request: the rule would take wgmma
        ind = torch.tensor([0, qo[0], qo[0] + qo[1]], dtype=torch.int32)
        w.plan(ind, ind, 8, 2, 64, causal=True, q_data_type=BF)
        assert w._state.family == "batch_prefill_mma" and w._tile == 16


def test_shipped_and_models():
    from cute_attn.models import BUILTIN, model_specs
    from cute_attn.presets import preset_specs

    fams = lambda specs: {s.family for s in specs}  # noqa: E731
    assert "batch_prefill_mma" in fams(preset_specs("default", "sm_100a"))
    hopper = [s for s in preset_specs("default", "sm_90a") if s.family == "batch_prefill_mma"]
    # the batches the Hopper rule gives it; head dim 512 (only this family serves it) both tiles
    assert {s.pdict["tile_q"] for s in hopper if s.pdict["head_dim"] != 512} == {16}
    assert {s.pdict["tile_q"] for s in hopper if s.pdict["head_dim"] == 512} == {16, 32}
    assert "batch_prefill_sm90" not in fams(preset_specs("default", "sm_100a"))
    llama = model_specs(BUILTIN["llama-3"], "sm_100a")
    tiles = {s.pdict["tile_q"] for s in llama if s.family == "batch_prefill_mma"}
    assert tiles == {16, 32, 64, 128} and {s.pdict["tile_q"] for s in llama if s.family == "merge_partials"} >= tiles
    hopper = {s.pdict["tile_q"] for s in model_specs(BUILTIN["llama-3"], "sm_90a") if s.family == "batch_prefill_mma"}
    assert hopper == {16}
