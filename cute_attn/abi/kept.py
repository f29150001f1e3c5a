"""A kept decode plan on the device: the records ``sched.reuse`` writes and
``kernels/kept_update.py`` reads to put the last full decode plan's work items on the lengths
the device holds at each replay (the engine's ``kv_indptr`` / ``kv_last_page_len`` buffers).
Apart from ``records`` so that only that kernel's cache key hashes it."""

# -- parameters: int32[KEPT_PARAMS] ------------------------------------------------------
K_ON = 0  # 1: the update runs; 0: the records are the host's (the kernel returns at once)
K_BATCH = 1
K_SORT_LOG2 = 2  # the length sort's size: 2^K_SORT_LOG2 >= batch keys
K_PAGE_SIZE = 3
K_NUM_CTAS = 4
K_NUM_MERGES = 5
K_EPOCH = 6  # which full plan these items are from (echoed in the status word)
K_PER_ITEM = 7  # the planner's modelled fixed cost of one item
K_BETA = 8  # the planner's cost of one kv token
K_BOUND_Q20 = 9  # balance bound (``reuse.KeptPlan.bound``) x 2^20
K_MAX_KV_LEN = 10  # the planner's limit: a longer length counts as invalid
K_NUM_ITEMS = 11
KEPT_PARAMS = 16

# -- one record per work item of the full plan: int32[items, KEPT_ITEM_FIELDS] -------------
KI_RANK = 0  # length rank of its request (0: the longest; ties by request index)
KI_START = 1  # its kv range in the full plan; both ends are clamped to the new length
KI_END = 2  # -1: the last chunk of its (request, kv head), which ends at the new length
KI_CTA = 3  # the CTA whose list holds it
KEPT_ITEM_FIELDS = 4

# -- the status word the kernel writes into host memory: epoch * 4 + these bits ------------
KS_UNBALANCED = 1  # the kept items are out of balance: the next step plans anew
KS_BAD_LENGTHS = 2  # a request's pages / last-page length on the device were invalid (read as 0)

MAX_BATCH = 2048  # requests the kernel sorts in shared memory (larger batches keep host plans)
MAX_CTAS = 2048  # CTAs whose kv tokens it sums in shared memory
