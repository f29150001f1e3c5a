"""Block-sparse attention, FlashInfer-compatible: ``BlockSparseAttentionWrapper``.

The attention mask is a BSR matrix (SciPy's ``bsr_matrix``): ``M`` query rows in blocks of
``R``, ``N`` key columns in blocks of ``C``, row block ``i`` attending to the column blocks
``indices[indptr[i]:indptr[i+1]]`` (each optionally masked element-wise by ``mask``).  That is
the block-sparse KV format the paged kernels already read (DESIGN §3), so the wrapper is a
mapping onto ``BatchPrefillWithPagedKVCacheWrapper``: a row block is a request of ``R``
queries, K / V ``[N, kv_heads, head_dim]`` are viewed as pages of ``C`` tokens (no copy), the
BSR column indices are the request's page ids and the element mask its custom mask.

A row block's keys are then its column blocks in ``indices`` order, not their positions in
``N``, so position-dependent options -- ``causal``, RoPE, ALiBi -- would see gathered
positions rather than the real ones; they are refused (express causality as ``mask`` /
``packed_mask``; FlashInfer's own cuTile backend refuses them for the same reason).  A row
block with no column block gets ``out = 0`` and ``lse = -inf``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .prefill import BatchPrefillWithPagedKVCacheWrapper, _reject_unsupported
from .sched.inputs import as_index_array, check_indptr

__all__ = ["BlockSparseAttentionWrapper", "convert_bsr_mask_layout"]


def _positive(name, v):
    if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _flatten_blocks(mask: torch.Tensor, ip: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """BSR block masks ``[nnz, R, C]`` to the custom-mask layout of the paged prefill: row block
    i as ``[rows[i], nnz_i * C]`` row-major (its first rows[i] of the R rows), blocks in order."""
    parts = [mask[ip[i]:ip[i + 1], :rows[i]].transpose(0, 1).reshape(-1) for i in range(ip.shape[0] - 1)]
    return torch.cat(parts) if parts else mask.new_zeros(0)


def convert_bsr_mask_layout(mask: torch.Tensor, indptr) -> torch.Tensor:
    """``mask`` ``[nnz, R, C]`` (BSR blocks) to FlashInfer's flattened layout ``[nnz * R * C]``:
    row block after row block, each ``[R, nnz_i * C]`` row-major (FlashInfer's function)."""
    ip = as_index_array("indptr", indptr)
    return _flatten_blocks(mask, ip, np.full(ip.shape[0] - 1, mask.shape[1]))


class BlockSparseAttentionWrapper:
    """FlashInfer's block-sparse wrapper (its ``fa2`` / ``fa3`` semantics): ``plan(indptr,
    indices, M, N, R, C, num_qo_heads, num_kv_heads, head_dim, mask=None, packed_mask=None,
    ...)`` then ``run(q, k, v)`` with q ``[M, num_qo_heads, head_dim]``, k / v ``[N,
    num_kv_heads, head_dim]``.  ``M`` need not be a multiple of ``R`` (the last row block is
    shorter; ``mask`` then still holds ``R`` rows per block, the extra ones unused); ``N`` must
    be a multiple of ``C``.  cute_attn's own: ``variant=`` (position-free variants) and
    ``kv_pass=`` as the paged prefill wrapper's; ``run(out=, lse=, return_lse=)``."""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        if backend != "auto":
            raise NotImplementedError(f"backend={backend!r}: cute_attn has one block-sparse backend ('auto')")
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD")
        self._shape = None

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        self._prefill.reset_workspace_buffer(float_workspace_buffer)
        self._shape = None

    def plan(self, indptr, indices, M: int, N: int, R: int, C: int, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, mask: Optional[torch.Tensor] = None, packed_mask: Optional[torch.Tensor] = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, block_mask=None, kv_block_lens=None,
             q2k_indices=None, q2k_num=None, kv_splits=None, use_clc=None, q_scale=None, k_scale=None,
             v_scale=None, variant=None, kv_pass: Optional[bool] = None) -> None:
        _reject_unsupported(fp8_scales=(q_scale, k_scale, v_scale), extra=(
            ("block_mask", block_mask), ("kv_block_lens", kv_block_lens), ("q2k_indices", q2k_indices),
            ("q2k_num", q2k_num), ("kv_splits", kv_splits), ("use_clc", use_clc)))
        if causal:
            raise NotImplementedError(
                "causal block-sparse attention: a row block reads its column blocks in indices order, so the "
                "kernel's causal mask would see gathered positions, not the real ones; pass the causal "
                "pattern as mask= / packed_mask= instead")
        if pos_encoding_mode != "NONE":
            raise NotImplementedError(
                f"pos_encoding_mode={pos_encoding_mode!r} with block-sparse attention: keys are read in indices "
                f"order, so RoPE / ALiBi would see gathered positions, not the real ones")
        M, N, R, C = (_positive(n, v) for n, v in (("M", M), ("N", N), ("R", R), ("C", C)))
        if N % C:
            raise ValueError(f"N ({N}) must be a multiple of the block width C ({C}), as in FlashInfer")
        mb, nb = -(-M // R), N // C
        ip = as_index_array("indptr", indptr)
        if ip.shape[0] != mb + 1:
            raise ValueError(f"indptr must have ceil(M / R) + 1 = {mb + 1} entries, got {ip.shape[0]}")
        check_indptr("indptr", ip)
        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(np.asarray(indices))
        idx_h = idx.detach().cpu()
        nnz = int(ip[-1])
        if idx_h.dim() != 1 or idx_h.numel() < nnz:
            raise ValueError(f"indices must be 1-D with at least indptr[-1] = {nnz} entries, got {tuple(idx_h.shape)}")
        if nnz and (int(idx_h[:nnz].min()) < 0 or int(idx_h[:nnz].max()) >= nb):
            raise ValueError(f"indices must lie in [0, N / C = {nb}), got [{int(idx_h[:nnz].min())}, "
                             f"{int(idx_h[:nnz].max())}]")
        rows = np.minimum(np.arange(mb + 1) * R, M)  # query rows: row block i = one request
        nblk = np.diff(ip)
        last = np.where(nblk > 0, C, 0).astype(np.int32)
        custom = None
        if packed_mask is not None and M % R:
            raise ValueError(f"packed_mask needs M ({M}) to be a multiple of R ({R}): FlashInfer packs R rows per "
                             f"row block; pass mask= (the short last block's extra rows are dropped)")
        if mask is not None and packed_mask is None:
            if tuple(mask.shape) != (nnz, R, C):
                raise ValueError(f"mask must be [nnz, R, C] = [{nnz}, {R}, {C}], got {tuple(mask.shape)}")
            custom = _flatten_blocks(mask.detach().to("cpu", torch.bool), ip, np.diff(rows))
        self._prefill.plan(torch.as_tensor(rows.astype(np.int32)), torch.as_tensor(ip.astype(np.int32)),
                           idx_h[:nnz].to(torch.int32), torch.as_tensor(last), num_qo_heads, num_kv_heads, head_dim,
                           C, custom_mask=custom, packed_custom_mask=packed_mask, causal=False,
                           use_fp16_qk_reduction=use_fp16_qk_reduction, logits_soft_cap=logits_soft_cap,
                           sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                           o_data_type=o_data_type, non_blocking=non_blocking, variant=variant, kv_pass=kv_pass)
        self._shape = (M, N, C, num_kv_heads, head_dim)

    begin_forward = plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None, return_lse: bool = False, enable_pdl=None, sinks=None):
        """q ``[M, num_qo_heads, head_dim]``, k / v ``[N, num_kv_heads, head_dim]`` (any strides
        the paged kernels take: the head dim contiguous, 16-byte aligned)."""
        if self._shape is None:
            raise RuntimeError("run() before plan()")
        M, N, C, hk, d = self._shape
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape) != (N, hk, d):
                raise ValueError(f"{name} must be [N, num_kv_heads, head_dim] = [{N}, {hk}, {d}], got "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        # pages of C tokens: splitting the token dim is a view whatever the strides
        pages = (k.unflatten(0, (N // C, C)), v.unflatten(0, (N // C, C)))
        return self._prefill.run(q, pages, *args, out=out, lse=lse, return_lse=return_lse, sinks=sinks)

    forward = run

    def run_return_lse(self, q, k, v, *args, **kw):
        return self.run(q, k, v, *args, **dict(kw, return_lse=True))

    def end_forward(self) -> None:
        pass
