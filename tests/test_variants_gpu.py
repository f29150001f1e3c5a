"""Every built-in variant and the user-defined example in paged decode against the fp32
reference with the same variant applied (``cute_attn.testing.reference.paged_variant_reference``).

Same conventions as tests/test_decode_gpu.py: shuffled pages, NaN in every unowned cache slot
and in the outputs before the run, an empty request and long ones (split across CTAs).
Specializations: ``cute_attn.testing.matrices.variant_decode_specs`` (bf16/d128 and f16/d64 of every
variant here).  RoPE cases use the reference's ``rope_round_to``: q/k rotated in fp32 and
rounded to the input dtype, as the kernel is specified to compute (and FlashInfer's
tensor-core path does); the plain fp32 rotation differs by the rounding (LSE 2.5e-3 at 3000 keys).
"""

import random

import pytest
import torch
from test_decode_gpu import check, make_paged

from cute_attn import BatchDecodeWithPagedKVCacheWrapper
from cute_attn.testing.reference import paged_variant_reference
from cute_attn.variants import Causal, FlashSigmoid, get_alibi_slopes
from cute_attn.variants.examples import RelativePositionBias

pytestmark = pytest.mark.gpu

# (dtype, head_dim, num_qo_heads, num_kv_heads, page_size): GQA 4, 1, 8, 8; page sizes 16 and 1
CONFIGS = [
    (torch.bfloat16, 128, 32, 8, 16),
    (torch.float16, 64, 8, 8, 1),
    (torch.bfloat16, 128, 16, 2, 1),
    (torch.float16, 64, 32, 4, 16),
]
KV_LENS = [1, 17, 300, 64, 0, 1000, 129, 5, 3000]


def _rel_bias_mod(table, bucket_size=16, num_buckets=32):
    def mod(s, b, h, qp, kp):
        bucket = ((qp - kp).clamp_min(0) // bucket_size).clamp_max(num_buckets - 1)
        return s + table[h, bucket]

    return mod


def _case(name, hq, gen, kv_lens):
    """(plan kwargs, run positional args, run kwargs, reference kwargs) of one variant case."""
    dev = "cuda"
    if name == "causal":
        return dict(variant=Causal()), (), {}, dict(causal=True)
    if name == "alibi":
        return dict(pos_encoding_mode="ALIBI"), (), {}, dict(alibi_slopes=get_alibi_slopes(hq))
    if name == "rope":
        return (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e5), (), {}, dict(rope=(2.0, 5e5)))
    if name == "sink":
        sinks = (torch.randn(hq, generator=gen) * 2).to(dev)
        return {}, (), dict(sinks=sinks), dict(sinks=sinks)
    if name == "custom_mask":
        mask = torch.rand(sum(kv_lens), generator=gen) < 0.7
        return dict(custom_mask=mask), (), {}, dict(custom_mask=mask)
    if name == "sigmoid":
        return dict(variant=FlashSigmoid(sigmoid_bias=-1.5)), (), {}, dict(sigmoid_bias=-1.5)
    if name == "rel_bias":  # the user-defined example: its table is run()'s extra argument
        table = (torch.randn(hq, 32, generator=gen)).to(dev)
        return dict(variant=RelativePositionBias()), (table,), {}, dict(score_mod=_rel_bias_mod(table))
    if name == "window_sink":  # gpt-oss: sliding window + sinks
        sinks = (torch.randn(hq, generator=gen) * 2).to(dev)
        return dict(window_left=100), (), dict(sinks=sinks), dict(window_left=100, sinks=sinks)
    if name == "alibi_softcap":
        return (
            dict(pos_encoding_mode="ALIBI", logits_soft_cap=5.0),
            (),
            {},
            dict(alibi_slopes=get_alibi_slopes(hq), logits_soft_cap=5.0),
        )
    if name == "rope_default":  # FlashInfer's defaults (scale 1, theta 1e4)
        return dict(pos_encoding_mode="ROPE_LLAMA"), (), {}, dict(rope=(1.0, 1e4))
    if name == "rope_sink":
        sinks = (torch.randn(hq, generator=gen) * 2).to(dev)
        return (dict(pos_encoding_mode="ROPE_LLAMA"), (), dict(sinks=sinks), dict(rope=(1.0, 1e4), sinks=sinks))
    raise KeyError(name)


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
]


