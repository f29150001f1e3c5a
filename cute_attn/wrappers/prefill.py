"""Batch prefill / append attention, FlashInfer-compatible: ``BatchPrefillWithRaggedKVCacheWrapper``
and ``BatchPrefillWithPagedKVCacheWrapper`` (their shared planning and launch, and the kernel
choice -- wgmma on Hopper, the portable mma.sync kernel elsewhere: ``prefill_base``).

Variants (docs/variants.md) as in decode: ``causal``, ``window_left`` and ``logits_soft_cap``
are the kernel's static flags (its fast paths); ``pos_encoding_mode="ALIBI"`` / ``"ROPE_LLAMA"``
(``rope_scale``, ``rope_theta``), ``custom_mask`` / ``packed_custom_mask`` (FlashInfer's
per-request row-major ``[qo_len, kv_len]`` layout, bits packed little-endian per request;
a custom mask replaces ``causal``, as FlashInfer's MaskMode.CUSTOM), ``run(sinks=)`` and
``plan(variant=...)`` become a traced variant (spec params ``variant`` / ``variant_fp``), whose
runtime arguments follow the fixed ones in the kernel ABI; soft-cap joins the variant (in
decode's order) when another component transforms logits."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from ..sched.inputs import as_index_array, check_indptr, kv_lens_from_paged, kv_lens_from_ragged
from . import common, compat, guards, kv_gather, scales
from .compiled import compilable_run
from .plans import PrefillInputs
from .prefill_base import BatchPrefillBase
from .prefill_engine import recorded_plan


class BatchPrefillWithRaggedKVCacheWrapper(BatchPrefillBase):
    """FlashInfer's batch prefill over ragged (contiguous) KV: ``plan()`` once per batch,
    ``run(q, k, v)`` per layer.  ``q`` is ``[qo_indptr[-1], num_qo_heads, head_dim]``; ``k``/``v``
    are ``[kv_indptr[-1], num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_indptr[-1],
    head_dim]`` (HND), any strides with a contiguous last dim.

    ``use_cuda_graph=True`` needs ``qo_indptr_buf`` / ``kv_indptr_buf`` (int32 CUDA, batch + 1
    entries, as in FlashInfer); the first ``plan()`` fixes the query-token capacity, the tile
    size and the kernel; a captured ``run()`` then stays valid across later plans of at most
    that many tokens. Capture with ``q``/``out`` sized for the largest plan and ``k``/``v`` for
    the most kv tokens (their addresses and extents are baked into the graph).
    """

    _PAGED = False

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
    ):
        if variant_owns_mask:
            raise NotImplementedError("variant_owns_mask (a jit_args variant's own mask) is not supported")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, jit_args, custom_mask_buf, mask_indptr_buf)
        if use_cuda_graph:
            common.check_index_buffers(
                (("qo_indptr_buf", qo_indptr_buf), ("kv_indptr_buf", kv_indptr_buf)), "of batch_size + 1 entries"
            )
            if kv_indptr_buf.numel() != qo_indptr_buf.numel():
                raise ValueError(
                    f"kv_indptr_buf has {kv_indptr_buf.numel()} entries, qo_indptr_buf "
                    f"{qo_indptr_buf.numel()}: both must be batch_size + 1"
                )
        self._qo_indptr_buf = qo_indptr_buf if use_cuda_graph else None
        self._kv_indptr_buf = kv_indptr_buf if use_cuda_graph else None

    @common.guarded_plan
    @recorded_plan
    def plan(
        self,
        qo_indptr,
        kv_indptr,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        seq_lens=None,
        seq_lens_q=None,
        max_token_per_sequence: Optional[int] = None,
        max_sequence_kv: Optional[int] = None,
        v_indptr=None,
        o_indptr=None,
        uniform_q_len: Optional[int] = None,
        variant=None,
        prefill_backend: Optional[str] = None,
        kv_pass: Optional[bool] = None,
    ) -> None:
        """FlashInfer's arguments.  Index arrays are best passed on the CPU (a CUDA one is read
        back, which synchronizes).  ``head_dim_vo`` (None: ``head_dim_qk``): v's and the output's
        head dim -- 192 / 128 (DeepSeek's prefill) besides equal ones (64, 96, 128, 256); run()'s v
        and out are then ``[..., head_dim_vo]``.  ``fixed_split_size`` (kv tokens): every
        request's KV is cut at multiples of it and nothing else, with the kernel's largest tile,
        so a request's output is bitwise the same whatever else is batched with it;
        ``disable_split_kv``: no request is split.  ``use_fp16_qk_reduction``, ``uniform_q_len``
        (q·k is always fp32; the planner sees the lengths), ``max_token_per_sequence`` /
        ``max_sequence_kv`` (cuDNN's) are ignored.

        Variants: ``pos_encoding_mode`` ``"ALIBI"`` (slopes as FlashInfer's ``get_alibi_slopes``)
        or ``"ROPE_LLAMA"`` (``rope_scale`` default 1, ``rope_theta`` default 1e4; query token i
        at position ``kv_len - qo_len + i``, key j at j, rotated in fp32 and rounded to the
        input dtype: Q by the kernel, K by a pass over the keys before it (ragged KV; a paged
        cache's K blocks are rotated by the kernel, for every query tile that reads them));
        ``custom_mask`` (flat bool: request b's row-major ``[qo_len, kv_len]`` block after
        request b-1's) or ``packed_custom_mask`` (its bits, packed per request, little bit
        order: FlashInfer's ``segment_packbits``) -- a custom mask replaces ``causal``, as in
        FlashInfer; ``variant`` (any ``cute_attn.variants.Variant``,
        applied after the built-ins; its runtime arguments not given to its constructor
        follow the KV in ``run()``).

        ``kv_data_type`` ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` with fp16 / bf16
        queries: an fp8 K / V, widened by the kernel in shared memory at head dim 128 without
        RoPE (``kernels/prefill_sm90_kv8.py``), else (or where that kernel is not built, or
        with ``kv_pass=True``) dequantized by the KV pass first (``wrappers/kv_gather.py``;
        ``kv_pass=False``: the kernel's or an error).  Output in the query dtype; run()
        applies its scales.

        ``prefill_backend`` (cute_attn's own): ``"prefill_sm90"`` (wgmma, Hopper) or
        ``"prefill_mma_sync"`` (the portable kernel, every arch; a 16-bit cache only) instead of
        the arch's choice (``families.backends.choose_prefill_backend``)."""
        fixed_split_size = compat.split_size(fixed_split_size)
        q_dtype, kv_dtype, d, dv, arch = self._check_common(
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            head_dim_vo,
            q_data_type,
            kv_data_type,
            o_data_type,
            window_left,
            logits_soft_cap,
            fixed_split_size,
            "kv tokens",
            pos_encoding_mode=pos_encoding_mode,
            variant=variant,
            extra=(
                ("prefix_len_ptr", prefix_len_ptr),
                ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                ("max_item_len_ptr", max_item_len_ptr),
                ("seq_lens", seq_lens),
                ("seq_lens_q", seq_lens_q),
                ("v_indptr", v_indptr),
                ("o_indptr", o_indptr),
            ),
        )
        if kv_pass is not None and kv_dtype == q_dtype:
            raise ValueError(f"kv_pass={kv_pass} with a {q_dtype} ragged cache: the pass only dequantizes an fp8 one")
        qo_h = as_index_array("qo_indptr", qo_indptr)
        kv_h = as_index_array("kv_indptr", kv_indptr)
        if qo_h.shape != kv_h.shape:
            raise ValueError(
                f"qo_indptr and kv_indptr must have the same length (batch_size + 1), got "
                f"{qo_h.shape[0]} and {kv_h.shape[0]}"
            )
        check_indptr("qo_indptr", qo_h)
        kv_lens = kv_lens_from_ragged(kv_h)
        st = self._plan_common(
            qo_h,
            kv_lens,
            arch=arch,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=d,
            head_dim_vo=dv,
            q_dtype=q_dtype,
            causal=causal,
            page_size=1,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            split_tokens=None if fixed_split_size is None else int(fixed_split_size),
            disable_split_kv=disable_split_kv,
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask,
            variant=variant,
            kv_pass=kv_pass,
            kv_dtype=kv_dtype,
            prefill_backend=prefill_backend,
        )
        if self._use_cuda_graph:
            # the buffers' unused tail repeats the last offset (empty requests): the key-transform
            # pass walks every entry of the buffer a captured run() was given
            pad = lambda h: np.concatenate([h, np.full(self._qo_indptr_buf.numel() - h.size, h[-1])])  # noqa: E731
            qo_dev = self._to_device(pad(qo_h), self._qo_indptr_buf, "qo_indptr")
            kv_dev = self._to_device(pad(kv_h), self._kv_indptr_buf, "kv_indptr")
        else:  # qo_indptr: only the key-transform pass reads it
            qo_dev = self._to_device(qo_h, None, "qo_indptr") if st.pass_module is not None else None
            kv_dev = self._to_device(kv_indptr, None, "kv_indptr")
        inputs = PrefillInputs(
            kv_indptr=kv_dev,
            kv_indices=common.arange(1, self._device),  # the ABI's page-id array: unused for ragged KV
            qo_indptr=qo_dev,
            kv_total=int(kv_h[-1]),
        )
        self._commit(st, inputs)

    begin_forward = plan

    @compilable_run
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        o_scale=None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl=None,
        kv_cache_sf=None,
        sinks: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``*args``: the runtime arguments of plan()'s ``variant`` not given to its constructor,
        in declaration order.  ``sinks``: per-head sink logits ``[num_qo_heads]`` (natural
        units; the returned LSE includes them).  ``q_scale`` / ``k_scale`` / ``v_scale`` /
        ``o_scale`` are accepted and ignored for fp16 / bf16 K / V, as FlashInfer 0.7.2's fa2 /
        fa3 ragged path does (it applies them only with NVFP4 ``kv_cache_sf``).  With an fp8
        K / V (``plan(kv_data_type=float8_*)``) ``q_scale`` / ``k_scale`` multiply the softmax
        scale and ``v_scale`` the output, as the paged wrapper's (``o_scale`` stays ignored: the
        output is 16-bit)."""
        compat.check_kv_cache_sf(kv_cache_sf)
        compat.check_lse_format(lse_base, lse_layout)
        st = self._require_plan()
        sc = scales.NONE
        if st.kv_dtype != st.dtype or st.fp8 is not None:  # fp8 K / V: the scales apply (the scales first)
            sc = scales.resolve(self._device, st.hq, st.hk, q_scale, k_scale, v_scale)
        out, lse = self._check_run(q, out, lse, args)
        return self._run_ragged(q, k, v, args, out, lse, sinks, None, return_lse, sc)

    def _run_ragged(self, q, k, v, args, out, lse, sinks, ov, return_lse, sc=scales.NONE):
        st = self._state
        n = st.inputs.kv_total
        k, v = self._ragged_kv(k, v, n)
        if not self._use_cuda_graph:
            # exactly the planned tokens: a KV block that runs past the last request's end then
            # reads TMA's zero fill, never what lies beyond in the caller's tensor (0 * NaN = NaN)
            k, v = k[:n], v[:n]
        self._launch(q, k.unsqueeze(0), v.unsqueeze(0), st.kv_indptr, st.kv_indices, out, lse, args, sinks, ov, sc)
        return (out, lse) if return_lse else out

    def _run_kv(self, q, kv, ov, q_scale, k_scale, v_scale, return_lse):
        out, lse = self._check_run(q, None, None, ())
        return self._run_ragged(q, kv[0], kv[1], (), out, lse, None, ov, return_lse)

    def run_return_lse(self, q, k, v, *args, **kw):
        return self.run(q, k, v, *args, **dict(kw, return_lse=True))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        """FlashInfer's deprecated ``forward``: ``run`` with this call's ``causal`` (a re-plan
        where it differs from the plan's), ``sm_scale`` (None: 1/sqrt(head_dim)),
        ``logits_soft_cap`` and ``window_left`` taking effect (FlashInfer drops the latter two
        unless planned; cute_attn applies them, with the kernel that has them: loaded on first
        use outside a CUDA-graph capture, under capture a ValueError asks to pass them to
        plan()).  The plan's own values stay for later ``run()`` calls."""
        return self._forward(q, (k, v), causal, pos_encoding_mode, None, None, None, window_left,
                             logits_soft_cap, sm_scale, rope_scale, rope_theta, False)  # fmt: skip

    def forward_return_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        """``forward`` returning (out, lse)."""
        return self._forward(q, (k, v), causal, pos_encoding_mode, None, None, None, window_left,
                             logits_soft_cap, sm_scale, rope_scale, rope_theta, True)  # fmt: skip

    def end_forward(self) -> None:
        pass


class BatchPrefillWithPagedKVCacheWrapper(BatchPrefillBase):
    """FlashInfer's batch prefill / append over a paged KV cache: ``plan()`` once per batch,
    ``run(q, paged_kv_cache)`` per layer.  ``q`` is ``[qo_indptr[-1], num_qo_heads, head_dim]``;
    the cache is a ``(k, v)`` tuple of ``[pages, page_size, kv_heads, head_dim]`` (NHD) /
    ``[pages, kv_heads, page_size, head_dim]`` (HND) tensors or one ``[pages, 2, ...]`` tensor;
    any page size.

    ``use_cuda_graph=True`` needs ``qo_indptr_buf``, ``paged_kv_indptr_buf``,
    ``paged_kv_indices_buf`` and ``paged_kv_last_page_len_buf`` (int32 CUDA, as in FlashInfer);
    the first ``plan()`` fixes the query-token capacity, the tile size and the kernel, and a
    captured ``run()`` stays valid across later plans within them (capture with ``q``/``out``
    sized for the largest plan).
    """

    _PAGED = True

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indices_buf: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
    ):
        if variant_owns_mask:
            raise NotImplementedError("variant_owns_mask (a jit_args variant's own mask) is not supported")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, jit_args, custom_mask_buf, mask_indptr_buf)
        bufs = (
            ("qo_indptr_buf", qo_indptr_buf),
            ("paged_kv_indptr_buf", paged_kv_indptr_buf),
            ("paged_kv_indices_buf", paged_kv_indices_buf),
            ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf),
        )
        if use_cuda_graph:
            common.check_index_buffers(bufs, "sized for the largest batch")
            b = qo_indptr_buf.numel() - 1
            if paged_kv_indptr_buf.numel() != b + 1 or paged_kv_last_page_len_buf.numel() != b:
                raise ValueError(
                    f"paged_kv_indptr_buf must have batch_size + 1 = {b + 1} entries and "
                    f"paged_kv_last_page_len_buf batch_size = {b} (qo_indptr_buf has {b + 1})"
                )
        self._qo_indptr_buf, self._indptr_buf, self._indices_buf, self._last_buf = (
            (b for _, b in bufs) if use_cuda_graph else (None,) * 4
        )

    def workspace_size(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask=None,
        packed_custom_mask=None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale=None,
        window_left: int = -1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
        uniform_q_len=None,
    ) -> Tuple[int, int]:
        """FlashInfer's ``workspace_size``: (float workspace bytes, int workspace bytes) plan()
        with these sizes uses in this wrapper's workspace (without the KV pass's copies, which
        an fp8 cache's plan puts in a buffer of its own where they do not fit); no side
        effects.  The int bytes are 0 (the plan's records live in a buffer of the wrapper's
        own)."""
        from .prefill_sizes import prefill_workspace_bytes

        qo_h = as_index_array("qo_indptr", qo_indptr)
        check_indptr("qo_indptr", qo_h)
        batch, total_q = qo_h.shape[0] - 1, int(qo_h[-1])
        if self._use_cuda_graph and self._max_rows is not None:
            total_q = max(total_q, self._max_rows)
            batch = self._qo_indptr_buf.numel() - 1
        arch = self._arch_for_plan()
        have = self._workspace.numel()
        return prefill_workspace_bytes(self._dev, arch, batch, total_q, int(num_qo_heads), int(num_kv_heads),
                                       head_dim_qk, have, head_dim_vo), 0  # fmt: skip

    @common.guarded_plan
    @recorded_plan
    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence: Optional[int] = None,
        max_sequence_kv: Optional[int] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        uniform_q_len: Optional[int] = None,
        variant=None,
        kv_pass: Optional[bool] = None,
        prefill_backend: Optional[str] = None,
    ) -> None:
        """FlashInfer's arguments (see the ragged wrapper's ``plan``, variants included).
        ``fixed_split_size`` is in pages, as in FlashInfer.

        ``kv_pass`` (cute_attn's own): gather the cache's K and V into contiguous copies in the
        workspace by one memory-bound pass before the kernel (``kernels/kv_pass.py``; RoPE's key
        rotation happens there too), so the kernel reads them by TMA.  ``None`` (default): when
        the model :func:`~cute_attn.families.backends.kv_pass_pays` says so (long queries per
        key; it needs workspace room for both copies past the plan; never in CUDA-graph mode,
        nor with ``fixed_split_size``, whose output must not depend on the rest of the batch);
        ``True``: always (an error if the workspace is too small or in CUDA-graph mode);
        ``False``: never (the kernel gathers each block itself).

        ``kv_data_type`` ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` with fp16 / bf16
        queries: an fp8 cache.  At head dim 128, page sizes k*16, no RoPE the kernel may widen it
        itself (``kernels/prefill_sm90_kv8.py``: where the plan's cost model says so, always in
        CUDA-graph mode, ``kv_pass=False`` forces it); else the KV pass gathers and dequantizes
        it (``wrappers/kv_gather.py``: in the workspace when it has room, else a buffer of the
        wrapper's own; in CUDA-graph mode the first plan fixes it).  Output in the query dtype.
        ``prefill_backend``: as in the ragged wrapper's plan."""
        fixed_split_size = compat.split_size(fixed_split_size)
        q_dtype, kv_dtype, d, dv, arch = self._check_common(
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            head_dim_vo,
            q_data_type,
            kv_data_type,
            o_data_type,
            window_left,
            logits_soft_cap,
            fixed_split_size,
            "pages",
            pos_encoding_mode=pos_encoding_mode,
            variant=variant,
            extra=(
                ("prefix_len_ptr", prefix_len_ptr),
                ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                ("max_item_len_ptr", max_item_len_ptr),
                ("seq_lens", seq_lens),
                ("seq_lens_q", seq_lens_q),
                ("block_tables", block_tables),
            ),
        )
        if not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        qo_h = as_index_array("qo_indptr", qo_indptr)
        indptr_h = as_index_array("paged_kv_indptr", paged_kv_indptr)
        if qo_h.shape != indptr_h.shape:
            raise ValueError(
                f"qo_indptr and paged_kv_indptr must have the same length (batch_size + 1), got "
                f"{qo_h.shape[0]} and {indptr_h.shape[0]}"
            )
        check_indptr("qo_indptr", qo_h)
        indices_t = common.int32_tensor(paged_kv_indices)
        if indptr_h.shape[0] and indptr_h[0] != 0:
            # FlashInfer reads request b's pages at indices[indptr[b]:indptr[b + 1]] whatever
            # indptr[0] is (vLLM's prefill plan passes the batch's indptr from its first prefill
            # request on, not rebased): rebase it, and view the indices from indptr[0] on
            start = int(indptr_h[0])
            if start < 0:
                raise ValueError(f"paged_kv_indptr[0] must be >= 0, got {start}")
            indptr_h = indptr_h - start
            indices_t = indices_t[start:]
            paged_kv_indptr = torch.from_numpy(indptr_h.astype(np.int32))
        guards.check_indices_length(indices_t, int(indptr_h[-1]), "paged_kv_indices")
        host_indices = None if indices_t.is_cuda else indices_t
        kv_lens = kv_lens_from_paged(indptr_h, paged_kv_last_page_len, int(page_size), host_indices)
        st = self._plan_common(
            qo_h,
            kv_lens,
            arch=arch,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=d,
            head_dim_vo=dv,
            q_dtype=q_dtype,
            causal=causal,
            page_size=int(page_size),
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            split_tokens=(None if fixed_split_size is None else int(fixed_split_size) * int(page_size)),
            disable_split_kv=disable_split_kv,
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask,
            variant=variant,
            kv_pass=kv_pass,
            kv_dtype=kv_dtype,
            prefill_backend=prefill_backend,
        )
        if self._use_cuda_graph:
            self._to_device(qo_indptr, self._qo_indptr_buf, "qo_indptr")  # FlashInfer's buffers (unused here)
            self._to_device(paged_kv_last_page_len, self._last_buf, "paged_kv_last_page_len")
        # the KV pass: token offsets of the gathered K / V, q offsets
        gathered = {} if st.gather is None else kv_gather.paged_gather_inputs(self, st.kv_lens, qo_h)
        inputs = PrefillInputs(
            kv_indptr=self._to_device(paged_kv_indptr, self._indptr_buf, "paged_kv_indptr"),
            kv_indices=self._to_device(indices_t, self._indices_buf, "paged_kv_indices"),
            page_size=int(page_size),
            max_page=common.max_page_id(host_indices, int(indptr_h[-1])),
            kv_tokens=int(kv_lens.sum()),
            used_pages=int(indptr_h[-1]),
            **gathered,
        )
        self._commit(st, inputs)

    begin_forward = plan

    @compilable_run
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl=None,
        window_left: Optional[int] = None,
        sinks=None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None,
        use_fp16_softmax=None,
        uses_spcompress=None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``*args``: the runtime arguments of plan()'s ``variant`` not given to its constructor,
        in declaration order.  ``sinks``: per-head sink logits ``[num_qo_heads]`` (natural
        units; the returned LSE includes them).  ``q_scale`` / ``k_scale`` multiply the softmax
        scale, ``v_scale`` the output after the kernel (FlashInfer's semantics, for fp16 / bf16
        and fp8 caches; the LSE is not scaled; a tensor scale on the CPU or this device).  A
        ``(k, v)`` tuple of 3-D ``[tokens, kv_heads, head_dim]``
        caches is a page-size-1 cache."""
        compat.check_kv_cache_sf(kv_cache_sf)
        compat.check_lse_format(lse_base, lse_layout)
        # the scales first (a 1-element tensor under capture is refused with its own message)
        st = self._require_plan()
        sc = scales.resolve(self._device, st.hq, st.hk, q_scale, k_scale, v_scale)
        out, lse = self._check_run(
            q, out, lse, args, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor
        )
        if window_left is not None and window_left != self._state.window_left:
            raise ValueError("run(window_left=...) differs from plan(); pass it to plan()")
        return self._run_paged(q, paged_kv_cache, args, out, lse, sinks, None, sc, return_lse)

    def _run_paged(self, q, paged_kv_cache, args, out, lse, sinks, ov, sc, return_lse):
        """``sc``: the run's ``scales.Scales``."""
        st = self._state
        inp = st.inputs
        d, dv = st.head_dim, st.head_dim_vo
        k, v = common.kv_views(compat.expand_3d(paged_kv_cache, self._kv_layout), self._kv_layout, d == dv)
        self._check_kv(k, v, "paged_kv_cache")
        if k.shape[1:] != (inp.page_size, st.hk, d) or v.shape[-1] != dv:
            got = f"{tuple(k.shape[1:])}" + ("" if d == dv else f" (v: head_dim {v.shape[-1]})")
            want = f"({inp.page_size}, {st.hk}, {d})" + ("" if d == dv else f" (v: head_dim {dv})")
            raise ValueError(
                f"paged_kv_cache ({self._kv_layout}) has page_size/kv_heads/head_dim {got}, plan() said {want}"
            )
        if inp.max_page >= k.shape[0] or (inp.kv_tokens and k.shape[0] == 0):
            raise ValueError(
                f"paged_kv_indices reference page {max(inp.max_page, 0)}, the cache has {k.shape[0]} pages"
            )
        guards.check_device_page_ids(inp.kv_indices, inp.used_pages, k.shape[0], "paged_kv_indices")
        self._launch(q, k, v, inp.kv_indptr, inp.kv_indices, out, lse, args, sinks, ov, sc)
        return (out, lse) if return_lse else out

    def _run_kv(self, q, kv, ov, q_scale, k_scale, v_scale, return_lse):
        st = self._require_plan()
        sc = scales.resolve(self._device, st.hq, st.hk, q_scale, k_scale, v_scale)
        out, lse = self._check_run(q, None, None, ())
        return self._run_paged(q, kv[0], (), out, lse, None, ov, sc, return_lse)

    def run_return_lse(self, q, paged_kv_cache, *args, **kw):
        return self.run(q, paged_kv_cache, *args, **dict(kw, return_lse=True))

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        """FlashInfer's deprecated ``forward`` (see the ragged wrapper's), with ``k_scale`` /
        ``v_scale`` as in ``run``."""
        return self._forward(q, (paged_kv_cache,), causal, pos_encoding_mode, None, k_scale, v_scale, window_left,
                             logits_soft_cap, sm_scale, rope_scale, rope_theta, False)  # fmt: skip

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        """``forward`` returning (out, lse)."""
        return self._forward(q, (paged_kv_cache,), causal, pos_encoding_mode, None, k_scale, v_scale, window_left,
                             logits_soft_cap, sm_scale, rope_scale, rope_theta, True)  # fmt: skip

    def end_forward(self) -> None:
        pass
