"""Every built-in variant and the user-defined example in batch prefill (ragged and paged KV)
against the fp32 reference with the same variant (``cute_attn.testing.reference.variant_reference``;
RoPE: q/k rotated in fp32 and rounded to the input dtype (``rope_round_to``), as the kernel is
specified to compute).

GPU tests (marked ``gpu``; the specializations are the ``variants`` preset, e.g. ``python -m
cute_attn compile --arch sm_90a --preset variants``): four configurations -- bf16/d128 ragged
causal GQA 4, bf16/d128 paged (page 16) GQA 8, f16/d64 paged (page 1) causal GQA 1, f16/d64
ragged GQA 8 -- for each case of ``cute_attn.testing.matrices.variant_test_cases`` (causal via
``Causal()``, ALiBi, RoPE, sinks, custom mask (flat bool and bit-packed), FlashSigmoid, the
RelativePositionBias example, window + sinks, ALiBi + soft-cap, RoPE + sinks), two head-dim-256
cases, and a forced split-KV run per case (sinks are added once, sigmoid weights sum over the
chunks).  Query lengths 1, odd and > 128, kv >= qo (append), an empty request; outputs and LSE
pre-filled with NaN, every cache slot no request owns (spare pages, last-page slack, rows past
the ragged KV) NaN.  Tolerances as tests/test_prefill_gpu.py.

CPU tests (run in CI): mask packing (FlashInfer's ``segment_packbits``), the option -> variant
mapping (``resolve_variant``), spec identity, the ABI, and both wrappers end to end against a
Python emulation of the kernel's variant contract (the same emulated work items, partial slots
and merge as tests/test_prefill_gpu.py, plus the variant's hooks as torch ops): argument order,
the runtime values the wrappers pass (ALiBi slopes, RoPE scalars, packed mask + offsets, sinks,
the example's table) and the split-KV semantics of sinks and sigmoid.
"""

import math

import numpy as np
import pytest
import torch
from test_prefill_gpu import (
    DTYPES,
    _cpu_ws,
    _cumsum,
    _Emulated,
    _FakeEvent,
    _gen,
    _ws,
    check,
    make_paged,
    make_ragged,
    replay_ragged_plans,
)

from cute_attn.testing.reference import LOG2E, rope_reference, variant_reference
from cute_attn.variants import Causal, FlashSigmoid, get_alibi_slopes
from cute_attn.variants.examples import RelativePositionBias

gpu = pytest.mark.gpu
DEV = "cuda"

# (name, dtype, head_dim, paged, causal, num_qo_heads, num_kv_heads, page_size): must match
# cute_attn.testing.matrices.VARIANT_TEST_CONFIGS (the compiled specs)
CONFIGS = [
    ("bf16-d128-ragged-causal-h32x8", "bf16", 128, False, True, 32, 8, 0),
    ("bf16-d128-p16-h16x2", "bf16", 128, True, False, 16, 2, 16),
    ("f16-d64-p1-causal-h8x8", "f16", 64, True, True, 8, 8, 1),
    ("f16-d64-ragged-h32x4", "f16", 64, False, False, 32, 4, 0),
]
QO_LENS = [1, 17, 300, 5, 0, 77, 130]
KV_LENS = [1, 117, 300, 2005, 9, 77, 400]  # kv >= qo; request 4 has kv but no queries
NAMES = [
    "causal",
    "alibi",
    "rope",
    "sink",
    "custom_mask",
    "sigmoid",
    "rel_bias",
    "window_sink",
    "alibi_softcap",
    "rope_sink",
    "alibi_softcap_rel_bias",
]


