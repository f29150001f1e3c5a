"""fp8 attention in the prefill wrappers: ``plan(q_data_type=float8_e4m3fn,
kv_data_type=float8_e4m3fn, o_data_type=bfloat16 | float16)`` and ``run(q, k, v, q_scale=,
k_scale=, v_scale=)``, as FlashInfer's fa3 fp8 path.  Q, K and V are multiplied in fp8 on
Hopper's fp8 wgmma (``kernels/prefill_fp8.py``); ``q_scale`` and ``k_scale`` fold into the
softmax scale, ``v_scale`` multiplies the output inside the kernel.

Per run: the V^T pass (``kernels/vt_pass.py``) writes V transposed and permuted into the
workspace (or a buffer of the wrapper's own when the workspace has no room), and for a paged
cache gathers K into contiguous rows; then the attention kernel reads Q, K (the caller's ragged
K, or the gathered one) and V^T; then the ⊕ merge where the plan split some KV
(``families/prefill_fp8.py`` explains the layout and why the plan cuts KV at multiples of 32).

Not built yet, refused by plan() with ``NotImplementedError``: e5m2, fp8 output, head dims other
than 64 / 128, soft-cap, sliding window, custom masks, RoPE / ALiBi and other variants,
``use_cuda_graph=True``, run()'s sinks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..families import prefill_fp8 as F
from ..families.backends import NoBackend, backend_for
from ..families.merge import merge_partials_spec
from ..families.prefill import FIXED_SPLIT_TILE
from ..runtime.arch import arch_of_index, sm_count_of_index
from ..runtime.loader import kernel
from ..sched import WorkspaceLayout
from ..sched.cost import choose_cta_tile_q
from . import common, guards, scales
from .plans import PrefillPlanState

ALIGN = 256
QKV = {torch.float8_e4m3fn: "e4m3"}


def is_fp8_query(q_data_type) -> bool:
    return common.as_dtype(q_data_type, "q_data_type") in common.FP8


def check_plan(
    w,
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
    split_unit,
    pos_encoding_mode="NONE",
    variant=None,
    extra=(),
):
    """plan()'s argument checks for fp8 queries (``_check_common``'s): returns (q dtype, kv
    dtype, head_dim, arch) and keeps the output dtype for ``plan_state``."""
    common.check_plan_not_captured()
    q_dtype = common.as_dtype(q_data_type, "q_data_type")
    kv_dtype = common.as_dtype(kv_data_type, "kv_data_type") or q_dtype
    o_dtype = common.as_dtype(o_data_type, "o_data_type")
    common.reject_unsupported(head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, extra=extra)
    if q_dtype not in QKV:
        raise NotImplementedError(f"fp8 attention with {q_dtype} queries: only float8_e4m3fn is built")
    if kv_dtype != q_dtype:
        raise NotImplementedError(
            f"fp8 queries ({q_dtype}) with a {kv_dtype} KV cache: fp8 attention reads q, k and v of one fp8 dtype"
        )
    if o_dtype is None or common.dtype_name(o_dtype) is None:
        raise NotImplementedError(
            f"fp8 attention writes float16 / bfloat16: pass o_data_type=torch.bfloat16 (or float16), got {o_dtype}"
        )
    if w._use_cuda_graph:
        raise NotImplementedError("fp8 attention (fp8 queries) with use_cuda_graph=True is not supported yet")
    unsupported = [
        (pos_encoding_mode not in (None, "NONE"), f"pos_encoding_mode={pos_encoding_mode!r}"),
        (variant is not None, "variant"),
        (window_left is not None and window_left >= 0, "window_left"),
        (bool(logits_soft_cap), "logits_soft_cap"),
    ]
    for bad, what in unsupported:
        if bad:
            raise NotImplementedError(f"fp8 attention (fp8 queries) with {what} is not supported yet")
    arch = arch_of_index(w._dev)
    try:
        backend = backend_for("prefill_fp8", arch)
    except NoBackend as e:
        raise NoBackend(f"fp8 attention cannot run on cuda:{w._dev} ({arch}): {e}") from None
    if head_dim_qk not in backend.head_dims:
        raise NotImplementedError(f"fp8 attention at head_dim {head_dim_qk}: built for {backend.head_dims}")
    common.check_heads(num_qo_heads, num_kv_heads, head_dim_qk, backend.head_dims)
    common.check_plan_scalars(window_left, logits_soft_cap, fixed_split_size, split_unit)
    w._fp8_o_dtype = o_dtype
    return q_dtype, kv_dtype, int(head_dim_qk), int(head_dim_qk), arch


@dataclass(frozen=True)
class Fp8Plan:
    """What run() needs beyond the common plan state: the output dtype, the V^T pass, its
    groups table, V^T's columns per request and where V^T (and a paged cache's gathered K)
    go."""

    o_dtype: torch.dtype
    vt_pass: Any
    groups: torch.Tensor  # [n_groups, 3] int32: request, first key, first V^T column
    vt_indptr: torch.Tensor  # [batch + 1] int32: V^T columns per request (prefix sums)
    tok_indptr: Optional[torch.Tensor]  # paged: K rows per request (prefix sums) of the gathered K
    columns: int  # V^T columns in all
    tokens: int
    buf: torch.Tensor  # flat uint8: V^T at [0, vt_bytes), then (paged) K
    offset: int

    def views(self, hk: int, d: int):
        vt_bytes = hk * d * self.columns
        vt = self.buf[self.offset : self.offset + vt_bytes].view(torch.float8_e4m3fn).view(hk, d, self.columns)
        if self.tok_indptr is None:
            return vt, None
        o = self.offset + _align(vt_bytes)
        k = self.buf[o : o + self.tokens * hk * d].view(torch.float8_e4m3fn).view(1, self.tokens, hk, d)
        return vt, k


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def vt_groups(kv_lens) -> tuple:
    """(groups [n, 3]: request, first key, first V^T column; V^T columns per request as prefix
    sums) of a batch's kv lengths (``families/prefill_fp8.py``: 32 keys a group)."""
    kv = np.asarray(kv_lens, dtype=np.int64)
    n = -(-kv // F.VT_GROUP)
    vt_indptr = np.concatenate([[0], np.cumsum(n * F.VT_GROUP)])
    req = np.repeat(np.arange(kv.size), n)
    first = (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)) * F.VT_GROUP
    groups = np.stack([req, first, vt_indptr[:-1][req] + first], axis=1).astype(np.int32)
    return groups.reshape(-1, 3), vt_indptr.astype(np.int32)


