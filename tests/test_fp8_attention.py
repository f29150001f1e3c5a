"""fp8 attention for prefill (fp8 q / k / v on Hopper's fp8 wgmma: ``kernels/prefill_fp8.py``,
the V^T pass ``kernels/vt_pass.py``, ``wrappers/prefill_fp8.py``).

References.  The fp32 reference (``cute_attn.testing``) on the *dequantized* q / k / v (fp8 ->
fp32 is exact), with ``q_scale * k_scale`` in the softmax scale and ``v_scale`` on the output.
The kernel quantizes P to e4m3 (3 mantissa bits: up to 2^-4 relative error per weight) before
P·V, so its output cannot be as close to that reference as a 16-bit kernel's: the tolerance is
derived from a second fp32 reference that rounds P to e4m3 the same way (at the row's true max;
the kernel's lazily kept max differs from it by < 2^8, so its roundings differ, their size does
not).  Output: relative L2 error <= 1.5 x that reference's own error + 4e-3 (bf16 output
rounding, 2^-9; f16 2^-11: the same bound).  A wrong V^T permutation or a misplaced block
gives errors of order 1.  LSE (base 2, from the fp32 scores of exact fp8 products): absolute
2e-3 where finite, -inf exactly where the reference has it (o = 0 there).  Outputs and LSE are
pre-filled with NaN; a paged cache has NaN in every slot no request owns, ragged K / V have NaN
rows past the last request.

CPU tests: both wrappers against emulations of the two kernels' contracts (the V^T layout of
``families/prefill_fp8.py``, read back through ``vt_key`` by the attention emulation, which
also asserts that every item's KV starts on a 32-key group), every refusal, and that the GPU
cases' specs ship.  GPU tests (marked ``gpu``): ragged and paged (page 1 / 16, NHD / HND),
head dims 64 / 128, GQA 1-8, causal or not, bf16 / f16 output, lengths 0 / 1 / odd / long /
a split-KV skew, scales, determinism.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_prefill_gpu import _cpu_ws, _cumsum, _emulate_merge, _Emulated, _fake_cuda, _gen, emu, make_paged, make_ragged  # noqa: F401

from cute_attn.families.prefill_fp8 import VT_GROUP, vt_key
from cute_attn.testing import ragged_reference

gpu = pytest.mark.gpu
DEV = "cuda"
E4M3 = torch.float8_e4m3fn
BF, F16 = torch.bfloat16, torch.float16
# LSE (base 2, absolute).  Not the 16-bit tests' 2e-3: Hopper's fp8 wgmma adds its products in
# reduced precision before the fp32 accumulator (DeepSeek-V3's report: ~14 bits), so S -- and the
# LSE, a weighted mean of it -- differ from the fp32 reference's by up to a few 1e-3 at head dim
# 128.  Measured on the H200 over this grid, three kernel settings (128 / 192 keys, lazy rescale
# on / off): every case below 2e-3 but one per run, at 2.05e-3, 2.09e-3 and 2.76e-3, each time a
# different case of the random inputs (no layout pattern).
LSE_TOL = 5e-3
OUT_SLACK = 4e-3


# --------------------------------------------------------------------------- references


def pq_reference(q, k, v, qo, kv, causal, sm_scale):
    """fp32 attention with P rounded to e4m3 before P·V (at each row's true max); the row sum of
    the unrounded weights, as the kernel keeps it.  q / k / v dequantized, [tokens, heads, d]."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qo, kv = qo.tolist(), kv.tolist()
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if qe == qs or ke == ks:
            continue
        qq = q[qs:qe].float().transpose(0, 1)  # [hq, m, d]
        kk = k[ks:ke].float().repeat_interleave(g, 1).transpose(0, 1)
        vv = v[ks:ke].float().repeat_interleave(g, 1).transpose(0, 1)
        s = (qq @ kk.transpose(1, 2)) * (sm_scale * math.log2(math.e))
        if causal:
            m, n = qe - qs, ke - ks
            qpos = torch.arange(m, device=q.device)[:, None] + (n - m)
            s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos, -math.inf)
        mx = s.amax(-1, keepdim=True)
        mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
        p = torch.exp2(s - mx)
        den = p.sum(-1, keepdim=True)
        o = (p.to(E4M3).float() @ vv) / den.clamp_min(1e-30)
        out[qs:qe] = torch.where(den > 0, o, torch.zeros_like(o)).transpose(0, 1)
    return out


