"""What every wrapper checks and holds the same way, written once: the constructor's workspace
and layout checks, dtype parsing, the unsupported-feature check, index arrays on the device,
KV views, out / lse / sinks checks and the CUDA-graph capture guards.

Errors for bad input are ``ValueError`` (``TypeError`` for a wrong variant type), for what is
not supported *yet* ``NotImplementedError`` (:func:`reject_unsupported`)."""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from ..abi import dtypes
from . import guards

KV_LAYOUTS = ("NHD", "HND")
NO_SPLIT = 1 << 30  # disable_split_kv: a kv_split_size longer than any request
FP8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


# ---- constructor ------------------------------------------------------------------------------
def check_kv_layout(kv_layout) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


def _flat_bytes(buf: torch.Tensor) -> torch.Tensor:
    # the plan is written into the caller's buffer: a strided one would be silently copied by
    # reshape (and view(uint8) of a wider dtype fails with torch's own, less helpful, error)
    if not buf.is_contiguous():
        raise ValueError(
            f"float_workspace_buffer must be contiguous (the plan is written into it in place), got "
            f"shape {tuple(buf.shape)} with strides {tuple(buf.stride())}"
        )
    return buf.view(torch.uint8).reshape(-1)


def workspace_view(buf) -> torch.Tensor:
    """The constructor's workspace as the wrappers hold it (flat uint8): a contiguous CUDA tensor."""
    if not isinstance(buf, torch.Tensor) or not buf.is_cuda:
        raise ValueError("float_workspace_buffer must be a CUDA tensor")
    return _flat_bytes(buf)


def workspace_bytes(buf, device) -> torch.Tensor:
    """A replacement workspace as the wrappers hold it (flat uint8), checked to be on ``device``."""
    if not isinstance(buf, torch.Tensor) or buf.device != device:
        raise ValueError(f"float_workspace_buffer must be a tensor on {device}")
    return _flat_bytes(buf)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def check_index_buffers(named, what: str) -> None:
    """CUDA-graph mode's index buffers: each a 1-D int32 CUDA tensor (``what``: its size)."""
    for name, buf in named:
        if buf is None or not buf.is_cuda or buf.dtype != torch.int32 or buf.dim() != 1:
            raise ValueError(f"use_cuda_graph=True needs {name} (a 1-D int32 CUDA tensor {what}), as in FlashInfer")


# ---- plan arguments ---------------------------------------------------------------------------
def as_dtype(x, what: str = "dtype") -> Optional[torch.dtype]:
    """A torch dtype from a dtype or its name (``"float16"``, ``"torch.bfloat16"``); None stays None."""
    if x is None or isinstance(x, torch.dtype):
        return x
    t = getattr(torch, str(x).replace("torch.", ""), None)
    if not isinstance(t, torch.dtype):
        raise ValueError(f"{what} {x!r} is not a torch dtype")
    return t


def is_fp8(x) -> bool:
    """Whether ``x`` names an fp8 dtype (a name that does not parse: False, for plan()'s own checks)."""
    try:
        return as_dtype(x) in FP8
    except ValueError:
        return False


def dtype_name(dtype: torch.dtype) -> str:
    """The spec name (``"f16"`` / ``"bf16"``) of an attention dtype (checked by :func:`plan_dtype`)."""
    return dtypes.name_of(dtype, dtypes.ATTENTION)


def reject_unsupported(
    *,
    q_dtype=None,
    kv_dtype=None,
    o_dtype=None,
    head_dim_qk=None,
    head_dim_vo=None,
    jit_args=None,
    fp8_scales=(),
    extra=(),
):
    """Everything the wrappers do not support *yet*, in one place: raises
    NotImplementedError.  ``extra``: (name, value) pairs of FlashInfer arguments that must be None."""
    if q_dtype in FP8 or kv_dtype in FP8:
        raise NotImplementedError(f"fp8 q/kv ({q_dtype} / {kv_dtype}) are not supported yet")
    if any(s is not None for s in fp8_scales):
        raise NotImplementedError("q/k/v scales (fp8) are not supported yet")
    if o_dtype is not None and q_dtype is not None and o_dtype != q_dtype:
        raise NotImplementedError(f"o_data_type must equal the q dtype ({q_dtype}), got {o_dtype}")
    if head_dim_vo is not None and head_dim_qk is not None and head_dim_vo != head_dim_qk:
        raise NotImplementedError(f"head_dim_vo ({head_dim_vo}) != head_dim_qk ({head_dim_qk}) is not supported yet")
    if jit_args is not None:
        raise NotImplementedError(
            "custom kernels (jit_args / jit_kwargs) are not supported; variants come "
            "through cute_attn's own variant API (plan(variant=...))"
        )
    for name, value in extra:
        if value is not None:
            raise NotImplementedError(f"{name} is not supported")