def _region(w, start: int, nbytes: int):
    """(buffer, offset) for ``nbytes`` of pass output: the workspace past the plan when it has
    room, else the wrapper's own buffer (grown to the largest plan)."""
    ws = w._workspace
    if start + nbytes <= ws.numel():
        return ws, start
    buf = getattr(w, "_fp8_buf", None)
    if buf is None or buf.numel() < nbytes:
        w._fp8_buf = None
        buf = w._fp8_buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=w._device)
    return buf, 0


def plan_state(
    w,
    qo_h,
    kv_lens,
    *,
    arch,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    q_dtype,
    causal,
    page_size,
    sm_scale,
    split_tokens,
    disable_split_kv,
    custom_mask=None,
    packed_custom_mask=None,
    kv_pass=None,
    kv_dtype=None,
    **ignored,  # the options check_plan refused already (window, soft-cap, RoPE, variant)
) -> PrefillPlanState:
    """``_plan_common`` for fp8 queries: limits, the modules, the plan (KV cut at multiples of
    32 keys) and the pass's tables."""
    if custom_mask is not None or packed_custom_mask is not None:
        raise NotImplementedError("fp8 attention (fp8 queries) with a custom mask is not supported yet")
    paged = w._PAGED
    if paged and kv_pass is False:
        raise ValueError(
            "kv_pass=False with fp8 queries: a paged cache is read only through the V^T pass (which also "
            "gathers K); leave kv_pass unset"
        )
    if split_tokens is not None and split_tokens % F.VT_GROUP:
        raise ValueError(
            f"fixed_split_size: fp8 attention cuts KV at multiples of {F.VT_GROUP} keys, got {split_tokens} keys"
        )
    o_dtype = w._fp8_o_dtype
    hq, hk, d = int(num_qo_heads), int(num_kv_heads), int(head_dim)
    backend = backend_for("prefill_fp8", arch)
    qo_len = np.diff(qo_h)
    batch, total_q, group = int(qo_len.shape[0]), int(qo_h[-1]), hq // hk
    if split_tokens is not None:
        tile = FIXED_SPLIT_TILE
    else:
        tile = max(min(backend.tiles), choose_cta_tile_q(total_q * group, int(np.count_nonzero(qo_len))))
    if disable_split_kv:
        split_tokens = common.NO_SPLIT
    num_sms, per_sm = sm_count_of_index(w._dev), backend.ctas_for(d)
    num_ctas = num_sms * per_sm
    lim, grow = w._choose_limits(batch, total_q, hq, hk, d, num_ctas)
    out_name = common.dtype_name(o_dtype)
    qkv = QKV[q_dtype]
    spec = F.prefill_fp8_spec(arch, out_name, d, tile, bool(causal), qkv)
    attn = kernel(spec.family, arch, **spec.pdict)
    vs = F.vt_pass_spec(arch, d, paged, qkv)
    vt_pass = kernel(vs.family, arch, **vs.pdict)
    ms = merge_partials_spec(arch, out_name, d, tile)
    merge = kernel(ms.family, arch, **ms.pdict)
    planner = w._install_planner(lim, num_sms, per_sm, backend.planner, grow)
    plan = planner.plan(
        qo_h,
        kv_lens,
        causal=bool(causal),
        page_size=F.VT_GROUP,  # split-KV cuts at multiples of 32 keys: blocks start on V^T groups
        num_qo_heads=hq,
        num_kv_heads=hk,
        cta_tile_q=tile,
        kv_split_size=split_tokens,
    )
    planner.upload(w._plan_buf)
    groups, vt_indptr = vt_groups(kv_lens)
    columns, tokens = int(vt_indptr[-1]), int(np.sum(kv_lens))
    nbytes = _align(hk * d * columns) + (tokens * hk * d if paged else 0)
    buf, offset = _region(w, _align(WorkspaceLayout(lim, planner.num_ctas).total_bytes), nbytes)
    dev = w._device
    tok = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    fp8 = Fp8Plan(
        o_dtype=o_dtype,
        vt_pass=vt_pass,
        groups=common.to_device(torch.from_numpy(groups), None, "fp8 groups", dev).view(-1, 3),
        vt_indptr=common.to_device(vt_indptr, None, "vt_indptr", dev),
        tok_indptr=common.to_device(tok, None, "kv token indptr", dev) if paged else None,
        columns=columns,
        tokens=tokens,
        buf=buf,
        offset=offset,
    )
    return PrefillPlanState(
        plan=plan,
        arch=arch,
        family=backend.family,
        tile=tile,
        attn=attn,
        merge=merge,
        batch=batch,
        total_q=total_q,
        dtype=q_dtype,
        group=group,
        num_ctas=planner.num_ctas,
        hq=hq,
        hk=hk,
        head_dim=d,
        head_dim_vo=d,
        causal=bool(causal),
        sm_scale=guards.launch_sm_scale(sm_scale, d),
        soft_cap=0.0,
        window_left=-1,
        variant=None,
        spec_kw=dict(spec.pdict),
        pass_module=None,
        pass_variant=None,
        pass_grid=0,
        gather=None,
        kv_lens=kv_lens,
        kv_dtype=kv_dtype or q_dtype,
        options=dict(pos_encoding_mode="NONE", rope_scale=None, rope_theta=None, custom_mask=None, variant=None),
        sm_scale_arg=sm_scale,
        fp8=fp8,
    )


