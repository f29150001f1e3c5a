"""What the engines' FlashInfer backends (vLLM, SGLang) call beyond plan() / run(), written once
for every wrapper: decode plan()'s legacy positional arguments, the q / k / v scales of fp16 /
bf16 KV, 3-D page-size-1 caches, the kernels a ``forward(...)`` needs when its soft-cap or window
differs from the plan's, and the small stand-in for FlashInfer's ``_cached_module`` that vLLM's
own fast decode path calls.  FlashInfer 0.7.2 is the reference (``build/dev/engine_calls.md``)."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from ..sched import Limits, WorkspaceLayout
from ..sched.inputs import check_lengths_fit_pages, lengths_valid, step_lengths

# decode plan()'s positional arguments after page_size, in FlashInfer 0.7.2's legacy order
# (``_BATCH_DECODE_PLAN_LEGACY_POS_ARGS``)
DECODE_PLAN_LEGACY = (
    "pos_encoding_mode",
    "window_left",
    "logits_soft_cap",
    "q_data_type",
    "kv_data_type",
    "o_data_type",
    "data_type",
    "sm_scale",
    "rope_scale",
    "rope_theta",
    "non_blocking",
    "block_tables",
    "seq_lens",
    "fixed_split_size",
    "disable_split_kv",
    "q_len_per_req",
)


def legacy_decode_kwargs(args: tuple, kwargs: dict) -> dict:
    """decode plan()'s positional arguments after page_size as keywords (FlashInfer's legacy
    order, with its DeprecationWarning); a duplicate of a keyword is a TypeError."""
    if not args:
        return kwargs
    if len(args) > len(DECODE_PLAN_LEGACY):
        raise TypeError(
            f"plan() takes at most {len(DECODE_PLAN_LEGACY)} positional arguments after page_size "
            f"({', '.join(DECODE_PLAN_LEGACY)}), got {len(args)}"
        )
    warnings.warn(
        "passing plan()'s optional arguments positionally (after page_size) is deprecated, as in "
        "FlashInfer; pass them by keyword",
        DeprecationWarning,
        stacklevel=3,
    )
    out = dict(kwargs)
    for name, value in zip(DECODE_PLAN_LEGACY, args):
        if name in out:
            raise TypeError(f"plan() got multiple values for argument {name!r}")
        out[name] = value
    return out


def split_size(fixed_split_size) -> Optional[int]:
    """``fixed_split_size``: -1 or None is off (FlashInfer's automatic split), else as given."""
    if fixed_split_size is None or (isinstance(fixed_split_size, (int, np.integer)) and fixed_split_size == -1):
        return None
    return fixed_split_size


# ---- workspace ----
def partial_rows_that_fit(have: int, num_ctas: int, rows: int, min_rows: int, **lim) -> Limits:
    """Limits whose partial-output section holds ``rows`` packed rows (the wrapper's default
    room), or, where that layout does not fit ``have`` bytes, the most rows that do (halving,
    not below ``min_rows``: one partial slot per CTA) -- so that a small plan runs in a small
    workspace (FlashInfer's usual 16 MiB) while a large one keeps the room split-KV balancing
    needs.  Deterministic in its arguments, so CUDA-graph mode's re-plans get the first plan's
    layout.  The caller checks the result fits (``min_rows`` may not)."""
    r = rows
    while True:
        cand = Limits(max_partial_rows=r, **lim)
        if r <= min_rows or WorkspaceLayout(cand, num_ctas).total_bytes <= have:
            return cand
        r = max(r // 2 // 16 * 16, min_rows)


# ---- scales -----------------------------------------------------------------------------------
def check_kv_cache_sf(kv_cache_sf) -> None:
    if kv_cache_sf is not None:
        raise NotImplementedError("kv_cache_sf (NVFP4 KV-cache scale factors) is not supported yet")


def check_lse_format(lse_base, lse_layout) -> None:
    if lse_base != "log2" or lse_layout != "NH":
        raise NotImplementedError(
            f"lse_base={lse_base!r} / lse_layout={lse_layout!r}: only FlashInfer's default ('log2', 'NH') is supported"
        )


# ---- caches -----------------------------------------------------------------------------------
def expand_3d(paged_kv_cache, kv_layout: str):
    """A ``(k, v)`` tuple of 3-D ``[tokens, heads, dim]`` caches (or one ``[tokens, 2, heads,
    dim]`` tensor) as page-size-1 views, as FlashInfer's ``_expand_4d``: the page dim inserted
    before the heads (NHD) or after them (HND); anything else as given."""
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k, v = paged_kv_cache
        if isinstance(k, torch.Tensor) and k.dim() == 3 and isinstance(v, torch.Tensor) and v.dim() == 3:
            dim = 1 if kv_layout == "NHD" else 2
            return k.unsqueeze(dim), v.unsqueeze(dim)
    elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 4 and paged_kv_cache.shape[1] == 2:
        return paged_kv_cache.unsqueeze(2 if kv_layout == "NHD" else 3)
    return paged_kv_cache


# ---- kernels a forward() switches to ------------------------------------------------------------
_RUN_MODULES: dict = {}  # (family, arch, spec params) -> module: loaded outside any capture, reused


def run_module(load, key):
    """The module of ``key`` for a run whose options differ from the plan's: loaded once (never
    inside a CUDA-graph capture: then a ValueError asks to pass the option to plan())."""
    m = _RUN_MODULES.get(key)
    if m is None:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "this run's logits_soft_cap / window_left need another kernel than the plan's, and it "
                "cannot be loaded during a CUDA-graph capture; pass them to plan() (or run once "
                "before capturing)"
            )
        m = _RUN_MODULES[key] = load()
    return m


class PlanInfo(tuple):
    """What ``_cached_module.plan(...)`` returns (vLLM stores it in ``_plan_info``): a
    placeholder; the plan itself lives in the wrapper."""


class CachedModule:
    """FlashInfer's ``wrapper._cached_module`` as vLLM's fast decode path calls it:
    ``plan(float_ws, int_ws, pinned_ws, qo_indptr_host, indptr_cpu, kv_lens_cpu, total_rows,
    batch, H, Hkv, P, cuda_graph, D_qk, D_vo, causal, window_left[, fixed_split_size,
    disable_split_kv, num_colocated_ctas[, uniform_q_len]])`` re-plans the wrapper from those
    host arrays (the page ids are already in the wrapper's index buffer)."""

    def __init__(self, wrapper):
        self._wrapper = wrapper

    def plan(
        self,
        float_workspace_buffer,
        int_workspace_buffer,
        pin_memory_int_workspace_buffer,
        qo_indptr_host,
        indptr_host,
        kv_lens_host,
        total_num_rows,
        batch_size,
        num_qo_heads,
        num_kv_heads,
        page_size,
        enable_cuda_graph,
        head_dim_qk,
        head_dim_vo,
        causal,
        window_left,
        fixed_split_size=-1,
        disable_split_kv=False,
        num_colocated_ctas=0,
        uniform_q_len=0,
    ):
        w = self._wrapper
        args = (batch_size, total_num_rows, num_qo_heads, num_kv_heads, page_size, enable_cuda_graph, head_dim_qk,
                head_dim_vo, causal, window_left, fixed_split_size, disable_split_kv, num_colocated_ctas,
                uniform_q_len)  # fmt: skip
        step = getattr(w, "_step", None)
        if step is not None and step[1] is w._state and step[0] == ("cached", args):
            # vLLM's per-step call: the arguments of the last one but the arrays (its checks held)
            if not (w._device_step() and lengths_valid(kv_lens_host, int(batch_size))):
                w._step_lengths(step_lengths(kv_lens_host, int(batch_size)), None)
            return PlanInfo((int(batch_size), int(total_num_rows)))
        if head_dim_vo != head_dim_qk:
            raise NotImplementedError(
                f"head_dim_vo ({head_dim_vo}) != head_dim_qk ({head_dim_qk}) is not supported yet"
            )
        check_lengths_fit_pages(indptr_host, kv_lens_host, int(page_size))  # kv lengths given beside the pages
        w._replan_fast(
            indptr_host,
            kv_lens_host,
            int(batch_size),
            int(num_qo_heads),
            int(num_kv_heads),
            int(head_dim_qk),
            int(page_size),
            window_left=int(window_left),
            fixed_split_size=split_size(fixed_split_size),
            disable_split_kv=bool(disable_split_kv),
            q_len_per_req=int(uniform_q_len) or max(int(total_num_rows) // max(int(batch_size), 1), 1),
        )
        if w._use_cuda_graph and not w._routed:
            w._step = (("cached", args), w._state)
        return PlanInfo((int(batch_size), int(total_num_rows)))
