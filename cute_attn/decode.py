"""Batch decode on a paged KV cache, FlashInfer-compatible: ``BatchDecodeWithPagedKVCacheWrapper``
and ``single_decode_with_kv_cache``.

``plan()`` runs the CPU scheduler (``cute_attn.sched``) and uploads its work lists into the
user's ``float_workspace_buffer`` at fixed offsets; ``run()`` launches the persistent decode
kernel (``kernels/decode.py``) and, when the plan split some KV, the persistent ⊕ merge
kernel.  NHD and HND layouts, ``(k, v)`` tuples and single ``[pages, 2, ...]`` tensors are
all passed to one kernel as strided ``[pages, page_size, kv_heads, head_dim]`` views.

Variants (docs/variants.md): FlashInfer's options map onto built-ins (``logits_soft_cap`` ->
``SoftCap``, ``window_left`` -> ``SlidingWindow``, ``pos_encoding_mode="ALIBI"`` -> ``ALiBi``,
``"ROPE_LLAMA"`` -> ``RoPE``, ``run(sinks=)`` -> ``AttentionSink``); ``plan(variant=...)`` adds
any other variant, whose runtime arguments follow the cache in ``run(q, kv, *args)``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import numpy as np
import torch

from .families.base import variant_params
from .families.decode import CTAS_PER_SM as _CTAS_PER_SM
from .families.decode import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from .families.decode import PACKED_HEADS, SHIPPED_VARIANTS, packing_params
from .families.decode import STAGES as _STAGES
from .families.decode import TILE_Q as DECODE_TILE_Q
from .runtime.arch import arch_of_index, sm_count_of_index
from .runtime.loader import kernel
from .sched import Limits, Planner, kv_lens_from_paged
from .variants import base as vbase
from .variants.binding import VariantBinding
from .variants.builtins import ALiBi, CustomMask, RoPE, SlidingWindow, SoftCap, mask_kv_bounds

# Head packing (h kv heads per work item) is chosen where, with it, the batch still has at
# least this many items per CTA and no item is longer than a CTA's fair share: the items
# then balance whole, and packing only saves item boundaries (fewer epilogues and record
# loads).  Where packing would make the planner cut items instead, it costs more than it
# saves (BENCHMARKS, session 12: lognormal batch of 128 +1.4 %, batch 128 x 2k at h = 4 +3 %).
MIN_PACKED_ITEMS_PER_CTA = 1.9
_SHIPPED_PACKED: Optional[set] = None  # SHIPPED_VARIANTS' spec parameters, made on first use
_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
_packing_params = packing_params


def _packed_kernel_ships(variant) -> bool:
    """Whether the compile presets hold packed kernels of ``variant`` (``SHIPPED_VARIANTS``)."""
    global _SHIPPED_PACKED
    if _SHIPPED_PACKED is None:
        _SHIPPED_PACKED = {tuple(variant_params(v).items()) for v in SHIPPED_VARIANTS}
    return tuple(variant_params(variant).items()) in _SHIPPED_PACKED


def workspace_bytes(buf, device) -> torch.Tensor:
    """A replacement workspace as the wrappers hold it (flat uint8), checked to be on ``device``."""
    if not isinstance(buf, torch.Tensor) or buf.device != device:
        raise ValueError(f"float_workspace_buffer must be a tensor on {device}")
    return buf.view(torch.uint8).reshape(-1)


def _as_dtype(x) -> Optional[torch.dtype]:
    if x is None or isinstance(x, torch.dtype):
        return x
    return getattr(torch, str(x).replace("torch.", ""))


def _kv_views(paged_kv_cache, kv_layout: str):
    """(K, V) as [pages, page_size, kv_heads, head_dim] views of any supported cache form."""
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
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k/v caches must be 4-D and equal in shape, got {tuple(k.shape)} / {tuple(v.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    elif kv_layout != "NHD":
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return k, v


class BatchDecodeWithPagedKVCacheWrapper:
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
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if not isinstance(float_workspace_buffer, torch.Tensor) or not float_workspace_buffer.is_cuda:
            raise ValueError("float_workspace_buffer must be a CUDA tensor")
        self._workspace = float_workspace_buffer.view(torch.uint8).reshape(-1)
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._device = float_workspace_buffer.device
        self._dev = self._device.index if self._device.index is not None else torch.cuda.current_device()
        self._ctas_per_sm = ctas_per_sm  # None: the most that fit for the head dim
        if use_cuda_graph:
            for name, buf in (
                ("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer),
            ):
                if buf is None or not buf.is_cuda or buf.dtype != torch.int32:
                    raise ValueError(
                        f"use_cuda_graph=True needs {name} (an int32 CUDA tensor sized for the "
                        "largest batch), as in FlashInfer"
                    )
        self._indptr_buf = paged_kv_indptr_buffer
        self._indices_buf = paged_kv_indices_buffer
        self._planner: Optional[Planner] = None
        self._views = None
        self._plan = None
        self._hpi = 1  # kv heads per work item of the current plan
        self._graph_hpi = None  # CUDA-graph mode: the first plan's, kept (the captured kernel's)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Use another workspace from the next ``plan()`` on (FlashInfer's method; the int
        workspace is not used: the plan lives in the float one)."""
        self._workspace = workspace_bytes(float_workspace_buffer, self._device)
        self._views = self._plan = None
        self._graph_hpi = None  # graphs captured on the old workspace are void: capture again

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        q_data_type="float16",
        kv_data_type=None,
        data_type=None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        o_data_type=None,
        block_tables: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        variant=None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        heads_per_item: Optional[int] = None,
    ) -> None:
        """FlashInfer's arguments.  ``fixed_split_size`` (in pages, as FlashInfer): every request's
        KV is cut at multiples of it and nothing else, so a request's output is bitwise the same
        whatever else is in the batch.  ``disable_split_kv``: no request is split (one work item
        per request and kv head).

        Variants: ``pos_encoding_mode`` ``"ALIBI"`` (slopes from the head count, as FlashInfer's
        ``get_alibi_slopes``) or ``"ROPE_LLAMA"`` (``rope_scale`` default 1, ``rope_theta``
        default 1e4; the query sits at position ``kv_len - 1``, key ``j`` at ``j``), soft-cap,
        window, and (extensions: FlashInfer's decode has none of them) ``custom_mask`` (flat
        bool, concatenated ``[1, kv_len]`` rows) or ``packed_custom_mask`` (its bits, packed
        per request as FlashInfer's prefill) and ``variant`` (any ``cute_attn.variants.Variant``,
        applied after the built-ins).

        ``heads_per_item`` (an extension): kv heads per work item, 1, 2 or 4 (head packing,
        ``kernels/decode.py``; more than 1 only for softmax variants without query/key
        transforms -- not RoPE -- and with ``heads_per_item * group <= 16``).  Default: 4 or 2
        where the batch keeps ``MIN_PACKED_ITEMS_PER_CTA`` items per CTA with it and no packed
        item exceeds a CTA's share, for the plain kernel, soft-cap and window (the kernels the
        presets ship), else 1; 1 with ``fixed_split_size`` / ``disable_split_kv`` (packing
        changes the summation order).  With ``use_cuda_graph=True`` the first plan's choice
        holds for every later plan, ``fixed_split_size`` ones included (the captured launch
        keeps its kernel): give the first plan ``heads_per_item=1`` for outputs bitwise equal
        to an eager wrapper's in batch-invariant mode."""
        if pos_encoding_mode not in ("NONE", "ALIBI", "ROPE_LLAMA"):
            raise ValueError(f"pos_encoding_mode must be NONE, ROPE_LLAMA or ALIBI, got {pos_encoding_mode!r}")
        if variant is not None and not isinstance(variant, vbase.Variant):
            raise TypeError(f"variant must be a cute_attn.variants.Variant, got {type(variant).__name__}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        q_dtype = _as_dtype(data_type) or _as_dtype(q_data_type)
        kv_dtype = _as_dtype(kv_data_type) or q_dtype
        if q_dtype not in _DTYPES or kv_dtype != q_dtype:
            raise ValueError(f"q/kv dtypes must be one of float16/bfloat16 and equal, got {q_dtype} / {kv_dtype}")
        if _as_dtype(o_data_type) not in (None, q_dtype):
            raise NotImplementedError(f"o_data_type must equal the q dtype ({q_dtype}), got {o_data_type}")
        if block_tables is not None or seq_lens is not None:
            raise NotImplementedError(
                "block_tables / seq_lens (the trtllm-gen backend's inputs) are not supported; "
                "pass indptr / indices / last_page_len"
            )
        if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or fixed_split_size < 1):
            raise ValueError(f"fixed_split_size must be a positive number of pages, got {fixed_split_size!r}")
        if window_left is None or window_left < -1:
            raise ValueError(f"window_left must be >= -1, got {window_left}")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("plan() must not be captured in a CUDA graph; call it before replaying")

        indptr_h = np.asarray(indptr.cpu() if isinstance(indptr, torch.Tensor) else indptr, dtype=np.int64)
        batch = indptr_h.shape[0] - 1
        if batch < 0:
            raise ValueError("indptr must have at least one element")
        indices_t = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices, dtype=torch.int32)
        # kv lengths, checked, once per plan: the planner, the packing rule and a custom mask use them
        kv_lens = kv_lens_from_paged(
            indptr_h, last_page_len, page_size, kv_indices=indices_t.cpu() if not indices_t.is_cuda else None
        )
        parts = []
        if pos_encoding_mode == "ROPE_LLAMA":
            parts.append(
                RoPE(
                    rope_scale=1.0 if rope_scale is None else float(rope_scale),
                    rope_theta=1e4 if rope_theta is None else float(rope_theta),
                )
            )
        elif pos_encoding_mode == "ALIBI":
            parts.append(ALiBi())
        if logits_soft_cap:
            parts.append(SoftCap(logits_soft_cap=float(logits_soft_cap)))
        if window_left >= 0:
            parts.append(SlidingWindow(window_left=int(window_left)))
        if custom_mask is not None or packed_custom_mask is not None:
            parts.append(self._custom_mask(custom_mask, packed_custom_mask, kv_lens))
        parts.extend(vbase.components(variant))
        self._variant = parts[0] if len(parts) == 1 else (vbase.Compose(*parts) if parts else None)
        hooks = vbase.Hooks(self._variant)
        if hooks.has_output:
            disable_split_kv = True  # an output transform must see the whole row (not a partial state)
        per_sm = self._ctas_per_sm or _CTAS_PER_SM[head_dim]
        num_ctas = sm_count_of_index(self._dev) * per_sm
        limits = self._limits(batch, num_qo_heads, num_kv_heads, head_dim, num_ctas)
        if self._planner is None or self._planner.limits != limits or self._planner.num_ctas != num_ctas:
            # alpha: a work item costs the decode kernel a pipeline fill + an epilogue, worth about
            # 128 kv tokens (alpha * tile 16); with the default (32 tokens) the planner preferred
            # plans of many short items that ran 17 % slower on the H200 (lognormal batch of 128).
            # balance_tol: decode is bandwidth-bound, so even a few % of imbalance is worth a split.
            self._planner = Planner(limits, sm_count_of_index(self._dev), per_sm, alpha=8, balance_tol=0.01)
            self._views = None
        self._num_ctas = self._planner.num_ctas
        need = self._planner.layout.total_bytes
        if self._workspace.numel() < need:
            raise ValueError(
                f"float_workspace_buffer has {self._workspace.numel()} bytes; this plan needs {need} "
                f"(batch {batch}, {num_qo_heads} qo heads, head_dim {head_dim})"
            )
        if self._views is None:  # section offsets are fixed per planner: views made once
            self._views = self._planner.layout.views(self._workspace)
        split_tokens = self._split_tokens(fixed_split_size, disable_split_kv, page_size)
        hpi = self._heads_per_item(
            heads_per_item, kv_lens, num_qo_heads, num_kv_heads, num_ctas, split_tokens is not None, hooks.packs_heads
        )
        plan = self._planner.plan(
            np.arange(batch + 1),
            kv_lens,
            page_size=int(page_size),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            cta_tile_q=DECODE_TILE_Q,
            kv_split_size=split_tokens,
            heads_per_item=hpi,
            workspace=self._workspace,
        )
        self._hpi = hpi
        # the largest page id, checked against the cache in run() (the cache is not known here);
        # unknown (-1) when the indices already live on the GPU (reading them back would sync)
        self._max_page = int(indices_t.max()) if not indices_t.is_cuda and indices_t.numel() else -1
        self._kv_indptr = self._to_device(indptr, self._indptr_buf, "indptr")
        self._kv_indices = self._to_device(indices_t, self._indices_buf, "indices")
        self._plan = plan
        if self._use_cuda_graph and self._graph_hpi is None:
            self._graph_hpi = hpi  # once the plan is in place (a plan that failed fixes nothing)
        self._page_size = int(page_size)
        self._batch, self._hq, self._hk, self._d = batch, num_qo_heads, num_kv_heads, head_dim
        self._dtype = q_dtype
        self._sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self._soft_cap = float(logits_soft_cap) if logits_soft_cap else 0.0
        self._window_left = int(window_left)
        arch = arch_of_index(self._dev)
        dt = _DTYPES[q_dtype]
        self._arch = arch
        self._decode = self._module(self._variant)
        self._merge = kernel("merge_partials", arch, dtype=dt, head_dim=head_dim, tile_q=DECODE_TILE_Q)
        self._binding = VariantBinding(
            self._variant,
            {
                "num_qo_heads": num_qo_heads,
                "num_kv_heads": num_kv_heads,
                "head_dim": head_dim,
                "sm_scale": self._sm_scale,
                "device": self._device,
                "batch": batch,
            },
            self._decode,
            self._module,
        )

    def _module(self, v):
        return kernel(
            "paged_decode",
            self._arch,
            dtype=_DTYPES[self._dtype],
            head_dim=self._d,
            stages=_STAGES[self._d],
            **_packing_params(self._hpi),
            **variant_params(v),
        )

    def _heads_per_item(self, want, kv_lens, hq, hk, num_ctas, invariant, packable) -> int:
        """kv heads per work item for this plan (``plan()``'s ``heads_per_item``; the default
        rule: ``MIN_PACKED_ITEMS_PER_CTA``).  ``packable``: the variant's ``Hooks.packs_heads``."""
        group, batch = hq // hk, kv_lens.shape[0]

        def why_not(h):
            if not isinstance(h, int) or h not in (1,) + PACKED_HEADS:
                return f"must be one of {(1,) + PACKED_HEADS}"
            if h > 1 and not packable:
                return "head packing needs a softmax variant without query/key transforms (RoPE has them)"
            if hk % h or h * group > DECODE_TILE_Q:
                return f"needs num_kv_heads ({hk}) % h == 0 and h * group ({group}) <= {DECODE_TILE_Q}"
            return None

        fixed = self._graph_hpi if self._use_cuda_graph else None
        if want is not None:
            want = int(want) if isinstance(want, (int, np.integer)) else want
        elif fixed is not None:
            want = fixed
        elif invariant:
            want = 1
        else:
            cands = [
                h
                for h in PACKED_HEADS
                if batch * (hk // h) >= MIN_PACKED_ITEMS_PER_CTA * num_ctas and why_not(h) is None
            ]
            want = 1
            # only where the kernel ships in the compile presets (plain, soft-cap, window), and no
            # packed item longer than one CTA's fair share (in head-tokens)
            if cands and _packed_kernel_ships(self._variant):
                share, longest = hk * int(kv_lens.sum()) / num_ctas, int(kv_lens.max())
                want = next((h for h in cands if h * longest <= share), 1)
        if fixed is not None and want != fixed:
            raise ValueError(
                f"heads_per_item={want}: with use_cuda_graph=True the first plan fixed it at {fixed} "
                "(the captured run() keeps that kernel)"
            )
        err = why_not(want)
        if err:
            how = (
                (
                    f" (use_cuda_graph=True: the first plan fixed heads_per_item={fixed}; pass heads_per_item=1 to "
                    "the first plan of a wrapper whose later plans change the variant)"
                )
                if fixed is not None
                else ""
            )
            raise ValueError(f"heads_per_item={want}: {err}{how}")
        return want

    def _custom_mask(self, custom_mask, packed, kv_lens) -> CustomMask:
        """FlashInfer's mask conventions: per request a row-major ``[qo_len, kv_len]`` bool block,
        bit-packed per request (little bit order), ``mask_indptr`` = byte offset per request."""
        nbytes = (kv_lens + 7) // 8
        mask_indptr = np.concatenate([[0], np.cumsum(nbytes)]).astype(np.int32)
        if packed is None:
            flat = custom_mask.reshape(-1).to(device="cpu", dtype=torch.bool).numpy()
            if flat.size != kv_lens.sum():
                raise ValueError(f"custom_mask has {flat.size} entries, expected sum(kv_len) = {kv_lens.sum()}")
            offs = np.concatenate([[0], np.cumsum(kv_lens)])
            packed_np = np.concatenate(
                [np.packbits(flat[offs[b] : offs[b + 1]], bitorder="little") for b in range(len(kv_lens))]
                + [np.zeros(1, np.uint8)]
            )
            packed = torch.from_numpy(packed_np)
        packed = packed.reshape(-1).to(torch.uint8)
        batch, n = len(kv_lens), packed.numel()
        ones = np.ones(batch, dtype=np.int64)  # one query row per request
        index = dict(mask_indptr=torch.from_numpy(mask_indptr), qo_indptr=torch.arange(batch + 1, dtype=torch.int32))
        if not self._use_cuda_graph:
            words = CustomMask.words(packed, device=self._device)
            return CustomMask(
                packed_custom_mask=words,
                kv_bounds=mask_kv_bounds(words.view(torch.uint8)[:n], mask_indptr, ones, kv_lens),
                **{k: t.to(self._device, non_blocking=True) for k, t in index.items()},
            )
        # a captured run() keeps the tensors of the plan it was captured with: later plans write
        # theirs into the same buffers, sized by the first plan (an extension: FlashInfer's decode
        # has no custom mask, hence no user buffers for it)
        sizes = dict(packed_custom_mask=n // 4 + 1, kv_bounds=max(batch, 1), **{k: t.numel() for k, t in index.items()})
        bufs = getattr(self, "_mask_bufs", None)
        if bufs is None:
            bufs = self._mask_bufs = {
                k: torch.zeros((m, 2) if k == "kv_bounds" else m, dtype=torch.int32, device=self._device)
                for k, m in sizes.items()
            }
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
            return 1 << 30  # longer than any request: nothing is cut
        return None if fixed_split_size is None else fixed_split_size * int(page_size)

    def _limits(self, batch, hq, hk, d, num_ctas) -> Limits:
        max_batch = batch
        if self._use_cuda_graph:  # fixed by the buffers, so the workspace offsets never move
            max_batch = self._indptr_buf.numel() - 1
            if batch > max_batch:
                raise ValueError(f"batch {batch} exceeds paged_kv_indptr_buffer capacity {max_batch}")
        elif self._planner is not None:
            max_batch = max(batch, self._planner.limits.max_batch)
        # Partial slots: DECODE_TILE_Q rows each, 8 per CTA is ample for split-KV decode (the
        # default sizing is for 128-row prefill tiles and would need 4x the workspace).
        return Limits(
            max_batch=max(max_batch, 1),
            max_total_q_tokens=max(max_batch, 1),
            num_qo_heads=hq,
            num_kv_heads=hk,
            head_dim=d,
            max_qo_len=1,
            max_partial_rows=8 * num_ctas * DECODE_TILE_Q,
        )

    def _to_device(self, t, buf, name):
        t = t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
        if buf is not None:
            if t.numel() > buf.numel():
                raise ValueError(f"{name} has {t.numel()} entries, its CUDA-graph buffer only {buf.numel()}")
            buf[: t.numel()].copy_(t.reshape(-1), non_blocking=True)
            return buf
        return t.to(device=self._device, dtype=torch.int32, non_blocking=True).reshape(-1)

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
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``*args``: the runtime arguments of plan()'s ``variant`` not given to its constructor,
        in declaration order.  ``sinks``: per-head sink logits ``[num_qo_heads]`` (FlashInfer's
        attention-sink argument; natural units; the returned LSE includes them)."""
        if self._plan is None:
            raise RuntimeError("run() before plan()")
        if torch.cuda.is_current_stream_capturing() and not self._use_cuda_graph:
            raise RuntimeError(
                "run() is being captured into a CUDA graph but the wrapper was created with "
                "use_cuda_graph=False; its buffers may move between plans. Create it with "
                "use_cuda_graph=True and fixed paged_kv_*_buffer tensors."
            )
        if window_left is not None and window_left != self._window_left:
            raise ValueError("run(window_left=...) differs from plan(); pass it to plan()")
        if q_scale is not None or k_scale is not None or v_scale is not None:
            raise NotImplementedError("q_scale/k_scale/v_scale (fp8) are not supported yet")
        k, v = _kv_views(paged_kv_cache, self._kv_layout)
        b, hq, hk, d = self._batch, self._hq, self._hk, self._d
        # CUDA-graph mode: q may hold more rows than this plan's batch (captured at the largest
        # batch, as the prefill wrappers allow); rows past the batch are neither read nor written
        rows_ok = q.dim() == 3 and (q.shape[0] >= b if self._use_cuda_graph else q.shape[0] == b)
        if not rows_ok or q.shape[1:] != (hq, d) or q.dtype != self._dtype or q.device != self._device:
            rows = f">= {b}" if self._use_cuda_graph else f"{b}"
            raise ValueError(
                f"q must be {self._dtype} [{rows}, {hq}, {d}] on {self._device}, got {q.dtype} "
                f"{tuple(q.shape)} on {q.device}"
            )
        if k.dtype != q.dtype or k.device != q.device:
            raise ValueError(f"paged_kv_cache must be {q.dtype} on {q.device}, got {k.dtype} on {k.device}")
        if k.shape[1] != self._page_size or k.shape[2] != hk or k.shape[3] != d:
            raise ValueError(
                f"paged_kv_cache ({self._kv_layout}) has page_size/kv_heads/head_dim "
                f"{tuple(k.shape[1:])}, plan() said ({self._page_size}, {hk}, {d})"
            )
        if self._max_page >= k.shape[0]:
            raise ValueError(f"kv indices reference page {self._max_page}, the cache has {k.shape[0]} pages")
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
        if lse is None:
            lse = torch.empty((q.shape[0], hq), dtype=torch.float32, device=q.device)
        elif lse.shape != (q.shape[0], hq) or lse.dtype != torch.float32:
            raise ValueError(f"lse must be float32 [{q.shape[0]}, {hq}], got {lse.dtype} {tuple(lse.shape)}")
        if b:
            vw = self._views
            group = self._plan.group_size  # packed rows per token and kv head (group) of the plan
            if sinks is not None and (sinks.shape != (hq,) or sinks.device != q.device):
                raise ValueError(f"sinks must be [{hq}] on {q.device}, got {tuple(sinks.shape)} on {sinks.device}")
            module, vvals = self._binding.select(args, None if sinks is None else sinks.float())
            if vvals:
                module(
                    q,
                    k,
                    v,
                    self._kv_indptr,
                    self._kv_indices,
                    out,
                    lse,
                    vw["work_items"],
                    vw["work_indptr"],
                    vw["partial_o"],
                    vw["partial_lse"],
                    group,
                    self._sm_scale,
                    self._num_ctas,
                    *vvals,
                )
            else:
                module(
                    q,
                    k,
                    v,
                    self._kv_indptr,
                    self._kv_indices,
                    out,
                    lse,
                    vw["work_items"],
                    vw["work_indptr"],
                    vw["partial_o"],
                    vw["partial_lse"],
                    group,
                    self._sm_scale,
                    self._num_ctas,
                )
            if self._use_cuda_graph or self._plan.has_split:
                self._merge(
                    vw["partial_o"], vw["partial_lse"], vw["merge_tasks"], vw["meta"], out, lse, group, self._num_ctas
                )
        return (out, lse) if return_lse else out

    forward = run


_SINGLE: dict = {}
_ARANGE: dict = {}


def _arange(n: int, device) -> torch.Tensor:
    """0..n-1 as int32 on ``device``, from one cached (grown by doubling) tensor."""
    t = _ARANGE.get(device)
    if t is None or t.numel() < n:
        t = _ARANGE[device] = torch.arange(
            max(n, 2 * (t.numel() if t is not None else 4096)), dtype=torch.int32, device=device
        )
    return t[:n]


def _single_kv_nhd(q, k, v, kv_layout, q_dim, q_shape):
    """The single-request functions' shape and layout checks; k / v as [kv_len, heads, dim] views."""
    if q.dim() != q_dim or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"q must be {q_shape} and k/v equal 3-D tensors, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return (k.transpose(0, 1), v.transpose(0, 1)) if kv_layout == "HND" else (k, v)


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
    k, v = _single_kv_nhd(q, k, v, kv_layout, 2, "[heads, dim]")
    kv_len, hk = k.shape[0], k.shape[1]
    if kv_len == 0:
        o = torch.zeros_like(q)
        s = torch.full((q.shape[0],), -float("inf"), device=q.device)
        return (o, s) if return_lse else o
    key = (q.device, q.dtype)
    w = _SINGLE.get(key)
    if w is None:
        w = _SINGLE[key] = BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=q.device), kv_layout="NHD"
        )
    w.plan(
        torch.tensor([0, kv_len], dtype=torch.int32),
        _arange(kv_len, q.device),
        torch.tensor([1], dtype=torch.int32),
        q.shape[0],
        hk,
        q.shape[1],
        1,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=q.dtype,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        variant=variant,
    )
    out, lse = w.run(q.unsqueeze(0), (k.unsqueeze(1), v.unsqueeze(1)), return_lse=True, sinks=sinks)
    return (out[0], lse[0]) if return_lse else out[0]
