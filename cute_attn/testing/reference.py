"""Reference attention in fp32/fp64 torch: the ground truth for every kernel test.

Everything here follows FlashInfer's conventions so that results can be compared
one-to-one with FlashInfer (and with ``cute_attn``'s drop-in wrappers):

* Queries/outputs are ragged: ``q`` is ``[total_q, num_qo_heads, head_dim]`` and
  request ``b`` owns rows ``qo_indptr[b]:qo_indptr[b+1]``.
* KV is ragged (``k``/``v`` ``[total_kv, num_kv_heads, head_dim]`` with ``kv_indptr``
  in tokens) or paged (see :func:`paged_kv_to_ragged`). Paged KV is gathered into
  ragged KV first, so every entry point runs on the one ragged core
  (:func:`ragged_reference`).
* GQA: qo head ``h`` reads kv head ``h // (num_qo_heads // num_kv_heads)``.
* Logits: ``s = (q . k) * sm_scale`` with ``sm_scale`` defaulting to
  ``1/sqrt(head_dim)``. With ``logits_soft_cap > 0``:
  ``s = cap * tanh((q . k) * sm_scale / cap)`` -- FlashInfer's convention
  (``pre_tanh_scale = sm_scale / cap``, ``post_tanh_scale = cap``, i.e. the cap is
  applied to the already scaled logits).
* Masks (all combine with AND; ``True`` = keep). For a request with ``qo_len`` rows
  and ``kv_len`` keys, let ``d = kv_len - qo_len`` (bottom-right alignment):

  - ``causal``: row ``i`` sees keys ``j <= i + d``.
  - ``window_left = w >= 0``: row ``i`` sees keys ``j >= i + d - w`` (the ``w`` keys
    left of the aligned diagonal plus the diagonal itself). As in FlashInfer it
    applies with or without ``causal`` (without ``causal`` it bounds the left side
    only). ``-1`` disables it.
  - ``custom_mask``: flat bool tensor, the concatenation over requests of row-major
    ``[qo_len, kv_len]`` masks (FlashInfer's unpacked ``custom_mask``); for
    :func:`single_reference` a ``[qo_len, kv_len]`` tensor is also accepted.
* Results: ``out`` ``[total_q, num_qo_heads, head_dim]`` in the compute dtype
  (the caller casts), ``lse`` ``[total_q, num_qo_heads]`` in **base 2**:
  ``lse = log2(sum_j exp(s_j)) = logsumexp(s) * log2(e)``.
  A row that sees no key gets ``out = 0`` and ``lse = -inf`` (never NaN).

Attention states merge with the ⊕ operator (docs/design.md §6), here in base 2:
``s = log2(2^s_a + 2^s_b)``, ``v = (2^s_a v_a + 2^s_b v_b) / 2^s``; see
:func:`merge_state_reference` / :func:`merge_states_reference`.

All functions compute on the device of their inputs (CPU or CUDA). fp32 matmuls run
with ``torch.set_float32_matmul_precision("highest")`` (no TF32) for the duration of
the call; the previous setting is restored afterwards.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "LOG2E",
    "ragged_reference",
    "paged_reference",
    "single_reference",
    "paged_kv_to_ragged",
    "merge_state_reference",
    "merge_states_reference",
]

LOG2E = 1.0 / math.log(2.0)  # log2(e)

# Budget (elements) for one block of logits [kv_heads, group, q_rows, kv_len].
# 2**26 fp32 elements = 256 MiB per temporary; an 8k x 8k request with 32 heads is
# processed 256 query rows at a time.
DEFAULT_MAX_CHUNK_ELEMS = 1 << 26

PagedKV = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], Sequence[torch.Tensor]]


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _highest_matmul_precision():
    prev = torch.get_float32_matmul_precision()
    if prev == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def _check_compute_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute dtype must be torch.float32 or torch.float64, got {dtype}")


def _indptr_list(indptr: torch.Tensor, name: str) -> list:
    if not isinstance(indptr, torch.Tensor):
        indptr = torch.as_tensor(indptr)
    if indptr.dim() != 1 or indptr.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of length batch+1, got shape {tuple(indptr.shape)}")
    if indptr.dtype.is_floating_point or indptr.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {indptr.dtype}")
    vals = [int(x) for x in indptr.tolist()]
    if vals[0] < 0:
        raise ValueError(f"{name}[0] must be >= 0, got {vals[0]}")
    for a, b in zip(vals[:-1], vals[1:]):
        if b < a:
            raise ValueError(f"{name} must be non-decreasing, got {vals}")
    return vals


# ------------------------------------------------------------------------ paged KV


def _split_paged_cache(paged_kv_cache: PagedKV) -> Tuple[torch.Tensor, torch.Tensor]:
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                "a single-tensor paged KV cache must be [pages, 2, ...] (4 more dims after pages), "
                f"got shape {tuple(paged_kv_cache.shape)}"
            )
        return paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k_cache, v_cache = paged_kv_cache
        if k_cache.dim() != 4 or v_cache.dim() != 4:
            raise ValueError(
                "k_cache/v_cache must be 4-D [pages, page_size, kv_heads, dim] (NHD) or "
                f"[pages, kv_heads, page_size, dim] (HND), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(f"k_cache and v_cache shapes disagree: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
        return k_cache, v_cache
    raise TypeError("paged_kv_cache must be a tensor [pages, 2, ...] or a (k_cache, v_cache) tuple")


def paged_kv_to_ragged(
    paged_kv_cache: PagedKV,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather a paged KV cache into ragged KV.

    Args:
        paged_kv_cache: ``(k_cache, v_cache)`` each ``[pages, page_size, kv_heads, dim]``
            (NHD) or ``[pages, kv_heads, page_size, dim]`` (HND), or one tensor
            ``[pages, 2, ...]`` with index 0 = K and 1 = V.
        kv_indptr: ``[batch+1]``, pages per request (request ``b`` owns
            ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``).
        kv_indices: page ids.
        kv_last_page_len: ``[batch]``, tokens in each request's last page
            (``1..page_size``); ignored for a request with 0 pages (kv_len 0).
        kv_layout: ``"NHD"`` or ``"HND"``.

    Returns:
        ``(k, v, kv_indptr_tokens)``: ``k``/``v`` ``[total_kv, kv_heads, dim]`` in the
        cache's dtype and device, ``kv_indptr_tokens`` ``[batch+1]`` int64 on the CPU.
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    k_cache, v_cache = _split_paged_cache(paged_kv_cache)
    if kv_layout == "HND":  # -> NHD view [pages, page_size, kv_heads, dim]
        k_cache = k_cache.transpose(1, 2)
        v_cache = v_cache.transpose(1, 2)
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]

    indptr = _indptr_list(kv_indptr, "kv_indptr")
    batch = len(indptr) - 1
    indices = torch.as_tensor(kv_indices).reshape(-1).to(device="cpu", dtype=torch.int64)
    if indptr[-1] > indices.numel():
        raise ValueError(f"kv_indptr[-1] = {indptr[-1]} exceeds len(kv_indices) = {indices.numel()}")
    last = [int(x) for x in torch.as_tensor(kv_last_page_len).reshape(-1).tolist()]
    if len(last) != batch:
        raise ValueError(f"kv_last_page_len has {len(last)} entries, expected batch = {batch}")
    used = indices[indptr[0] : indptr[-1]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise ValueError(f"kv_indices out of range [0, {num_pages})")

    ks, vs, tok_indptr = [], [], [0]
    for b in range(batch):
        n = indptr[b + 1] - indptr[b]
        if n == 0:
            tok_indptr.append(tok_indptr[-1])
            continue
        if not 1 <= last[b] <= page_size:
            raise ValueError(
                f"kv_last_page_len[{b}] = {last[b]} must be in [1, page_size={page_size}] for a request with pages"
            )
        kv_len = (n - 1) * page_size + last[b]
        pages = indices[indptr[b] : indptr[b + 1]].to(k_cache.device)
        ks.append(k_cache[pages].reshape(n * page_size, *k_cache.shape[2:])[:kv_len])
        vs.append(v_cache[pages].reshape(n * page_size, *v_cache.shape[2:])[:kv_len])
        tok_indptr.append(tok_indptr[-1] + kv_len)

    if ks:
        k, v = torch.cat(ks), torch.cat(vs)
    else:
        k = k_cache.new_empty((0, *k_cache.shape[2:]))
        v = v_cache.new_empty((0, *v_cache.shape[2:]))
    return k, v, torch.tensor(tok_indptr, dtype=torch.int64)


# ---------------------------------------------------------------------- ragged core


def _request_attention(
    q: torch.Tensor,  # [qo_len, Hq, D], compute dtype
    k: torch.Tensor,  # [kv_len, Hk, D]
    v: torch.Tensor,  # [kv_len, Hk, Dv]
    custom_mask: Optional[torch.Tensor],  # [qo_len, kv_len] bool or None
    *,
    causal: bool,
    window_left: int,
    sm_scale: float,
    logits_soft_cap: float,
    max_chunk_elems: int,
    out: torch.Tensor,  # [qo_len, Hq, Dv] (written)
    lse: torch.Tensor,  # [qo_len, Hq] (written)
) -> None:
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_qo_heads // num_kv_heads
    diag = kv_len - qo_len  # bottom-right alignment offset
    if qo_len == 0:
        return
    if kv_len == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return

    device = q.device
    cols = torch.arange(kv_len, device=device)
    rows_per_chunk = max(1, max_chunk_elems // max(1, num_qo_heads * kv_len))
    for r0 in range(0, qo_len, rows_per_chunk):
        r1 = min(qo_len, r0 + rows_per_chunk)
        qc = q[r0:r1].reshape(r1 - r0, num_kv_heads, group, head_dim)
        # logits [Hk, G, rows, kv_len]
        s = torch.einsum("qhgd,khd->hgqk", qc, k) * sm_scale
        if logits_soft_cap > 0:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)

        # keep-mask [rows, kv_len]
        keep = None
        rows = torch.arange(r0, r1, device=device)[:, None]
        if causal:
            keep = cols[None, :] <= rows + diag
        if window_left >= 0:
            w = cols[None, :] >= rows + diag - window_left
            keep = w if keep is None else keep & w
        if custom_mask is not None:
            cm = custom_mask[r0:r1]
            keep = cm if keep is None else keep & cm
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)

        m = s.amax(dim=-1, keepdim=True)  # -inf for rows that see nothing
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)  # masked -> exp(-inf) = 0
        denom = p.sum(dim=-1, keepdim=True)  # [Hk, G, rows, 1]
        o = torch.einsum("hgqk,khd->qhgd", p, v)  # [rows, Hk, G, Dv]
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        o = o / safe.permute(2, 0, 1, 3)
        # log(0) = -inf for empty rows: lse = -inf, out = 0 (p was all zeros)
        row_lse = (m + torch.log(denom)).squeeze(-1) * LOG2E  # [Hk, G, rows]
        out[r0:r1] = o.reshape(r1 - r0, num_qo_heads, -1)
        lse[r0:r1] = row_lse.permute(2, 0, 1).reshape(r1 - r0, num_qo_heads)


def ragged_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    causal: bool = False,
    sm_scale: Optional[float] = None,
    logits_soft_cap: Optional[float] = None,
    window_left: int = -1,
    custom_mask: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Batched attention over ragged queries and ragged KV (the reference core).

    Args:
        q: ``[total_q, num_qo_heads, head_dim]``.
        k: ``[total_kv, num_kv_heads, head_dim]``.
        v: ``[total_kv, num_kv_heads, head_dim_vo]``.
        qo_indptr, kv_indptr: ``[batch+1]`` row/token offsets (any device). Rows of
            ``q`` not covered by ``qo_indptr`` (padding) get ``out = 0``, ``lse = -inf``.
        causal, window_left, custom_mask, sm_scale, logits_soft_cap: see module doc.
        dtype: compute/output dtype, ``torch.float32`` (default) or ``torch.float64``.
        max_chunk_elems: logits elements per block (memory bound; rows are chunked).

    Returns:
        ``(out [total_q, num_qo_heads, head_dim_vo], lse [total_q, num_qo_heads])``,
        both ``dtype`` on ``q``'s device; ``lse`` in base 2.
    """
    _check_compute_dtype(dtype)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be 3-D [tokens, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    total_q, num_qo_heads, head_dim = q.shape
    total_kv, num_kv_heads, head_dim_k = k.shape
    if head_dim_k != head_dim:
        raise ValueError(f"q and k head_dim differ: {head_dim} vs {head_dim_k}")
    if v.shape[0] != total_kv or v.shape[1] != num_kv_heads:
        raise ValueError(f"k and v shapes disagree: {tuple(k.shape)} vs {tuple(v.shape)}")
    if num_kv_heads == 0 or num_qo_heads % num_kv_heads != 0:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")

    qo = _indptr_list(qo_indptr, "qo_indptr")
    kv = _indptr_list(kv_indptr, "kv_indptr")
    if len(qo) != len(kv):
        raise ValueError(f"qo_indptr and kv_indptr have different batch sizes: {len(qo) - 1} vs {len(kv) - 1}")
    if qo[-1] > total_q:
        raise ValueError(f"qo_indptr[-1] = {qo[-1]} exceeds total_q = {total_q}")
    if kv[-1] > total_kv:
        raise ValueError(f"kv_indptr[-1] = {kv[-1]} exceeds total_kv = {total_kv}")
    batch = len(qo) - 1

    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    cap = float(logits_soft_cap) if logits_soft_cap is not None else 0.0
    window_left = -1 if window_left is None else int(window_left)
    if window_left < -1:
        raise ValueError(f"window_left must be >= -1, got {window_left}")

    mask_offsets = None
    if custom_mask is not None:
        custom_mask = custom_mask.reshape(-1)
        if custom_mask.dtype != torch.bool:
            raise ValueError(f"custom_mask must be a bool tensor, got {custom_mask.dtype}")
        mask_offsets = [0]
        for b in range(batch):
            mask_offsets.append(mask_offsets[-1] + (qo[b + 1] - qo[b]) * (kv[b + 1] - kv[b]))
        if custom_mask.numel() != mask_offsets[-1]:
            raise ValueError(
                f"custom_mask has {custom_mask.numel()} elements, expected sum(qo_len * kv_len) = {mask_offsets[-1]}"
            )
        custom_mask = custom_mask.to(q.device)

    out = torch.zeros((total_q, num_qo_heads, v.shape[2]), dtype=dtype, device=q.device)
    lse = torch.full((total_q, num_qo_heads), -math.inf, dtype=dtype, device=q.device)
    with torch.no_grad(), _highest_matmul_precision():
        for b in range(batch):
            qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
            cm = None
            if mask_offsets is not None:
                cm = custom_mask[mask_offsets[b] : mask_offsets[b + 1]].reshape(qe - qs, ke - ks)
            _request_attention(
                q[qs:qe].to(dtype),
                k[ks:ke].to(dtype),
                v[ks:ke].to(dtype),
                cm,
                causal=causal,
                window_left=window_left,
                sm_scale=float(sm_scale),
                logits_soft_cap=cap,
                max_chunk_elems=max_chunk_elems,
                out=out[qs:qe],
                lse=lse[qs:qe],
            )
    return out, lse


def paged_reference(
    q: torch.Tensor,
    paged_kv_cache: PagedKV,
    qo_indptr: Optional[torch.Tensor],
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    causal: bool = False,
    sm_scale: Optional[float] = None,
    logits_soft_cap: Optional[float] = None,
    window_left: int = -1,
    custom_mask: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Batched attention over ragged queries and a paged KV cache.

    ``qo_indptr=None`` means decode: one query row per request
    (``qo_indptr = arange(batch+1)``). The KV is gathered with
    :func:`paged_kv_to_ragged` and handed to :func:`ragged_reference`; ``custom_mask``
    uses token kv lengths. Returns ``(out, lse)`` as :func:`ragged_reference`.
    """
    k, v, kv_tok_indptr = paged_kv_to_ragged(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout)
    if qo_indptr is None:
        qo_indptr = torch.arange(kv_tok_indptr.numel(), dtype=torch.int64)
    return ragged_reference(
        q,
        k.to(q.device),
        v.to(q.device),
        qo_indptr,
        kv_tok_indptr,
        causal=causal,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window_left=window_left,
        custom_mask=custom_mask,
        dtype=dtype,
        max_chunk_elems=max_chunk_elems,
    )


def single_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    causal: bool = False,
    sm_scale: Optional[float] = None,
    logits_soft_cap: Optional[float] = None,
    window_left: int = -1,
    custom_mask: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    max_chunk_elems: int = DEFAULT_MAX_CHUNK_ELEMS,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One request (FlashInfer's ``single_prefill_with_kv_cache`` / ``single_decode_with_kv_cache``).

    Args:
        q: ``[qo_len, num_qo_heads, head_dim]``, or ``[num_qo_heads, head_dim]`` for decode
            (then ``out`` is ``[num_qo_heads, head_dim_vo]`` and ``lse`` ``[num_qo_heads]``).
        k, v: ``[kv_len, num_kv_heads, dim]`` (NHD) or ``[num_kv_heads, kv_len, dim]`` (HND).
        custom_mask: ``[qo_len, kv_len]`` or flat bool.
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    decode = q.dim() == 2
    if decode:
        q = q.unsqueeze(0)
    if kv_layout == "HND":
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
    qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int64)
    kv_indptr = torch.tensor([0, k.shape[0]], dtype=torch.int64)
    out, lse = ragged_reference(
        q,
        k,
        v,
        qo_indptr,
        kv_indptr,
        causal=causal,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        window_left=window_left,
        custom_mask=custom_mask,
        dtype=dtype,
        max_chunk_elems=max_chunk_elems,
    )
    if decode:
        return out[0], lse[0]
    return out, lse


# ---------------------------------------------------------------------- merge (⊕)


def merge_state_reference(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states of disjoint key sets (⊕), LSE in base 2.

    Args:
        v_a, v_b: ``[seq, num_heads, head_dim]``; s_a, s_b: ``[seq, num_heads]`` (base-2 LSE).

    Returns:
        ``(v, s)`` in ``dtype`` (default fp64). A ``-inf`` state has weight 0 (its ``v`` is
        ignored, even if NaN); merging two ``-inf`` states gives ``v = 0``, ``s = -inf``.
    """
    v = torch.stack([v_a, v_b], dim=1)
    s = torch.stack([s_a, s_b], dim=1)
    return merge_states_reference(v, s, dtype=dtype)


def merge_states_reference(
    v: torch.Tensor,
    s: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``n`` states per row (⊕ over dim 1), LSE in base 2.

    Args:
        v: ``[seq, num_states, num_heads, head_dim]``; s: ``[seq, num_states, num_heads]``.

    Returns:
        ``(v [seq, num_heads, head_dim], s [seq, num_heads])`` in ``dtype`` (default fp64).
    """
    _check_compute_dtype(dtype)
    if v.dim() != 4 or s.dim() != 3 or v.shape[:3] != s.shape:
        raise ValueError(
            f"expected v [seq, n, heads, dim] and s [seq, n, heads], got {tuple(v.shape)} and {tuple(s.shape)}"
        )
    v = v.to(dtype)
    s = s.to(dtype)
    seq, n, heads, dim = v.shape
    if n == 0:
        return (
            torch.zeros((seq, heads, dim), dtype=dtype, device=v.device),
            torch.full((seq, heads), -math.inf, dtype=dtype, device=v.device),
        )
    m = s.amax(dim=1, keepdim=True)  # [seq, 1, heads]
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp2(s - m)  # 0 for -inf states
    total = w.sum(dim=1)  # [seq, heads]
    wv = torch.where(w[..., None] > 0, w[..., None] * v, torch.zeros_like(v)).sum(dim=1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    v_out = wv / safe[..., None]
    s_out = m.squeeze(1) + torch.log2(total)  # log2(0) = -inf
    return v_out, s_out


# --------------------------------------------------------------------- variants (appended)


def rope_reference(
    x: torch.Tensor, pos: torch.Tensor, rope_scale: float = 1.0, rope_theta: float = 1e4
) -> torch.Tensor:
    """Llama RoPE (FlashInfer's ``ROPE_LLAMA``) in fp32: ``x`` ``[n, heads, D]``, ``pos`` ``[n]``;
    dims ``i`` and ``i + D/2`` rotate by ``pos / (rope_scale * rope_theta^(2i/D))``."""
    x = x.float()
    d = x.shape[-1]
    i = torch.arange(d // 2, device=x.device, dtype=torch.float32)
    freq = 1.0 / (rope_scale * torch.pow(torch.tensor(float(rope_theta), device=x.device), 2.0 * i / d))
    ang = pos.to(device=x.device, dtype=torch.float32)[:, None] * freq[None, :]  # [n, D/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    lo, hi = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)


def variant_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    sm_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    rope: Optional[Tuple[float, float]] = None,
    rope_round_to: Optional[torch.dtype] = None,
    custom_mask: Optional[torch.Tensor] = None,
    score_mod=None,
    mask_mod=None,
    sinks: Optional[torch.Tensor] = None,
    sigmoid_bias: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention over ragged q/k/v with the built-in variants of ``cute_attn.variants``
    applied in the order the wrappers compose them: RoPE (``rope=(scale, theta)``, query at its
    bottom-right aligned position, key ``j`` at ``j``; with ``rope_round_to`` the rotated q/k are
    rounded to that dtype, as the kernels do with their MMA operands -- without it the rotation
    differs from the kernels by up to half an ulp per element, which shows in the LSE of long
    requests, bf16: ~2.5e-3 at 3000 keys) -> ``s = q·k·sm_scale`` -> ALiBi
    (``+ slope[h]·(j - q_pos)``) -> soft-cap -> ``score_mod(s, b, h, q_pos, kv_pos)`` (a
    FlexAttention-style torch callable on broadcast index tensors: ``h`` ``[H,1,1]``, ``q_pos``
    ``[1,qo,1]``, ``kv_pos`` ``[1,1,kv]``) -> masks (causal, window, ``custom_mask`` as
    :func:`ragged_reference`, ``mask_mod(b, h, q_pos, kv_pos)`` -> bool) -> softmax with a
    per-head ``sinks`` logit in the denominator (and in the LSE), or, with ``sigmoid_bias``,
    FlashSigmoid: ``out = Σ sigmoid(s + bias)·v`` (LSE 0 for a request with keys, as the kernels
    report it).  Returns ``(out, lse)`` fp32, LSE base 2; rows that see nothing: 0 / -inf
    (with sinks: 0 / the sink, the softmax over the sink alone)."""
    total_q, hq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    qo = _indptr_list(qo_indptr, "qo_indptr")
    kv = _indptr_list(kv_indptr, "kv_indptr")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    dev = q.device
    out = torch.zeros((total_q, hq, v.shape[2]), dtype=torch.float32, device=dev)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=dev)
    moff = 0
    heads = torch.arange(hq, device=dev)[:, None, None]
    with torch.no_grad(), _highest_matmul_precision():
        for b in range(len(qo) - 1):
            qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
            qo_len, kv_len = qe - qs, ke - ks
            cm = None
            if custom_mask is not None:
                cm = custom_mask.reshape(-1)[moff : moff + qo_len * kv_len].reshape(qo_len, kv_len).to(dev)
                moff += qo_len * kv_len
            if qo_len == 0 or kv_len == 0:
                if qo_len and sinks is not None and sigmoid_bias is None:  # only the sink: out 0, lse = sink
                    lse[qs:qe] = sinks.to(dev).float()[None, :] * LOG2E
                continue
            qpos = torch.arange(kv_len - qo_len, kv_len, device=dev)
            kpos = torch.arange(kv_len, device=dev)
            qb, kb, vb = q[qs:qe].float(), k[ks:ke].float(), v[ks:ke].float()
            if rope is not None:
                qb, kb = rope_reference(qb, qpos, *rope), rope_reference(kb, kpos, *rope)
                if rope_round_to is not None:
                    qb, kb = qb.to(rope_round_to).float(), kb.to(rope_round_to).float()
            kb = kb.repeat_interleave(group, dim=1)
            vb = vb.repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", qb, kb) * sm_scale  # [H, qo, kv]
            rel = (kpos[None, :] - qpos[:, None]).float()[None]  # [1, qo, kv]
            if alibi_slopes is not None:
                s = s + alibi_slopes.to(dev).float()[:, None, None] * rel
            if logits_soft_cap:
                s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
            if score_mod is not None:
                s = score_mod(s, b, heads, qpos[None, :, None], kpos[None, None, :])
            keep = torch.ones((1, qo_len, kv_len), dtype=torch.bool, device=dev)
            if causal:
                keep = keep & (kpos[None, :] <= qpos[:, None])[None]
            if window_left is not None and window_left >= 0:
                keep = keep & (kpos[None, :] >= qpos[:, None] - window_left)[None]
            if cm is not None:
                keep = keep & cm[None]
            if mask_mod is not None:
                keep = keep & mask_mod(b, heads, qpos[None, :, None], kpos[None, None, :])
            if sigmoid_bias is not None:
                p = torch.sigmoid(s + sigmoid_bias) * keep
                out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vb)
                lse[qs:qe] = 0.0
                continue
            s = s.masked_fill(~keep, -math.inf)
            m = s.amax(dim=-1, keepdim=True)
            if sinks is not None:
                sk = sinks.to(dev).float()[:, None, None].expand_as(m)
                m = torch.maximum(m, sk)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(s - m)
            denom = p.sum(dim=-1, keepdim=True)
            if sinks is not None:
                denom = denom + torch.exp(sk - m)
            o = torch.einsum("hqk,khd->qhd", p, vb)
            safe = torch.where(denom > 0, denom, torch.ones_like(denom))
            out[qs:qe] = o / safe.permute(1, 0, 2)
            lse[qs:qe] = ((m + torch.log(denom)).squeeze(-1) * LOG2E).transpose(0, 1)
    return out, lse


def paged_variant_reference(
    q: torch.Tensor,
    paged_kv_cache: PagedKV,
    qo_indptr: Optional[torch.Tensor],
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    **variant_kwargs,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`variant_reference` over a paged KV cache (``qo_indptr=None``: decode, one row per request)."""
    k, v, kv_tok_indptr = paged_kv_to_ragged(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout)
    if qo_indptr is None:
        qo_indptr = torch.arange(kv_tok_indptr.numel(), dtype=torch.int64)
    return variant_reference(q, k.to(q.device), v.to(q.device), qo_indptr, kv_tok_indptr, **variant_kwargs)


__all__ += ["rope_reference", "variant_reference", "paged_variant_reference"]
