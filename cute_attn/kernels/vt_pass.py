"""The V^T pass of fp8 attention (``kernels/prefill_fp8.py``): writes an fp8 V as V^T, the keys
contiguous per (kv head, head-dim row), each request's keys in groups of 32 in the permuted order
the attention kernel's P fragments have (``families/prefill_fp8.py``: ``vt_key``, the layout's
contract), pad columns zero.  For a paged cache it also gathers K into contiguous rows (the
kernel reads K by TMA, V^T by TMA).

One CTA per (group of 32 keys, kv head), 128 threads: the group's 32 rows of V (and K) come in
as 16-byte loads and go to shared memory (rows past the request's end as zeros); then thread d
(< head_dim) writes row d of the group's V^T, 32 bytes gathered from column d of the tile in
``vt_key`` order (one byte per shared load: a warp reads 32 consecutive bytes of one row, no
bank conflict).  The groups table (request, first key, V^T column) comes from the plan, so the
kernel needs no search; it is memory-bound (~1 byte read and 1 written per element of V)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8, const_expr

from ..families.prefill_fp8 import VT_GROUP, vt_key
from .pages import in_cache

THREADS = 128


class VtPass:
    def __init__(self, qkv_dtype, head_dim: int, paged: bool):
        assert head_dim <= THREADS and head_dim % 16 == 0
        self.dtype, self.head_dim, self.paged = qkv_dtype, head_dim, paged
        self.chunks = head_dim // 16  # 16-byte chunks per row

    @cute.jit
    def host(
        self,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKout: cute.Tensor,
        mVt: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mPageIndptr: cute.Tensor,
        mPageIndices: cute.Tensor,
        mGroups: cute.Tensor,
        num_groups: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """``mK`` / ``mV``: ``[pages, page_size, kv_heads, D]`` (paged) or ``[1, tokens, kv_heads,
        D]``; ``mKout``: paged K gathered to ``[1, tokens, kv_heads, D]`` (rows ``mKvIndptr``; unused
        when ragged); ``mVt``: ``[kv_heads, D, columns]``; ``mGroups``: per group (request, first
        key in the request, first V^T column)."""
        self.kernel(mK, mV, mKout, mVt, mKvIndptr, mPageIndptr, mPageIndices, mGroups).launch(
            grid=[num_groups, mV.shape[2], 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKout: cute.Tensor,
        mVt: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mPageIndptr: cute.Tensor,
        mPageIndices: cute.Tensor,
        mGroups: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        g, h, _ = cute.arch.block_idx()
        D, C = self.head_dim, self.chunks

        @cute.struct
        class Smem:
            tile: cute.struct.Align[cute.struct.MemRange[self.dtype, VT_GROUP * D], 16]

        st = cutlass.utils.SmemAllocator().allocate(Smem)
        sV = st.tile.get_tensor(cute.make_layout((VT_GROUP, D), stride=(D, 1)))
        req, key0, col0 = mGroups[g, 0], mGroups[g, 1], mGroups[g, 2]
        tok0 = mKvIndptr[req]
        n_valid = cutlass.min(mKvIndptr[req + 1] - tok0 - key0, VT_GROUP)
        page_size = None
        if const_expr(self.paged):
            page_size = cute.FastDivmodDivisorV2(mV.shape[1])
        for i in cutlass.range_constexpr(VT_GROUP * C // THREADS):
            idx = tidx + i * THREADS
            row, c = idx // C, idx % C
            vrow = cute.make_rmem_tensor((16,), self.dtype)
            vrow.fill(0.0)
            if row < n_valid:
                key = key0 + row
                if const_expr(self.paged):
                    page_idx, slot = divmod(key, page_size)
                    page = in_cache(mPageIndices[mPageIndptr[req] + page_idx], mV.shape[0])
                    krow = cute.make_rmem_tensor((16,), self.dtype)
                    cute.autovec_copy(cute.local_tile(mK[page, slot, h, None], (16,), (c,)), krow)
                    cute.autovec_copy(cute.local_tile(mV[page, slot, h, None], (16,), (c,)), vrow)
                    cute.autovec_copy(krow, cute.local_tile(mKout[0, tok0 + key, h, None], (16,), (c,)))
                else:
                    cute.autovec_copy(cute.local_tile(mV[0, tok0 + key, h, None], (16,), (c,)), vrow)
            cute.autovec_copy(vrow, cute.local_tile(sV[row, None], (16,), (c,)))
        cute.arch.barrier()
        sB = cute.recast_tensor(sV, Uint8)
        if tidx < D:
            for half in cutlass.range_constexpr(2):
                words = cute.make_rmem_tensor((4,), Int32)
                for w in cutlass.range_constexpr(4):
                    acc = Int32(0)
                    for b in cutlass.range_constexpr(4):
                        key = vt_key(16 * half + 4 * w + b)
                        acc = acc | (sB[key, tidx].to(Int32) << (8 * b))
                    words[w] = acc
                dst = cute.local_tile(mVt[h, tidx, None], (16,), ((col0 // 16) + half,))
                cute.autovec_copy(words, cute.recast_tensor(dst, Int32))


class VtPassPrmt(VtPass):
    """A variant (spec knob ``groups``: 1, 2 or 4): ``groups`` groups per CTA; every thread's
    16-byte reads issued before any shared store (the groups' table rows first); then thread u
    takes group u // (D / 4) and head-dim columns 4q .. 4q + 3 (q = u % (D / 4)): one word load
    per key (a warp reads one key's consecutive bytes: no bank conflict) and 4 x 4 PRMT byte
    transposes (8 per 16 output bytes) in ``vt_key`` order, against the default's one byte per
    shared load.  At 4 groups it ran 42.9 us against the default's 36.4 (2 x 8k x 16 heads, hd128,
    H200, f53ff88: 2048 CTAs of 16 KB are 1.2 waves); 1 and 2 groups not yet measured."""

    def __init__(self, qkv_dtype, head_dim: int, paged: bool, groups: int):
        super().__init__(qkv_dtype, head_dim, paged)
        assert groups in (1, 2, 4) and (VT_GROUP * self.chunks) % THREADS == 0
        self.groups = groups

    @cute.jit
    def host(
        self,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKout: cute.Tensor,
        mVt: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mPageIndptr: cute.Tensor,
        mPageIndices: cute.Tensor,
        mGroups: cute.Tensor,
        num_groups: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """``mK`` / ``mV``: ``[pages, page_size, kv_heads, D]`` (paged) or ``[1, tokens, kv_heads,
        D]``; ``mKout``: paged K gathered to ``[1, tokens, kv_heads, D]`` (rows ``mKvIndptr``; unused
        when ragged); ``mVt``: ``[kv_heads, D, columns]``; ``mGroups``: per group (request, first
        key in the request, first V^T column)."""
        ctas = (num_groups + (self.groups - 1)) // self.groups
        self.kernel(mK, mV, mKout, mVt, mKvIndptr, mPageIndptr, mPageIndices, mGroups, num_groups).launch(
            grid=[ctas, mV.shape[2], 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKout: cute.Tensor,
        mVt: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mPageIndptr: cute.Tensor,
        mPageIndices: cute.Tensor,
        mGroups: cute.Tensor,
        num_groups: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        blk, h, _ = cute.arch.block_idx()
        D, C, G = self.head_dim, self.chunks, self.groups
        rows = G * VT_GROUP

        @cute.struct
        class Smem:
            tile: cute.struct.Align[cute.struct.MemRange[self.dtype, rows * D], 16]

        st = cutlass.utils.SmemAllocator().allocate(Smem)
        sV = st.tile.get_tensor(cute.make_layout((rows, D), stride=(D, 1)))
        page_size = None
        if const_expr(self.paged):
            page_size = cute.FastDivmodDivisorV2(mV.shape[1])
        # each group's table row and bounds once (independent loads), then every chunk's load
        # before any shared store: all of a thread's 16-byte reads in flight at once
        meta = []
        for gg in cutlass.range_constexpr(G):
            g = blk * G + gg
            gc = cutlass.min(g, num_groups - 1)  # past the last group: in-bounds reads, nothing kept
            req, key0 = mGroups[gc, 0], mGroups[gc, 1]
            tok0 = mKvIndptr[req]
            n_valid = cutlass.min(mKvIndptr[req + 1] - tok0 - key0, VT_GROUP)
            n_valid = cutlass.select_(g < num_groups, n_valid, Int32(0))
            meta.append((req, key0, tok0, n_valid))
        per_group = VT_GROUP * C // THREADS  # a thread's chunks per group (a whole number: below)
        assert per_group * THREADS == VT_GROUP * C
        vrows = []
        for i in cutlass.range_constexpr(rows * C // THREADS):
            idx = tidx + i * THREADS
            row, c = idx // C, idx % C
            req, key0, tok0, n_valid = meta[i // per_group]  # idx // (VT_GROUP * C) = i // per_group
            vrow = cute.make_rmem_tensor((16,), self.dtype)
            vrow.fill(0.0)
            r = row % VT_GROUP
            if r < n_valid:
                key = key0 + r
                if const_expr(self.paged):
                    page_idx, slot = divmod(key, page_size)
                    page = in_cache(mPageIndices[mPageIndptr[req] + page_idx], mV.shape[0])
                    krow = cute.make_rmem_tensor((16,), self.dtype)
                    cute.autovec_copy(cute.local_tile(mK[page, slot, h, None], (16,), (c,)), krow)
                    cute.autovec_copy(cute.local_tile(mV[page, slot, h, None], (16,), (c,)), vrow)
                    cute.autovec_copy(krow, cute.local_tile(mKout[0, tok0 + key, h, None], (16,), (c,)))
                else:
                    cute.autovec_copy(cute.local_tile(mV[0, tok0 + key, h, None], (16,), (c,)), vrow)
            vrows.append(vrow)
        for i in cutlass.range_constexpr(rows * C // THREADS):
            idx = tidx + i * THREADS
            cute.autovec_copy(vrows[i], cute.local_tile(sV[idx // C, None], (16,), (idx % C,)))
        cute.arch.barrier()
        sW = cute.recast_tensor(sV, Int32)  # (rows, D / 4) words
        Q = D // 4
        gq = tidx // Q
        g = blk * G + gq
        valid = g < num_groups
        if const_expr(G * Q < THREADS):
            valid = valid & (tidx < G * Q)  # hd64: the upper half of the threads idles
        if valid:
            q = tidx % Q
            col0 = mGroups[g, 2]
            words = [sW[gq * VT_GROUP + vt_key(p), q] for p in range(VT_GROUP)]  # in column order
            out = [cute.make_rmem_tensor((4,), Int32) for _ in range(8)]  # (dim e, half): 4 words
            for w in cutlass.range_constexpr(VT_GROUP // 4):
                a = words[4 * w : 4 * w + 4]
                t0 = cute.arch.prmt(a[0], a[1], 0x5140)  # a0.0 a1.0 a0.1 a1.1
                t1 = cute.arch.prmt(a[0], a[1], 0x7362)  # a0.2 a1.2 a0.3 a1.3
                t2 = cute.arch.prmt(a[2], a[3], 0x5140)
                t3 = cute.arch.prmt(a[2], a[3], 0x7362)
                col = [
                    cute.arch.prmt(t0, t2, 0x5410),  # byte 0 (dim 4q) of the 4 keys
                    cute.arch.prmt(t0, t2, 0x7632),  # byte 1
                    cute.arch.prmt(t1, t3, 0x5410),
                    cute.arch.prmt(t1, t3, 0x7632),
                ]
                for e in cutlass.range_constexpr(4):
                    out[2 * e + w // 4][w % 4] = Int32(col[e])
            for e in cutlass.range_constexpr(4):
                for half in cutlass.range_constexpr(2):
                    dst = cute.local_tile(mVt[h, 4 * q + e, None], (16,), ((col0 // 16) + half,))
                    cute.autovec_copy(out[2 * e + half], cute.recast_tensor(dst, Int32))


def build_vt_pass(spec):
    """The jit entry of a ``vt_pass`` spec (qkv_dtype, head_dim, paged)."""
    from ..abi.dtypes import to_dsl
    from ..families.prefill_fp8 import vt_pass_abi
    from ..variants.trace import make_entry

    p = spec.pdict
    args = (to_dsl(p["qkv_dtype"]), p["head_dim"], bool(p["paged"]))
    kern = VtPassPrmt(*args, p["groups"]) if p.get("groups") else VtPass(*args)
    return make_entry(kern, vt_pass_abi(p), [])
