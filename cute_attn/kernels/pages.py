"""Page ids read from a caller's page table, made safe to dereference.

A page table on the GPU cannot be checked on the host without a synchronization, and a wrong id
would make a kernel read outside the cache: an illegal address that loses the whole CUDA
context of a serving process.  Every kernel that turns a page id into an address passes it
through :func:`in_cache` first, so a bad id reads some page of the cache instead (wrong values
for that request only; ``CUTE_ATTN_CHECK_INDICES=1`` makes the wrappers check the ids and
raise).  Two integer selects per looked-up page: nothing next to the copy it guards.  Paged TMA
boxes need no guard: the tensor map bounds-checks their coordinates (zero fill)."""

from __future__ import annotations

import cutlass


def in_cache(page, num_pages):
    """``page`` clamped into ``[0, num_pages)``."""
    page = cutlass.select_(page < num_pages, page, num_pages - 1)
    return cutlass.select_(page >= 0, page, 0)
