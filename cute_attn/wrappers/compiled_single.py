"""torch.compile support of ``single_decode_with_kv_cache`` / ``single_prefill_with_kv_cache``:
one custom op each (``cute_attn::single_decode`` / ``single_prefill``) whose eager side keeps
one planned batch wrapper per key (device, dtype, shapes, options), so that under
``mode="reduce-overhead"`` the recorded launch finds its plan in place (plan() cannot run
under capture).  ``single.py`` calls these while dynamo traces; the batch wrappers' run() goes
through ``compiled.compilable_run``."""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["compiled_single_decode", "compiled_single_prefill", "clear_single_cache", "MAX_UNPINNED_SINGLE"]

from .compiled import _encode, _flat, _parse, _unflat  # noqa: F401
from .masks import check_single_mask

# ---- single-request functions -------------------------------------------------------------------
MAX_UNPINNED_SINGLE = 8  # keyed wrappers kept that never ran under CUDA-graph capture
_KEYED: OrderedDict[tuple, object] = OrderedDict()  # key -> planned wrapper (most recent last)
_PINNED: set = set()  # keys whose wrapper ran under capture: a recorded graph reads its workspace
_FIRST_WORKSPACE = 16 << 20  # a decode wrapper's first workspace; grown to what the plan says it needs


def clear_single_cache() -> None:
    """Drop the single functions' keyed wrappers (graphs recorded on them must not be replayed)."""
    _KEYED.clear()
    _PINNED.clear()


