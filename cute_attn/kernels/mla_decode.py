"""Paged MLA attention in the absorbed form (CuTe DSL), executing the scheduler's work items.

Multi-head latent attention (DeepSeek-V2/V3) after matrix absorption has one latent KV head
shared by every query head: per token a compressed row ``ckv`` (512 wide) and a RoPE row
``kpe`` (64 wide).  For query head h of a token::

    s_j = (q_nope[h] . ckv_j + q_pe[h] . kpe_j) * sm_scale      (K = [ckv | kpe], 576 wide)
    o   = softmax(s) . ckv                                       (V = ckv, 512 wide)

so every key is read once for *all* heads: a work item is a tile of packed query rows (heads x
query tokens of one request, the planner's GQA packing with group = heads and one kv head;
contract: ``cute_attn/sched/__init__.py``), and the [ckv | kpe] row in shared memory serves as
K of the scores and as V of the output (FlashMLA's idea, written here on ``mma.sync``).

Geometry (``TILE_Q = 16 x row_groups`` rows; one group = 4 warps = 16 rows):
- **Loads**: one stream of ``cp.async`` 16-byte copies over the CTA's items, ``stages`` blocks of
  ``BLOCK_N`` = 32 tokens in flight (the load cursor runs ``stages - 1`` blocks ahead and moves
  to the next item as soon as one is exhausted, so the ring never drains at item boundaries).
  8 threads copy one token's row: chunks t, t+8, .. of ckv and chunk t of kpe, one page lookup
  per token (``kernels/pages.py`` clamps it into the cache).  A stage is [32, 576] 16-bit
  values under the 128-byte swizzle: 36 KB.
- **Q** of an item is read once (16-byte loads into a swizzled staging tile, one barrier) and
  kept in registers: warp w of a group holds 9 k16 steps of the 576-wide rows, the 8 of ckv
  columns [128 w, 128 w + 128) and q_pe step w (columns 512 + 16 w ..), 36 registers.
- **S = Q Kᵀ split over the contraction**: warp w computes the 16 x 32 scores over its 9
  steps (36 MMAs), writes the partial sums to shared memory (8 KB per group), one barrier, and
  every warp adds the four partials in the same fixed order: each warp then holds the whole
  score tile, bitwise the same in all four, and runs the online softmax on it redundantly (16
  values per thread).  So no max exchange and no P round trip through shared memory: P goes
  from the accumulator to the A operand in registers.
- **O += P V split over the output columns**: warp w owns columns [128 w, 128 w + 128) of the
  512 (a 16 x 128 fp32 accumulator: 64 registers per thread), V from the same stage by the
  transposing ``ldmatrix``.  Every warp has the same row statistics, so the epilogue needs no
  ⊕ between warps: each normalizes and stores its own columns (bf16 / fp16 rows + LSE, or an
  fp32 partial slot for the merge kernel).
Two barriers per block (the stage's arrival and the partial scores), none in the epilogue.

Why the contraction split: holding all of a 16 x 576 Q tile as A fragments takes 144 registers
per thread; split four ways it is 36, and the partial-score exchange (8 KB written, 32 KB read
per block and group) costs less shared bandwidth than re-reading Q from shared memory each
block (4 x 18 KB).  Bytes per SM: 36 KB per block and ~2 blocks per microsecond at 4.8 TB/s
over 132 SMs; one group's 68 MMAs per warp take well under that (memory-bound at 16 rows).

Shared-memory views: every runtime offset of a tile view is a whole number of 8 x 64 swizzle
atoms; steps inside an atom are constant indices of a partitioned view (the kpe step of warp w
by a branch on w).  ``local_tile`` at a runtime offset *inside* an atom (the first version's
steps ``w + 4 i``) is lowered by the DSL 4.8.1 with the offset added twice -- inside the XOR and
to the address -- and read the wrong rows (relative error ~1 on the H200).  tests/
test_mla_smem_probe.py checks every ldmatrix address of the warps' views from the PTX, and
tests/test_mla_ptx_emulated.py runs the whole compiled kernel on the CPU (tests/ptx_interp.py).

Causal masking (runtime ``causal``) is bottom-right aligned: packed row r of an item is query
token ``r // group`` at position ``kv_len - qo_len + r // group`` and sees keys up to it.
Scores are kept in base 2 (scaled by ``sm_scale * log2 e``), so the LSE is base 2 as FlashInfer
returns it.  No Hopper-only instruction: the same code compiles for sm_100a.

An fp8 latent cache (``kernels/mla_decode_fp8.py``) overrides where the loads land
(``_smem_fields``, ``_kv_tiles``, ``_ring_base``, ``_issue_kv``, ``_block_tile``: a byte ring),
how the operands reach the MMAs (``_q_fragments`` / ``_load_q``, ``_scores``, ``_v_step``:
ldmatrix of byte pairs converted in registers) and where the output columns go
(``_out_vectors``); here those hooks are the 16-bit kernel's own steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from ..variants.dsl import LOG2E
from .copy import cp_async_16
from .fragments import mma_acc_as_a, mma_mn_view, quad_max, quad_sum
from .pages import in_cache
from .work import ItemInfo, tok_head

D_CKV = 512  # latent (compressed KV) width: the output width
D_KPE = 64  # RoPE part of the key
D_QK = D_CKV + D_KPE  # score contraction width
BLOCK_N = 32  # tokens per pipeline stage
ROWS = 16  # packed query rows per warp group (one m16 MMA tile)
GROUP_WARPS = 4
O_COLS = D_CKV // GROUP_WARPS  # output columns per warp: 128
ROW_CHUNKS = D_QK // 8  # 16-byte chunks per [ckv | kpe] row: 72 (64 + 8)
THREADS_PER_ROW = 8  # threads that copy one row (8 ckv chunks + 1 kpe chunk each)


@dataclass(frozen=True)
class MlaConfig:
    """What an ``mla_decode`` specialization fixes: the value dtype (DSL type), the warp groups
    per CTA (16 rows each), the pipeline depth and an fp8 cache's dtype (None: the value dtype)."""

    dtype: Any
    row_groups: int
    stages: int
    kv_dtype: Any = None

    @classmethod
    def from_spec(cls, p: dict) -> MlaConfig:
        from ..abi.dtypes import to_dsl

        assert p["head_dim_ckv"] == D_CKV and p["head_dim_kpe"] == D_KPE, p
        assert p["tile_q"] % ROWS == 0, p
        kv = to_dsl(p["kv_dtype"]) if "kv_dtype" in p else None
        return cls(to_dsl(p["dtype"]), p["tile_q"] // ROWS, p["stages"], kv)


class Cursor:
    """The load cursor: the item it is in, its next block ``nb`` of ``n``, the item's token range
    [start, end), its page-table offset ``base`` and kv head ``head`` (0 for MLA's one latent
    head).  Carried through the kernel's loops as seven Int32 values in this order
    (``__extract_mlir_values__``)."""

    FIELDS = ("item", "nb", "n", "start", "end", "base", "head")

    def __init__(self, item, nb, n, start, end, base, head):
        self.item, self.nb, self.n, self.start, self.end, self.base = item, nb, n, start, end, base
        self.head = head

    def next_block(self):
        return Cursor(self.item, self.nb + 1, self.n, self.start, self.end, self.base, self.head)

    def astuple(self):
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __extract_mlir_values__(self):
        return [v for f in self.FIELDS for v in cutlass.extract_mlir_values(getattr(self, f))]

    def __new_from_mlir_values__(self, values):
        return Cursor(*[cutlass.new_from_mlir_values(getattr(self, f), [v]) for f, v in zip(self.FIELDS, values)])


@dataclass(frozen=True)
class LoadStream:
    """What the load cursor reads and writes, fixed for the CTA (made before the item loop and
    only read in it): the caches and page table, the stage ring's base address, the page lookups
    of the cursor's next block (``rows``), this thread, the page-size divisor and the work list."""

    mCkv: Any
    mKpe: Any
    mWork: Any
    mKvIndptr: Any
    mKvIndices: Any
    kv_base: Any
    rows: Any
    tidx: Any
    page_size: Any
    group: Any
    item_end: Any


def smem_off(r, j, t, s, rows: int, width: int = D_QK):
    """Element offset of row r, 16-byte chunk 8 j + t (j < width / 64: chunk column j of the
    swizzle atom; t < 8), slice s of a (rows, width, n) tile: 128-byte rows, chunk XOR (row mod 8)."""
    return s * (rows * width) + j * (rows * 64) + r * 64 + (t ^ (r % 8)) * 8


def swizzle_atom():
    """The 8 x 64 atom of the shared tiles: ldmatrix's 8 rows of one chunk hit 8 bank groups."""
    return cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))