def rel(a, b):
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-6)).item()


def check_fp8(out, lse, ref_o, ref_lse, pq_o, o_dtype):
    assert out.dtype == o_dtype
    assert not torch.isnan(out).any(), "NaN in output (unwritten row or a wrong read)"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    tol = 1.5 * rel(pq_o, ref_o) + OUT_SLACK
    err = rel(out, ref_o)
    assert err <= tol, f"relative error {err:.3e} > {tol:.3e} (P-rounded reference: {rel(pq_o, ref_o):.3e})"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs from the reference"
    if fin.any():
        e = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert e < LSE_TOL, f"LSE error {e:.3e}"
    assert (out[~fin] == 0).all(), "rows that see no key must be 0"
    return err, tol


# --------------------------------------------------------------------------- cases


class Case:
    def __init__(self, w, q, kv_args, ref, qo, kv_tok, o_dtype, causal, sm_scale):
        self.w, self.q, self.kv_args, self.ref = w, q, kv_args, ref  # ref: dequantized (q, k, v)
        self.qo, self.kv_tok, self.o_dtype, self.causal, self.sm_scale = qo, kv_tok, o_dtype, causal, sm_scale

    def run(self, q_scale=None, k_scale=None, v_scale=None, check=True):
        q, hq = self.q, self.q.shape[1]
        out = torch.full(q.shape, float("nan"), dtype=self.o_dtype, device=q.device)
        lse = torch.full((q.shape[0], hq), float("nan"), device=q.device)
        self.w.run(q, *self.kv_args, out=out, lse=lse, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        if check:
            f = lambda x: 1.0 if x is None else float(x)  # noqa: E731
            sm = self.sm_scale * f(q_scale) * f(k_scale)
            qf, kf, vf = self.ref
            ref_o, ref_lse = ragged_reference(qf, kf, vf, self.qo, self.kv_tok, causal=self.causal, sm_scale=sm)
            pq = pq_reference(qf, kf, vf, self.qo, self.kv_tok, self.causal, sm)
            check_fp8(out, lse, ref_o * f(v_scale), ref_lse, pq * f(v_scale), self.o_dtype)
        return out, lse


def plan_case(kind, qo_lens, kv_lens, hq, hk, d, *, o_dtype=BF, causal=False, page_size=16, layout="NHD",
              single_tensor=False, device=None, workspace=None, seed=None, scale=1.0, **plan_kw) -> Case:  # fmt: skip
    """Fresh random inputs (fp32 ``scale`` x N(0, 1), NaN where no request owns a slot, then e4m3)
    and a wrapper planned for them (``kind``: "paged" / "ragged")."""
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    device = device or DEV
    gen = _gen(seed)
    ws = workspace if workspace is not None else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    qo = torch.tensor(_cumsum(qo_lens), dtype=torch.int32)
    opts = dict(causal=causal, q_data_type=E4M3, kv_data_type=E4M3, o_data_type=o_dtype, **plan_kw)
    if kind == "paged":
        cache, indptr, indices, last, (k, v), kv_tok = make_paged(
            kv_lens, page_size, hk, d, torch.float32, layout, single_tensor, gen, "cpu"
        )
        cache = (
            (cache * scale).to(E4M3).to(device)
            if single_tensor
            else tuple((t * scale).to(E4M3).to(device) for t in cache)
        )
        q = (torch.randn(sum(qo_lens), hq, d, generator=gen) * scale).to(E4M3).to(device)
        w = BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout)
        w.plan(qo, indptr, indices, last, hq, hk, d, page_size, **opts)
        kv_args = (cache,)
    else:
        q, k_all, v_all, _, kv_tok, (k, v) = make_ragged(
            qo_lens, kv_lens, hq, hk, d, torch.float32, layout, gen, "cpu", tail=5
        )
        q = (q * scale).to(E4M3).to(device)
        w = BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout=layout)
        w.plan(qo, kv_tok, hq, hk, d, **opts)
        kv_args = ((k_all * scale).to(E4M3).to(device), (v_all * scale).to(E4M3).to(device))
    ref = (q.float(), (k * scale).to(E4M3).float().to(device), (v * scale).to(E4M3).float().to(device))
    sm = plan_kw.get("sm_scale") or 1.0 / math.sqrt(d)
    return Case(w, q, kv_args, ref, qo, kv_tok, o_dtype, causal, sm)