def plan_dtype(q_data_type, kv_data_type, o_data_type, head_dim_qk=None, head_dim_vo=None, **unsupported):
    """plan()'s dtypes: (q dtype) after :func:`reject_unsupported`; q and kv must be one of
    float16 / bfloat16 and equal."""
    q_dtype = as_dtype(q_data_type, "q_data_type")
    kv_dtype = as_dtype(kv_data_type, "kv_data_type") or q_dtype
    o_dtype = as_dtype(o_data_type, "o_data_type")
    reject_unsupported(
        q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
        **unsupported,
    )  # fmt: skip
    if dtype_name(q_dtype) is None or kv_dtype != q_dtype:
        raise ValueError(f"q/kv dtypes must be one of float16/bfloat16 and equal, got {q_dtype} / {kv_dtype}")
    return q_dtype


def plan_kv_dtype(q_data_type, kv_data_type, o_data_type, **unsupported):
    """plan()'s dtypes for a wrapper whose kernels also read an fp8 cache: (q dtype, kv dtype),
    q float16 / bfloat16, kv the q dtype or float8_e4m3fn / float8_e5m2 (fp8 queries: the fp8
    attention kernels do not exist yet)."""
    q_dtype = as_dtype(q_data_type, "q_data_type")
    kv_dtype = as_dtype(kv_data_type, "kv_data_type") or q_dtype
    if q_dtype in FP8:
        raise NotImplementedError(f"fp8 queries ({q_dtype}; fp8 attention) are not supported yet")
    rest = None if kv_dtype in FP8 else kv_dtype
    q_dtype = plan_dtype(q_dtype, rest, o_data_type, **unsupported)
    return q_dtype, kv_dtype


def kv_dtype_name(kv_dtype, q_dtype) -> str | None:
    """The spec's ``kv_dtype`` of a plan: None for a cache of the query dtype, else the fp8 name."""
    return None if kv_dtype == q_dtype else dtypes.name_of(kv_dtype, dtypes.FP8)


def check_heads(num_qo_heads, num_kv_heads, head_dim, supported) -> None:
    if head_dim not in supported:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {supported}")
    for name, h in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(h, (int, np.integer)) or h < 1:
            raise ValueError(f"{name} must be a positive int, got {h!r}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def check_window_left(window_left) -> None:
    """An int >= -1 (-1: no window); a float or bool would be truncated into a different window."""
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)) or window_left < -1:
        raise ValueError(f"window_left must be >= -1 (an int), got {window_left!r}")


def check_plan_scalars(window_left, logits_soft_cap, fixed_split_size, split_unit: str) -> None:
    """window_left, logits_soft_cap and fixed_split_size (``split_unit``: pages or kv tokens)."""
    check_window_left(window_left)
    guards.check_soft_cap(logits_soft_cap)
    if fixed_split_size is not None and (not isinstance(fixed_split_size, (int, np.integer)) or fixed_split_size < 1):
        raise ValueError(f"fixed_split_size must be a positive int ({split_unit}), got {fixed_split_size!r}")


def check_plan_not_captured() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("plan() must not be captured in a CUDA graph; call it before replaying")


