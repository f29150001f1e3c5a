"""Batch prefill over an fp8 KV cache (float8_e4m3fn / float8_e5m2, fp16 / bf16 queries): a
ragged cache at head dim 128 is read by the kernel itself, which widens each block in shared
memory (``kernels/prefill_sm90_kv8.py``); any other -- paged, other head dims, RoPE, or
``kv_pass=True`` -- goes through the KV pass (``kernels/kv_pass.py``), which dequantizes it into
contiguous 16-bit K / V for the unchanged 16-bit kernel (``wrappers/kv_gather.py``).  Both
widen exactly, so the in-kernel path must match the pass's bit for bit.

The reference is the fp32 one (``cute_attn.testing``) on the *dequantized* K / V (fp8 -> fp32,
and fp8 -> fp16 / bf16 in the pass, are exact), so the tests measure the kernels, not the
quantization; ``k_scale`` multiplies the logits (the reference's ``sm_scale``), ``v_scale`` the
output (FlashInfer's / vLLM's semantics).  The cache is built in fp32 with NaN in every slot no
request owns (spare pages, last-page slack, rows past the ragged KV) and converted to fp8 (NaN
stays NaN); outputs and LSE are pre-filled with NaN.  Tolerances: those of the 16-bit prefill
tests (tests/test_prefill_gpu.py ``check``): output relative L2 error bf16 2e-2, fp16 4e-3 (the
kernel rounds P to the query dtype); LSE (base 2) absolute 2e-3 where finite, -inf exactly where
the reference has it, o = 0 there.

GPU tests (marked ``gpu``; specs of the ``all`` preset): page sizes 1 / 16 / 64, NHD / HND,
tuple and single-tensor caches, head dims 64 / 128 / 256, e4m3 / e5m2, fp16 / bf16 queries, GQA
groups 1-8, causal and not, soft-cap and window, lengths 0 / 1 / odd / 8192 / a split-KV skew,
scales (floats and 1-element tensors), RoPE through the pass, a workspace too small for the
dequantized K / V, determinism, CUDA-graph capture + replay under new plans, the cascade.

CPU tests (run in CI): spec parameters and ABI; both wrappers against the emulated kernels of
tests/test_prefill_gpu.py (the pass and the kernel run on the exact tensors ``run()`` passes, after
the real argument packer): which kernels run, where the pass writes, CUDA-graph mode's fixed
region, the scales, RoPE, the cascade; every GPU case's specs are in the ``all`` preset; and a
``compile``-marked check of the pass's PTX / SASS (conversions present, no local memory).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from test_prefill_gpu import _cpu_ws, _cumsum, _Emulated, _fake_cuda, _gen, _ws, check, emu, make_paged, make_ragged  # noqa: F401

from cute_attn.families import backends
from cute_attn.families.backends import kv8_widening_pays
from cute_attn.testing import ragged_reference

gpu = pytest.mark.gpu
DEV = "cuda"
BF, F16 = torch.bfloat16, torch.float16
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# --------------------------------------------------------------------------- inputs


def _scale(x) -> float:
    """A scalar scale's value (a per-head one is applied to the reference's K / V: ``_per_head``)."""
    return 1.0 if x is None or (isinstance(x, torch.Tensor) and x.numel() > 1) else float(x)


def _per_head(x, t):
    """The reference's ``[tokens, kv_heads, dim]`` K or V with a per-kv-head scale applied.  A
    per-head k scale reaches the kernel multiplied into the 16-bit query, one more rounding of
    q (``wrappers/scales.py``; ``test_wrappers_api`` checks it is exactly one): the value tests
    draw k scales that are powers of 2, exact in that product, so they measure the kernel and
    the head mapping at the usual tolerances; v scales are any values (a multiply of the output)."""
    if isinstance(x, torch.Tensor) and x.numel() > 1:
        assert t.shape[1] == x.numel()
        return t * x.float().to(t.device).view(1, -1, 1)
    return t


class Fp8Case:
    """A planned wrapper and what run() and the reference need."""

    def __init__(self, w, q, kv_args, ref_kv, qo, kv_tok, dtype, ref_kw):
        self.w, self.q, self.kv_args, self.ref_kv = w, q, kv_args, ref_kv
        self.qo, self.kv_tok, self.dtype, self.ref_kw = qo, kv_tok, dtype, ref_kw

    def run(self, k_scale=None, v_scale=None, check_values=True):
        q, hq = self.q, self.q.shape[1]
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], hq), float("nan"), device=q.device)
        self.w.run(q, *self.kv_args, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
        if check_values:
            kw = dict(self.ref_kw)
            kw["sm_scale"] = _scale(k_scale) * kw.pop("sm_scale", 1.0 / math.sqrt(q.shape[2]))
            ref_kv = (_per_head(k_scale, self.ref_kv[0]), _per_head(v_scale, self.ref_kv[1]))
            ref_o, ref_lse = ragged_reference(q, *ref_kv, self.qo, self.kv_tok, **kw)
            check(out, lse, ref_o * _scale(v_scale), ref_lse, self.dtype)
        return out, lse


def plan_case(
    kind,
    qo_lens,
    kv_lens,
    hq,
    hk,
    d,
    *,
    page_size=16,
    q_dtype=BF,
    kv="e4m3",
    layout="NHD",
    single_tensor=False,
    causal=False,
    soft_cap=None,
    window_left=-1,
    device=None,
    workspace=None,
    seed=None,
    **plan_kw,
) -> Fp8Case:
    """Fresh random inputs (fp32, NaN where no request owns a slot, then fp8), a wrapper planned
    for them (``kind``: "paged" / "ragged")."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    f8 = FP8[kv]
    ws = workspace if workspace is not None else _ws(device)
    qo = torch.tensor(_cumsum(qo_lens), dtype=torch.int32)
    opts = dict(causal=causal, q_data_type=q_dtype, kv_data_type=f8, logits_soft_cap=soft_cap, window_left=window_left)
    if kind == "paged":
        cache, indptr, indices, last, (k, v), kv_tok = make_paged(
            kv_lens, page_size, hk, d, torch.float32, layout, single_tensor, gen, "cpu"
        )
        cache = cache.to(f8).to(device) if single_tensor else tuple(t.to(f8).to(device) for t in cache)
        q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(q_dtype).to(device)
        w = BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout)
        w.plan(qo, indptr, indices, last, hq, hk, d, page_size, **opts, **plan_kw)
        kv_args = (cache,)
    else:
        q, k8, v8, _, kv_tok, (k, v) = make_ragged(
            qo_lens, kv_lens, hq, hk, d, torch.float32, layout, gen, "cpu", tail=5
        )
        q = q.to(q_dtype).to(device)
        w = BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout=layout)
        w.plan(qo, kv_tok, hq, hk, d, **opts, **plan_kw)
        kv_args = (k8.to(f8).to(device), v8.to(f8).to(device))
    ref_kv = tuple(t.to(f8).float().to(device) for t in (k, v))  # the dequantized K / V
    ref_kw = dict(causal=causal, logits_soft_cap=soft_cap, window_left=window_left)
    if plan_kw.get("sm_scale") is not None:
        ref_kw["sm_scale"] = plan_kw["sm_scale"]
    return Fp8Case(w, q, kv_args, ref_kv, qo, kv_tok, q_dtype, ref_kw)


def run_case(*args, k_scale=None, v_scale=None, **kw) -> Fp8Case:
    c = plan_case(*args, **kw)
    c.run(k_scale, v_scale)
    return c


# =========================================================================== GPU tests
# The cases as data: test_cpu_gpu_cases_use_preset_specs plans each of them on the CPU.

