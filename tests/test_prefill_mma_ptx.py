"""The portable prefill kernel (``kernels/prefill_mma.py``), compiled and executed on the CPU: its
PTX (sm_90a) run by ``tests/ptx_interp.py`` on the exact tensors the prefill wrappers pass,
every CTA of small plans (two emulated SMs: four CTAs, so long KV is split and merged), checked
against the fp32 reference.  The GPU tests (``tests/test_prefill_mma_gpu.py``) check the same on
the H200 over the full grid; these run where no GPU is: the three warp geometries (tiles 16 /
32 / 64), head dims 64, 96 and 128, ragged and paged KV (page sizes 1 and 16), causal (queries longer than keys
included: rows that see nothing), window + soft-cap, a traced variant per epilogue (sinks on
the register epilogue, a custom mask and FlashSigmoid through the shared-memory ⊕), a split
item and its merge, with the threads run in forward and in reverse order between
synchronizations (a race between warps shows as a difference).

Pure Python (~1 us an instruction and thread): small head dims and lengths only."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_interp  # noqa: E402
from test_mla_ptx_emulated import ptx_of  # noqa: E402,F401  (the fixture: spec -> kernel.ptx)
from test_prefill_gpu import _cpu_ws, _emulate_merge, _FakeEvent, _plain, run_paged, run_ragged  # noqa: E402
from test_prefill_variants_gpu import run_variant  # noqa: E402

pytestmark = pytest.mark.compile
LOG2E = 1.0 / np.log(2.0)
PORTABLE = dict(prefill_backend="prefill_mma_sync")


class _Interpreted:
    """A ``batch_prefill_mma`` module stand-in: the real argument packer, then every CTA of the
    grid run by the PTX interpreter on the tensors' bytes (written back into them)."""

    def __init__(self, params, ptx_of, order):
        from cute_attn.families.base import get_family
        from cute_attn.families.spec import Spec
        from cute_attn.runtime.loader import make_packer

        self.abi = get_family("batch_prefill_mma").abi(params)
        self.pack = make_packer(self.abi)
        self.params = params
        self.ptx = ptx_of(Spec.make("batch_prefill_mma", "sm_90a", **params))
        self.order = order
        self.steps = 0
        self.turns = 0  # bar.arrive executed (the ping-pong's turns)

    def __call__(self, *args):
        args = [_plain(a) for a in args]
        self.pack(*args)
        tensors = args[:11]
        group, sm_scale, soft_cap, window_left, num_ctas = args[11:16]
        var = list(zip(self.abi[16:], args[16:]))
        var_t = [(a, t) for a, t in var if hasattr(a, "shape")]
        var_s = [(a, t) for a, t in var if not hasattr(a, "shape")]
        mem = ptx_interp.Memory()
        bases, regions = {}, {}
        for t in tensors + [t for _, t in var_t]:
            st = t.untyped_storage()  # views sharing a buffer (the workspace's sections) map to one region
            if st.data_ptr() not in regions:
                regions[st.data_ptr()] = mem.add(torch.empty(0, dtype=torch.uint8).set_(st).numpy())
            bases[id(t)] = regions[st.data_ptr()] + t.storage_offset() * t.element_size()
        if self.params["head_dim"] == 512:
            # kernels/decode_wide.py runs the MLA kernel's body: the ABI's tensors, group, causal, scale
            params = ptx_interp.pack_params(self.abi[:11], tensors, mem, bases)
            params += [int(group).to_bytes(4, "little"), int(self.params["causal"]).to_bytes(4, "little")]
            params.append((np.float32(sm_scale) * np.float32(LOG2E)).tobytes())
            for cta in range(num_ctas):
                c = ptx_interp.CTA(self.ptx, params, mem, 8 * self.params["tile_q"], ctaid=cta, order=self.order)
                c.run()
                self.steps += c.executed
            return
        # the host function's launch values (kernels/prefill_mma.py ``host``), in fp32
        cap = np.float32(soft_cap) if soft_cap > 0 else np.float32(1.0)
        scale_log2 = cap * np.float32(LOG2E) if self.params["soft_cap"] else np.float32(sm_scale) * np.float32(LOG2E)
        params = ptx_interp.pack_params(self.abi[:11], tensors, mem, bases)
        params += ptx_interp.pack_params([a for a, _ in var_t], [t for _, t in var_t], mem, bases)
        params += [int(group).to_bytes(4, "little"), np.float32(scale_log2).tobytes(), np.float32(sm_scale).tobytes()]
        params += [(np.float32(sm_scale) / cap).tobytes(), int(window_left).to_bytes(4, "little", signed=True)]
        params += [int(num_ctas).to_bytes(4, "little")]
        params += ptx_interp.pack_params([a for a, _ in var_s], [t for _, t in var_s], mem, bases)
        groups = self.params.get("groups", 1)  # 4-warp groups per CTA, each a CTA of the plan
        grid = (num_ctas + groups - 1) // groups
        for cta in range(grid):
            c = ptx_interp.CTA(self.ptx, params, mem, 128 * groups, ctaid=cta, order=self.order, grid=grid)
            c.run()
            assert not any(c.arrived.values()), f"arrivals that no wait met: {c.arrived}"
            self.turns += c.arrived_total
            self.steps += c.executed