def int32_tensor(x) -> torch.Tensor:
    """An index array as given (a tensor stays where it is) or as a new int32 CPU tensor."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x), dtype=torch.int32)


def max_page_id(host_indices, used: int) -> int:
    """The largest page id in use (the first ``used`` entries: a buffer may be padded past
    them), checked against the cache in run(); -1 (unknown) for indices already on the GPU
    (reading them back would synchronize) or no page in use."""
    return int(host_indices[:used].max()) if host_indices is not None and used else -1


def to_device(t, buf, name: str, device) -> torch.Tensor:
    """An index array on the device: copied into ``buf`` (CUDA-graph mode) or a new int32 tensor."""
    t = t if isinstance(t, torch.Tensor) else torch.as_tensor(np.asarray(t))
    if buf is not None:
        if t.numel() > buf.numel():
            raise ValueError(f"{name} has {t.numel()} entries, its CUDA-graph buffer only {buf.numel()}")
        src = t.reshape(-1)
        if src.device == buf.device and src.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            if src.data_ptr() == buf.data_ptr() and src.dtype == buf.dtype:
                return buf  # the caller filled the buffer in place
            src = src.clone()  # a view into the buffer itself (a rebased indptr's indices): no overlapping copy
        buf[: t.numel()].copy_(src, non_blocking=True)
        return buf
    # a strided view (e.g. a column of a bigger table) is copied: the kernels read it with stride 1
    return t.to(device=device, dtype=torch.int32, non_blocking=True).reshape(-1).contiguous()


def guarded_plan(plan):
    """A plan() that raises leaves no plan: it may have written part of the new one into the
    workspace or the CUDA-graph buffers already, and run() must not launch the old kernel on
    that.  run() then raises, naming the failure."""

    @functools.wraps(plan)
    def wrapper(self, *args, **kwargs):
        try:
            out = plan(self, *args, **kwargs)
        except BaseException as e:
            self._state = None
            self._plan_error = f"{type(e).__name__}: {str(e)[:200]}"
            raise
        self._plan_error = None
        return out

    return wrapper


def check_capture_rows(wrapper, rows: int, what: str) -> None:
    if wrapper._captured_rows is not None and rows > wrapper._captured_rows:
        raise ValueError(
            f"use_cuda_graph=True: this plan has {rows} {what}, but a run() captured with q of "
            f"{wrapper._captured_rows} rows would write past its output on replay; capture with q sized "
            f"for the largest plan"
        )


_ARANGE: dict = {}


def arange(n: int, device) -> torch.Tensor:
    """0..n-1 as int32 on ``device``, from one cached (grown by doubling) tensor."""
    t = _ARANGE.get(device)
    if t is None or t.numel() < n:
        t = _ARANGE[device] = torch.arange(
            max(n, 2 * (t.numel() if t is not None else 4096)), dtype=torch.int32, device=device
        )
    return t[:n]


# ---- run arguments ----------------------------------------------------------------------------
def check_run_capture(wrapper, q, buffers: str) -> None:
    """A captured run() needs a wrapper whose buffers stay put between plans; and it bakes in its
    q rows, which a later plan() must not exceed (``check_capture_rows``).  One capture query
    per run()."""
    if not torch.cuda.is_current_stream_capturing():
        return
    if not wrapper._use_cuda_graph:
        raise RuntimeError(
            "run() is being captured into a CUDA graph but the wrapper was created with "
            "use_cuda_graph=False; its buffers may move between plans. Create it with "
            f"use_cuda_graph=True and fixed {buffers} tensors."
        )
    rows = int(q.shape[0])
    wrapper._captured_rows = rows if wrapper._captured_rows is None else min(rows, wrapper._captured_rows)


def kv_views(paged_kv_cache, kv_layout: str, same_dim: bool = True):
    """(K, V) as [pages, page_size, kv_heads, head_dim] views of any supported cache form;
    ``same_dim=False``: a ``(k, v)`` tuple's head dims may differ (head_dim_vo != head_dim_qk)."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError("paged_kv_cache tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
    else:
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                f"a single paged_kv_cache tensor must be [pages, 2, ...], got {tuple(paged_kv_cache.shape)}"
            )
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if k.dim() != 4 or v.dim() != 4 or (k.shape != v.shape if same_dim else k.shape[:3] != v.shape[:3]):
        what = "equal in shape" if same_dim else "equal but for the head dim"
        raise ValueError(f"k/v caches must be 4-D and {what}, got {tuple(k.shape)} / {tuple(v.shape)}")
    check_kv_pair(k, v, "k/v caches")
    check_last_dim_contiguous(("the k cache", k), ("the v cache", v))
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    else:
        check_kv_layout(kv_layout)
    return k, v


