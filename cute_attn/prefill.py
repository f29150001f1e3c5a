"""Batch prefill / append attention, FlashInfer-compatible: ``BatchPrefillWithRaggedKVCacheWrapper``,
``BatchPrefillWithPagedKVCacheWrapper`` and ``single_prefill_with_kv_cache``.

Hopper (sm_90a) only for now: the kernel (``kernels/prefill_sm90.py``, family
``batch_prefill_sm90``) is built on ``wgmma``, which Blackwell does not have; a Blackwell
prefill kernel does not exist yet and the wrappers say so in ``plan()``.

``plan()`` runs the CPU scheduler (``cute_attn.sched``) with query tiles of 64 or 128 packed
rows (the planner's tile rule, its 16-row decode tile mapped to 64) and one persistent CTA per
SM, and uploads the work lists into the user's ``float_workspace_buffer`` at fixed offsets.
``run()`` launches the prefill kernel and, when the plan split some KV (or in CUDA-graph mode,
where a later plan may split), the persistent ⊕ merge kernel (``merge_partials``, the same one
decode uses, specialized for the prefill tile).

Both wrappers feed the same kernel ABI as decode (``decode._decode_abi``):

* paged: K/V are the cache as strided ``[pages, page_size, kv_heads, head_dim]`` views (NHD,
  HND, ``(k, v)`` tuples and ``[pages, 2, ...]`` tensors, exactly as decode passes them),
  ``mKvIndptr`` / ``mKvIndices`` the page indptr / page ids;
* ragged: K/V are passed as ``[1, total_kv_tokens, kv_heads, head_dim]`` views (an HND ragged
  ``[kv_heads, total, head_dim]`` tensor is transposed first, no copy), ``mKvIndptr`` the
  ragged kv_indptr in tokens, ``mKvIndices`` a one-element dummy.

Variants (docs/variants.md) as in decode: ``causal``, ``window_left`` and ``logits_soft_cap``
are the kernel's static flags (its fast paths); ``pos_encoding_mode="ALIBI"`` / ``"ROPE_LLAMA"``
(``rope_scale``, ``rope_theta``), ``custom_mask`` / ``packed_custom_mask`` (FlashInfer's
per-request row-major ``[qo_len, kv_len]`` layout, bits packed little-endian per request;
a custom mask replaces ``causal``, as FlashInfer's MaskMode.CUSTOM), ``run(sinks=)`` and
``plan(variant=...)`` become a traced variant (spec params ``variant`` / ``variant_fp``), whose
runtime arguments follow the fixed ones in the kernel ABI.  Soft-cap joins the variant (in
decode's order: RoPE/ALiBi, soft-cap, ...) when another component transforms logits.

What is not supported yet raises ``NotImplementedError`` from one place
(``_reject_unsupported``): fp8, ``head_dim_vo != head_dim_qk``, an output dtype other than the
query's, custom (``jit_args``) kernels and FlashInfer's multi-item-scoring / trtllm-gen inputs.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple, Union

import numpy as np
import torch

from .decode import _DTYPES, SUPPORTED_HEAD_DIMS, _arange, _as_dtype, _kv_views, _single_kv_nhd, workspace_bytes
from .families.backends import kv_pass_pays
from .families.base import variant_params
from .families.kv_pass import CTAS_PER_SM as _KV_PASS_CTAS_PER_SM
from .families.kv_pass import kv_pass_spec
from .families.prefill import ARCH as PREFILL_ARCH
from .families.prefill import FIXED_SPLIT_TILE as _FIXED_SPLIT_TILE
from .families.prefill import TILES as PREFILL_TILES  # noqa: F401
from .families.prefill import keys_pretransformed, page_box_for
from .runtime.arch import arch_of_index, sm_count_of_index
from .runtime.loader import KernelNotAvailable, kernel
from .sched import Limits, Planner, WorkspaceLayout
from .sched.cost import choose_cta_tile_q
from .sched.inputs import as_index_array, check_indptr, kv_lens_from_paged, kv_lens_from_ragged
from .variants import base as vbase
from .variants.binding import VariantBinding
from .variants.builtins import CustomMask, mask_kv_bounds
from .wrappers.options import POS_MODES, resolve_variant  # noqa: F401

_NO_SPLIT = 1 << 30  # disable_split_kv: a kv_split_size longer than any request
_FP8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def _rows_per_cta(head_dim: int) -> int:
    """Partial-output rows per CTA: 4 slots of 128 rows (8 of 64) up to head_dim 128, half that
    at 256, so the fp32 partial section stays at ~35 MB on an H200 (132 SMs) for every head
    dim. The planner only cuts a tile when whole tiles cannot balance (few long tiles); its
    pre-cut candidate doubles the chunk until the slots fit."""
    return 512 * 128 // max(head_dim, 128)


def _round_rows(n: int) -> int:
    """Query-token capacity when it has to grow: a power of two (>= 1024), so that the
    planner (pinned staging buffers, workspace layout) is rebuilt only log-many times."""
    return max(1024, 1 << max(int(n) - 1, 0).bit_length())


def _dtype(x, what: str) -> Optional[torch.dtype]:
    try:
        return _as_dtype(x)
    except AttributeError:
        raise ValueError(f"{what} {x!r} is not a torch dtype") from None


def _reject_unsupported(
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
    """Everything the prefill path does not support *yet*, in one place: raises
    NotImplementedError.  ``extra``: (name, value) pairs of FlashInfer arguments that must be None."""
    if q_dtype in _FP8 or kv_dtype in _FP8:
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


def pack_custom_mask(custom_mask, qo_lens, kv_lens) -> Tuple[torch.Tensor, np.ndarray]:
    """FlashInfer's ``segment_packbits``: the flat bool mask (request b's row-major
    ``[qo_len, kv_len]`` block after request b-1's) bit-packed per request, little bit order;
    returns (packed uint8 on the CPU, byte indptr [batch + 1])."""
    n = np.asarray(qo_lens, dtype=np.int64) * np.asarray(kv_lens, dtype=np.int64)
    flat = custom_mask.reshape(-1).to(device="cpu", dtype=torch.bool).numpy()
    if flat.size != n.sum():
        raise ValueError(f"custom_mask has {flat.size} entries, expected sum(qo_len * kv_len) = {int(n.sum())}")
    offs = np.concatenate([[0], np.cumsum(n)])
    packed = [np.packbits(flat[offs[b] : offs[b + 1]], bitorder="little") for b in range(n.shape[0])]
    indptr = np.concatenate([[0], np.cumsum((n + 7) // 8)]).astype(np.int64)
    return torch.from_numpy(np.concatenate(packed + [np.zeros(1, np.uint8)])), indptr


def _check_capture_plan():
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("plan() must not be captured in a CUDA graph; call it before replaying")


class _BatchPrefillBase:
    """What the ragged and paged wrappers share: planning, limits, the launch."""

    _PAGED = False

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool, jit_args=None):
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if not isinstance(float_workspace_buffer, torch.Tensor) or not float_workspace_buffer.is_cuda:
            raise ValueError("float_workspace_buffer must be a CUDA tensor")
        _reject_unsupported(jit_args=jit_args)
        self._workspace = float_workspace_buffer.view(torch.uint8).reshape(-1)
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._device = float_workspace_buffer.device
        self._dev = self._device.index if self._device.index is not None else torch.cuda.current_device()
        self._grow_workspace = False  # single_prefill_with_kv_cache's private wrappers grow theirs
        self._planner: Optional[Planner] = None
        self._views = None
        self._plan = None
        self._fixed = None  # CUDA-graph mode: what the first plan fixed (a captured run() bakes it)
        self._max_rows = None  # CUDA-graph mode: query tokens, fixed by the first plan (as FlashInfer)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Use another workspace from the next ``plan()`` on (FlashInfer's method; the int
        workspace is not used: the plan lives in the float one)."""
        self._workspace = workspace_bytes(float_workspace_buffer, self._device)
        self._views = self._plan = None

    # -- plan -----------------------------------------------------------------------------
    def _check_common(
        self,
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
        pos_encoding_mode="NONE",
        variant=None,
        **unsupported,
    ):
        """Argument checks shared by both plans; returns (q dtype, head_dim)."""
        _check_capture_plan()
        q_dtype = _dtype(q_data_type, "q_data_type")
        kv_dtype = _dtype(kv_data_type, "kv_data_type") or q_dtype
        o_dtype = _dtype(o_data_type, "o_data_type")
        _reject_unsupported(
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            o_dtype=o_dtype,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            **unsupported,
        )
        if pos_encoding_mode not in POS_MODES:
            raise ValueError(f"pos_encoding_mode must be one of {POS_MODES}, got {pos_encoding_mode!r}")
        if variant is not None and not isinstance(variant, vbase.Variant):
            raise TypeError(f"variant must be a cute_attn.variants.Variant, got {type(variant).__name__}")
        if head_dim_qk not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim_qk} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
        for name, h in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(h, (int, np.integer)) or h < 1:
                raise ValueError(f"{name} must be a positive int, got {h!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if q_dtype not in _DTYPES or kv_dtype != q_dtype:
            raise ValueError(f"q/kv dtypes must be one of float16/bfloat16 and equal, got {q_dtype} / {kv_dtype}")
        if window_left is None or window_left < -1:
            raise ValueError(f"window_left must be >= -1, got {window_left}")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 (0 or None: off), got {logits_soft_cap}")
        if fixed_split_size is not None and (
            not isinstance(fixed_split_size, (int, np.integer)) or fixed_split_size < 1
        ):
            raise ValueError(f"fixed_split_size must be a positive int, got {fixed_split_size!r}")
        arch = arch_of_index(self._dev)
        if arch != PREFILL_ARCH:
            raise RuntimeError(
                f"batch prefill runs on Hopper (sm_90a) GPUs only for now: its kernel is built on "
                f"wgmma; cuda:{self._dev} is {arch}, for which no prefill kernel exists yet"
            )
        return q_dtype, int(head_dim_qk)

    def _plan_common(
        self,
        qo_h,
        kv_lens,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        q_dtype,
        causal,
        page_size,
        window_left,
        logits_soft_cap,
        sm_scale,
        split_tokens,
        disable_split_kv,
        pos_encoding_mode="NONE",
        rope_scale=None,
        rope_theta=None,
        custom_mask=None,
        packed_custom_mask=None,
        variant=None,
        kv_pass=None,
    ):
        """Validate lengths, (re)make the planner, plan + upload, pick the kernels. Returns the
        state ``_commit`` stores once the device copies are queued.  ``kv_pass`` (paged): gather
        the cache by the KV pass first (True), never (False) or when it pays (None)."""
        hq, hk, d = int(num_qo_heads), int(num_kv_heads), head_dim
        qo_len = np.diff(qo_h)
        batch = int(qo_len.shape[0])
        mask_v = None
        if custom_mask is not None or packed_custom_mask is not None:
            mask_v = self._custom_mask(custom_mask, packed_custom_mask, qo_len, kv_lens)
        causal, cap_flag, _, var = resolve_variant(
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            custom_mask=mask_v,
            variant=variant,
        )
        if vbase.Hooks(var).has_output:
            disable_split_kv = True  # an output transform must see whole rows, not partial states
        if causal and batch:
            short = np.flatnonzero(kv_lens < qo_len)
            if short.size:
                i = int(short[0])
                raise ValueError(
                    f"causal=True needs kv_len >= qo_len for every request (as FlashInfer); request {i} "
                    f"has qo_len {int(qo_len[i])}, kv_len {int(kv_lens[i])}"
                )
        total_q = int(qo_h[-1])
        group = hq // hk
        soft_cap = float(logits_soft_cap) if logits_soft_cap and cap_flag else 0.0
        window_left = int(window_left)
        launch = dict(
            dtype=_DTYPES[q_dtype],
            head_dim=d,
            causal=bool(causal),
            soft_cap=soft_cap > 0,
            window=window_left >= 0,
            hq=hq,
            hk=hk,
            sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d),
            soft_cap_value=soft_cap,
            window_left=window_left,
            variant=vbase.encode(var),
            page_box=page_box_for(self._PAGED, int(page_size)),
        )  # the KV pass may change it

        batch_invariant = split_tokens is not None  # fixed_split_size: nothing may depend on the batch
        if batch_invariant:
            tile = _FIXED_SPLIT_TILE  # batch-invariant: the tile may not depend on the batch either
        else:
            with_q = int(np.count_nonzero(qo_len))
            tile = max(64, choose_cta_tile_q(total_q * group, with_q))
        if disable_split_kv:
            split_tokens = _NO_SPLIT

        num_ctas = sm_count_of_index(self._dev)  # one CTA per SM (the kernel fills the SM's smem)
        if self._use_cuda_graph:
            if self._fixed is None:
                self._max_rows = max(total_q, 1)
            else:
                changed = [k for k in self._fixed if k != "tile_q" and self._fixed[k] != launch[k]]
                if changed:
                    raise ValueError(
                        f"use_cuda_graph=True: plan() changed {changed} since the first plan; a captured "
                        f"run() bakes them (kernel specialization and launch scalars). Keep them "
                        f"fixed or use another wrapper."
                    )
                tile = self._fixed["tile_q"]  # the captured kernel's tile
            if total_q > self._max_rows:
                raise ValueError(
                    f"use_cuda_graph=True: qo_indptr[-1] = {total_q} exceeds the {self._max_rows} query "
                    f"tokens of the first plan (which fixes the workspace layout, as in FlashInfer)"
                )
        lim, grow = self._choose_limits(batch, total_q, hq, hk, d, num_ctas)
        gather = None  # (offset, bytes per tensor) of the gathered K / V in the workspace
        if self._PAGED:
            # batch-invariant plans take the pass only when asked: the model weighs the whole batch
            want = False if kv_pass is None and batch_invariant else kv_pass
            gather = self._gather_region(
                want, lim, num_ctas, int(page_size), var, qo_len, kv_lens, causal, window_left, hq, hk, d, q_dtype
            )
        # modules first (loaded here, outside any capture): a missing one must fail before the
        # new plan overwrites the workspace that the previous plan's state still describes
        try:
            paged, spec_kw, pass_var, pass_module, attn = self._kernels(launch, tile, d, var, page_size, gather)
        except KernelNotAvailable:
            if gather is None or kv_pass:
                raise
            # the pass was the model's choice, not the caller's: a cache built without its
            # kernels (an older `compile --preset`) still serves the plan by the in-kernel gather
            gather = None
            paged, spec_kw, pass_var, pass_module, attn = self._kernels(launch, tile, d, var, page_size, gather)
        merge = kernel("merge_partials", PREFILL_ARCH, dtype=launch["dtype"], head_dim=d, tile_q=tile)
        planner = self._install_planner(lim, num_ctas, grow)
        plan = planner.plan(
            qo_h,
            kv_lens,
            causal=bool(causal),
            page_size=int(page_size) if paged else 1,
            num_qo_heads=hq,
            num_kv_heads=hk,
            cta_tile_q=tile,
            kv_split_size=split_tokens,
            workspace=self._workspace,
        )
        if self._use_cuda_graph and self._fixed is None:
            self._fixed = dict(launch, tile_q=tile)
        return dict(
            plan=plan,
            launch=launch,
            tile=tile,
            attn=attn,
            merge=merge,
            batch=batch,
            total_q=total_q,
            q_dtype=q_dtype,
            group=group,
            num_ctas=planner.num_ctas,
            variant=var,
            spec_kw=spec_kw,
            kv_pass=pass_module,
            pass_variant=pass_var,
            gather=gather,
            kv_lens=kv_lens,
        )

    def _kernels(self, launch, tile, d, var, page_size, gather):
        """Load the plan's modules: (kernel reads a paged cache, its spec params, the KV pass's
        variant, the pass module or None, the attention module); sets ``launch["page_box"]``."""
        paged = self._PAGED and gather is None  # the kernel reads the cache itself
        launch["page_box"] = page_box_for(paged, int(page_size))
        spec_kw = dict(
            dtype=launch["dtype"],
            head_dim=d,
            tile_q=tile,
            paged=paged,
            causal=launch["causal"],
            soft_cap=launch["soft_cap"],
            window=launch["window"],
        )
        if launch["page_box"]:
            spec_kw["page_box"] = launch["page_box"]
        if keys_pretransformed(paged, var):
            spec_kw["keys_transformed"] = True
        pass_var = var if keys_pretransformed(paged, var) else None  # the pass's variant: K's transform
        pass_spec = kv_pass_spec(PREFILL_ARCH, launch["dtype"], d, gather is not None, pass_var)
        pass_module = None if pass_spec is None else kernel(pass_spec.family, PREFILL_ARCH, **pass_spec.pdict)
        attn = kernel("batch_prefill_sm90", PREFILL_ARCH, **spec_kw, **self._variant_kw(var))
        return paged, spec_kw, pass_var, pass_module, attn

    def _gather_region(
        self, want, lim, num_ctas, page_size, var, qo_len, kv_lens, causal, window_left, hq, hk, d, q_dtype
    ):
        """Whether this paged plan gathers the cache by the KV pass (``kv_pass_pays`` when
        ``want`` is None) and where: (byte offset, bytes per tensor) of K / V in the workspace,
        past the plan's sections; None for the in-kernel gather.  Not in CUDA-graph mode: a
        captured run() bakes the path, and a later plan's lengths may not pay or fit."""
        if want is False:
            return None
        elt = q_dtype.itemsize
        transform = var is not None and vbase.Hooks(var).has_transform_k
        if want is None:
            boxes = bool(page_box_for(True, page_size))  # else the kernel's cp.async gather
            if self._use_cuda_graph or not kv_pass_pays(
                qo_len, kv_lens, hq, hk, d, bool(causal), transform, elt, window_left, boxes
            ):
                return None
        elif self._use_cuda_graph:
            raise ValueError(
                "kv_pass=True is not available with use_cuda_graph=True (a captured run() bakes the "
                "path; the in-kernel gather serves every plan)"
            )
        per = -(-int(kv_lens.sum()) * hk * d * elt // 256) * 256
        start = -(-WorkspaceLayout(lim, num_ctas).total_bytes // 256) * 256
        have = self._workspace.numel()
        if start + 2 * per > have:
            if want:
                raise ValueError(
                    f"kv_pass=True: float_workspace_buffer has {have} bytes; the plan and the gathered "
                    f"K / V need {start + 2 * per}"
                )
            return None
        return start, per

    @staticmethod
    def _variant_kw(v) -> dict:
        return variant_params(v) if v is not None else {}

    def _custom_mask(self, custom_mask, packed, qo_len, kv_lens) -> CustomMask:
        """FlashInfer's mask conventions: per request a row-major ``[qo_len, kv_len]`` bool block,
        bit-packed per request (little bit order); ``mask_indptr`` = byte offset per request.
        With ``use_cuda_graph`` the offsets go into the constructor's ``mask_indptr_buf`` and the
        bits into an int32 twin of ``custom_mask_buf`` (the kernels read words; the uint8 buffer
        only sizes it): a captured run() reads them there."""
        nbits = qo_len.astype(np.int64) * kv_lens.astype(np.int64)
        if packed is None:
            packed, indptr = pack_custom_mask(custom_mask, qo_len, kv_lens)
        else:
            indptr = np.concatenate([[0], np.cumsum((nbits + 7) // 8)])
            if packed.numel() < indptr[-1]:
                raise ValueError(
                    f"packed_custom_mask has {packed.numel()} bytes, the lengths need {int(indptr[-1])} "
                    f"(per request ceil(qo_len * kv_len / 8), FlashInfer's segment_packbits)"
                )
            if packed.dtype != torch.uint8:
                raise ValueError(f"packed_custom_mask must be uint8, got {packed.dtype}")
        indptr_t = torch.from_numpy(indptr.astype(np.int32))
        qo_h = np.concatenate([[0], np.cumsum(qo_len)]).astype(np.int32)
        packed = packed.reshape(-1)
        if packed.numel() == 0:
            packed = torch.zeros(1, dtype=torch.uint8)
        mbuf, ibuf = getattr(self, "_mask_buf", None), getattr(self, "_mask_indptr_buf", None)
        if self._use_cuda_graph:
            if mbuf is None or ibuf is None:
                raise ValueError(
                    "use_cuda_graph=True with a custom mask needs custom_mask_buf (uint8) and "
                    "mask_indptr_buf (int32) in the constructor, as in FlashInfer"
                )
            if packed.numel() > mbuf.numel() or indptr_t.numel() > ibuf.numel():
                raise ValueError(
                    f"the packed mask ({packed.numel()} bytes, {indptr_t.numel()} offsets) exceeds "
                    f"custom_mask_buf / mask_indptr_buf ({mbuf.numel()} / {ibuf.numel()})"
                )
            if getattr(self, "_mask_words_buf", None) is None:  # the kernel reads words: a fixed int32 twin
                self._mask_words_buf = torch.zeros(mbuf.numel() // 4 + 1, dtype=torch.int32, device=self._device)
            if getattr(self, "_mask_bounds_buf", None) is None:  # the first plan fixes the query tokens
                self._mask_bounds_buf = torch.zeros((max(int(qo_h[-1]), 1), 2), dtype=torch.int32, device=self._device)
                self._mask_qo_buf = torch.zeros(self._qo_indptr_buf.numel(), dtype=torch.int32, device=self._device)
            if qo_h[-1] > self._mask_bounds_buf.shape[0] or qo_h.size > self._mask_qo_buf.numel():
                raise ValueError(
                    f"use_cuda_graph=True: {int(qo_h[-1])} query tokens / batch {qo_h.size - 1} exceed "
                    f"the first plan's {self._mask_bounds_buf.shape[0]} / {self._mask_qo_buf.numel() - 1}"
                )
            ibuf[: indptr_t.numel()].copy_(indptr_t, non_blocking=True)
            self._mask_qo_buf[: qo_h.size].copy_(torch.from_numpy(qo_h), non_blocking=True)
            words = CustomMask.words(packed, self._mask_words_buf)
            return CustomMask(
                packed_custom_mask=words,
                mask_indptr=ibuf,
                qo_indptr=self._mask_qo_buf,
                kv_bounds=mask_kv_bounds(
                    words.view(torch.uint8)[: packed.numel()], indptr, qo_len, kv_lens, out=self._mask_bounds_buf
                ),
            )
        words = CustomMask.words(packed, device=self._device)
        return CustomMask(
            packed_custom_mask=words,
            mask_indptr=indptr_t.to(self._device, non_blocking=True),
            qo_indptr=torch.from_numpy(qo_h).to(self._device, non_blocking=True),
            kv_bounds=mask_kv_bounds(words.view(torch.uint8)[: packed.numel()], indptr, qo_len, kv_lens),
        )

    def _choose_limits(self, batch, total_q, hq, hk, d, num_ctas):
        """The planner limits for this plan and the bytes the workspace must grow to (0: it
        fits); no side effects (a kernel that fails to load leaves the previous plan intact)."""
        rows = _rows_per_cta(d) * num_ctas

        def limits(max_batch, max_q):
            return Limits(
                max_batch=max(max_batch, 1),
                max_total_q_tokens=max(max_q, 1),
                num_qo_heads=hq,
                num_kv_heads=hk,
                head_dim=d,
                max_partial_rows=rows,
            )

        have = self._workspace.numel()
        if self._use_cuda_graph:  # fixed by the buffers and the first plan: offsets never move
            cands = [limits(self._batch_capacity(batch), self._max_rows)]
        else:
            prev = self._planner.limits if self._planner is not None else None
            same_heads = prev is not None and (prev.num_qo_heads, prev.num_kv_heads, prev.head_dim) == (hq, hk, d)
            grow_b = max(batch, prev.max_batch) if same_heads else batch
            grow_q = max(_round_rows(total_q), prev.max_total_q_tokens) if same_heads else _round_rows(total_q)
            if same_heads and prev.max_batch >= batch and prev.max_total_q_tokens >= total_q:
                cands = [prev]
            else:  # grow with headroom; exact sizes if the headroom does not fit the workspace
                cands = [limits(grow_b, grow_q), limits(batch, total_q)]
        lim = next((c for c in cands if WorkspaceLayout(c, num_ctas).total_bytes <= have), None)
        if lim is not None:
            return lim, 0
        need = WorkspaceLayout(cands[-1], num_ctas).total_bytes
        if not self._grow_workspace:
            raise ValueError(
                f"float_workspace_buffer has {have} bytes; this plan needs {need} (batch {batch}, "
                f"{total_q} query tokens, {hq} qo heads, head_dim {d})"
            )
        return cands[-1], need

    def _install_planner(self, lim, num_ctas, grow) -> Planner:
        """Make ``lim``'s planner current (growing the workspace to ``grow`` bytes if set)."""
        if grow:
            self._workspace = torch.empty(grow, dtype=torch.uint8, device=self._device)
            self._views = None
        if self._planner is None or self._planner.limits != lim or self._planner.num_ctas != num_ctas:
            self._planner = Planner(lim, num_ctas, 1)
            self._views = None
        if self._views is None:  # section offsets are fixed per planner: views made once
            self._views = self._planner.layout.views(self._workspace)
        return self._planner

    def _batch_capacity(self, batch) -> int:
        cap = self._qo_indptr_buf.numel() - 1
        if batch > cap:
            raise ValueError(f"batch {batch} exceeds the CUDA-graph buffers' capacity {cap} (qo_indptr_buf)")
        return cap

    def _commit(self, st) -> None:
        self._plan, self._tile, self._attn, self._merge = st["plan"], st["tile"], st["attn"], st["merge"]
        self._batch, self._total_q, self._dtype = st["batch"], st["total_q"], st["q_dtype"]
        self._group, self._num_ctas = st["group"], st["num_ctas"]
        L = st["launch"]
        self._hq, self._hk, self._d = L["hq"], L["hk"], L["head_dim"]
        self._causal, self._sm_scale, self._soft_cap, self._window_left = (
            L["causal"],
            L["sm_scale"],
            L["soft_cap_value"],
            L["window_left"],
        )
        self._variant, self._spec_kw = st["variant"], st["spec_kw"]
        info = {
            "num_qo_heads": self._hq,
            "num_kv_heads": self._hk,
            "head_dim": self._d,
            "sm_scale": self._sm_scale,
            "device": self._device,
            "batch": self._batch,
        }
        self._binding = VariantBinding(
            self._variant,
            info,
            self._attn,
            lambda v: kernel("batch_prefill_sm90", PREFILL_ARCH, **self._spec_kw, **self._variant_kw(v)),
        )
        # the KV pass: the plan's key transform, if any (run()'s sinks do not touch keys)
        self._kv_pass = None if st["kv_pass"] is None else VariantBinding(st["pass_variant"], info, st["kv_pass"], None)
        self._gathered = None
        if st["gather"] is not None:  # the pass's output: contiguous K / V in the workspace
            off, per = st["gather"]
            n = int(st["kv_lens"].sum())
            self._gathered = tuple(
                self._workspace[o : o + per].view(self._dtype)[: n * self._hk * self._d].view(1, n, self._hk, self._d)
                for o in (off, off + per)
            )

    def _to_device(self, t, buf, name):
        """An index array on the device: copied into ``buf`` (CUDA-graph mode) or a new tensor."""
        t = t if isinstance(t, torch.Tensor) else torch.as_tensor(np.asarray(t))
        if buf is not None:
            if t.numel() > buf.numel():
                raise ValueError(f"{name} has {t.numel()} entries, its CUDA-graph buffer only {buf.numel()}")
            buf[: t.numel()].copy_(t.reshape(-1), non_blocking=True)
            return buf
        return t.to(device=self._device, dtype=torch.int32, non_blocking=True).reshape(-1)

    # -- run ------------------------------------------------------------------------------
    def _check_run(self, q, out, lse, fp8_scales, args, **unsupported):
        if self._plan is None:
            raise RuntimeError("run() before plan()")
        if torch.cuda.is_current_stream_capturing() and not self._use_cuda_graph:
            raise RuntimeError(
                "run() is being captured into a CUDA graph but the wrapper was created with "
                "use_cuda_graph=False; its buffers may move between plans. Create it with "
                "use_cuda_graph=True and fixed *_buf index tensors."
            )
        if args and self._variant is None:
            raise TypeError(
                f"run() got {len(args)} extra positional argument(s): those are the runtime arguments of "
                f"plan(variant=...), and this plan has no variant (custom jit_args kernels are not "
                f"supported)"
            )
        _reject_unsupported(fp8_scales=fp8_scales, extra=tuple(unsupported.items()))
        hq, d, n = self._hq, self._d, self._total_q
        rows_ok = q.dim() == 3 and (q.shape[0] >= n if self._use_cuda_graph else q.shape[0] == n)
        if not rows_ok or q.shape[1:] != (hq, d) or q.dtype != self._dtype or q.device != self._device:
            rows = f">= {n}" if self._use_cuda_graph else f"{n}"
            raise ValueError(
                f"q must be {self._dtype} [{rows} (qo_indptr[-1]), {hq}, {d}] on {self._device}, got "
                f"{q.dtype} {tuple(q.shape)} on {q.device}"
            )
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must be {q.dtype} {tuple(q.shape)} on {q.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        if lse is None:
            lse = torch.empty((q.shape[0], hq), dtype=torch.float32, device=q.device)
        elif lse.shape != (q.shape[0], hq) or lse.dtype != torch.float32 or lse.device != q.device:
            raise ValueError(
                f"lse must be float32 [{q.shape[0]}, {hq}] on {q.device}, got {lse.dtype} "
                f"{tuple(lse.shape)} on {lse.device}"
            )
        return out, lse

    def _check_kv(self, k, v, what):
        if k.dtype != self._dtype or v.dtype != self._dtype or k.device != self._device or v.device != self._device:
            raise ValueError(
                f"{what} must be {self._dtype} on {self._device}, got {k.dtype} / {v.dtype} on {k.device} / {v.device}"
            )

    def _variant_args(self, args, sinks):
        """(module, runtime values of its variant) for this run (see ``VariantBinding``)."""
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or sinks.shape != (self._hq,) or sinks.device != self._device:
                raise ValueError(
                    f"sinks must be a [{self._hq}] tensor on {self._device}, got "
                    f"{tuple(getattr(sinks, 'shape', ()))} on {getattr(sinks, 'device', None)}"
                )
            sinks = sinks.float()
        return self._binding.select(args, sinks)

    def _launch(self, q, k4, v4, kv_indptr, kv_indices, out, lse, args=(), sinks=None):
        """K/V are 4-D views; a cache without any token (so no request has kv) gets o = 0,
        lse = -inf without a kernel (TMA descriptors cannot describe an empty tensor; with
        sinks: lse = the sink)."""
        module, vvals = self._variant_args(args, sinks)
        if q.shape[0] == 0:
            return
        if (self._gathered[0] if self._gathered is not None else k4).numel() == 0:
            out.zero_()
            lse.fill_(-math.inf)
            if sinks is not None:
                lse.copy_((sinks.float() * (1.0 / math.log(2.0)))[None, :].expand_as(lse))
            return
        if self._kv_pass is not None:  # the KV pass: gather the paged cache, and / or transform K
            pass_module, pass_vals = self._kv_pass.select(args if self._kv_pass.variant is not None else ())
            grid = self._num_ctas * _KV_PASS_CTAS_PER_SM
            if self._gathered is not None:  # paged -> contiguous K and V (ragged from here on)
                k_g, v_g = self._gathered
                pass_module(
                    k4,
                    v4,
                    k_g,
                    v_g,
                    self._qo_indptr,
                    self._kv_tok_indptr,
                    kv_indptr,
                    kv_indices,
                    self._batch,
                    self._sm_scale,
                    grid,
                    *pass_vals,
                )
                k4, v4, kv_indptr, kv_indices = k_g, v_g, self._kv_tok_indptr, self._no_indices
            else:  # ragged K through the variant's transform_k, once per key (V and pages unused)
                k_t = torch.empty((1, k4.shape[1], self._hk, self._d), dtype=k4.dtype, device=k4.device)
                pass_module(
                    k4,
                    k4,
                    k_t,
                    k_t,
                    self._qo_indptr,
                    kv_indptr,
                    kv_indptr,
                    kv_indptr,
                    kv_indptr.numel() - 1,
                    self._sm_scale,
                    grid,
                    *pass_vals,
                )
                k4 = k_t
        vw = self._views
        module(
            q,
            k4,
            v4,
            kv_indptr,
            kv_indices,
            out,
            lse,
            vw["work_items"],
            vw["work_indptr"],
            vw["partial_o"],
            vw["partial_lse"],
            self._group,
            self._sm_scale,
            self._soft_cap,
            self._window_left,
            self._num_ctas,
            *vvals,
        )
        if self._use_cuda_graph or self._plan.has_split:
            self._merge(
                vw["partial_o"], vw["partial_lse"], vw["merge_tasks"], vw["meta"], out, lse, self._group, self._num_ctas
            )


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
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
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, jit_args)
        if use_cuda_graph:
            for name, buf in (("qo_indptr_buf", qo_indptr_buf), ("kv_indptr_buf", kv_indptr_buf)):
                if buf is None or not buf.is_cuda or buf.dtype != torch.int32 or buf.dim() != 1:
                    raise ValueError(
                        f"use_cuda_graph=True needs {name} (a 1-D int32 CUDA tensor of batch_size + 1 "
                        f"entries), as in FlashInfer"
                    )
            if kv_indptr_buf.numel() != qo_indptr_buf.numel():
                raise ValueError(
                    f"kv_indptr_buf has {kv_indptr_buf.numel()} entries, qo_indptr_buf "
                    f"{qo_indptr_buf.numel()}: both must be batch_size + 1"
                )
        self._qo_indptr_buf = qo_indptr_buf if use_cuda_graph else None
        self._kv_indptr_buf = kv_indptr_buf if use_cuda_graph else None
        self._mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf

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
        variant=None,
    ) -> None:
        """FlashInfer's arguments.  Index arrays are best passed on the CPU (a CUDA one is read
        back, which synchronizes).  ``fixed_split_size`` (kv tokens): every request's KV is cut
        at multiples of it and nothing else, with a fixed 128-row tile, so a request's output is
        bitwise the same whatever else is batched with it; ``disable_split_kv``: no request is
        split.  ``use_fp16_qk_reduction`` is accepted and ignored (q·k is always fp32);
        ``max_token_per_sequence`` / ``max_sequence_kv`` are cuDNN hints, ignored.

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
        follow the KV in ``run()``)."""
        q_dtype, d = self._check_common(
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
            pos_encoding_mode=pos_encoding_mode,
            variant=variant,
            extra=(
                ("prefix_len_ptr", prefix_len_ptr),
                ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                ("max_item_len_ptr", max_item_len_ptr),
                ("seq_lens", seq_lens),
                ("seq_lens_q", seq_lens_q),
                ("v_indptr", v_indptr),
            ),
        )
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
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=d,
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
        )
        if self._use_cuda_graph:
            # the buffers' unused tail repeats the last offset (empty requests): the key-transform
            # pass walks every entry of the buffer a captured run() was given
            pad = lambda h: np.concatenate([h, np.full(self._qo_indptr_buf.numel() - h.size, h[-1])])  # noqa: E731
            self._qo_indptr = self._to_device(pad(qo_h), self._qo_indptr_buf, "qo_indptr")
            self._kv_indptr = self._to_device(pad(kv_h), self._kv_indptr_buf, "kv_indptr")
        else:  # qo_indptr: only the key-transform pass reads it
            self._qo_indptr = self._to_device(qo_h, None, "qo_indptr") if st["kv_pass"] is not None else None
            self._kv_indptr = self._to_device(kv_indptr, None, "kv_indptr")
        self._kv_indices = _arange(1, self._device)  # the ABI's page-id array: unused for ragged KV
        self._kv_total = int(kv_h[-1])
        self._commit(st)

    begin_forward = plan

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
        enable_pdl=None,
        sinks: Optional[torch.Tensor] = None,
        kv_cache_sf=None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``*args``: the runtime arguments of plan()'s ``variant`` not given to its constructor,
        in declaration order.  ``sinks``: per-head sink logits ``[num_qo_heads]`` (natural
        units; the returned LSE includes them)."""
        out, lse = self._check_run(q, out, lse, (q_scale, k_scale, v_scale, o_scale), args, kv_cache_sf=kv_cache_sf)
        if k.dim() != 3 or k.shape != v.shape:
            raise ValueError(f"k/v must be equal 3-D tensors, got {tuple(k.shape)} / {tuple(v.shape)}")
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        self._check_kv(k, v, "k/v")
        if k.shape[0] < self._kv_total or k.shape[1:] != (self._hk, self._d):
            raise ValueError(
                f"k/v ({self._kv_layout}) must hold {self._kv_total} (kv_indptr[-1]) tokens of "
                f"{self._hk} kv heads x {self._d}, got {tuple(k.shape)} as [tokens, heads, dim]"
            )
        if not self._use_cuda_graph:
            # exactly the planned tokens: a KV block that runs past the last request's end then
            # reads TMA's zero fill, never what lies beyond in the caller's tensor (0 * NaN = NaN)
            k, v = k[: self._kv_total], v[: self._kv_total]
        self._launch(q, k.unsqueeze(0), v.unsqueeze(0), self._kv_indptr, self._kv_indices, out, lse, args, sinks)
        return (out, lse) if return_lse else out

    forward = run

    def run_return_lse(self, q, k, v, *args, **kw):
        return self.run(q, k, v, *args, **dict(kw, return_lse=True))

    def end_forward(self) -> None:
        pass


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
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
    ):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, jit_args)
        bufs = (
            ("qo_indptr_buf", qo_indptr_buf),
            ("paged_kv_indptr_buf", paged_kv_indptr_buf),
            ("paged_kv_indices_buf", paged_kv_indices_buf),
            ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf),
        )
        if use_cuda_graph:
            for name, buf in bufs:
                if buf is None or not buf.is_cuda or buf.dtype != torch.int32 or buf.dim() != 1:
                    raise ValueError(
                        f"use_cuda_graph=True needs {name} (a 1-D int32 CUDA tensor sized for the "
                        f"largest batch), as in FlashInfer"
                    )
            b = qo_indptr_buf.numel() - 1
            if paged_kv_indptr_buf.numel() != b + 1 or paged_kv_last_page_len_buf.numel() != b:
                raise ValueError(
                    f"paged_kv_indptr_buf must have batch_size + 1 = {b + 1} entries and "
                    f"paged_kv_last_page_len_buf batch_size = {b} (qo_indptr_buf has {b + 1})"
                )
        self._qo_indptr_buf, self._indptr_buf, self._indices_buf, self._last_buf = (
            (b for _, b in bufs) if use_cuda_graph else (None,) * 4
        )
        self._mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf

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
        variant=None,
        kv_pass: Optional[bool] = None,
    ) -> None:
        """FlashInfer's arguments (see the ragged wrapper's ``plan``, variants included).
        ``fixed_split_size`` is in pages, as in FlashInfer.

        ``kv_pass`` (cute_attn's own): gather the cache's K and V into contiguous copies in the
        workspace by one memory-bound pass before the kernel (``kernels/kv_pass.py``; RoPE's key
        rotation happens there too), so the kernel reads them by TMA.  ``None`` (default): when
        the model :func:`kv_pass_pays` says so (long queries per key; it needs workspace room
        for both copies past the plan; never in CUDA-graph mode, nor with ``fixed_split_size``,
        whose output must not depend on the rest of the batch); ``True``: always (an error if
        the workspace is too small or in CUDA-graph mode); ``False``: never (the kernel gathers
        each block itself)."""
        q_dtype, d = self._check_common(
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
        indices_t = (
            paged_kv_indices
            if isinstance(paged_kv_indices, torch.Tensor)
            else torch.as_tensor(np.asarray(paged_kv_indices), dtype=torch.int32)
        )
        host_indices = None if indices_t.is_cuda else indices_t
        kv_lens = kv_lens_from_paged(indptr_h, paged_kv_last_page_len, int(page_size), host_indices)
        st = self._plan_common(
            qo_h,
            kv_lens,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=d,
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
        )
        # the largest page id, checked against the cache in run() (the cache is not known here);
        # unknown (-1) when the indices already live on the GPU (reading them back would sync)
        used = int(indptr_h[-1])
        self._max_page = int(host_indices[:used].max()) if host_indices is not None and used else -1
        if self._use_cuda_graph:
            self._to_device(qo_indptr, self._qo_indptr_buf, "qo_indptr")  # FlashInfer's buffers (unused here)
            self._to_device(paged_kv_last_page_len, self._last_buf, "paged_kv_last_page_len")
        self._kv_indptr = self._to_device(paged_kv_indptr, self._indptr_buf, "paged_kv_indptr")
        self._kv_indices = self._to_device(indices_t, self._indices_buf, "paged_kv_indices")
        self._page_size = int(page_size)
        self._kv_tokens = int(kv_lens.sum())
        if st["gather"] is not None:  # the KV pass: token offsets of the gathered K / V, q offsets
            tok = np.concatenate([[0], np.cumsum(st["kv_lens"])]).astype(np.int32)
            self._kv_tok_indptr = self._to_device(tok, None, "kv token indptr")
            self._qo_indptr = self._to_device(qo_h.astype(np.int32), None, "qo_indptr")
            self._no_indices = _arange(1, self._device)
        self._commit(st)

    begin_forward = plan

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
        sinks=None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None,
        use_fp16_softmax=None,
        uses_spcompress=None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``*args``: the runtime arguments of plan()'s ``variant`` not given to its constructor,
        in declaration order.  ``sinks``: per-head sink logits ``[num_qo_heads]`` (natural
        units; the returned LSE includes them)."""
        out, lse = self._check_run(
            q,
            out,
            lse,
            (q_scale, k_scale, v_scale),
            args,
            kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
        )
        if window_left is not None and window_left != self._window_left:
            raise ValueError("run(window_left=...) differs from plan(); pass it to plan()")
        k, v = _kv_views(paged_kv_cache, self._kv_layout)
        self._check_kv(k, v, "paged_kv_cache")
        if k.shape[1:] != (self._page_size, self._hk, self._d):
            raise ValueError(
                f"paged_kv_cache ({self._kv_layout}) has page_size/kv_heads/head_dim "
                f"{tuple(k.shape[1:])}, plan() said ({self._page_size}, {self._hk}, {self._d})"
            )
        if self._max_page >= k.shape[0] or (self._kv_tokens and k.shape[0] == 0):
            raise ValueError(
                f"paged_kv_indices reference page {max(self._max_page, 0)}, the cache has {k.shape[0]} pages"
            )
        self._launch(q, k, v, self._kv_indptr, self._kv_indices, out, lse, args, sinks)
        return (out, lse) if return_lse else out

    forward = run

    def run_return_lse(self, q, paged_kv_cache, *args, **kw):
        return self.run(q, paged_kv_cache, *args, **dict(kw, return_lse=True))

    def end_forward(self) -> None:
        pass


_SINGLE: dict = {}


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
    _reject_unsupported(
        q_dtype=q.dtype,
        kv_dtype=k.dtype,
        o_dtype=_dtype(o_dtype, "o_dtype"),
        fp8_scales=(scale_q, scale_k, scale_v, k_scale, v_scale),
        extra=(("kv_cache_sf", kv_cache_sf),),
    )
    k, v = _single_kv_nhd(q, k, v, kv_layout, 3, "[qo_len, heads, dim]")
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor, got one on {q.device}")
    qo_len, kv_len, hk = q.shape[0], k.shape[0], k.shape[1]
    key = (q.device, q.dtype)
    w = _SINGLE.get(key)
    if w is None:
        w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=q.device))
        w._grow_workspace = True
        _SINGLE[key] = w
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
    out, lse = w.run(q, k, v, *variant_args, return_lse=True, sinks=sinks)
    return (out, lse) if return_lse else out


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