LENS = ([1, 17, 128, 300, 5, 77], [1, 117, 128, 333, 2005, 77])  # kv = qo and kv > qo (append)
APPEND = ([250, 3, 700, 1, 64, 511, 9, 333, 100], [900, 3, 1500, 1200, 64, 511, 1400, 333, 2100])
EDGES = {
    "empty_requests": ([0, 5, 0, 300, 7, 2], [10, 0, 0, 500, 7, 0]),  # qo 0, kv 0, both 0
    "single_tokens": ([1, 1, 1], [1, 2, 1]),
    "odd": ([1, 3, 129, 77, 255], [1, 999, 129, 301, 1023]),
    "long_8k": ([8192], [8192]),
    "split_kv_skew": ([1, 4000, 3], [30000, 4000, 60000]),
    "no_keys": ([4, 9], [0, 0]),  # no kernel: o = 0, lse = -inf
}
SOFTCAP_WINDOW = [(30.0, -1), (None, 100), (50.0, 7), (None, 0)]
GPU_CASES = (
    [
        (f"pages-ps{ps}-{lay}-{'single' if st else 'tuple'}-c{int(c)}", ("paged",) + APPEND + (32, 8, 128),
         dict(page_size=ps, layout=lay, single_tensor=st, causal=c))
        for ps in (1, 16, 64) for lay in ("NHD", "HND") for st in (False, True) for c in (False, True)
    ]
    + [
        (f"dims-{kind}-d{d}-{kv}-{qd}-h{hq}x{hk}", (kind,) + LENS + (hq, hk, d),
         dict(kv=kv, q_dtype=dict(bf16=BF, f16=F16)[qd], causal=kind == "paged", layout="HND" if hq == 16 else "NHD"))
        for kind in ("paged", "ragged") for d in (64, 128, 256) for kv in ("e4m3", "e5m2") for qd in ("bf16", "f16")
        for hq, hk in ((8, 8), (32, 8), (16, 2))
    ]
    + [
        (f"group-{kind}-g{g}", (kind,) + LENS + (2 * g, 2, 128), dict(causal=True))
        for kind in ("paged", "ragged") for g in (1, 2, 3, 4, 5, 8)
    ]
    + [
        (f"softcap-window-{kind}-{cap}-{win}-c{int(c)}", (kind, [100, 333, 1, 1000, 64], [100, 900, 50, 1000, 2000],
         32, 8, 128), dict(soft_cap=cap, window_left=win, causal=c, kv="e5m2" if c else "e4m3"))
        for kind in ("paged", "ragged") for cap, win in SOFTCAP_WINDOW for c in (False, True)
    ]
    + [
        (f"lengths-{kind}-{name}", (kind,) + lens + (32, 8, 128),
         dict(causal=True, page_size=1 if kind == "paged" else 16))
        for kind in ("paged", "ragged") for name, lens in EDGES.items()
    ]
)  # fmt: skip
GPU_IDS = [c[0] for c in GPU_CASES]


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_fp8_prefill(case):
    _, args, kw = case
    c = run_case(*args, **kw)
    # hd128, ragged or in page boxes (page sizes k*16): widened by the kernel where the model says
    # it beats the pass; else through the pass, then the ragged kernel
    kind, qo, kv, hq, hk, d = args
    in_kernel = d == 128 and (kind == "ragged" or kw.get("page_size", 16) % 16 == 0)
    if in_kernel:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        in_kernel = kv8_widening_pays(qo, kv, hq, hk, d, kw.get("causal", False), c.w._tile, sms,
                                      kw.get("window_left", -1))  # fmt: skip
    assert (c.w._gathered is None) == in_kernel and c.w._spec_kw["paged"] == (kind == "paged" and in_kernel)
    pass_in_kernel = c.w._spec_kw.get("kv8_pass") is not None  # the pass run by the kernel itself
    assert not pass_in_kernel or (d == 128 and c.w._tile == 128 and c.w._spec_kw["kv8_pass"] == 1 + (kind == "paged"))
    assert c.w._spec_kw.get("kv_dtype") == (kw.get("kv", "e4m3") if in_kernel or pass_in_kernel else None)
    if "soft_cap" in kw:
        assert c.w._tile == 128  # the soft-cap / window kernels are compiled for 128-row tiles


@gpu
@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("k_scale,v_scale", [(0.5, 2.0), (3.0, None), (None, 0.25), ("t", "t"), ("h", "h"), ("h", 2.0)])
def test_fp8_scales(kind, k_scale, v_scale):
    """Float scales and 1-element tensors (vLLM's layer._k_scale); a CPU tensor too; per-kv-head
    tensors (cute_attn's extension)."""
    if k_scale == "t":
        k_scale, v_scale = torch.tensor([0.7], device=DEV), torch.tensor(1.3)
    if k_scale == "h":
        k_scale = 2.0 ** torch.randint(-2, 3, (8,), device=DEV).float()  # why powers of 2: _per_head
        v_scale = torch.rand(8, device=DEV) * 1.5 + 0.25 if v_scale == "h" else v_scale
    c = plan_case(kind, *LENS, 32, 8, 128, causal=True)
    c.run(k_scale, v_scale)
    c.run(k_scale, v_scale)  # the scales are not sticky
    c.run()


@gpu
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_fp8_deterministic(kind):
    c = plan_case(kind, [3000, 17, 1], [20000, 17, 900], 32, 8, 128, causal=True)
    out, lse = c.run()
    out2, lse2 = c.run(check_values=False)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@gpu
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_fp8_small_workspace_own_buffer(kind):
    """A 48 MiB workspace holds the plan but not 2 x 40000 tokens x 8 heads x 128 x 2 bytes: the
    pass writes into a buffer of the wrapper's own."""
    c = run_case(kind, [2000, 30], [40000, 30], 32, 8, 128, causal=True, workspace=_ws(DEV, 48), kv_pass=True)
    assert c.w._gathered[0].data_ptr() != c.w._workspace.data_ptr() + c.w._state.gather.offset
    assert not c.w._state.gather.in_workspace


KV8_CASES = [
    ("e4m3", BF, False, LENS),  # short requests: 64-row tiles
    ("e5m2", F16, True, LENS),
    ("e4m3", F16, True, ([4000, 1, 700], [4000, 9000, 700])),  # 128-row tiles, a split request
    ("e5m2", BF, False, ([2048, 300], [2048, 300])),
]


@gpu
@pytest.mark.parametrize("kv,q_dtype,causal,lens", KV8_CASES)
def test_fp8_ragged_in_kernel_matches_pass(kv, q_dtype, causal, lens):
    """The kernel's own widening of a ragged fp8 cache against the KV pass's (``kv_pass=True``)
    on the same inputs: both widen exactly and the consumers are the same code, so the outputs
    and LSE must be equal bit for bit (and both match the reference)."""
    seed = int(torch.randint(1 << 30, ()).item())
    own = plan_case("ragged", *lens, 32, 8, 128, kv=kv, q_dtype=q_dtype, causal=causal, seed=seed, kv_pass=False)
    pas = plan_case("ragged", *lens, 32, 8, 128, kv=kv, q_dtype=q_dtype, causal=causal, seed=seed, kv_pass=True)
    assert own.w._gathered is None and own.w._spec_kw["kv_dtype"] == kv
    assert pas.w._gathered is not None and ("kv_dtype" not in pas.w._spec_kw or pas.w._spec_kw.get("kv8_pass"))
    assert own.w._tile == pas.w._tile
    o1, l1 = own.run(0.5, 2.0)
    o2, l2 = pas.run(0.5, 2.0)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# (kv, q dtype, causal, (qo lens, kv lens), qo heads, kv heads) of the pass inside the kernel
PASS_IN_KERNEL_CASES = [
    ("e4m3", BF, True, ([8192], [8192]), 16, 16),  # 64 blocks x 16 heads: tasks race the consumers
    ("e5m2", F16, False, ([300, 1, 2000, 129, 700], [300, 1, 2000, 129, 700]), 32, 8),
    ("e4m3", BF, True, ([1, 4000, 3, 900], [30000, 4000, 60000, 900]), 32, 8),  # split KV, odd cut points
    ("e4m3", F16, True, ([0, 500, 0, 300, 7, 900], [10, 0, 0, 500, 7, 901]), 16, 4),  # empty requests
]


@gpu
@pytest.mark.parametrize("kv,q_dtype,causal,lens,hq,hk", PASS_IN_KERNEL_CASES)
def test_fp8_ragged_pass_in_kernel_matches_pass(monkeypatch, kv, q_dtype, causal, lens, hq, hk):
    """The pass inside the kernel (``kv8_pass``: producer warps dequantize each block once, the
    consumers wait for its flag) against the standalone pass on the same inputs: both convert
    by ``cvt`` and the consumers are the same code, so output and LSE must be equal bit for
    bit (and match the fp32 reference; run twice: the state is re-zeroed per launch)."""
    _pass_in_kernel_matches_host(monkeypatch, "ragged", lens, hq, hk, kv=kv, q_dtype=q_dtype, causal=causal)


def _pass_in_kernel_matches_host(monkeypatch, kind, lens, hq, hk, **kw):
    """Plan ``kind`` with the pass inside the kernel, on a workspace all NaN (0xff bytes: a block
    read past a request's end must meet converted rows), and with the standalone pass, on the
    same inputs; run both and the first again: equal bit for bit (``run`` also checks the fp32
    reference)."""
    seed = int(torch.randint(1 << 30, ()).item())
    nan_ws = torch.full((1 << 30,), 255, dtype=torch.uint8, device=DEV)
    inl = plan_case(kind, *lens, hq, hk, 128, seed=seed, kv_pass=True, workspace=nan_ws, **kw)
    assert inl.w._state.gather.in_workspace and inl.w._state.pass_module is None
    src = 2 if kind == "paged" else 1  # the kernel reads the ragged 16-bit copy either way
    assert inl.w._tile == 128 and inl.w._spec_kw.get("kv8_pass") == src and not inl.w._spec_kw["paged"]
    monkeypatch.setattr(backends, "KV8_PASS_IN_KERNEL", False)
    host = plan_case(kind, *lens, hq, hk, 128, seed=seed, kv_pass=True, **kw)
    assert "kv8_pass" not in host.w._spec_kw and host.w._state.pass_module is not None
    o1, l1 = inl.run(0.5, 2.0)
    o2, l2 = host.run(0.5, 2.0)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    o3, l3 = inl.run(0.5, 2.0)
    assert torch.equal(o1, o3) and torch.equal(l1, l3)