@pytest.fixture(params=["forward", "reverse"])
def interp(request, monkeypatch, ptx_of):  # noqa: F811
    import cute_attn.wrappers.prefill_base as P

    mods = []

    class Merge:
        def __init__(self, params):
            self.params = params

        def __call__(self, *args):
            _emulate_merge(self.params, *[_plain(a) for a in args])

    def kernel(family, arch, **params):
        if family == "batch_prefill_mma":
            if params["tile_q"] == 64:
                params = dict(params, **TILE64_KNOBS)
            if params["tile_q"] == 128:
                params = dict(params, **TILE128_KNOBS)
            m = _Interpreted(params, ptx_of, request.param)
            mods.append(m)
            return m
        assert family == "merge_partials", family
        return Merge(params)

    monkeypatch.setattr(P, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 2)  # 4 CTAs (2 per SM): long KV is split
    monkeypatch.setattr(P, "kernel", kernel)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return mods


CPU = dict(device="cpu", seed=11)
TILE64_KNOBS: dict = {}  # spec knobs the interpreted 64-row kernels get (test_warps_m_knob)
TILE128_KNOBS: dict = {}  # and the 128-row ones (test_groups_knob)

# qo_lens, kv_lens, hq, hk, head_dim, dtype, page size (0: ragged), causal, soft_cap, window,
# plan extras, the tile (the planner's rule: mean packed rows per request -> 16 / 32 / 64 / 128)
CASES = [
    ([1, 1, 1], [70, 5, 130], 8, 2, 64, torch.bfloat16, 16, False, None, -1, {}, 16),  # decode-like
    ([4, 4], [40, 67], 8, 2, 64, torch.float16, 1, True, None, -1, {}, 16),  # multi-token, page 1
    ([8, 3], [19, 100], 8, 2, 64, torch.bfloat16, 0, True, None, -1, {}, 32),  # 2 x 2 warps, ragged
    ([40, 9], [40, 300], 4, 2, 64, torch.float16, 16, True, None, -1, {}, 64),  # 4 x 1 warps
    ([50, 7], [20, 90], 2, 2, 64, torch.bfloat16, 0, True, None, -1, {}, 32),  # causal qo > kv: rows see nothing
    ([33, 2], [150, 2], 4, 2, 64, torch.bfloat16, 0, True, 30.0, 20, {}, 64),  # soft-cap + window
    ([2, 3], [100, 71], 32, 4, 128, torch.bfloat16, 16, False, None, 40, {}, 32),  # head dim 128, window
    ([20], [200], 4, 2, 64, torch.bfloat16, 0, True, None, -1, dict(fixed_split_size=64), 128),  # split, merge
    # the 128-row tile (4 warps of 32 rows, Q read per k16 step from its single buffer): CTAs with
    # several items reload Q; a request of fewer rows than the tile
    ([70, 9], [80, 300], 4, 2, 64, torch.bfloat16, 0, True, None, -1, {}, 128),
    ([66, 70], [150, 90], 4, 2, 64, torch.float16, 16, True, 30.0, 20, {}, 128),  # soft-cap + window
    ([40, 30], [100, 71], 8, 2, 128, torch.bfloat16, 1, False, None, -1, {}, 128),  # head dim 128, page 1
    ([80], [300], 4, 2, 64, torch.bfloat16, 0, True, None, -1, dict(fixed_split_size=128), 128),  # split + merge
    # head dim 96: 192-byte rows in three 64-byte swizzle atom columns, the epilogue's column pieces
    ([1, 2], [70, 33], 8, 2, 96, torch.bfloat16, 16, False, None, -1, {}, 16),
    ([8, 3], [19, 100], 8, 2, 96, torch.float16, 0, True, None, -1, {}, 32),
    ([33, 2], [150, 2], 4, 2, 96, torch.bfloat16, 1, True, 30.0, 20, {}, 64),
    ([20], [200], 4, 2, 96, torch.bfloat16, 16, True, None, -1, dict(fixed_split_size=4), 64),  # (in pages)
    # head dim 80: 160-byte rows in five 32-byte swizzle atom columns
    ([1, 2], [70, 33], 8, 2, 80, torch.bfloat16, 16, False, None, -1, {}, 16),
    ([8, 3], [19, 100], 8, 2, 80, torch.float16, 0, True, None, -1, {}, 32),
    ([33, 2], [150, 2], 4, 2, 80, torch.bfloat16, 1, True, 30.0, 20, {}, 64),
    # head dim 256: Q read per k16 step from its buffer of the stage (several short items per CTA:
    # a buffer is refilled only once its item is done)
    ([1, 2, 1], [70, 33, 5], 8, 2, 256, torch.bfloat16, 16, False, None, -1, {}, 16),
    ([8, 3], [19, 100], 8, 2, 256, torch.float16, 0, True, None, -1, {}, 32),
    ([50, 30, 5, 30], [50, 300, 6, 30], 4, 2, 256, torch.bfloat16, 1, True, 30.0, -1, {}, 64),  # soft-cap
    ([20], [200], 4, 2, 256, torch.bfloat16, 16, True, None, -1, dict(fixed_split_size=4), 64),  # (in pages)
    # head dim 512 (kernels/decode_wide.py: 16- and 32-row tiles, one and two warp groups)
    ([1, 2], [70, 33], 8, 2, 512, torch.bfloat16, 16, False, None, -1, {}, 16),
    ([8, 3], [19, 100], 8, 2, 512, torch.float16, 0, True, None, -1, {}, 32),
    ([50, 7], [20, 90], 2, 2, 512, torch.bfloat16, 1, True, None, -1, {}, 32),  # causal qo > kv, page 1
    ([20], [200], 4, 2, 512, torch.bfloat16, 0, True, None, -1, dict(fixed_split_size=128), 32),  # split + merge
]


