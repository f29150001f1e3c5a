"""The records the planner (``sched``) writes into the workspace and the kernels read: field
indices of a work item, a merge task and the meta block.  Every kernel that walks a plan and
the planner that makes it import these, so the two cannot disagree; a kernel's cache key
hashes this file (changing a field changes the binaries)."""

# -- work item: one int32 record of WORK_FIELDS values ------------------------------------
W_REQ = 0  # request index b
W_KV_HEAD = 1  # kv head h
W_ROW_START = 2  # first packed row of the tile, relative to the request (a multiple of tile)
W_NUM_ROWS = 3  # packed rows in the tile, 1..cta_tile_q
W_KV_START = 4  # first kv token position, relative to the request
W_KV_END = 5  # one past the last kv token position (kv_start <= kv_end <= kv_len)
W_DEST = 6  # -1: write the final output; >= 0: partial slot index
W_QO_OFFSET = 7  # qo_indptr[b]: row of the request's first query token in q / o
W_QO_LEN = 8  # qo_len of the request
W_KV_LEN = 9  # kv_len of the request (causal diagonal offset is kv_len - qo_len)
W_CHUNK = 10  # index of this kv chunk within its tile = its position in the merge order
W_NUM_CHUNKS = 11  # chunks of this tile (1: unsplit, W_DEST == -1)
WORK_FIELDS = 12

# -- merge task: one int32 record of MERGE_FIELDS values -----------------------------------
M_REQ = 0
M_KV_HEAD = 1
M_ROW_START = 2
M_NUM_ROWS = 3
M_QO_OFFSET = 4
M_SLOT_START = 5  # the task's partial slots are SLOT_START .. SLOT_START + NUM_SLOTS - 1,
M_NUM_SLOTS = 6  # in kv order: merge them left to right
M_RESERVED = 7
MERGE_FIELDS = 8

# -- meta: int32[META_FIELDS], read by the kernels (counts are data, not launch arguments) --
META_NUM_WORK_ITEMS = 0
META_NUM_MERGE_TASKS = 1
META_CTA_TILE_Q = 2
META_NUM_CTAS = 3
META_NUM_PARTIAL_SLOTS = 4
META_GROUP_SIZE = 5
META_KV_CHUNK = 6  # length tiles were pre-cut at (0: none; the wrap-around split may still cut)
META_BATCH_SIZE = 7
META_TOTAL_QO_ROWS = 8  # qo_indptr[-1]
META_CAUSAL = 9
META_NUM_QO_HEADS = 10
META_NUM_KV_HEADS = 11
META_FIELDS = 16
