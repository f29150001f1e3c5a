"""``Planner.plan()``: validate, tile, cut, assign, write the records, stage, upload."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import workspace as ws
from .assign import split_to_fit
from .cost import build_tiles, choose_cta_tile_q, fair_chunk, full, schedule
from .inputs import as_index_array, check_indptr, check_lengths, kv_lens_from_paged, kv_lens_from_ragged
from .workspace import Limits, WorkspaceLayout


_NO_MERGE = np.empty((0, ws.MERGE_FIELDS), np.int32)
_NO_MERGE.flags.writeable = False


@dataclass
class Plan:
    """One batch's schedule (host copies; ``Planner`` stages the same bytes for upload)."""

    work_items: np.ndarray   # int32 [num_work_items, WORK_FIELDS], CTA-major
    work_indptr: np.ndarray  # int32 [num_ctas + 1]
    merge_tasks: np.ndarray  # int32 [num_merge_tasks, MERGE_FIELDS]
    meta: np.ndarray         # int32 [META_FIELDS]
    cta_cost: np.ndarray     # int64 [num_ctas], modelled cost per CTA (diagnostics)
    cta_tile_q: int
    group_size: int
    num_ctas: int
    kv_chunk: int            # kv length tiles were pre-cut at (0: none), see META_KV_CHUNK
    causal: bool

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


