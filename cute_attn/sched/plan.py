"""``Planner.plan()``: validate, tile, cut, assign, write the records, stage, upload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import workspace as ws
from .assign import Snake, ids, lpt_assign, ones, refine_pairs, wrap_fill
from .cost import build_tiles, choose_cta_tile_q, chunk_counts, cut_schedule, min_chunk_len
from .fast import OneTilePath
from .inputs import as_index_array, check_lengths, indptr_lengths, kv_lens_from_paged, kv_lens_from_ragged
from .locality import locality_order, request_rounds
from .reuse import KeptPlan
from .staging import Staging
from .workspace import Limits, WorkspaceLayout

_NO_MERGE = np.empty((0, ws.MERGE_FIELDS), np.int32)
_NO_MERGE.flags.writeable = False


@dataclass
class Plan:
    """One batch's schedule (host copies; ``Planner`` stages the same bytes for upload)."""

    work_items: np.ndarray  # int32 [num_work_items, WORK_FIELDS], CTA-major
    work_indptr: np.ndarray  # int32 [num_ctas + 1]
    merge_tasks: np.ndarray  # int32 [num_merge_tasks, MERGE_FIELDS]
    meta: np.ndarray  # int32 [META_FIELDS]
    cta_cost: np.ndarray  # int64 [num_ctas], modelled cost per CTA (diagnostics)
    cta_tile_q: int
    group_size: int
    num_ctas: int
    kv_chunk: int  # kv length tiles were pre-cut at (0: none), see META_KV_CHUNK
    causal: bool
    min_kv_chunk: int = 0  # shortest piece a wrap-around cut could leave (0: no cut tried)

    @property
    def num_work_items(self) -> int:
        return int(self.work_items.shape[0])

    @property
    def num_merge_tasks(self) -> int:
        return int(self.merge_tasks.shape[0])

    @property
    def num_partial_slots(self) -> int:
        return int(self.meta[ws.META_NUM_PARTIAL_SLOTS])

    @property
    def has_split(self) -> bool:
        return self.merge_tasks.shape[0] > 0


def limit_of(loads, tol: float) -> float:
    """``C * max load`` may be up to this for ``loads`` to count as balanced within tol."""
    return (1.0 + tol) * int(loads.sum())


class Planner:
    """Plans for one wrapper: holds the workspace layout and the (pinned) staging buffers.

    ``num_ctas = num_sms * ctas_per_sm`` is the persistent grid; it is passed in, never
    queried. ``alpha``/``beta``: the cost model (see ``cost``). ``min_kv_chunk``: the
    upper end of the shortest kv chunk a cut may leave; the minimum itself scales with a
    CTA's fair share, with a floor (``cost.min_chunk_len``). ``balance_tol``: how far
    above the mean the busiest CTA may be with whole (unsplit) items before the
    wrap-around split is tried (it costs planning time and extra partials + a merge, so it
    runs only where whole items fall short). ``order_block``: the snake deals items in
    descending cost with extents rounded up to this many kv tokens (the kernels' block), so
    tiles of one request that differ by a few keys stay adjacent (1: exact order).
    ``num_staging``: staging
    buffers used in turn, so that a plan never overwrites bytes an earlier upload may still
    be reading (with CUDA, an event per buffer; a wait happens only if the CPU is that many
    plans ahead of the copies). ``keep_tol`` (default ``balance_tol``): how far the balance of a
    kept decode plan may drift from its full plan's before ``replan`` plans anew (``reuse``).
    ``fast_path``: batches of one query tile per request
    (decode) go to the vectorized path of ``fast`` (False: always the general one below).
    ``locality_tol``: batches of several tiles per request are first dealt request-major
    (``locality.request_rounds``: few heads' K/V in flight, read from L2) and kept if the
    busiest CTA is within this of the mean, or a quarter of it of the cost-ordered plan's;
    negative: never.

    Per plan (``_plan_balanced``): whole items by the snake if that is within
    ``balance_tol``, else by LPT (+ pairwise refinement where CTAs hold few items) if that
    is, else the pre-cut candidate (tiles longer than a CTA's share cut at multiples of it,
    LPT over the pieces) if that is, else the lower modelled makespan (``_score``: busiest
    CTA + merge rounds; ties: fewer merges, then fewer items) of the pre-cut candidate (or
    whole items by LPT) and the wrap-around split (kept only if it fits the partial slots
    and keeps the LPT bound) (``assign`` module doc). The pre-cut candidate comes first
    because the kernel pays for every item and every split more than the model says:
    the wrap-around rule packs runs of short items onto a few CTAs and cuts an item at
    almost every CTA boundary (docs/history/benchmarks-notebook.md, "H200 decode regression").
    """

    def __init__(
        self,
        limits: Limits,
        num_sms: int,
        ctas_per_sm: int = 1,
        *,
        alpha: int = 2,
        beta: int = 1,
        min_kv_chunk: int = 256,
        balance_tol: float = 0.05,
        order_block: int = 64,
        locality_tol: float = 0.02,
        keep_tol: Optional[float] = None,
        num_staging: int = 2,
        pin_memory: Optional[bool] = None,
        fast_path: bool = True,
    ):
        for name, v in (("num_sms", num_sms), ("ctas_per_sm", ctas_per_sm)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, v in (("alpha", alpha), ("beta", beta), ("min_kv_chunk", min_kv_chunk)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if alpha + beta == 0:
            raise ValueError("alpha and beta cannot both be 0")
        self.limits = limits
        self.num_ctas = num_sms * ctas_per_sm
        self.layout = WorkspaceLayout(limits, self.num_ctas)
        self.alpha, self.beta = alpha, beta
        self.min_kv_chunk = min_kv_chunk
        self.balance_tol = balance_tol
        self.order_block = order_block
        self.locality_tol = locality_tol
        self.keep_tol = balance_tol if keep_tol is None else keep_tol
        self.fast_path = fast_path
        if pin_memory is None:
            import torch

            pin_memory = torch.cuda.is_available()
        self._staging = Staging(self.layout, self.num_ctas, num_staging, pin_memory)
        self._kept = None  # KeptPlan of the last full decode plan, made at its first replan
        self._keep_args = None  # (plan, per_item) of the last full decode plan, None: not kept
        self._tmpl = self._template(limits.max_batch)
        self._snake = Snake(self.num_ctas)
        self._fast = OneTilePath(self.num_ctas)

    @staticmethod
    def _template(rows: int) -> np.ndarray:
        """Fields of unsplit tile records that do not depend on the batch when tile i is
        request i's only one: REQ i, ROW_START 0, KV_START 0, DEST -1, CHUNK 0, NUM_CHUNKS 1."""
        t = np.zeros((rows, ws.WORK_FIELDS), np.int32)
        t[:, ws.W_REQ] = np.arange(rows)
        t[:, ws.W_DEST] = -1
        t[:, ws.W_NUM_CHUNKS] = 1
        return t

    # -- entry points -------------------------------------------------------------------
    def plan_paged(
        self,
        qo_indptr,
        kv_indptr,
        last_page_len,
        page_size: int,
        *,
        kv_indices=None,
        num_pages_total: Optional[int] = None,
        **kw,
    ) -> Plan:
        kv_lens = kv_lens_from_paged(kv_indptr, last_page_len, page_size, kv_indices, num_pages_total)
        return self.plan(qo_indptr, kv_lens, page_size=page_size, **kw)

    def plan_ragged(self, qo_indptr, kv_indptr, **kw) -> Plan:
        return self.plan(qo_indptr, kv_lens_from_ragged(kv_indptr), **kw)

    def plan(
        self,
        qo_indptr,
        kv_lens,
        *,
        causal: bool = False,
        page_size: int = 1,
        num_qo_heads: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        cta_tile_q: Optional[int] = None,
        kv_split_size: Optional[int] = None,
        heads_per_item: int = 1,
        workspace=None,
    ) -> Plan:
        """Plan one batch, stage it in the host buffer and, given a device ``workspace``
        tensor (>= ``layout.total_bytes`` bytes), enqueue its upload (one non-blocking copy).

        ``qo_indptr`` None: one query token per request (decode: ``arange(len(kv_lens) + 1)``,
        which then is neither built by the caller nor checked).

        ``kv_split_size``: batch-invariant mode -- every tile is cut at multiples of this
        many kv tokens whatever else is in the batch, and the tile size must not depend on
        the batch either: ``cta_tile_q`` if given, else the rule applied to
        ``limits.max_qo_len`` (default ``max_total_q_tokens``) packed rows.

        ``heads_per_item`` = h packs h consecutive kv heads into one item: the plan is that of
        num_kv_heads / h heads with group * h packed rows per query token (query heads of
        consecutive kv heads are consecutive, so the records' row -> (token, qo head) rule is
        unchanged with the plan's ``group_size``), and an item's kv token costs h (the cost
        model's per-item term is charged as alpha * tile / h in units of h tokens).  For the
        decode kernel's head packing (``kernels/decode.py``).
        """
        lim = self.limits
        hq = lim.num_qo_heads if num_qo_heads is None else num_qo_heads
        hk = lim.num_kv_heads if num_kv_heads is None else num_kv_heads
        if not (isinstance(hq, int) and isinstance(hk, int) and 1 <= hk and 1 <= hq):
            raise ValueError(f"num_qo_heads / num_kv_heads must be positive ints, got {hq!r} / {hk!r}")
        if hq > lim.num_qo_heads or hk > lim.num_kv_heads:
            raise ValueError(
                f"num_qo_heads={hq}, num_kv_heads={hk} exceed the limits ({lim.num_qo_heads}, {lim.num_kv_heads})"
            )
        if hq % hk:
            raise ValueError(f"num_qo_heads ({hq}) is not a multiple of num_kv_heads ({hk})")
        if not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        group = hq // hk
        h = heads_per_item
        if not isinstance(h, (int, np.integer)) or h < 1 or hk % h:
            raise ValueError(f"heads_per_item must be a positive divisor of num_kv_heads ({hk}), got {h!r}")
        hk, group = hk // h, group * h

        kv_len = None
        if qo_indptr is None:  # one query token per request: arange(batch + 1), nothing to check
            kv_len = as_index_array("kv_lens", kv_lens)
            b = kv_len.shape[0]
            qo_indptr, qo_len, qmin = ids(b + 1), ones(b), (1 if b else None)
        else:
            qo_indptr = as_index_array("qo_indptr", qo_indptr)
            qo_len, qmin = indptr_lengths("qo_indptr", qo_indptr)
            b = qo_len.shape[0]
        if b > lim.max_batch:
            raise ValueError(f"batch size {b} (len(qo_indptr) - 1) exceeds max_batch ({lim.max_batch})")
        total_q = int(qo_indptr[-1])
        if total_q > lim.max_total_q_tokens:
            raise ValueError(
                f"qo_indptr[-1] = {total_q} query tokens exceeds max_total_q_tokens ({lim.max_total_q_tokens})"
            )
        # qo_len >= 0 summing to b with min >= 1: all ones (decode), max known for free.
        qmax = None if qmin is None else 1 if (qmin == 1 and total_q == b) else int(qo_len.max())
        if lim.max_qo_len is not None and qmax is not None and qmax > lim.max_qo_len:
            check_lengths("qo_len (qo_indptr diff)", qo_len, lim.max_qo_len, "max_qo_len")
        if kv_len is None:
            kv_len = as_index_array("kv_lens", kv_lens, b)
        check_lengths("kv_lens", kv_len, lim.max_kv_len, "max_kv_len")

        if kv_split_size is not None:
            if not isinstance(kv_split_size, (int, np.integer)) or kv_split_size < 1:
                raise ValueError(f"kv_split_size must be a positive int, got {kv_split_size!r}")
        if cta_tile_q is None:
            if kv_split_size is not None:  # batch-invariant: from the limits, not the batch
                max_q = lim.max_qo_len if lim.max_qo_len is not None else lim.max_total_q_tokens
                tile = choose_cta_tile_q(max_q * group, 1)
            else:
                with_q = b if (qmin or 0) >= 1 else int(np.count_nonzero(qo_len))
                tile = choose_cta_tile_q(total_q * group, with_q)
        else:
            if (
                not isinstance(cta_tile_q, (int, np.integer))
                or cta_tile_q % ws.MIN_CTA_TILE_Q
                or not ws.MIN_CTA_TILE_Q <= cta_tile_q <= ws.MAX_CTA_TILE_Q
            ):
                raise ValueError(
                    f"cta_tile_q must be a multiple of {ws.MIN_CTA_TILE_Q} in "
                    f"[{ws.MIN_CTA_TILE_Q}, {ws.MAX_CTA_TILE_Q}], got {cta_tile_q!r}"
                )
            tile = int(cta_tile_q)

        req, row0, rows, ext, one_each = build_tiles(qo_len, kv_len, group, tile, causal, qmin, qmax)
        rec_args = (req, row0, rows, ext, one_each, qo_indptr, qo_len, kv_len, tile, group, causal)
        if self.fast_path and kv_split_size is None and one_each and self.beta > 0 and b:  # decode-like (``fast``)
            p = self._fast.plan(self, ext, hk, self.alpha * tile // h, int(page_size), rec_args)
        elif kv_split_size is None and one_each:
            p = self._plan_balanced(ext, hk, tile, int(page_size), self.alpha * tile // h, rec_args)
        elif kv_split_size is None:  # several tiles per request share its K/V
            p = self._plan_local(req, ext, kv_len, hk, tile, int(page_size), self.alpha * tile // h, rec_args)
        else:
            p = self._plan_invariant(ext, hk, tile, int(kv_split_size), self.alpha * tile // h, rec_args)
            if not one_each:  # several tiles per request share its K/V: order for L2 reuse
                p.work_items = locality_order(p.work_items, p.work_indptr)
        self._stage(p, b, total_q, hq, hk)
        decode = one_each and qmax == 1 and kv_split_size is None
        # kv_len may be the caller's array (read in place): the kept plan's ranks need this step's
        self._keep_args = (p, kv_len.copy(), self.alpha * tile // h) if decode else None
        self._kept = None
        if workspace is not None:
            self.upload(workspace)
        return p

    # -- scheduling and records ----------------------------------------------------------
    def _tile_records(self, nt, req, row0, rows, ext, one_each, qo_indptr, qo_len, kv_len):
        """One record per tile, unsplit (KV_HEAD 0): what every item of the tile starts from."""
        if nt > self._tmpl.shape[0]:
            self._tmpl = self._template(2 * nt)
        rec = self._tmpl[:nt].copy()  # REQ = arange, KV_START 0, DEST -1, CHUNK 0, NUM_CHUNKS 1
        rec[:, ws.W_NUM_ROWS] = rows
        rec[:, ws.W_KV_END] = ext
        if one_each:  # req is arange(b), row 0: no gathers
            rec[:, ws.W_QO_OFFSET] = qo_indptr[:-1]
            rec[:, ws.W_QO_LEN] = qo_len
            rec[:, ws.W_KV_LEN] = kv_len
        else:
            rec[:, ws.W_REQ] = req
            rec[:, ws.W_ROW_START] = row0
            rec[:, ws.W_QO_OFFSET] = qo_indptr[req]
            rec[:, ws.W_QO_LEN] = qo_len[req]
            rec[:, ws.W_KV_LEN] = kv_len[req]
        return rec

    def _plan_local(self, req, ext, kv_len, hk, tile, page, per_item, rec_args):
        """Whole items dealt request-major (``locality.request_rounds``) where the busiest CTA
        is within ``locality_tol`` of the mean, or within a quarter of it of the cost-ordered
        plan's busiest (that plan is then made too, and kept otherwise, each CTA's items in
        ``locality_order``): what a few tenths of a percent of balance buy back is K/V read
        from L2 instead of DRAM (an 8k chunk on a 56k prefix, 16 heads: 1.033 against 1.029
        of the mean, modelled K/V from DRAM 0.76 GB against 1.58; ``scripts/plan_locality.py``)."""
        tile_cost = self.beta * ext + per_item
        mean = hk * int(tile_cost.sum()) / self.num_ctas
        rr = None
        if self.locality_tol >= 0:
            # beyond balance_tol the cost-ordered plan splits items, and would be kept anyway
            rr = request_rounds(req, tile_cost, kv_len, hk, self.num_ctas, (1.0 + self.balance_tol) * mean)
            if rr is not None and int(rr[2].max()) <= (1.0 + self.locality_tol) * mean:
                return self._unsplit(*rr, None, hk, ext.shape[0], rec_args)
        p = self._plan_balanced(ext, hk, tile, page, per_item, rec_args)
        if rr is not None and int(rr[2].max()) <= (1.0 + self.locality_tol / 4) * int(p.cta_cost.max()):
            return self._unsplit(*rr, None, hk, ext.shape[0], rec_args)
        p.work_items = locality_order(p.work_items, p.work_indptr)
        return p

    def _plan_balanced(self, ext, hk, tile, page, per_item, rec_args):
        """Snake, else LPT (+ pairwise refinement), else the wrap-around split, else whole
        items (``assign`` module doc). The split is kept only if it fits the partial-slot
        section, keeps the LPT bound and lowers the makespan below whole items'."""
        nc, beta = self.num_ctas, self.beta
        nt = ext.shape[0]
        n = nt * hk
        if n == 0:
            return self._unsplit(ids(0), np.zeros(nc + 1, np.int64), np.zeros(nc, np.int64), None, hk, nt, rec_args)
        cost = beta * ext + per_item
        order = np.argsort(-cost, kind="stable")
        cs = cost[order]
        total = hk * int(cs.sum())
        limit = (1.0 + self.balance_tol) * total  # max load * C may be up to this
        lpt = None
        if int(cs[0]) * nc <= limit:  # whole items may do
            # The snake deals in block order: extents that round up to the same KV block count
            # as equal, so the tiles of one request (whose causal extents differ by a few keys)
            # stay in tile order and go to neighbouring CTAs in one round, where they read the
            # same KV at about the same time and L2 serves the later reads.
            blk = self.order_block
            by_block = order if blk <= 1 else np.argsort(-(beta * (-(-ext // blk)) + per_item), kind="stable")
            loads = np.bincount(self._snake.cta(n), cost[by_block].repeat(hk), nc)
            if loads.max() * nc <= limit:
                items, indptr = self._snake.cta_major(n)
                return self._unsplit(items, indptr, loads.astype(np.int64), by_block, hk, nt, rec_args)
            item_cost = cs.repeat(hk)
            lpt = lpt_assign(item_cost, nc)
            if int(lpt[1].max()) * nc <= limit:
                return self._unsplit_lpt(lpt, order, hk, nt, rec_args)
            lpt = refine_pairs(item_cost, lpt[0], nc) or lpt  # few items per CTA: LPT's weak spot
            if int(lpt[1].max()) * nc <= limit:
                return self._unsplit_lpt(lpt, order, hk, nt, rec_args)
        # Whole items cannot be balanced: cut. Two candidates (``assign`` module doc):
        # pre-cut + LPT -- few cuts, short items spread over the CTAs as fillers -- taken at
        # once if within tolerance; else the wrap-around split too, and the lower modelled
        # makespan (``_score``) wins, ties going to fewer merges, then fewer items.
        share = (total / nc - per_item) / beta if beta else 0
        m = min_chunk_len(int(share), page, self.min_kv_chunk)
        max_slots = self.layout.max_partial_rows // tile
        pre = self._precut(ext, hk, per_item, page, m, share, max_slots) if beta else None
        if pre is not None and int(pre["loads"].max()) * nc <= limit_of(pre["loads"], self.balance_tol):
            return self._precut_plan(pre, hk, nt, m, rec_args)
        wrap = self._wrap(ext, order, hk, per_item, page, m, max_slots)
        if pre is None:  # nothing to cut: whole items by LPT are the other candidate
            if wrap is not None and wrap["key"][0] < int(cs[0]):  # LPT's max >= largest item
                return self._wrap_plan(wrap, order, hk, nt, n, m, rec_args)
            if lpt is None:
                lpt = lpt_assign(cs.repeat(hk), nc)
            if wrap is None or (self._score(lpt[1], 0, per_item), 0, n) <= wrap["key"]:
                return self._unsplit_lpt(lpt, order, hk, nt, rec_args)
            return self._wrap_plan(wrap, order, hk, nt, n, m, rec_args)
        key_b = (self._score(pre["loads"], pre["merges"], per_item), pre["merges"], pre["items"])
        if wrap is not None and wrap["key"] < key_b:
            # Pairwise refinement may still bring the pre-cut plan level: worth its time
            # only where that plan is within tolerance of the wrap-around one.
            if key_b[0] > (1.0 + self.balance_tol) * wrap["key"][0] or not self._refine_precut(pre):
                return self._wrap_plan(wrap, order, hk, nt, n, m, rec_args)
            key_b = (self._score(pre["loads"], pre["merges"], per_item), pre["merges"], pre["items"])
            if wrap["key"] < key_b:
                return self._wrap_plan(wrap, order, hk, nt, n, m, rec_args)
        elif wrap is None:
            self._refine_precut(pre)
        return self._precut_plan(pre, hk, nt, m, rec_args)

    def _wrap(self, ext, order, hk, per_item, page, m, max_slots):
        """The wrap-around candidate (``assign.wrap_fill``, then pairwise refinement of its
        pieces if still out of tolerance), or None where it does not apply, does not fit
        the partial slots or breaks the LPT bound. ``key``: (score, merges, items)."""
        nc, beta = self.num_ctas, self.beta
        wf = wrap_fill(
            ext[order].repeat(hk),
            per_item=per_item,
            beta=beta,
            page=page,
            min_chunk=m,
            num_ctas=nc,
            tol=self.balance_tol,
        )
        if wf is None:
            return None
        item, start, stop, chunk, cta, loads, ncut = wf
        split = ncut > 0
        merges = int(np.count_nonzero(split))
        if int(ncut[split].sum()) + merges > max_slots:
            return None
        pc = per_item + beta * (stop - start)
        if int(loads.max()) * nc > limit_of(loads, self.balance_tol):
            r = refine_pairs(pc, cta, nc)  # trade whole pieces between CTAs
            if r is not None:
                cta, loads = r
                by = np.argsort(cta, kind="stable")  # CTA-major again
                item, start, stop, chunk, cta, pc = (item[by], start[by], stop[by], chunk[by], cta[by], pc[by])
        if int(loads.max()) * nc > int(loads.sum()) + nc * int(pc.max()):  # the LPT bound
            return None
        return dict(
            item=item,
            start=start,
            stop=stop,
            chunk=chunk,
            cta=cta,
            loads=loads,
            ncut=ncut,
            key=(self._score(loads, merges, per_item), merges, item.shape[0]),
        )

    def _wrap_plan(self, wp, order, hk, nt, n, m, rec_args):
        item = wp["item"]
        nch = np.empty(n, np.int64)
        nch[order.repeat(hk) * hk + ids(n) % hk] = wp["ncut"] + 1  # per (tile, head) pair
        return self._split(
            order[item // hk],
            item % hk,
            wp["start"],
            wp["stop"],
            wp["chunk"],
            nch,
            wp["cta"],
            wp["loads"],
            hk,
            nt,
            0,
            m,
            rec_args,
        )

    def _score(self, loads, merges: int, per_item: int) -> int:
        """Modelled makespan used to compare candidate plans: the busiest CTA, plus the
        merge pass (``ceil(merges / C)`` rounds of one per-item cost each -- a merge task
        reads its partial tiles and writes one output tile)."""
        return int(loads.max()) + per_item * (-(-merges // self.num_ctas))

    def _precut(self, ext, hk, per_item, page, m, share, max_slots):
        """The pre-cut candidate: tiles longer than a CTA's fair share are cut at multiples
        of it (page-aligned; a last piece shorter than ``m`` joins the one before), then all
        pieces x heads are assigned by LPT. Few cuts (a piece is about a CTA's share), and
        the short items end up spread over the CTAs as fillers, so no CTA gets a long run
        of them. The chunk doubles while the partial slots would not fit. Returns None when
        no tile is longer than the chunk, else a dict of the schedule."""
        chunk = max(m, int(share) // page * page)
        emax = int(ext.max())
        while True:
            if chunk >= emax:
                return None
            n = chunk_counts(ext, chunk, m)
            split = n > 1
            if not split.any():
                return None
            if hk * int(n[split].sum()) <= max_slots:
                break
            chunk *= 2
        n, tp, c, start, end, order, cta, loads, item_cost = cut_schedule(
            ext, chunk, per_item, self.beta, hk, self.num_ctas, m
        )
        return dict(
            chunk=chunk,
            n=n,
            t=tp,
            c=c,
            start=start,
            end=end,
            order=order,
            cta=cta,
            loads=loads,
            cost=item_cost,
            merges=hk * int(np.count_nonzero(split)),
            items=item_cost.shape[0],
        )

    def _refine_precut(self, pre) -> bool:
        """Pairwise refinement of the pre-cut candidate (in place); whether it improved."""
        r = refine_pairs(pre["cost"], pre["cta"], self.num_ctas)
        if r is None:
            return False
        pre["cta"], pre["loads"] = r
        return True

    def _precut_plan(self, pre, hk, nt, m, rec_args):
        nc, cta = self.num_ctas, pre["cta"]
        by_cta = np.argsort(cta.astype(np.int16 if nc < 2**15 else np.int32), kind="stable")
        q = pre["order"][by_cta // hk]
        return self._split(
            pre["t"][q],
            by_cta % hk,
            pre["start"][q],
            pre["end"][q],
            pre["c"][q],
            pre["n"].repeat(hk),
            cta[by_cta],
            pre["loads"],
            hk,
            nt,
            pre["chunk"],
            m,
            rec_args,
        )

    def _plan_invariant(self, ext, hk, tile, split, per_item, rec_args):
        """Batch-invariant mode: cut at multiples of ``split``, LPT over the chunks."""
        nc, nt = self.num_ctas, ext.shape[0]
        n, t, c, start, end, order, cta, loads, _ = cut_schedule(ext, split, per_item, self.beta, hk, nc)
        need = hk * int(n[n > 1].sum())
        max_slots = self.layout.max_partial_rows // tile
        if need > max_slots:
            raise ValueError(
                f"kv_split_size={split} needs {need} partial slots; the "
                f"workspace holds {max_slots} at cta_tile_q={tile}"
            )
        by_cta = np.argsort(cta.astype(np.int16 if nc < 2**15 else np.int32), kind="stable")
        q = order[by_cta // hk]
        nch = n.repeat(hk)  # pair id = tile * hk + head
        return self._split(
            t[q], by_cta % hk, start[q], end[q], c[q], nch, cta[by_cta], loads, hk, nt, split, 0, rec_args
        )

    def _unsplit_lpt(self, lpt, order, hk, nt, rec_args):
        cta, loads = lpt
        nc = self.num_ctas
        by_cta = np.argsort(cta.astype(np.int16 if nc < 2**15 else np.int32), kind="stable")
        indptr = np.zeros(nc + 1, np.int64)
        np.cumsum(np.bincount(cta, minlength=nc), out=indptr[1:])
        return self._unsplit(by_cta, indptr, loads, order, hk, nt, rec_args)

    def _unsplit(self, items, indptr, loads, order, hk, nt, rec_args):
        """Nothing split: one item per (tile, head), all direct. ``items``: ids of the
        cost-ordered items (item i = tile order[i // hk], head i % hk), CTA-major."""
        rec = self._tile_records(nt, *rec_args[:8])
        if hk & (hk - 1) == 0:
            sh = hk.bit_length() - 1
            t, h = items >> sh, items & (hk - 1)
        else:
            t, h = np.divmod(items, hk)
        w = rec.take(order.take(t) if order is not None else t, axis=0)
        w[:, ws.W_KV_HEAD] = h
        return self._finish_unsplit(w, indptr, loads, rec_args)

    def _finish_unsplit(self, w, indptr, loads, rec_args) -> Plan:
        """The Plan of unsplit records ``w`` (CTA-major) and their ``work_indptr``."""
        tile, group, causal = rec_args[8:]
        nc = self.num_ctas
        meta = np.array(
            (w.shape[0], 0, tile, nc, 0, group, 0, 0, 0, int(causal), 0, 0, 0, 0, 0, 0), np.int32
        )  # field order: META_* in workspace.py
        return Plan(
            work_items=w,
            work_indptr=indptr.astype(np.int32, copy=False),
            merge_tasks=_NO_MERGE,
            meta=meta,
            cta_cost=loads,
            cta_tile_q=tile,
            group_size=group,
            num_ctas=nc,
            kv_chunk=0,
            causal=bool(causal),
        )

    def _split(self, t, h, start, stop, chunk, nch_pair, cta, loads, hk, nt, kv_chunk, min_chunk, rec_args):
        """Records of pieces given CTA-major: tile t, head h, kv [start, stop), index chunk
        in the (tile, head) pair's merge order; ``nch_pair[tile * hk + head]``: chunks of
        each pair. Partial slots go to split pairs in pair order, chunks in merge order
        inside (a merge task's slots are contiguous)."""
        nc = self.num_ctas
        rec = self._tile_records(nt, *rec_args[:8])
        pid = t * hk + h
        nch = nch_pair[pid]
        nsl = np.where(nch_pair > 1, nch_pair, 0)
        slot0 = np.cumsum(nsl) - nsl
        w = rec.take(t, axis=0)
        w[:, ws.W_KV_HEAD] = h
        w[:, ws.W_KV_START] = start
        w[:, ws.W_KV_END] = stop
        w[:, ws.W_CHUNK] = chunk
        w[:, ws.W_NUM_CHUNKS] = nch
        w[:, ws.W_DEST] = np.where(nch > 1, slot0[pid] + chunk, -1)
        indptr = np.zeros(nc + 1, np.int32)
        indptr[1:] = np.bincount(cta, minlength=nc).cumsum()
        # Merge tasks: one per split (tile, head) pair, in pair order.
        sp = np.flatnonzero(nch_pair > 1)
        mt = rec.take(sp // hk, axis=0)
        merge = np.empty((sp.shape[0], ws.MERGE_FIELDS), np.int32)
        merge[:, ws.M_REQ] = mt[:, ws.W_REQ]
        merge[:, ws.M_KV_HEAD] = sp % hk
        merge[:, ws.M_ROW_START] = mt[:, ws.W_ROW_START]
        merge[:, ws.M_NUM_ROWS] = mt[:, ws.W_NUM_ROWS]
        merge[:, ws.M_QO_OFFSET] = mt[:, ws.W_QO_OFFSET]
        merge[:, ws.M_SLOT_START] = slot0[sp]
        merge[:, ws.M_NUM_SLOTS] = nch_pair[sp]
        merge[:, ws.M_RESERVED] = 0
        return self._finish_split(w, indptr, merge, loads, int(nsl.sum()), kv_chunk, min_chunk, rec_args)

    def _finish_split(self, w, indptr, merge, loads, slots, kv_chunk, min_chunk, rec_args) -> Plan:
        """The Plan of records ``w`` (CTA-major, some split), their ``work_indptr`` and merge
        tasks, using ``slots`` partial slots."""
        tile, group, causal = rec_args[8:]
        nc = self.num_ctas
        meta = np.zeros(ws.META_FIELDS, np.int32)
        meta[ws.META_NUM_WORK_ITEMS] = w.shape[0]
        meta[ws.META_NUM_MERGE_TASKS] = merge.shape[0]
        meta[ws.META_CTA_TILE_Q] = tile
        meta[ws.META_NUM_CTAS] = nc
        meta[ws.META_NUM_PARTIAL_SLOTS] = slots
        meta[ws.META_GROUP_SIZE] = group
        meta[ws.META_KV_CHUNK] = kv_chunk
        meta[ws.META_CAUSAL] = int(causal)
        return Plan(
            work_items=w,
            work_indptr=indptr,
            merge_tasks=merge,
            meta=meta,
            cta_cost=loads,
            cta_tile_q=tile,
            group_size=group,
            num_ctas=nc,
            kv_chunk=int(kv_chunk),
            causal=bool(causal),
            min_kv_chunk=int(min_chunk),
        )

    # -- staging and upload -------------------------------------------------------------
    def _stage(self, p: Plan, b: int, total_q: int, hq: int, hk: int) -> None:
        p.meta[ws.META_BATCH_SIZE] = b
        p.meta[ws.META_TOTAL_QO_ROWS] = total_q
        p.meta[ws.META_NUM_QO_HEADS] = hq
        p.meta[ws.META_NUM_KV_HEADS] = hk
        self._staging.stage(p)

    def kept(self) -> Optional[KeptPlan]:
        """The last full plan's ``KeptPlan`` (None where it is not a decode plan, or a
        batch-invariant one: those are never kept)."""
        if self._keep_args is None:
            return None
        if self._kept is None:
            p, kv, per_item = self._keep_args
            self._kept = KeptPlan(p, kv, per_item, self.beta, self.keep_tol)
        return self._kept

    def replan(self, kv_lens, upper: Optional[int] = None) -> Optional[Plan]:
        """The last full decode plan's items on new kv lengths (``reuse`` module doc), staged
        for ``upload`` like a plan (its work items and merge tasks are views of the staging
        buffer, valid until that buffer's next turn: read them before the next two plans);
        None where that plan was not a decode plan of this many
        requests or its items would be out of balance (then ``plan()`` anew). ``kv_lens``:
        int64 [batch], non-negative (checked by the caller); ``upper``: a bound on them the
        caller knows (saves a pass over them)."""
        kept = self.kept()
        if kept is None or kv_lens.shape[0] != kept.batch:
            return None
        lim = self.limits.max_kv_len
        if (upper is None or upper > lim) and kv_lens.shape[0] and int(kv_lens.max()) > lim:
            return None  # plan() names the error
        got = kept.follow(kv_lens)
        if got is None:
            return None
        fields, loads = got
        full = kept.plan
        kept_plan = object.__new__(Plan)  # the full plan's CTA lists, meta and tiles (a copy
        kept_plan.__dict__.update(full.__dict__)  # without the dataclass __init__: per step)
        kept_plan.work_items, kept_plan.merge_tasks = self._staging.stage_kept(full, *fields)
        kept_plan.cta_cost = loads
        return kept_plan

    def upload(self, workspace) -> None:
        """Enqueue one non-blocking host->device copy of the last staged plan into
        ``workspace`` (any dtype; its bytes are used): the whole workspace, or a buffer of just
        the layout's int sections (``layout.int_bytes``: where a wrapper keeps its plan apart
        from the fp32 scratch). Never reads anything back."""
        self._staging.upload(workspace)
