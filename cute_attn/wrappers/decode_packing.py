"""How a decode plan lays out its rows: on the decode kernel or the prefill kernels
(``decodes_on_prefill``), and how many kv heads a decode work item carries (head packing: the
default rule and the checks of a requested value,
``BatchDecodeWithPagedKVCacheWrapper.plan(heads_per_item=)``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..families.base import variant_params
from ..families.decode import MAX_PACKED_HEADS, PACKED_HEADS, SHIPPED_VARIANTS, decode_tile, head_dims_for, packed_ok
from ..families.prefill import HEAD_DIMS as PREFILL_HEAD_DIMS
from . import common

# decode of GQA groups above this many query heads per kv head (MQA) plans on the prefill
# kernels where they serve the head dim: the decode kernel's 16-row items would read each
# token's keys once per 16 query heads, the prefill kernel's 64-row tiles once
MAX_DECODE_GROUP = 16


def decodes_on_prefill(head_dim, kv_data_type, num_qo_heads=1, num_kv_heads=1, plain: bool = True) -> bool:
    """Whether decode at ``head_dim`` over a ``kv_data_type`` cache plans on the prefill kernels:
    a head dim or cache the decode kernel does not serve (an fp8 cache at 96), or a 16-bit cache
    at a GQA group above ``MAX_DECODE_GROUP`` where the plan is ``plain`` (no variant, custom
    mask or head packing: what the routed plan cannot take).  Head counts are checked later:
    here a bad one counts as group 1."""
    if head_dim not in PREFILL_HEAD_DIMS:
        return False
    fp8 = common.is_fp8(kv_data_type)
    if head_dim not in head_dims_for(fp8):
        return True
    counts = all(isinstance(h, (int, np.integer)) and h > 0 for h in (num_qo_heads, num_kv_heads))
    return plain and not fp8 and counts and num_qo_heads // num_kv_heads > MAX_DECODE_GROUP


# Head packing (h kv heads per work item) is chosen where, with it, the batch still has at
# least this many items per CTA and no item is longer than a CTA's fair share: the items
# then balance whole, and packing only saves item boundaries (fewer epilogues and record
# loads).  Where packing would make the planner cut items instead, it costs more than it
# saves (BENCHMARKS.md: lognormal batch of 128 +1.4 %, batch 128 x 2k at h = 4 +3 %).
MIN_PACKED_ITEMS_PER_CTA = 1.9
# Caches whose kv head row is ONE_ITEM_ROW_BYTES (head dim 64 16-bit, head dim 128 fp8) also
# pack where the packed items are about one per CTA (at least this share of the grid, at most
# the grid) and none is longer than ONE_ITEM_SLACK above a CTA's share: each CTA then streams one
# item whole (the decode backend's balance tolerance for these rows keeps it unsplit).  A
# 128-byte row per token and head reads DRAM worse than packed heads' 256 contiguous bytes (H200,
# BENCHMARKS.md): gpt-oss (64 / 8 heads, hd64) at 64 x 4k ran 143.7 -> 131.6 us; an e4m3 cache
# at 32 / 8 heads, hd128, 64 x 4k 139.7 -> 132.7 us (page 1: 143.1 -> 134.6).
ONE_ITEM_ROW_BYTES = 128
MIN_ONE_ITEM_PER_CTA = 0.95
ONE_ITEM_SLACK = 0.05
_SHIPPED_PACKED: Optional[set] = None  # SHIPPED_VARIANTS' spec parameters, made on first use


def _packed_kernel_ships(variant) -> bool:
    """Whether the compile presets hold packed kernels of ``variant`` (``SHIPPED_VARIANTS``)."""
    global _SHIPPED_PACKED
    if _SHIPPED_PACKED is None:
        _SHIPPED_PACKED = {tuple(variant_params(v).items()) for v in SHIPPED_VARIANTS}
    return tuple(variant_params(variant).items()) in _SHIPPED_PACKED


def kv_row_bytes(head_dim: int, kv_name=None) -> int:
    """Bytes of one kv head's row in the cache: 16-bit values, or fp8 where ``kv_name`` names
    an fp8 cache."""
    return head_dim * (1 if kv_name is not None else 2)


def heads_per_item(want, fixed, kv_lens, hq, hk, num_ctas, invariant, packable, variant, kv_name=None, head_dim=0):
    """kv heads per work item for this plan (``plan()``'s ``heads_per_item``; the default
    rule: ``MIN_PACKED_ITEMS_PER_CTA``, and ``ONE_ITEM_ROW_BYTES``).  ``packable``: the
    variant's ``Hooks.packs_heads``; ``kv_name``: an fp8 cache's dtype (None: the query's);
    ``fixed``: the value a CUDA-graph wrapper's first plan fixed (None: none)."""
    group, batch = hq // hk, kv_lens.shape[0]

    def why_not(h):
        if not isinstance(h, int) or h not in (1,) + PACKED_HEADS:
            return f"must be one of {(1,) + PACKED_HEADS}"
        if h > 1 and not packable:
            return "head packing needs a softmax variant without query/key transforms (RoPE has them)"
        if h > MAX_PACKED_HEADS.get(head_dim, h):
            return f"head dim {head_dim} packs at most {MAX_PACKED_HEADS[head_dim]} kv heads per item"
        if hk % h or not packed_ok(h, group, head_dim):
            return f"needs num_kv_heads ({hk}) % h == 0 and h * group ({group}) <= 16 (or h = 4 at group 8)"
        if kv_name is not None and decode_tile(h, group) != 16:
            return f"an fp8 cache packs only h * group ({group}) <= 16"
        return None

    if want is not None:
        want = int(want) if isinstance(want, (int, np.integer)) else want
    elif fixed is not None:
        want = fixed
    elif invariant:
        want = 1
    else:
        # (32-row tiles -- four heads of GQA 8 -- only when asked for: they do not ship)
        cands = [
            h
            for h in PACKED_HEADS
            if batch * (hk // h) >= MIN_PACKED_ITEMS_PER_CTA * num_ctas
            and why_not(h) is None
            and decode_tile(h, group) == 16
        ]
        want = 1
        # only where the kernel ships in the compile presets (plain, soft-cap, window), and no
        # packed item longer than one CTA's fair share (in head-tokens)
        if batch and _packed_kernel_ships(variant):
            share, longest = hk * int(kv_lens.sum()) / num_ctas, int(kv_lens.max())
            want = next((h for h in cands if h * longest <= share), 1)
            if want == 1 and kv_row_bytes(head_dim, kv_name) == ONE_ITEM_ROW_BYTES:
                one = [
                    h
                    for h in PACKED_HEADS
                    if MIN_ONE_ITEM_PER_CTA * num_ctas <= batch * (hk // h) <= num_ctas
                    and h * longest <= (1 + ONE_ITEM_SLACK) * share
                    and why_not(h) is None
                    and decode_tile(h, group) == 16
                ]
                want = next(iter(one), 1)
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