LENS = ([1, 17, 128, 300, 5, 77], [1, 117, 128, 333, 2005, 77])  # kv = qo and kv > qo (append)
EDGES = {
    "empty_requests": ([0, 5, 0, 300, 7, 2], [10, 0, 0, 500, 7, 0]),
    "single_tokens": ([1, 1, 1], [1, 2, 1]),
    "odd": ([1, 3, 129, 77, 255], [1, 999, 129, 301, 1023]),
    "long_4k": ([4096], [4096]),
    "split_kv_skew": ([1, 4000, 3], [30000, 4000, 60000]),
    "no_keys": ([4, 9], [0, 0]),
}
GPU_CASES = (
    [
        (f"dims-{kind}-d{d}-{od}-h{hq}x{hk}-c{int(c)}", (kind,) + LENS + (hq, hk, d),
         dict(o_dtype=dict(bf16=BF, f16=F16)[od], causal=c, layout="HND" if hq == 16 else "NHD"))
        for kind in ("ragged", "paged") for d in (64, 128) for od in ("bf16", "f16")
        for hq, hk in ((8, 8), (32, 8), (16, 2)) for c in (False, True)
    ]
    + [
        (f"pages-ps{ps}-{lay}-{'single' if st else 'tuple'}", ("paged",) + LENS + (32, 8, 128),
         dict(page_size=ps, layout=lay, single_tensor=st, causal=True))
        for ps in (1, 16) for lay in ("NHD", "HND") for st in (False, True)
    ]
    + [
        (f"lengths-{kind}-{name}", (kind,) + lens + (32, 8, 128),
         dict(causal=True, page_size=1 if kind == "paged" else 16))
        for kind in ("ragged", "paged") for name, lens in EDGES.items()
    ]
)  # fmt: skip


# =========================================================================== GPU tests


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_fp8_attention(case):
    _, args, kw = case
    c = plan_case(*args, **kw)
    c.run()


@gpu
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_fp8_attention_scales_and_determinism(kind):
    c = plan_case(kind, *LENS, 32, 8, 128, causal=True, scale=0.5)
    a, la = c.run(q_scale=2.0, k_scale=0.75, v_scale=3.0)
    b, lb = c.run(q_scale=2.0, k_scale=0.75, v_scale=3.0)
    assert torch.equal(a, b) and torch.equal(la, lb)  # bitwise the same run to run
    c.run(q_scale=torch.tensor([1.5]), k_scale=torch.tensor([0.5], device=DEV), v_scale=None)
    c.run()
    # per-kv-head v scales multiply the output's heads; per-head q / k scales are refused
    vs = torch.rand(8, device=DEV) + 0.25
    o, lo = c.run(q_scale=2.0, k_scale=0.75, v_scale=vs, check=False)
    heads = torch.arange(32, device=DEV) // 4
    torch.testing.assert_close(o.float(), (a.float() / 3.0) * vs[heads][:, None], rtol=1e-2, atol=1e-3)
    assert torch.equal(lo, la)
    with pytest.raises(ValueError, match="fp8 queries"):
        c.run(k_scale=torch.ones(8, device=DEV))


