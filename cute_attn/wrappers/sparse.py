"""Block-sparse attention, FlashInfer-compatible: ``BlockSparseAttentionWrapper`` and
``VariableBlockSparseAttentionWrapper``.

The attention mask is a BSR matrix (SciPy's ``bsr_matrix``): ``M`` query rows in blocks of
``R``, ``N`` key columns in blocks of ``C``, row block ``i`` attending to the column blocks
``indices[indptr[i]:indptr[i+1]]`` (each optionally masked element-wise by ``mask``).  That is
the block-sparse KV format the paged kernels already read (docs/design.md §3), so the wrapper is a
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

from ..sched.inputs import as_index_array, check_indptr
from ..variants import base as vbase
from ..variants.builtins import ALiBi, Causal, RoPE, SlidingWindow
from . import common
from .common import reject_unsupported
from .compiled import compilable_run
from .masks import bool_mask
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "convert_bsr_mask_layout"]


def _positive(name, v):
    if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _check_variant(variant, per_head_request_tensors_ok: bool = True) -> None:
    """Refuse what would act on gathered key positions: causal, window, RoPE, ALiBi, any key or
    query transform.  (A user variant that reads ``kv_pos`` otherwise sees the position within
    the gathered blocks -- documented, not detectable.)"""
    if variant is None:
        return
    if not isinstance(variant, vbase.Variant):
        raise TypeError(f"variant must be a cute_attn.variants.Variant, got {type(variant).__name__}")
    h = vbase.Hooks(variant)
    bad = [type(c).__name__ for c in vbase.components(variant) if isinstance(c, (Causal, SlidingWindow, RoPE, ALiBi))]
    if bad or h.causal or h.has_transform_q or h.has_transform_k:
        raise NotImplementedError(
            f"variant {bad or type(variant).__name__} with block-sparse attention: keys are gathered block by block, "
            f"so position-based components would see gathered positions, not the real ones"
        )
    if not per_head_request_tensors_ok and h.num_tensors:
        raise NotImplementedError(
            "variants with runtime tensors in VariableBlockSparseAttentionWrapper: the kernel sees one kv head per "
            "request (a request per kv head and row block), so per-head or per-request tensors would be indexed "
            "wrongly"
        )


def _flatten_blocks(mask: torch.Tensor, ip: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """BSR block masks ``[nnz, R, C]`` to the custom-mask layout of the paged prefill: row block
    i as ``[rows[i], nnz_i * C]`` row-major (its first rows[i] of the R rows), blocks in order."""
    parts = [mask[ip[i] : ip[i + 1], : rows[i]].transpose(0, 1).reshape(-1) for i in range(ip.shape[0] - 1)]
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
    be a multiple of ``C``.  Duplicate column indices in a row block count those keys twice
    (as FlashInfer).  ``o_data_type`` defaults to the query dtype: FlashInfer's default is
    float16 whatever the query dtype, and an output dtype other than the query's raises
    ``NotImplementedError`` here.  cute_attn's own: ``variant=`` (position-free variants) and
    ``kv_pass=`` as the paged prefill wrapper's; ``run(out=, lse=, return_lse=)``."""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        if backend != "auto":
            raise NotImplementedError(f"backend={backend!r}: cute_attn has one block-sparse backend ('auto')")
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD")
        self._shape = None

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        self._prefill.reset_workspace_buffer(float_workspace_buffer)
        self._shape = None

    def plan(
        self,
        indptr,
        indices,
        M: int,
        N: int,
        R: int,
        C: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        mask: Optional[torch.Tensor] = None,
        packed_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        block_mask=None,
        kv_block_lens=None,
        q2k_indices=None,
        q2k_num=None,
        kv_splits=None,
        use_clc=None,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        variant=None,
        kv_pass: Optional[bool] = None,
    ) -> None:
        reject_unsupported(
            fp8_scales=(q_scale, k_scale, v_scale),
            extra=(
                ("block_mask", block_mask),
                ("kv_block_lens", kv_block_lens),
                ("q2k_indices", q2k_indices),
                ("q2k_num", q2k_num),
                ("kv_splits", kv_splits),
                ("use_clc", use_clc),
            ),
        )
        if causal:
            raise NotImplementedError(
                "causal block-sparse attention: a row block reads its column blocks in indices order, so the "
                "kernel's causal mask would see gathered positions, not the real ones; pass the causal "
                "pattern as mask= / packed_mask= instead"
            )
        if pos_encoding_mode != "NONE":
            raise NotImplementedError(
                f"pos_encoding_mode={pos_encoding_mode!r} with block-sparse attention: keys are read in indices "
                f"order, so RoPE / ALiBi would see gathered positions, not the real ones"
            )
        _check_variant(variant)
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
            raise ValueError(
                f"indices must lie in [0, N / C = {nb}), got [{int(idx_h[:nnz].min())}, {int(idx_h[:nnz].max())}]"
            )
        rows = np.minimum(np.arange(mb + 1) * R, M)  # query rows: row block i = one request
        nblk = np.diff(ip)
        last = np.where(nblk > 0, C, 0).astype(np.int32)
        custom = None
        if packed_mask is not None and M % R:
            raise ValueError(
                f"packed_mask needs M ({M}) to be a multiple of R ({R}): FlashInfer packs R rows per "
                f"row block; pass mask= (the short last block's extra rows are dropped)"
            )
        if mask is not None and packed_mask is None:
            if tuple(mask.shape) != (nnz, R, C):
                raise ValueError(f"mask must be [nnz, R, C] = [{nnz}, {R}, {C}], got {tuple(mask.shape)}")
            custom = _flatten_blocks(bool_mask(mask, "mask"), ip, np.diff(rows))
        self._prefill.plan(
            torch.as_tensor(rows.astype(np.int32)),
            torch.as_tensor(ip.astype(np.int32)),
            idx_h[:nnz].to(torch.int32),
            torch.as_tensor(last),
            num_qo_heads,
            num_kv_heads,
            head_dim,
            C,
            custom_mask=custom,
            packed_custom_mask=packed_mask,
            causal=False,
            use_fp16_qk_reduction=use_fp16_qk_reduction,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
            non_blocking=non_blocking,
            variant=variant,
            kv_pass=kv_pass,
        )
        self._shape = (M, N, C, num_kv_heads, head_dim)

    begin_forward = plan

    @compilable_run
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale_q=None,
        scale_k=None,
        scale_v=None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl=None,
        *,
        sinks=None,
        variant_args: tuple = (),
    ):
        """q ``[M, num_qo_heads, head_dim]``, k / v ``[N, num_kv_heads, head_dim]`` (any strides
        the paged kernels take: the head dim contiguous, 16-byte aligned).  FlashInfer's
        positional order; ``scale_q/k/v`` are its fp8 per-head scales (not supported yet);
        ``variant_args``: the runtime arguments of plan()'s ``variant`` not given to it."""
        common.reject_unsupported(fp8_scales=(scale_q, scale_k, scale_v))
        pages = self._pages(k, v)
        args = tuple(variant_args)
        return self._prefill.run(q, pages, *args, out=out, lse=lse, return_lse=return_lse, sinks=sinks)

    def forward(self, q, k, v, scale_q=None, scale_k=None, scale_v=None, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated ``forward``: the run-time soft-cap / softmax scale take effect
        (as the paged prefill's ``forward``); RoPE / ALiBi stay refused (keys arrive by block)."""
        common.reject_unsupported(fp8_scales=(scale_q, scale_k, scale_v))
        if pos_encoding_mode != "NONE":
            raise ValueError(f"pos_encoding_mode={pos_encoding_mode!r}: block-sparse attention takes no positions")
        return self._prefill.forward(q, self._pages(k, v), causal=False, use_fp16_qk_reduction=use_fp16_qk_reduction,
                                     logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)  # fmt: skip

    def _pages(self, k, v):
        if self._shape is None:
            raise RuntimeError("run() before plan()")
        M, N, C, hk, d = self._shape
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape) != (N, hk, d):
                raise ValueError(
                    f"{name} must be [N, num_kv_heads, head_dim] = [{N}, {hk}, {d}], got "
                    f"{tuple(getattr(t, 'shape', ()))}"
                )
        # pages of C tokens: splitting the token dim is a view whatever the strides
        return k.unflatten(0, (N // C, C)), v.unflatten(0, (N // C, C))

    def run_return_lse(self, q, k, v, *args, **kw):
        return self.run(q, k, v, *args, **dict(kw, return_lse=True))

    def end_forward(self) -> None:
        pass


class VariableBlockSparseAttentionWrapper:
    """FlashInfer's variable-block-size sparse wrapper: every kv head has its own pattern
    ``block_mask_map[h]`` ``[MB, NB]`` over row blocks of ``block_row_sz[h]`` queries and column
    blocks of ``block_col_sz[h]`` keys (sizes may differ between blocks and heads; each head's
    sizes sum to the same M and N).  q ``[num_qo_heads, M, head_dim]``, k / v ``[num_kv_heads,
    N, head_dim]`` (FlashInfer's layouts); out ``[num_qo_heads, M, head_dim]``, lse
    ``[num_qo_heads, M]``.

    On the paged prefill as FlashInfer maps it: a request per (kv head, row block) with the
    head's ``group`` query heads packed (one kv head in the kernel's view), K / V as pages of one
    token (``[num_kv_heads * N, 1, 1, head_dim]``, a view), the request's keys the tokens of its
    column blocks; q and out are rearranged around the kernel (one copy each).  Position-based
    options are refused as in ``BlockSparseAttentionWrapper``."""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        if backend != "auto":
            raise NotImplementedError(f"backend={backend!r}: cute_attn has one block-sparse backend ('auto')")
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD")
        self._shape = None

    def reset_workspace_buffer(
        self,
        float_workspace_buffer: torch.Tensor,
        int_workspace_buffer=None,
        vector_sparse_indices_buffer=None,
        vector_sparse_indptr_buffer=None,
    ) -> None:
        self._prefill.reset_workspace_buffer(float_workspace_buffer)
        self._shape = None

    def plan(
        self,
        block_mask_map: torch.Tensor,
        block_row_sz: torch.Tensor,
        block_col_sz: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        q_data_type="float16",
        kv_data_type=None,
        variant=None,
        kv_pass: Optional[bool] = None,
    ) -> None:
        if causal or pos_encoding_mode != "NONE":
            raise NotImplementedError(
                "causal / RoPE / ALiBi with block-sparse attention: a request's keys are its column blocks' tokens "
                "gathered in block order, so the kernel's positions are not the real ones"
            )
        _check_variant(variant, per_head_request_tensors_ok=False)
        hk = _positive("num_kv_heads", num_kv_heads)
        hq = _positive("num_qo_heads", num_qo_heads)
        if hq % hk:
            raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
        bm = block_mask_map.detach().cpu()
        rs = block_row_sz.detach().cpu().to(torch.int64).numpy()
        cs = block_col_sz.detach().cpu().to(torch.int64).numpy()
        if bm.dim() != 3 or bm.shape[0] != hk or rs.shape != tuple(bm.shape[:2]) or cs.shape != (hk, bm.shape[2]):
            raise ValueError(
                f"block_mask_map must be [num_kv_heads, MB, NB] with block_row_sz [num_kv_heads, MB] and "
                f"block_col_sz [num_kv_heads, NB] (num_kv_heads = {hk}), got {tuple(bm.shape)}, "
                f"{rs.shape}, {cs.shape}"
            )
        if (rs < 0).any() or (cs < 0).any():
            raise ValueError("block_row_sz and block_col_sz must be >= 0")
        m_h, n_h = rs.sum(1), cs.sum(1)
        if len(set(m_h.tolist())) != 1 or len(set(n_h.tolist())) != 1:
            raise ValueError(
                f"every kv head's block sizes must sum to the same lengths: rows {m_h.tolist()}, columns {n_h.tolist()}"
            )
        M, N = int(m_h[0]), int(n_h[0])
        mask = bool_mask(bm, "block_mask_map").numpy()
        qo_indptr = np.concatenate([[0], np.cumsum(rs.reshape(-1))]).astype(np.int32)  # requests (head, row block)
        kv_len = (mask * cs[:, None, :]).sum(-1).reshape(-1)
        if int(kv_len.sum()) >= 2**31 or hk * N >= 2**31:
            raise ValueError(f"{int(kv_len.sum())} attended tokens in all: the kernel's index arrays are int32")
        kv_indptr = np.concatenate([[0], np.cumsum(kv_len)]).astype(np.int32)
        # the tokens of every kept block, request by request (row-major nonzero: head, row, column)
        h_i, _, c_i = np.nonzero(mask)
        lengths = cs[h_i, c_i]
        base = h_i * N + (np.cumsum(cs, axis=1) - cs)[h_i, c_i]
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens = (np.repeat(base, lengths) + np.arange(int(lengths.sum())) - starts).astype(np.int32)
        last = (kv_len > 0).astype(np.int32)
        self._prefill.plan(
            torch.from_numpy(qo_indptr),
            torch.from_numpy(kv_indptr),
            torch.from_numpy(tokens),
            torch.from_numpy(last),
            hq // hk,
            1,
            head_dim,
            1,
            use_fp16_qk_reduction=use_fp16_qk_reduction,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            non_blocking=non_blocking,
            variant=variant,
            kv_pass=kv_pass,
        )
        self._shape = (hq, hk, M, N, head_dim)

    @compilable_run
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl=None,
        *,
        variant_args: tuple = (),
    ):
        """FlashInfer's positional order; ``variant_args``: the runtime arguments of plan()'s
        ``variant`` not given to it."""
        if self._shape is None:
            raise RuntimeError("run() before plan()")
        args = tuple(variant_args)
        hq, hk, M, N, d = self._shape
        g = hq // hk
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (hq, M, d):
            raise ValueError(
                f"q must be [num_qo_heads, M, head_dim] = [{hq}, {M}, {d}], got {tuple(getattr(q, 'shape', ()))}"
            )
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (hk, N, d):
                raise ValueError(
                    f"{name} must be [num_kv_heads, N, head_dim] = [{hk}, {N}, {d}], got "
                    f"{tuple(getattr(t, 'shape', ()))}"
                )
        if out is not None and (tuple(out.shape) != (hq, M, d) or out.dtype != q.dtype or out.device != q.device):
            raise ValueError(f"out must be {q.dtype} [{hq}, {M}, {d}] on {q.device}")
        if lse is not None and (tuple(lse.shape) != (hq, M) or lse.dtype != torch.float32 or lse.device != q.device):
            raise ValueError(f"lse must be float32 [{hq}, {M}] on {q.device}")
        # request rows: (kv head, query) major, the head's group of query heads packed
        qr = q.reshape(hk, g, M, d).permute(0, 2, 1, 3).reshape(hk * M, g, d)
        pages = (k.reshape(hk * N, 1, 1, d), v.reshape(hk * N, 1, 1, d))  # one-token pages
        o, s = self._prefill.run(qr, pages, *args, return_lse=True)
        o = o.view(hk, M, g, d).permute(0, 2, 1, 3).reshape(hq, M, d)
        s = s.view(hk, M, g).permute(0, 2, 1).reshape(hq, M)
        if out is not None:
            out.copy_(o)
            o = out
        if lse is not None:
            lse.copy_(s)
            s = lse
        return (o, s) if return_lse else o

    def forward(self, q, k, v, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, logits_soft_cap=None,
                sm_scale=None, rope_scale=None, rope_theta=None):  # fmt: skip
        """FlashInfer's deprecated ``forward``: the plan's soft-cap and softmax scale are the ones
        used (a different value is an error: pass it to plan())."""
        if pos_encoding_mode != "NONE":
            raise ValueError(f"pos_encoding_mode={pos_encoding_mode!r}: block-sparse attention takes no positions")
        st = self._prefill._require_plan()
        if sm_scale is not None and float(sm_scale) != st.sm_scale:
            raise ValueError(f"forward(sm_scale={sm_scale}) differs from plan()'s {st.sm_scale}; pass it to plan()")
        if logits_soft_cap is not None and float(logits_soft_cap or 0.0) != self._prefill._logits_soft_cap:
            raise ValueError(f"forward(logits_soft_cap={logits_soft_cap}) differs from plan(); pass it to plan()")
        return self.run(q, k, v)

    def end_forward(self) -> None:
        pass