# (page size, layout, single tensor, kv, q dtype, causal, lens, qo heads, kv heads) of a paged cache's pass
PAGED_PASS_CASES = [
    (16, "NHD", False, "e4m3", BF, True, ([8192], [8192]), 16, 16),
    (1, "HND", True, "e5m2", F16, False, ([300, 1, 2000, 129, 700], [300, 1, 2000, 129, 700]), 32, 8),
    (64, "NHD", True, "e4m3", BF, True, ([1, 4000, 3, 900], [30000, 4000, 60000, 900]), 32, 8),
    (5, "HND", False, "e4m3", F16, True, ([0, 500, 0, 300, 7, 900], [10, 0, 0, 500, 7, 901]), 16, 4),
]


@gpu
@pytest.mark.parametrize("ps,layout,single,kv,q_dtype,causal,lens,hq,hk", PAGED_PASS_CASES)
def test_fp8_paged_pass_in_kernel_matches_pass(monkeypatch, ps, layout, single, kv, q_dtype, causal, lens, hq, hk):
    """A paged fp8 cache's pass inside the kernel (``kv8_pass`` 2: the helpers gather each
    block's rows through the page table with ``cp.async``) against the standalone paged pass on
    the same inputs, bit for bit, on an all-NaN workspace, twice (and against the reference)."""
    kw = dict(page_size=ps, layout=layout, single_tensor=single, kv=kv, q_dtype=q_dtype, causal=causal)
    _pass_in_kernel_matches_host(monkeypatch, "paged", lens, hq, hk, **kw)


@gpu
def test_fp8_ragged_pass_in_kernel_forward_flags():
    """forward()'s soft-cap / window on a plan whose kernel runs the fp8 pass: the kernel with
    those flags (it runs the pass too), against the reference -- and a plan with them."""
    lens = ([300, 1, 2000, 129, 700], [300, 1, 2000, 129, 700])
    c = plan_case("ragged", *lens, 32, 8, 128, causal=True, kv_pass=True)
    assert c.w._spec_kw.get("kv8_pass") == 1
    for cap, win in ((30.0, -1), (0.0, 100), (50.0, 7)):
        out, lse = c.w.forward_return_lse(c.q, *c.kv_args, causal=True, logits_soft_cap=cap, window_left=win)
        ref_o, ref_lse = ragged_reference(c.q, *c.ref_kv, c.qo, c.kv_tok, causal=True, logits_soft_cap=cap or None,
                                          window_left=win)  # fmt: skip
        check(out, lse, ref_o, ref_lse, c.dtype)
    p = plan_case("ragged", *lens, 32, 8, 128, causal=True, kv_pass=True, soft_cap=30.0, window_left=100)
    assert p.w._spec_kw.get("kv8_pass") == 1 and p.w._spec_kw["soft_cap"] and p.w._spec_kw["window"]
    p.run()


@gpu
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_fp8_ragged_in_kernel_every_byte(kv):
    """K and V drawn over every finite fp8 byte (subnormals, the largest values, both zeros):
    the kernel's widening against the pass's, bit for bit (a small sm_scale keeps the logits of
    values up to 448 / 57344 finite in fp32)."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    f8 = FP8[kv]
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f8).float().isfinite()
    byte_vals = torch.arange(256, dtype=torch.int32)[finite].to(torch.uint8)
    n, hq, hk, d = 1500, 16, 4, 128
    pick = lambda: byte_vals[torch.randint(len(byte_vals), (n, hk, d))].view(f8).cuda()  # noqa: E731
    k, v = pick(), pick()
    q = (torch.randn(n, hq, d) * 0.01).to(BF).cuda()
    ind = torch.tensor([0, 700, n], dtype=torch.int32)
    outs = []
    for kv_pass in (False, True):
        w = BatchPrefillWithRaggedKVCacheWrapper(_ws(DEV))
        w.plan(ind, ind, hq, hk, d, causal=True, q_data_type=BF, kv_data_type=f8, sm_scale=1e-4, kv_pass=kv_pass)
        assert (w._gathered is None) == (kv_pass is False)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((n, hq), float("nan"), device=DEV)
        w.run(q, k, v, out=out, lse=lse)
        outs.append((out, lse))
    assert outs[0][0].isfinite().all() and outs[0][1].isfinite().all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_fp8_rope(kind, kv):
    """RoPE (pos_encoding_mode ROPE_LLAMA): the pass dequantizes K and rotates it in fp32,
    rounded to bf16 (the reference rounds the rotated q / k the same way)."""
    from cute_attn.testing.reference import variant_reference

    c = plan_case(kind, [1, 17, 300, 5, 0, 77, 130], [1, 117, 300, 2005, 9, 77, 400], 32, 8, 128, kv=kv,
                  causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5)  # fmt: skip
    assert c.w._spec_kw.get("keys_transformed")
    out, lse = c.run(check_values=False)
    ref_o, ref_lse = variant_reference(c.q, *c.ref_kv, c.qo, c.kv_tok, causal=True, rope=(2.0, 5e5), rope_round_to=BF)
    check(out, lse, ref_o, ref_lse, BF)


def _graph_paged(ws, layout, max_b, max_pages, index_buf):
    """A CUDA-graph-mode paged wrapper with FlashInfer's index buffers (``index_buf(n)``: an
    int32 buffer of n entries, on the GPU or a fake CUDA one)."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    bufs = dict(
        qo_indptr_buf=index_buf(max_b + 1),
        paged_kv_indptr_buf=index_buf(max_b + 1),
        paged_kv_indices_buf=index_buf(max_pages),
        paged_kv_last_page_len_buf=index_buf(max_b),
    )
    return BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout, use_cuda_graph=True, **bufs)


def _cpu_index_buf(n):
    return _fake_cuda(torch.zeros(n, dtype=torch.int32))


def _random_pages(qo, kv, ps, max_pages, gen):
    """(qo indptr, page indptr, page ids, last page lengths) of requests with ``kv`` tokens in
    pages of ``ps`` drawn at random from ``max_pages``."""
    pages = [(n + ps - 1) // ps for n in kv]
    indices = torch.randperm(max_pages, generator=gen)[: sum(pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv, pages)], dtype=torch.int32)
    return torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(pages), dtype=torch.int32), indices, last