def tensor_core_lse(q8, k8, qo, kv, causal, sm_scale):
    """Base-2 LSE of the scores Hopper's fp8 tensor cores give: S = q k^T by cuBLAS's fp8 GEMM
    (``torch._scaled_mm``, unit scales, fp32 out) per request and q head, the softmax in fp32.
    ``q8`` / ``k8``: e4m3, [tokens, heads, d]."""
    hq, hk, d = q8.shape[1], k8.shape[1], q8.shape[2]
    out = torch.full((q8.shape[0], hq), -math.inf, device=q8.device)
    one = torch.ones((), device=q8.device)
    qo, kv = qo.tolist(), kv.tolist()
    for b in range(len(qo) - 1):
        m, n = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if m == 0 or n == 0:
            continue
        qa = torch.zeros(-(-m // 16) * 16, d, dtype=E4M3, device=q8.device)
        ka = torch.zeros(-(-n // 16) * 16, d, dtype=E4M3, device=q8.device)
        for h in range(hq):
            qa[:m] = q8[qo[b] : qo[b + 1], h]
            ka[:n] = k8[kv[b] : kv[b + 1], h // (hq // hk)]
            s = torch._scaled_mm(qa, ka.t(), one, one, out_dtype=torch.float32)[:m, :n] * (sm_scale * math.log2(math.e))
            if causal:
                qpos = torch.arange(m, device=q8.device)[:, None] + (n - m)
                s = s.masked_fill(torch.arange(n, device=q8.device)[None, :] > qpos, -math.inf)
            out[qo[b] : qo[b + 1], h] = torch.logsumexp(s * math.log(2), -1) / math.log(2)
    return out


# The large-logits case's LSE: the tensor cores' own fp8 products-and-sums differ from exact fp32
# ones (Hopper's fp8 MMA accumulates with ~14 significant bits), by an amount that grows with the
# logits.  Measured on the H200 at f53ff88 (scripts/fp8_knobs.py, this case): the LSE of cuBLAS's
# fp8 GEMM scores is up to 5.98e-2 from the fp32 reference's (mean 7.0e-3; every row's largest
# logit above 40 in base 2), and the kernel's LSE is within 1.4e-4 of cuBLAS's (full and fast
# accumulation alike: one 128-deep k-chunk).  So the kernel's LSE is checked against the tensor
# cores' scores at LSE_TOL, and against the fp32 reference for gross errors only (LARGE_LSE_FP32:
# 2.5x the tensor cores' own distance).  The output passes the usual bound (4.5e-3 against 1.16e-2).
LARGE_LSE_FP32 = 0.15


@gpu
def test_fp8_attention_large_logits():
    """Logits of ~+-60 (q, k ~ 4 N(0, 1); every row's max above 40 in base 2): rows dominated by
    one key, the max raised on every new maximum so each row's largest weight is exactly 1 in
    e4m3.  Output against the fp32 reference with the usual bound; LSE against the tensor cores'
    scores (see above)."""
    c = plan_case("ragged", [500, 1000], [700, 3000], 16, 4, 128, causal=True, scale=4.0)
    out, lse = c.run(check=False)
    qf, kf, vf = c.ref
    ref_o, ref_lse = ragged_reference(qf, kf, vf, c.qo, c.kv_tok, causal=True, sm_scale=c.sm_scale)
    pq = pq_reference(qf, kf, vf, c.qo, c.kv_tok, True, c.sm_scale)
    tc = tensor_core_lse(c.q, kf.to(E4M3), c.qo, c.kv_tok, True, c.sm_scale)
    check_fp8(out, lse, ref_o, tc, pq, BF)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(tc), fin)
    e = (lse[fin] - ref_lse[fin]).abs().max().item()
    assert e < LARGE_LSE_FP32, f"LSE error against the fp32 reference {e:.3e}"


# =========================================================================== CPU tests


def _emulate_vt_pass(p, k, v, k_out, vt, kv_indptr, page_indptr, page_indices, groups, num_groups):
    """kernels/vt_pass.py: per group (request b, first key j0, column c0) and kv head h,
    vt[h, :, c0 + col] = V[key j0 + vt_key(col % 32) + 32 (col // 32)] (zeros past the request),
    and (paged) K gathered into rows kv_indptr[b] + j of k_out."""
    assert k.dtype == v.dtype == vt.dtype == E4M3 and num_groups == groups.shape[0]
    ps = k.shape[1]
    for g in range(num_groups):
        b, j0, c0 = groups[g].tolist()
        assert c0 % VT_GROUP == 0 and j0 % VT_GROUP == 0
        t0, n = int(kv_indptr[b]), int(kv_indptr[b + 1] - kv_indptr[b])
        for col in range(VT_GROUP):
            key = j0 + vt_key(col)
            if key >= n:
                vt[:, :, c0 + col] = torch.zeros((), dtype=torch.float32).to(E4M3)
                continue
            if p["paged"]:
                page = int(page_indices[int(page_indptr[b]) + key // ps])
                vt[:, :, c0 + col] = v[page, key % ps]
                k_out[0, t0 + key] = k[page, key % ps]
            else:
                vt[:, :, c0 + col] = v[0, t0 + key]


def _emulate_fp8_attn(p, q, k4, vt, kv_indptr, vt_indptr, out, lse, work, work_indptr, part_o, part_lse, group,
                      sm_scale, v_scale, num_ctas):  # fmt: skip
    """What kernels/prefill_fp8.py must compute, item by item (fp64, P not rounded): V read back
    from V^T through vt_key; every item's kv range starts on a 32-key group."""
    from cute_attn.sched import workspace as ws

    tile = p["tile_q"]
    assert q.dtype == k4.dtype == vt.dtype == E4M3 and work_indptr.numel() == num_ctas + 1
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    ip = work_indptr.tolist()
    inv = [0] * VT_GROUP
    for col in range(VT_GROUP):
        inv[vt_key(col)] = col
    for c in range(num_ctas):
        for it in range(ip[c], ip[c + 1]):
            f = work[it].tolist()
            b, h, r0, nr = f[ws.W_REQ], f[ws.W_KV_HEAD], f[ws.W_ROW_START], f[ws.W_NUM_ROWS]
            ks, ke, dest, qoff = f[ws.W_KV_START], f[ws.W_KV_END], f[ws.W_DEST], f[ws.W_QO_OFFSET]
            qo_len, kv_len = f[ws.W_QO_LEN], f[ws.W_KV_LEN]
            assert ks % VT_GROUP == 0, f"item kv_start {ks} not on a 32-key group"
            rows = torch.arange(r0, r0 + nr)
            tok, heads = qoff + rows // group, h * group + rows % group
            qq = q[tok, heads].double()
            keys = torch.arange(ks, ke)
            kk = k4[0, int(kv_indptr[b]) + keys, h].double()
            cols = (
                int(vt_indptr[b])
                + keys // VT_GROUP * VT_GROUP
                + torch.tensor([inv[j % VT_GROUP] for j in keys.tolist()], dtype=torch.long)
            )
            vv = vt[h][:, cols].double().T if len(keys) else torch.zeros(0, q.shape[2], dtype=torch.float64)
            s = (qq @ kk.T) * sm_scale * math.log2(math.e)
            if p["causal"]:
                qpos = (kv_len - qo_len) + rows // group
                s = s.masked_fill(keys[None, :] > qpos[:, None], -math.inf)
            m = s.amax(1) if s.shape[1] else torch.full((nr,), -math.inf, dtype=torch.float64)
            m0 = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            w_ = torch.exp2(s - m0[:, None])
            tot = w_.sum(1)
            o = torch.where(
                tot[:, None] > 0, (w_ @ vv) / tot.clamp_min(1e-300)[:, None], torch.zeros(1, dtype=torch.float64)
            )
            o = o * v_scale
            l2 = torch.where(tot > 0, m0 + torch.log2(tot.clamp_min(1e-300)), torch.full_like(tot, -math.inf))
            if dest < 0:
                out[tok, heads] = o.to(out.dtype)
                lse[tok, heads] = l2.float()
            else:
                part_o[dest * tile + torch.arange(nr)] = o.float()
                part_lse[dest * tile + torch.arange(nr)] = l2.float()


class _EmulatedFp8(_Emulated):
    """``_Emulated`` with the fp8 attention and V^T pass emulations."""

    OWN = {"batch_prefill_fp8_sm90": _emulate_fp8_attn, "vt_pass": _emulate_vt_pass}

    def __init__(self, family, params, calls):
        if family not in self.OWN:
            super().__init__(family, params, calls)
            return
        from cute_attn.families.base import get_family
        from cute_attn.runtime.loader import make_packer

        self.family, self.params, self.calls = family, params, calls
        self.pack = make_packer(get_family(family).abi(params))
        self.emulate = self.OWN[family]


@pytest.fixture
def emu8(emu, monkeypatch):
    import cute_attn.wrappers.prefill_fp8 as P8

    monkeypatch.setattr(P8, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(P8, "sm_count_of_index", lambda i: 8)
    monkeypatch.setattr(P8, "kernel", lambda family, arch, **params: _EmulatedFp8(family, params, emu.calls))
    return emu


CPU_CASES = [
    ("ragged", [1, 17, 130, 0, 64], [1, 40, 500, 9, 64], 8, 2, 64, dict(causal=True)),
    ("ragged", [3, 200, 1], [100, 200, 2000], 4, 4, 128, dict(causal=False, layout="HND")),
    ("paged", [1, 17, 130, 0, 3], [1, 40, 500, 9, 3], 8, 2, 64, dict(causal=True, page_size=16)),
    ("paged", [5, 64], [333, 64], 4, 1, 64, dict(causal=False, page_size=1, layout="HND", single_tensor=True)),
    ("ragged", [1, 2], [3000, 5000], 2, 1, 64, dict(causal=True)),  # few long items: split KV
    ("ragged", [7, 3], [0, 0], 4, 4, 64, dict()),  # no keys: no kernel
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CPU_CASES)])
def test_cpu_fp8_wiring(emu8, case):
    kind, qo, kv, hq, hk, d, kw = case
    c = plan_case(kind, qo, kv, hq, hk, d, device="cpu", workspace=_cpu_ws(), seed=3, **kw)
    out, lse = c.run(q_scale=1.5, k_scale=0.5, v_scale=2.0, check=False)
    f = lambda t: t.float()  # noqa: E731
    qf, kf, vf = c.ref
    ref_o, ref_lse = ragged_reference(qf, kf, vf, c.qo, c.kv_tok, causal=c.causal, sm_scale=c.sm_scale * 0.75)
    assert out.dtype == BF and not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel(f(out), ref_o * 2.0) < 1e-2
    fin = torch.isfinite(ref_lse)
    assert (
        torch.equal(torch.isfinite(lse), fin) and (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-4
        if fin.any()
        else True
    )
    fams = [fam for fam, _ in emu8.calls]
    if sum(kv):
        assert fams[:2] == ["vt_pass", "batch_prefill_fp8_sm90"], fams
        assert emu8.calls[0][1]["paged"] == (kind == "paged")
        if case is CPU_CASES[4]:
            assert c.w._state.plan.has_split and fams[2] == "merge_partials"
    else:
        assert fams == []


def test_cpu_fp8_refusals(emu8):
    from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

    ws = _cpu_ws()
    qo = torch.tensor([0, 4], dtype=torch.int32)
    w = BatchPrefillWithRaggedKVCacheWrapper(ws)
    base = dict(q_data_type=E4M3, kv_data_type=E4M3, o_data_type=BF)
    nie = [
        dict(base, o_data_type=None),
        dict(base, o_data_type=E4M3),
        dict(base, q_data_type=torch.float8_e5m2, kv_data_type=torch.float8_e5m2),
        dict(base, kv_data_type=BF),
        dict(base, window_left=8),
        dict(base, logits_soft_cap=30.0),
        dict(base, pos_encoding_mode="ROPE_LLAMA"),
        dict(base, custom_mask=torch.ones(16, dtype=torch.bool)),
    ]
    for kw in nie:
        with pytest.raises(NotImplementedError):
            w.plan(qo, qo, 4, 4, 128, **kw)
    with pytest.raises(NotImplementedError, match="head_dim"):
        w.plan(qo, qo, 4, 4, 256, **base)
    with pytest.raises(ValueError, match="multiples of 32"):
        w.plan(qo, qo, 4, 4, 128, fixed_split_size=48, **base)
    wg = BatchPrefillWithRaggedKVCacheWrapper(
        ws, use_cuda_graph=True, qo_indptr_buf=_fake_cuda(qo.clone()), kv_indptr_buf=_fake_cuda(qo.clone())
    )
    with pytest.raises(NotImplementedError, match="cuda_graph"):
        wg.plan(qo, qo, 4, 4, 128, **base)
    wp = BatchPrefillWithPagedKVCacheWrapper(ws)
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_pass=False"):
        wp.plan(qo, one, torch.zeros(1, dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 4, 4, 128, 16,
                kv_pass=False, **base)  # fmt: skip
    # run(): the output dtype, sinks
    c = plan_case("ragged", [4], [40], 4, 4, 64, device="cpu", workspace=ws, seed=1)
    with pytest.raises(ValueError, match="o_data_type"):
        c.w.run(c.q, *c.kv_args, out=torch.empty(c.q.shape, dtype=F16))
    with pytest.raises(NotImplementedError, match="sinks"):
        c.w.run(c.q, *c.kv_args, sinks=torch.zeros(4))
    assert emu8.calls == [] or all(f != "batch_prefill_fp8_sm90" for f, _ in emu8.calls)


def test_cpu_fp8_plans_cut_on_groups(emu8):
    """Split-KV plans of many shapes: every item starts on a 32-key group (the V^T contract)."""
    import random

    from cute_attn.sched import workspace as ws

    rng = random.Random(5)
    splits = 0
    for _ in range(12):
        n = rng.randrange(1, 6)
        kv = [rng.randrange(0, 9000) for _ in range(n)]
        qo = [rng.randrange(1, 40) for _ in range(n)]
        c = plan_case(
            "ragged",
            qo,
            kv,
            8,
            2,
            128,
            device="cpu",
            workspace=_cpu_ws(),
            seed=rng.randrange(99),
            causal=rng.random() < 0.5,
        )
        plan = c.w._state.plan
        splits += plan.has_split
        assert (plan.work_items[:, ws.W_KV_START] % VT_GROUP == 0).all()
    assert splits >= 3  # the property is exercised by split plans


def test_cpu_gpu_cases_use_shipped_specs(emu8, monkeypatch):
    """Every GPU case plans with specs of the ``all`` preset (sm_90a, 132 SMs)."""
    import cute_attn.wrappers.prefill_base as P
    import cute_attn.wrappers.prefill_fp8 as P8
    from cute_attn.families.spec import Spec
    from cute_attn.presets import preset_specs

    have = {(s.family, s.params) for s in preset_specs("all", "sm_90a")}
    missing = []

    def lookup(family, arch, **params):
        if (family, Spec.make(family, arch, **params).params) not in have:
            missing.append((family, params))
        return _EmulatedFp8(family, params, [])

    monkeypatch.setattr(P8, "kernel", lookup)
    monkeypatch.setattr(P8, "sm_count_of_index", lambda i: 132)
    monkeypatch.setattr(P, "sm_count_of_index", lambda i: 132)
    for _, args, kw in GPU_CASES:
        plan_case(*args, device="cpu", workspace=_cpu_ws(), seed=0, **kw)
    assert not missing, missing[:5]