def check_kv_pair(k, v, what: str) -> None:
    """K and V of one cache share a dtype and a device (callers check K against the plan; a V
    of another dtype would be read as K's)."""
    if k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"{what} must share a dtype and device, got {k.dtype} / {v.dtype} on {k.device} / {v.device}")


def single_kv_nhd(q, k, v, kv_layout, q_dim, q_shape):
    """The single-request functions' shape and layout checks; k / v as [kv_len, heads, dim] views."""
    if q.dim() != q_dim or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"q must be {q_shape} and k/v equal 3-D tensors, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_kv_pair(k, v, "k/v")
    check_last_dim_contiguous(("q", q), ("k", k), ("v", v))
    check_kv_layout(kv_layout)
    return (k.transpose(0, 1), v.transpose(0, 1)) if kv_layout == "HND" else (k, v)


def check_last_dim_contiguous(*named) -> None:
    """(name, tensor) pairs: each row (the head dim) contiguous, as the kernels' 16-byte loads
    and stores need (other strides are free)."""
    for name, t in named:
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")


def check_q(q, rows: int, hq: int, d: int, dtype, device, use_cuda_graph: bool, rows_name: str = "") -> None:
    """q ``[rows, hq, d]`` (CUDA-graph mode: at least ``rows``: captured at the largest plan;
    rows past the plan are neither read nor written)."""
    rows_ok = q.dim() == 3 and (q.shape[0] >= rows if use_cuda_graph else q.shape[0] == rows)
    if not rows_ok or q.shape[1:] != (hq, d) or q.dtype != dtype or q.device != device:
        want = (f">= {rows}" if use_cuda_graph else f"{rows}") + rows_name
        raise ValueError(
            f"q must be {dtype} [{want}, {hq}, {d}] on {device}, got {q.dtype} {tuple(q.shape)} on {q.device}"
        )
    check_last_dim_contiguous(("q", q))