def _rel_bias_mod(table, bucket_size=16, num_buckets=32):
    def mod(s, b, h, qp, kp):
        bucket = ((qp - kp).clamp_min(0) // bucket_size).clamp_max(num_buckets - 1)
        return s + table[h, bucket]

    return mod


def _segment_packbits(mask, qo_lens, kv_lens):
    """FlashInfer's packed_custom_mask, written independently of the wrapper: per request its
    qo_len * kv_len bits, little bit order, each request starting on a byte."""
    out, off = [], 0
    for q, k in zip(qo_lens, kv_lens):
        bits = mask[off : off + q * k].tolist()
        off += q * k
        for i in range(0, len(bits), 8):
            out.append(sum(1 << j for j, b in enumerate(bits[i : i + 8]) if b))
    return torch.tensor(out or [0], dtype=torch.uint8)


def _case(name, hq, gen, qo_lens, kv_lens, causal, dev, packed=False):
    """(plan kwargs, run positional args, run kwargs, reference kwargs) of one case."""
    if name == "causal":
        return dict(variant=Causal()), (), {}, dict(causal=True)
    ref_causal = dict(causal=causal)
    if name == "alibi":
        return dict(pos_encoding_mode="ALIBI"), (), {}, dict(alibi_slopes=get_alibi_slopes(hq), **ref_causal)
    if name == "rope":
        return (
            dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5),
            (),
            {},
            dict(rope=(2.0, 5e5), **ref_causal),
        )
    if name == "sink":
        sinks = (torch.randn(hq, generator=gen) * 2).to(dev)
        return {}, (), dict(sinks=sinks), dict(sinks=sinks, **ref_causal)
    if name == "custom_mask":  # replaces causal (FlashInfer's MaskMode.CUSTOM)
        mask = torch.rand(sum(q * k for q, k in zip(qo_lens, kv_lens)), generator=gen) < 0.7
        plan = dict(packed_custom_mask=_segment_packbits(mask, qo_lens, kv_lens)) if packed else dict(custom_mask=mask)
        return plan, (), {}, dict(custom_mask=mask)
    if name == "custom_mask_docs":  # documents of 200 tokens, causal inside: large all-0 / all-1 regions
        parts = []
        for q, k in zip(qo_lens, kv_lens):
            qpos, kpos = torch.arange(k - q, k)[:, None], torch.arange(k)[None, :]
            parts.append(((qpos // 200 == kpos // 200) & (kpos <= qpos)).reshape(-1))
        mask = torch.cat(parts)
        return dict(custom_mask=mask), (), {}, dict(custom_mask=mask)
    if name == "sigmoid":
        return dict(variant=FlashSigmoid(sigmoid_bias=-1.5)), (), {}, dict(sigmoid_bias=-1.5, **ref_causal)
    if name == "rel_bias":  # the user-defined example: its table is run()'s extra argument
        table = torch.randn(hq, 32, generator=gen).to(dev)
        return dict(variant=RelativePositionBias()), (table,), {}, dict(score_mod=_rel_bias_mod(table), **ref_causal)
    if name == "window_sink":  # gpt-oss: sliding window + sinks
        sinks = (torch.randn(hq, generator=gen) * 2).to(dev)
        return dict(window_left=100), (), dict(sinks=sinks), dict(window_left=100, sinks=sinks, **ref_causal)
    if name == "alibi_softcap":
        return (
            dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0),
            (),
            {},
            dict(alibi_slopes=get_alibi_slopes(hq), logits_soft_cap=5.0, **ref_causal),
        )
    if name == "alibi_softcap_rel_bias":  # ALiBi's bias seeded, the cap, then the example's bias as a logit
        table = torch.randn(hq, 32, generator=gen).to(dev)
        return (
            dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0, variant=RelativePositionBias()),
            (table,),
            {},
            dict(alibi_slopes=get_alibi_slopes(hq), logits_soft_cap=5.0, score_mod=_rel_bias_mod(table), **ref_causal),
        )
    if name == "rope_sink":
        sinks = (torch.randn(hq, generator=gen) * 2).to(dev)
        return (
            dict(pos_encoding_mode="ROPE_LLAMA"),
            (),
            dict(sinks=sinks),
            dict(rope=(1.0, 1e4), sinks=sinks, **ref_causal),
        )
    raise KeyError(name)


def _reference(q, k, v, qo, kv, dtype, ref_kw):
    ref_kw = dict(ref_kw)
    for key in ("alibi_slopes", "sinks"):
        if key in ref_kw:
            ref_kw[key] = ref_kw[key].to(q.device)
    if "rope" in ref_kw:
        ref_kw["rope_round_to"] = dtype
    return variant_reference(q, k, v, qo, kv, **ref_kw)


def run_variant(
    name,
    dtype,
    d,
    paged,
    causal,
    hq,
    hk,
    page_size,
    qo_lens,
    kv_lens,
    *,
    seed=None,
    device=None,
    workspace=None,
    packed=False,
    **plan_extra,
):
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    plan_kw, run_args, run_kw, ref_kw = _case(name, hq, gen, qo_lens, kv_lens, causal, device, packed)
    qo = torch.tensor(_cumsum(qo_lens), dtype=torch.int32)
    ws = workspace if workspace is not None else _ws(device)
    if paged:
        cache, indptr, indices, last, (k_ref, v_ref), kv_tok = make_paged(
            kv_lens, page_size, hk, d, dtype, "NHD", False, gen, device
        )
        q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
        w = BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(
            qo, indptr, indices, last, hq, hk, d, page_size, causal=causal, q_data_type=dtype, **plan_kw, **plan_extra
        )
        kv_args = (cache,)
    else:
        q, k, v, qo, kv_tok, (k_ref, v_ref) = make_ragged(
            qo_lens, kv_lens, hq, hk, d, dtype, "NHD", gen, device, tail=5
        )
        w = BatchPrefillWithRaggedKVCacheWrapper(ws)
        w.plan(qo, kv_tok, hq, hk, d, causal=causal, q_data_type=dtype, **plan_kw, **plan_extra)
        kv_args = (k, v)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    w.run(q, *kv_args, *run_args, out=out, lse=lse, **run_kw)
    ref_o, ref_lse = _reference(q, k_ref, v_ref, qo, kv_tok, dtype, ref_kw)
    check(out, lse, ref_o, ref_lse, dtype)
    return w, out, lse


# =========================================================================== GPU tests


@gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c[0])
@pytest.mark.parametrize("name", NAMES)
def test_variant_prefill(name, config):
    _, dt, d, paged, causal, hq, hk, ps = config
    # a paged cache read by the kernel itself (test_variant_prefill_kv_pass: through the KV pass)
    run_variant(
        name,
        DTYPES[dt],
        d,
        paged,
        causal,
        hq,
        hk,
        ps,
        QO_LENS,
        KV_LENS,
        packed=paged,
        **(dict(kv_pass=False) if paged else {}),
    )


@gpu
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[3]], ids=lambda c: c[0])
@pytest.mark.parametrize("name", NAMES)
def test_variant_prefill_kv_pass(name, config):
    """A paged cache gathered by the KV pass (plan(kv_pass=True); RoPE rotates K there), then
    the ragged kernel with the variant."""
    _, dt, d, paged, causal, hq, hk, ps = config
    w = run_variant(name, DTYPES[dt], d, paged, causal, hq, hk, ps, QO_LENS, KV_LENS, packed=paged, kv_pass=True)[0]
    assert w._gathered is not None and not w._spec_kw["paged"]
    assert bool(w._spec_kw.get("keys_transformed")) == ("rope" in name)


@gpu
@pytest.mark.parametrize(
    "config,kv_pass",
    [(CONFIGS[0], None), (CONFIGS[1], False), (CONFIGS[1], True)],
    ids=["ragged", "paged", "paged-kv_pass"],
)
def test_rope_prefill_long_context(config, kv_pass):
    """Appends at positions past 32k: ragged (the KV pass rotates K), paged (the producer's
    rotation of K blocks) and paged through the KV pass; angles of ~20000 rad at the lowest dims
    (rope_scale 2), reduced in fixed point."""
    _, dt, d, paged, causal, hq, hk, ps = config
    extra = {} if kv_pass is None else dict(kv_pass=kv_pass)
    run_variant("rope", DTYPES[dt], d, paged, causal, hq, hk, ps, [40, 3], [40000, 33001], **extra)  # 128-row tiles


@gpu
@pytest.mark.parametrize("name", ["rope_sink", "alibi_softcap"])
def test_variant_prefill_hd256(name):
    run_variant(name, torch.bfloat16, 256, False, True, 16, 4, 0, [1, 33, 200, 7], [1, 40, 700, 7])


@gpu
@pytest.mark.parametrize("name", NAMES)
def test_variant_prefill_split_kv(name):
    """Long requests cut into chunks (fixed_split_size, tile 128): sinks are added once per row,
    sigmoid weights sum over the chunks, RoPE positions are absolute, masks index whole rows."""
    w = run_variant(
        name, torch.bfloat16, 128, False, True, 32, 8, 0, [300, 1, 64], [5000, 2000, 64], fixed_split_size=2048
    )[0]
    assert w._plan.has_split


@gpu
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3]], ids=lambda c: c[0])
def test_custom_mask_uniform_blocks(config):
    """A document-causal mask: most warps' bits of a block are all 0 (the softmax is skipped)
    or all 1 (the mask-free path), the rest mixed; a request whose bits all fit one block."""
    _, dt, d, paged, causal, hq, hk, ps = config
    run_variant("custom_mask_docs", DTYPES[dt], d, paged, causal, hq, hk, ps, [600, 1, 333, 40], [900, 50, 1400, 40])


