"""One request, FlashInfer-compatible: ``single_decode_with_kv_cache``,
``single_prefill_with_kv_cache`` (and ``_return_lse``).  Each runs the batch kernel on a
batch of one, through a private wrapper per (device, dtype), so a long request is still
spread over all SMs by the planner."""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from . import common, scales
from .compiled_single import compiled_single_decode, compiled_single_prefill
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .masks import check_single_mask
from .prefill import BatchPrefillWithRaggedKVCacheWrapper

_DECODE: dict = {}  # (device, dtype) -> wrapper
_PREFILL: dict = {}


class _GrowingRaggedWrapper(BatchPrefillWithRaggedKVCacheWrapper):
    """single_prefill_with_kv_cache's wrapper: its workspace grows when a request needs more."""

    grows_workspace = True


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale=None,
    k_scale=None,
    v_scale=None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale=None,
    rope_theta=None,
    return_lse: bool = False,
    variant=None,
    sinks: Optional[torch.Tensor] = None,
):
    """Decode one request: q [num_qo_heads, head_dim], k/v [kv_len, kv_heads, head_dim] (NHD) or
    [kv_heads, kv_len, head_dim] (HND).  The KV is read in place, as kv_len pages of one token
    (page size 1 is a first-class path of the kernel), so a long request is still split across
    all SMs by the planner."""
    if torch.compiler.is_compiling():  # one custom op for torch.compile (compiled_single.py)
        return compiled_single_decode(
            q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
            logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse, variant, sinks,
        )  # fmt: skip
    k, v = common.single_kv_nhd(q, k, v, kv_layout, 2, "[heads, dim]")
    kv_len, hk = k.shape[0], k.shape[1]
    sm_scale, sc = scales.for_single(sm_scale, q, hk, q_scale, k_scale, v_scale)
    if kv_len == 0:
        o = torch.zeros_like(q)
        s = torch.full((q.shape[0],), -float("inf"), device=q.device)
        return (o, s) if return_lse else o
    key = (q.device, q.dtype)
    w = _DECODE.get(key)
    if w is None:
        w = _DECODE[key] = BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=q.device), kv_layout="NHD"
        )
    w.plan(
        torch.tensor([0, kv_len], dtype=torch.int32),
        common.arange(kv_len, q.device),
        torch.tensor([1], dtype=torch.int32),
        q.shape[0],
        hk,
        q.shape[1],
        1,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=q.dtype,
        kv_data_type=k.dtype,  # an fp8 cache: the fp8 decode kernel
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        variant=variant,
    )
    out, lse = w.run(sc.query(q).unsqueeze(0), (k.unsqueeze(1), v.unsqueeze(1)), return_lse=True, sinks=sinks)
    sc.output(out)
    return (out[0], lse[0]) if return_lse else out[0]


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q=None,
    scale_k=None,
    scale_v=None,
    o_dtype=None,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_cache_sf=None,
    k_scale=None,
    v_scale=None,
    sinks: Optional[torch.Tensor] = None,
    variant=None,
    *variant_args,
):
    """Prefill / append for one request (FlashInfer's argument order): q ``[qo_len, num_qo_heads,
    head_dim]``, k/v ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len,
    head_dim]`` (HND), read in place.  Runs the batch kernel on a batch of one, so a long
    request is still spread over all SMs by the planner.  Returns ``out`` (and ``lse``
    ``[qo_len, num_qo_heads]``, base 2).  Variants as the batch wrappers: ``custom_mask`` is
    ``[qo_len, kv_len]`` bool (or flat), ``packed_custom_mask`` its bits (little bit order),
    ``sinks`` per-head sink logits, ``variant`` (with its missing runtime arguments as
    ``variant_args``)."""
    if torch.compiler.is_compiling():  # one custom op for torch.compile (compiled_single.py)
        return compiled_single_prefill(
            q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
            pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
            backend, return_lse, kv_cache_sf, k_scale, v_scale, sinks, variant, *variant_args,
        )  # fmt: skip
    common.reject_unsupported(
        q_dtype=q.dtype,
        kv_dtype=k.dtype,
        o_dtype=common.as_dtype(o_dtype, "o_dtype"),
        fp8_scales=(scale_q, scale_k, scale_v),
        extra=(("kv_cache_sf", kv_cache_sf),),
    )
    k, v = common.single_kv_nhd(q, k, v, kv_layout, 3, "[qo_len, heads, dim]")
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor, got one on {q.device}")
    qo_len, kv_len, hk = q.shape[0], k.shape[0], k.shape[1]
    check_single_mask(custom_mask, qo_len, kv_len)
    sm_scale, sc = scales.for_single(sm_scale, q, hk, None, k_scale, v_scale)
    key = (q.device, q.dtype)
    w = _PREFILL.get(key)
    if w is None:
        w = _PREFILL[key] = _GrowingRaggedWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=q.device))
    w.plan(
        np.array([0, qo_len]),
        np.array([0, kv_len]),
        q.shape[1],
        hk,
        q.shape[2],
        causal=causal,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        q_data_type=q.dtype,
        kv_data_type=k.dtype,
        custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask,
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        variant=variant,
    )
    out, lse = w.run(sc.query(q), k, v, *variant_args, return_lse=True, sinks=sinks)
    sc.output(out)
    return (out, lse) if return_lse else out


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