def _host_buffer(nbytes: int, pin: bool):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class Planner:
    """Plans for one wrapper: holds the workspace layout and the (pinned) staging buffers.

    ``num_ctas = num_sms * ctas_per_sm`` is the persistent grid; it is passed in, never
    queried. ``alpha``/``beta``: the cost model (see ``cost``). ``min_kv_chunk``: the
    shortest kv chunk a split may produce (rounded up to a page). ``balance_tol``: how far
    above the mean the busiest CTA may be before split-to-fit is tried (it costs planning
    time and extra partials, so it runs only where LPT alone falls short). ``num_staging``: staging
    buffers used in turn, so that a plan never overwrites bytes an earlier upload may still
    be reading (with CUDA, an event per buffer; a wait happens only if the CPU is that many
    plans ahead of the copies).
    """

    def __init__(self, limits: Limits, num_sms: int, ctas_per_sm: int = 1, *, alpha: int = 2,
                 beta: int = 1, min_kv_chunk: int = 256, balance_tol: float = 0.05,
                 num_staging: int = 2, pin_memory: Optional[bool] = None):
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
        if pin_memory is None:
            import torch

            pin_memory = torch.cuda.is_available()
        self._staging = [_host_buffer(self.layout.int_bytes, pin_memory) for _ in range(num_staging)]
        self._events = [None] * num_staging
        self._views = [self._section_views(t.numpy()) for t in self._staging]
        self._turn = 0
        self._staged = None  # (buffer index, bytes to copy) of the last plan
        self._unsplit_template = self._template(limits.max_batch)

    @staticmethod
    def _template(rows: int) -> np.ndarray:
        """Constant fields of unsplit records: KV_START 0, DEST -1, CHUNK 0, NUM_CHUNKS 1."""
        t = np.zeros((rows, ws.WORK_FIELDS), np.int32)
        t[:, ws.W_DEST] = -1
        t[:, ws.W_NUM_CHUNKS] = 1
        return t

    def _section_views(self, buf: np.ndarray):
        lay = self.layout

        def sec(name, shape):
            o, n = lay.sections[name]
            return buf[o:o + n].view(np.int32).reshape(shape)

        return dict(meta=sec("meta", (ws.META_FIELDS,)),
                    work_indptr=sec("work_indptr", (self.num_ctas + 1,)),
                    merge_tasks=sec("merge_tasks", (lay.max_merge_tasks, ws.MERGE_FIELDS)),
                    work_items=sec("work_items", (lay.max_work_items, ws.WORK_FIELDS)))

    # -- entry points -------------------------------------------------------------------
    def plan_paged(self, qo_indptr, kv_indptr, last_page_len, page_size: int, *, kv_indices=None,
                   num_pages_total: Optional[int] = None, **kw) -> Plan:
        kv_lens = kv_lens_from_paged(kv_indptr, last_page_len, page_size, kv_indices, num_pages_total)
        return self.plan(qo_indptr, kv_lens, page_size=page_size, **kw)

    def plan_ragged(self, qo_indptr, kv_indptr, **kw) -> Plan:
        return self.plan(qo_indptr, kv_lens_from_ragged(kv_indptr), **kw)

    def plan(self, qo_indptr, kv_lens, *, causal: bool = False, page_size: int = 1,
             num_qo_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
             cta_tile_q: Optional[int] = None, kv_split_size: Optional[int] = None,
             workspace=None) -> Plan:
        """Plan one batch, stage it in the host buffer and, given a device ``workspace``
        tensor (>= ``layout.total_bytes`` bytes), enqueue its upload (one non-blocking copy).

        ``kv_split_size``: batch-invariant mode -- every tile is cut at multiples of this
        many kv tokens whatever else is in the batch, and the tile size must not depend on
        the batch either: ``cta_tile_q`` if given, else the rule applied to
        ``limits.max_qo_len`` (default ``max_total_q_tokens``) packed rows.
        """
        lim = self.limits
        hq = lim.num_qo_heads if num_qo_heads is None else num_qo_heads
        hk = lim.num_kv_heads if num_kv_heads is None else num_kv_heads
        if not (isinstance(hq, int) and isinstance(hk, int) and 1 <= hk and 1 <= hq):
            raise ValueError(f"num_qo_heads / num_kv_heads must be positive ints, got {hq!r} / {hk!r}")
        if hq > lim.num_qo_heads or hk > lim.num_kv_heads:
            raise ValueError(f"num_qo_heads={hq}, num_kv_heads={hk} exceed the limits "
                             f"({lim.num_qo_heads}, {lim.num_kv_heads})")
        if hq % hk:
            raise ValueError(f"num_qo_heads ({hq}) is not a multiple of num_kv_heads ({hk})")
        if not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        group = hq // hk

        qo_indptr = as_index_array("qo_indptr", qo_indptr)
        qo_len = check_indptr("qo_indptr", qo_indptr)
        b = qo_len.shape[0]
        if b > lim.max_batch:
            raise ValueError(f"batch size {b} (len(qo_indptr) - 1) exceeds max_batch ({lim.max_batch})")
        total_q = int(qo_indptr[-1])
        if total_q > lim.max_total_q_tokens:
            raise ValueError(f"qo_indptr[-1] = {total_q} query tokens exceeds max_total_q_tokens "
                             f"({lim.max_total_q_tokens})")
        if lim.max_qo_len is not None:
            check_lengths("qo_len (qo_indptr diff)", qo_len, lim.max_qo_len, "max_qo_len")
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
                tile = choose_cta_tile_q(total_q * group, int(np.count_nonzero(qo_len)))
        else:
            if (not isinstance(cta_tile_q, (int, np.integer)) or cta_tile_q % ws.MIN_CTA_TILE_Q
                    or not ws.MIN_CTA_TILE_Q <= cta_tile_q <= ws.MAX_CTA_TILE_Q):
                raise ValueError(f"cta_tile_q must be a multiple of {ws.MIN_CTA_TILE_Q} in "
                                 f"[{ws.MIN_CTA_TILE_Q}, {ws.MAX_CTA_TILE_Q}], got {cta_tile_q!r}")
            tile = int(cta_tile_q)

        req, row0, rows, ext, one_each = build_tiles(qo_len, kv_len, group, tile, causal)
        s, reb = self._schedule(ext, tile, hk, int(page_size), kv_split_size)
        if reb is None and s["chunk"] == 0:
            p = self._records_unsplit(s, req, row0, rows, one_each, qo_indptr, qo_len, kv_len, hk,
                                      tile, group, causal)
        else:
            p = self._records(s, reb, req, row0, rows, qo_indptr, qo_len, kv_len, hk, tile, group,
                              causal)
        self._stage(p, b, total_q, hq, hk)
        if workspace is not None:
            self.upload(workspace)
        return p

    # -- scheduling ---------------------------------------------------------------------
    def _schedule(self, ext, tile, hk, page, kv_split_size):
        nc, beta, per_item = self.num_ctas, self.beta, self.alpha * tile
        max_slots = self.layout.max_partial_rows // tile
        if kv_split_size is not None:
            # Batch-invariant: cuts depend on the tile alone; no split-to-fit (it would
            # make a request's chunks depend on the other requests).
            s = full(schedule(ext, int(kv_split_size), 0, per_item, beta, hk, nc))
            need = hk * int(s["n"][s["n"] > 1].sum())
            if need > max_slots:
                raise ValueError(f"kv_split_size={kv_split_size} needs {need} partial slots; the "
                                 f"workspace holds {max_slots} at cta_tile_q={tile}")
            return s, None
        min_chunk = -(-max(self.min_kv_chunk, 1) // page) * page
        chunk = fair_chunk(ext, per_item=per_item, beta=beta, heads=hk, num_ctas=nc,
                           page_size=page, min_chunk=min_chunk)
        while True:
            s = schedule(ext, chunk, min_chunk, per_item, beta, hk, nc)
            if chunk == 0:
                base = 0
                break
            base = hk * int(s["n"][s["n"] > 1].sum())
            if base <= max_slots:
                break
            chunk *= 2  # the workspace cannot hold this many partials: cut coarser
            if chunk >= int(ext.max()):
                chunk = 0
        m = min(s["cta"].shape[0], nc)
        loads = s["loads"]
        if m == 0 or int(loads.max()) * nc <= (1 + self.balance_tol) * int(loads.sum()):
            return s, None  # LPT alone is within tolerance: no extra splits
        s = full(s)
        first = s["order"][np.arange(m) // hk]  # item c < C is the largest one of CTA c
        loads = s["loads"].copy()
        reb = split_to_fit(loads, s["cost"], s["start"][first], s["end"][first], per_item=per_item,
                           beta=beta, min_chunk=min_chunk, page=page)
        if reb[0].shape[0] == 0:
            return s, None
        # Worst case, each donor's pair turns split (+1 slot) and every piece owns a slot.
        if base + reb[0].shape[0] + reb[2].shape[0] > max_slots:
            return s, None
        s["loads"] = loads
        return s, reb

    # -- records ------------------------------------------------------------------------
    def _records(self, s, reb, req, row0, rows, qo_indptr, qo_len, kv_len, hk, tile, group, causal):
        nc = self.num_ctas
        s = full(s)
        n, t, order = s["n"], s["t"], s["order"]
        npc = t.shape[0]
        # The chunk table: one record per (tile, kv range); kv head and destination are
        # filled per item. Split-to-fit appends rows for trimmed items and moved pieces.
        k1 = 0 if reb is None else reb[0].shape[0]
        k2 = 0 if reb is None else reb[2].shape[0]
        rec = np.empty((npc + k1 + k2, ws.WORK_FIELDS), np.int32)
        r = req[t]
        rec[:npc, ws.W_REQ] = r
        rec[:npc, ws.W_ROW_START] = row0[t]
        rec[:npc, ws.W_NUM_ROWS] = rows[t]
        rec[:npc, ws.W_KV_START] = s["start"]
        rec[:npc, ws.W_KV_END] = s["end"]
        rec[:npc, ws.W_QO_OFFSET] = qo_indptr[r]
        rec[:npc, ws.W_QO_LEN] = qo_len[r]
        rec[:npc, ws.W_KV_LEN] = kv_len[r]
        rec[:npc, ws.W_CHUNK] = s["c"]
        rec_t = t
        # Item i of the cost order is chunk order[i // hk] for head i % hk.
        item_rec = np.repeat(order, hk)
        item_head = np.tile(np.arange(hk), npc)
        cta = s["cta"]
        count = np.repeat(n, hk)  # chunks per (tile, head) pair, pair id = tile * hk + head
        if reb is not None:
            donors, cut, src, start, end, dst = reb
            drec = item_rec[donors]  # donors are CTA ids = item ids (item c is CTA c's first)
            rec[npc:npc + k1] = rec[drec]
            rec[npc:npc + k1, ws.W_KV_END] = cut
            prec = drec[src]
            rec[npc + k1:] = rec[prec]
            rec[npc + k1:, ws.W_KV_START] = start
            rec[npc + k1:, ws.W_KV_END] = end
            ph = item_head[donors][src]
            pair = t[prec] * hk + ph
            # Moved pieces merge after the pair's original chunks, in line order.
            o = np.argsort(pair, kind="stable")
            sp = pair[o]
            grp_start = np.flatnonzero(np.r_[True, sp[1:] != sp[:-1]])
            rank = np.empty_like(o)
            rank[o] = np.arange(o.shape[0]) - np.repeat(grp_start, np.diff(np.r_[grp_start, o.shape[0]]))
            rec[npc + k1:, ws.W_CHUNK] = n[t[prec]] + rank
            count = count + np.bincount(pair, minlength=count.shape[0])
            item_rec[donors] = npc + np.arange(k1)
            item_rec = np.concatenate((item_rec, npc + k1 + np.arange(k2)))
            item_head = np.concatenate((item_head, ph))
            cta = np.concatenate((cta, dst))
            rec_t = np.concatenate((t, t[drec], t[prec]))
        # Partial slots: pairs that are split, in pair order, chunks in merge order inside:
        # a merge task's slots are contiguous.
        nsl = np.where(count > 1, count, 0)
        slot0 = np.cumsum(nsl) - nsl
        # Group items by CTA, keeping the cost order inside a CTA (radix sort on small ids).
        by_cta = np.argsort(cta.astype(np.int16 if nc < 2**15 else np.int32), kind="stable")
        ir = item_rec[by_cta]
        ih = item_head[by_cta]
        items = rec.take(ir, axis=0)
        items[:, ws.W_KV_HEAD] = ih
        ip = rec_t[ir] * hk + ih
        cnt = count[ip]
        items[:, ws.W_NUM_CHUNKS] = cnt
        items[:, ws.W_DEST] = np.where(cnt > 1, slot0[ip] + items[:, ws.W_CHUNK], -1)
        indptr = np.zeros(nc + 1, np.int32)
        indptr[1:] = np.bincount(cta, minlength=nc).cumsum()
        # Merge tasks: one per split (tile, head) pair, in pair order.
        sp = np.flatnonzero(count > 1)
        mt, mh = sp // hk, sp % hk
        mr = req[mt]
        merge = np.empty((sp.shape[0], ws.MERGE_FIELDS), np.int32)
        merge[:, ws.M_REQ] = mr
        merge[:, ws.M_KV_HEAD] = mh
        merge[:, ws.M_ROW_START] = row0[mt]
        merge[:, ws.M_NUM_ROWS] = rows[mt]
        merge[:, ws.M_QO_OFFSET] = qo_indptr[mr]
        merge[:, ws.M_SLOT_START] = slot0[sp]
        merge[:, ws.M_NUM_SLOTS] = count[sp]
        merge[:, ws.M_RESERVED] = 0
        nslots = int(nsl.sum())
        loads = s["loads"]
        meta = np.zeros(ws.META_FIELDS, np.int32)
        meta[ws.META_NUM_WORK_ITEMS] = items.shape[0]
        meta[ws.META_NUM_MERGE_TASKS] = merge.shape[0]
        meta[ws.META_CTA_TILE_Q] = tile
        meta[ws.META_NUM_CTAS] = nc
        meta[ws.META_NUM_PARTIAL_SLOTS] = nslots
        meta[ws.META_GROUP_SIZE] = group
        meta[ws.META_KV_CHUNK] = s["chunk"]
        meta[ws.META_CAUSAL] = int(causal)
        return Plan(work_items=items, work_indptr=indptr, merge_tasks=merge, meta=meta,
                    cta_cost=loads, cta_tile_q=tile, group_size=group, num_ctas=nc,
                    kv_chunk=int(meta[ws.META_KV_CHUNK]), causal=bool(causal))

    def _records_unsplit(self, s, req, row0, rows, one_each, qo_indptr, qo_len, kv_len, hk, tile,
                         group, causal):
        """The common decode case, nothing split: one item per (tile, head), all direct."""
        nc, cta = self.num_ctas, s["cta"]
        nt = req.shape[0]
        if nt > self._unsplit_template.shape[0]:
            self._unsplit_template = self._template(2 * nt)
        rec = self._unsplit_template[:nt].copy()
        rec[:, ws.W_REQ] = req
        rec[:, ws.W_ROW_START] = row0
        rec[:, ws.W_NUM_ROWS] = rows
        rec[:, ws.W_KV_END] = s["end"]
        if one_each:  # req is arange(b): no gathers
            rec[:, ws.W_QO_OFFSET] = qo_indptr[:-1]
            rec[:, ws.W_QO_LEN] = qo_len
            rec[:, ws.W_KV_LEN] = kv_len
        else:
            rec[:, ws.W_QO_OFFSET] = qo_indptr[req]
            rec[:, ws.W_QO_LEN] = qo_len[req]
            rec[:, ws.W_KV_LEN] = kv_len[req]
        by_cta = np.argsort(cta.astype(np.int16 if nc < 2**15 else np.int32), kind="stable")
        q = by_cta // hk
        items = rec.take(s["order"][q], axis=0)  # (take: ~5x faster than rec[idx])
        items[:, ws.W_KV_HEAD] = by_cta & (hk - 1) if hk & (hk - 1) == 0 else by_cta - q * hk
        indptr = np.zeros(nc + 1, np.int32)
        indptr[1:] = np.bincount(cta, minlength=nc).cumsum()
        meta = np.array((items.shape[0], 0, tile, nc, 0, group, 0, 0, 0, int(causal), 0, 0, 0, 0,
                         0, 0), np.int32)  # field order: META_* in workspace.py
        return Plan(work_items=items, work_indptr=indptr, merge_tasks=_NO_MERGE, meta=meta,
                    cta_cost=s["loads"], cta_tile_q=tile, group_size=group, num_ctas=nc,
                    kv_chunk=0, causal=bool(causal))

    # -- staging and upload -------------------------------------------------------------
    def _stage(self, p: Plan, b: int, total_q: int, hq: int, hk: int) -> None:
        p.meta[ws.META_BATCH_SIZE] = b
        p.meta[ws.META_TOTAL_QO_ROWS] = total_q
        p.meta[ws.META_NUM_QO_HEADS] = hq
        p.meta[ws.META_NUM_KV_HEADS] = hk
        i = self._turn
        self._turn = (i + 1) % len(self._staging)
        ev = self._events[i]
        if ev is not None and not ev.query():
            ev.synchronize()  # an upload from this buffer is still queued (see class doc)
        v = self._views[i]
        v["meta"][:] = p.meta
        v["work_indptr"][:] = p.work_indptr
        v["merge_tasks"][:p.num_merge_tasks] = p.merge_tasks
        v["work_items"][:p.num_work_items] = p.work_items
        # Work items are the last int32 section, so one prefix covers everything in use.
        nbytes = self.layout.offset("work_items") + 4 * ws.WORK_FIELDS * p.num_work_items
        self._staged = (i, nbytes)

    def upload(self, workspace) -> None:
        """Enqueue one non-blocking host->device copy of the last staged plan into
        ``workspace`` (any dtype; its bytes are used). Never reads anything back."""
        if self._staged is None:
            raise RuntimeError("upload() before any plan()")
        import torch

        dst = workspace.view(torch.uint8).reshape(-1) if workspace.dtype != torch.uint8 else workspace.reshape(-1)
        if dst.numel() < self.layout.total_bytes:
            raise ValueError(f"workspace has {dst.numel()} bytes, the layout needs {self.layout.total_bytes}")
        i, nbytes = self._staged
        dst[:nbytes].copy_(self._staging[i][:nbytes], non_blocking=True)
        if dst.is_cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._events[i] = ev