@gpu
# the pass with room past the plan or a buffer of its own; the kernel's widening (page boxes)
@pytest.mark.parametrize("ws_mb,kv_pass", [(512, True), (40, True), (512, None)])
def test_fp8_cuda_graph_paged_replay_with_new_plans(ws_mb, kv_pass):
    """Capture run() once (scales as floats), re-plan with other lengths and pages, replay: the
    pass (its bound read on the device, its token offsets padded to the batch capacity) or the
    widening kernel (CUDA-graph mode's default at page 16) follow the new plan."""
    hq, hk, d, ps, max_b, t_max, max_pages = 32, 8, 128, 16, 4, 2048, 4096
    gen = _gen()
    w = _graph_paged(_ws(DEV, ws_mb), "HND", max_b, max_pages, lambda n: torch.zeros(n, dtype=torch.int32, device=DEV))
    kc = torch.randn(max_pages, hk, ps, d, generator=gen).to(torch.float8_e4m3fn).cuda()
    vc = torch.randn(max_pages, hk, ps, d, generator=gen).to(torch.float8_e4m3fn).cuda()
    q = torch.randn(t_max, hq, d, generator=gen).to(BF).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(t_max, hq, device=DEV)

    def plan(qo, kv):
        qo_t, indptr, indices, last = _random_pages(qo, kv, ps, max_pages, gen)
        w.plan(qo_t, indptr, indices, last, hq, hk, d, ps, q_data_type=BF, kv_data_type=torch.float8_e4m3fn,
               causal=True, kv_pass=kv_pass)  # fmt: skip
        assert (w._gathered is None) == (kv_pass is None)
        return qo_t, indptr, indices, last

    plan([1024, 1024, 0, 0], [1024, 30000, 5, 16])  # the first plan fixes the pass's region
    w.run(q, (kc, vc), out=out, lse=lse, k_scale=0.5, v_scale=2.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, (kc, vc), out=out, lse=lse, k_scale=0.5, v_scale=2.0)
    from cute_attn.testing import paged_reference

    deq = (kc.float(), vc.float())
    for qo, kv in (([1, 2047, 0, 0], [9000, 2047, 1, 1]), ([500, 500, 500, 500], [500, 20000, 700, 900]),
                   ([3, 1, 4], [3, 1, 4])):  # fmt: skip
        qo_t, indptr, indices, last = plan(qo, kv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        n = int(qo_t[-1])
        ref_o, ref_lse = paged_reference(q[:n], deq, qo_t, indptr, indices, last, kv_layout="HND", causal=True,
                                         sm_scale=0.5 / math.sqrt(d))  # fmt: skip
        check(out, lse, 2.0 * ref_o, ref_lse, BF, rows=n)
    if kv_pass is None:
        assert w._spec_kw["paged"] and w._spec_kw["page_box"] == 16 and w._spec_kw["kv_dtype"] == "e4m3"
    elif ws_mb == 40:  # the first plan's 31045 kv tokens, rounded up to a power of two
        assert not w._state.gather.in_workspace and w._state.gather.tokens == 32768
        with pytest.raises(ValueError, match="kv tokens exceed"):
            plan([1, 1, 1, 1], [40000, 1, 1, 1])
    else:
        assert w._state.gather.in_workspace


@gpu
def test_fp8_cuda_graph_ragged_replay_with_new_plans():
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    hq, hk, d, t_max, kv_max = 16, 4, 128, 4096, 40000
    gen = _gen()
    w = BatchPrefillWithRaggedKVCacheWrapper(
        _ws(DEV), use_cuda_graph=True, qo_indptr_buf=torch.zeros(5, dtype=torch.int32, device=DEV),
        kv_indptr_buf=torch.zeros(5, dtype=torch.int32, device=DEV),
    )  # fmt: skip
    q = torch.randn(t_max, hq, d, generator=gen).to(BF).cuda()
    k = torch.randn(kv_max, hk, d, generator=gen).to(torch.float8_e5m2).cuda()
    v = torch.randn(kv_max, hk, d, generator=gen).to(torch.float8_e5m2).cuda()
    out, lse = torch.empty_like(q), torch.empty(t_max, hq, device=DEV)

    def plan(qo, kv):
        qo_t, kv_t = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(kv), dtype=torch.int32)
        w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=BF, kv_data_type=torch.float8_e5m2)
        return qo_t, kv_t

    plan([2000, 24, 1000, 1072], [2000, 1024, 1007, 4072])
    w.run(q, k, v, out=out, lse=lse, v_scale=0.5)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out, lse=lse, v_scale=0.5)
    for qo, kv in (([1, 1, 1, 4093], [1, 1, 1, 30000]), ([5, 77, 300, 1], [5, 77, 300, 1]), ([2000, 24], [2000, 24])):
        qo_t, kv_t = plan(qo, kv)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        n = int(qo_t[-1])
        ref_o, ref_lse = ragged_reference(q[:n], k.float(), v.float(), qo_t, kv_t, causal=True)
        check(out, lse, 0.5 * ref_o, ref_lse, BF, rows=n)


@gpu
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("decode_kernel", [None, False])
def test_fp8_cascade(decode_kernel, per_head):
    """A shared prefix + each request's own tokens, one query per request, fp8 cache: the prefix
    level through the KV pass, the own level on the fp8 decode kernel (or the prefill one);
    float scales or per-kv-head ones."""
    from test_cascade import _two_level, make_cascade, plan_args

    from cute_attn import MultiLevelCascadeAttentionWrapper

    batch, hq, hk, d, ps = 6, 32, 8, 128, 16
    groups, segs = _two_level(batch, 900, [5, 300, 17, 1, 64, 99])
    q, cache, levels, (k_cat, v_cat, cat_tok) = make_cascade(
        groups, segs, [1] * batch, ps, hq, hk, d, torch.float32, "NHD", _gen(), "cpu"
    )
    q, cache = q.to(BF).cuda(), tuple(t.to(torch.float8_e4m3fn).cuda() for t in cache)
    w = MultiLevelCascadeAttentionWrapper(2, torch.empty(256 << 20, dtype=torch.uint8, device=DEV))
    w.plan(*plan_args(levels), hq, hk, d, ps, q_data_type=BF, kv_data_type=torch.float8_e4m3fn,
           decode_kernel=decode_kernel)  # fmt: skip
    ks, vs = 0.5, 2.0
    if per_head:
        ks, vs = 2.0 ** torch.randint(-2, 3, (hk,), device=DEV).float(), torch.rand(hk, device=DEV) + 0.25
    out, lse = w.run(q, cache, return_lse=True, k_scale=ks, v_scale=vs)
    deq = [_per_head(x, t.to(torch.float8_e4m3fn).float().cuda()) for x, t in ((ks, k_cat), (vs, v_cat))]
    ref_o, ref_lse = ragged_reference(q, *deq, torch.arange(batch + 1), cat_tok, sm_scale=_scale(ks) / math.sqrt(d))
    check(out, lse, _scale(vs) * ref_o, ref_lse, BF)


# =========================================================================== CPU tests


def test_cpu_fp8_specs_and_abi():
    from cute_attn.families.base import get_family
    from cute_attn.families.kv_pass import kv_pass_spec, shipped_specs
    from cute_attn.presets import preset_specs

    sp = kv_pass_spec("sm_90a", "bf16", 128, True, None, "e4m3")
    assert sp.pdict == dict(dtype="bf16", head_dim=128, paged=True, kv_dtype="e4m3")
    # a cache of the output dtype: no kv_dtype parameter (the 16-bit specs' parameters unchanged)
    assert kv_pass_spec("sm_90a", "bf16", 128, True, None, "bf16").pdict == dict(dtype="bf16", head_dim=128, paged=True)
    assert kv_pass_spec("sm_90a", "f16", 64, False, None) is None  # ragged 16-bit: nothing to do
    assert kv_pass_spec("sm_90a", "f16", 64, False, None, "e5m2").pdict["paged"] is False
    with pytest.raises(ValueError, match="only an fp8 cache"):
        kv_pass_spec("sm_90a", "bf16", 128, True, None, "f16")
    abi = {a.name: a for a in get_family("kv_pass").abi(sp.pdict)}
    assert abi["mK"].dtype == abi["mV"].dtype == "e4m3" and abi["mKout"].dtype == abi["mVout"].dtype == "bf16"
    assert abi["mK"].stride_divisibility == 16 and abi["mKout"].stride_divisibility == 8  # whole 16-byte vectors
    fp8 = [s for s in shipped_specs("sm_90a") if "kv_dtype" in s.pdict]
    assert len(fp8) == 2 * 3 * 2 * 2  # output dtype x head dim x fp8 kind x paged / ragged
    assert set(fp8) <= set(preset_specs("default", "sm_90a")) and not shipped_specs("sm_100a")
    # the ragged kernels that widen an fp8 cache themselves: head dim 128 only, an fp8 K / V in the ABI
    from cute_attn.families import prefill

    kv8 = [s for s in prefill.shipped_specs("sm_90a") if "kv_dtype" in s.pdict]
    pages = {(s.pdict["head_dim"], s.pdict["paged"], s.pdict.get("page_box")) for s in kv8}
    assert pages == {(128, False, None), (128, True, 16)}
    assert {s.pdict["kv_dtype"] for s in kv8} == {"e4m3", "e5m2"} and set(kv8) <= set(preset_specs("default", "sm_90a"))
    abi = {a.name: a for a in get_family("batch_prefill_sm90").abi(kv8[0].pdict)}
    assert abi["mK"].dtype == abi["mV"].dtype == kv8[0].pdict["kv_dtype"] and abi["mQ"].dtype == kv8[0].pdict["dtype"]
    for bad in (dict(head_dim=64), dict(paged=True), dict(head_dim=192, head_dim_vo=128)):
        args = dict(dtype="bf16", head_dim=128, tile_q=128, paged=False) | bad
        with pytest.raises(ValueError, match="through the KV pass"):
            prefill.prefill_spec("sm_90a", args.pop("dtype"), args.pop("head_dim"), args.pop("tile_q"),
                                 args.pop("paged"), kv_dtype="e4m3", **args)  # fmt: skip
    # the pass inside the kernel: 16-bit K / V (the copy it writes), then the fp8 cache, its state and plan
    from cute_attn.variants.builtins import FlashSigmoid

    inl = [s for s in kv8 if s.pdict.get("kv8_pass")]
    # ragged / paged cache x dtype x fp8 kind x causal x (plain, soft-cap, window, both); the
    # kernel itself reads the ragged 16-bit copy either way
    assert len(inl) == 2 * 2 * 2 * 2 * 4 and all(s.pdict["tile_q"] == 128 and not s.pdict["paged"] for s in inl)
    assert {s.pdict["kv8_pass"] for s in inl} == {prefill.KV8_PASS_RAGGED, prefill.KV8_PASS_PAGED}
    pass_tensors = {
        prefill.KV8_PASS_RAGGED: ["mK8", "mV8", "mPassState", "mPassPlan"],
        prefill.KV8_PASS_PAGED: ["mK8", "mV8", "mPassState", "mPassPlan", "mPassPageIndptr", "mPassPageIds"],
    }
    for src, want in pass_tensors.items():
        spec = next(s for s in inl if s.pdict["kv8_pass"] == src)
        abi = get_family("batch_prefill_sm90").abi(spec.pdict)
        names = [a.name for a in abi]
        assert names[names.index("num_ctas") + 1 :] == want
        by = {a.name: a for a in abi}
        assert by["mK"].dtype == by["mV"].dtype == spec.pdict["dtype"]
        assert by["mK8"].dtype == by["mV8"].dtype == spec.pdict["kv_dtype"]
        assert all(by[n].dtype == "i32" for n in want[2:])
    bad_args = (dict(paged=True, page_box=16), dict(tile_q=64), dict(variant=FlashSigmoid()), dict(kv8_pass=3))
    for bad in bad_args:
        args = dict(dtype="bf16", head_dim=128, tile_q=128, paged=False, kv8_pass=True) | bad
        with pytest.raises(ValueError, match="kv8_pass"):
            prefill.prefill_spec("sm_90a", args.pop("dtype"), args.pop("head_dim"), args.pop("tile_q"),
                                 args.pop("paged"), kv_dtype="e4m3", **args)  # fmt: skip


