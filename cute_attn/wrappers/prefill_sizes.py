"""Sizes of a prefill plan: the head dims a backend serves, the partial-output rows per CTA,
the query-token capacity as it grows, and the float workspace a plan of given sizes uses
(``workspace_size()`` of the prefill and multi-token decode wrappers)."""

from __future__ import annotations

import numpy as np

from ..families.backends import backends_for
from ..runtime.arch import sm_count_of_index
from ..sched import WorkspaceLayout
from ..sched.workspace import MIN_CTA_TILE_Q
from . import common, compat


def rows_per_cta(head_dim: int) -> int:
    """Partial-output rows per CTA: 4 slots of 128 rows (8 of 64) up to head_dim 128, half that
    at 256, so the fp32 partial section stays at ~35 MB on an H200 (132 SMs) for every head
    dim. The planner only cuts a tile when whole tiles cannot balance (few long tiles); its
    pre-cut candidate doubles the chunk until the slots fit."""
    return 512 * 128 // max(head_dim, 128)


def round_rows(n: int) -> int:
    """Query-token capacity when it has to grow: a power of two (>= 1024), so that the
    planner (pinned staging buffers, workspace layout) is rebuilt only log-many times."""
    return max(1024, 1 << max(int(n) - 1, 0).bit_length())


def check_head_dims(backends, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo) -> tuple:
    """(head_dim_qk, head_dim_vo) as ints (``head_dim_vo`` None: ``head_dim_qk``), checked
    against what one of the arch's prefill ``backends`` serves, and the head counts."""
    dv = head_dim_qk if head_dim_vo is None else head_dim_vo
    for name, d in (("head_dim_qk", head_dim_qk), ("head_dim_vo", dv)):
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 1:
            raise ValueError(f"{name} must be a positive int, got {d!r}")
    equal = tuple(sorted({d for b in backends for d in b.head_dims}))
    if int(dv) != int(head_dim_qk):
        if not any(b.serves_head_dims(int(head_dim_qk), int(dv)) for b in backends):
            pairs = ", ".join(sorted({f"{a}/{b}" for be in backends for a, b in be.head_dim_pairs})) or "none"
            raise ValueError(
                f"head_dim_qk {head_dim_qk} with head_dim_vo {dv} is not supported; supported: equal head dims "
                f"{equal}, or (qk/vo) {pairs}"
            )
        common.check_heads(num_qo_heads, num_kv_heads, int(head_dim_qk), (int(head_dim_qk),))
    else:
        common.check_heads(num_qo_heads, num_kv_heads, head_dim_qk, equal)
    return int(head_dim_qk), int(dv)


def prefill_workspace_bytes(device_index, arch, batch, total_q, hq, hk, d, have, dv=None) -> int:
    """The float workspace bytes a prefill plan of these sizes uses in a workspace of ``have``
    bytes (the partial-output room shrunk to fit, as plan() does), for ``workspace_size``;
    ``dv``: head_dim_vo (None: ``d``), the partial outputs' width."""
    d, dv = check_head_dims(backends_for("prefill", arch), hq, hk, d, dv)
    # the most CTAs any of the arch's prefill kernels runs (the plan picks one per batch)
    num_ctas = sm_count_of_index(device_index) * max(b.ctas_for(d) for b in backends_for("prefill", arch))
    return WorkspaceLayout(partial_limits(have, num_ctas, batch, total_q, hq, hk, dv), num_ctas).total_bytes


def partial_limits(have: int, num_ctas: int, max_batch: int, max_q: int, hq: int, hk: int, dv: int):
    """The planner limits of a prefill plan in a workspace of ``have`` bytes: ``rows_per_cta``
    partial-output rows of width ``dv`` per CTA, shrunk to fit (at least one smallest tile per
    CTA)."""
    return compat.partial_rows_that_fit(
        have,
        num_ctas,
        max_batch=max(max_batch, 1),
        max_total_q_tokens=max(max_q, 1),
        num_qo_heads=hq,
        num_kv_heads=hk,
        head_dim=dv,
        rows=rows_per_cta(dv) * num_ctas,
        min_rows=num_ctas * MIN_CTA_TILE_Q,
    )
