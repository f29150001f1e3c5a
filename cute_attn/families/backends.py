"""The arch -> backend table: which kernel serves which op on which arch, with what tiles, and
the cost models the wrappers plan with.  A new kernel (a Blackwell prefill, an fp8 variant)
is a new entry here plus its family and kernel; the wrappers choose from the table.

Nothing that shapes a binary lives here, so editing a cost model recompiles nothing (no
family imports this module)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict

import numpy as np

from ..abi import dtypes
from ..abi.archs import ARCHS, HOPPER
from . import decode, kept, kv_pass, merge, mla, prefill, prefill_fp8, prefill_mma


@dataclass(frozen=True)
class Backend:
    op: str  # "merge", "decode", "prefill", "prefill_fp8", "vt_pass", "kv_pass", "mla_decode"
    name: str
    family: str
    archs: tuple
    head_dims: tuple
    dtypes: tuple
    tiles: tuple = ()  # packed query rows per work item the kernel is built for
    tiles_by_head_dim: Dict[int, tuple] = field(default_factory=dict)  # where a head dim has fewer
    ctas_per_sm: Dict[int, int] = field(default_factory=dict)  # head_dim -> CTAs per SM (default 1)
    planner: Dict[str, float] = field(default_factory=dict)  # the planner's cost parameters
    # the planner's overrides per bytes of one kv head's cache row (head dim x element size)
    planner_by_row_bytes: Dict[int, Dict[str, float]] = field(default_factory=dict)
    shipped: Callable[[str], list] = lambda arch: []  # the specializations it ships, per arch
    head_dim_pairs: tuple = ()  # (head_dim_qk, head_dim_vo) served besides the equal head_dims

    def ctas_for(self, head_dim: int) -> int:
        return self.ctas_per_sm.get(head_dim, 1)

    def tiles_for(self, head_dim: int) -> tuple:
        return self.tiles_by_head_dim.get(head_dim, self.tiles)

    def planner_for(self, row_bytes: int) -> Dict[str, float]:
        """The planner's parameters for a cache of ``row_bytes``-byte rows (``planner`` with its
        overrides)."""
        return {**self.planner, **self.planner_by_row_bytes.get(row_bytes, {})}

    def serves_head_dims(self, head_dim_qk: int, head_dim_vo: int) -> bool:
        if head_dim_qk == head_dim_vo:
            return head_dim_qk in self.head_dims
        return (head_dim_qk, head_dim_vo) in self.head_dim_pairs


class NoBackend(RuntimeError):
    """No kernel serves this op on this arch (yet)."""


# ---- which prefill kernel serves a batch ----------------------------------------------------
PORTABLE_PREFILL = "prefill_mma_sync"
# Hopper: the portable kernel serves batches whose mean packed query rows per request (qo_len x
# group over the requests with queries) are at most this, by how the wgmma kernel would read
# the KV: TMA ("tma": ragged, page sizes k*16) or its cp.async gather ("gather": other page
# sizes).  Such batches (multi-token decode, speculative verification) are bandwidth-bound in
# both kernels; the wgmma kernel computes 64-row tiles for them.  Measured on the H200 (bs 64
# x 4k, 32 / 8 heads, 4 query tokens = 16 packed rows; BENCHMARKS.md, "Portable prefill"):
# page 1, portable 0.937x the wgmma kernel's time (its gather is the slow part there); page 16,
# 0.992x (within the noise: not taken); 8 and 16 tokens (32 / 64 rows), page 16: 1.025x /
# 1.131x.  0: never.
HOPPER_PORTABLE_MAX_ROWS = {"tma": 0, "gather": 16}
# head dims Hopper keeps on the wgmma kernel whatever the batch (the portable kernel's limits
# above were measured at 128 only); ``prefill_backend`` still forces it
HOPPER_WGMMA_ONLY_HEAD_DIMS = (80, 96)

# MLA's planner: every head of a request reads one latent cache, and its row tiles are near-equal
# (tokens a key apart): the snake deals them side by side in one round (``order_block``), the
# order its records were measured with; the request-major dealing (``sched/locality.py``) is for
# prefill's many tiles per (request, head)
MLA_PLANNER = {"alpha": 8, "balance_tol": 0.05, "locality_tol": -1.0}


def portable_tiles(arch: str, head_dim: int | None = None) -> tuple:
    """The portable kernel's tiles an arch's plans may use (what it ships): all of them, and
    on Hopper those of the batches ``choose_prefill_backend`` gives it (none while its limits
    are 0, or at ``HOPPER_WGMMA_ONLY_HEAD_DIMS``; ``plan(prefill_backend=...)`` then compiles
    on first use)."""
    tiles = prefill_mma.TILES_BY_HEAD_DIM.get(head_dim, prefill_mma.TILES)
    if arch != HOPPER:
        return tiles
    if head_dim in HOPPER_WGMMA_ONLY_HEAD_DIMS:
        return ()
    lim = max(HOPPER_PORTABLE_MAX_ROWS.values())
    if not lim:
        return ()
    return tuple(t for t in tiles if t < lim) + (min([t for t in tiles if t >= lim] or [max(tiles)]),)


def portable_paged(arch: str) -> tuple:
    """The ``paged`` spec values of the portable kernel's plans on ``arch``: both, and on Hopper
    while only paged caches the wgmma kernel would gather take it, paged alone."""
    return (True,) if arch == HOPPER and not HOPPER_PORTABLE_MAX_ROWS["tma"] else (False, True)


BACKENDS = (
    Backend(
        "merge", "merge", "merge_states", ARCHS, merge.HEAD_DIMS, dtypes.MERGE_VALUES, shipped=merge.shipped_specs
    ),  # fmt: skip
    # alpha: a work item costs the decode kernel a pipeline fill + an epilogue, worth about 128
    # kv tokens (alpha x tile 16); with the planner's default (32 tokens) it preferred plans of
    # many short items that ran 17 % slower on the H200 (lognormal batch of 128).  balance_tol:
    # decode is bandwidth-bound, so even a few % of imbalance is worth a split.  keep_tol: a
    # per-step re-plan keeps the last plan's items while their modelled balance stays within 3 %
    # of that plan's (sched/reuse.py); on the H200 kept plans ran 1.004 / 1.000x the GPU time of
    # full plans of the same lengths (churn traces, batch 64 / 256), and each full plan costs
    # ~0.4 ms of host time there.
    Backend(
        "decode",
        "decode_mma_sync",
        "paged_decode",
        ARCHS,
        decode.HEAD_DIMS,
        dtypes.ATTENTION,
        tiles=(decode.TILE_Q,),
        ctas_per_sm=decode.CTAS_PER_SM,
        planner={"alpha": 8, "balance_tol": 0.01, "keep_tol": 0.03},
        # 128-byte rows (head dim 64 16-bit, 128 fp8: the plans decode_packing's one-item rule
        # packs): the merge kernel a split adds costs ~2-3 % of a 130 us decode (H200, gpt-oss 64
        # x 4k: 256 items of two heads on 264 CTAs ran 131.0 us whole, 134-138 us split; fp8 hd128
        # 64 x 4k 132.7 us whole, 141.2 split), more than a few idle CTAs cost a bandwidth-bound kernel
        planner_by_row_bytes={128: {"balance_tol": 0.05}},
        shipped=lambda arch: decode.shipped_specs(arch) + [kept.kept_update_spec(arch)],
    ),  # fmt: skip
    Backend(
        "prefill",
        "prefill_sm90",
        "batch_prefill_sm90",
        (prefill.ARCH,),
        prefill.HEAD_DIMS,
        dtypes.ATTENTION,
        tiles=prefill.TILES,
        shipped=prefill.shipped_specs,
        head_dim_pairs=prefill.HEAD_DIM_PAIRS,
    ),  # fmt: skip
    # fp8 attention (fp8 q / k / v on the fp8 wgmma) and its V^T pass, which the wrapper launches
    # with one CTA per (32 keys, kv head)
    Backend(
        "prefill_fp8",
        "prefill_fp8_sm90",
        "batch_prefill_fp8_sm90",
        (prefill_fp8.ARCH,),
        prefill_fp8.HEAD_DIMS,
        prefill_fp8.QKV_DTYPES,
        tiles=prefill_fp8.TILES,
        shipped=prefill_fp8.shipped_specs,
    ),  # fmt: skip
    Backend("vt_pass", "vt_pass", "vt_pass", (prefill_fp8.ARCH,), prefill_fp8.HEAD_DIMS, prefill_fp8.QKV_DTYPES),
    # the portable prefill (mma.sync + cp.async, every arch): the prefill of any arch without
    # a faster one, and Hopper's where ``mma_prefill_pays`` says so.  The planner parameters are
    # decode's: its 16-row tile is the decode kernel's geometry, and bandwidth-bound batches
    # (multi-token decode) are where it runs on Hopper
    Backend(
        "prefill",
        "prefill_mma_sync",
        "batch_prefill_mma",
        ARCHS,
        prefill_mma.HEAD_DIMS,
        dtypes.ATTENTION,
        tiles=prefill_mma.TILES,
        tiles_by_head_dim=prefill_mma.TILES_BY_HEAD_DIM,
        ctas_per_sm=prefill_mma.CTAS_PER_SM,
        planner={"alpha": 8, "balance_tol": 0.01},
        shipped=lambda arch: (
            prefill_mma.shipped_specs(arch, portable_tiles(arch), portable_paged(arch)) + prefill_mma.wide_specs(arch)
        ),
    ),  # fmt: skip
    Backend(
        "kv_pass",
        "kv_pass",
        "kv_pass",
        (prefill.ARCH,),
        prefill.HEAD_DIMS,
        dtypes.ATTENTION,
        ctas_per_sm={d: kv_pass.CTAS_PER_SM for d in prefill.HEAD_DIMS},
        shipped=kv_pass.shipped_specs,
    ),  # fmt: skip
    # absorbed MLA (one 576-wide latent kv head for every query head): alpha as decode's (the
    # same kind of kernel: a memory-bound cp.async stream per item); balance_tol 0.05, not
    # decode's 0.01: a split costs more here (the merge of 512-wide rows), and at 0.01 the
    # planner cut batch 128 x 4k on 132 CTAs into 250 items and 122 merges for no lower modelled
    # makespan (4224 either way) -- the H200 run at 904362b read 3.44 TB/s there, 4.41 at 32k
    Backend(
        "mla_decode",
        "mla_mma_sync",
        "mla_decode",
        ARCHS,
        (mla.HEAD_DIM_CKV,),
        dtypes.ATTENTION,
        tiles=mla.TILES,  # CTAs per SM: by tile and cache dtype, families/mla.ctas_per_sm
        planner=MLA_PLANNER,
        shipped=mla.shipped_specs,
    ),  # fmt: skip
    # Hopper's wgmma MLA kernel: 64-row items (one wgmma M), for plans whose requests have more
    # packed rows than the mma.sync kernel's largest tile (the wrapper picks it by name:
    # ``MLA_WGMMA``); the same planner parameters
    Backend(
        "mla_decode",
        "mla_wgmma",
        "mla_decode_sm90",
        (HOPPER,),
        (mla.HEAD_DIM_CKV,),
        dtypes.ATTENTION,
        tiles=(mla.TILE_SM90,),
        planner=MLA_PLANNER,
        shipped=mla.shipped_specs_sm90,
    ),  # fmt: skip
)
MLA_WGMMA = "mla_wgmma"


def backend_for(op: str, arch: str, name: str | None = None) -> Backend:
    """The backend that serves ``op`` on ``arch`` (the first of the table: the fastest in
    general; ``name``: that one); :class:`NoBackend` naming what exists."""
    for b in BACKENDS:
        if b.op == op and arch in b.archs and name in (None, b.name):
            return b
    have = [f"{b.name} ({', '.join(b.archs)})" for b in BACKENDS if b.op == op]
    raise NoBackend(
        f"no {op} kernel{' ' + name if name else ''} for {arch} yet; {op} runs on: {'; '.join(have) or 'nothing'}"
        + (" (the KV pass serves only the Hopper prefill)" if op == "kv_pass" else "")
        + (" (fp8 attention is built on Hopper's fp8 wgmma)" if op in ("prefill_fp8", "vt_pass") else "")
    )


def backends_for(op: str, arch: str) -> list:
    """Every backend that serves ``op`` on ``arch``, in table order."""
    return [b for b in BACKENDS if b.op == op and arch in b.archs]


def choose_prefill_backend(
    arch: str,
    packed_rows: float,
    name: str | None = None,
    needs_pass: bool = False,
    batch_invariant: bool = False,
    gathers: bool = False,
    head_dims: tuple | None = None,
) -> Backend:
    """The prefill kernel of a batch: ``name`` if given (a backend of ``arch``), else the arch's
    first prefill backend, except on Hopper for batches of at most HOPPER_PORTABLE_MAX_ROWS
    mean packed rows per request (``packed_rows``; ``gathers``: the wgmma kernel would gather
    the pages with cp.async), which take the portable kernel -- unless the plan needs the KV
    pass (an fp8 cache, ``kv_pass=True``: it feeds only the wgmma kernel) or must not depend on
    the batch (``fixed_split_size``) or has head dims (``head_dims``: (qk, vo)) it does not serve
    (or ``HOPPER_WGMMA_ONLY_HEAD_DIMS``).  A head dim only a later backend serves takes it."""
    if name is not None:
        return backend_for("prefill", arch, name)
    first = backend_for("prefill", arch)
    if head_dims is not None and not first.serves_head_dims(*head_dims):
        # 512: the portable family's wide kernel
        return next((b for b in backends_for("prefill", arch) if b.serves_head_dims(*head_dims)), first)
    limit = HOPPER_PORTABLE_MAX_ROWS["gather" if gathers else "tma"]
    if first.name != PORTABLE_PREFILL and not needs_pass and not batch_invariant and 0 < packed_rows <= limit:
        portable = backend_for("prefill", arch, PORTABLE_PREFILL)
        if head_dims is None or (
            portable.serves_head_dims(*head_dims) and head_dims[0] not in HOPPER_WGMMA_ONLY_HEAD_DIMS
        ):
            return portable
    return first


def shipped_specs(arch: str) -> list:
    """Every backend's shipped specializations on ``arch`` (the ``default`` preset's core)."""
    return [s for b in BACKENDS if arch in b.archs for s in b.shipped(arch)]


# ---- the KV pass's cost model ---------------------------------------------------------------
# When the KV pass pays for a paged cache.  Its cost: read + write K and V once (3.3-3.7 TB/s
# on an H200 for 0.1-0.5 GB).  Its saving: what the kernel's in-kernel gather costs over TMA,
# a share of the attention's time (~600 TFLOP/s at hd128/256): 16-29 % for the 16-byte
# cp.async gather, 46-143 % when the producer also rotates every gathered K block (RoPE),
# 6-16 % even for TMA page boxes (page sizes k*16: the boxes' page lookups).  Constants fitted
# to the cases of scripts/kv_pass_sweep.py, where the model then picks the faster path or one
# within 2 % (and 9 of 9 right picks out of sample: BENCHMARKS.md).
PASS_COPY_RATE = 3.3e12  # bytes / s, read + write, of the pass
PASS_ATTN_RATE = 600e12  # FLOP / s of the prefill kernel
PASS_SAVES_GATHER = 0.2  # in-kernel cp.async gather: share of the kernel's time
PASS_SAVES_TRANSFORM = 1.0  # in-kernel gather + transform_k of every K block
PASS_SAVES_BOXES = 0.08  # in-kernel TMA page boxes (page sizes k*16)


# When a ragged fp8 cache is better widened by the kernel (``kernels/prefill_sm90_kv8.py``) than
# dequantized by the KV pass.  The pass reads 1 and writes 2 bytes per element of K and V once
# (~2.6 TB/s of those bytes: 78 us at 2 x 8k x 16 heads, hd128, H200); the kernel widens every
# 128-key block again for every query tile that reads it, ~0.47 us of an SM's time per
# (tile, block) where the kernel is compute-bound (2 x 8k: 1.28x / 1.31x the bf16 time, causal /
# not, against the pass's 1.10x / 1.05x; BENCHMARKS.md).  So the widening pays for short queries
# over long keys (chunked prefill, appends, speculative decoding), the pass for long prefills.
KV8_PASS_RATE = 2.6e12  # bytes / s the dequantizing pass moves (1 read + 2 written per element)
KV8_WIDEN_S = 0.47e-6  # seconds of one SM per (query tile, 128-key block) widened in the kernel
KV8_BLOCK = 128  # keys per block of the hd128 kernel
KV8_PASS_IN_KERNEL = True  # the pass run by the prefill kernel's producer warps where it serves the plan
KV8_PASS_LAUNCH_S = 3e-6  # the pass's own launch and tail: what decides for small batches


def kv8_widening_pays(
    qo_lens, kv_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int, causal: bool, tile_q: int, num_sms: int,
    window_left: int = -1,
) -> bool:  # fmt: skip
    """Whether the kernel's own widening of a ragged fp8 cache beats the dequantizing KV pass,
    by the model above: the pass costs a launch and 6 x kv_tokens x kv_heads x head_dim bytes; the widening
    one unit per (query tile, key block), a tile being ``tile_q`` packed rows (GQA) of one kv
    head and its blocks the keys its queries attend on average."""
    qo = np.asarray(qo_lens, dtype=np.float64)
    kv = np.asarray(kv_lens, dtype=np.float64)
    group = num_qo_heads // num_kv_heads
    keys = attended_pairs(qo_lens, kv_lens, causal, window_left) / np.maximum(qo, 1.0)  # per query, on average
    units = num_kv_heads * float((np.ceil(qo * group / tile_q) * np.ceil(keys / KV8_BLOCK)).sum())
    t_widen = units * KV8_WIDEN_S / max(num_sms, 1)
    t_pass = KV8_PASS_LAUNCH_S + 6.0 * num_kv_heads * head_dim * float(kv.sum()) / KV8_PASS_RATE
    return t_widen < t_pass


def attended_pairs(qo_lens, kv_lens, causal: bool, window_left: int = -1) -> np.ndarray:
    """(query, key) pairs each request attends: causal is bottom-right aligned; a window hides
    the keys more than ``window_left`` to the left of a query."""
    qo = np.asarray(qo_lens, dtype=np.float64)
    kv = np.asarray(kv_lens, dtype=np.float64)
    pairs = qo * kv
    if causal:  # query i (of qo) sees kv - qo + i + 1 keys; a window: at most window_left + 1
        pairs = pairs - qo * (qo - 1) / 2
        if window_left >= 0:
            pairs = np.minimum(pairs, qo * (window_left + 1.0))
    elif window_left >= 0:  # query i misses the max(0, kv - qo + i - window_left) keys on its left
        a = kv - qo - window_left
        m = np.maximum(0.0, qo + np.minimum(a, 0.0))  # queries that miss any key
        pairs = pairs - (m * np.maximum(a, 0.0) + m * (m - 1) / 2)
    return pairs


def kv_pass_pays(
    qo_lens,
    kv_lens,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool,
    transform: bool,
    elt_bytes: int = 2,
    window_left: int = -1,
    page_boxes: bool = False,
) -> bool:
    """Whether gathering a paged cache by the KV pass (then reading it by TMA) beats the
    kernel's in-kernel gather, by the model above: the pass costs 2 x 2 x kv_tokens x kv_heads
    x head_dim x elt_bytes bytes; it saves a share of 4 x head_dim x qo_heads x attended pairs
    FLOPs.  It pays when each key is read by enough query rows: non-causal, about qo_len x
    group >= 1800 (>= 360 with a key transform; >= 4500 where the kernel would read the pages
    by TMA boxes, ``page_boxes``); causal with qo_len = kv_len, twice that."""
    kv = np.asarray(kv_lens, dtype=np.float64)
    pairs = attended_pairs(qo_lens, kv_lens, causal, window_left)
    t_attn = 4.0 * head_dim * num_qo_heads * float(pairs.sum()) / PASS_ATTN_RATE
    t_pass = 4.0 * num_kv_heads * head_dim * elt_bytes * float(kv.sum()) / PASS_COPY_RATE
    saves = PASS_SAVES_TRANSFORM if transform else PASS_SAVES_BOXES if page_boxes else PASS_SAVES_GATHER
    return bool(kv.sum() > 0 and saves * t_attn > t_pass)