def _calls(emu):
    return [f for f, _ in emu.calls]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single_tensor", [False, True])
@pytest.mark.parametrize("kv,q_dtype", [("e4m3", BF), ("e5m2", F16)])
def test_cpu_fp8_paged_wiring(emu, page_size, layout, single_tensor, kv, q_dtype):
    """Short queries (the 16-bit plan would not take the pass): an fp8 cache always goes through
    it, into the workspace past the plan, then the ragged kernel."""
    c = run_case("paged", [3, 50, 0, 1], [40, 900, 7, 1], 8, 2, 64, page_size=page_size, layout=layout,
                 single_tensor=single_tensor, kv=kv, q_dtype=q_dtype, causal=True, device="cpu",
                 workspace=_cpu_ws(), seed=3)  # fmt: skip
    assert _calls(emu)[:2] == ["kv_pass", "batch_prefill_sm90"]
    assert emu.calls[0][1] == dict(dtype=dict([(BF, "bf16"), (F16, "f16")])[q_dtype], head_dim=64, paged=True,
                                   kv_dtype=kv)  # fmt: skip
    assert not emu.calls[1][1]["paged"] and "page_box" not in emu.calls[1][1]
    g = c.w._state.gather
    assert g.in_workspace and g.offset >= c.w._planner.layout.total_bytes and g.offset % 256 == 0
    assert c.w._gathered[0].dtype == q_dtype and c.w._gathered[0].shape == (1, 948, 2, 64)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv,q_dtype", [("e4m3", F16), ("e5m2", BF)])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_fp8_ragged_wiring(emu, layout, kv, q_dtype, causal):
    c = run_case("ragged", [1, 17, 40, 0, 9], [1, 40, 90, 9, 9], 8, 2, 64, layout=layout, kv=kv, q_dtype=q_dtype,
                 causal=causal, device="cpu", workspace=_cpu_ws(), seed=4, window_left=20)  # fmt: skip
    assert _calls(emu)[:2] == ["kv_pass", "batch_prefill_sm90"]
    assert emu.calls[0][1]["kv_dtype"] == kv and not emu.calls[0][1]["paged"]
    assert c.w._gathered[0].shape == (1, 149, 2, 64)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv,q_dtype", [("e4m3", F16), ("e5m2", BF)])
def test_cpu_fp8_ragged_in_kernel_wiring(emu, layout, kv, q_dtype, monkeypatch):
    """Ragged at head dim 128: the kernel (spec ``kv_dtype``) reads the fp8 cache itself, no pass;
    ``kv_pass=True`` takes the pass; RoPE takes it too (the pass rotates the keys)."""
    lens = ([1, 17, 40, 0, 9], [1, 40, 90, 9, 9])
    c = run_case("ragged", *lens, 8, 2, 128, layout=layout, kv=kv, q_dtype=q_dtype, causal=True, device="cpu",
                 workspace=_cpu_ws(), seed=4, k_scale=0.5, v_scale=2.0)  # fmt: skip
    assert _calls(emu)[0] == "batch_prefill_sm90" and "kv_pass" not in _calls(emu)
    assert emu.calls[0][1]["kv_dtype"] == kv and not emu.calls[0][1]["paged"]
    assert c.w._gathered is None and c.w._state.pass_module is None
    emu.calls.clear()
    c = run_case("ragged", *lens, 8, 2, 128, layout=layout, kv=kv, q_dtype=q_dtype, device="cpu",
                 workspace=_cpu_ws(), seed=4, kv_pass=True)  # fmt: skip
    # the pass runs inside the 128-row kernel (spec kv8_pass; the emulation checks its task list)
    assert c.w._tile == 128 and _calls(emu) == ["batch_prefill_sm90"] and emu.calls[0][1]["kv8_pass"] == 1
    assert c.w._gathered is not None and c.w._state.pass_module is None
    emu.calls.clear()
    monkeypatch.setattr(backends, "KV8_PASS_IN_KERNEL", False)  # the standalone pass, then the kernel
    c = run_case("ragged", *lens, 8, 2, 128, layout=layout, kv=kv, q_dtype=q_dtype, device="cpu",
                 workspace=_cpu_ws(), seed=4, kv_pass=True)  # fmt: skip
    assert _calls(emu)[:2] == ["kv_pass", "batch_prefill_sm90"] and "kv_dtype" not in emu.calls[1][1]
    c = plan_case("ragged", *lens, 8, 2, 128, kv=kv, q_dtype=q_dtype, device="cpu", workspace=_cpu_ws(), seed=4,
                  pos_encoding_mode="ROPE_LLAMA")  # fmt: skip
    assert "kv_dtype" not in c.w._spec_kw and c.w._spec_kw["keys_transformed"] and c.w._state.pass_module is not None


def test_cpu_fp8_ragged_in_kernel_missing(emu, monkeypatch):
    """A cache built without the widening kernel: the plan falls back to the pass (kv_pass unset)
    or fails (kv_pass=False); a 16-bit ragged plan refuses kv_pass."""
    import cute_attn.wrappers.prefill_base as P
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper
    from cute_attn.runtime.loader import KernelNotAvailable

    load = P.kernel

    def no_kv8(family, arch, **params):
        if "kv_dtype" in params and family == "batch_prefill_sm90":
            raise KernelNotAvailable("not in this cache")
        return load(family, arch, **params)

    monkeypatch.setattr(P, "kernel", no_kv8)
    c = run_case("ragged", [5, 30], [20, 30], 8, 2, 128, device="cpu", workspace=_cpu_ws(), seed=5)
    assert _calls(emu)[:2] == ["kv_pass", "batch_prefill_sm90"] and c.w._gathered is not None
    with pytest.raises(KernelNotAvailable):
        plan_case("ragged", [5, 30], [20, 30], 8, 2, 128, device="cpu", workspace=_cpu_ws(), kv_pass=False)
    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws())
    ind = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="only dequantizes an fp8"):
        w.plan(ind, ind, 8, 2, 128, q_data_type=BF, kv_pass=True)


def test_cpu_fp8_widening_or_pass(emu, monkeypatch):
    """The cost model (families.backends.kv8_widening_pays) picks the pass for long prefills and
    the kernel's widening for short queries over long keys; CUDA-graph mode and fixed_split_size
    always widen (nothing may depend on the batch), and a graph-mode re-plan with kv_pass=True
    is refused."""
    import cute_attn.wrappers.prefill_base as P
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)  # the model's constants are an H200's
    pays = lambda qo, kv, causal: kv8_widening_pays(qo, kv, 16, 16, 128, causal, 128, 132)  # noqa: E731
    assert not pays([8192] * 2, [8192] * 2, True) and not pays([8192] * 2, [8192] * 2, False)
    assert pays([512] * 2, [8192] * 2, True) and pays([4] * 64, [4096] * 64, True) and pays([9], [9], False)
    long_ = plan_case("ragged", [6000], [6000], 8, 8, 128, device="cpu", workspace=_cpu_ws(256), causal=True)
    assert long_.w._gathered is not None
    short = plan_case("ragged", [64, 64], [6000, 5000], 8, 8, 128, device="cpu", workspace=_cpu_ws(256))
    assert short.w._gathered is None and short.w._spec_kw["kv_dtype"] == "e4m3"
    fixed = plan_case("ragged", [6000], [6000], 8, 8, 128, device="cpu", workspace=_cpu_ws(256), causal=True,
                      fixed_split_size=4096)  # fmt: skip
    assert fixed.w._gathered is None
    ind = _fake_cuda(torch.zeros(3, dtype=torch.int32))
    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(256), use_cuda_graph=True, qo_indptr_buf=ind,
                                             kv_indptr_buf=_fake_cuda(torch.zeros(3, dtype=torch.int32)))  # fmt: skip
    kw = dict(causal=True, q_data_type=BF, kv_data_type=torch.float8_e4m3fn)
    for n in (6000, 100):
        w.plan(torch.tensor([0, n]), torch.tensor([0, n]), 8, 8, 128, **kw)
        assert w._gathered is None and w._spec_kw["kv_dtype"] == "e4m3"
    with pytest.raises(ValueError, match="changed"):
        w.plan(torch.tensor([0, 100]), torch.tensor([0, 100]), 8, 8, 128, kv_pass=True, **kw)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_cpu_fp8_scales(emu, kind):
    """k_scale (and q_scale) fold into the kernel's softmax scale, v_scale multiplies the output;
    a float, a 0-d or 1-element tensor."""
    c = plan_case(kind, [5, 30], [20, 30], 8, 2, 64, device="cpu", workspace=_cpu_ws(), seed=5)
    per_head = 2.0 ** torch.randint(-2, 3, (2,)).float(), torch.rand(2, generator=_gen(None)) + 0.25
    for ks, vs in ((0.5, 2.0), (torch.tensor(0.25), torch.tensor([3.0])), (None, 0.5), (2.0, None), per_head):
        emu.calls.clear()
        c.run(ks, vs)
    out, _ = c.run(0.5, None)
    out4, _ = c.run(0.5, 4.0)
    assert torch.equal(out4, out * 4)  # v_scale: one multiply of the output (exact by a power of 2)


