"""The prefill wrappers' KV pass (``kernels/kv_pass.py``) on the host side: where its contiguous
K / V go, its launch, and what an fp8 KV cache adds (the cache dtype, the scales).

Where the pass writes (a :class:`Gather`, 256-byte aligned, K then V):

* a 16-bit paged cache (the gather is an optimization, ``kv_pass_pays``): past the plan's
  sections in the float workspace, or not at all (the kernel gathers the pages itself) when
  it has no room; ``kv_pass=True`` there is an error naming the bytes;
* an fp8 cache, paged or ragged, unless the prefill kernel widens it itself (:func:`widens`):
  the workspace when it has room, else a buffer of the wrapper's own,
  grown to the largest plan -- an engine's usual 128 MiB workspace does not hold 2 x 2 bytes
  per element of a long context, and a plan must not fail for that.  In CUDA-graph mode the
  first fp8 plan fixes the region (a captured run() bakes its address and extent): all the
  workspace's room past the plan, or, if that is less than this plan's tokens, an own buffer
  of them rounded up to a power of two; a later plan with more kv tokens is an error.  The
  region is zeroed when it is made: a KV block of the last request that runs past its end
  reads rows no plan wrote there, and a NaN in them would survive the softmax's zero weight
  (0 x NaN); later plans leave only earlier plans' finite rows behind.  Outside graph mode the
  views hold exactly the plan's tokens, so such a block reads TMA's zero fill.

The scales of an fp8 cache are the run's (``wrappers/scales.py``), not the pass's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..abi import dtypes
from ..families import backends
from ..families.backends import kv8_widening_pays
from ..families.prefill import KV8_PASS_BLOCK, kv8_pass_serves, kv8_serves, page_box_for
from ..sched import WorkspaceLayout
from ..sched.pass_order import pass_plan as pass_tasks
from . import common

ALIGN = 256


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


# ---- the cache dtype ----------------------------------------------------------------------------
def kv_name(kv_dtype, q_dtype) -> Optional[str]:
    """The KV pass's ``kv_dtype`` spec parameter of a plan: None for a cache of the query dtype,
    ``"e4m3"`` / ``"e5m2"`` for fp8; the fnuz fp8 formats (AMD's) have no kernels."""
    if kv_dtype == q_dtype:
        return None
    name = dtypes.name_of(kv_dtype, dtypes.FP8)
    if name is None:
        raise NotImplementedError(
            f"kv_data_type {kv_dtype}: the fp8 KV caches served are float8_e4m3fn and float8_e5m2"
        )
    return name


# ---- where the pass writes ------------------------------------------------------------------------
@dataclass(frozen=True)
class Gather:
    """The pass's output region: ``per`` bytes for K at ``buf[offset:]``, then V; views of
    ``tokens`` rows (this plan's, or in CUDA-graph mode the region's capacity)."""

    buf: torch.Tensor  # flat uint8: the workspace or the wrapper's own buffer
    offset: int
    per: int
    tokens: int
    in_workspace: bool

    def views(self, dtype, hk: int, d: int) -> tuple:
        n, o = self.tokens, self.offset
        return tuple(self.buf[a : a + self.per].view(dtype)[: n * hk * d].view(1, n, hk, d) for a in (o, o + self.per))


def _fp8_region(w, start: int, kv_tokens: int, row: int) -> Gather:
    ws = w._workspace
    have = ws.numel()
    if w._use_cuda_graph:
        fixed = getattr(w, "_gather_fixed", None)
        if fixed is not None and not (fixed.in_workspace and fixed.buf.data_ptr() != ws.data_ptr()):
            if kv_tokens > fixed.tokens:
                raise ValueError(
                    f"use_cuda_graph=True with an fp8 KV cache: this plan's {kv_tokens} kv tokens exceed the "
                    f"{fixed.tokens} the first plan fixed for the KV pass's output (a captured run() reads it); "
                    f"plan the most kv tokens first, or give a larger float_workspace_buffer"
                )
            return fixed
        room = max(have - start, 0) // 2 // ALIGN * ALIGN
        if room // row >= max(kv_tokens, 1):
            g = Gather(ws, start, room, room // row, True)
        else:
            cap = 1 << max(kv_tokens - 1, 0).bit_length()
            per = _align(cap * row)
            g = Gather(torch.empty(2 * per, dtype=torch.uint8, device=w._device), 0, per, cap, False)
        g.buf[g.offset : g.offset + 2 * g.per].zero_()
        w._gather_fixed = g
        return g
    per = _align(kv_tokens * row)
    if start + 2 * per <= have:
        return Gather(ws, start, per, kv_tokens, True)
    buf = getattr(w, "_gather_buf", None)
    if buf is None or buf.numel() < 2 * per:
        w._gather_buf = buf = None  # the old one is freed first
        buf = w._gather_buf = torch.empty(2 * per, dtype=torch.uint8, device=w._device)
    return Gather(buf, 0, per, kv_tokens, False)


def widens(w, launch, kv_pass, dims, variant, page_size: int, batch, tile: int, num_sms: int, invariant: bool) -> bool:
    """Whether the prefill kernel widens this plan's fp8 cache itself (``kernels/prefill_sm90_kv8.py``;
    ragged, or paged in page boxes) instead of the dequantizing pass: where it serves the plan
    and beats the pass (``families.backends.kv8_widening_pays``, on ``batch`` = (qo lengths, kv
    lengths, qo heads, kv heads, causal, window_left)), or always where nothing may depend on the
    batch (CUDA graphs, ``invariant``: fixed_split_size); ``kv_pass`` False forces it, True the
    pass.  ``launch``: the plan's launch parameters (dtype, the cache's fp8 name)."""
    d, dv = dims
    kv_name = launch["kv_dtype"]
    pb = page_box_for(w._PAGED, page_size)
    ok = kv_name is not None and not kv_pass and kv8_serves(launch["dtype"], kv_name, d, dv, w._PAGED, variant, pb)
    if ok and kv_pass is None and not (w._use_cuda_graph or invariant):
        qo, kv, hq, hk, causal, window_left = batch
        ok = kv8_widening_pays(qo, kv, hq, hk, d, causal, tile, num_sms, window_left)
    if w._use_cuda_graph and w._fixed is not None and w._fixed["kv8"] != ok:
        raise ValueError("use_cuda_graph=True: plan() changed kv_pass since the first plan (a captured run() bakes it)")
    return ok


def pass_in_kernel(w, launch, tile: int, dims, variant) -> bool:
    """Whether the prefill kernel runs this plan's fp8 pass itself (``kernels/prefill_sm90_kv8_pass.py``:
    a ragged or paged cache (any page size), 128-row kernels at head dim 128 with the static
    flags only, not in CUDA-graph mode), by ``families.backends.KV8_PASS_IN_KERNEL``."""
    d, dv = dims
    return (
        backends.KV8_PASS_IN_KERNEL
        and not w._use_cuda_graph
        and variant is None
        and launch["kv_dtype"] is not None
        and kv8_pass_serves(launch["dtype"], launch["kv_dtype"], d, dv, tile)
    )


def pass_plan(w, plan, kv_lens, hk: int) -> tuple:
    """(state, plan) of the pass inside the kernel on the device: the zeroed-per-run counter and
    flags, and the task list in the order the ``plan``'s CTAs need them (``sched.pass_order``)."""
    plan, n_flags = pass_tasks(plan.work_items, plan.work_indptr, kv_lens, hk, KV8_PASS_BLOCK)
    state = torch.zeros(4 + n_flags, dtype=torch.int32, device=w._device)
    return state, w._to_device(plan, None, "kv8 pass plan")


def gather_region(w, want, fp8: bool, lim, num_ctas: int, kv_tokens: int, row: int, pays) -> Optional[Gather]:
    """Whether this plan runs the KV pass into contiguous K / V and where (module doc); None
    for none.  ``want``: plan()'s ``kv_pass`` (None: the cost model ``pays()`` decides, for a
    16-bit paged cache); ``row``: bytes of one token's K (kv heads x head_dim x the output's
    element size)."""
    start = _align(WorkspaceLayout(lim, num_ctas).total_bytes)
    if fp8:
        if want is False:
            raise ValueError(
                "kv_pass=False with an fp8 KV cache: the cache is read only through the KV pass (which "
                "dequantizes it for the 16-bit prefill kernel); leave kv_pass unset"
            )
        return _fp8_region(w, start, kv_tokens, row)
    if want is False:
        return None
    if want is None:
        if w._use_cuda_graph or not pays():
            return None
    elif w._use_cuda_graph:
        raise ValueError(
            "kv_pass=True is not available with use_cuda_graph=True (a captured run() bakes the "
            "path; the in-kernel gather serves every plan)"
        )
    per = _align(kv_tokens * row)
    have = w._workspace.numel()
    if start + 2 * per > have:
        if want:
            raise ValueError(
                f"kv_pass=True: float_workspace_buffer has {have} bytes; the plan and the gathered "
                f"K / V need {start + 2 * per}"
            )
        return None
    return Gather(w._workspace, start, per, kv_tokens, True)


def paged_gather_inputs(w, kv_lens, qo_h) -> dict:
    """The paged KV pass's device inputs (``PrefillInputs`` fields): the gathered K / V's token
    offsets and the query offsets (read for a key transform), and the kernel's dummy page ids.
    CUDA-graph mode: fixed buffers (a captured run() reads these addresses), the token offsets
    padded to the batch capacity by repeating the last (empty requests: the pass walks every
    entry, its bound read on the device)."""
    tok = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    if not w._use_cuda_graph:
        return dict(
            kv_tok_indptr=w._to_device(tok, None, "kv token indptr"),
            qo_indptr=w._to_device(qo_h.astype(np.int32), None, "qo_indptr"),
            no_indices=common.arange(1, w._device),
        )
    cap = w._qo_indptr_buf.numel()
    if getattr(w, "_kv_tok_buf", None) is None:
        w._kv_tok_buf = torch.zeros(cap, dtype=torch.int32, device=w._device)
        w._no_indices = common.arange(1, w._device)
    tok = np.concatenate([tok, np.full(cap - tok.size, tok[-1], dtype=np.int32)])
    return dict(
        kv_tok_indptr=w._to_device(tok, w._kv_tok_buf, "kv token indptr"),
        qo_indptr=w._qo_indptr_buf,  # plan() copied qo_indptr there
        no_indices=w._no_indices,
    )


# ---- the launch ---------------------------------------------------------------------------------
def run_pass(st, paged: bool, k4, v4, kv_indptr, kv_indices, args):
    """Launch the plan's KV pass; returns the (K, V, kv indptr, page ids) the prefill kernel
    then reads."""
    inp = st.inputs
    pass_module, pass_vals = st.pass_binding.select(args if st.pass_binding.variant is not None else ())
    if st.gathered is not None:  # contiguous K and V in the gather region (ragged from here on)
        k_g, v_g = st.gathered
        if paged:  # the page table in, the gathered tokens' offsets out
            tok = inp.kv_tok_indptr
            pass_module(k4, v4, k_g, v_g, inp.qo_indptr, tok, kv_indptr, kv_indices, tok.numel() - 1,
                        st.sm_scale, st.pass_grid, *pass_vals)  # fmt: skip
            return k_g, v_g, tok, inp.no_indices
        # a ragged fp8 cache, dequantized row for row (kv_indptr: tokens; no pages)
        pass_module(k4, v4, k_g, v_g, inp.qo_indptr, kv_indptr, kv_indptr, kv_indptr, kv_indptr.numel() - 1,
                    st.sm_scale, st.pass_grid, *pass_vals)  # fmt: skip
        return k_g, v_g, kv_indptr, kv_indices
    # a ragged 16-bit K through the variant's transform_k, once per key (V and pages unused)
    k_t = torch.empty((1, k4.shape[1], st.hk, st.head_dim), dtype=k4.dtype, device=k4.device)
    pass_module(k4, k4, k_t, k_t, inp.qo_indptr, kv_indptr, kv_indptr, kv_indptr, kv_indptr.numel() - 1,
                st.sm_scale, st.pass_grid, *pass_vals)  # fmt: skip
    return k_t, v4, kv_indptr, kv_indices
