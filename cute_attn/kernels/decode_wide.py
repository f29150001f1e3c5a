"""Paged decode at head dim 512 (CuTe DSL): the ``paged_decode`` family's kernel for rows too
wide for ``kernels/decode.py``, built on the MLA kernel's geometry (``kernels/mla_decode.py``).

Why not ``decode.py``: there each warp owns 16 keys of a block and a whole 16 x head_dim output
accumulator -- at 512 that is 256 fp32 registers per thread, more than a thread has.  The MLA
kernel was made for exactly this width (its latent rows are 512 wide): the four warps of a
group split the score contraction (warp w: head dims [128 w, 128 w + 128); partial scores
summed through shared memory in a fixed order, so every warp holds the same bits of the whole
score tile) and the output columns (warp w: O columns [128 w, 128 w + 128), 64 registers).
What differs from MLA is only where the operands come from, so this class overrides the MLA
kernel's hooks:

- K and V are separate tensors of ``kv_heads`` heads (``[pages, page_size, kv_heads, 512]``,
  NHD or HND by strides), one kv head per work item (the cursor carries it); the MLA kernel
  reads one latent row as both K and V.  A stage holds the block's 32 K rows (ring slice
  2 s) and its 32 V rows (slice 2 s + 1): 64 KB at 16 bits; 3 stages + Q + the score
  exchange take 216 KB (one CTA per SM).
- No RoPE part: the contraction is the 512 K columns (8 k16 steps per warp, Q held as 32
  registers per thread).
- Two entries: ``host`` takes ``paged_decode``'s ABI (``families/decode.decode_abi_fixed``: one
  query token per request, so the MLA kernel's causal scalar is 0); ``host_prefill`` the
  prefill ABI of ``batch_prefill_mma`` at head dim 512 (16- or 32-row tiles of packed query
  rows, paged or ragged K / V -- ragged reads token ``kv_indptr[req] + pos`` of a
  ``[1, tokens, kv_heads, 512]`` view --, causal bottom-right as a static flag).  Work items,
  page lookups (``in_cache``), the ring that never drains at item boundaries, partial slots for
  the merge kernel and the epilogue are the MLA kernel's.

No variants (soft-cap, windows, RoPE in the kernel): the wrappers reject them at this head dim
before a launch.  No Hopper-only instruction: the same code compiles for sm_100a.  A prefill
here is an ``mma.sync`` kernel with 16 / 32-row tiles: correct for any length, but long
prefills are far from what a wgmma kernel would reach.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .copy import cp_async_16
from .mla_decode import BLOCK_N, GROUP_WARPS, ROWS, THREADS_PER_ROW, LoadStream, MlaConfig, MlaDecode, smem_off
from .pages import in_cache
from .work import ItemInfo, tok_head

HEAD_DIM = 512
O_COLS = HEAD_DIM // GROUP_WARPS  # each warp's k columns of S and output columns of O: 128
ATOMS = HEAD_DIM // 64  # 64-wide swizzle atoms per row: 8 (a row's 8 threads copy chunk t of each)


class WideDecode(MlaDecode):
    def __init__(self, dtype, tile_q: int, stages: int, paged: bool = True, causal: bool = False):
        """A 16-bit cache, ``tile_q`` packed rows per item (16 or 32: one or two warp groups),
        ``stages`` KV blocks in flight; ``paged`` (else ragged K / V, ``[1, tokens, kv_heads,
        512]`` with token offsets ``kv_indptr``) and ``causal`` (bottom-right) for the prefill
        entry (``host_prefill``)."""
        assert tile_q % ROWS == 0, tile_q
        super().__init__(MlaConfig(dtype, tile_q // ROWS, stages))
        self.width = HEAD_DIM
        self.tile_stages = 2 * self.stages  # K of stage s in ring slice 2 s, V in 2 s + 1
        self.paged = paged
        self.causal = causal

    @classmethod
    def for_decode(cls, cfg):
        """The ``paged_decode`` spec's kernel (``kernels.decode.DecodeConfig``: head dim 512, no
        variant, one kv head per item, a 16-bit cache)."""
        assert cfg.head_dim == HEAD_DIM and cfg.variant is None, cfg
        assert cfg.heads_per_item == 1 and cfg.kv_dtype is None, cfg
        return cls(cfg.dtype, cfg.tile_q, cfg.stages)

    @classmethod
    def for_prefill(cls, cfg, stages: int):
        """The ``batch_prefill_mma`` spec's kernel (``kernels.prefill_mma.PrefillMmaConfig``: head
        dim 512, no soft-cap, window or variant)."""
        assert cfg.head_dim == HEAD_DIM and cfg.variant is None and not (cfg.soft_cap or cfg.window), cfg
        return cls(cfg.dtype, cfg.tile_q, stages, cfg.paged, cfg.causal)

    @cute.jit
    def host(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        sm_scale: Float32,
        num_ctas: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """The host function behind the generated entry (``variants.trace.make_entry``): the
        ``paged_decode`` arguments mapped onto the MLA kernel's (Q as its one query part, K and V
        as its two caches, causal 0: the kernel's parameters keep the ABI's tensor order)."""
        tensors = (mK, mV, mKvIndptr, mKvIndices, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse)
        self._launch((mQ,), tensors, group, Int32(0), sm_scale, num_ctas, stream)

    @cute.jit
    def host_prefill(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        sm_scale: Float32,
        soft_cap: Float32,
        window_left: Int32,
        num_ctas: Int32,
        var_tensors: tuple,
        var_scalars: tuple,
        stream: cuda.CUstream,
    ):
        """The ``batch_prefill_mma`` host function (the prefill ABI; soft-cap and window are not
        served at this head dim, so their scalars are unused)."""
        tensors = (mK, mV, mKvIndptr, mKvIndices, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse)
        self._launch((mQ,), tensors, group, Int32(1 if self.causal else 0), sm_scale, num_ctas, stream)

    # ---- the shared tiles each warp reads (runtime offsets: whole 8 x 64 swizzle atoms) ------
    def _block_tile(self, sKV, ld: LoadStream, stage):
        """(K tile, V tile) of the block in ring stage ``stage``: [32, 512] each."""
        return sKV[None, None, 2 * stage], sKV[None, None, 2 * stage + 1]

    def _q_tiles(self, sQ, grp, wg):
        """Warp (grp, wg)'s Q: the group's 16 rows, columns [128 wg, 128 wg + 128)."""
        return cute.local_tile(cute.local_tile(sQ, (ROWS, HEAD_DIM), (grp, 0)), (ROWS, O_COLS), (0, wg))

    def _q_fragments(self, thr_mma, sQ, grp, wg):
        return thr_mma.make_fragment_A(thr_mma.partition_A(self._q_tiles(sQ, grp, wg)))

    def _load_q(self, s2r_q, sQ, tSrQ, grp, wg, lane):
        cute.copy(s2r_q, s2r_q.partition_S(self._q_tiles(sQ, grp, wg)), s2r_q.retile(tSrQ))

    def _scores(self, tiled_mma, thr_mma, s2r_k, acc_S, tSrQ, sKV_blk, wg, lane):
        """acc_S += this warp's 8 Q steps x the block's keys over the same columns."""
        sK_c = cute.local_tile(sKV_blk[0], (BLOCK_N, O_COLS), (0, wg))
        tSsK = s2r_k.partition_S(sK_c)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_c))
        tSrK_v = s2r_k.retile(tSrK)
        for i in range(cute.size(tSrK, mode=[2])):
            cute.copy(s2r_k, tSsK[None, None, i], tSrK_v[None, None, i])
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, i], tSrK[None, None, i], acc_S)

    def _v_step(self, thr_mma, s2r_v, sKV_blk, k, wg, lane):
        """B operand of O += P V: keys [16 k, 16 k + 16) x this warp's 128 columns of the V tile,
        seen as V^T [128, 16] and read by the transposing ldmatrix."""
        sV_k = cute.local_tile(sKV_blk[1], (16, O_COLS), (k, wg))
        sVt = cute.composition(sV_k, cute.make_layout((O_COLS, 16), stride=(16, 1)))
        tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        cute.copy(s2r_v, s2r_v.partition_S(sVt), s2r_v.retile(tOrV))
        return tOrV

    # ---- loads ------------------------------------------------------------------------------
    @cute.jit
    def _stage_q(self, mQ: tuple, sQ: cute.Tensor, info: ItemInfo, tidx: Int32):
        """The item's Q tile into the staging tile: row tidx / 8, chunks t, t + 8, .. (t = tidx
        mod 8); all loads first, then the stores.  Rows past num_rows re-read row 0 and are never
        written out."""
        r = tidx // THREADS_PER_ROW
        t = tidx % THREADS_PER_ROW
        j = r if r < info.num_rows else 0
        tok, head = tok_head(info, info.row_start + j)
        frags = []
        for c in cutlass.range_constexpr(ATOMS):
            frag = cute.make_rmem_tensor((8,), self.dtype)
            cute.autovec_copy(cute.local_tile(mQ[0][tok, head, None], (8,), (t + 8 * c,)), frag)
            frags.append(frag)
        base = sQ.iterator.toint()
        for c in cutlass.range_constexpr(ATOMS):
            off = smem_off(r, c, t, 0, self.tile_q, HEAD_DIM)
            dst = cute.make_ptr(self.dtype, base + off * 2, cute.AddressSpace.smem, assumed_align=16)
            cute.autovec_copy(frags[c], cute.make_tensor(dst, cute.make_layout((8,))))

    def _lookup(self, ld: LoadStream, page_base: Int32, blk_start: Int32, kv_end: Int32):
        """Paged: the MLA kernel's page lookups.  Ragged: the request's first token in K / V
        (``page_base`` is its token offset), kept for the copies."""
        if self.paged:
            MlaDecode._lookup(self, ld, page_base, blk_start, kv_end)
        else:
            ld.rows[0] = page_base

    @cute.jit
    def _issue_kv(self, ld: LoadStream, blk_start: Int32, kv_end: Int32, stage: Int32, head: Int32):
        """cp.async this thread's chunks of the block's rows of kv head ``head`` into a stage: per
        row, chunks t, t + 8, .., t + 56 of K and of V (t = tidx mod 8): 8 threads read a row's
        1024 bytes of each as 8 fully used 128-byte lines.  ``ld.mCkv`` / ``ld.mKpe`` hold K / V."""
        t = ld.tidx % THREADS_PER_ROW
        for i in cutlass.range_constexpr(self.n_lookups):
            pos = self._row_pos(ld.tidx, i, blk_start, kv_end)
            if const_expr(self.paged):
                _, slot = divmod(pos, ld.page_size)
                page = in_cache(ld.rows[i], ld.mCkv.shape[0])
            else:  # ragged: token base + pos of the one "page"
                slot = ld.rows[0] + pos
                page = Int32(0)
            r = ld.tidx // THREADS_PER_ROW + i * self.row_step
            k_row = ld.mCkv[page, slot, head, None].iterator.toint()
            v_row = ld.mKpe[page, slot, head, None].iterator.toint()
            for c in cutlass.range_constexpr(ATOMS):
                cp_async_16(ld.kv_base + smem_off(r, c, t, 2 * stage, BLOCK_N, HEAD_DIM) * 2, k_row + (t + 8 * c) * 16)
            for c in cutlass.range_constexpr(ATOMS):
                cp_async_16(
                    ld.kv_base + smem_off(r, c, t, 2 * stage + 1, BLOCK_N, HEAD_DIM) * 2, v_row + (t + 8 * c) * 16
                )