class MlaDecode:
    def __init__(self, cfg: MlaConfig):
        assert cfg.row_groups in (1, 2) and cfg.stages >= 2, cfg
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.groups = cfg.row_groups
        self.tile_q = ROWS * cfg.row_groups
        self.stages = cfg.stages
        self.threads = 32 * GROUP_WARPS * cfg.row_groups
        self.row_step = self.threads // THREADS_PER_ROW  # a thread's copied rows are row_step apart
        self.n_lookups = BLOCK_N // self.row_step  # tokens each thread copies per block
        assert self.n_lookups * self.row_step == BLOCK_N
        assert self.tile_q * THREADS_PER_ROW == self.threads  # Q staging: one row per 8 threads
        self.tile_stages = self.stages  # 16-bit [32, 576] tiles in shared memory: the ring itself
        self.mma_dtype = self.dtype  # the MMA's operand dtype (P is converted to it)
        self.width = D_QK  # values per row of the stage and Q tiles

    # ---- host side ----------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQn: cute.Tensor,
        mQp: cute.Tensor,
        mCkv: cute.Tensor,
        mKpe: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        causal: Int32,
        sm_scale: Float32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tensors = (mCkv, mKpe, mKvIndptr, mKvIndices, mO, mLse, mWork, mWorkIndptr, mPartO, mPartLse)
        self._launch((mQn, mQp), tensors, group, causal, sm_scale, num_ctas, stream)

    def _launch(self, mQ: tuple, tensors: tuple, group, causal, sm_scale, num_ctas, stream):
        """Every entry's launch (traced inline into the calling host function): the query parts
        (``kernel``'s ``mQ``), then the kernel's tensors from the caches to the partial LSEs."""
        kv_layout, q_layout, Smem = self.smem_layouts()
        self._check_smem_off(kv_layout, BLOCK_N, min(2, self.tile_stages))
        self._check_smem_off(q_layout, self.tile_q, None)
        self.kernel(mQ, *tensors, group, causal, sm_scale * LOG2E, kv_layout, q_layout, self.make_mma(), Smem).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    def smem_layouts(self):
        """(stage ring layout, Q staging layout, the shared-memory struct): trace-time values."""
        kv_layout = cute.tile_to_shape(swizzle_atom(), (BLOCK_N, self.width, self.tile_stages), (0, 1, 2))
        q_layout = cute.tile_to_shape(swizzle_atom(), (self.tile_q, self.width), (0, 1))
        fields = self._smem_fields(kv_layout, q_layout)
        # built from evaluated annotations: this module's are strings (``from __future__``)
        return kv_layout, q_layout, cute.struct(type("Smem", (), {"__annotations__": fields}))

    def _smem_fields(self, kv_layout, q_layout) -> dict:
        return {
            "sKV": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024],
            # the partial scores: per group, warp, 4-value vector and lane (16-byte accesses of
            # 8 consecutive lanes are 128 contiguous bytes: no bank conflict)
            "sS": cute.struct.Align[cute.struct.MemRange[Float32, self.groups * GROUP_WARPS * ROWS * BLOCK_N], 16],
        }

    def make_mma(self):
        """m16n8k16 with fp32 accumulators, 16 x 16 x 16 per warp (two n8 atoms: one ldmatrix.x4)."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.mma_dtype, Float32, (16, 8, 16)), (1, 1, 1), permutation_mnk=(16, 16, 16)
        )

    def warp_copies(self, tiled_mma, lane):
        """This lane's ldmatrix copies: Q as the A operand, K as B of S, V (transposed) as B of O."""
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(lane)
        s2r_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(lane)
        s2r_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(lane)
        return s2r_q, s2r_k, s2r_v

    def _check_smem_off(self, layout, rows: int, slices):
        """Trace time: ``smem_off`` agrees with the layout's own offsets (``slices`` of a
        (rows, width, n) layout, None for a (rows, width) one)."""
        for r in range(rows):
            for c in range(self.width // 8):
                for s in range(slices or 1):
                    crd = (r, c * 8, s) if slices else (r, c * 8)
                    want = cute.crd2idx(crd, layout)
                    got = smem_off(r, c // 8, c % 8, s, rows, self.width)
                    if want != got:
                        raise AssertionError(f"smem_off({r}, {c}, {s}) = {got}, layout {want}")

    # ---- device side --------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: tuple,
        mCkv: cute.Tensor,
        mKpe: cute.Tensor,
        mKvIndptr: cute.Tensor,
        mKvIndices: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mWork: cute.Tensor,
        mWorkIndptr: cute.Tensor,
        mPartO: cute.Tensor,
        mPartLse: cute.Tensor,
        group: Int32,
        causal: Int32,
        scale_log2: Float32,
        kv_layout: cute.ComposedLayout,
        q_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        # the merge kernel (a programmatic dependent launch) may start now; it waits for this
        # grid before it reads a partial
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wid = tidx // 32
        lane = tidx % 32
        grp = wid // GROUP_WARPS  # this warp's 16 rows of the tile
        wg = wid % GROUP_WARPS  # its k steps of S and its 128 columns of O

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        sKV = self._kv_tiles(st, kv_layout)
        sQ = st.sQ.get_tensor(q_layout)
        # sS[e, lane, warp, group]: accumulator value e of a lane's 16-value score fragment
        sS = st.sS.get_tensor(
            cute.make_layout(
                ((4, 4), 32, GROUP_WARPS, self.groups),
                stride=((1, 128), 4, 512, 512 * GROUP_WARPS),
            )
        )

        thr_mma = tiled_mma.get_slice(lane)
        s2r_q, s2r_k, s2r_v = self.warp_copies(tiled_mma, lane)

        tScS = mma_mn_view(thr_mma.partition_C(cute.make_identity_tensor((ROWS, BLOCK_N))))
        tOcO = mma_mn_view(thr_mma.partition_C(cute.make_identity_tensor((ROWS, O_COLS))))
        n_rows_thr = cute.size(tScS, mode=[0])
        n_cols_s = cute.size(tScS, mode=[1])

        page_size = cute.FastDivmodDivisorV2(mCkv.shape[1])
        rows = cute.make_rmem_tensor((self.n_lookups,), Int32)  # the pages of the cursor's next block
        item_begin, item_end = mWorkIndptr[cta], mWorkIndptr[cta + 1]
        ld = LoadStream(
            mCkv, mKpe, mWork, mKvIndptr, mKvIndices, self._ring_base(st, sKV), rows, tidx, page_size, group, item_end
        )
        # The loads run as one stream over this CTA's items, stages - 1 blocks ahead of the
        # compute, into a ring that does not restart at item boundaries (block t of the stream
        # goes to stage t % stages); one cp.async group per block and one block issued per
        # computed block, so the wait for block t is always "all but the stages - 2 newest".
        z = Int32(0)
        cur = self._cursor_next(ld, Cursor(item_begin - 1, z, z, z, z, z, z))
        for s in cutlass.range_constexpr(self.stages - 1):
            cur = self._cursor_issue(ld, s, cur)
        g = Int32(0)  # blocks computed so far: the stream position of this item's block 0
        for item in cutlass.range(item_begin, item_end, unroll=1):
            info = ItemInfo(mWork, item, group)
            n_blocks = (info.kv_end - info.kv_start + BLOCK_N - 1) // BLOCK_N
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, O_COLS)), Float32)
            acc_O.fill(0.0)
            row_m = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_l = cute.make_rmem_tensor((n_rows_thr,), Float32)
            row_m.fill(-Float32.inf)
            row_l.fill(0.0)
            # the last key + 1 each accumulator row may see: the item's end, or before that its
            # query position + 1 when causal (bottom-right aligned)
            row_lim = cute.make_rmem_tensor((n_rows_thr,), Int32)
            for r in cutlass.range_constexpr(n_rows_thr):
                j = grp * ROWS + tScS[r, 0][0]
                q_pos = info.qpos_base + (info.row_start + j) // group
                lim = info.kv_end
                if causal != 0:
                    lim = cutlass.min(lim, q_pos + 1)
                row_lim[r] = lim
            # this warp's Q: ckv columns [128 wg, 128 wg + 128) (8 k16 steps) and kpe step wg
            tSrQ = self._q_fragments(thr_mma, sQ, grp, wg)
            if n_blocks > 0:
                # Q: 16-byte loads into the staging tile, one barrier, then this warp's steps into
                # registers.  The next item writes the tile only after this item's blocks, each
                # behind a barrier, so every warp has read it by then.
                self._stage_q(mQ, sQ, info, tidx)
                cute.arch.sync_threads()
                self._load_q(s2r_q, sQ, tSrQ, grp, wg, lane)

            for nb in cutlass.range(n_blocks):
                cute.arch.cp_async_wait_group(self.stages - 2)
                cute.arch.sync_threads()
                cur = self._cursor_issue(ld, (g + nb + self.stages - 1) % self.stages, cur)
                sK = self._block_tile(sKV, ld, (g + nb) % self.stages)
                key0 = info.kv_start + nb * BLOCK_N

                # S partial = Q Kᵀ over this warp's k steps (16 rows x 32 keys)
                acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, BLOCK_N)), Float32)
                acc_S.fill(0.0)
                self._scores(tiled_mma, thr_mma, s2r_k, acc_S, tSrQ, sK, wg, lane)
                self._exchange_scores(acc_S, sS, lane, wg, grp)

                # logits (base 2), mask, online softmax: the same values in every warp of the group
                acc_S_mn = mma_mn_view(acc_S)
                acc_O_mn = mma_mn_view(acc_O)
                for r in cutlass.range_constexpr(n_rows_thr):
                    m_blk = -Float32.inf
                    for c in cutlass.range_constexpr(n_cols_s):
                        v = acc_S_mn[r, c] * scale_log2
                        v = v if key0 + tScS[0, c][1] < row_lim[r] else -Float32.inf
                        acc_S_mn[r, c] = v
                        m_blk = cute.arch.fmax(m_blk, v)
                    m_blk = quad_max(m_blk)
                    m_new = cute.arch.fmax(row_m[r], m_blk)
                    m_use = m_new if m_new != -Float32.inf else Float32(0.0)
                    corr = cute.math.exp2(row_m[r] - m_use, fastmath=True)
                    l_blk = Float32(0.0)
                    for c in cutlass.range_constexpr(n_cols_s):
                        p = cute.math.exp2(acc_S_mn[r, c] - m_use, fastmath=True)
                        acc_S_mn[r, c] = p
                        l_blk = l_blk + p
                    row_l[r] = row_l[r] * corr + l_blk  # per-thread partial sum, quad-reduced at the end
                    row_m[r] = m_new
                    for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                        acc_O_mn[r, c] = acc_O_mn[r, c] * corr

                # O += P V over this warp's 128 columns, 16 keys at a time
                rP = cute.make_fragment_like(acc_S, self.mma_dtype)
                rP.store(acc_S.load().to(self.mma_dtype))
                tOrP = mma_acc_as_a(rP)
                for k in cutlass.range_constexpr(BLOCK_N // 16):
                    tOrV = self._v_step(thr_mma, s2r_v, sK, k, wg, lane)
                    cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrV[None, None, 0], acc_O)

            g = g + n_blocks
            self._store(mO, mLse, mPartO, mPartLse, acc_O, row_m, row_l, (tScS, tOcO), info, lane, wg, grp)

    # ---- the shared tiles each warp reads -----------------------------------------------------
    def _kv_tiles(self, st, kv_layout):
        """The 16-bit stage tiles (the ring the loads write)."""
        return st.sKV.get_tensor(kv_layout)

    def _ring_base(self, st, sKV):
        """Shared byte address of the stage ring the loads write: the 16-bit tiles themselves."""
        return sKV.iterator.toint()

    def _block_tile(self, sKV, ld: LoadStream, stage):
        """The [32, 576] 16-bit tile of the block that arrived in ring stage ``stage``."""
        return sKV[None, None, stage]

    # Every runtime offset is a whole number of 8 x 64 swizzle atoms (rows 8 k, columns 64 k);
    # offsets inside an atom are constants of a partitioned view (``_load_pe_step``).  The DSL
    # (4.8.1) lowers ``local_tile`` at a runtime column offset inside an atom wrongly: the offset
    # is applied both inside the swizzle and to the address (tests/test_mla_smem_probe.py).
    def _q_tiles(self, sQ, grp, wg):
        """Warp (grp, wg)'s Q: the group's 16 rows, ckv columns [128 wg, 128 wg + 128) and the kpe part."""
        sQ_g = cute.local_tile(sQ, (ROWS, D_QK), (grp, 0))
        return cute.local_tile(sQ_g, (ROWS, O_COLS), (0, wg)), cute.local_tile(sQ_g, (ROWS, D_KPE), (0, D_CKV // D_KPE))

    def _q_fragments(self, thr_mma, sQ, grp, wg):
        """This warp's Q registers (A operands): the 8 ckv steps and the kpe step, unloaded."""
        sQ_c, sQ_p = self._q_tiles(sQ, grp, wg)
        tSrQ_c = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_c))
        tSrQ_p = thr_mma.make_fragment_A(thr_mma.partition_A(cute.local_tile(sQ_p, (ROWS, 16), (0, 0))))
        return tSrQ_c, tSrQ_p

    def _load_q(self, s2r_q, sQ, tSrQ, grp, wg, lane):
        """The staged Q tile's steps of this warp into its registers (``ldmatrix``)."""
        tSrQ_c, tSrQ_p = tSrQ
        sQ_c, sQ_p = self._q_tiles(sQ, grp, wg)
        cute.copy(s2r_q, s2r_q.partition_S(sQ_c), s2r_q.retile(tSrQ_c))
        self._load_pe_step(s2r_q, s2r_q.partition_S(sQ_p), s2r_q.retile(tSrQ_p), wg)

    def _scores(self, tiled_mma, thr_mma, s2r_k, acc_S, tSrQ, sK, wg, lane):
        """acc_S += this warp's Q steps x the block's keys (K by ``ldmatrix``, one step ahead of
        nothing: each step's fragment is loaded right before its MMAs)."""
        tSrQ_c, tSrQ_p = tSrQ
        sK_c, sK_p = self._k_tiles(sK, wg)
        tSsK = s2r_k.partition_S(sK_c)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_c))
        tSrK_v = s2r_k.retile(tSrK)
        for i in range(cute.size(tSrK, mode=[2])):
            cute.copy(s2r_k, tSsK[None, None, i], tSrK_v[None, None, i])
            cute.gemm(tiled_mma, acc_S, tSrQ_c[None, None, i], tSrK[None, None, i], acc_S)
        tSrKp = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(sK_p, (BLOCK_N, 16), (0, 0))))
        self._load_pe_step(s2r_k, s2r_k.partition_S(sK_p), s2r_k.retile(tSrKp), wg)
        cute.gemm(tiled_mma, acc_S, tSrQ_p[None, None, 0], tSrKp[None, None, 0], acc_S)

    def _v_step(self, thr_mma, s2r_v, sK, k, wg, lane):
        """B operand of O += P V for keys [16 k, 16 k + 16) and this warp's 128 columns."""
        sVt = self._v_tile(sK, k, wg)
        tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        cute.copy(s2r_v, s2r_v.partition_S(sVt), s2r_v.retile(tOrV))
        return tOrV

    def _out_vectors(self, tOcO):
        """How a thread's accumulator columns leave: (first output column of the warp's 128,
        accumulator columns of the mn view in output order) per vector store -- here each n8
        tile's two adjacent columns."""
        n_cols = cute.size(tOcO, mode=[1])
        return [(tOcO[0, 2 * c][1], (2 * c, 2 * c + 1)) for c in range(n_cols // 2)]

    def _k_tiles(self, sK, wg):
        """A stage's keys as warp wg reads them for S: ckv columns [128 wg, +128) and the kpe part."""
        return cute.local_tile(sK, (BLOCK_N, O_COLS), (0, wg)), cute.local_tile(
            sK, (BLOCK_N, D_KPE), (0, D_CKV // D_KPE)
        )

    def _v_tile(self, sK, k, wg):
        """Keys [16 k, 16 k + 16) x ckv columns [128 wg, +128) of a stage seen as V^T [128, 16] (n = output
        column, k = key), read by the transposing ldmatrix."""
        sV_k = cute.local_tile(sK, (16, O_COLS), (k, wg))
        return cute.composition(sV_k, cute.make_layout((O_COLS, 16), stride=(16, 1)))

    @cute.jit
    def _load_pe_step(self, s2r, src: cute.Tensor, dst: cute.Tensor, wg: Int32):
        """k16 step ``wg`` of a partitioned 64-wide kpe tile (``src``: the copy's source view,
        (CPY, .., 4)) into the one-step fragment view ``dst``.  The step is picked by a branch
        on the warp, each branch with a constant index: a runtime offset inside a 64-wide
        swizzle atom is never formed (see the module doc)."""
        for kk in cutlass.range_constexpr(D_KPE // 16):
            if wg == kk:
                cute.copy(s2r, src[None, None, kk], dst[None, None, 0])

    # ---- the score exchange ------------------------------------------------------------------
    @cute.jit
    def _exchange_scores(self, acc_S: cute.Tensor, sS: cute.Tensor, lane: Int32, wg: Int32, grp: Int32):
        """Replace this warp's partial scores by the group's total: write them (4 x 16 bytes per
        lane), one barrier, add the four warps' partials in warp order (so every warp gets the
        same bits).  The next block writes sS only after its own first barrier, which every warp
        reaches after these reads."""
        n = cute.size(acc_S)
        for v in cutlass.range_constexpr(n // 4):
            frag = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                frag[e] = acc_S[4 * v + e]
            cute.autovec_copy(frag, cute.local_tile(sS[None, lane, wg, grp], (4,), (v,)))
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(GROUP_WARPS):
            for v in cutlass.range_constexpr(n // 4):
                frag = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.local_tile(sS[None, lane, w, grp], (4,), (v,)), frag)
                for e in cutlass.range_constexpr(4):
                    if const_expr(w == 0):
                        acc_S[4 * v + e] = frag[e]
                    else:
                        acc_S[4 * v + e] = acc_S[4 * v + e] + frag[e]

    # ---- loads ------------------------------------------------------------------------------
    @cute.jit
    def _stage_q(self, mQ: tuple, sQ: cute.Tensor, info: ItemInfo, tidx: Int32):
        """The item's Q tile into the staging tile: row tidx / 8 of the tile, its 16-byte chunks
        t, t + 8, .. of q_nope and chunk t of q_pe (t = tidx mod 8); all loads first, then the
        stores.  Rows past num_rows re-read row 0 and are never written out.  ``mQ``: (q_nope,
        q_pe), the kernel's query parts (a tuple: a subclass's query may be one tensor)."""
        mQn, mQp = mQ
        r = tidx // THREADS_PER_ROW
        t = tidx % THREADS_PER_ROW
        j = r if r < info.num_rows else 0
        tok, head = tok_head(info, info.row_start + j)
        frags = []
        for c in cutlass.range_constexpr(D_QK // 64):
            frag = cute.make_rmem_tensor((8,), self.dtype)
            if const_expr(c < D_CKV // 64):
                cute.autovec_copy(cute.local_tile(mQn[tok, head, None], (8,), (t + 8 * c,)), frag)
            else:
                cute.autovec_copy(cute.local_tile(mQp[tok, head, None], (8,), (t,)), frag)
            frags.append(frag)
        base = sQ.iterator.toint()
        for c in cutlass.range_constexpr(D_QK // 64):
            off = smem_off(r, c, t, 0, self.tile_q)
            dst = cute.make_ptr(self.dtype, base + off * 2, cute.AddressSpace.smem, assumed_align=16)
            cute.autovec_copy(frags[c], cute.make_tensor(dst, cute.make_layout((8,))))

    @cute.jit
    def _cursor_next(self, ld: LoadStream, cur: Cursor):
        """The cursor past an exhausted item moves on to the next item that has blocks (or to the
        end of the list), then looks up the pages of its next block (the lookups stay one block
        ahead of the copies).  The while loop runs on the fields unpacked into locals."""
        c_item, c_nb, c_n, c_start, c_end, c_base, c_head = cur.astuple()
        while (c_nb >= c_n) & (c_item + 1 < ld.item_end):
            c_item = c_item + 1
            info = ItemInfo(ld.mWork, c_item, ld.group)
            c_start, c_end = info.kv_start, info.kv_end
            c_base = ld.mKvIndptr[info.req]
            c_head = info.kv_head
            c_n = (c_end - c_start + BLOCK_N - 1) // BLOCK_N
            c_nb = Int32(0)
        if c_nb < c_n:
            self._lookup(ld, c_base, c_start + c_nb * BLOCK_N, c_end)
        return Cursor(c_item, c_nb, c_n, c_start, c_end, c_base, c_head)

    @cute.jit
    def _cursor_issue(self, ld: LoadStream, stage: Int32, cur: Cursor):
        """Issue the cursor's next block into ``stage``, advance the cursor, and commit one
        cp.async group (empty once the CTA's items are all issued, so the count the compute
        waits on stays exact)."""
        if cur.nb < cur.n:
            self._issue_kv(ld, cur.start + cur.nb * BLOCK_N, cur.end, stage, cur.head)
            cur = self._cursor_next(ld, cur.next_block())
        cute.arch.cp_async_commit_group()
        return cur

    def _row_pos(self, tidx, t, blk_start, kv_end):
        """Token of this thread's t-th row of the block starting at blk_start, clamped to the
        last valid token (rows past the end re-read it: finite data, masked later)."""
        p = blk_start + tidx // THREADS_PER_ROW + t * self.row_step
        return cutlass.select_(p < kv_end, p, kv_end - 1)

    @cute.jit
    def _lookup(self, ld: LoadStream, page_base: Int32, blk_start: Int32, kv_end: Int32):
        """The page id of each row this thread copies in the block at blk_start (token p is in
        page kv_indices[page_base + p // page_size]).  Only the loads: their values are first
        used by the next iteration's copies, so nothing here waits for them."""
        for t in cutlass.range_constexpr(self.n_lookups):
            page, _ = divmod(self._row_pos(ld.tidx, t, blk_start, kv_end), ld.page_size)
            ld.rows[t] = ld.mKvIndices[page_base + page]

    def _row_source(self, ld: LoadStream, i: int, blk_start: Int32, kv_end: Int32):
        """This thread's i-th gathered row of the block: its row in the stage and the global
        addresses of its ckv and kpe (page from the lookup in ``ld.rows``, clamped to the cache)."""
        _, slot = divmod(self._row_pos(ld.tidx, i, blk_start, kv_end), ld.page_size)
        page = in_cache(ld.rows[i], ld.mCkv.shape[0])
        r = ld.tidx // THREADS_PER_ROW + i * self.row_step
        return r, ld.mCkv[page, slot, None].iterator.toint(), ld.mKpe[page, slot, None].iterator.toint()

    @cute.jit
    def _issue_kv(self, ld: LoadStream, blk_start: Int32, kv_end: Int32, stage: Int32, head: Int32):
        """cp.async this thread's chunks of the block's rows (of kv head ``head``: MLA has one) into
        a stage: per row, ckv chunks
        t, t + 8, .., t + 56 and kpe chunk t (t = tidx mod 8): 8 threads read a row's 1152 bytes
        as 9 fully used 128-byte lines."""
        t = ld.tidx % THREADS_PER_ROW
        for i in cutlass.range_constexpr(self.n_lookups):
            r, ckv, kpe = self._row_source(ld, i, blk_start, kv_end)
            for c in cutlass.range_constexpr(D_QK // 64):
                d = smem_off(r, c, t, stage, BLOCK_N) * 2
                if const_expr(c < D_CKV // 64):
                    cp_async_16(ld.kv_base + d, ckv + (t + 8 * c) * 16)
                else:
                    cp_async_16(ld.kv_base + d, kpe + t * 16)

    # ---- epilogue ------------------------------------------------------------------------------
    @cute.jit
    def _store(self, mO, mLse, mPartO, mPartLse, acc_O, row_m, row_l, coords, info: ItemInfo, lane, wg, grp):
        """Each warp normalizes and stores its 128 columns of the group's rows (two adjacent
        columns per store); warp 0 of the group writes the LSE.  Final rows go to o / lse (value
        dtype), split ones to partial slot ``dest`` (fp32).  A row that saw no key: o = 0,
        lse = -inf."""
        tScS, tOcO = coords
        acc_O_mn = mma_mn_view(acc_O)
        vectors = self._out_vectors(tOcO)
        for r in cutlass.range_constexpr(cute.size(row_l)):
            l_all = quad_sum(row_l[r])
            j = grp * ROWS + tScS[r, 0][0]  # the row within the tile
            if j < info.num_rows:
                inv_l = Float32(0.0)
                lse = -Float32.inf
                if l_all > Float32(0.0):
                    inv_l = cute.arch.rcp_approx(l_all)
                    lse = row_m[r] + cute.math.log2(l_all, fastmath=True)
                if info.dest < 0:
                    tok, head = tok_head(info, info.row_start + j)
                    row = mO[tok, head, None]
                    for col0, cols in vectors:
                        n = len(cols)
                        out = cute.make_rmem_tensor((n,), mO.element_type)
                        for e in cutlass.range_constexpr(n):
                            out[e] = (acc_O_mn[r, cols[e]] * inv_l).to(mO.element_type)
                        cute.autovec_copy(out, cute.local_tile(row, (n,), ((wg * O_COLS + col0) // n,)))
                    if (wg == 0) & (lane % 4 == 0):
                        mLse[tok, head] = lse
                else:
                    slot_row = info.dest * self.tile_q + j
                    row = mPartO[slot_row, None]
                    for col0, cols in vectors:
                        n = len(cols)
                        out = cute.make_rmem_tensor((n,), Float32)
                        for e in cutlass.range_constexpr(n):
                            out[e] = acc_O_mn[r, cols[e]] * inv_l
                        cute.autovec_copy(out, cute.local_tile(row, (n,), ((wg * O_COLS + col0) // n,)))
                    if (wg == 0) & (lane % 4 == 0):
                        mPartLse[slot_row] = lse