def test_cpu_fp8_own_buffer_and_growth(emu):
    """A workspace with room for the plan but not for the dequantized K / V: a buffer of the
    wrapper's own, grown by a larger plan (the previous plan's views keep the old one alive),
    reused by a smaller one; a plan whose K / V fit goes back to the workspace."""
    c = plan_case("paged", [3, 50], [40, 900], 8, 2, 64, device="cpu", workspace=_cpu_ws(), seed=6)
    small = _fake_cuda(torch.empty(c.w._planner.layout.total_bytes + 4096, dtype=torch.uint8))
    row = 2 * 64 * 2  # bytes of one token's K: kv heads x head_dim x bf16
    sizes = []
    for kv, fits in (([40, 900], False), ([40, 1900], False), ([40, 100], False), ([3, 4], True)):
        c = run_case("paged", [3, 4], kv, 8, 2, 64, device="cpu", workspace=small, seed=6)
        g = c.w._state.gather
        assert g.in_workspace == fits and g.tokens == sum(kv)
        if not fits:
            assert g.buf is c.w._gather_buf and g.buf.numel() >= 2 * sum(kv) * row
        sizes.append(None if fits else g.buf.numel())
    assert sizes[1] > sizes[0]


def test_cpu_fp8_one_wrapper_replans(emu):
    """One wrapper, plans that need more and less room: the own buffer grows once and is reused."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper

    c = plan_case("paged", [3, 50], [40, 900], 8, 2, 64, device="cpu", workspace=_cpu_ws(), seed=6)
    w = BatchPrefillWithPagedKVCacheWrapper(_fake_cuda(torch.empty(c.w._planner.layout.total_bytes + 4096,
                                                                   dtype=torch.uint8)))  # fmt: skip
    bufs = []
    for kv in (900, 1900, 100):
        pages = torch.arange(kv // 4, dtype=torch.int32)  # page size 4
        w.plan(torch.tensor([0, 5]), torch.tensor([0, kv // 4]), pages, torch.tensor([4]), 8, 2, 64, 4,
               q_data_type=BF, kv_data_type=torch.float8_e4m3fn)  # fmt: skip
        assert not w._state.gather.in_workspace and w._state.gather.tokens == kv
        bufs.append(w._gather_buf)
    assert bufs[0] is not bufs[1] and bufs[1] is bufs[2] and bufs[1].numel() >= 2 * 1900 * 256


def test_cpu_fp8_kv_pass_false_and_missing_kernels(emu, monkeypatch):
    import cute_attn.wrappers.prefill_base as P
    from cute_attn.runtime.loader import KernelNotAvailable

    with pytest.raises(ValueError, match="kv_pass=False with an fp8 KV cache"):
        plan_case("paged", [3], [40], 8, 2, 64, device="cpu", workspace=_cpu_ws(), kv_pass=False)
    plan_case("paged", [3], [40], 8, 2, 64, device="cpu", workspace=_cpu_ws(), kv_pass=True)
    load = P.kernel

    def no_pass(family, arch, **params):
        if family == "kv_pass":
            raise KernelNotAvailable("kv_pass is not in this cache")
        return load(family, arch, **params)

    monkeypatch.setattr(P, "kernel", no_pass)
    for kind in ("paged", "ragged"):  # no fallback: the kernel cannot read an fp8 cache itself
        with pytest.raises(KernelNotAvailable):
            plan_case(kind, [400, 5], [400, 20], 32, 4, 64, page_size=1, device="cpu", workspace=_cpu_ws())


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_cpu_fp8_cuda_graph_mode(emu, kind):
    """The first fp8 plan fixes the pass's region (zeroed, all the workspace's room past the
    plan) and, paged, its token-offset buffer (padded to the capacity); later plans reuse both
    and the pass walks the whole capacity; more kv tokens than the region holds is an error."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    hq, hk, d, cap = 8, 2, 64, 4
    bufs = [_fake_cuda(torch.zeros(n, dtype=torch.int32)) for n in (cap + 1, cap + 1, 600, cap)]
    if kind == "paged":
        w = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws(), use_cuda_graph=True, qo_indptr_buf=bufs[0],
                                                paged_kv_indptr_buf=bufs[1], paged_kv_indices_buf=bufs[2],
                                                paged_kv_last_page_len_buf=bufs[3])  # fmt: skip
        cache = tuple(torch.randn(600, 1, hk, d).to(torch.float8_e4m3fn) for _ in range(2))
    else:
        w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws(), use_cuda_graph=True, qo_indptr_buf=bufs[0],
                                                 kv_indptr_buf=bufs[1])  # fmt: skip
        cache = tuple(torch.randn(600, hk, d).to(torch.float8_e4m3fn) for _ in range(2))
    q = torch.randn(300, hq, d).to(BF)
    deq = tuple(t.float() for t in cache)
    views = None
    for qo, kv in (([100, 100, 100], [200, 150, 100]), ([1, 5, 0, 9], [1, 5, 500, 9]), ([50], [50])):
        qo_t, kv_t = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(kv), dtype=torch.int32)
        if kind == "paged":  # page size 1: page ids = token ids
            w.plan(qo_t, kv_t, torch.arange(int(kv_t[-1]), dtype=torch.int32), torch.ones(len(qo), dtype=torch.int32),
                   hq, hk, d, 1, causal=True, q_data_type=BF, kv_data_type=torch.float8_e4m3fn)  # fmt: skip
        else:
            w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=BF, kv_data_type=torch.float8_e4m3fn)
        g = w._state.gather
        if views is None:
            views = [t.data_ptr() for t in w._gathered]
            assert g.in_workspace and g.tokens > 600 and (w._gathered[0] == 0).all()
        assert [t.data_ptr() for t in w._gathered] == views and w._gathered[0].shape[1] == g.tokens
        emu.calls.clear()
        out = torch.full_like(q, float("nan"))
        lse = torch.full((300, hq), float("nan"))
        w.run(q, *((cache,) if kind == "paged" else cache), out=out, lse=lse)
        assert _calls(emu) == ["kv_pass", "batch_prefill_sm90", "merge_partials"]
        n = int(qo_t[-1])
        k_ref = deq[0].reshape(600, hk, d)[: int(kv_t[-1])]
        v_ref = deq[1].reshape(600, hk, d)[: int(kv_t[-1])]
        ref_o, ref_lse = ragged_reference(q[:n], k_ref, v_ref, qo_t, kv_t, causal=True)
        check(out, lse, ref_o, ref_lse, BF, rows=n)
        if kind == "paged":
            tok = w._state.inputs.kv_tok_indptr
            assert tok is w._kv_tok_buf and tok.numel() == cap + 1 and (tok[len(qo) :] == kv_t[-1]).all()
    small = _fake_cuda(torch.empty(w._planner.layout.total_bytes + 8192, dtype=torch.uint8))
    w.reset_workspace_buffer(small)  # a new workspace: the next plan fixes the region anew (an own buffer)
    qo_t, kv_t = torch.tensor([0, 5]), torch.tensor([0, 300])
    if kind == "ragged":
        w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=BF, kv_data_type=torch.float8_e4m3fn)
        assert not w._state.gather.in_workspace and w._state.gather.tokens == 512  # rounded up
        with pytest.raises(ValueError, match="kv tokens exceed the 512"):
            w.plan(qo_t, torch.tensor([0, 513]), hq, hk, d, causal=True, q_data_type=BF,
                   kv_data_type=torch.float8_e4m3fn)  # fmt: skip
    with pytest.raises(ValueError, match="changed"):  # the cache dtype is baked too
        if kind == "ragged":
            w.plan(qo_t, kv_t, hq, hk, d, causal=True, q_data_type=BF, kv_data_type=torch.float8_e5m2)
        else:
            w.plan(qo_t, kv_t, torch.arange(300, dtype=torch.int32), torch.ones(1, dtype=torch.int32), hq, hk, d, 1,
                   causal=True, q_data_type=BF, kv_data_type=torch.float8_e5m2)  # fmt: skip


