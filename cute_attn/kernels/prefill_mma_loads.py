"""The portable prefill's K / V copies (mixed into ``PrefillMma``, ``kernels/prefill_mma.py``):
a block's rows of a paged cache (pages looked up by the load cursor) or of ragged K / V (token
offsets from the request's first token), K and V together or either alone (the deferred order
loads V a block after K, ``prefill_mma_turns.py``)."""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64

from .copy import cp_async_16
from .decode import LoadStream, PagedDecode
from .pages import in_cache


class KvLoads:
    """The K / V copies of ``PrefillMma`` (decode's, ``PagedDecode``, without head packing)."""

    def _lookup(self, ld: LoadStream, page_base, blk_start, kv_end):
        if self.paged:
            PagedDecode._lookup(self, ld, page_base, blk_start, kv_end)
        else:
            ld.rows[0] = page_base  # the request's first token in the ragged K / V

    def _issue_kv(self, ld: LoadStream, kv_head, blk_start, kv_end, stage, parts=(0, 1), rows=None):
        """``parts``: K (0) and / or V (1); ``rows``: the block's lookups (default ``ld.rows``)."""
        rows = ld.rows if rows is None else rows
        if self.paged:
            self._issue_paged(ld, kv_head, blk_start, kv_end, stage, parts, rows)
        else:
            self._issue_ragged(ld, kv_head, blk_start, kv_end, stage, parts, rows)

    def _issue_paged(self, ld: LoadStream, kv_head, blk_start, kv_end, stage, parts, rows):
        """cp.async this thread's chunks of a paged block (decode's ``_issue_kv`` without head
        packing: one kv head, row i's page in ``rows[i]``): a row's global address is the
        head's base + page x page stride (one 32 x 32 -> 64-bit multiply-add) + slot x token
        stride (32-bit), not a full address over 64-bit strides per row and tensor."""
        assert self.hpi == 1 and not self.slot_lookups  # the prefill packs no kv heads
        tidx = ld.tidx
        _, c = self._slot(tidx, 0)
        heads = []  # (global byte address of the head + chunk, bytes per page, per token, smem base)
        for m, s_base in self._kv_parts(ld, parts):
            g0 = m[0, 0, kv_head, None].iterator.toint()
            per_page = Int32(m[1, 0, kv_head, None].iterator.toint() - g0)
            per_tok = Int32(m[0, 1, kv_head, None].iterator.toint() - g0)
            heads.append((g0 + c * 16, per_page, per_tok, s_base))
        for i in range(self.rows_per_thread):
            r, c_i = self._slot(tidx, i)
            _, slot = divmod(self._row_pos(tidx, i, blk_start, kv_end), ld.page_size)
            page = in_cache(rows[i], ld.mK.shape[0])
            d = self._smem_off(r, c_i, stage, self.block_n, self.kv_width) * 2
            for g0, per_page, per_tok, s_base in heads:
                self._copy_atoms(s_base + d, g0 + Int64(page) * Int64(per_page) + Int64(slot * per_tok))

    def _issue_ragged(self, ld: LoadStream, kv_head, blk_start, kv_end, stage, parts, rows):
        """cp.async this thread's chunks of a ragged block: its rows are row_step tokens apart
        (the last token re-read past kv_end), so the global addresses are its first row's plus
        32-bit offsets -- one clamp and one multiply-add a row, where a full address (64-bit
        token strides) took ~12 instructions, 16 times a block."""
        tidx, base = ld.tidx, rows[0]
        r0, c = self._slot(tidx, 0)
        tok0 = base + self._row_pos(tidx, 0, blk_start, kv_end)
        # offset of row i from row 0 in tokens: min(i * row_step, the rows left), 0 past the end
        left = kv_end - 1 - blk_start - r0
        left = cutlass.select_(left > 0, left, Int32(0))
        row0 = []  # (first row's global byte address, bytes per token, smem base) of K and / or V
        for m, s_base in self._kv_parts(ld, parts):
            g0 = m[0, tok0, kv_head, None].iterator.toint()
            step = Int32(m[0, tok0 + 1, kv_head, None].iterator.toint() - g0)
            row0.append((g0 + c * 16, step, s_base))
        for i in range(self.rows_per_thread):
            r, c_i = self._slot(tidx, i)
            d = self._smem_off(r, c_i, stage, self.block_n, self.kv_width) * 2
            off = cutlass.min(Int32(i * self.row_step), left)
            for g0, step, s_base in row0:
                self._copy_atoms(s_base + d, g0 + Int64(off * step))

    @staticmethod
    def _kv_parts(ld: LoadStream, parts):
        """(global tensor, shared base address) of K (part 0) and / or V (part 1)."""
        return [((ld.mK, ld.mV)[x], (ld.sK, ld.sV)[x].iterator.toint()) for x in parts]

    def _copy_atoms(self, s_addr, g_addr):
        """cp.async the 16-byte chunk at global byte address ``g_addr`` to shared ``s_addr``, and
        the same chunk of each further atom column (``_copy_row``: block_n x atom_w elements on in
        the stage, gather_w chunks on in the row)."""
        atom_bytes = self.block_n * self._atom_w(self.kv_width) * 2
        for a in range(self.col_groups):
            cp_async_16(s_addr + a * atom_bytes, g_addr + a * self.gather_w * 16)