def run_variant(name, dtype, d, hq, hk, page_size, kv_lens, seed=None, fixed_split_size=None, heads_per_item=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    cache, indptr, indices, last = make_paged(kv_lens, page_size, hk, d, dtype, "NHD", False, gen)
    b = len(kv_lens)
    q = torch.randn(b, hq, d, generator=gen).to(dtype).cuda()
    plan_kw, run_args, run_kw, ref_kw = _case(name, hq, gen, kv_lens)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(
        indptr,
        indices,
        last,
        hq,
        hk,
        d,
        page_size,
        q_data_type=dtype,
        fixed_split_size=fixed_split_size,
        heads_per_item=heads_per_item,
        **plan_kw,
    )
    if heads_per_item is not None:
        assert w._hpi == heads_per_item
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq), float("nan"), device="cuda")
    w.run(q, cache, *run_args, out=out, lse=lse, **run_kw)
    if "rope" in ref_kw:  # the kernel rotates q/k in fp32 and rounds them to the input dtype (the MMA operands)
        ref_kw = dict(ref_kw, rope_round_to=dtype)
    ref_o, ref_lse = paged_variant_reference(q, cache, None, indptr, indices, last, **ref_kw)
    check(out, lse, ref_o, ref_lse, dtype)
    return w, q, cache, run_args, run_kw, out, lse


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-h{c[2]}x{c[3]}-p{c[4]}")
@pytest.mark.parametrize("name", NAMES)
def test_variant_decode(name, config):
    dtype, d, hq, hk, ps = config
    run_variant(name, dtype, d, hq, hk, ps, KV_LENS)


@pytest.mark.parametrize("name", ["sink", "sigmoid", "rope", "rel_bias"])
def test_variant_split_kv(name):
    """A long request cut into many chunks (fixed_split_size): sinks are added once, sigmoid
    weights sum over the chunks, RoPE positions are absolute."""
    run_variant(name, torch.bfloat16, 128, 32, 8, 16, [9000, 33, 1, 4100], fixed_split_size=8)


@pytest.mark.parametrize(
    "name,dtype,d,h",
    [
        ("sink", torch.bfloat16, 128, 2),
        ("sink", torch.bfloat16, 128, 4),
        ("sink", torch.float16, 64, 4),
        ("window_sink", torch.bfloat16, 128, 4),
        ("window_sink", torch.float16, 64, 2),
        ("causal", torch.bfloat16, 128, 4),
        ("alibi", torch.bfloat16, 128, 4),
        ("custom_mask", torch.bfloat16, 128, 4),
    ],
)
def test_variant_head_packing(name, dtype, d, h):
    """Softmax variants without query/key transforms on a head-packed plan (2 or 4 kv heads per
    work item): each row's hooks see its own heads (ALiBi slope, sink), masks and windows per
    row; a 33k request is split across CTAs."""
    run_variant(name, dtype, d, 32, 8, 16, KV_LENS + [33000], heads_per_item=h)


def test_rope_long_context():
    """RoPE at positions past 32k (angles of ~40000 rad at the lowest dims): the kernel reduces
    pos * freq in fixed point (``dsl.sincos_multiple``), the reference as an fp32 product then
    sin/cos; the two reductions differ by ~1e-4 rad here, well inside the usual tolerances."""
    run_variant("rope_default", torch.bfloat16, 128, 32, 8, 16, [40000, 517, 1])


def test_variant_cuda_graph_and_determinism():
    w, q, cache, args, kw, out, lse = run_variant("window_sink", torch.bfloat16, 128, 32, 8, 16, KV_LENS)
    out2, lse2 = w.run(q, cache, *args, return_lse=True, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    g = torch.cuda.CUDAGraph()
    o3 = torch.full_like(out, float("nan"))
    with pytest.raises(RuntimeError, match="use_cuda_graph"):
        with torch.cuda.graph(g):
            w.run(q, cache, *args, out=o3, **kw)


def test_variant_errors():
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    ind = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, pos_encoding_mode="ROPE")
    with pytest.raises(TypeError, match="Variant"):
        w.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, variant="alibi")
    w.plan(ind, ind[:1], ind[1:], 8, 8, 128, 16, q_data_type=torch.bfloat16, variant=RelativePositionBias())
    cache = torch.randn(2, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="bias_table"):
        w.run(q, cache)  # the example's table is missing
    with pytest.raises(ValueError, match="sinks"):
        w.run(q, cache, torch.zeros(8, 32, device="cuda"), sinks=torch.zeros(4, device="cuda"))
