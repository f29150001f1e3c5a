"""Batch decode on a paged KV cache, FlashInfer-compatible: ``BatchDecodeWithPagedKVCacheWrapper``.

``plan()`` runs the CPU scheduler (``cute_attn.sched``) and uploads its work lists into the
user's ``float_workspace_buffer`` at fixed offsets; ``run()`` launches the persistent decode
kernel (``kernels/decode.py``) and, when the plan split some KV, the persistent ⊕ merge
kernel.  NHD and HND layouts, ``(k, v)`` tuples and single ``[pages, 2, ...]`` tensors are
all passed to one kernel as strided ``[pages, page_size, kv_heads, head_dim]`` views.

Variants (docs/variants.md): FlashInfer's options map onto built-ins (``logits_soft_cap`` ->
``SoftCap``, ``window_left`` -> ``SlidingWindow``, ``pos_encoding_mode="ALIBI"`` -> ``ALiBi``,
``"ROPE_LLAMA"`` -> ``RoPE``, ``run(sinks=)`` -> ``AttentionSink``; ``options.decode_variant``);
``plan(variant=...)`` adds any other variant, whose runtime arguments follow the cache in
``run(q, kv, *args)``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from ..families.backends import backend_for
from ..families.base import variant_params
from ..families.decode import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from ..families.decode import decode_spec, decode_tile
from ..families.kept import kept_update_spec
from ..families.merge import merge_partials_spec
from ..runtime.arch import arch_of_index, sm_count_of_index
from ..runtime.loader import KernelNotAvailable, kernel
from ..sched import Limits, kv_lens_from_paged
from ..sched.inputs import as_index_array, check_indptr
from ..variants import base as vbase
from ..variants.binding import VariantBinding
from ..variants.builtins import CustomMask, mask_kv_bounds
from . import common, compat, guards, scales
from .compiled import compilable_run
from .decode_engine import DecodeEngineAPI, fast_decode_plan  # noqa: F401
from .decode_packing import MIN_PACKED_ITEMS_PER_CTA, decodes_on_prefill, heads_per_item, kv_row_bytes  # noqa: F401  (re-exported)
from .kept_device import DeviceKeep
from .masks import device_mask, packed_mask
from .options import check_options, decode_variant
from .plans import DecodePlanState


class BatchDecodeWithPagedKVCacheWrapper(DecodeEngineAPI, common.WrapperBase):
    """FlashInfer's batch decode wrapper.  ``plan()`` once per step (shared by all layers),
    ``run()`` per layer.  With ``use_cuda_graph=True`` a captured ``run()`` stays valid when
    ``plan()`` is called again with other lengths/batch composition within the buffers' sizes.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
        paged_kv_indices_buffer: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args=None,
        ctas_per_sm: Optional[int] = None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        common.reject_unsupported(jit_args=jit_args)
        self._ctas_per_sm = ctas_per_sm  # None: the most that fit for the head dim
        if use_cuda_graph:
            common.check_index_buffers(
                (
                    ("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                    ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                    ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer),
                ),
                "sized for the largest batch",
            )
            if paged_kv_indptr_buffer.numel() != paged_kv_last_page_len_buffer.numel() + 1:
                raise ValueError(
                    f"paged_kv_indptr_buffer must have len(paged_kv_last_page_len_buffer) + 1 = "
                    f"{paged_kv_last_page_len_buffer.numel() + 1} entries, got {paged_kv_indptr_buffer.numel()}"
                )
        if backend not in ("auto", "fa2", "fa3"):
            raise NotImplementedError(f"backend {backend!r} is not supported (cute_attn has its own decode kernel)")
        self._float_ws_arg = float_workspace_buffer
        self._use_tensor_cores_arg = bool(use_tensor_cores)
        self._backend_arg = backend
        self._indptr_buf = paged_kv_indptr_buffer
        self._indices_buf = paged_kv_indices_buffer
        self._last_buf = paged_kv_last_page_len_buffer
        self._fixed_bs = paged_kv_last_page_len_buffer.numel() if use_cuda_graph else 0
        self._int_ws = None
        self._pinned_ws = None
        self._cached = None  # compat.CachedModule, after the first plan()
        self._plan_info = None  # what vLLM's fast path stores from _cached_module.plan()
        self._mt = None  # the paged prefill wrapper that runs plans of q_len_per_req > 1
        self._mt_qo_buf = None
        self._q_len = 1  # the current plan's query tokens per request
        self._routed = False  # the current plan runs on the paged prefill kernel (_plan_multi)
        self._frozen_q_len = None  # CUDA-graph mode: the first plan's q_len_per_req
        self._graph_hpi = None  # CUDA-graph mode: the first plan's, kept (the captured kernel's)
        self._graph_fixed = None  # CUDA-graph mode: the first plan's scale and variant (_check_graph_fixed)
        self._used_pages = 0  # indptr[-1] of the current plan: the page ids the kernel reads
        self._mask_bufs = None  # CUDA-graph mode: the custom mask's tensors, sized by the first plan
        self._sched_key = None  # what the planner's limits were made from (_schedule)
        self._dev_keep = None  # CUDA-graph mode: kept plans updated on the device (kept_device)
        self._step_keep = True  # False: the next per-step re-plan plans anew (the device said so)

    @property
    def _hpi(self) -> int:
        """kv heads per work item of the current plan (1 before any)."""
        return 1 if self._state is None else self._state.hpi

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Use another workspace from the next ``plan()`` on (FlashInfer's method; the int
        workspace is not used: the plan's records live in a buffer of the wrapper's own)."""
        super().reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._graph_hpi = self._graph_fixed = None  # graphs captured on the old workspace are void
        self._captured_rows = None

    # ---- plan -------------------------------------------------------------------------------
    @common.guarded_plan
    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *deprecated_positional_args,
        **kwargs,
    ) -> None:
        """FlashInfer 0.7.2's ``plan``: after ``page_size`` its keyword arguments
        (:meth:`_plan_impl`); positional ones map in FlashInfer's legacy order
        (``compat.DECODE_PLAN_LEGACY``) with a DeprecationWarning."""
        kw = compat.legacy_decode_kwargs(deprecated_positional_args, kwargs)
        return self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw)

    begin_forward = plan

    def end_forward(self) -> None:
        pass

    def _plan_impl(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: Optional[float] = None,
        q_data_type=None,
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        block_tables: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        is_causal: Optional[bool] = None,
        variant=None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        heads_per_item: Optional[int] = None,
    ) -> None:
        """FlashInfer's arguments.  ``q_data_type`` (default float16) and ``kv_data_type``
        (default the q dtype) are filled from ``data_type`` where not given, as FlashInfer.
        ``fixed_split_size`` (in pages, as FlashInfer; -1 or None: off): every request's
        KV is cut at multiples of it and nothing else, so a request's output is bitwise the same
        whatever else is in the batch.  ``disable_split_kv``: no request is split (one work item
        per request and kv head).  ``window_right`` must be 0 (FlashInfer's default; other
        values are its cute-dsl backend's).

        ``q_len_per_req`` > 1 (2-8 query tokens per request, causal among them, bottom-right
        aligned): the plan runs on the paged prefill kernel (an internal
        ``BatchPrefillWithPagedKVCacheWrapper`` on this workspace); ``run()`` then takes q
        ``[batch * q_len_per_req, num_qo_heads, head_dim]``.  Every request needs kv_len >=
        q_len_per_req.

        Variants: ``pos_encoding_mode`` ``"ALIBI"`` (slopes from the head count, as FlashInfer's
        ``get_alibi_slopes``) or ``"ROPE_LLAMA"`` (``rope_scale`` default 1, ``rope_theta``
        default 1e4; the query sits at position ``kv_len - 1``, key ``j`` at ``j``), soft-cap,
        window, and (extensions, keyword-only: FlashInfer's decode has none of them)
        ``custom_mask`` (flat bool, concatenated ``[1, kv_len]`` rows) or ``packed_custom_mask``
        (its bits, packed per request as FlashInfer's prefill) and ``variant`` (any
        ``cute_attn.variants.Variant``, applied after the built-ins).

        ``heads_per_item`` (an extension): kv heads per work item, 1, 2 or 4 (head packing,
        ``kernels/decode.py``; more than 1 only for softmax variants without query/key
        transforms -- not RoPE -- and with ``heads_per_item * group <= 16``, or 4 at group 8
        on a 16-bit cache: 32-row tiles, never picked by default -- their kernels do not ship).  Default: 4 or 2
        where the batch keeps ``MIN_PACKED_ITEMS_PER_CTA`` items per CTA with it and no packed
        item exceeds a CTA's share, for the plain kernel, soft-cap and window (the kernels the
        presets ship), for 128-byte cache rows (head dim 64 16-bit, 128 fp8) also where the
        packed items are about one per CTA (``ONE_ITEM_ROW_BYTES``), else 1; 1 with
        ``fixed_split_size`` / ``disable_split_kv`` (packing changes the summation order).  With
        ``use_cuda_graph=True`` the first plan's choice holds for every later plan,
        ``fixed_split_size`` ones included (the captured launch keeps its kernel): give the
        first plan ``heads_per_item=1`` for outputs bitwise equal to an eager wrapper's in
        batch-invariant mode."""
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        if q_data_type is None:
            q_data_type = "float16"
        if window_right != 0:
            raise NotImplementedError(f"window_right={window_right} is not supported (FlashInfer: cute-dsl only)")
        fixed_split_size = compat.split_size(fixed_split_size)
        if not isinstance(q_len_per_req, (int, np.integer)) or q_len_per_req < 1:
            raise ValueError(f"q_len_per_req must be a positive int, got {q_len_per_req!r}")
        q_len_per_req = int(q_len_per_req)
        if is_causal is not None and bool(is_causal) != (q_len_per_req > 1):
            raise NotImplementedError(
                "is_causal must be q_len_per_req > 1 (the decode mask follows q_len_per_req, as FlashInfer's fa2)"
            )
        if self._use_cuda_graph and self._frozen_q_len is not None and q_len_per_req != self._frozen_q_len:
            raise ValueError(
                f"use_cuda_graph=True: q_len_per_req is part of the captured shape; this wrapper was planned "
                f"with {self._frozen_q_len}, got {q_len_per_req} (use a wrapper per q_len_per_req)"
            )
        # several query tokens per request, a head dim / cache only the prefill kernels serve (an
        # fp8 cache at 96) or a GQA group above 16: a causal paged prefill of q_len_per_req rows
        # per request (FlashInfer's tensor-core decode)
        plain = variant is None and custom_mask is None and packed_custom_mask is None and heads_per_item is None
        if q_len_per_req > 1 or decodes_on_prefill(head_dim, kv_data_type, num_qo_heads, num_kv_heads, plain):
            return self._plan_multi(
                indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_len_per_req,
                pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type, sm_scale=sm_scale,
                rope_scale=rope_scale, rope_theta=rope_theta, block_tables=block_tables, seq_lens=seq_lens,
                fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, variant=variant,
                custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, heads_per_item=heads_per_item,
            )  # fmt: skip
        check_options(pos_encoding_mode, variant)
        common.check_heads(num_qo_heads, num_kv_heads, head_dim, SUPPORTED_HEAD_DIMS)
        q_dtype, kv_dtype = common.plan_kv_dtype(q_data_type, kv_data_type, o_data_type)
        kv_name = common.kv_dtype_name(kv_dtype, q_dtype)
        if block_tables is not None or seq_lens is not None:
            raise NotImplementedError(
                "block_tables / seq_lens (the trtllm-gen backend's inputs) are not supported; "
                "pass indptr / indices / last_page_len"
            )
        common.check_plan_scalars(window_left, logits_soft_cap, fixed_split_size, "pages")
        common.check_plan_not_captured()
        hq, hk, head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)

        indptr_h = as_index_array("indptr", indptr)
        check_indptr("indptr", indptr_h)
        batch = indptr_h.shape[0] - 1
        indices_t = common.int32_tensor(indices)
        guards.check_indices_length(indices_t, int(indptr_h[-1]), "indices")
        host_indices = None if indices_t.is_cuda else indices_t.cpu()
        # kv lengths, checked, once per plan: the planner, the packing rule and a custom mask use them
        kv_lens = kv_lens_from_paged(indptr_h, last_page_len, page_size, kv_indices=host_indices)
        mask = None
        if custom_mask is not None or packed_custom_mask is not None:
            mask = self._custom_mask(custom_mask, packed_custom_mask, kv_lens)
        var = decode_variant(
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            custom_mask=mask,
            variant=variant,
        )
        hooks = vbase.Hooks(var)
        if kv_name is not None and (hooks.has_transform_q or hooks.has_transform_k):
            raise NotImplementedError(
                f"an fp8 KV cache ({kv_dtype}) with in-kernel RoPE (pos_encoding_mode / a query or key "
                "transform) is not supported; apply RoPE before writing the cache"
            )
        if hooks.has_output:
            disable_split_kv = True  # an output transform must see the whole row (not a partial state)
        arch = arch_of_index(self._dev)
        backend = backend_for("decode", arch)
        split_tokens = self._split_tokens(fixed_split_size, disable_split_kv, page_size)
        num_ctas = sm_count_of_index(self._dev) * (self._ctas_per_sm or backend.ctas_for(head_dim))
        hpi = self._heads_per_item(
            heads_per_item,
            kv_lens,
            hq,
            hk,
            num_ctas,
            split_tokens is not None,
            hooks.packs_heads,
            var,
            kv_name,
            head_dim,
        )
        tile = decode_tile(hpi, hq // hk)
        dt = common.dtype_name(q_dtype)

        def load(v):
            sp = decode_spec(arch, dt, head_dim, v, hpi, kv_name, tile)
            return kernel(backend.family, arch, **sp.pdict)

        # modules first: a missing one fails before the workspace is overwritten
        decode = load(var)
        ms = merge_partials_spec(arch, dt, head_dim, tile)
        merge = kernel(ms.family, arch, **ms.pdict)
        sm = guards.launch_sm_scale(sm_scale, head_dim)
        self._check_graph_fixed(
            batch, var, sm_scale=sm, logits_soft_cap=float(logits_soft_cap or 0.0), window_left=int(window_left),
            rope=(rope_scale, rope_theta),
        )  # fmt: skip
        row = kv_row_bytes(head_dim, kv_name)
        plan = self._schedule(kv_lens, batch, hq, hk, head_dim, row, int(page_size), split_tokens, hpi, backend, arch)
        kv_indptr = common.to_device(indptr, self._indptr_buf, "indptr", self._device)
        kv_indices = common.to_device(indices_t, self._indices_buf, "indices", self._device)
        if self._use_cuda_graph:
            common.to_device(last_page_len, self._last_buf, "last_page_len", self._device)  # as FlashInfer
        if self._use_cuda_graph and self._graph_hpi is None:
            self._graph_hpi = hpi  # once the plan is in place (a plan that failed fixes nothing)
        info = dict(num_qo_heads=hq, num_kv_heads=hk, head_dim=head_dim, sm_scale=sm, device=self._device)
        options = dict(
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            custom_mask=mask,
            variant=variant,
            load=load,
        )
        self._used_pages = int(indptr_h[-1])
        self._state = DecodePlanState(
            plan=plan,
            batch=batch,
            hq=hq,
            hk=hk,
            head_dim=head_dim,
            page_size=int(page_size),
            dtype=q_dtype,
            kv_dtype=kv_dtype,
            sm_scale=sm,
            window_left=int(window_left),
            num_ctas=self._planner.num_ctas,
            hpi=hpi,
            max_page=common.max_page_id(host_indices, int(indptr_h[-1])),
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            variant=var,
            decode=decode,
            merge=merge,
            binding=VariantBinding(var, dict(info, batch=batch), decode, load),
            options=options,
            arch=arch,
            family=backend.family,
            sm_scale_arg=sm_scale,
            logits_soft_cap=float(logits_soft_cap or 0.0),
            kv_lens=kv_lens,
        )
        self._q_len = 1
        self._routed = False
        if self._use_cuda_graph and self._frozen_q_len is None:
            self._frozen_q_len = 1
        if not self._use_cuda_graph:
            self._last_dev = last_page_len
        if self._cached is None:
            self._cached = compat.CachedModule(self)

    def _check_graph_fixed(self, batch: int, variant, **fixed) -> None:
        """CUDA-graph mode: a captured run() bakes the kernel (the variant) and the launch values
        of the plan it was captured with -- the softmax scale and the options' runtime values
        (soft-cap, window, RoPE; the variant's spec does not hold them); a re-plan that changes
        them would be ignored by the replay, so it is an error (as in the prefill wrappers)."""
        if not self._use_cuda_graph:
            return
        common.check_capture_rows(self, batch, "requests")
        fixed["variant"] = variant_params(variant)
        if self._graph_fixed is None:
            self._graph_fixed = fixed
            return
        changed = [k for k in fixed if fixed[k] != self._graph_fixed[k]]
        if changed:
            raise ValueError(
                f"use_cuda_graph=True: plan() changed {changed} since the first plan ({self._graph_fixed}); a "
                f"captured run() bakes them. Keep them fixed or use another wrapper."
            )

    def _schedule(self, kv_lens, batch, hq, hk, head_dim, row_bytes, page_size, split_tokens, hpi, backend, arch):
        """The planner call of a decode plan: (re)make the planner for the limits and the cache's
        row size (``kv_row_bytes``), plan the lengths and upload the work lists into the
        workspace; returns the ``sched.Plan``."""
        tile = decode_tile(hpi, hq // hk)
        per_sm = self._ctas_per_sm or backend.ctas_for(head_dim)
        num_sms = sm_count_of_index(self._dev)
        num_ctas = num_sms * per_sm
        # the limits follow from these alone: made (and compared) only when one changes, not
        # on every step's re-plan
        key = (self._max_batch(batch), hq, hk, head_dim, row_bytes, num_ctas, tile, self._workspace.numel())
        same = key == self._sched_key and self._planner is not None
        if not same or self._views is None:
            limits = self._limits(batch, hq, hk, head_dim, num_ctas, tile)
            # the backend's cost parameters (alpha, balance_tol: families/backends.py says why)
            desc = f"batch {batch}, {hq} qo heads, head_dim {head_dim}"
            common.install_planner(self, limits, num_sms, per_sm, backend.planner_for(row_bytes), desc)
        self._sched_key = key
        plan = self._planner.plan(
            None,  # one query token per request
            kv_lens,
            page_size=int(page_size),
            num_qo_heads=hq,
            num_kv_heads=hk,
            cta_tile_q=tile,
            kv_split_size=split_tokens,
            heads_per_item=hpi,
        )
        self._planner.upload(self._plan_buf)
        if self._use_cuda_graph:
            self._keep_on_device(int(page_size), arch)
        return plan

    def _keep_on_device(self, page_size: int, arch: str) -> None:
        """Hand the plan just made to the device's per-step update (``kept_device``; off where
        the plan is not kept, or where the update's kernel is not in the cache: then the host
        re-plans every step)."""
        if self._plan_buf.device.type != "cuda":
            return
        dk = self._dev_keep
        if dk is None or dk.plan_buf is not self._plan_buf:
            sp = kept_update_spec(arch)
            try:
                module = kernel(sp.family, arch, **sp.pdict)
            except KernelNotAvailable:
                self._dev_keep = None
                return
            lay = self._planner.layout
            dk = self._dev_keep = DeviceKeep(self._plan_buf, lay.max_work_items, lay.max_merge_tasks, module)
        dk.load(self._planner.kept(), page_size, self._planner.limits.max_kv_len)

    def _heads_per_item(
        self, want, kv_lens, hq, hk, num_ctas, invariant, packable, variant, kv_name=None, head_dim=0
    ) -> int:
        """``decode_packing.heads_per_item`` with this wrapper's CUDA-graph fixed value."""
        fixed = self._graph_hpi if self._use_cuda_graph else None
        return heads_per_item(want, fixed, kv_lens, hq, hk, num_ctas, invariant, packable, variant, kv_name, head_dim)

    def _custom_mask(self, custom_mask, packed, kv_lens) -> CustomMask:
        """The plan's ``CustomMask``: one query row per request (``masks``: FlashInfer's layout)."""
        batch = len(kv_lens)
        ones = np.ones(batch, dtype=np.int64)  # one query row per request
        packed, mask_indptr = packed_mask(custom_mask, packed, ones, kv_lens)
        if not self._use_cuda_graph:
            return device_mask(packed, mask_indptr, ones, kv_lens, self._device)
        # a captured run() keeps the tensors of the plan it was captured with: later plans write
        # theirs into the same buffers, sized by the first plan (an extension: FlashInfer's decode
        # has no custom mask, hence no user buffers for it)
        n = packed.numel()
        index = dict(
            mask_indptr=torch.from_numpy(mask_indptr.astype(np.int32)),
            qo_indptr=torch.arange(batch + 1, dtype=torch.int32),
        )
        sizes = dict(packed_custom_mask=n // 4 + 1, kv_bounds=max(batch, 1), **{k: t.numel() for k, t in index.items()})
        if self._mask_bufs is None:
            self._mask_bufs = {
                k: torch.zeros((m, 2) if k == "kv_bounds" else m, dtype=torch.int32, device=self._device)
                for k, m in sizes.items()
            }
        bufs = self._mask_bufs
        for k, m in sizes.items():
            if m > bufs[k].shape[0]:
                raise ValueError(
                    f"use_cuda_graph=True: this plan's custom mask needs {m} entries of {k}, "
                    f"the first plan fixed {bufs[k].shape[0]}"
                )
        words = CustomMask.words(packed, bufs["packed_custom_mask"])
        mask_kv_bounds(words.view(torch.uint8)[:n], mask_indptr, ones, kv_lens, out=bufs["kv_bounds"])
        for k, t in index.items():
            bufs[k][: t.numel()].copy_(t, non_blocking=True)
        return CustomMask(**bufs)

    @staticmethod
    def _split_tokens(fixed_split_size, disable_split_kv, page_size) -> Optional[int]:
        """The planner's batch-invariant cut length in tokens (None: let it balance)."""
        if disable_split_kv:
            return common.NO_SPLIT  # longer than any request: nothing is cut
        return None if fixed_split_size is None else int(fixed_split_size) * int(page_size)

    def _max_batch(self, batch) -> int:
        """The planner's max_batch for a plan of ``batch`` requests."""
        if self._use_cuda_graph:  # fixed by the buffers, so the workspace offsets never move
            max_batch = self._indptr_buf.numel() - 1
            if batch > max_batch:
                raise ValueError(f"batch {batch} exceeds paged_kv_indptr_buffer capacity {max_batch}")
            return max_batch
        return batch if self._planner is None else max(batch, self._planner.limits.max_batch)

    def _limits(self, batch, hq, hk, d, num_ctas, tile) -> Limits:
        max_batch = self._max_batch(batch)
        # Partial slots: one tile's rows each, 8 per CTA is ample for split-KV decode (the
        # default sizing is for 128-row prefill tiles and would need 4x the workspace).
        # A workspace too small for that gets fewer (compat.partial_rows_that_fit: FlashInfer's
        # usual 16 MiB holds every small batch's plan).
        return compat.partial_rows_that_fit(
            self._workspace.numel(),
            num_ctas,
            max_batch=max(max_batch, 1),
            max_total_q_tokens=max(max_batch, 1),
            num_qo_heads=hq,
            num_kv_heads=hk,
            head_dim=d,
            max_qo_len=1,
            rows=8 * num_ctas * tile,
            min_rows=num_ctas * tile,
        )

    # ---- run ---------------------------------------------------------------------------------
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
        enable_pdl=None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
        q_len_per_req: Optional[int] = None,
        skip_softmax_threshold_scale_factor=None,
        kv_cache_sf=None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``*args``: the runtime arguments of plan()'s ``variant`` not given to its constructor,
        in declaration order.  ``sinks``: per-head sink logits ``[num_qo_heads]`` (FlashInfer's
        attention-sink argument; natural units; the returned LSE includes them).  ``q_scale`` /
        ``k_scale`` multiply the softmax scale, ``v_scale`` the output after the kernel
        (FlashInfer's semantics for fp16 / bf16 KV; the LSE is not scaled).  A ``(k, v)`` tuple
        of 3-D ``[tokens, kv_heads, head_dim]`` caches is a page-size-1 cache."""
        if window_left is not None and window_left != self._window_left_planned():
            raise ValueError("run(window_left=...) differs from plan(); pass it to plan()")
        return self._run(q, paged_kv_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse, sinks,
                         q_len_per_req, skip_softmax_threshold_scale_factor, kv_cache_sf)  # fmt: skip

    def _run(self, q, paged_kv_cache, args, q_scale, k_scale, v_scale, out, lse, return_lse, sinks,
             q_len_per_req, skip_softmax, kv_cache_sf, binding=None, sm_scale=None):  # fmt: skip
        compat.check_kv_cache_sf(kv_cache_sf)
        common.reject_unsupported(extra=(("skip_softmax_threshold_scale_factor", skip_softmax),))
        paged_kv_cache = compat.expand_3d(paged_kv_cache, self._kv_layout)
        if self._routed:
            if q_len_per_req is not None and q_len_per_req != self._q_len:
                raise ValueError(f"run(q_len_per_req={q_len_per_req}) differs from plan()'s {self._q_len}")
            self._check_q_len(q, self._mt._state.batch)
            return self._mt.run(q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                out=out, lse=lse, return_lse=return_lse, sinks=sinks)  # fmt: skip
        st = self._require_plan()
        if q_len_per_req is not None and q_len_per_req != 1:
            raise ValueError(f"run(q_len_per_req={q_len_per_req}) differs from plan()'s 1")
        base = st.sm_scale if sm_scale is None else guards.launch_sm_scale(sm_scale, st.head_dim)
        b, hq, hk, d = st.batch, st.hq, st.hk, st.head_dim
        sc = scales.resolve(self._device, hq, hk, q_scale, k_scale, v_scale)
        k, v = common.kv_views(paged_kv_cache, self._kv_layout)
        # CUDA-graph mode: q may hold more rows than this plan's batch (captured at the largest
        # batch, as the prefill wrappers allow); rows past the batch are neither read nor written
        common.check_q(q, b, hq, d, st.dtype, self._device, self._use_cuda_graph)
        if k.dtype != st.kv_dtype or k.device != q.device:
            raise ValueError(
                f"paged_kv_cache must be {st.kv_dtype} (as planned) on {q.device}, got {k.dtype} on {k.device}"
            )
        if k.shape[1] != st.page_size or k.shape[2] != hk or k.shape[3] != d:
            raise ValueError(
                f"paged_kv_cache ({self._kv_layout}) has page_size/kv_heads/head_dim "
                f"{tuple(k.shape[1:])}, plan() said ({st.page_size}, {hk}, {d})"
            )
        if st.max_page >= k.shape[0]:
            raise ValueError(f"kv indices reference page {st.max_page}, the cache has {k.shape[0]} pages")
        guards.check_device_page_ids(st.kv_indices, self._used_pages, k.shape[0], "kv indices")
        common.check_run_capture(self, q, "paged_kv_*_buffer")
        out, lse = common.out_and_lse(q, out, lse, hq)
        sinks = common.check_sinks(sinks, hq, q.device)
        if b:
            vw = self._views
            group = st.plan.group_size  # packed rows per token and kv head (group) of the plan
            module, vvals = (binding or st.binding).select(args, sinks)
            if self._dev_keep is not None:
                self._dev_keep.before_run(st.kv_indptr, self._last_buf, vw)
            module(
                sc.query(q),
                k,
                v,
                st.kv_indptr,
                st.kv_indices,
                out,
                lse,
                vw["work_items"],
                vw["work_indptr"],
                vw["partial_o"],
                vw["partial_lse"],
                group,
                sc.sm_scale(base),
                st.num_ctas,
                *vvals,
            )
            if self._use_cuda_graph or st.plan.has_split:
                st.merge(
                    vw["partial_o"], vw["partial_lse"], vw["merge_tasks"], vw["meta"], out, lse, group, st.num_ctas
                )
            sc.output(out)
        return (out, lse) if return_lse else out


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's deprecated CUDA-graph decode wrapper: ``use_cuda_graph=True`` with the three
    index buffers."""

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        indptr_buffer: torch.Tensor,
        indices_buffer: torch.Tensor,
        last_page_len_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
    ):
        super().__init__(
            workspace_buffer,
            kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer,
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )
