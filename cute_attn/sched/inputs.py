"""Index arrays in, int64 numpy arrays out, with errors that name the argument and index.

numpy arrays, lists and CPU tensors are read in place: nothing here touches a GPU. A CUDA
tensor is copied to the host with ``.cpu()``, which waits for the device (the one case in
which planning synchronizes; pass host copies of the index arrays to avoid it).
"""

from __future__ import annotations

import numpy as np


def as_index_array(name: str, x, length: int | None = None) -> np.ndarray:
    """1-D int64 numpy array from an int array / list / torch tensor."""
    if hasattr(x, "detach") and hasattr(x, "device"):  # torch.Tensor, without importing torch
        if x.device.type != "cpu":
            x = x.detach().cpu()  # device -> host: synchronizes (documented above)
        x = x.detach().numpy()
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(a.shape)}")
    if a.dtype.kind not in "iu":
        if a.size == 0 and a.dtype.kind == "f":
            a = a.astype(np.int64)  # np.asarray([]) is float64
        else:
            raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {a.shape[0]}")
    return a.astype(np.int64, copy=False)


def check_indptr(name: str, a: np.ndarray) -> np.ndarray:
    """Validate an indptr (length >= 1, starts at 0, non-decreasing); return its diff."""
    return indptr_lengths(name, a)[0]


def indptr_lengths(name: str, a: np.ndarray):
    """``check_indptr``, returning (diff, min of diff or None when empty)."""
    if a.shape[0] < 1:
        raise ValueError(f"{name} must have at least one element (batch_size + 1)")
    if a[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(a[0])}")
    d = a[1:] - a[:-1]
    if d.shape[0] == 0:
        return d, None
    dmin = int(d.min())
    if dmin < 0:
        i = int(np.argmax(d < 0)) + 1
        raise ValueError(f"{name} is not non-decreasing at index {i} ({int(a[i - 1])} > {int(a[i])})")
    return d, dmin


def check_lengths(name: str, a: np.ndarray, upper: int, upper_name: str) -> None:
    if a.shape[0] == 0:
        return
    if a.min() < 0:
        i = int(np.argmax(a < 0))
        raise ValueError(f"{name}[{i}] is negative ({int(a[i])})")
    if a.max() > upper:
        i = int(np.argmax(a > upper))
        raise ValueError(f"{name}[{i}] = {int(a[i])} exceeds {upper_name} ({upper})")


def kv_lens_from_ragged(kv_indptr) -> np.ndarray:
    """kv lengths of ragged (contiguous) KV: kv_indptr[b+1] - kv_indptr[b]."""
    return check_indptr("kv_indptr", as_index_array("kv_indptr", kv_indptr))


def kv_lens_from_paged(
    kv_indptr, last_page_len, page_size: int, kv_indices=None, num_pages_total: int | None = None
) -> np.ndarray:
    """kv lengths of a paged cache, FlashInfer's convention.

    kv_indptr[b] .. kv_indptr[b+1] index request b's pages in ``kv_indices``; the last page
    holds ``last_page_len[b]`` tokens, in [1, page_size] when the request has pages (ignored
    when it has none). kv_len = (num_pages - 1) * page_size + last_page_len, 0 for 0 pages.
    When ``kv_indices`` is given, the pages in use (its first kv_indptr[-1] entries) must lie
    in [0, num_pages_total) (checked only when num_pages_total is given).
    """
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    indptr = as_index_array("kv_indptr", kv_indptr)
    num_pages = check_indptr("kv_indptr", indptr)
    last = as_index_array("last_page_len", last_page_len, num_pages.shape[0])
    has = num_pages > 0
    # 1 <= last <= page_size <=> last - 1, read as unsigned, < page_size (one compare)
    bad = (last - 1).view(np.uint64) >= page_size
    if bad.any() and (bad & has).any():
        bad &= has
        i = int(np.argmax(bad))
        raise ValueError(
            f"last_page_len[{i}] = {int(last[i])} is outside [1, page_size={page_size}] "
            f"(request {i} has {int(num_pages[i])} pages)"
        )
    if kv_indices is not None:
        idx = as_index_array("kv_indices", kv_indices)
        used = int(indptr[-1])
        if idx.shape[0] < used:
            raise ValueError(f"kv_indices has {idx.shape[0]} entries, kv_indptr[-1] needs {used}")
        if used:
            u = idx[:used]
            hi = num_pages_total if num_pages_total is not None else np.iinfo(np.int64).max
            bad = (u < 0) | (u >= hi)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"kv_indices[{i}] = {int(u[i])} is outside [0, num_pages_total={hi})")
    return np.where(has, num_pages * page_size + (last - page_size), 0)


