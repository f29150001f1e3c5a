"""What the MLA tests share: a paged latent cache with shuffled pages (NaN in every slot no request
owns), optionally as SGLang's views of one 576-wide buffer; the check against the reference;
and a CPU emulation of what ``kernels/mla_decode.py`` must compute per work item (fp64), used
to test the wrapper's wiring without a GPU."""

from __future__ import annotations

import math
import random

import torch

from cute_attn.testing.mla_reference import mla_reference

CKV, KPE = 512, 64
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # relative Frobenius error of out
LSE_TOL = 2e-3


def gen(seed=None):
    return torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))


def cumsum(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def make_batch(qo_lens, kv_lens, heads, page_size, dtype, g, device="cpu", packed=False, spare=3, scale=1.0,
               kv_dtype=None):  # fmt: skip
    """(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_lens) with CPU
    int32 index arrays; ``packed``: q and the caches as views of 576-wide buffers (SGLang's
    ``q[..., :512]`` / ``k_buffer[..., :512]``).  Queries are scaled by ``scale`` (larger logits:
    a sharper softmax).  ``kv_dtype``: an fp8 cache (the 16-bit values rounded to it)."""
    ps = page_size
    pages = [(n + ps - 1) // ps for n in kv_lens]
    total = sum(pages) + spare
    indptr = cumsum(pages)
    indices = torch.randperm(total, generator=g)[: indptr[-1]].to(torch.int32)
    cache = torch.full((total * ps, CKV + KPE), float("nan"), dtype=dtype)
    for b, n in enumerate(kv_lens):
        pos = torch.arange(n)
        slots = indices[indptr[b] + pos // ps].long() * ps + pos % ps
        cache[slots] = torch.randn(n, CKV + KPE, generator=g).to(dtype)
    cache = cache.view(total, ps, CKV + KPE).to(device)
    if kv_dtype is not None:
        cache = cache.to(kv_dtype)
    tq = sum(qo_lens)
    q = (torch.randn(tq, heads, CKV + KPE, generator=g) * scale).to(dtype).to(device)
    if packed:
        qn, qp, ckv, kpe = q[..., :CKV], q[..., CKV:], cache[..., :CKV], cache[..., CKV:]
    else:
        qn, qp = q[..., :CKV].contiguous(), q[..., CKV:].contiguous()
        ckv, kpe = cache[..., :CKV].contiguous(), cache[..., CKV:].contiguous()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return qn, qp, ckv, kpe, i32(cumsum(qo_lens)), i32(indptr), indices, i32(kv_lens)


def reference(b, sm_scale, causal, compute_dtype=torch.float32):
    """The reference on the batch's cache values (an fp8 cache dequantized: exact in the q dtype)."""
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    dev = qn.device
    ckv, kpe = ckv.to(qn.dtype), kpe.to(qn.dtype)
    return mla_reference(qn, qp, ckv, kpe, qo.to(dev), kvp.to(dev), idx.to(dev), kvl, sm_scale, causal, compute_dtype)


def check(out, lse, ref_o, ref_lse, dtype, rows=None):
    if rows is not None:
        out, lse, ref_o, ref_lse = out[:rows], lse[:rows], ref_o[:rows], ref_lse[:rows]
    assert not torch.isnan(out).any(), "NaN in output (unwritten row or a wrong read)"
    assert not torch.isnan(lse).any(), "NaN in LSE"
    err = ((out.float() - ref_o.float()).norm() / ref_o.float().norm().clamp_min(1e-6)).item()
    assert err < TOL[dtype], f"relative error {err:.3e} >= {TOL[dtype]}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs from the reference"
    if fin.any():
        e = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert e < LSE_TOL, f"LSE error {e:.3e}"
    assert (out[~fin] == 0).all(), "rows that see no key must be 0"


def emulate_mla(p, qn, qp, ckv, kpe, kv_indptr, kv_indices, out, lse, work, work_indptr, part_o, part_lse, group,
                causal, sm_scale, num_ctas):  # fmt: skip
    """What kernels/mla_decode.py must compute, item by item (fp64): the item's packed rows
    (token r // group, head r % group) over keys [KV_START, KV_END), causal bottom-right, into
    the final rows or partial slot DEST (tile_q rows per slot)."""
    from cute_attn.sched import workspace as ws

    tile = p["tile_q"]
    part_o.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    ip = work_indptr.tolist()
    kvp = kv_indptr.long()
    ps = ckv.shape[1]
    assert kpe.shape[:2] == ckv.shape[:2] and group == qn.shape[1]
    for c in range(num_ctas):
        for it in range(ip[c], ip[c + 1]):
            f = work[it].tolist()
            b, h, r0, nr = f[ws.W_REQ], f[ws.W_KV_HEAD], f[ws.W_ROW_START], f[ws.W_NUM_ROWS]
            ks, ke, dest = f[ws.W_KV_START], f[ws.W_KV_END], f[ws.W_DEST]
            qoff, qlen, klen = f[ws.W_QO_OFFSET], f[ws.W_QO_LEN], f[ws.W_KV_LEN]
            assert h == 0 and 1 <= nr <= tile and 0 <= ks <= ke <= klen and r0 % tile == 0
            rows = torch.arange(r0, r0 + nr)
            tok, head = qoff + rows // group, rows % group
            qpos = klen - qlen + rows // group
            pos = torch.arange(ks, ke)
            page = kv_indices.long()[kvp[b] + pos // ps]
            kc = ckv[page, pos % ps].double()  # [n, 512]
            kp = kpe[page, pos % ps].double()
            s = (qn[tok, head].double() @ kc.T + qp[tok, head].double() @ kp.T) * sm_scale  # [nr, n]
            if causal:
                s = s.masked_fill(pos[None, :] > qpos[:, None], -math.inf)
            m = s.amax(1, keepdim=True) if s.shape[1] else torch.full((nr, 1), -math.inf, dtype=torch.float64)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            e = torch.exp(s - m)
            den = e.sum(1, keepdim=True)
            o = torch.where(den > 0, (e @ kc) / den.clamp_min(1e-300), torch.zeros(1, dtype=torch.float64))
            row_lse = torch.where(den > 0, (m + torch.log(den)) / math.log(2), -math.inf).squeeze(1)
            if dest < 0:
                out[tok, head] = o.to(out.dtype)
                lse[tok, head] = row_lse.float()
            else:
                part_o[dest * tile : dest * tile + nr] = o.float()
                part_lse[dest * tile : dest * tile + nr] = row_lse.float()
