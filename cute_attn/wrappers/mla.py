"""Paged MLA attention, FlashInfer-compatible: ``BatchMLAPagedAttentionWrapper``.

Multi-head latent attention in the absorbed form (DeepSeek-V2/V3; FlashInfer's
``flashinfer.mla.BatchMLAPagedAttentionWrapper``, 0.7.2): one latent KV head shared by every
query head, ``ckv_cache [pages, page_size, 512]`` and ``kpe_cache [pages, page_size, 64]``;
for query head h of a token, ``s_j = (q_nope[h] . ckv_j + q_pe[h] . kpe_j) * sm_scale`` and
``out[h] = softmax(s) . ckv``.  Decode (one token per request), multi-token steps (MTP /
speculative verification) and chunked prefill on a paged latent cache, causal bottom-right
aligned (query i of a request with qo_len q and kv_len k sees keys < k - q + i + 1).

``plan()`` runs the CPU scheduler (``cute_attn.sched``: the heads x query tokens of a request
are its packed rows, with one kv head) into the wrapper's own plan buffer; ``run()`` launches
the persistent MLA kernel (``kernels/mla_decode.py``; ``kernels/mla_decode_fp8.py`` for an fp8
latent cache, on both arches: the Hopper wgmma kernel has no fp8 path) and, when the plan split some KV (or in
CUDA-graph mode, where a later plan may), the ⊕ merge of the fp32 partials.  The LSE is base 2,
as FlashInfer returns it (``return_lse_base_on_e`` / ``lse_mode="basee"``: natural log).

CUDA-graph mode (``use_cuda_graph=True`` with the four index buffers): the plan's arrays go
into those buffers and the work lists into buffers fixed by the first plan, so a captured
``run()`` stays valid when ``plan()`` is called again with other lengths or fewer requests
(``_cached_module.plan`` is SGLang's fast re-plan from host arrays).  What a captured launch
bakes -- heads, page size, causal, the softmax scale, the dtype, the kernel's tile -- cannot
change in a re-plan: that is an error, not a silent stale replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np
import torch

from ..abi import dtypes
from ..families.backends import MLA_WGMMA, backend_for, backends_for
from ..families.mla import HEAD_DIM_CKV, HEAD_DIM_KPE, TILE_SM90, TILES, mla_merge_spec, mla_sm90_spec, mla_spec
from ..families.mla import ctas_per_sm as mla_ctas_per_sm
from ..runtime.arch import arch_of_index, sm_count_of_index
from ..runtime.loader import kernel
from ..sched import Limits
from . import common, compat, guards
from .mla_inputs import (
    LN2,
    OTHER_BACKENDS,
    OWN_BACKENDS,
    Batch,
    check_contract,
    check_heads_dims,
    check_operand,
    csr_batch,
    metadata_fields,
    out_and_lse,
    plan_dtype,
    reject_run_options,
    split_pair,
)

D_QK = HEAD_DIM_CKV + HEAD_DIM_KPE
# The merge of split items runs on this many CTAs per CTA of the attention grid: at 512 columns
# a merge unit is one row (128 threads x 4 fp32), so on the attention grid's CTAs a CTA would fold
# its ~15 units one load latency after another (a tail of tens of microseconds after a split
# decode); its 128-thread CTAs are small, several share an SM and the rows go in parallel.
MERGE_CTAS_PER_CTA = 4


@dataclass(frozen=True)
class MlaPlanState:
    """What ``plan()`` leaves for ``run()``: replaced whole by the next plan."""

    plan: Any  # sched.Plan, uploaded into the plan buffer
    batch: int
    total_q: int
    heads: int
    page_size: int
    dtype: torch.dtype  # queries and output
    kv_dtype: torch.dtype  # ckv / kpe: dtype, or fp8
    sm_scale: float  # the launch scalar
    causal: bool
    tile: int
    num_ctas: int
    arch: str
    kv_indptr: torch.Tensor  # device, int32
    kv_indices: torch.Tensor  # device, int32
    used_pages: int  # kv_indptr[-1]: the page ids the kernel reads
    max_page: int  # the largest of them where they were on the host, else -1
    attn: Any  # the mla_decode module
    merge: Any  # the merge_partials module
    lse_mode: str
    kv_lens: np.ndarray

    @property
    def group(self) -> int:
        return self.heads  # packed rows per query token (one kv head)


class _PlanOp:
    """``_cached_module.plan``: callable, and as ``.default`` (SGLang calls the torch-op form)."""

    def __init__(self, fn):
        self._fn = fn
        self.default = fn

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class CachedModule:
    """FlashInfer's ``wrapper._cached_module`` as SGLang's ``fast_mla_decode_plan`` calls it
    during CUDA-graph replay: ``plan(float_ws, int_ws, pinned_ws, qo_indptr_cpu, kv_indptr_cpu,
    kv_len_arr_cpu, num_heads, head_dim_ckv, causal)`` re-plans the wrapper from those host
    arrays, with the page ids already in the wrapper's ``kv_indices`` buffer and the page size
    and scale from the wrapper's ``_page_size`` / ``_sm_scale`` (which SGLang sets first)."""

    def __init__(self, wrapper):
        self._wrapper = wrapper
        self.plan = _PlanOp(self._plan)

    def _plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_len_arr, num_heads, head_dim_ckv, causal,
              *rest):  # fmt: skip
        self._wrapper._replan_fast(qo_indptr, kv_indptr, kv_len_arr, num_heads, head_dim_ckv, causal)
        return ()


