"""Reference MLA (multi-head latent attention) in the absorbed form, in fp32 / fp64 torch: the
ground truth of the MLA kernel tests, with FlashInfer's conventions
(``flashinfer.mla.BatchMLAPagedAttentionWrapper``):

* ``q_nope [total_q, heads, 512]``, ``q_pe [total_q, heads, 64]``, ragged by ``qo_indptr``;
* one latent KV head: ``ckv_cache [pages, page_size, 512]``, ``kpe_cache [pages, page_size,
  64]``; token p of request b is slot ``p % page_size`` of page ``kv_indices[kv_indptr[b] + p
  // page_size]`` (``kv_indptr`` in pages), ``kv_lens[b]`` tokens;
* ``s_j = (q_nope . ckv_j + q_pe . kpe_j) * sm_scale``, ``out = softmax(s) . ckv``;
* causal is bottom-right aligned: query i of a request with ``qo_len`` q and ``kv_len`` k sees
  keys ``j <= k - q + i``;
* ``lse`` in base 2 (``log2 sum_j exp(s_j)``); a row that sees no key: ``out = 0``,
  ``lse = -inf``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from .reference import _check_compute_dtype, _highest_matmul_precision, _indptr_list

LOG2E = 1.0 / math.log(2.0)
MAX_ROW_ELEMS = 1 << 24  # logits per chunk of query tokens (x heads x keys)


def mla_gather(ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len: int, b: int):
    """Request b's first ``kv_len`` latent rows: (ckv [kv_len, 512], kpe [kv_len, 64])."""
    ptr = _indptr_list(kv_indptr, "kv_indptr")
    ps = ckv_cache.shape[1]
    pos = torch.arange(kv_len, device=ckv_cache.device)
    pages = torch.as_tensor(kv_indices, device=ckv_cache.device).long()[ptr[b] + pos // ps]
    return ckv_cache[pages, pos % ps], kpe_cache[pages, pos % ps]


def mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    sm_scale: float,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [total_q, heads, 512] in ``compute_dtype``, lse [total_q, heads] base 2), on the
    inputs' device."""
    _check_compute_dtype(compute_dtype)
    qo = _indptr_list(qo_indptr, "qo_indptr")
    lens = [int(x) for x in torch.as_tensor(kv_lens).tolist()]
    if len(lens) != len(qo) - 1:
        raise ValueError(f"kv_lens has {len(lens)} entries, qo_indptr says {len(qo) - 1} requests")
    total, heads = q_nope.shape[0], q_nope.shape[1]
    dv = ckv_cache.shape[-1]
    dev = q_nope.device
    out = torch.zeros(total, heads, dv, dtype=compute_dtype, device=dev)
    lse = torch.full((total, heads), -math.inf, dtype=torch.float32, device=dev)
    with _highest_matmul_precision():
        for b in range(len(qo) - 1):
            q0, q1, k = qo[b], qo[b + 1], lens[b]
            if q1 == q0 or k == 0:
                continue
            ckv, kpe = mla_gather(ckv_cache, kpe_cache, kv_indptr, kv_indices, k, b)
            ckv, kpe = ckv.to(compute_dtype), kpe.to(compute_dtype)
            step = max(1, MAX_ROW_ELEMS // max(1, heads * k))
            for t0 in range(q0, q1, step):
                t1 = min(q1, t0 + step)
                qn = q_nope[t0:t1].to(compute_dtype)  # [t, h, 512]
                qp = q_pe[t0:t1].to(compute_dtype)
                s = (torch.einsum("thd,kd->thk", qn, ckv) + torch.einsum("thd,kd->thk", qp, kpe)) * sm_scale
                if causal:
                    i = torch.arange(t0 - q0, t1 - q0, device=dev)[:, None]
                    j = torch.arange(k, device=dev)[None, :]
                    keep = j <= (k - (q1 - q0)) + i  # [t, k]
                    s = s.masked_fill(~keep[:, None, :], -math.inf)
                m = s.amax(-1, keepdim=True)
                m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
                e = torch.exp(s - m)
                den = e.sum(-1, keepdim=True)
                o = torch.einsum("thk,kd->thd", e, ckv) / den.clamp_min(torch.finfo(compute_dtype).tiny)
                seen = den.squeeze(-1) > 0
                out[t0:t1] = torch.where(seen[..., None], o, torch.zeros_like(o))
                row_lse = (m.squeeze(-1) + torch.log(den.squeeze(-1))) * LOG2E
                lse[t0:t1] = torch.where(seen, row_lse, torch.full_like(row_lse, -math.inf)).float()
    return out, lse
