"""The producer warpgroup of the Hopper prefill kernel (``prefill_sm90.py``): it fills the K and
V stage rings the consumer warpgroups read.

Three ways K/V reach the swizzled stage tiles, chosen per spec:
- contiguous (ragged) KV: one TMA box per block, issued by warp 0, K(j) one block ahead of V(j);
- paged KV whose page size is a multiple of ``page_box``: one TMA box per 16-row page run,
  the boxes of a block shared out over ``box_warps`` warps (their pages looked up one block
  ahead, one lane per box);
- any other paged KV (page size 1 included), and whenever the producer rotates K blocks
  (``transform_k``): a ``cp.async`` gather of 16-byte chunks by all 128 threads, row addresses
  staged in shared memory one block ahead (``ROW_RING``).

A mixin of ``BatchPrefillSm90``: its methods read the kernel's configuration from ``self``,
the item from an ``ItemInfo`` and the launch's values from a ``TraceCtx`` (``work.py``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from .copy import cp_async_16
from .fragments import WG
from .pages import in_cache
from .prefill_sm90_tiles import ROW_RING
from .work import ItemInfo

BAR_PRODUCER = 5  # the gather producer's named barrier (see prefill_sm90's named barriers)
BOX_WARPS = 4  # paged TMA: producer warps issuing the boxes of a block (see _produce)


class PrefillProducer:
    """K/V loads of the prefill kernel (see the module docstring)."""

    def _page_box_tma(self, mX, sX_layout, D, dt=None):
        """The TMA atom and global view of paged K or V (rows of D) read in boxes of (page_box,
        D): the cache viewed as (page_size, D, kv_heads, pages), each box written into a row
        slice of the stage tile (``dt``: its element type, the kernel's dtype by default)."""
        PB, dt = self.page_box, dt or self.dtype
        x4 = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))
        stage0 = cute.make_tensor(cute.make_ptr(dt, 0, cute.AddressSpace.smem, assumed_align=1024), sX_layout.outer)[
            None, None, 0
        ]
        sub = cute.select(cute.local_tile(stage0, (PB, D), (0, 0)).layout, mode=[0, 1])
        box = cute.make_composed_layout(sX_layout.inner, 0, sub)
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), x4, box, (PB, D))

    @cute.jit
    def _produce(self, gm, tma, sm, cta, tidx, warp_idx, tc):
        """The producer warpgroup's loop over the CTA's items (``gm``: the kernel's global
        tensors, ``tma``: its TMA atoms, ``sm``: shared memory and pipelines, ``tc``: the
        launch's values)."""
        mK, mKvIndptr, mKvIndices, mWork, mWorkIndptr = gm.mK, gm.mKvIndptr, gm.mKvIndices, gm.mWork, gm.mWorkIndptr
        tma_k, tK, tma_v, tV = tma[:4]
        sK, sV, sRows, pipe_k, pipe_v = sm.sK, sm.sV, sm.sRows, sm.pipe_k, sm.pipe_v
        group = tc.group
        TN, D, DV = self.tile_n, self.head_dim, self.head_dim_vo
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        ring = Int32(0)  # gather: blocks staged so far (selects the lookup ring slot)
        g2s = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype, num_bits_per_copy=128
        )
        # p // page_size and p % page_size by multiply-high and shift: a runtime integer division
        # is ~25 instructions, and the issue path does one per box or row
        pdiv = cute.FastDivmodDivisorV2(mK.shape[1])
        dst = None
        if const_expr(self.gather):
            dst = self._gather_dst(sK, sV, tidx)
        for item in cutlass.range(mWorkIndptr[cta], mWorkIndptr[cta + 1], unroll=1):
            info = ItemInfo(mWork, item, group, tc.group_div)
            req, kv_head, kv_start, kv_end = info.req, info.kv_head, info.kv_start, info.kv_end
            first, n_blocks = self._block_range(info, tc)
            if const_expr(self.page_box):
                # A block is TN / page_box boxes, and one warp issuing all of them (a shuffle, the
                # coordinates and a TMA each) is slower than the consumers use them: the boxes are
                # shared out over box_warps warps.  Each warp waits for the stage itself; warp 0
                # alone arms the full barrier with the whole block's bytes (boxes landing before
                # that only drive its transaction count below zero, which an mbarrier allows:
                # the phase cannot complete before warp 0's arrival).
                if warp_idx < self.box_warps:
                    # lane b looks up the page of box b and its 16-row slot in the page (all boxes
                    # of a block in one round trip), one block ahead of its use; the TMA issue
                    # reads them with shuffles, as warp-uniform values (see _load_pages)
                    page_base = mKvIndptr[req]
                    page_size = pdiv
                    lane = cute.arch.lane_idx()
                    head = cute.arch.make_warp_uniform(kv_head)
                    nb = n_blocks - first
                    pg_k, rw_k = Int32(0), Int32(0)
                    pg_v, rw_v = Int32(0), Int32(0)
                    if nb > 0:
                        pg_k, rw_k = self._box_page(
                            mKvIndices, lane, kv_start + (n_blocks - 1) * TN, kv_end, page_base, page_size
                        )
                    for j in cutlass.range(nb + 1, unroll=1):
                        pg_next, rw_next = Int32(0), Int32(0)
                        if j + 1 < nb:
                            pg_next, rw_next = self._box_page(
                                mKvIndices, lane, kv_start + (n_blocks - 2 - j) * TN, kv_end, page_base, page_size
                            )
                        if j < nb:
                            boxes = self._box_coords(pg_k, rw_k, warp_idx)  # before the wait
                            self._acquire_boxes(pipe_k, k_state, warp_idx)
                            self._load_pages(tma_k, tK, sK, pipe_k, k_state.index, boxes, head)
                            k_state.advance()
                        if j > 0:
                            boxes = self._box_coords(pg_v, rw_v, warp_idx)
                            self._acquire_boxes(pipe_v, v_state, warp_idx)
                            self._load_pages(tma_v, tV, sV, pipe_v, v_state.index, boxes, head)
                            v_state.advance()
                        pg_v, rw_v = pg_k, rw_k
                        pg_k, rw_k = pg_next, rw_next
            elif const_expr(not self.gather):
                if warp_idx == 0:
                    row0 = mKvIndptr[req] + kv_start
                    gK = cute.local_tile(cute.domain_offset((row0, 0), tK[None, None, kv_head]), (TN, D), (None, 0))
                    gV = cute.local_tile(cute.domain_offset((row0, 0), tV[None, None, kv_head]), (TN, DV), (None, 0))
                    tKs, tKg = cpasync.tma_partition(
                        tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
                    )
                    tVs, tVg = cpasync.tma_partition(
                        tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
                    )
                    # K(i) goes out one block ahead of V(i): QK of the next block can start
                    # while PV of this one still reads its V stage
                    pending = self._pass_pending(tma.p8) if const_expr(self.kv8_pass) else None
                    for j in cutlass.range(n_blocks - first + 1, unroll=1):
                        if j < n_blocks - first:
                            if const_expr(self.kv8_pass):  # the block's rows dequantized (prefill_sm90_kv8_pass)
                                if pending != 0:
                                    self._wait_block(gm, tma.p8, row0 + (n_blocks - 1 - j) * TN, kv_head)
                            pipe_k.producer_acquire(k_state)
                            cute.copy(
                                tma_k,
                                tKg[None, n_blocks - 1 - j],
                                tKs[None, k_state.index],
                                tma_bar_ptr=pipe_k.producer_get_barrier(k_state),
                            )
                            k_state.advance()
                        if j > 0:
                            pipe_v.producer_acquire(v_state)
                            cute.copy(
                                tma_v,
                                tVg[None, n_blocks - j],
                                tVs[None, v_state.index],
                                tma_bar_ptr=pipe_v.producer_get_barrier(v_state),
                            )
                            v_state.advance()
            else:
                # Page lookups are staged in smem one block ahead: thread t < TN looks up row t of
                # the next block (a global load whose latency hides behind this block's copies)
                # and stores the global addresses of its K and V rows; every thread then reads its
                # rows' addresses from smem (one 8-byte load per 16-byte copy: this loop is the
                # producer's whole work, and with the page arithmetic in it the producer, not the
                # tensor cores, set the pace).  Ring of ROW_RING blocks: K(j), V(j-1) and the
                # lookup of j+1 are in flight together.
                page_base = mKvIndptr[req]
                page_size = pdiv
                nb = n_blocks - first
                if nb > 0:
                    ak, av = self._row_addrs(
                        gm, tidx, kv_start + (n_blocks - 1) * TN, kv_end, page_base, page_size, kv_head
                    )
                    if tidx < TN:
                        sRows[0, tidx, ring % ROW_RING] = ak
                        sRows[1, tidx, ring % ROW_RING] = av
                    cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=WG)
                for j in cutlass.range(nb + 1, unroll=1):
                    ak = cutlass.Int64(0)
                    av = cutlass.Int64(0)
                    k_idx = k_state.index  # the stage K(j) goes to (rotated below with transform_k)
                    if j + 1 < nb:
                        ak, av = self._row_addrs(
                            gm, tidx, kv_start + (n_blocks - 2 - j) * TN, kv_end, page_base, page_size, kv_head
                        )
                    if j < nb:
                        pipe_k.producer_acquire(k_state)
                        if const_expr(self.hooks.has_transform_k):
                            # each thread copies both halves (dims d, d + D/2) of its rows, so it can
                            # rotate them itself once its own copies land: no producer barrier
                            self._gather_pairs(sK, sRows, g2s, tidx, k_state.index, (ring + j) % ROW_RING)
                            cute.arch.cp_async_commit_group()
                        else:
                            self._gather(dst, sRows, tidx, 0, k_state.index, (ring + j) % ROW_RING)
                            pipe_k.producer_commit(k_state)
                        k_state.advance()
                    if j > 0:
                        pipe_v.producer_acquire(v_state)
                        self._gather(dst, sRows, tidx, 1, v_state.index, (ring + j - 1) % ROW_RING)
                        pipe_v.producer_commit(v_state)
                        v_state.advance()
                    if const_expr(self.hooks.has_transform_k):
                        if j < nb:
                            # K(j) rotated in place while V(j-1) is in flight, then released
                            cute.arch.cp_async_commit_group()
                            cute.arch.cp_async_wait_group(1)
                            self._rotate_k(sK, tidx, k_idx, kv_start + (n_blocks - 1 - j) * TN, info, tc)
                            cute.arch.fence_view_async_shared()  # generic writes -> read by wgmma
                            pipe_k.sync_object_full.arrive_mbarrier(k_idx)
                    if j + 1 < nb:
                        if tidx < TN:
                            sRows[0, tidx, (ring + j + 1) % ROW_RING] = ak
                            sRows[1, tidx, (ring + j + 1) % ROW_RING] = av
                    cute.arch.barrier(barrier_id=BAR_PRODUCER, number_of_threads=WG)
                ring = ring + nb
        if const_expr(self.gather):
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # no copy of this thread outlives it

    @cute.jit
    def _acquire_boxes(self, pipe, state, warp_idx):
        """Every box-issuing warp waits for the stage to be free; warp 0 arms its full barrier."""
        pipe.sync_object_empty.wait(state.index, state.phase)
        if warp_idx == 0:
            pipe.sync_object_full.arrive(state.index, pipe.producer_mask)

    def _box_coords(self, pg, rw, warp_idx):
        """(box, page, slot) of this warp's boxes of a block (box b by warp b % box_warps) as
        warp-uniform values, from lane b of ``pg`` / ``rw`` (``_box_page``).  TMA operands must
        sit in uniform registers; for a value the compiler cannot prove uniform (a shuffle's
        result) it converts per issue.  Computed before the stage wait, off the issue path."""
        out = []
        for k in range((self.tile_n // self.page_box + self.box_warps - 1) // self.box_warps):
            b = cute.arch.make_warp_uniform(warp_idx + k * self.box_warps)
            out.append(
                (
                    b,
                    cute.arch.make_warp_uniform(cute.arch.shuffle_sync(pg, b)),
                    cute.arch.make_warp_uniform(cute.arch.shuffle_sync(rw, b)),
                )
            )
        return out

    @cute.jit
    def _load_pages(self, tma, tX, sX, pipe, stage, boxes, kv_head):
        """This warp's boxes of one block (``boxes``: ``_box_coords``), each from its own page.
        Boxes past kv_end re-read the last valid box; the unused slots of the last page are
        zeroed in smem by the consumers before P V (``_zero_v_tail``)."""
        PB, D = self.page_box, cute.size(sX, mode=[1])  # K: head_dim, V: head_dim_vo
        stage = cute.arch.make_warp_uniform(stage)
        bar = pipe.sync_object_full.get_barrier(stage)
        for k in cutlass.range_constexpr(len(boxes)):
            b, page, row = boxes[k]
            if b < self.tile_n // PB:
                g = cute.local_tile(tX[None, None, kv_head, page], (PB, D), (row, 0))
                s_ = cute.local_tile(sX[None, None, stage], (PB, D), (b, 0))
                ts, tg = cpasync.tma_partition(
                    tma, 0, cute.make_layout(1), cute.group_modes(s_, 0, 2), cute.group_modes(g, 0, 2)
                )
                cute.copy(tma, tg, ts, tma_bar_ptr=bar)

    @cute.jit
    def _box_page(self, mKvIndices, lane, blk, kv_end, page_base, page_size):
        """(page, page_box-row slot in the page) of box ``lane`` of the block starting at token blk
        (clamped to the last valid token, so every lane reads a valid index)."""
        p = blk + lane * self.page_box
        p = p if p < kv_end else kv_end - 1
        q, r = divmod(p, page_size)
        return mKvIndices[page_base + q], r // self.page_box

    @cute.jit
    def _row_addrs(self, gm, tidx, blk, kv_end, page_base, page_size, kv_head):
        """Global byte addresses of the K and V rows (this kv head) of row tidx of the block
        starting at token blk; rows past kv_end re-read the last token (finite data, masked
        later: a NaN there would survive 0 * NaN in P V)."""
        mK, mV, mKvIndices = gm.mK, gm.mV, gm.mKvIndices
        p = blk + tidx
        p = p if p < kv_end else kv_end - 1
        page, slot = Int32(0), page_base + p  # ragged KV gathered (transform_k): token kv_indptr[req] + p
        if const_expr(self.paged):
            q, slot = divmod(p, page_size)
            page = in_cache(mKvIndices[page_base + q], mK.shape[0])
        return mK[page, slot, kv_head, None].iterator.toint(), mV[page, slot, kv_head, None].iterator.toint()

    def _chunk(self, addr):
        """The 16 bytes at global byte address ``addr`` as a tensor (a cp.async source)."""
        return cute.make_tensor(
            cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=16), cute.make_layout((8,))
        )

    def _gather_dst(self, sK, sV, tidx):
        """Where this thread's gathered chunks go.  Rows of 128-byte swizzle atoms whose chunk
        count divides the warpgroup (``regular_rows``): thread t copies 16-byte chunk c = t %
        chunks of rows t // chunks + r * (WG / chunks).  A stage tile is the linear layout x(row,
        col) (elements, checked in ``host``) under the 128-byte swizzle on byte addresses, b -> b
        ^ ((b >> 7) & 7) << 4, which repeats every 8 rows (1024 bytes): row r's address is one of
        max(1, 8 / (WG / chunks)) per-thread bases plus a static multiple of whole periods, no
        swizzle arithmetic per copy.  Other rows (head dims 96, 192) take ``_gather_any``.
        Returns (K base, V base, K's bases, V's bases), bytes; None for an irregular tensor."""
        bases = self._gather_bases(self.chunks, tidx) if regular_rows(self.head_dim) else None
        bases_v = bases
        if const_expr(self.head_dim_vo != self.head_dim):
            bases_v = self._gather_bases(self.chunks_vo, tidx) if regular_rows(self.head_dim_vo) else None
        return sK.iterator.toint(), sV.iterator.toint(), bases, bases_v

    def _gather_bases(self, chunks, tidx):
        TN, rpp = self.tile_n, WG // chunks
        col = (tidx % chunks) * 8
        bases = []
        for k in range(max(1, 8 // rpp)):
            b = ((col // 64) * (TN * 64) + (tidx // chunks + k * rpp) * 64 + col % 64) * 2
            bases.append(b ^ (((b >> 7) & 7) << 4))
        return bases

    @cute.jit
    def _gather(self, dst, sRows, tidx, which, stage, buf):
        """cp.async this thread's 16-byte chunks of a block's K (which = 0) or V rows into a
        stage: row addresses from sRows, destinations from ``_gather_dst``."""
        D = (self.head_dim, self.head_dim_vo)[which]
        chunks = D // 8
        if const_expr(dst[2 + which] is None):
            self._gather_any(dst[which], sRows, tidx, which, stage, buf, D)
        else:
            TN, rpp = self.tile_n, WG // chunks
            nb = max(1, 8 // rpp)
            c16 = (tidx % chunks) * 16
            s_base = dst[which] + stage * (TN * D * 2)
            # all row addresses first: a cp.async writes shared memory, so the compiler keeps each
            # smem load behind the copies before it, and the load -> copy chains would serialize
            addrs = [sRows[which, tidx // chunks + r * rpp, buf] for r in range(TN // rpp)]
            for r in cutlass.range_constexpr(TN // rpp):
                d = s_base + dst[2 + which][r % nb] + (r // nb) * (nb * rpp * 128)  # nb * rpp rows: a 1 KB period
                cp_async_16(d, addrs[r] + c16)  # with the L2 128-byte prefetch hint

    @cute.jit
    def _gather_any(self, base, sRows, tidx, which, stage, buf, D):
        """``_gather`` for rows whose chunk count does not divide the warpgroup or whose swizzle
        atom is narrower than 128 bytes: copy i of thread t is chunk (t + i WG) % chunks of row
        (t + i WG) // chunks, its smem address computed per copy -- the tile's linear layout over
        atoms of ``aw`` columns, then the atom's swizzle on the byte address (both checked in
        ``host`` by ``check_gather_swizzle``)."""
        TN, chunks = self.tile_n, D // 8
        aw, bits = swizzle_atom(D)
        n = (TN * chunks + WG - 1) // WG
        s_base = base + stage * (TN * D * 2)
        rows = [(tidx + i * WG) // chunks for i in range(n)]
        cols = [((tidx + i * WG) % chunks) * 8 for i in range(n)]
        # all row addresses first (see _gather); a pass past the tile's last row re-reads it
        addrs = [sRows[which, cutlass.min(rows[i], TN - 1), buf] for i in range(n)]
        for i in cutlass.range_constexpr(n):
            row, col = rows[i], cols[i]
            b = ((col // aw) * (TN * aw) + row * aw + col % aw) * 2
            b = b ^ (((b >> 7) & ((1 << bits) - 1)) << 4)
            if const_expr((i + 1) * WG > TN * chunks):
                if row < TN:
                    cp_async_16(s_base + b, addrs[i] + col * 2)
            else:
                cp_async_16(s_base + b, addrs[i] + col * 2)

    @cute.jit
    def _gather_pairs(self, sX, sRows, g2s, tidx, stage, buf):
        """As ``_gather`` for K, but thread t copies chunks c and c + chunks/2 (dims d and d + D/2)
        of its rows, c = t % (chunks/2): the pairs a transform_k rotates are all its own."""
        half = self.chunks // 2
        rows_per_pass = WG // half
        c = tidx % half
        for r in cutlass.range(self.tile_n // rows_per_pass, unroll=2):
            row = tidx // half + r * rows_per_pass
            addr = sRows[0, row, buf]
            cute.copy(g2s, self._chunk(addr + c * 16), cute.local_tile(sX[row, None, stage], (8,), (c,)))
            cute.copy(
                g2s, self._chunk(addr + (c + half) * 16), cute.local_tile(sX[row, None, stage], (8,), (c + half,))
            )

    @cute.jit
    def _rotate_k(self, sK, tidx, stage, blk, info, tc):
        """transform_k on this thread's pairs of a K block in shared memory (``_gather_pairs``'s
        assignment); key row ``row`` is token ``blk + row`` of the request."""
        half = self.chunks // 2
        rows_per_pass = WG // half
        c = tidx % half
        base = self._k_ctx(info, tc, blk)  # once-values: per block, outside the row loop
        for r in cutlass.range(self.tile_n // rows_per_pass, unroll=1):
            row = tidx // half + r * rows_per_pass
            lo = cute.make_rmem_tensor((8,), self.dtype)
            hi = cute.make_rmem_tensor((8,), self.dtype)
            s_lo = cute.local_tile(sK[row, None, stage], (8,), (c,))
            s_hi = cute.local_tile(sK[row, None, stage], (8,), (c + half,))
            cute.autovec_copy(s_lo, lo)
            cute.autovec_copy(s_hi, hi)
            self._transform_key_pairs(base, tc, blk + row, lo, hi, c * 8)
            cute.autovec_copy(lo, s_lo)
            cute.autovec_copy(hi, s_hi)


def swizzle_atom(D: int):
    """(columns, swizzle bits) of the 16-bit smem atom ``sm90_utils.get_smem_layout_atom`` picks
    for rows of D elements: 128-, 64- or 32-byte rows (Swizzle<3|2|1, 4, 3>)."""
    for aw, bits in ((64, 3), (32, 2), (16, 1)):
        if D % aw == 0:
            return aw, bits
    raise ValueError(f"head dim {D}: not a multiple of 16")


def regular_rows(D: int) -> bool:
    """Whether the gather's per-thread bases serve rows of D elements (``_gather_dst``)."""
    return D % 64 == 0 and WG % (D // 8) == 0


def check_gather_swizzle(layout, TN: int, D: int):
    """``_gather_dst`` / ``_gather_any`` compute stage-tile addresses themselves: verify at trace
    time that the tile is what they assume -- the linear map x(row, col, stage) in elements over
    atoms of ``aw`` columns under Swizzle<bits, 4, 3> (``swizzle_atom``; CuTe applies it to byte
    addresses) -- so a DSL change to the smem atom fails the build, not the output."""
    aw, bits = swizzle_atom(D)
    sw = layout.inner
    if (sw.num_bits, sw.num_base, sw.num_shift) != (bits, 4, 3):
        raise ValueError(f"gather: the stage tile's swizzle is not the one _gather_dst assumes ({layout})")
    for row in range(TN):
        for col in range(0, D, 8):
            for stage in range(2):
                x = stage * TN * D + (col // aw) * (TN * aw) + row * aw + col % aw
                if cute.crd2idx((row, col, stage), layout.outer) != x:
                    raise ValueError(f"gather: the stage tile's layout is not the one _gather_dst assumes ({layout})")
