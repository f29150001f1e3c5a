"""The decode wrapper's FlashInfer surface beyond plan() / run(), as vLLM's and SGLang's
FlashInfer backends use it (``build/dev/engine_calls.md``; FlashInfer 0.7.2): the private
attributes they read, ``forward`` / ``forward_return_lse`` / ``run_return_lse``,
``workspace_size``, re-plans of new lengths (``fast_decode_plan``, vLLM's
``_cached_module.plan``: ``_replan_fast`` -> ``_replan_lengths``, the one planner call to swap
for a faster planner) and plans of several query tokens per request (``q_len_per_req`` > 1, on
the paged prefill kernel).  A mixin of ``BatchDecodeWithPagedKVCacheWrapper``."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import numpy as np
import torch

from ..abi.kept import KS_BAD_LENGTHS, KS_UNBALANCED
from ..families.backends import backend_for
from ..families.base import variant_params
from ..families.decode import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from ..families.decode import decode_spec, decode_tile
from ..families.prefill import HEAD_DIMS as PREFILL_HEAD_DIMS
from ..runtime.arch import arch_of_index, sm_count_of_index
from ..sched import WorkspaceLayout, kv_lens_from_paged
from ..sched.inputs import as_index_array, check_indptr, paged_lengths_valid, step_kv_lens
from ..variants.binding import VariantBinding
from . import common, compat, guards
from .decode_packing import decodes_on_prefill, kv_row_bytes
from .options import decode_variant


def _replaced(st, **changes):
    """``dataclasses.replace`` of a plan state without its per-field ``__init__`` (a re-plan
    swaps a dozen of the state's fields every engine step; the state has no ``__post_init__``
    to run): a new record, the old one untouched."""
    new = object.__new__(type(st))
    new.__dict__.update(st.__dict__)
    new.__dict__.update(changes)
    return new


class DecodeEngineAPI:
    """FlashInfer's decode-wrapper surface the engines use (see the module doc)."""

    # ---- FlashInfer's attributes the engines read -------------------------------------------
    @property
    def use_tensor_cores(self) -> bool:
        """As given to the constructor (cute_attn has one decode kernel; read-only)."""
        return self._use_tensor_cores_arg

    @property
    def _use_tensor_cores(self) -> bool:
        return self._use_tensor_cores_arg

    @property
    def _backend(self) -> str:
        """FlashInfer's resolved backend name: "auto" resolves to "fa2" at the first plan()
        (vLLM's fast path passes fa2's trailing arguments to ``_cached_module.plan``)."""
        if self._backend_arg == "auto" and self._state is None and self._cached is None:
            return "auto"
        return "fa2" if self._backend_arg == "auto" else self._backend_arg

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def _fixed_batch_size(self) -> int:
        return self._fixed_bs

    @property
    def _float_workspace_buffer(self) -> torch.Tensor:
        return self._float_ws_arg

    @property
    def _int_workspace_buffer(self) -> torch.Tensor:
        """FlashInfer's int workspace: unused (the plan's records live in a buffer of the wrapper's own)."""
        if self._int_ws is None:
            self._int_ws = torch.empty(0, dtype=torch.uint8, device=self._device)
        return self._int_ws

    @property
    def _pin_memory_int_workspace_buffer(self) -> torch.Tensor:
        if self._pinned_ws is None:
            self._pinned_ws = torch.empty(0, dtype=torch.uint8)
        return self._pinned_ws

    @property
    def _paged_kv_indptr_buf(self):
        if self._use_cuda_graph:
            return self._indptr_buf
        return None if self._state is None else self._state.kv_indptr

    @property
    def _paged_kv_indices_buf(self):
        if self._use_cuda_graph:
            return self._indices_buf
        return None if self._state is None else self._state.kv_indices

    @property
    def _paged_kv_last_page_len_buf(self):
        return self._last_buf if self._use_cuda_graph else getattr(self, "_last_dev", None)

    @property
    def _qo_indptr_buf(self):
        if self._routed:
            return self._mt._qo_indptr_buf if self._use_cuda_graph else self._mt._qo_indptr_dev
        return None

    @property
    def _q_len_per_req(self) -> int:
        return self._q_len

    @property
    def _cached_module(self):
        """FlashInfer's planned module as vLLM's fast decode path calls it (``compat.CachedModule``);
        None before the first plan()."""
        return self._cached

    @property
    def _sm_scale(self):
        return self._require_plan().sm_scale

    @_sm_scale.setter
    def _sm_scale(self, value) -> None:
        """vLLM's fast path (and FlashInfer's fast_decode_plan) set the run's scalars on the
        wrapper: they take effect for later runs (None: 1/sqrt(head_dim))."""
        st = self._require_plan()
        self._set_options(st, sm=guards.launch_sm_scale(value, st.head_dim))

    def _set_options(self, st, window=None, cap=None, sm=None) -> None:
        """Later runs with this window / soft-cap / softmax scale: the plan's kernel (the values
        are launch scalars or runtime values), else a ValueError (another kernel: call plan())."""
        if self._routed:
            raise ValueError("a plan on the prefill kernel (q_len_per_req > 1, head dim 96) sets its options in plan()")
        window = st.window_left if window is None else window
        cap = st.logits_soft_cap if cap is None else cap
        sm = st.sm_scale if sm is None else sm
        if (window, cap, sm) == (st.window_left, st.logits_soft_cap, st.sm_scale):
            return
        var, binding = self._same_kernel_binding(st, window, cap, sm)
        self._state = replace(st, window_left=window, logits_soft_cap=cap, sm_scale=sm, variant=var, binding=binding)

    def _same_kernel_binding(self, st, window, cap, sm):
        """(variant, VariantBinding) for these values on the plan's kernel; ValueError when they
        need another kernel (a window or soft-cap turned on or off)."""
        if self._use_cuda_graph and self._captured_rows is not None:
            raise ValueError(
                "use_cuda_graph=True: a captured run() bakes the window / soft-cap / softmax scale of the plan it "
                "was captured with; changing them would be ignored by the replay. Keep them fixed or use another "
                "wrapper."
            )
        var, module = self._run_variant(st, window, cap)
        if module is not st.decode:
            raise ValueError(
                "the plan's kernel cannot serve this window_left / logits_soft_cap (it turns a window or "
                "soft-cap on or off); call plan()"
            )
        info = dict(st.binding.info, sm_scale=sm)
        return var, VariantBinding(var, info, st.decode, st.options["load"])

    @property
    def _window_left(self) -> int:
        return -1 if self._state is None else self._state.window_left

    @_window_left.setter
    def _window_left(self, value) -> None:
        st = self._require_plan()
        common.check_window_left(value)
        self._set_options(st, window=int(value))

    @property
    def _logits_soft_cap(self) -> float:
        return 0.0 if self._state is None else self._state.logits_soft_cap

    @_logits_soft_cap.setter
    def _logits_soft_cap(self, value) -> None:
        st = self._require_plan()
        guards.check_soft_cap(value)
        self._set_options(st, cap=float(value or 0.0))

    @property
    def _batch_size(self):
        return None if self._state is None else self._state.batch

    @property
    def _num_qo_heads(self):
        return None if self._state is None else self._state.hq

    @property
    def _num_kv_heads(self):
        return None if self._state is None else self._state.hk

    @property
    def _cached_q_data_type(self):
        return self.dtype

    @property
    def _cached_kv_data_type(self):
        return self.dtype if self._state is None or self._routed else self._state.kv_dtype

    _cached_o_data_type = _cached_q_data_type

    @property
    def _pos_encoding_mode(self) -> str:
        return "NONE" if self._state is None else self._state.options["pos_encoding_mode"]

    @_pos_encoding_mode.setter
    def _pos_encoding_mode(self, value) -> None:
        if value != self._pos_encoding_mode:
            raise ValueError(f"_pos_encoding_mode={value!r}: the plan's is {self._pos_encoding_mode!r}; call plan()")

    @property
    def _rope_scale(self):
        return None if self._state is None else self._state.options["rope_scale"]

    @_rope_scale.setter
    def _rope_scale(self, value) -> None:
        if self._pos_encoding_mode == "ROPE_LLAMA" and value != self._rope_scale:
            raise ValueError("_rope_scale differs from the plan's; call plan()")

    @property
    def _rope_theta(self):
        return None if self._state is None else self._state.options["rope_theta"]

    @_rope_theta.setter
    def _rope_theta(self, value) -> None:
        if self._pos_encoding_mode == "ROPE_LLAMA" and value != self._rope_theta:
            raise ValueError("_rope_theta differs from the plan's; call plan()")

    # ---- re-plans of new lengths (fast_decode_plan, vLLM's _cached_module.plan) -----------------
    def _replan_fast(
        self,
        indptr_host,
        kv_lens,
        batch,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        window_left=None,
        logits_soft_cap=None,
        sm_scale=None,
        fixed_split_size=None,
        disable_split_kv=False,
        q_len_per_req=1,
        indptr=None,
        indices=None,
        last_page_len=None,
    ) -> None:
        """A re-plan with the first plan's kernels, dtypes and options and new lengths (host
        arrays: no device synchronization).  The index arrays on the device are the CUDA-graph
        buffers (the caller wrote them) or ``indptr`` / ``indices`` as given (eager mode)."""
        st = self._state
        if st is None and self._mt is None:
            raise RuntimeError("fast_decode_plan / _cached_module.plan need a prior plan()")
        common.check_plan_not_captured()
        if q_len_per_req != self._q_len:
            raise ValueError(
                f"q_len_per_req={q_len_per_req}: the first plan() planned {self._q_len} (a fast re-plan keeps "
                "its kernels); call plan()"
            )
        if self._use_cuda_graph:
            if batch != self._fixed_bs:
                raise ValueError(
                    f"the batch size is fixed in CUDA-graph mode: got {batch}, the buffers hold {self._fixed_bs}"
                )
            if indices is not None and len(indices) > self._indices_buf.numel():
                raise ValueError(
                    f"indices has {len(indices)} entries, paged_kv_indices_buffer only {self._indices_buf.numel()}"
                )
        if self._routed:
            return self._replan_multi(indptr_host, kv_lens, batch, page_size, fixed_split_size, disable_split_kv,
                                      indices)  # fmt: skip
        if (num_qo_heads, num_kv_heads, head_dim, page_size) != (st.hq, st.hk, st.head_dim, st.page_size):
            raise ValueError(
                f"a fast re-plan keeps the first plan's heads / head_dim / page_size "
                f"({st.hq}, {st.hk}, {st.head_dim}, {st.page_size}), got "
                f"({num_qo_heads}, {num_kv_heads}, {head_dim}, {page_size}); call plan()"
            )
        if st.options["custom_mask"] is not None:
            raise ValueError("a plan with a custom mask cannot be re-planned fast (the mask follows the lengths)")
        kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
        if kv_lens.shape[0] != batch or (kv_lens < 0).any():
            raise ValueError(f"kv lengths must be {batch} non-negative entries, got {kv_lens.shape[0]}")
        fixed_split_size = compat.split_size(fixed_split_size)
        window_arg = -1 if window_left is None else window_left
        common.check_plan_scalars(window_arg, logits_soft_cap, fixed_split_size, "pages")
        binding, var, window, cap = st.binding, st.variant, st.window_left, st.logits_soft_cap
        sm = st.sm_scale if sm_scale is None else guards.launch_sm_scale(sm_scale, st.head_dim)
        if window_left is not None:
            window = int(window_left)
        if logits_soft_cap is not None:
            cap = float(logits_soft_cap or 0.0)
        if (window, cap, sm) != (st.window_left, st.logits_soft_cap, st.sm_scale):
            var, binding = self._same_kernel_binding(st, window, cap, sm)
        split_tokens = self._split_tokens(fixed_split_size, disable_split_kv, page_size)
        self._step_split = split_tokens
        plan = self._replan_lengths(kv_lens, batch, split_tokens, st)
        if self._use_cuda_graph:
            kv_indptr, kv_indices = self._indptr_buf, self._indices_buf
        else:
            kv_indptr = common.to_device(indptr if indptr is not None else indptr_host, None, "indptr", self._device)
            kv_indices = st.kv_indices if indices is None else common.to_device(indices, None, "indices", self._device)
            self._last_dev = last_page_len
        if binding.info.get("batch") != batch:
            binding = VariantBinding(var, dict(binding.info, batch=batch), st.decode, st.options["load"])
        self._state = _replaced(
            st,
            plan=plan,
            batch=batch,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            max_page=-1,
            sm_scale=sm,
            window_left=window,
            logits_soft_cap=cap,
            variant=var,
            binding=binding,
            kv_lens=kv_lens,
        )

    def _replan_step(self, indptr_host, indices, last_page_len, page_size: int) -> None:
        """``fast_decode_plan``'s per-step path (its doc): new lengths, nothing else."""
        n = indices.shape[0] if isinstance(indices, torch.Tensor) else 0 if indices is None else len(indices)
        if n > self._indices_buf.numel():
            raise ValueError(f"indices has {n} entries, paged_kv_indices_buffer only {self._indices_buf.numel()}")
        if self._device_step() and paged_lengths_valid(indptr_host, last_page_len, page_size, self._fixed_bs):
            return
        self._step_lengths(*step_kv_lens(indptr_host, last_page_len, page_size, self._fixed_bs))

    def _device_step(self) -> bool:
        """Whether this step's re-plan can be left to the device (``kept_device``): a kept plan
        is on the device and its last update found it balanced.  The caller then checks the
        step's host arrays (a failed check takes the host path, which names the error) and
        returns: nothing else is done on the host."""
        dk = self._dev_keep
        if dk is None or not dk.on or self._routed or self._step_split is not None:
            return False
        status = dk.status()
        if status & KS_BAD_LENGTHS:
            dk.off()  # the host path re-plans (and names the error if the host arrays hold it)
            raise ValueError(
                "an earlier step's kv_indptr / kv_last_page_len buffers on the device held an invalid "
                "length (pages < 0, or a last page outside [1, page_size]); it was read as 0"
            )
        if status & KS_UNBALANCED:
            self._step_keep = False  # the host path plans anew
            return False
        common.check_plan_not_captured()
        dk.pending = True
        return True

    def _step_lengths(self, kv_lens, upper) -> None:
        """A per-step re-plan of a CUDA-graph wrapper (``fast_decode_plan``'s and
        ``_cached_module.plan``'s): the last plan's kernels and options, new kv lengths (host
        int64, non-negative; ``upper``: a bound on them, or None)."""
        common.check_plan_not_captured()
        if kv_lens.shape[0] != self._fixed_bs:
            raise ValueError(
                f"the batch size is fixed in CUDA-graph mode: got {kv_lens.shape[0]}, the buffers hold {self._fixed_bs}"
            )
        st = self._state
        keep, self._step_keep = self._step_keep, True
        plan = self._replan_lengths(kv_lens, st.batch, self._step_split, st, upper, keep)
        self._state = _replaced(st, plan=plan, kv_lens=kv_lens)
        self._step = (self._step[0], self._state)

    def _replan_lengths(self, kv_lens, batch, split_tokens, st, upper=None, keep=True):
        """THE planner call of a fast re-plan (``fast_decode_plan``, ``_cached_module.plan``):
        new kv lengths (host int64 ``[batch]``; ``upper``: a bound on them, or None), the
        current plan's heads, page size, head packing and kernels: the last plan's items on the
        new lengths where they stay balanced (``sched.reuse``; not with ``keep`` False), else
        the wrapper's own planner (``_schedule``).  Returns the ``sched.Plan`` (uploaded)."""
        if keep and split_tokens is None and self._planner is not None and self._views is not None:
            plan = self._planner.replan(kv_lens, upper)
            if plan is not None:
                self._planner.upload(self._plan_buf)
                return plan
        backend = backend_for("decode", st.arch)
        row = kv_row_bytes(st.head_dim, common.kv_dtype_name(st.kv_dtype, st.dtype))
        return self._schedule(
            kv_lens, batch, st.hq, st.hk, st.head_dim, row, st.page_size, split_tokens, st.hpi, backend, st.arch
        )

    # ---- several query tokens per request: the paged prefill kernel --------------------------
    def _multi_wrapper(self):
        from .prefill import BatchPrefillWithPagedKVCacheWrapper

        if self._mt is None:
            bufs = {}
            if self._use_cuda_graph:  # its own index buffers, sized from this wrapper's
                z = lambda n: self._indptr_buf.new_zeros(n)  # noqa: E731
                bufs = dict(
                    qo_indptr_buf=z(self._fixed_bs + 1),
                    paged_kv_indptr_buf=z(self._indptr_buf.numel()),
                    paged_kv_indices_buf=z(self._indices_buf.numel()),
                    paged_kv_last_page_len_buf=z(self._last_buf.numel()),
                )
            self._mt = BatchPrefillWithPagedKVCacheWrapper(
                self._float_ws_arg, self._kv_layout, use_cuda_graph=self._use_cuda_graph, **bufs
            )
        return self._mt

    def _plan_multi(self, indptr, indices, last_page_len, hq, hk, d, page_size, n, **kw):
        """plan(q_len_per_req=n > 1), and decode at a head dim only the prefill kernel serves (96,
        n = 1): a causal paged prefill with qo_indptr = arange(batch + 1) * n."""
        for k in ("variant", "custom_mask", "packed_custom_mask", "heads_per_item"):
            if kw.pop(k) is not None:
                why = f"q_len_per_req={n}" if n > 1 else f"head_dim {d} (decode on the prefill kernel)"
                raise NotImplementedError(f"{k} with {why} is not supported")
        if kw.pop("block_tables") is not None or kw.pop("seq_lens") is not None:
            raise NotImplementedError("block_tables / seq_lens (the trtllm-gen backend's inputs) are not supported")
        common.check_plan_not_captured()
        indptr_h = as_index_array("indptr", indptr)
        check_indptr("indptr", indptr_h)
        batch = indptr_h.shape[0] - 1
        kv_lens = kv_lens_from_paged(indptr_h, last_page_len, page_size)
        if self._use_cuda_graph:  # as FlashInfer's plan(): this wrapper's buffers hold the batch
            for t, buf, name in ((indptr, self._indptr_buf, "indptr"), (indices, self._indices_buf, "indices"),
                                 (last_page_len, self._last_buf, "last_page_len")):  # fmt: skip
                common.to_device(t, buf, name, self._device)
        self._mt_plan(indptr, indices, last_page_len, kv_lens, batch, hq, hk, d, page_size, n, kw)

    def _mt_plan(self, indptr, indices, last_page_len, kv_lens, batch, hq, hk, d, page_size, n, kw):
        short = np.flatnonzero(kv_lens < n) if n > 1 else ()  # one token: kv_len 0 gives out 0, LSE -inf
        if len(short):
            i = int(short[0])
            raise ValueError(
                f"q_len_per_req={n} needs kv_len >= {n} for every request (as FlashInfer); request {i} "
                f"has kv_len {int(kv_lens[i])}"
            )
        mt = self._multi_wrapper()
        qo = np.arange(batch + 1, dtype=np.int32) * n
        mt.plan(qo, indptr, indices, last_page_len, hq, hk, d, page_size, causal=True, **kw)
        if not self._use_cuda_graph:
            mt._qo_indptr_dev = torch.from_numpy(qo).to(self._device, non_blocking=True)
        self._mt_kw = dict(kw, hq=hq, hk=hk, d=d, page_size=page_size)
        self._state = None
        self._q_len = n
        self._routed = True
        if self._use_cuda_graph and self._frozen_q_len is None:
            self._frozen_q_len = n
        if self._cached is None:
            self._cached = compat.CachedModule(self)

    def _replan_multi(self, indptr_host, kv_lens, batch, page_size, fixed_split_size, disable_split_kv, indices):
        """A fast re-plan of a q_len_per_req > 1 plan: the internal prefill wrapper's plan() from
        the host lengths (the page ids stay on the device)."""
        kw = dict(self._mt_kw)
        hq, hk, d = kw.pop("hq"), kw.pop("hk"), kw.pop("d")
        kw.pop("page_size")
        kw.update(fixed_split_size=compat.split_size(fixed_split_size), disable_split_kv=disable_split_kv)
        if self._use_cuda_graph:
            indices = self._indices_buf
        ip = np.asarray(indptr_host, dtype=np.int64)
        npages = np.diff(ip)
        last = np.where(npages > 0, np.asarray(kv_lens) - np.maximum(npages - 1, 0) * page_size, 0)
        self._mt_plan(ip, indices, last.astype(np.int32), np.asarray(kv_lens), batch, hq, hk, d, page_size,
                      self._q_len, kw)  # fmt: skip

    # ---- workspace_size ----------------------------------------------------------------------
    def workspace_size(
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
        o_data_type=None,
        data_type=None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        block_tables=None,
        seq_lens=None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
    ) -> Tuple[int, int]:
        """FlashInfer's ``workspace_size``: (float workspace bytes, int workspace bytes) that
        plan() with these arguments needs; no side effects.  The int bytes are 0 (the plan lives
        in the float workspace)."""
        on_prefill = decodes_on_prefill(head_dim, kv_data_type, num_qo_heads, num_kv_heads)
        dims = PREFILL_HEAD_DIMS if on_prefill else SUPPORTED_HEAD_DIMS
        common.check_heads(num_qo_heads, num_kv_heads, head_dim, dims)
        if block_tables is not None or seq_lens is not None:
            raise NotImplementedError("block_tables / seq_lens (the trtllm-gen backend's inputs) are not supported")
        batch = len(last_page_len)
        hq, hk, d = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        arch = arch_of_index(self._dev)
        if q_len_per_req > 1 or on_prefill:
            from .prefill_sizes import prefill_workspace_bytes

            have = self._workspace.numel()
            return prefill_workspace_bytes(self._dev, arch, batch, batch * int(q_len_per_req), hq, hk, d, have), 0
        backend = backend_for("decode", arch)
        (tile,) = backend.tiles  # (a plan asked for 32-row tiles fits fewer partial slots in it)
        per_sm = self._ctas_per_sm or backend.ctas_for(d)
        num_ctas = sm_count_of_index(self._dev) * per_sm
        lim = self._limits(batch, hq, hk, d, num_ctas, tile)
        return WorkspaceLayout(lim, num_ctas).total_bytes, 0

    def run_return_lse(self, q, paged_kv_cache, *args, **kw):
        return self.run(q, paged_kv_cache, *args, **dict(kw, return_lse=True))

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        pos_encoding_mode: str = "NONE",
        q_scale=None,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        """FlashInfer's deprecated ``forward``: ``run`` with this call's ``sm_scale`` (None:
        1/sqrt(head_dim)), ``logits_soft_cap`` and ``window_left`` applied (FlashInfer ignores
        the latter two unless plan() had them on; cute_attn applies them: the plan's kernel when
        it serves the value, else the kernel with that soft-cap / window, loaded on the first
        such call outside a CUDA-graph capture -- under capture a ValueError asks to pass them
        to plan()).  ``pos_encoding_mode`` / ``rope_*`` must be the plan's.  Nothing is re-planned
        and the plan's own values stay for later ``run()`` calls."""
        return self._forward(q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                             logits_soft_cap, sm_scale, rope_scale, rope_theta, False)  # fmt: skip

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        pos_encoding_mode: str = "NONE",
        q_scale=None,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ):
        """``forward`` returning (out, lse)."""
        return self._forward(q, paged_kv_cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                             logits_soft_cap, sm_scale, rope_scale, rope_theta, True)  # fmt: skip

    def _window_left_planned(self) -> int:
        if self._routed:
            return self._mt._state.window_left
        return self._require_plan().window_left

    def _forward(self, q, kv, pos_encoding_mode, q_scale, k_scale, v_scale, window_left, logits_soft_cap,
                 sm_scale, rope_scale, rope_theta, return_lse):  # fmt: skip
        if self._routed:
            self._check_q_len(q, self._mt._state.batch)
            kv = (compat.expand_3d(kv, self._kv_layout),)
            return self._mt._forward(q, kv, True, pos_encoding_mode, q_scale, k_scale, v_scale, window_left,
                                     logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse)  # fmt: skip
        st = self._require_plan()
        opts = st.options
        if pos_encoding_mode != opts["pos_encoding_mode"] or (
            pos_encoding_mode == "ROPE_LLAMA" and (rope_scale, rope_theta) != (opts["rope_scale"], opts["rope_theta"])
        ):
            raise ValueError("forward(pos_encoding_mode / rope_scale / rope_theta) must be the plan()'s")
        common.check_plan_scalars(window_left, logits_soft_cap, None, "pages")
        sm = guards.launch_sm_scale(sm_scale, st.head_dim)
        cap = float(logits_soft_cap or 0.0)
        window = int(window_left)
        if (sm, cap, window) == (st.sm_scale, st.logits_soft_cap, st.window_left):
            binding = st.binding
        else:
            var, module = self._run_variant(st, window, cap)
            info = dict(st.binding.info, sm_scale=sm)
            binding = VariantBinding(var, info, module, st.options["load"])
        return self._run(q, kv, (), q_scale, k_scale, v_scale, None, None, return_lse, None, None, None, None,
                         binding=binding, sm_scale=sm)  # fmt: skip

    def _run_variant(self, st, window_left: int, cap: float):
        """(variant, module) of a run with this window / soft-cap: the plan's module when the
        variant specializes the same (the values are runtime values), else another one
        (``compat.run_module``: loaded once, never during a capture)."""
        o = st.options
        var = decode_variant(
            window_left=window_left,
            logits_soft_cap=cap or None,
            pos_encoding_mode=o["pos_encoding_mode"],
            rope_scale=o["rope_scale"],
            rope_theta=o["rope_theta"],
            custom_mask=o["custom_mask"],
            variant=o["variant"],
        )
        if variant_params(var) == variant_params(st.variant):
            return var, st.decode
        dt = common.dtype_name(st.dtype)
        kv = common.kv_dtype_name(st.kv_dtype, st.dtype)
        sp = decode_spec(st.arch, dt, st.head_dim, var, st.hpi, kv, decode_tile(st.hpi, st.hq // st.hk))
        key = (st.family, st.arch, tuple(sorted((k, str(v)) for k, v in sp.pdict.items())))
        return var, compat.run_module(lambda: o["load"](var), key)

    def _check_q_len(self, q, batch):
        if batch and q.dim() == 3 and q.shape[0] // batch != self._q_len and not self._use_cuda_graph:
            raise ValueError(
                f"q has {q.shape[0]} rows for a batch of {batch}: {q.shape[0] // batch} tokens per request, "
                f"plan() planned q_len_per_req={self._q_len}"
            )


def fast_decode_plan(
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
    q_data_type=None,
    kv_data_type=None,
    data_type=None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    non_blocking: bool = True,
    fixed_split_size: Optional[int] = None,
    disable_split_kv: bool = False,
    q_len_per_req: int = 1,
    global_override_indptr_cpu=None,
) -> None:
    """FlashInfer's ``fast_decode_plan`` (engine_calls.md §4): a re-plan of new lengths with the
    first ``plan()``'s kernels, dtypes and variant flags (a call that needs another kernel
    raises).  In CUDA-graph mode nothing is copied into the index buffers (the caller wrote
    them in place, as SGLang does); the kv lengths come from ``global_override_indptr_cpu``
    (else ``indptr.cpu()``) and ``last_page_len`` (ones for page size 1, else
    ``last_page_len.cpu()``), so host arrays mean no device synchronization.  The planner call
    is ``BatchDecodeWithPagedKVCacheWrapper._replan_lengths``.

    The engines call it every step with the same arguments but the lengths: a CUDA-graph
    wrapper's call whose other arguments equal those of its last fast re-plan, with no plan()
    since, skips their checks (they held then) and only re-plans the lengths
    (``DecodeEngineAPI._replan_step``)."""
    args = (num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap,
            q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta, fixed_split_size,
            disable_split_kv, q_len_per_req)  # fmt: skip
    step = getattr(self, "_step", None)
    if step is not None and step[1] is self._state and step[0] == args:
        host = global_override_indptr_cpu if global_override_indptr_cpu is not None else indptr
        return self._replan_step(host, indices, last_page_len, int(page_size))
    if not isinstance(self, DecodeEngineAPI):
        raise TypeError(f"fast_decode_plan takes a BatchDecodeWithPagedKVCacheWrapper, got {type(self).__name__}")
    if self._cached is None:
        raise RuntimeError("fast_decode_plan needs a prior plan() on this wrapper (as FlashInfer)")
    if not isinstance(q_len_per_req, (int, np.integer)) or q_len_per_req < 1:
        raise ValueError(f"q_len_per_req must be >= 1, got {q_len_per_req}")
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    planned_q = self._mt.dtype if self._routed else self.dtype
    planned_kv = planned_q if self._routed else self._state.kv_dtype
    for name, dt, planned in (("q_data_type", q_data_type, planned_q), ("kv_data_type", kv_data_type, planned_kv)):
        if dt is not None and common.as_dtype(dt, name) != planned:
            raise ValueError(f"fast_decode_plan: {name} {dt} differs from the first plan()'s {planned}; call plan()")
    if not self._routed:
        o = self._state.options
        if pos_encoding_mode != o["pos_encoding_mode"]:
            raise ValueError("fast_decode_plan: pos_encoding_mode differs from the first plan()'s; call plan()")
    batch = len(last_page_len)
    indptr_host = global_override_indptr_cpu if global_override_indptr_cpu is not None else indptr
    ip = as_index_array("indptr", indptr_host)  # a CUDA indptr is read back (as FlashInfer's .cpu())
    if ip.shape[0] != batch + 1:
        raise ValueError(f"indptr has {ip.shape[0]} entries, last_page_len {batch}: expected batch + 1")
    if int(page_size) == 1:
        last = np.ones(batch, dtype=np.int64)
    else:
        last = as_index_array("last_page_len", last_page_len, batch)
    kv_lens = kv_lens_from_paged(ip, last, int(page_size))
    if indices is not None and int(ip[-1]) > len(indices):  # eager mode: the kernel reads them as given
        raise ValueError(f"indices has {len(indices)} entries, indptr[-1] needs {int(ip[-1])}")
    self._replan_fast(
        ip, kv_lens, batch, int(num_qo_heads), int(num_kv_heads), int(head_dim), int(page_size),
        window_left=window_left, logits_soft_cap=logits_soft_cap or 0.0,  # as FlashInfer: None is off, 0.0
        sm_scale=guards.launch_sm_scale(sm_scale, int(head_dim)),  # None: 1 / sqrt(head_dim), as FlashInfer
        fixed_split_size=fixed_split_size, disable_split_kv=bool(disable_split_kv),
        q_len_per_req=int(q_len_per_req), indptr=indptr, indices=indices, last_page_len=last_page_len,
    )  # fmt: skip
    if self._use_cuda_graph and not self._routed:
        self._step = (args, self._state)