def test_cpu_fp8_cuda_graph_paged_page16_replans(emu):
    """CUDA-graph mode at page 16 (a page size the kernel would read by TMA boxes): the first
    fp8 plan fixes the ragged kernel (the pass gathers, page_box 0), and re-plans with other
    lengths and pages keep it (the H200 run at 904362b refused them: the plan's page_box was
    compared before the pass took the pages)."""
    from cute_attn.testing import paged_reference

    hq, hk, d, ps, max_b, max_pages = 8, 2, 64, 16, 4, 256
    gen = _gen(9)
    w = _graph_paged(_cpu_ws(), "HND", max_b, max_pages, _cpu_index_buf)
    kc = torch.randn(max_pages, hk, ps, d, generator=gen).to(torch.float8_e4m3fn)
    vc = torch.randn(max_pages, hk, ps, d, generator=gen).to(torch.float8_e4m3fn)
    q = torch.randn(200, hq, d, generator=gen).to(BF)
    for qo, kv in (([100, 100, 0, 0], [100, 2000, 5, 16]), ([1, 199, 0, 0], [900, 199, 1, 1]), ([3, 1, 4], [3, 1, 4])):
        qo_t, indptr, indices, last = _random_pages(qo, kv, ps, max_pages, gen)
        w.plan(qo_t, indptr, indices, last, hq, hk, d, ps, q_data_type=BF, kv_data_type=torch.float8_e4m3fn,
               causal=True)  # fmt: skip
        assert "page_box" not in w._spec_kw and not w._spec_kw["paged"]
        out = torch.full_like(q, float("nan"))
        lse = torch.full((200, hq), float("nan"))
        w.run(q, (kc, vc), out=out, lse=lse, k_scale=0.5, v_scale=2.0)
        n = int(qo_t[-1])
        ref_o, ref_lse = paged_reference(q[:n], (kc.float(), vc.float()), qo_t, indptr, indices, last,
                                         kv_layout="HND", causal=True, sm_scale=0.5 / math.sqrt(d))  # fmt: skip
        check(out, lse, 2.0 * ref_o, ref_lse, BF, rows=n)


def test_cpu_fp8_cuda_graph_paged_widening_replans(emu):
    """CUDA-graph mode at page 16, hd128: the kernel widens the paged cache (page boxes) for every
    plan (the first fixes it; re-plans with other lengths keep it, outputs checked); a re-plan
    asking for the pass is refused."""
    from cute_attn.testing import paged_reference

    hq, hk, d, ps, max_b, max_pages = 8, 2, 128, 16, 4, 256
    gen = _gen(11)
    w = _graph_paged(_cpu_ws(), "NHD", max_b, max_pages, _cpu_index_buf)
    kc = torch.randn(max_pages, ps, hk, d, generator=gen).to(torch.float8_e4m3fn)
    vc = torch.randn(max_pages, ps, hk, d, generator=gen).to(torch.float8_e4m3fn)
    q = torch.randn(120, hq, d, generator=gen).to(BF)

    def plan(qo, kv, **kw):
        qo_t, indptr, indices, last = _random_pages(qo, kv, ps, max_pages, gen)
        w.plan(qo_t, indptr, indices, last, hq, hk, d, ps, q_data_type=BF, kv_data_type=torch.float8_e4m3fn,
               causal=True, **kw)  # fmt: skip
        return qo_t, indptr, indices, last

    for qo, kv in (([100, 20], [600, 20]), ([1, 3, 4], [1000, 3, 40])):
        qo_t, indptr, indices, last = plan(qo, kv)
        assert w._gathered is None and w._spec_kw["paged"] and w._spec_kw["page_box"] == 16
        out = torch.full_like(q, float("nan"))
        lse = torch.full((120, hq), float("nan"))
        w.run(q, (kc, vc), out=out, lse=lse)
        n = int(qo_t[-1])
        ref_o, ref_lse = paged_reference(q[:n], (kc.float(), vc.float()), qo_t, indptr, indices, last,
                                         kv_layout="NHD", causal=True)  # fmt: skip
        check(out, lse, ref_o, ref_lse, BF, rows=n)
    with pytest.raises(ValueError, match="changed"):
        plan([3], [30], kv_pass=True)


@pytest.fixture
def emu_variants(monkeypatch, emu):
    """``emu`` with the variant emulation of tests/test_prefill_variants_gpu.py for the kernel."""
    from test_prefill_variants_gpu import _emulate_variant_prefill

    import cute_attn.wrappers.prefill_base as P

    monkeypatch.setattr(
        P, "kernel", lambda family, arch, **params: _Emulated(family, params, emu.calls, _emulate_variant_prefill)
    )
    return emu


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_cpu_fp8_rope(emu_variants, kind):
    from cute_attn.testing.reference import variant_reference

    c = plan_case(kind, [1, 17, 40, 0, 9], [1, 40, 90, 9, 9], 8, 2, 64, page_size=1, kv="e5m2", causal=True,
                  device="cpu", workspace=_cpu_ws(), seed=7, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0,
                  rope_theta=5e5)  # fmt: skip
    out, lse = c.run(check_values=False)
    (fam, pp), (fam2, kp) = emu_variants.calls[:2]
    assert fam == "kv_pass" and pp["variant"] == "RoPE" and pp["kv_dtype"] == "e5m2"
    assert fam2 == "batch_prefill_sm90" and kp["keys_transformed"] and not kp["paged"]
    ref_o, ref_lse = variant_reference(c.q, *c.ref_kv, c.qo, c.kv_tok, causal=True, rope=(2.0, 5e5), rope_round_to=BF)
    check(out, lse, ref_o, ref_lse, BF)


def test_cpu_fp8_cascade(monkeypatch, emu):
    """The cascade's prefill levels plan the fp8 cache through the KV pass; its decode levels get
    kv_data_type (the fp8 decode kernel); run()'s k_scale / v_scale reach every level."""
    from test_cascade import _RefDecode, _two_level, make_cascade, plan_args

    import cute_attn.wrappers.cascade as C
    from cute_attn import MultiLevelCascadeAttentionWrapper
    from cute_attn.testing import merge_state_reference

    def merge_in_place(v, s, v_o, s_o, mask=None):
        o, l_ = merge_state_reference(*(t.as_subclass(torch.Tensor) for t in (v, s, v_o, s_o)))
        v.copy_(o.to(v.dtype))
        s.copy_(l_)

    runs = []

    class _Fp8RefDecode(_RefDecode):
        def run(self, q, cache, *args, k_scale=None, v_scale=None, **kw):
            runs.append((k_scale, v_scale))
            return super().run(q, tuple(t.float() for t in cache), *args, **kw)

    monkeypatch.setattr(C, "merge_state_in_place", merge_in_place)
    monkeypatch.setattr(C, "BatchDecodeWithPagedKVCacheWrapper", _Fp8RefDecode)
    monkeypatch.setattr(C, "merge_pair_module", lambda *a: None)
    batch, hq, hk, d = 4, 8, 2, 64
    groups, segs = _two_level(batch, 300, [9, 30, 2, 64])
    for decode_kernel, qo in ((False, [1, 3, 2, 5]), (None, [1] * batch)):
        emu.calls.clear()
        q, cache, levels, (k_cat, v_cat, cat_tok) = make_cascade(
            groups, segs, qo, 16, hq, hk, d, torch.float32, "NHD", _gen(8), "cpu"
        )
        q, cache = q.to(BF), tuple(t.to(torch.float8_e4m3fn) for t in cache)
        w = MultiLevelCascadeAttentionWrapper(2, _cpu_ws(96))
        w.plan(*plan_args(levels), hq, hk, d, 16, causal=True, q_data_type=BF, kv_data_type=torch.float8_e4m3fn,
               decode_kernel=decode_kernel)  # fmt: skip
        out, lse = w.run(q, cache, return_lse=True, v_scale=2.0)
        passes = [p for f, p in emu.calls if f == "kv_pass"]
        assert passes and all(p["kv_dtype"] == "e4m3" and p["paged"] for p in passes)
        if decode_kernel is None:
            assert w._kind == ["prefill", "decode"] and runs[-1] == (None, 2.0)
            assert w._decode[1].plans[-1]["kv_data_type"] == torch.float8_e4m3fn
            continue
        deq = [t.to(torch.float8_e4m3fn).float() for t in (k_cat, v_cat)]
        ref_o, ref_lse = ragged_reference(q, *deq, torch.tensor(_cumsum(qo)), cat_tok, causal=True)
        check(out, lse, 2.0 * ref_o, ref_lse, BF)