def out_and_lse(q, out, lse, hq: int, d_out: Optional[int] = None):
    """run()'s ``out`` / ``lse``: new tensors, or the caller's checked for dtype, shape and device;
    ``d_out``: the output's head dim where it is not q's (head_dim_vo)."""
    shape = q.shape if d_out is None else torch.Size((*q.shape[:-1], d_out))
    if out is None:
        out = torch.empty_like(q) if d_out is None else q.new_empty(shape)
    elif out.shape != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {q.dtype} {tuple(shape)} on {q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    else:
        check_last_dim_contiguous(("out", out))
    if lse is None:
        lse = torch.empty((q.shape[0], hq), dtype=torch.float32, device=q.device)
    elif lse.shape != (q.shape[0], hq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(
            f"lse must be float32 [{q.shape[0]}, {hq}] on {q.device}, got {lse.dtype} "
            f"{tuple(lse.shape)} on {lse.device}"
        )
    return out, lse


def check_sinks(sinks, hq: int, device) -> Optional[torch.Tensor]:
    """run()'s ``sinks``: per-head sink logits ``[hq]`` on ``device``, as fp32 (None stays None)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (hq,) or sinks.device != device:
        raise ValueError(
            f"sinks must be a [{hq}] tensor on {device}, got "
            f"{tuple(getattr(sinks, 'shape', ()))} on {getattr(sinks, 'device', None)}"
        )
    return sinks.float()


# ---- the plan's own buffer ----------------------------------------------------------------------
# The engines give one float workspace to several wrappers (vLLM: the prefill and decode wrappers
# of a mixed step, planned before either runs; SGLang: the ragged and paged prefill of one
# extend step): a plan's work lists must not live in it.  As FlashInfer's int workspace, each
# wrapper keeps them in its own device buffer (the layout's int sections, small); the shared
# workspace holds the fp32 partial outputs, scratch that only a run() uses, at the layout's
# offsets (its int sections there stay unused).
_INT_SECTIONS = ("meta", "work_indptr", "merge_tasks", "work_items")


def plan_buffer(layout, workspace) -> torch.Tensor:
    """A wrapper's own buffer for a layout's int sections, on the workspace's device."""
    return workspace.new_zeros(layout.int_bytes)


def plan_views(layout, workspace, plan_buf) -> dict:
    """The layout's section views: the int ones in ``plan_buf``, the fp32 ones in ``workspace``."""
    v = layout.views(workspace)
    for name in _INT_SECTIONS:
        o, n = layout.sections[name]
        v[name] = plan_buf[o : o + n].view(torch.int32).view(v[name].shape)
    return v


def install_planner(w, limits, num_sms: int, per_sm: int, cost: dict, plan_desc: Optional[str] = None):
    """Make ``w``'s planner the one of ``limits`` and ``num_sms x per_sm`` CTAs (kept while both
    hold; ``cost``: the backend's planner parameters) and its section views (made once per
    planner).  ``plan_desc`` (what the plan is, for the error): check that the workspace holds a
    new planner's layout.  ``w``: a wrapper with ``_planner`` / ``_views`` / ``_plan_buf`` /
    ``_workspace``."""
    from ..sched import Planner

    num_ctas = num_sms * per_sm
    if w._planner is None or w._planner.limits != limits or w._planner.num_ctas != num_ctas:
        planner = Planner(limits, num_sms, per_sm, **cost)
        need = planner.layout.total_bytes
        if plan_desc is not None and w._workspace.numel() < need:
            raise ValueError(
                f"float_workspace_buffer has {w._workspace.numel()} bytes; this plan needs {need} ({plan_desc})"
            )
        w._planner, w._views = planner, None
    if w._views is None:
        w._plan_buf = plan_buffer(w._planner.layout, w._workspace)
        w._views = plan_views(w._planner.layout, w._workspace, w._plan_buf)
    return w._planner


class WrapperBase:
    """The constructor state every batch wrapper holds: the workspace (flat uint8), the KV
    layout, CUDA-graph mode, the device, and the planner (kept while the limits hold)."""

    def __init__(self, float_workspace_buffer, kv_layout: str, use_cuda_graph: bool):
        check_kv_layout(kv_layout)
        self._workspace = workspace_view(float_workspace_buffer)
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._device = float_workspace_buffer.device
        self._dev = device_index(self._device)
        self._planner = None  # sched.Planner of the current limits
        self._views = None  # the planner's workspace sections (fixed offsets per planner)
        self._plan_buf = None  # the plan's int sections (plan_buffer), made with the views
        self._state = None  # the current plan (a frozen plans.*PlanState), None before plan()
        self._plan_error = None  # why the last plan() raised (run() then refuses to launch)
        self._captured_rows = None  # CUDA-graph mode: q rows of the smallest captured run()

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def device_index(self) -> int:
        return self._dev

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The q / kv / output dtype of the current plan (None before plan())."""
        return None if self._state is None else self._state.dtype

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Use another workspace from the next ``plan()`` on (FlashInfer's method; the int
        workspace is not used: the plan's records live in a buffer of the wrapper's own)."""
        self._workspace = workspace_bytes(float_workspace_buffer, self._device)
        self._views = self._state = None

    def _require_plan(self):
        if self._state is None:
            why = getattr(self, "_plan_error", None)
            raise RuntimeError("run() before plan()" + (f": the last plan() failed ({why})" if why else ""))
        return self._state

    # what tests and scripts inspect of the current plan
    @property
    def _plan(self):
        return None if self._state is None else self._state.plan

    @property
    def _num_ctas(self):
        return self._state.num_ctas

    @property
    def _sm_scale(self):
        return self._state.sm_scale

    @property
    def _batch(self):
        return self._state.batch

    @property
    def _hk(self):
        return self._state.hk

    @property
    def _page_size(self):
        return self._state.page_size

    @property
    def _kv_indptr(self):
        return self._state.kv_indptr

    @property
    def _kv_indices(self):
        return self._state.kv_indices

    @property
    def _binding(self):
        return self._state.binding