@gpu
def test_custom_mask_cuda_graph_replay_with_new_plans():
    """A captured run() with a custom mask: later plans write new bits, offsets and per-row kv
    bounds into the same buffers (a smaller batch, other lengths, another pattern)."""
    from cute_attn.prefill import BatchPrefillWithRaggedKVCacheWrapper

    hq, hk, d, max_b, t_max, kv_max = 32, 8, 128, 3, 1024, 4096
    gen = _gen()
    bufs = dict(
        qo_indptr_buf=torch.zeros(max_b + 1, dtype=torch.int32, device=DEV),
        kv_indptr_buf=torch.zeros(max_b + 1, dtype=torch.int32, device=DEV),
        custom_mask_buf=torch.zeros(1 << 20, dtype=torch.uint8, device=DEV),
        mask_indptr_buf=torch.zeros(max_b + 1, dtype=torch.int32, device=DEV),
    )
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(DEV), use_cuda_graph=True, **bufs)
    q = torch.randn(t_max, hq, d, generator=gen).to(torch.bfloat16).to(DEV)
    k = torch.randn(kv_max, hk, d, generator=gen).to(torch.bfloat16).to(DEV)
    v = torch.randn(kv_max, hk, d, generator=gen).to(torch.bfloat16).to(DEV)
    out = torch.empty_like(q)
    lse = torch.empty(t_max, hq, device=DEV)

    def plan(qo, kv, doc):
        mask = torch.cat(
            [
                (
                    (torch.arange(b - a, b)[:, None] // doc == torch.arange(b)[None, :] // doc)
                    & (torch.arange(b)[None, :] <= torch.arange(b - a, b)[:, None])
                ).reshape(-1)
                for a, b in zip(qo, kv)
            ]
        )
        qo_t, kv_t = torch.tensor(_cumsum(qo), dtype=torch.int32), torch.tensor(_cumsum(kv), dtype=torch.int32)
        w.plan(qo_t, kv_t, hq, hk, d, custom_mask=mask, q_data_type=torch.bfloat16)
        return qo_t, kv_t, mask

    plan([500, 24, 500], [1000, 100, 2900], 300)  # the first plan fixes 1024 query tokens
    w.run(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, k, v, out=out, lse=lse)
    for qo, kv, doc in (([1000, 24], [3000, 24], 200), ([7, 900, 100], [7, 900, 3000], 1000), ([1], [1], 5)):
        qo_t, kv_t, mask = plan(qo, kv, doc)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        n, nk = int(qo_t[-1]), int(kv_t[-1])
        ref_o, ref_lse = _reference(q[:n], k[:nk], v[:nk], qo_t, kv_t, torch.bfloat16, dict(custom_mask=mask))
        check(out[:n], lse[:n], ref_o, ref_lse, torch.bfloat16)


@gpu
def test_rope_ragged_cuda_graph_replay_with_new_plans():
    """Ragged RoPE in a captured graph: the key-transform pass reads the request count and the
    offsets from the indptr buffers, so later plans -- a smaller batch (the buffers' tail
    repeats the last offset), other lengths, a split -- replay correctly."""
    replay_ragged_plans(
        32,
        8,
        128,
        2048,
        12000,
        ([1000, 24, 500, 524], [1000, 1024, 1007, 4072]),  # fixes 2048 query tokens
        [
            ([1, 1, 2, 2044], [1, 1, 9, 11000]),  # long: split by the planner
            ([300, 0, 77], [5000, 9, 77]),  # a smaller batch, a request without queries
            ([5, 7], [5, 3000]),
        ],
        lambda q, k, v, qo_t, kv_t: _reference(
            q, k[: int(kv_t[-1])], v[: int(kv_t[-1])], qo_t, kv_t, torch.bfloat16, dict(rope=(2.0, 5e5), causal=True)
        ),
        pos_encoding_mode="ROPE_LLAMA",
        rope_scale=2.0,
        rope_theta=5e5,
    )


@gpu
def test_variant_single_prefill():
    from cute_attn.prefill import single_prefill_with_kv_cache

    gen = _gen(7)
    q = torch.randn(70, 8, 64, generator=gen).to(torch.float16).cuda()
    k = torch.randn(90, 8, 64, generator=gen).to(torch.float16).cuda()
    v = torch.randn(90, 8, 64, generator=gen).to(torch.float16).cuda()
    mask = torch.rand(70, 90, generator=gen) < 0.5
    o, s = single_prefill_with_kv_cache(q, k, v, custom_mask=mask.cuda(), return_lse=True)
    qo, kv = torch.tensor([0, 70]), torch.tensor([0, 90])
    ref_o, ref_lse = variant_reference(q, k, v, qo, kv, custom_mask=mask)
    check(o, s, ref_o, ref_lse, torch.float16)


# =========================================================================== CPU tests


def test_mask_kv_bounds():
    """CustomMask's per-row kv bounds: no visible key outside [lo, hi), non-decreasing in the
    row, exact where the raw bounds already are (a causal mask: [0, kv - qo + i + 1)), and
    (kv_len, 0) for rows that see nothing."""
    from cute_attn.prefill import pack_custom_mask
    from cute_attn.variants.builtins import mask_kv_bounds

    rng = np.random.default_rng(1)
    qo, kv = np.array([3, 0, 40, 6, 5]), np.array([7, 4, 90, 6, 0])
    parts = []
    for q, k in zip(qo, kv):
        m = torch.from_numpy(rng.random((q, k)) < 0.2)
        if q == 6:  # causal, top-left = bottom-right here
            m = torch.ones(q, k, dtype=torch.bool).tril()
        if q == 3:
            m[1] = False  # a row that sees nothing
        parts.append(m.reshape(-1))
    flat = torch.cat(parts)
    packed, indptr = pack_custom_mask(flat, qo, kv)
    b = mask_kv_bounds(packed, indptr, qo, kv)
    assert b.dtype == torch.int32 and b.shape == (int(qo.sum()), 2)
    row = off = 0
    for q, k in zip(qo, kv):
        m = flat[off : off + q * k].view(q, k)
        off += q * k
        lo, hi = b[row : row + q, 0], b[row : row + q, 1]
        row += q
        if q == 0:
            continue
        assert (lo[1:] >= lo[:-1]).all() and (hi[1:] >= hi[:-1]).all()
        cols = torch.arange(k)
        outside = (cols[None, :] < lo[:, None]) | (cols[None, :] >= hi[:, None])
        assert not (m & outside).any()
        if q == 6:
            assert lo.tolist() == [0] * 6 and hi.tolist() == list(range(1, 7))
        if k == 0:
            assert b[row - q : row].tolist() == [[0, 0]] * q
    only_empty = mask_kv_bounds(
        *pack_custom_mask(torch.zeros(8, dtype=torch.bool), np.array([2]), np.array([4])), np.array([2]), np.array([4])
    )
    assert only_empty.tolist() == [[4, 0], [4, 0]]


def test_pack_custom_mask_matches_segment_packbits():
    from cute_attn.prefill import pack_custom_mask

    rng = np.random.default_rng(0)
    qo, kv = [3, 0, 1, 5], [7, 4, 9, 13]
    mask = torch.from_numpy(rng.random(sum(q * k for q, k in zip(qo, kv))) < 0.5)
    packed, indptr = pack_custom_mask(mask, np.array(qo), np.array(kv))
    ref = _segment_packbits(mask, qo, kv)
    assert indptr.tolist() == _cumsum([(q * k + 7) // 8 for q, k in zip(qo, kv)])
    assert torch.equal(packed[: indptr[-1]], ref[: indptr[-1]])
    # bit (i, j) of request b is bit (i * kv + j) of its segment, little bit order
    b, i, j = 3, 4, 11
    bit = i * kv[b] + j
    seg = packed[indptr[b] : indptr[b + 1]]
    off = sum(q * k for q, k in zip(qo[:b], kv[:b]))
    assert bool((int(seg[bit // 8]) >> (bit % 8)) & 1) == bool(mask[off + bit])
    with pytest.raises(ValueError, match="sum"):
        pack_custom_mask(mask[:-1], np.array(qo), np.array(kv))


def test_resolve_variant_rules():
    from cute_attn.variants import ALiBi, AttentionSink, CustomMask, RoPE, SoftCap, encode
    from cute_attn.wrappers.options import resolve_variant

    assert resolve_variant() == (False, False, False, None)
    assert resolve_variant(causal=True, window_left=10, logits_soft_cap=30.0) == (True, True, True, None)
    # soft-cap stays a flag unless another component transforms logits or adds a bias after it
    # (then decode's order); ALiBi's bias comes before it and is seeded: the flag caps q·k + bias
    c, cap, win, v = resolve_variant(logits_soft_cap=5.0, pos_encoding_mode="ALIBI")
    assert (cap, encode(v)) == (True, "ALiBi")
    c, cap, win, v = resolve_variant(logits_soft_cap=5.0, pos_encoding_mode="ROPE_LLAMA", sinks=True)
    assert (cap, encode(v)) == (True, "RoPE+AttentionSink")
    c, cap, win, v = resolve_variant(logits_soft_cap=5.0, variant=RelativePositionBias())
    assert not cap and encode(v).startswith("SoftCap+cute_attn.variants.examples:RelativePositionBias")
    # a custom mask replaces causal; Causal() components become the flag
    c, cap, win, v = resolve_variant(causal=True, custom_mask=True)
    assert not c and isinstance(v, CustomMask)
    c, cap, win, v = resolve_variant(variant=Causal() + FlashSigmoid())
    assert c and isinstance(v, FlashSigmoid)
    c, _, _, v = resolve_variant(variant=Causal())
    assert c and v is None
    # RoPE parameters are runtime values, not part of the identity
    _, _, _, v = resolve_variant(pos_encoding_mode="ROPE_LLAMA", rope_scale=8.0, rope_theta=5e5)
    assert isinstance(v, RoPE) and v.values == dict(rope_scale=8.0, rope_theta=5e5)
    assert encode(v) == encode(RoPE())
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        resolve_variant(pos_encoding_mode="ROPE")
    with pytest.raises(TypeError, match="Variant"):
        resolve_variant(variant="alibi")
    assert isinstance(resolve_variant(sinks=True)[3], AttentionSink)
    assert encode(resolve_variant(pos_encoding_mode="ALIBI", custom_mask=CustomMask())[3]) == "ALiBi+CustomMask"
    assert isinstance(ALiBi(), ALiBi) and isinstance(SoftCap(), SoftCap)


def test_variant_prefill_specs_and_abi():
    from cute_attn.abi.args import ScalarArg, TensorArg
    from cute_attn.families.base import spec_variant as _spec_variant
    from cute_attn.families.prefill import ARCH as PREFILL_ARCH
    from cute_attn.families.prefill import prefill_abi as _prefill_abi
    from cute_attn.families.prefill import prefill_abi_fixed as _prefill_abi_fixed
    from cute_attn.testing.matrices import VARIANT_TEST_CONFIGS, variant_prefill_specs
    from cute_attn.variants import abi_args, fingerprint

    all_specs = variant_prefill_specs(PREFILL_ARCH)
    assert variant_prefill_specs("sm_100a") == []
    assert len(all_specs) == len(set(all_specs))
    specs = [s for s in all_specs if s.family == "batch_prefill_sm90"]
    passes = [s for s in all_specs if s.family == "kv_pass"]
    assert len(specs) + len(passes) == len(all_specs) and all(s.param("tile_q") == 128 for s in specs)
    # ragged RoPE (a gathered paged cache included): the kernel reads the KV pass's keys; every
    # such pass is listed
    pre = [s for s in specs if s.pdict.get("keys_transformed")]
    assert pre and all(not s.param("paged") and "RoPE" in s.param("variant") for s in pre)
    assert all(
        bool(s.pdict.get("keys_transformed")) == (not s.param("paged"))
        for s in specs
        if "RoPE" in s.pdict.get("variant", "")
    )
    assert {(s.param("dtype"), s.param("head_dim"), s.param("variant")) for s in passes if "variant" in s.pdict} == {
        (s.param("dtype"), s.param("head_dim"), s.param("variant")) for s in pre if "Sink" not in s.param("variant")
    }
    # the paged configurations' gathers (plan(kv_pass=...)), without a key transform too
    paged_cfgs = {(dt, d) for dt, d, ps, _ in VARIANT_TEST_CONFIGS if ps}
    assert {(s.param("dtype"), s.param("head_dim")) for s in passes if s.param("paged")} == paged_cfgs
    assert any(s.param("paged") and "variant" not in s.pdict for s in passes)
    fixed = _prefill_abi_fixed(specs[0].pdict)
    assert [a.name for a in fixed][-5:] == ["group", "sm_scale", "soft_cap", "window_left", "num_ctas"]
    fps = set()
    for s in specs:
        p = s.pdict
        v = _spec_variant(p)
        abi = _prefill_abi(p)
        assert abi[: len(fixed)] == _prefill_abi_fixed(p)
        assert abi[len(fixed) :] == abi_args(v)
        if v is None:
            assert "variant" not in p  # plain specs keep their parameters (the `prefill` preset's keys)
        else:
            assert p["variant_fp"] == fingerprint(v)
            fps.add(p["variant"])
        extra = abi[len(fixed) :]
        assert [type(a) for a in extra] == sorted((type(a) for a in extra), key=lambda t: t is ScalarArg)
        assert all(isinstance(a, (TensorArg, ScalarArg)) for a in extra)
    assert {"ALiBi", "RoPE", "AttentionSink", "CustomMask", "FlashSigmoid", "RoPE+AttentionSink"} <= fps
    assert any(f.startswith("cute_attn.variants.examples:RelativePositionBias") for f in fps)
    # ALiBi + soft-cap: the flag next to a seeded bias; with a bias after the cap, the traced chain
    assert any(s.param("soft_cap") and s.pdict.get("variant") == "ALiBi" for s in specs)
    assert any(f.startswith("ALiBi+SoftCap+cute_attn.variants.examples:RelativePositionBias") for f in fps)


def test_presets_list_the_variant_specs():
    from cute_attn.presets import preset_specs
    from cute_attn.testing.matrices import variant_decode_specs, variant_prefill_specs

    got = set(preset_specs("variants", "sm_90a"))
    assert set(variant_prefill_specs("sm_90a")) <= got and set(variant_decode_specs("sm_90a")) <= got
    assert set(variant_decode_specs("sm_90a")) <= set(preset_specs("default", "sm_90a"))
    assert set(variant_decode_specs("sm_100a")) <= set(preset_specs("variants", "sm_100a"))
    for arch in ("sm_90a", "sm_100a"):  # `all`: what a GPU machine without the DSL needs
        every = preset_specs("all", arch)
        assert len(every) == len(set(every))
        assert set(every) == set(preset_specs("default", arch)) | set(preset_specs("variants", arch))


# ---- the wrappers on the CPU against an emulation of the kernel's variant contract


def _emulate_variant_prefill(
    p,
    q,
    k4,
    v4,
    kv_indptr,
    kv_indices,
    out,
    lse,
    work,
    work_indptr,
    part_o,
    part_lse,
    group,
    sm_scale,
    soft_cap,
    window_left,
    num_ctas,
    *vargs,
):
    """What kernels/prefill_sm90.py computes for a spec with a variant, item by item (fp64):
    RoPE rotates q/k (rounded to the input dtype), the seeded biases before the soft-cap flag,
    logits hooks in order, masks intersect,
    a sink joins the statistics of the item starting at kv 0, FlashSigmoid sums weights and a
    split item writes (o / s, log2 s), s = its share of the tile's kv extent."""
    from cute_attn.families.base import spec_variant as _spec_variant
    from cute_attn.sched import workspace as ws
    from cute_attn.variants import ALiBi, AttentionSink, CustomMask, FlashSigmoid, RoPE, SoftCap, abi_args, components

    v = _spec_variant(p)
    names = [a.name for a in abi_args(v)]
    assert len(names) == len(vargs), (names, len(vargs))
    val = dict(zip(names, vargs))
    comps = [
        (c, {n.split("_", 1)[1]: val[n] for n in names if n.startswith(f"v{i}_")}) for i, c in enumerate(components(v))
    ]
    tile = p["tile_q"]
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    ip, kvp = work_indptr.tolist(), kv_indptr.long()
    for c in range(num_ctas):
        for it in range(ip[c], ip[c + 1]):
            f = work[it].tolist()
            b, h, r0, nr = f[ws.W_REQ], f[ws.W_KV_HEAD], f[ws.W_ROW_START], f[ws.W_NUM_ROWS]
            ks, ke, dest = f[ws.W_KV_START], f[ws.W_KV_END], f[ws.W_DEST]
            qoff, qlen, klen = f[ws.W_QO_OFFSET], f[ws.W_QO_LEN], f[ws.W_KV_LEN]
            rows = torch.arange(r0, r0 + nr)
            tok, heads = rows // group, h * group + rows % group
            pos = torch.arange(ks, ke)
            qpos = klen - qlen + tok
            qv = q[qoff + tok, heads].float()
            if p["paged"]:
                ps = k4.shape[1]
                page = kv_indices.long()[kvp[b] + pos // ps]
                kk, vv = k4[page, pos % ps, h].float(), v4[page, pos % ps, h].double()
            else:
                kk, vv = k4[0, kvp[b] + pos, h].float(), v4[0, kvp[b] + pos, h].double()
            for comp, a in comps:
                if isinstance(comp, RoPE):
                    rs, rt = float(a["rope_scale"]), float(a["rope_theta"])
                    qv = (
                        torch.stack(
                            [rope_reference(qv[i : i + 1, None], qpos[i : i + 1], rs, rt)[0, 0] for i in range(nr)]
                        )
                        .to(q.dtype)
                        .float()
                        if nr
                        else qv
                    )
                    if not p.get("keys_transformed"):  # else the key-transform pass did it
                        kk = rope_reference(kk[:, None], pos, rs, rt)[:, 0].to(q.dtype).float()
            s = qv.double() @ kk.double().T * sm_scale
            keep = torch.ones_like(s, dtype=torch.bool)
            rel = (pos[None, :] - qpos[:, None]).double()

            def bias(comp, a):
                if isinstance(comp, ALiBi):
                    return a["alibi_slopes"].double()[heads][:, None] * rel
                bucket = (-rel).long().clamp_min(0) // comp.bucket_size  # RelativePositionBias
                return a["bias_table"].double()[heads[:, None], bucket.clamp_max(comp.num_buckets - 1)]

            # biases of components before the first logits hook go into the QK accumulator, so
            # they come before the kernel's soft-cap flag; the rest apply in component order
            first_logits = next((i for i, (c, _) in enumerate(comps) if c.logits is not None), len(comps))
            seeded = [c.bias is not None and i <= first_logits for i, (c, _) in enumerate(comps)]
            for (comp, a), sd in zip(comps, seeded):
                if sd:
                    s = s + bias(comp, a)
            if p["soft_cap"]:
                s = soft_cap * torch.tanh(s / soft_cap)
            sigmoid = False
            sink = None
            for (comp, a), sd in zip(comps, seeded):
                if comp.bias is not None and not sd:
                    s = s + bias(comp, a)
                if isinstance(comp, SoftCap):
                    cap = float(a["logits_soft_cap"])
                    s = cap * torch.tanh(s / cap)
                elif isinstance(comp, FlashSigmoid):
                    s = torch.sigmoid(s + float(a["sigmoid_bias"]))
                    sigmoid = True
                elif isinstance(comp, CustomMask):
                    base = int(a["mask_indptr"][b])
                    bit = (qpos - (klen - qlen))[:, None] * klen + pos[None, :]
                    byte = a["packed_custom_mask"].view(torch.uint8).long()[base + bit // 8]
                    keep &= ((byte >> (bit % 8)) & 1) != 0
                elif isinstance(comp, AttentionSink):
                    sink = a["sinks"].double()[heads] * LOG2E
            if p["causal"]:
                keep &= pos[None, :] <= qpos[:, None]
            if p["window"]:
                keep &= pos[None, :] >= qpos[:, None] - window_left
            if sigmoid:
                ext = klen
                if p["causal"]:
                    ext = min(max(klen - qlen + (r0 + nr - 1) // group + 1, 0), klen)
                w = (ke - ks) / ext if ext > 0 else 0.0
                o = (s * keep) @ vv
                if dest < 0:
                    row_lse = torch.full((nr,), 0.0 if w > 0 else -math.inf, dtype=torch.float64)
                else:
                    o = o / w if w > 0 else o * 0
                    row_lse = torch.full((nr,), math.log2(w) if w > 0 else -math.inf, dtype=torch.float64)
            else:
                s2 = s.masked_fill(~keep, -math.inf) * LOG2E  # base 2
                m = s2.amax(1) if s2.shape[1] else torch.full((nr,), -math.inf, dtype=torch.float64)
                if sink is not None and ks == 0:
                    m = torch.maximum(m, sink)
                mu = torch.where(torch.isinf(m), torch.zeros_like(m), m)
                e = torch.exp2(s2 - mu[:, None])
                l_ = e.sum(1)
                if sink is not None and ks == 0:
                    l_ = l_ + torch.exp2(sink - mu)
                o = torch.where(
                    l_[:, None] > 0, (e @ vv) / l_.clamp_min(1e-300)[:, None], torch.zeros(1, dtype=torch.float64)
                )
                row_lse = mu + torch.log2(l_)
            if dest < 0:
                out[qoff + tok, heads] = o.to(out.dtype)
                lse[qoff + tok, heads] = row_lse.float()
            else:
                part_o[dest * tile : dest * tile + nr] = o.float()
                part_lse[dest * tile : dest * tile + nr] = row_lse.float()


@pytest.fixture
def emu(monkeypatch):
    import cute_attn.wrappers.prefill_base as P

    calls = []
    monkeypatch.setattr(P, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 8)
    monkeypatch.setattr(
        P, "kernel", lambda family, arch, **params: _Emulated(family, params, calls, _emulate_variant_prefill)
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return calls


CPU_CONFIGS = [
    ("bf16", 64, False, True, 8, 2, 0),
    ("f16", 64, True, False, 4, 4, 16),
    ("bf16", 64, True, True, 8, 2, 1),
]


@pytest.mark.parametrize(
    "config,kv_pass",
    [(c, None) for c in CPU_CONFIGS] + [(c, True) for c in CPU_CONFIGS if c[2]],
    ids=lambda x: (
        f"{x[0]}-{'paged' if x[2] else 'ragged'}-c{int(x[3])}"
        if isinstance(x, tuple)
        else "auto"
        if x is None
        else "kv_pass"
    ),
)
@pytest.mark.parametrize("name", NAMES)
def test_cpu_variant_wiring(emu, name, config, kv_pass):
    dt, d, paged, causal, hq, hk, ps = config
    qo, kv = [1, 17, 40, 0, 9], [1, 40, 90, 9, 9]
    run_variant(
        name,
        DTYPES[dt],
        d,
        paged,
        causal,
        hq,
        hk,
        ps,
        qo,
        kv,
        seed=11,
        device="cpu",
        workspace=_cpu_ws(),
        packed=paged,
        **({} if kv_pass is None else dict(kv_pass=kv_pass)),
    )
    fams = [c[0] for c in emu]
    fam, params = emu[fams.index("batch_prefill_sm90")]
    # RoPE over ragged KV, or a paged cache the KV pass gathers: the pass, then a kernel that
    # reads its keys by TMA (pre-rotated with RoPE); these short lengths never pay for the pass
    gathered = bool(kv_pass)
    pre = "rope" in name and (not paged or gathered)
    assert ("kv_pass" in fams) == (pre or gathered) and bool(params.get("keys_transformed")) == pre
    assert params["paged"] == (paged and not gathered)
    if pre or gathered:
        assert fams.index("kv_pass") < fams.index("batch_prefill_sm90")
        pass_params = emu[fams.index("kv_pass")][1]
        assert pass_params["paged"] == gathered and ("variant" in pass_params) == pre
    if name == "causal":
        assert "variant" not in params and params["causal"]
    else:
        assert "variant" in params
    if name == "custom_mask":
        assert not params["causal"]


@pytest.mark.parametrize("name", ["sink", "sigmoid", "rope_sink", "custom_mask", "window_sink"])
def test_cpu_variant_split(emu, name):
    """8 emulated SMs, fixed_split_size: chunks + merge, sinks once per row, sigmoid sums."""
    # 300 queries x group 2 = 5 tiles: causal tiles before the last end at their last row's
    # diagonal (the sigmoid share is of that extent, not of kv_len)
    w = run_variant(
        name,
        torch.bfloat16,
        64,
        False,
        True,
        4,
        2,
        0,
        [300, 1],
        [3000, 700],
        seed=3,
        device="cpu",
        workspace=_cpu_ws(),
        fixed_split_size=1024,
    )[0]
    assert w._plan.has_split and [c[0] for c in emu].count("merge_partials") == 1


def test_cpu_variant_errors(emu):
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    w = BatchPrefillWithRaggedKVCacheWrapper(_cpu_ws())
    ind = torch.tensor([0, 8], dtype=torch.int32)
    plan = lambda **kw: w.plan(
        **dict(
            dict(
                qo_indptr=ind,
                kv_indptr=ind,
                num_qo_heads=8,
                num_kv_heads=2,  # noqa: E731
                head_dim_qk=64,
                q_data_type=torch.bfloat16,
            ),
            **kw,
        )
    )
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        plan(pos_encoding_mode="ROPE")
    with pytest.raises(TypeError, match="Variant"):
        plan(variant="alibi")
    with pytest.raises(ValueError, match="custom_mask has 63"):
        plan(custom_mask=torch.ones(63, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_custom_mask has 7 bytes"):
        plan(packed_custom_mask=torch.ones(7, dtype=torch.uint8))
    q, k = torch.zeros(8, 8, 64, dtype=torch.bfloat16), torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    plan(variant=RelativePositionBias())
    with pytest.raises(ValueError, match="bias_table"):
        w.run(q, k, k)  # the example's table is missing
    with pytest.raises(ValueError, match="extra positional"):
        w.run(q, k, k, torch.zeros(8, 32), torch.zeros(1))
    w.run(q, k, k, torch.zeros(8, 32))
    with pytest.raises(ValueError, match="sinks"):
        w.run(q, k, k, torch.zeros(8, 32), sinks=torch.zeros(4))
    plan()
    with pytest.raises(TypeError, match="positional"):
        w.run(q, k, k, torch.zeros(1))
    pw = BatchPrefillWithPagedKVCacheWrapper(_cpu_ws())
    pages = torch.tensor([0, 1], dtype=torch.int32)
    pw.plan(
        ind,
        pages,
        torch.tensor([0]),
        torch.tensor([8]),
        8,
        2,
        64,
        16,
        q_data_type=torch.bfloat16,
        pos_encoding_mode="ALIBI",
    )
    pw.run(q, torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16), sinks=torch.zeros(8))
    assert emu[-1][1]["variant"] == "ALiBi+AttentionSink"