def test_cpu_fp8_errors(emu):
    """fp8 queries (fp8 attention is not built), fnuz fp8 caches, a 16-bit q / kv mismatch."""
    for kind in ("paged", "ragged"):
        with pytest.raises(NotImplementedError, match="fp8 attention"):
            plan_case(kind, [3], [40], 8, 2, 64, q_dtype=torch.float8_e4m3fn, device="cpu", workspace=_cpu_ws())
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws())
    ind = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn and float8_e5m2"):
        w.plan(ind, ind, 8, 2, 64, q_data_type=BF, kv_data_type=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="float16/bfloat16 and equal"):
        w.plan(ind, ind, 8, 2, 64, q_data_type=BF, kv_data_type=F16)


def test_models_kv_cache_dtype():
    """compile --model: a config's kv_cache_dtype (vLLM's names) or a compressed-tensors fp8 KV
    scheme picks the fp8 kernel set: fp8 decode, the dequantizing passes, and of the paged
    prefill kernels only those that widen the fp8 cache themselves."""
    from cute_attn.models import BUILTIN, from_config, model_specs, with_kv_cache_dtype

    cfg = dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, torch_dtype="bfloat16")
    assert from_config(cfg).kv_dtype is None
    assert from_config(dict(cfg, kv_cache_dtype="fp8")).kv_dtype == "e4m3"
    assert from_config(dict(cfg, kv_cache_dtype="fp8_e5m2")).kv_dtype == "e5m2"
    assert from_config(dict(cfg, kv_cache_dtype="auto")).kv_dtype is None
    scheme = dict(quantization_config=dict(kv_cache_scheme=dict(num_bits=8, type="float")))
    assert from_config(dict(cfg, **scheme)).kv_dtype == "e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        from_config(dict(cfg, kv_cache_dtype="int4"))
    m = with_kv_cache_dtype(BUILTIN["llama-3"], "fp8")
    assert with_kv_cache_dtype(BUILTIN["llama-3"], None) is BUILTIN["llama-3"]
    specs = model_specs(m, "sm_90a")
    passes = [s.pdict for s in specs if s.family == "kv_pass"]
    assert sorted(p["paged"] for p in passes) == [False, True] and all(p["kv_dtype"] == "e4m3" for p in passes)
    assert all(s.pdict.get("kv_dtype") == "e4m3" for s in specs if s.family == "paged_decode")
    paged = [s.pdict for s in specs if s.family == "batch_prefill_sm90" and s.pdict["paged"]]
    assert paged and all(p["kv_dtype"] == "e4m3" and p["page_box"] == 16 for p in paged)  # only the widening ones
    assert all("kv_dtype" in s.pdict for s in model_specs(m, "sm_100a") if s.family == "paged_decode")


def test_cpu_gpu_cases_use_preset_specs(monkeypatch, emu):
    """Every GPU case above plans (on 132 emulated SMs, as the H200) with only specs of the
    ``all`` preset: what the GPU machine's cache holds."""
    import cute_attn.wrappers.prefill_base as P
    from cute_attn.families.spec import Spec
    from cute_attn.presets import preset_specs

    have = set(preset_specs("all", "sm_90a"))
    missing = []

    class _Stub:
        def __call__(self, *a):
            raise AssertionError("no launch here")

    def lookup(family, arch, **params):
        s = Spec.make(family, arch, **params)
        if s not in have:
            missing.append(s.describe())
        return _Stub()

    monkeypatch.setattr(P, "kernel", lookup)
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)
    extra = [
        ("rope", ("paged", [1, 17, 300, 5, 0, 77, 130], [1, 117, 300, 2005, 9, 77, 400], 32, 8, 128),
         dict(kv=kv, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5))
        for kv in ("e4m3", "e5m2")
    ] + [("scales", ("ragged",) + LENS + (32, 8, 128), dict(causal=True)),
         ("determinism", ("paged", [3000, 17, 1], [20000, 17, 900], 32, 8, 128), dict(causal=True))]  # fmt: skip
    for name, args, kw in GPU_CASES + extra:
        for kind in ("paged", "ragged") if name in ("rope", "scales", "determinism") else (args[0],):
            plan_case(kind, *args[1:], **kw, device="cpu", workspace=_cpu_ws(256), seed=1)
    assert not missing, sorted(set(missing))


@pytest.mark.compile
def test_fp8_kv_pass_compiles_without_spills(tmp_path):
    """The dequantizing passes compile for sm_90a: 16-byte loads and stores, the fp8 -> fp16
    conversion (and fp16 -> bf16 through fp32 for bf16), no local memory."""
    from cute_attn.families.kv_pass import kv_pass_spec
    from cute_attn.runtime.cache import lookup
    from cute_attn.variants import RoPE

    specs = [
        kv_pass_spec("sm_90a", "bf16", 128, True, None, "e4m3"),
        kv_pass_spec("sm_90a", "f16", 64, False, None, "e5m2"),
        kv_pass_spec("sm_90a", "bf16", 256, False, None, "e5m2"),
        kv_pass_spec("sm_90a", "f16", 128, True, RoPE(), "e4m3"),
    ]
    cmd = [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--out", str(tmp_path), "-j", "2"]
    proc = subprocess.run(cmd + sum([["--spec", s.cli()] for s in specs], []), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for s in specs:
        found = lookup(s, tmp_path)
        assert found.meta is not None, found.problem
        assert all(v is True for v in found.meta["instructions"].values()), found.meta["instructions"]
        assert found.meta["resources"].get("local", 0) == 0, f"{s.describe()} spills: {found.meta['resources']}"
        ptx = (found.path / "kernel.ptx").read_text()
        kind = s.pdict["kv_dtype"]
        assert f"cvt.rn.f16x2.{kind}x2" in ptx
        assert ("cvt.rn.bf16x2.f32" in ptx) == (s.pdict["dtype"] == "bf16")
        sass = found.path / "kernel.sass"
        if sass.exists():
            text = sass.read_text()
            assert f"F2FP.F16.{kind.upper()}.UNPACK_B" in text
            assert "LDG.E.64" not in text  # the cache is read 16 bytes per load


@pytest.mark.parametrize("case", [1, 3])
def test_cpu_fp8_ragged_pass_in_kernel(emu, monkeypatch, case):
    """The GPU test's plans on 132 emulated SMs: one launch of the ``kv8_pass`` kernel, whose
    emulation checks the pass's task list and state, then the output against the reference."""
    import cute_attn.wrappers.prefill_base as P

    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)
    kv, q_dtype, causal, lens, hq, hk = PASS_IN_KERNEL_CASES[case]
    c = run_case("ragged", *lens, hq, hk, 128, kv=kv, q_dtype=q_dtype, causal=causal, device="cpu",
                 workspace=_cpu_ws(256), seed=3, kv_pass=True, k_scale=0.5, v_scale=2.0)  # fmt: skip
    assert _calls(emu)[0] == "batch_prefill_sm90" and emu.calls[0][1]["kv8_pass"] == 1
    assert c.w._state.kv8_pass is not None and c.w._state.pass_module is None


@pytest.mark.parametrize("case", range(len(PAGED_PASS_CASES)))
def test_cpu_fp8_paged_pass_in_kernel(emu, monkeypatch, case):
    """The paged GPU cases on 132 emulated SMs: one launch of the ``kv8_pass`` 2 kernel (no
    standalone pass), given the copy's token offsets and, after its pass tensors, the page
    table; its emulation gathers through that table and checks the tasks' requests."""
    import cute_attn.wrappers.prefill_base as P

    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)
    ps, layout, single, kv, q_dtype, causal, lens, hq, hk = PAGED_PASS_CASES[case]
    c = run_case("paged", *lens, hq, hk, 128, page_size=ps, layout=layout, single_tensor=single, kv=kv,
                 q_dtype=q_dtype, causal=causal, device="cpu", workspace=_cpu_ws(256), seed=3, kv_pass=True,
                 k_scale=0.5, v_scale=2.0)  # fmt: skip
    assert _calls(emu) == ["batch_prefill_sm90"] + (["merge_partials"] if c.w._state.plan.has_split else [])
    assert emu.calls[0][1]["kv8_pass"] == 2 and not emu.calls[0][1]["paged"]
    assert c.w._state.kv8_pass is not None and c.w._state.pass_module is None
    monkeypatch.setattr(backends, "KV8_PASS_IN_KERNEL", False)  # the standalone paged pass instead
    emu.calls.clear()
    run_case("paged", *lens, hq, hk, 128, page_size=ps, layout=layout, single_tensor=single, kv=kv, q_dtype=q_dtype,
             causal=causal, device="cpu", workspace=_cpu_ws(256), seed=3, kv_pass=True)  # fmt: skip
    assert _calls(emu)[:2] == ["kv_pass", "batch_prefill_sm90"] and emu.calls[0][1]["paged"]
