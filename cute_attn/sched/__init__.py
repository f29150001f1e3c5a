"""The scheduler: a CPU plan (numpy, no GPU) that persistent attention kernels execute.

This docstring is the contract between ``plan()`` and the kernels. Everything is int32.

Packing and tiles
-----------------
``group = num_qo_heads // num_kv_heads``. Request b has ``qo_len = qo_indptr[b+1] -
qo_indptr[b]`` query tokens; for one kv head h its *packed rows* are ``r = 0 .. qo_len *
group - 1``, row r being query token ``r // group`` (global row ``qo_indptr[b] + r //
group`` of q / o) of qo head ``h * group + r % group``: one kv read serves the whole group.
With ``plan(heads_per_item=H)`` (decode's head packing) the plan is that of ``num_kv_heads /
H`` heads and ``group = H * num_qo_heads // num_kv_heads`` (``Plan.group_size``, meta
``GROUP_SIZE``): "kv head" h below is then the head group of kv heads ``h*H .. h*H + H - 1``,
and the rule above still names each row's qo head, since the qo heads of consecutive kv heads
are consecutive (the row's kv head is its qo head // (group / H)).
Packed rows are cut into tiles of ``cta_tile_q`` rows (one value per plan -- one kernel
specialization -- in ``meta``); tile t holds rows ``[t * cta_tile_q, min((t+1) *
cta_tile_q, qo_len * group))``.

Causal masking is bottom-right aligned: query token i (0-based within the request) sees kv
positions ``[0, kv_len - qo_len + i]`` (none when that is negative). A row that sees no key
in an item's range has partial state (o = 0, lse = -inf); a row that sees no key at all gets
o = 0, lse = -inf in the final output.

Work items (``work_items``: int32 [num_work_items, WORK_FIELDS = 12])
----------------------------------------------------------------------
Field order (constants ``W_*`` in ``cute_attn.sched.workspace``)::

    0 REQ         request index b
    1 KV_HEAD     kv head h
    2 ROW_START   first packed row of the tile (relative to the request)
    3 NUM_ROWS    packed rows in the tile, 1 .. cta_tile_q
    4 KV_START    kv token range [KV_START, KV_END) within the request (positions, not
    5 KV_END        pages: token p is in page kv_indices[kv_indptr[b] + p // page_size])
    6 DEST        -1: write the final o / lse rows; s >= 0: write partial slot s
    7 QO_OFFSET   qo_indptr[b]
    8 QO_LEN      qo_len of b
    9 KV_LEN      kv_len of b (causal diagonal offset = KV_LEN - QO_LEN)
    10 CHUNK      this chunk's index in its tile's merge order (0 .. NUM_CHUNKS - 1)
    11 NUM_CHUNKS chunks the (tile, kv head) was cut into; 1 <=> DEST == -1

CTA c (grid = num_ctas = num_sms * ctas_per_sm, fixed) runs items ``work_indptr[c] ..
work_indptr[c+1] - 1`` in that order (prefill: the request-major dealing's global order, or
by request, kv head, last tile first; ``locality``). An item computes attention of its
tile's rows over its kv range (with the causal mask if ``meta[CAUSAL]``). KV_START is page-aligned except
where a chunk was cut at a non-aligned tile end. An item with KV_START == KV_END (a tile
that sees no key) writes o = 0, lse = -inf. Chunk boundaries lie within what the tile's last
row may see, so no item is entirely masked for every row.

Partial slots
-------------
Slot s holds one tile for one kv head: ``partial_o[s * cta_tile_q + j, :]`` (fp32,
[max_partial_rows, head_dim]) and ``partial_lse[s * cta_tile_q + j]`` (fp32, base 2, like
the final LSE) for row j = packed row ROW_START + j, j < NUM_ROWS. ``partial_o`` is the
normalized output over the item's kv range.

Merge tasks (``merge_tasks``: int32 [num_merge_tasks, MERGE_FIELDS = 8])
-----------------------------------------------------------------------
One per split (tile, kv head)::

    0 REQ  1 KV_HEAD  2 ROW_START  3 NUM_ROWS  4 QO_OFFSET  5 SLOT_START  6 NUM_SLOTS  7 (0)

Row j < NUM_ROWS: ``state = slot SLOT_START ⊕ slot SLOT_START+1 ⊕ ... ⊕ slot
SLOT_START+NUM_SLOTS-1``, folded left to right in that fixed order (deterministic output);
write it to o / lse of token QO_OFFSET + (ROW_START + j) // group, qo head KV_HEAD * group
+ (ROW_START + j) % group. All -inf -> o = 0, lse = -inf. The merge kernel is persistent:
its CTAs share the rows of all tasks (``kernels/merge.py``, MergePartials: units of rows, task-
minor over the grid; any split of the rows among CTAs meets this contract). It is launched after the
attention kernel as a programmatic dependent and waits for that grid (``griddepcontrol.wait``)
before it reads a partial.

meta (int32 [16], constants ``META_*``)
---------------------------------------
num_work_items, num_merge_tasks, cta_tile_q, num_ctas, num_partial_slots, group_size,
kv_chunk (pre-cut length), batch_size, total_qo_rows, causal, num_qo_heads, num_kv_heads.
Counts live in device memory so a captured CUDA graph replays any plan.

Workspace (``WorkspaceLayout``)
-------------------------------
One byte buffer; each section at a 256-byte-aligned offset fixed by the limits and
num_ctas: meta, work_indptr [C+1], merge_tasks [max_merge_tasks, 8], work_items
[max_work_items, 12] (these int32 sections are what ``plan()`` uploads: one non-blocking
copy of the prefix up to the last work item in use), then partial_lse [max_partial_rows]
and partial_o [max_partial_rows, head_dim] (fp32; written by the attention kernel, read by
the merge kernel).

Scheduling (see ``cost`` and ``assign``)
----------------------------------------
cost = alpha * cta_tile_q + beta * kv tokens (2, 1). Items are (tile, kv head) pairs,
sorted by cost. If whole items can be balanced within ``balance_tol`` -- dealt in a snake
(round-robin, alternating direction), else LPT-style to the least-loaded CTA -- nothing is
split. Otherwise (a tile longer than a CTA's share, or too few items) the items are laid on
a line and cut at the CTA boundaries (McNaughton's wrap-around rule), page-aligned, no
piece shorter than a minimum that scales with a CTA's fair share (floor max(page, 64)
tokens, ``cost.min_chunk_len``); kept only where it beats whole items. The busiest CTA is
within the largest item of the mean (tested). Deterministic: same input, same bytes.
Several tiles per request (prefill): first dealt request-major in rounds of one item per CTA
(``locality.request_rounds``: the CTAs then read a few heads' K/V at a time, from L2), kept
within ``locality_tol`` of the mean or a quarter of it of the plan above.
Batch-invariant mode (``kv_split_size=S``): every tile is cut at multiples of S and
nothing else, with a tile size that does not depend on the batch, so a request's items
and merge order are the same whatever else is batched with it.
Batches of one query tile per request (decode; ``plan(None, kv_lens)`` for one query token
each) take a vectorized path with the same candidates and rules but no per-CTA Python loop
(``fast``): the per-step re-plan of a serving engine. The records are those above.
"""

from .check import verify_plan
from .inputs import kv_lens_from_paged, kv_lens_from_ragged
from .plan import Plan, Planner
from .workspace import Limits, WorkspaceLayout

__all__ = ["Limits", "Plan", "Planner", "WorkspaceLayout", "kv_lens_from_paged", "kv_lens_from_ragged", "verify_plan"]