def _host_view(x):
    """``x`` as a numpy array without a copy where it is one already or a CPU tensor (None:
    anything else, which ``as_index_array`` handles)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return x.numpy()  # a CPU tensor without grad; a CUDA tensor raises
    except (AttributeError, TypeError, RuntimeError):
        return None


def _step_indptr(kv_indptr, batch: int):
    """A decode step's host ``kv_indptr`` read in place where it is plainly one (``batch + 1``
    integers from 0), else None."""
    ip = _host_view(kv_indptr)
    ok = ip is not None and ip.dtype.kind in "iu" and ip.shape == (batch + 1,) and batch > 0 and ip[0] == 0
    return ip if ok else None


def _step_tails(last_page_len, page_size: int, batch: int):
    """``kv_last_page_len - 1`` of a decode step's host array where every value is in [1,
    page_size] (checked in one unsigned reduction), else None."""
    last = _host_view(last_page_len)
    if last is None or last.dtype.kind != "i" or last.shape != (batch,):
        return None
    tail = last - 1
    return tail if tail.view(np.uint32 if tail.dtype.itemsize == 4 else np.uint64).max() < page_size else None


def step_kv_lens(kv_indptr, last_page_len, page_size: int, batch: int):
    """``kv_lens_from_paged`` for the per-step re-plan of a decode batch: host arrays of
    ``batch`` requests read in place, valid input checked in two whole-array reductions;
    anything else (a CUDA tensor, a list, an error to name) takes ``kv_lens_from_paged``. Page
    size 1 ignores ``last_page_len`` (every last page holds its one token), as FlashInfer.
    Returns (kv lengths int64, a bound on them or None)."""
    ip = _step_indptr(kv_indptr, batch)
    if ip is not None:
        pages = (ip[1:] - ip[:-1]).astype(np.int64)
        if page_size == 1:
            if pages.min() >= 0:
                return pages, int(ip[-1])
        else:
            tail = _step_tails(last_page_len, page_size, batch)
            if tail is not None and pages.min() > 0:
                pages *= page_size
                pages += tail
                pages += 1 - page_size
                return pages, int(ip[-1]) * page_size
    last = np.ones(batch, dtype=np.int64) if page_size == 1 else last_page_len
    return kv_lens_from_paged(kv_indptr, last, page_size), None


def paged_lengths_valid(kv_indptr, last_page_len, page_size: int, batch: int) -> bool:
    """Whether a decode step's host ``kv_indptr`` / ``kv_last_page_len`` (``batch`` requests)
    are plainly valid -- pages >= 0 and every last page in [1, page_size] -- in the fewest
    whole-array operations (False also for what needs a closer look: the full checks name it)."""
    ip = _step_indptr(kv_indptr, batch)
    if ip is None or (ip[1:] - ip[:-1]).min() < 0:
        return False
    return page_size == 1 or _step_tails(last_page_len, page_size, batch) is not None


def lengths_valid(kv_lens, batch: int) -> bool:
    """Whether a decode step's host kv lengths (vLLM's ``seq_lens_cpu``) are plainly valid:
    ``batch`` non-negative integers (False also for what needs a closer look)."""
    a = _host_view(kv_lens)
    return a is not None and a.dtype.kind in "iu" and a.shape == (batch,) and batch > 0 and a.min() >= 0


def step_lengths(kv_lens, batch: int) -> np.ndarray:
    """kv lengths given directly (vLLM's ``seq_lens_cpu``) for a per-step re-plan: a host
    array read in place and checked in one reduction, else ``as_index_array``'s checks."""
    a = _host_view(kv_lens)
    if a is not None and a.dtype.kind == "i" and a.shape == (batch,) and (batch == 0 or a.min() >= 0):
        return a.astype(np.int64)
    a = as_index_array("kv_lens", kv_lens, batch)
    check_lengths("kv_lens", a, np.iinfo(np.int64).max, "int64")
    return a


def check_lengths_fit_pages(kv_indptr, kv_lens, page_size: int) -> None:
    """kv lengths given beside a page indptr (vLLM's ``_cached_module.plan``: ``seq_lens_cpu``
    and ``paged_kv_indptr_cpu``): the indptr non-decreasing and each length within its
    request's pages (a longer one would read the next request's pages).  Host arrays only
    (anything else is not checked here)."""
    ip, lens = _host_view(kv_indptr), _host_view(kv_lens)
    if ip is None or lens is None or ip.ndim != 1 or lens.shape != (ip.shape[0] - 1,):
        return
    pages = np.diff(ip.astype(np.int64))
    if pages.size and pages.min() < 0:
        raise ValueError("kv_indptr must be non-decreasing")
    over = lens > pages * page_size
    if over.any():
        b = int(np.argmax(over))
        raise ValueError(
            f"request {b}: kv length {int(lens[b])} exceeds its {int(pages[b])} pages of {page_size} tokens"
        )
