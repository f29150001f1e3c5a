"""Cascade (shared-prefix) attention, FlashInfer-compatible: ``MultiLevelCascadeAttentionWrapper``,
plus the ⊕ merge ops under the module path FlashInfer gives them (``flashinfer.cascade``).

A cascade splits each request's KV into levels held in one paged cache: level 0 is typically
a prefix shared by every request (one "request" at that level owns all their queries), the
last level each request's own tokens, and levels in between prefixes shared by groups.  Each
level is a batch prefill over its own page table (``BatchPrefillWithPagedKVCacheWrapper``);
their states (out, LSE) are then ⊕-merged row by row (``merge_state_in_place``, docs/design.md §6), so
a shared prefix is read once per query *tile* instead of once per request.

A level where every request has exactly one query (the own-tokens level of a decode step)
runs on the decode kernel instead (``BatchDecodeWithPagedKVCacheWrapper``, 4-14 % faster for
the whole cascade on the H200: the prefill kernel's smallest query tile is 64 rows);
``plan(decode_kernel=False)`` keeps the prefill kernel everywhere.  In CUDA-graph mode the
first ``plan()`` fixes each level's kernel (a captured ``run()`` bakes it in).

Semantics follow FlashInfer's: ``causal`` applies to the last level only (the queries come
after every shared prefix); every level sees its own kv positions from 0, so position-based
options (``window_left``, RoPE, ALiBi) act within a level, not over the concatenated KV.
Variants that do not merge by ⊕ — an output transform, a ``finalize`` of the row statistics
(a variant attention sink), weights without softmax (FlashSigmoid) — are refused; ``run(sinks=)``
is applied once, at the last level, so the sink enters each row's denominator once.

The user's ``float_workspace_buffer`` is cut into ``num_levels`` equal slices, one per level
(each level's split-KV scratch lives in its slice; its records in its own buffer); an error names the size a
level needs when its slice is too small.  A prefill level needs about 34 MiB at head_dim 128 on
132 SMs (partial-output room for split KV), so FlashInfer's usual 128 MiB serves up to three
levels; give 40 MiB per level beyond that (FlashInfer's levels share one buffer: here each
level keeps its plan, so that a captured ``run()`` replays every level's).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from ..sched.inputs import as_index_array
from ..variants import base as vbase
from .common import as_dtype, check_kv_layout, device_index, workspace_bytes, workspace_view
from .compiled import compilable_run
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .merge import merge_pair_module, merge_state, merge_state_in_place, merge_states  # noqa: F401  (flashinfer.cascade's names)
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = [
    "MultiLevelCascadeAttentionWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]

_SLICE_ALIGN = 4096  # level slices start on this boundary (the planner aligns sections to 256 B)


def _slices(flat: torch.Tensor, n: int) -> List[torch.Tensor]:
    """``n`` equal slices of the flat workspace, each starting on a _SLICE_ALIGN boundary."""
    per = flat.numel() // n // _SLICE_ALIGN * _SLICE_ALIGN
    if per == 0:
        raise ValueError(
            f"float_workspace_buffer ({flat.numel()} bytes) is too small to give each of {n} cascade levels a slice"
        )
    return [flat[i * per : (i + 1) * per] for i in range(n)]


class MultiLevelCascadeAttentionWrapper:
    """FlashInfer's multi-level cascade wrapper (same constructor, ``plan`` and ``run``).

    ``plan()`` takes one ``qo_indptr`` / ``paged_kv_indptr`` / ``paged_kv_indices`` /
    ``paged_kv_last_page_len`` per level; every level's ``qo_indptr[-1]`` must be the same
    number of query rows (each row belongs to one request of every level).  The other
    arguments are the paged prefill wrapper's and apply to every level, except ``causal``
    (last level only).  cute_attn's own: ``variant=`` (⊕-mergeable variants only, see the
    module doc), ``kv_pass=`` (per level, as the paged prefill wrapper's) and ``decode_kernel``
    (``None``: the decode kernel for levels of one query per request; ``False``: never).
    ``kv_data_type`` ``torch.float8_e4m3fn`` / ``float8_e5m2`` (fp16 / bf16 queries): an fp8
    cache, every level -- its prefill levels through the KV pass that dequantizes the pages
    (``kv_pass=False`` is then an error), its decode levels on the fp8 decode kernel.

    ``run(q, paged_kv_cache)`` returns the output ``[total_q, num_qo_heads, head_dim]``;
    ``return_lse=True`` also returns the merged LSE (base 2), ``out=`` / ``lse=`` are written
    in place, ``sinks=`` as the paged wrapper's.
    """

    def __init__(
        self,
        num_levels: int,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf_arr: Optional[Sequence[torch.Tensor]] = None,
        paged_kv_indptr_buf_arr: Optional[Sequence[torch.Tensor]] = None,
        paged_kv_indices_buf_arr: Optional[Sequence[torch.Tensor]] = None,
        paged_kv_last_page_len_buf_arr: Optional[Sequence[torch.Tensor]] = None,
    ) -> None:
        if not isinstance(num_levels, (int, np.integer)) or num_levels < 1:
            raise ValueError(f"num_levels must be a positive int, got {num_levels!r}")
        flat = workspace_view(float_workspace_buffer)
        self._num_levels = int(num_levels)
        self._kv_layout = check_kv_layout(kv_layout)
        self._device = float_workspace_buffer.device
        self._dev = device_index(self._device)
        self._use_cuda_graph = bool(use_cuda_graph)
        bufs = (qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr, paged_kv_last_page_len_buf_arr)
        if self._use_cuda_graph:
            names = (
                "qo_indptr_buf_arr",
                "paged_kv_indptr_buf_arr",
                "paged_kv_indices_buf_arr",
                "paged_kv_last_page_len_buf_arr",
            )
            for name, arr in zip(names, bufs):
                if arr is None or len(arr) != self._num_levels:
                    raise ValueError(
                        f"use_cuda_graph=True needs {name}: one buffer per level ({self._num_levels}), "
                        f"got {None if arr is None else len(arr)}"
                    )
            per_level = list(zip(*bufs))
        else:
            per_level = [(None,) * 4] * self._num_levels
        self._slices = _slices(flat, self._num_levels)
        self._bufs = per_level
        self._prefill = [
            BatchPrefillWithPagedKVCacheWrapper(
                ws,
                kv_layout,
                use_cuda_graph=self._use_cuda_graph,
                qo_indptr_buf=b[0],
                paged_kv_indptr_buf=b[1],
                paged_kv_indices_buf=b[2],
                paged_kv_last_page_len_buf=b[3],
            )
            for ws, b in zip(self._slices, per_level)
        ]
        for w in self._prefill:  # a level keeps the full split-KV room (an error names a too-small slice)
            w.fit_partials = False
        self._decode = [None] * self._num_levels  # made on first use, on the level's slice and buffers
        self._kind = [None] * self._num_levels  # "decode" / "prefill": the kernel of the current plan
        self._total_q = None

    def _decode_wrapper(self, i: int) -> BatchDecodeWithPagedKVCacheWrapper:
        if self._decode[i] is None:
            b = self._bufs[i]
            self._decode[i] = BatchDecodeWithPagedKVCacheWrapper(
                self._slices[i],
                self._kv_layout,
                use_cuda_graph=self._use_cuda_graph,
                paged_kv_indptr_buffer=b[1],
                paged_kv_indices_buffer=b[2],
                paged_kv_last_page_len_buffer=b[3],
            )
        return self._decode[i]

    def _wrapper(self, i: int):
        return self._decode[i] if self._kind[i] == "decode" else self._prefill[i]

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def num_levels(self) -> int:
        return self._num_levels

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffers=None) -> None:
        """Use another workspace from the next ``plan()`` on, cut into one slice per level
        (FlashInfer's method; the int workspaces are not used)."""
        self._slices = _slices(workspace_bytes(float_workspace_buffer, self._device), self._num_levels)
        for i, ws in enumerate(self._slices):
            self._prefill[i].reset_workspace_buffer(ws)
            if self._decode[i] is not None:
                self._decode[i].reset_workspace_buffer(ws)
        self._total_q = None

    def plan(
        self,
        qo_indptr_arr,
        paged_kv_indptr_arr,
        paged_kv_indices_arr,
        paged_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
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
        variant=None,
        kv_pass: Optional[bool] = None,
        decode_kernel: Optional[bool] = None,
    ) -> None:
        n = self._num_levels
        self._total_q = None  # a plan() that fails part-way must not leave a runnable mix of two plans
        arrays = (
            ("qo_indptr_arr", qo_indptr_arr),
            ("paged_kv_indptr_arr", paged_kv_indptr_arr),
            ("paged_kv_indices_arr", paged_kv_indices_arr),
            ("paged_kv_last_page_len", paged_kv_last_page_len),
        )
        for name, arr in arrays:
            if not isinstance(arr, (list, tuple)) or len(arr) != n:
                got = f"a list of {len(arr)}" if isinstance(arr, (list, tuple)) else type(arr).__name__
                raise ValueError(f"{name} must be a list with one entry per level ({n}), got {got}")
        qo_h = [as_index_array(f"qo_indptr_arr[{i}]", a) for i, a in enumerate(qo_indptr_arr)]
        totals = [int(a[-1]) for a in qo_h]
        if len(set(totals)) != 1:
            raise ValueError(
                f"every level's qo_indptr must end at the same number of query rows (each row belongs "
                f"to one request per level), got {totals}"
            )
        for i in range(n):
            kv_n = as_index_array(f"paged_kv_indptr_arr[{i}]", paged_kv_indptr_arr[i]).shape[0]
            if kv_n != qo_h[i].shape[0]:
                raise ValueError(
                    f"level {i}: qo_indptr and paged_kv_indptr must have the same length (batch_size "
                    f"+ 1), got {qo_h[i].shape[0]} and {kv_n}"
                )
        hooks = vbase.Hooks(variant) if isinstance(variant, vbase.Variant) else None
        if hooks is not None and (not hooks.softmax or hooks.has_finalize or hooks.has_output):
            raise NotImplementedError(
                "this variant does not merge across cascade levels by ⊕ (it has an output transform, a finalize of "
                "the row statistics or no softmax); run it with the batch wrappers on the whole KV instead"
            )
        if hooks is not None and hooks.causal:
            raise ValueError(
                "a Causal() component in variant= would mask every level (the shared prefixes too); "
                "pass causal=True, which applies to the last level only"
            )
        common = dict(
            pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            variant=variant,
        )
        kinds = []
        for i in range(n):
            one_query = qo_h[i].shape[0] > 1 and bool((np.diff(qo_h[i]) == 1).all())
            kind = "decode" if one_query and decode_kernel is not False else "prefill"
            if self._use_cuda_graph and self._kind[i] is not None and kind != self._kind[i]:
                if self._kind[i] == "prefill":
                    kind = "prefill"  # the captured kernel takes any query count
                else:
                    raise ValueError(
                        f"cascade level {i} runs on the decode kernel since the first plan() (one query "
                        f"per request; a captured run() bakes the kernel in), and this plan does not "
                        f"give each of its requests exactly one query; create the wrapper with that "
                        f"plan first, or plan with decode_kernel=False"
                    )
            kinds.append(kind)
        for i in range(n):
            args = (
                paged_kv_indptr_arr[i],
                paged_kv_indices_arr[i],
                paged_kv_last_page_len[i],
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
            )
            try:
                if kinds[i] == "decode":  # one query per request: causal changes nothing
                    self._decode_wrapper(i).plan(*args, **common)
                else:
                    self._prefill[i].plan(
                        qo_indptr_arr[i],
                        *args,
                        causal=bool(causal) and i == n - 1,
                        use_fp16_qk_reduction=use_fp16_qk_reduction,
                        kv_pass=kv_pass,
                        **common,
                    )
            except ValueError as e:
                if "float_workspace_buffer has" in str(e):  # name the level and the split
                    raise ValueError(f"cascade level {i} (1/{n} of the workspace): {e}") from None
                raise
            self._kind[i] = kinds[i]
        # the merge kernel run() needs, loaded here: run() may be the call a CUDA graph captures
        # (every level planned with q_data_type, on this wrapper's device)
        merge_pair_module(as_dtype(q_data_type, "q_data_type"), int(head_dim), self._dev)
        self._total_q = totals[0]

    begin_forward = plan

    @compilable_run
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *args,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        sinks: Optional[torch.Tensor] = None,
        k_scale=None,
        v_scale=None,
    ):
        """The last level writes ``out`` / ``lse``; every other level's state is ⊕-merged into
        them in place.  ``*args``: the plan's variant's runtime arguments (every level).
        ``k_scale`` / ``v_scale`` (cute_attn's own, for an fp8 cache: ``plan(kv_data_type=
        torch.float8_e4m3fn / float8_e5m2)``): as the batch wrappers', given to every level (the
        ⊕ merge is linear in the outputs, so scaling each level's output scales the result)."""
        if self._total_q is None:
            raise RuntimeError("run() before plan()")
        scales = {n: x for n, x in (("k_scale", k_scale), ("v_scale", v_scale)) if x is not None}
        # the shared levels first, into their own tensors: a level's input error then raises
        # before the caller's out / lse are written (each level checks its inputs before its launch)
        shared = [
            self._wrapper(i).run(q, paged_kv_cache, *args, return_lse=True, **scales)
            for i in range(self._num_levels - 1)
        ]
        last = self._wrapper(self._num_levels - 1)
        out, lse = last.run(q, paged_kv_cache, *args, out=out, lse=lse, return_lse=True, sinks=sinks, **scales)
        for o_i, s_i in shared:
            merge_state_in_place(out, lse, o_i, s_i)
        return (out, lse) if return_lse else out

    forward = run

    def end_forward(self) -> None:
        pass


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper:
    """FlashInfer's deprecated shared-prefix decode wrapper, thin over cute_attn's (as
    FlashInfer's over its own): the shared prefix as contiguous ``k_shared`` / ``v_shared``
    (``single_prefill_with_kv_cache``), each request's own tokens in a paged cache
    (``BatchDecodeWithPagedKVCacheWrapper``), the two states ⊕-merged."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._batch_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._kv_layout = kv_layout

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        self._batch_decode_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self,
        unique_kv_indptr,
        unique_kv_indices,
        unique_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        data_type="float16",
    ) -> None:
        self._batch_decode_wrapper.begin_forward(
            unique_kv_indptr,
            unique_kv_indices,
            unique_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode="NONE",
            data_type=data_type,
        )

    plan = begin_forward

    def forward(self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor, unique_kv_cache):
        from .single import single_prefill_with_kv_cache

        inner = self._batch_decode_wrapper
        v_s, s_s = single_prefill_with_kv_cache(
            q,
            k_shared,
            v_shared,
            causal=False,
            pos_encoding_mode="NONE",
            kv_layout=self._kv_layout,
            sm_scale=inner._state.sm_scale_arg if inner._state is not None else None,
            return_lse=True,
        )
        v_u, s_u = inner.forward_return_lse(q, unique_kv_cache, pos_encoding_mode="NONE")
        merge_state_in_place(v_s, s_s, v_u, s_u)
        return v_s

    run = forward

    def end_forward(self) -> None:
        pass


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper:
    """FlashInfer's deprecated shared-prefix prefill wrapper, thin over cute_attn's: the shared
    prefix by ``single_prefill_with_kv_cache`` (non-causal), each request's own tokens by
    ``BatchPrefillWithPagedKVCacheWrapper`` (``causal`` applies there), ⊕-merged."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._batch_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._kv_layout = kv_layout

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        self._batch_prefill_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
    ) -> None:
        self._batch_prefill_wrapper.begin_forward(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
        )

    plan = begin_forward

    def forward(
        self,
        q: torch.Tensor,
        k_shared: torch.Tensor,
        v_shared: torch.Tensor,
        unique_kv_cache,
        causal: bool = False,
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        from .single import single_prefill_with_kv_cache

        v_s, s_s = single_prefill_with_kv_cache(
            q,
            k_shared,
            v_shared,
            causal=False,
            pos_encoding_mode="NONE",
            kv_layout=self._kv_layout,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            return_lse=True,
        )
        v_u, s_u = self._batch_prefill_wrapper.forward_return_lse(
            q,
            unique_kv_cache,
            causal=causal,
            pos_encoding_mode="NONE",
            use_fp16_qk_reduction=use_fp16_qk_reduction,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        merge_state_in_place(v_s, s_s, v_u, s_u)
        return v_s

    run = forward

    def end_forward(self) -> None:
        pass