def out_dtype(st) -> Optional[torch.dtype]:
    """run()'s output dtype where it is not the query's (fp8 attention), else None."""
    return None if getattr(st, "fp8", None) is None else st.fp8.o_dtype


def out_and_lse(q, out, lse, hq: int, o_dtype):
    """run()'s ``out`` (of ``o_dtype``, q's shape) and ``lse``: new, or the caller's checked."""
    if out is None:
        out = torch.empty(q.shape, dtype=o_dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != o_dtype or out.device != q.device:
        raise ValueError(
            f"out must be {o_dtype} (plan()'s o_data_type) {tuple(q.shape)} on {q.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    return common.out_and_lse(out, out, lse, hq)


def launch(w, st, q, k4, v4, kv_indptr, kv_indices, out, lse, sinks, ov, sc) -> None:
    """The V^T pass, the attention kernel and the merge (``_launch`` for fp8 queries; ``sc``:
    the run's ``scales.Scales``, its scalar v scale applied by the kernel)."""
    if sinks is not None:
        raise NotImplementedError("fp8 attention (fp8 queries) with sinks is not supported yet")
    if ov:
        raise NotImplementedError("forward() with fp8 queries is not supported: plan() and run()")
    sc.query(q)  # refuses per-head q / k scales (fp8 queries are quantized already)
    fp8, hk, d = st.fp8, st.hk, st.head_dim
    if q.shape[0] == 0:
        return
    if fp8.tokens == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return
    vt, k_g = fp8.views(hk, d)
    paged = fp8.tok_indptr is not None
    tok = fp8.tok_indptr if paged else kv_indptr
    k_out = k_g if paged else k4
    fp8.vt_pass(k4, v4, k_out, vt, tok, kv_indptr, kv_indices, fp8.groups, fp8.groups.shape[0])
    vw = w._views
    st.attn(
        q,
        k_out,
        vt,
        tok,
        fp8.vt_indptr,
        out,
        lse,
        vw["work_items"],
        vw["work_indptr"],
        vw["partial_o"],
        vw["partial_lse"],
        st.group,
        sc.sm_scale(st.sm_scale),
        1.0 if sc.out is None else sc.out,
        st.num_ctas,
    )
    if st.plan.has_split:
        st.merge(vw["partial_o"], vw["partial_lse"], vw["merge_tasks"], vw["meta"], out, lse, st.group, st.num_ctas)
    scales.Scales(v_heads=sc.v_heads).output(out)
