"""⊕ merge kernels on the GPU against the fp64 reference.

Random inputs fresh per test (some states -inf, some rows all -inf), outputs pre-filled with
NaN so an unwritten element fails.  Tolerances: relative L2 error of v against the fp64
reference (the kernel accumulates in fp32 and stores the value dtype):
f32 1e-5, f16 2e-3, bf16 1e-2; LSE (fp32) absolute 1e-4.
"""

import pytest
import torch

import cute_attn
from cute_attn.testing import merge_state_reference, merge_states_reference

pytestmark = pytest.mark.gpu

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _lse(shape, neg_inf_frac=0.15):
    s = torch.randn(shape, device="cuda") * 4
    s[torch.rand(shape, device="cuda") < neg_inf_frac] = -float("inf")
    return s


def _check(v, s, v_ref, s_ref, dtype):
    assert not torch.isnan(v).any(), "NaN in output (unwritten or bad -inf handling)"
    assert not torch.isnan(s).any(), "NaN in LSE"
    err = (v.double() - v_ref).norm() / v_ref.norm().clamp_min(1e-30)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]}"
    fin = torch.isfinite(s_ref)
    assert torch.equal(torch.isfinite(s), fin), "LSE finiteness differs from reference"
    assert torch.equal(s[~fin], s_ref[~fin].float()), "empty rows must have LSE -inf"
    assert (v[~fin] == 0).all(), "empty rows must have v = 0"
    if fin.any():
        assert (s[fin].double() - s_ref[fin]).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seq,n,heads", [(1, 1, 1), (7, 2, 5), (333, 8, 32), (64, 3, 4)])
def test_merge_states(dtype, head_dim, seq, n, heads):
    dt = DTYPES[dtype]
    v = torch.randn(seq, n, heads, head_dim, device="cuda", dtype=dt)
    s = _lse((seq, n, heads))
    s[0] = -float("inf")  # one row with every state empty
    out = torch.full((seq, heads, head_dim), float("nan"), device="cuda", dtype=dt)
    lse = torch.full((seq, heads), float("nan"), device="cuda")
    cute_attn.merge_states(v, s, out=out, lse=lse)
    v_ref, s_ref = merge_states_reference(v, s)
    _check(out, lse, v_ref, s_ref, dt)
    # public form (allocating) gives the same bits, and runs are deterministic
    o2, l2 = cute_attn.merge_states(v, s)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


def test_merge_states_noncontiguous_and_zero_states():
    v_full = torch.randn(50, 6, 8, 2 * 128, device="cuda", dtype=torch.bfloat16)
    v = v_full[:, ::2, :, :128]  # strided states, sliced head_dim: strides stay 16-byte aligned
    s = _lse((50, 6, 8))[:, ::2]
    out, lse = cute_attn.merge_states(v, s)
    _check(out, lse, *merge_states_reference(v, s), torch.bfloat16)
    out0, lse0 = cute_attn.merge_states(v[:, :0], s[:, :0])
    assert (out0 == 0).all() and (lse0 == -float("inf")).all()
    e_out, e_lse = cute_attn.merge_states(v[:0], s[:0])
    assert e_out.shape == (0, 8, 128) and e_lse.shape == (0, 8)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_merge_state(dtype, head_dim):
    dt = DTYPES[dtype]
    seq, heads = 129, 7
    va, vb = (torch.randn(seq, heads, head_dim, device="cuda", dtype=dt) for _ in range(2))
    sa, sb = _lse((seq, heads), 0.3), _lse((seq, heads), 0.3)
    sa[:3], sb[:3] = -float("inf"), -float("inf")
    out = torch.full_like(va, float("nan"))
    lse = torch.full_like(sa, float("nan"))
    cute_attn.merge_state(va, sa, vb, sb, out=out, lse=lse)
    _check(out, lse, *merge_state_reference(va, sa, vb, sb), dt)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("use_mask", [False, True])
def test_merge_state_in_place(dtype, use_mask):
    dt = DTYPES[dtype]
    seq, heads, d = 301, 8, 128
    v = torch.randn(seq, heads, d, device="cuda", dtype=dt)
    s = _lse((seq, heads))
    vo = torch.randn(seq, heads, d, device="cuda", dtype=dt)
    so = _lse((seq, heads))
    mask = torch.rand(seq, device="cuda") < 0.5 if use_mask else None
    v0, s0 = v.clone(), s.clone()
    cute_attn.merge_state_in_place(v, s, vo, so, mask=mask)
    v_ref, s_ref = merge_state_reference(v0, s0, vo, so)
    if mask is not None:
        keep = ~mask
        assert torch.equal(v[keep], v0[keep]) and torch.equal(s[keep], s0[keep]), "masked-off rows changed"
        v, s, v_ref, s_ref = v[mask], s[mask], v_ref[mask], s_ref[mask]
    _check(v, s, v_ref, s_ref, dt)


def test_merge_matches_attention_split():
    """⊕ of the states of two disjoint KV halves equals attention over all of the KV."""
    from cute_attn.testing import single_reference

    q = torch.randn(17, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16)
    vv = torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16)
    o1, l1 = single_reference(q, k[:123], vv[:123])
    o2, l2 = single_reference(q, k[123:], vv[123:])
    o, l = cute_attn.merge_state(o1.float(), l1.float(), o2.float(), l2.float())
    o_all, l_all = single_reference(q, k, vv, dtype=torch.float64)
    assert (o.double() - o_all).norm() / o_all.norm() < 1e-5
    assert (l.double() - l_all).abs().max() < 1e-4


def test_merge_state_errors_on_gpu():
    v = torch.randn(4, 2, 128, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(4, 2, device="cuda")
    with pytest.raises(ValueError, match="mask"):
        cute_attn.merge_state_in_place(v, s, v.clone(), s.clone(), mask=torch.ones(5, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="one device"):
        cute_attn.merge_state(v, s, v.cpu(), s)