class BatchMLAPagedAttentionWrapper:
    """FlashInfer's MLA wrapper: ``plan()`` once per step (shared by all layers), ``run()`` per
    layer.  With ``use_cuda_graph=True`` a captured ``run()`` stays valid across ``plan()``
    calls with other lengths within the buffers' sizes."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
        kv_indices: Optional[torch.Tensor] = None,
        kv_len_arr: Optional[torch.Tensor] = None,
        backend: str = "auto",
    ) -> None:
        if backend not in OWN_BACKENDS:
            if backend in OTHER_BACKENDS:
                raise NotImplementedError(
                    f"backend {backend!r} is not supported: cute_attn runs its own MLA kernel "
                    "(use 'auto', 'fa2' or 'fa3')"
                )
            raise ValueError(f"backend must be one of {OWN_BACKENDS + OTHER_BACKENDS}, got {backend!r}")
        self._workspace = common.workspace_view(float_workspace_buffer)
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._dev = common.device_index(self.device)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        if self._use_cuda_graph:
            common.check_index_buffers(
                (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                 ("kv_len_arr", kv_len_arr)),
                "sized for the largest batch",
            )  # fmt: skip
            if kv_indptr.numel() != qo_indptr.numel() or kv_len_arr.numel() != qo_indptr.numel() - 1:
                raise ValueError(
                    f"use_cuda_graph=True: qo_indptr / kv_indptr must have batch + 1 entries and kv_len_arr batch, "
                    f"got {qo_indptr.numel()} / {kv_indptr.numel()} / {kv_len_arr.numel()}"
                )
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr
        self._kv_indices_buf, self._kv_len_arr_buf = kv_indices, kv_len_arr
        # FlashInfer's int workspaces: the engines hand them back to _cached_module.plan; the
        # plan's records live in a buffer of this wrapper's own (``common.plan_buffer``)
        self._int_workspace_buffer = None
        self._pin_memory_int_workspace_buffer = None
        self._cached_module = CachedModule(self)
        self._planner = None  # sched.Planner of the current limits
        self._views = None  # its workspace sections
        self._plan_buf = None
        self._state: Optional[MlaPlanState] = None
        self._plan_error = None  # why the last plan() raised (run() then refuses to launch)
        self._captured_rows = None  # CUDA-graph mode: q rows of the smallest captured run()
        self._graph_fixed = None  # CUDA-graph mode: what the first plan fixed (_check_graph_fixed)
        # FlashInfer's attributes the engines read or set
        self._causal = self._page_size = self._sm_scale = None
        self._head_dim_ckv = self._q_data_type = self._kv_data_type = None
        self._use_profiler = False
        self._plan_info = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def _plan(self):
        return None if self._state is None else self._state.plan

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Use another workspace from the next ``plan()`` on (graphs captured on the old one are void)."""
        self._workspace = common.workspace_bytes(float_workspace_buffer, self.device)
        self._float_workspace_buffer = float_workspace_buffer
        self._views = self._state = self._planner = None
        self._graph_fixed = self._captured_rows = None

    # ---- plan -------------------------------------------------------------------------------
    @common.guarded_plan
    def plan(
        self,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
        kv_indices: Optional[torch.Tensor] = None,
        kv_len_arr: Optional[torch.Tensor] = None,
        num_heads: Optional[int] = None,
        head_dim_ckv: Optional[int] = None,
        head_dim_kpe: Optional[int] = None,
        page_size: Optional[int] = None,
        causal: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        q_data_type=None,
        kv_data_type=None,
        use_profiler: bool = False,
        *,
        metadata=None,
        cum_seq_lens_q: Optional[torch.Tensor] = None,
        block_tables: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        max_q_len: Optional[int] = None,
        query_layout: Optional[str] = None,
        kv_cache_layout: Optional[str] = None,
        lse_mode: str = "none",
        output_dtype=None,
        output_scale: str = "none",
        scale_mode: str = "default",
        skip_softmax: bool = False,
        enable_pdl: Optional[bool] = None,
        use_sinks: bool = False,
    ) -> None:
        """FlashInfer 0.7.2's ``plan``: the batch as flat CSR arrays (``qo_indptr``,
        ``kv_indptr`` in pages, ``kv_indices`` page ids, ``kv_len_arr`` tokens), as a flat dense
        page table (``cum_seq_lens_q``, ``block_tables [batch, pages]``, ``seq_lens``,
        ``max_q_len``) or as ``metadata=MLAPlanMetadata.csr(...)`` / ``.dense(...)``; index
        arrays on the host or the device (device ones are read back: one synchronization, as
        FlashInfer's plan).  ``head_dim_ckv`` must be 512 and ``head_dim_kpe`` 64; 1-128 heads;
        float16 / bfloat16 q = output, kv the same or an fp8 latent cache (``float8_e4m3fn`` /
        ``float8_e5m2``, ckv and kpe both: the mma.sync fp8 kernel on every arch; no scale
        reaches it -- fold the cache's scale into ``sm_scale`` and the output, as with
        FlashInfer).  ``query_layout`` / ``kv_cache_layout`` are accepted
        (run() takes either form); ``lse_mode="basee"`` returns a natural-log LSE;
        ``enable_pdl`` is ignored (the merge is always a programmatic dependent launch).  The
        profiler, output scales, fp8 scale modes, skip-softmax and sinks are not supported."""
        required = dict(num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                        page_size=page_size, causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
                        kv_data_type=kv_data_type)  # fmt: skip
        missing = [name for name, value in required.items() if value is None]
        if missing:
            raise TypeError("plan() missing required arguments: " + ", ".join(missing))
        check_contract(use_profiler, query_layout, kv_cache_layout, lse_mode, output_scale, scale_mode, skip_softmax,
                       use_sinks)  # fmt: skip
        heads = check_heads_dims(num_heads, head_dim_ckv, head_dim_kpe)
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        dtype, kv_dtype = plan_dtype(q_data_type, kv_data_type, output_dtype)
        sm = guards.launch_sm_scale(sm_scale, D_QK)
        common.check_plan_not_captured()
        flat = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr,
                    cum_seq_lens_q=cum_seq_lens_q, block_tables=block_tables, seq_lens=seq_lens,
                    max_q_len=max_q_len)  # fmt: skip
        batch = csr_batch(metadata_fields(metadata, flat), int(page_size))
        self._plan_batch(batch, heads, int(page_size), bool(causal), sm, (dtype, kv_dtype), lse_mode, copy_indices=True)
        self._causal, self._page_size, self._sm_scale = bool(causal), int(page_size), sm_scale
        self._head_dim_ckv, self._q_data_type, self._kv_data_type = head_dim_ckv, q_data_type, kv_data_type

    @common.guarded_plan
    def _replan_fast(self, qo_indptr, kv_indptr, kv_len_arr, num_heads, head_dim_ckv, causal) -> None:
        """``_cached_module.plan``: a re-plan from host arrays whose page ids are already in the
        ``kv_indices`` buffer (CUDA-graph mode) or in the last plan's device table."""
        prev = self._state
        if prev is None:
            raise RuntimeError("_cached_module.plan() before any plan(): the page size and dtype come from plan()")
        heads = check_heads_dims(num_heads, head_dim_ckv, HEAD_DIM_KPE)
        page_size = int(self._page_size)
        sm = guards.launch_sm_scale(self._sm_scale, D_QK)
        table = self._kv_indices_buf if self._use_cuda_graph else prev.kv_indices
        fields = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=table, kv_len_arr=kv_len_arr,
                      cum_seq_lens_q=None, block_tables=None, seq_lens=None, max_q_len=None)  # fmt: skip
        batch = csr_batch(fields, page_size)
        dts = (prev.dtype, prev.kv_dtype)
        self._plan_batch(batch, heads, page_size, bool(causal), sm, dts, prev.lse_mode, copy_indices=False)
        self._causal = bool(causal)

    def _plan_batch(self, b: Batch, heads, page_size, causal, sm_scale, dtypes_, lse_mode, copy_indices) -> None:
        """The kernels (loaded first: a missing one fails before the buffers are touched), the
        schedule, the index arrays on the device, the state.  ``dtypes_``: (q, cache)."""
        dtype, kv_dtype = dtypes_
        fp8 = kv_dtype != dtype
        arch = arch_of_index(self._dev)
        qo_len = np.diff(b.qo_indptr)
        rows = int(qo_len.max()) * heads if b.batch else 0
        # two warp groups (32 rows) where a request has more rows than one: each latent block
        # read from L2 then serves twice the rows; past 32 rows, on Hopper, the wgmma kernel's
        # 64-row items (compute-bound: 128 heads x 2 tokens are 4 of them per request)
        tile = TILES[1] if rows > TILES[0] else TILES[0]
        # (the wgmma kernel has no fp8 path: an fp8 cache runs on the mma.sync kernel on both arches)
        wgmma = [b_ for b_ in backends_for("mla_decode", arch) if b_.name == MLA_WGMMA and not fp8]
        if rows > TILES[-1] and wgmma:
            tile = TILE_SM90
        if self._use_cuda_graph and self._graph_fixed is not None:
            tile = self._graph_fixed["tile"]  # the captured launch keeps its kernel
        fixed = dict(heads=heads, page_size=page_size, causal=causal, sm_scale=sm_scale, dtype=dtype, tile=tile,
                     kv_dtype=kv_dtype)  # fmt: skip
        self._check_graph_fixed(b, fixed)
        dt = common.dtype_name(dtype)
        if tile == TILE_SM90:
            backend = wgmma[0]
            attn = kernel(backend.family, arch, **mla_sm90_spec(arch, dt).pdict)
        else:
            backend = backend_for("mla_decode", arch)
            kv = dtypes.name_of(kv_dtype, dtypes.FP8) if fp8 else None
            attn = kernel(backend.family, arch, **mla_spec(arch, dt, tile, kv).pdict)
        ms = mla_merge_spec(arch, dt, tile)
        merge = kernel(ms.family, arch, **ms.pdict)
        plan = self._schedule(b, heads, page_size, causal, tile, backend, mla_ctas_per_sm(tile, fp8))
        dev = self.device
        kv_indptr = common.to_device(
            torch.from_numpy(b.kv_indptr.astype(np.int32)), self._kv_indptr_buf, "kv_indptr", dev
        )
        if copy_indices:
            kv_indices = self._indices_to_device(b.kv_indices)
        else:
            kv_indices = b.kv_indices
        if self._use_cuda_graph:  # as FlashInfer: the caller's buffers hold the plan's arrays
            common.to_device(torch.from_numpy(b.qo_indptr.astype(np.int32)), self._qo_indptr_buf, "qo_indptr", dev)
            common.to_device(torch.from_numpy(b.kv_lens.astype(np.int32)), self._kv_len_arr_buf, "kv_len_arr", dev)
            if self._graph_fixed is None:
                self._graph_fixed = dict(fixed, max_q=self._planner.limits.max_total_q_tokens)
        host = None if b.kv_indices.is_cuda else b.kv_indices
        self._state = MlaPlanState(
            plan=plan,
            batch=b.batch,
            total_q=b.total_q,
            heads=heads,
            page_size=page_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
            sm_scale=sm_scale,
            causal=causal,
            tile=tile,
            num_ctas=self._planner.num_ctas,
            arch=arch,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            used_pages=b.used_pages,
            max_page=common.max_page_id(host, b.used_pages),
            attn=attn,
            merge=merge,
            lse_mode=lse_mode,
            kv_lens=b.kv_lens,
        )

    def _indices_to_device(self, indices: torch.Tensor) -> torch.Tensor:
        buf = self._kv_indices_buf if self._use_cuda_graph else None
        if buf is not None and indices.is_cuda and indices.data_ptr() == buf.data_ptr():
            if indices.numel() > buf.numel():
                raise ValueError(f"kv_indices has {indices.numel()} entries, its CUDA-graph buffer only {buf.numel()}")
            return buf  # the caller wrote the page ids into the buffer itself (SGLang)
        return common.to_device(indices, buf, "kv_indices", self.device)

    def _check_graph_fixed(self, b: Batch, fixed: dict) -> None:
        """CUDA-graph mode: a captured run() bakes the kernel, its launch scalars and the cache
        view of the plan it was captured with; a re-plan that changes them would be ignored by
        the replay, so it is an error.  Also: no more requests than the buffers hold, no more
        query tokens than the first plan's layout (and a captured q) has room for."""
        if not self._use_cuda_graph:
            return
        cap = self._qo_indptr_buf.numel() - 1
        if b.batch > cap:
            raise ValueError(f"use_cuda_graph=True: batch {b.batch} exceeds the qo_indptr buffer's {cap} requests")
        common.check_capture_rows(self, b.total_q, "query tokens")
        first = self._graph_fixed
        if first is None:
            return
        changed = [k for k in fixed if fixed[k] != first[k]]
        if changed:
            raise ValueError(
                f"use_cuda_graph=True: plan() changed {changed} since the first plan "
                f"({ {k: first[k] for k in changed} }); a captured run() bakes them. Keep them fixed or use "
                "another wrapper."
            )
        if b.total_q > first["max_q"]:
            raise ValueError(
                f"use_cuda_graph=True: {b.total_q} query tokens exceed the {first['max_q']} the first plan sized the "
                "work lists for"
            )

    def _schedule(self, b: Batch, heads, page_size, causal, tile, backend, per_sm):
        """(Re)make the planner for the limits (``per_sm`` CTAs per SM), plan the batch and upload
        its work lists."""
        num_sms = sm_count_of_index(self._dev)
        num_ctas = num_sms * per_sm
        limits = self._limits(b, heads, num_ctas, tile)
        desc = f"batch {b.batch}, {b.total_q} query tokens, {heads} heads"
        common.install_planner(self, limits, num_sms, per_sm, backend.planner, desc)
        plan = self._planner.plan(
            b.qo_indptr,
            b.kv_lens,
            causal=causal,
            page_size=page_size,
            num_qo_heads=heads,
            num_kv_heads=1,
            cta_tile_q=tile,
        )
        self._planner.upload(self._plan_buf)
        return plan

    def _limits(self, b: Batch, heads, num_ctas, tile) -> Limits:
        max_batch, max_q = b.batch, b.total_q
        if self._use_cuda_graph:  # fixed by the buffers and the first plan: the offsets never move
            max_batch = self._qo_indptr_buf.numel() - 1
            first = self._graph_fixed
            max_q = first["max_q"] if first is not None else max(b.total_q, max_batch)
        elif self._planner is not None:
            max_batch = max(max_batch, self._planner.limits.max_batch)
            max_q = max(max_q, self._planner.limits.max_total_q_tokens)
        # partial slots: 8 tiles per CTA (split-KV decode needs no more), fewer where the
        # workspace is small (compat.partial_rows_that_fit: at least one per CTA)
        return compat.partial_rows_that_fit(
            self._workspace.numel(),
            num_ctas,
            max_batch=max(max_batch, 1),
            max_total_q_tokens=max(max_q, 1),
            num_qo_heads=heads,
            num_kv_heads=1,
            head_dim=HEAD_DIM_CKV,
            rows=8 * num_ctas * tile,
            min_rows=num_ctas * tile,
        )

    # ---- run ---------------------------------------------------------------------------------
    def run(
        self,
        q_nope: Optional[torch.Tensor] = None,
        q_pe: Optional[torch.Tensor] = None,
        ckv_cache: Optional[torch.Tensor] = None,
        kpe_cache: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        profiler_buffer: Optional[torch.Tensor] = None,
        kv_len: Optional[torch.Tensor] = None,
        page_table: Optional[torch.Tensor] = None,
        return_lse_base_on_e: bool = False,
        o_scale: Optional[float] = None,
        *,
        query=None,
        kv_cache=None,
        ckv_scale: Optional[float] = None,
        ckv_scale_arr: Optional[torch.Tensor] = None,
        kpe_scale: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        bmm1_scale=None,
        bmm2_scale=None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """FlashInfer 0.7.2's ``run``: ``q_nope [tokens, heads, 512]``, ``q_pe [tokens, heads,
        64]``, ``ckv_cache [pages, page_size, 512]``, ``kpe_cache [pages, page_size, 64]``
        (strided views of one 576-wide buffer are fine: last dim contiguous, 16-byte aligned
        rows), or ``query=`` / ``kv_cache=`` as one packed 576-wide tensor or a pair.  Returns
        ``out [tokens, heads, 512]`` and, with ``return_lse``, the LSE ``[tokens, heads]``
        (base 2; natural log with ``return_lse_base_on_e`` or a ``lse_mode="basee"`` plan).
        The other backends' arguments (``kv_len`` / ``page_table``, fp8 scales, sinks, the
        profiler buffer, skip-softmax) must be None."""
        st = self._require_plan()
        reject_run_options(
            profiler_buffer=profiler_buffer, kv_len=kv_len, page_table=page_table, o_scale=o_scale,
            ckv_scale=ckv_scale, ckv_scale_arr=ckv_scale_arr, kpe_scale=kpe_scale, sinks=sinks,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor, bmm1_scale=bmm1_scale,
            bmm2_scale=bmm2_scale,
        )  # fmt: skip
        q_nope, q_pe = split_pair("query", q_nope, q_pe, query)
        ckv, kpe = split_pair("kv_cache", ckv_cache, kpe_cache, kv_cache)
        dev, dt, h = self.device, st.dtype, st.heads
        check_operand("q_nope", q_nope, (None, h, HEAD_DIM_CKV), dt, dev)
        check_operand("q_pe", q_pe, (q_nope.shape[0], h, HEAD_DIM_KPE), dt, dev)
        check_operand("ckv_cache", ckv, (None, st.page_size, HEAD_DIM_CKV), st.kv_dtype, dev)
        check_operand("kpe_cache", kpe, (ckv.shape[0], st.page_size, HEAD_DIM_KPE), st.kv_dtype, dev)
        tokens = q_nope.shape[0]
        # CUDA-graph mode: q may hold more tokens than this plan (captured at the largest);
        # rows past the plan are neither read nor written
        bad_rows = tokens < st.total_q if self._use_cuda_graph else tokens != st.total_q
        if bad_rows:
            want = f">= {st.total_q}" if self._use_cuda_graph else str(st.total_q)
            raise ValueError(f"q_nope has {tokens} tokens, the plan has {want} (qo_indptr[-1])")
        if st.max_page >= ckv.shape[0]:
            raise ValueError(f"kv_indices reference page {st.max_page}, the cache has {ckv.shape[0]} pages")
        guards.check_device_page_ids(st.kv_indices, st.used_pages, ckv.shape[0], "kv_indices")
        common.check_run_capture(self, q_nope, "qo_indptr / kv_indptr / kv_indices / kv_len_arr")
        out, lse = out_and_lse(q_nope, out, lse, h, dev)
        if st.batch:
            vw = self._views
            st.attn(
                q_nope,
                q_pe,
                ckv,
                kpe,
                st.kv_indptr,
                st.kv_indices,
                out,
                lse,
                vw["work_items"],
                vw["work_indptr"],
                vw["partial_o"],
                vw["partial_lse"],
                st.group,
                int(st.causal),
                st.sm_scale,
                st.num_ctas,
            )
            if self._use_cuda_graph or st.plan.has_split:
                st.merge(
                    vw["partial_o"],
                    vw["partial_lse"],
                    vw["merge_tasks"],
                    vw["meta"],
                    out,
                    lse,
                    st.group,
                    MERGE_CTAS_PER_CTA * st.num_ctas,
                )
        if return_lse_base_on_e or st.lse_mode == "basee":
            lse.mul_(LN2)
        return (out, lse) if return_lse else out

    def _require_plan(self) -> MlaPlanState:
        if self._state is None:
            why = self._plan_error
            raise RuntimeError("run() before plan()" + (f": the last plan() failed ({why})" if why else ""))
        return self._state