def _id(c):
    j = lambda xs: "_".join(map(str, xs))  # noqa: E731
    return (
        f"q{j(c[0])}-kv{j(c[1])}-h{c[2]}x{c[3]}-d{c[4]}-p{c[6]}"
        + ("-causal" if c[7] else "")
        + ("-split" if c[10] else "")
        + f"-t{c[11]}"
    )


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_compiled_kernel_matches_reference(interp, case):
    qo, kv, hq, hk, d, dtype, ps, causal, cap, window, extra, tile = case
    kw = dict(causal=causal, soft_cap=cap, window_left=window, workspace=_cpu_ws(), **CPU, **PORTABLE, **extra)
    if ps:
        w = run_paged(qo, kv, ps, hq, hk, d, dtype, **kw)[0]
    else:
        w = run_ragged(qo, kv, hq, hk, d, dtype, tail=3, **kw)[0]
    assert w._state.family == "batch_prefill_mma" and interp and interp[0].steps > 0
    assert w._tile == tile
    assert w._plan.has_split == bool(extra)  # the merge folded partials the interpreted kernel wrote


@pytest.mark.parametrize(
    "name,qo,kv,hq,hk,ps,tile",
    [
        ("sink", [40, 5], [60, 90], 4, 2, 0, 64),  # the register epilogue with finalize
        ("sink", [1, 2], [33, 70], 8, 2, 16, 16),  # the shared-memory ⊕ with finalize
        ("custom_mask", [9, 12], [30, 70], 4, 2, 16, 32),  # bitmaps
        ("sigmoid", [12, 3], [40, 75], 4, 2, 0, 16),  # no softmax
        ("sink", [100, 40], [120, 90], 4, 2, 0, 128),  # the 128-row tile with finalize
        ("custom_mask", [70, 66], [90, 100], 4, 2, 16, 128),  # the 128-row tile's per-row variant path
    ],
)
def test_compiled_variants_match_reference(interp, name, qo, kv, hq, hk, ps, tile):
    w = run_variant(
        name,
        torch.bfloat16,
        64,
        ps > 0,
        True,
        hq,
        hk,
        ps,
        qo,
        kv,
        workspace=_cpu_ws(),
        packed=ps > 0,
        **CPU,
        **PORTABLE,
    )[0]
    assert w._state.family == "batch_prefill_mma" and any(m.steps > 0 for m in interp)  # (sinks: run()'s kernel)
    assert w._tile == tile


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] == 64], ids=_id)
def test_warps_m_knob(interp, case, monkeypatch):
    """``warps_m=2`` at tile 64 (two warps of 32 rows per row group, their states merged in
    registers: ``_merge_pair_store``) on the 64-row cases."""
    monkeypatch.setitem(TILE64_KNOBS, "warps_m", 2)
    test_compiled_kernel_matches_reference(interp, case)
    assert any(m.params.get("warps_m") == 2 for m in interp)


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] == 128], ids=_id)
def test_groups_knob(interp, case, monkeypatch):
    """``groups=2`` at tile 128: two 4-warp groups per CTA, each running one CTA of the plan
    with its own shared memory and named barrier."""
    monkeypatch.setitem(TILE128_KNOBS, "groups", 2)
    test_compiled_kernel_matches_reference(interp, case)
    assert any(m.params.get("groups") == 2 and m.steps > 0 for m in interp)


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] == 128], ids=_id)
def test_pingpong_knob(interp, case, monkeypatch):
    """``groups=2, pingpong=1`` at tile 128: the two groups take turns ({P V of block j - 1, S of
    block j}) at named barriers; every wait must meet an arrival (the interpreter raises on a
    deadlock) whatever the two groups' numbers of items and blocks."""
    monkeypatch.setitem(TILE128_KNOBS, "groups", 2)
    monkeypatch.setitem(TILE128_KNOBS, "pingpong", 1)
    test_compiled_kernel_matches_reference(interp, case)
    assert any(m.params.get("pingpong") == 1 and m.steps > 0 for m in interp)
    assert sum(m.turns for m in interp) > 0  # the groups did take turns


@pytest.mark.parametrize("case", [c for c in CASES if c[-1] == 128], ids=_id)
def test_defer_knob(interp, case, monkeypatch):
    """``defer=1`` at tile 128: P V of block j - 1 beside S of block j in one CTA (the
    ping-pong's order without its turns), V loaded a block after K."""
    monkeypatch.setitem(TILE128_KNOBS, "defer", 1)
    test_compiled_kernel_matches_reference(interp, case)
    assert any(m.params.get("defer") == 1 and m.steps > 0 for m in interp)