def _alloc(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Workspaces and index buffers of the keyed wrappers (the CPU tests replace it)."""
    return torch.zeros(numel, dtype=dtype, device=device)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _outside_graph_pool(device, fn: Callable):
    """``fn()`` (make / plan a keyed wrapper) with its allocations outside any CUDA-graph memory
    pool: CUDA-graph trees' warm-up sends every allocation of the current thread to the graph's
    private pool, where a persistent workspace would be an untracked live tensor (an error of
    the trees).  On CUDA, ``fn`` runs on a worker thread (ordinary pool, its own stream) that
    waits for the caller's stream first and is synchronized before the caller goes on."""
    if device.type != "cuda":
        return fn()
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    box: dict = {}

    def work():
        try:
            with torch.cuda.device(device):
                s = torch.cuda.Stream(device)
                s.wait_event(ready)
                with torch.cuda.stream(s):
                    box["out"] = fn()
                s.synchronize()
        except BaseException as e:  # re-raised on the caller's thread
            box["err"] = e

    t = threading.Thread(target=work, name="cute_attn-keyed-plan")
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def _keyed_wrapper(key, make_planned: Callable, replan: Optional[Callable] = None):
    """The wrapper planned for ``key`` (``key[1]``: the device): ``make_planned()`` on first use
    (made and planned); ``replan(w)`` on later eager calls where given (a custom mask: its
    contents are not in the key), never under capture."""
    capturing = _capturing()
    w = _KEYED.get(key)
    if w is None:
        if capturing:
            raise RuntimeError(
                "cute_attn: a compiled single_*_with_kv_cache call is being captured into a CUDA graph for "
                "arguments it never ran with eagerly (its plan() cannot be captured); run the compiled "
                "function once before capture (torch.compile's CUDA-graph trees warm up first)"
            )
        w = _outside_graph_pool(key[1], make_planned)
        _KEYED[key] = w
    else:
        _KEYED.move_to_end(key)
        if replan is not None and not capturing:
            _outside_graph_pool(key[1], lambda: replan(w))
    if capturing:
        _PINNED.add(key)
    unpinned = [k for k in _KEYED if k not in _PINNED]
    for k in unpinned[: max(len(unpinned) - MAX_UNPINNED_SINGLE, 0)]:
        del _KEYED[k]
    return w


@functools.cache
def _growing_ragged():
    """The ragged wrapper whose workspace grows to what a plan needs (made on first use: the
    wrappers import this module)."""
    from .prefill import BatchPrefillWithRaggedKVCacheWrapper

    class _GrowingGraphRagged(BatchPrefillWithRaggedKVCacheWrapper):
        grows_workspace = True

    return _GrowingGraphRagged


_NEEDS = re.compile(r"this plan needs (\d+)")


def _decode_wrapper_for(q, kv_len: int, make_plan: Callable):
    """A graph-mode decode wrapper of batch one and ``kv_len`` one-token pages, planned by
    ``make_plan(w)``; its workspace grown once to what the plan needs."""
    from .decode import BatchDecodeWithPagedKVCacheWrapper

    def make(nbytes):
        dev = q.device
        return BatchDecodeWithPagedKVCacheWrapper(
            _alloc(nbytes, torch.uint8, dev),
            kv_layout="NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=_alloc(2, torch.int32, dev),
            paged_kv_indices_buffer=_alloc(max(kv_len, 1), torch.int32, dev),
            paged_kv_last_page_len_buffer=_alloc(1, torch.int32, dev),
        )

    w = make(_FIRST_WORKSPACE)
    try:
        make_plan(w)
    except ValueError as e:
        m = _NEEDS.search(str(e))
        if m is None or "float_workspace_buffer has" not in str(e):
            raise
        w = make(-(-int(m.group(1)) // (1 << 20)) << 20)
        make_plan(w)
    return w


def _none_or_float(x) -> Optional[float]:
    return None if x is None else float(x)


def _single_decode_impl(q, k, v, sinks, kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
                        rope_scale, rope_theta, variant):  # fmt: skip
    """single_decode_with_kv_cache on a keyed graph-mode wrapper: (out [hq, d], lse [hq])."""
    from . import common

    k, v = common.single_kv_nhd(q, k, v, kv_layout, 2, "[heads, dim]")
    kv_len, hk = k.shape[0], k.shape[1]
    if kv_len == 0:
        return torch.zeros_like(q), torch.full((q.shape[0],), -float("inf"), device=q.device)
    key = ("decode", q.device, q.dtype, q.shape[0], hk, q.shape[1], kv_len, pos_encoding_mode, window_left,
           logits_soft_cap, sm_scale, rope_scale, rope_theta, None if variant is None else id(variant),
           k.dtype)  # fmt: skip

    def plan(w):
        w.plan(
            torch.tensor([0, kv_len], dtype=torch.int32),
            torch.arange(kv_len, dtype=torch.int32),
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

    w = _keyed_wrapper(key, lambda: _decode_wrapper_for(q, kv_len, plan))
    out, lse = w.run(q.unsqueeze(0), (k.unsqueeze(1), v.unsqueeze(1)), return_lse=True, sinks=sinks)
    return out[0], lse[0]


def _single_prefill_impl(q, k, v, sinks, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                         sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, variant,
                         variant_args):  # fmt: skip
    """single_prefill_with_kv_cache on a keyed graph-mode ragged wrapper: (out, lse [qo_len, hq])."""
    from . import common

    k, v = common.single_kv_nhd(q, k, v, kv_layout, 3, "[qo_len, heads, dim]")
    qo_len, kv_len, hk = q.shape[0], k.shape[0], k.shape[1]
    check_single_mask(custom_mask, qo_len, kv_len)
    masked = custom_mask is not None or packed_custom_mask is not None
    mask_key = None
    if masked:
        m = custom_mask if custom_mask is not None else packed_custom_mask
        mask_key = ("bool" if custom_mask is not None else "packed", tuple(m.shape))
    key = ("prefill", q.device, q.dtype, qo_len, q.shape[1], q.shape[2], kv_len, hk, causal, pos_encoding_mode,
           sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, mask_key,
           None if variant is None else id(variant))  # fmt: skip

    def make_planned():
        dev = q.device
        mask_bufs = {}
        if masked:
            mask_bufs = dict(
                custom_mask_buf=_alloc(-(-qo_len * kv_len // 8) + 4, torch.uint8, dev),
                mask_indptr_buf=_alloc(2, torch.int32, dev),
            )
        w = _growing_ragged()(
            _alloc(1 << 20, torch.uint8, dev),
            use_cuda_graph=True,
            qo_indptr_buf=_alloc(2, torch.int32, dev),
            kv_indptr_buf=_alloc(2, torch.int32, dev),
            **mask_bufs,
        )
        plan(w)
        return w

    def plan(w):
        w.plan(
            torch.tensor([0, qo_len], dtype=torch.int32),
            torch.tensor([0, kv_len], dtype=torch.int32),
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

    w = _keyed_wrapper(key, make_planned, plan if masked else None)
    return w.run(q, k, v, *variant_args, return_lse=True, sinks=sinks)


@torch.library.custom_op("cute_attn::single_decode", mutates_args=())
def _single_decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    kv_layout: str,
    pos_encoding_mode: str,
    window_left: int,
    logits_soft_cap: Optional[float],
    sm_scale: Optional[float],
    rope_scale: Optional[float],
    rope_theta: Optional[float],
    extra_tensors: List[torch.Tensor],
    extra: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """single_decode_with_kv_cache: (out [hq, d], lse [hq]); ``extra``: JSON {"variant": node}."""
    rest = {k_: _unflat(n, extra_tensors) for k_, n in _parse(extra).items()}
    out, lse = _single_decode_impl(q, k, v, sinks, kv_layout, pos_encoding_mode, window_left, logits_soft_cap,
                                   sm_scale, rope_scale, rope_theta, rest.get("variant"))  # fmt: skip
    return out, lse


@_single_decode_op.register_fake
def _single_decode_fake(q, k, v, sinks, kv_layout, *rest):
    from . import common

    common.single_kv_nhd(q, k, v, kv_layout, 2, "[heads, dim]")
    return torch.empty_like(q), q.new_empty((q.shape[0],), dtype=torch.float32)


@torch.library.custom_op("cute_attn::single_prefill", mutates_args=())
def _single_prefill_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    custom_mask: Optional[torch.Tensor],
    packed_custom_mask: Optional[torch.Tensor],
    causal: bool,
    kv_layout: str,
    pos_encoding_mode: str,
    sm_scale: Optional[float],
    window_left: int,
    logits_soft_cap: Optional[float],
    rope_scale: Optional[float],
    rope_theta: Optional[float],
    extra_tensors: List[torch.Tensor],
    extra: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """single_prefill_with_kv_cache: (out [qo_len, hq, d], lse [qo_len, hq]); ``extra``: JSON
    {"variant": node, "variant_args": node}."""
    rest = {k_: _unflat(n, extra_tensors) for k_, n in _parse(extra).items()}
    return _single_prefill_impl(q, k, v, sinks, custom_mask, packed_custom_mask, causal, kv_layout,
                                pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                                rest.get("variant"), rest.get("variant_args", ()))  # fmt: skip


@_single_prefill_op.register_fake
def _single_prefill_fake(q, k, v, sinks, custom_mask, packed_custom_mask, causal, kv_layout, *rest):
    from . import common

    common.single_kv_nhd(q, k, v, kv_layout, 3, "[qo_len, heads, dim]")
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def _check_eager_only(**kw) -> None:
    """What the compiled single functions do not take (the eager functions refuse or ignore it):
    refused at trace time with the eager functions' message where they refuse it."""
    from . import common

    common.reject_unsupported(**kw)


def compiled_single_decode(
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
    """``single_decode_with_kv_cache`` under dynamo (its caller, same signature): the op
    ``cute_attn::single_decode``, the scales applied around it as the eager function does."""
    from . import common, scales

    hk = common.single_kv_nhd(q, k, v, kv_layout, 2, "[heads, dim]")[0].shape[1]  # the checks first
    sm_scale, sc = scales.for_single(sm_scale, q, hk, q_scale, k_scale, v_scale)
    extra_tensors: list = []
    extra = _encode({"variant": _flat(variant, extra_tensors)})
    out, lse = torch.ops.cute_attn.single_decode(
        sc.query(q), k, v, sinks, kv_layout, pos_encoding_mode, int(window_left), _none_or_float(logits_soft_cap),
        _none_or_float(sm_scale), _none_or_float(rope_scale), _none_or_float(rope_theta), extra_tensors, extra,
    )  # fmt: skip
    sc.output(out)
    return (out, lse) if return_lse else out


def compiled_single_prefill(
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
    """``single_prefill_with_kv_cache`` under dynamo (its caller, same signature): the op
    ``cute_attn::single_prefill``, the scales applied around it as the eager function does; the
    fp8 scales, ``o_dtype`` other than q's and ``kv_cache_sf`` are refused at trace time, as there."""
    from . import common, scales

    _check_eager_only(
        q_dtype=q.dtype,
        kv_dtype=k.dtype,
        o_dtype=common.as_dtype(o_dtype, "o_dtype"),
        fp8_scales=(scale_q, scale_k, scale_v),
        extra=(("kv_cache_sf", kv_cache_sf),),
    )
    hk = common.single_kv_nhd(q, k, v, kv_layout, 3, "[qo_len, heads, dim]")[0].shape[1]  # the checks first
    sm_scale, sc = scales.for_single(sm_scale, q, hk, None, k_scale, v_scale)
    extra_tensors: list = []
    extra = _encode(
        {"variant": _flat(variant, extra_tensors), "variant_args": _flat(tuple(variant_args), extra_tensors)}
    )
    out, lse = torch.ops.cute_attn.single_prefill(
        sc.query(q), k, v, sinks, custom_mask, packed_custom_mask, bool(causal), kv_layout, pos_encoding_mode,
        _none_or_float(sm_scale), int(window_left), _none_or_float(logits_soft_cap), _none_or_float(rope_scale),
        _none_or_float(rope_theta), extra_tensors, extra,
    )  # fmt: skip
    sc.output(out)
    return (out, lse) if return_lse else out
