"""One-warp probe kernels of the MLA kernel's shared-memory reads (tests/test_mla_smem_probe.py):
the kernel's own tile helpers and ldmatrix copies for Q ("q"), the K of S ("k") and V ("v"), with
the row group, the warp and the stage as runtime parameters.  Imports the DSL: import it only
where the DSL is installed.  (No ``from __future__ import annotations``: the DSL evaluates the
kernels' annotations.)"""

import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, const_expr
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from cute_attn.kernels.mla_decode import BLOCK_N, MlaConfig, MlaDecode


class Probe:
    def __init__(self, kind: str, tile_q: int, stages: int):
        self.kind = kind
        self.m = MlaDecode(MlaConfig(BFloat16, tile_q // 16, stages))

    @cute.jit
    def __call__(self, mOut: cute.Tensor, grp: Int32, wg: Int32, stage: Int32, stream: cuda.CUstream):
        kv_layout, q_layout, Smem = self.m.smem_layouts()
        tiled_mma = self.m.make_mma()
        self.kernel(mOut, grp, wg, stage, kv_layout, q_layout, tiled_mma, Smem).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Tensor,
        grp: Int32,
        wg: Int32,
        stage: Int32,
        kv_layout: cute.ComposedLayout,
        q_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        m = self.m
        lane, _, _ = cute.arch.thread_idx()
        st = cutlass.utils.SmemAllocator().allocate(Smem)
        sKV = st.sKV.get_tensor(kv_layout)
        sQ = st.sQ.get_tensor(q_layout)
        thr_mma = tiled_mma.get_slice(lane)
        s2r_q, s2r_k, s2r_v = m.warp_copies(tiled_mma, lane)
        frags = []
        if const_expr(self.kind == "q"):
            sQ_c, sQ_p = m._q_tiles(sQ, grp, wg)
            a = thr_mma.make_fragment_A(thr_mma.partition_A(sQ_c))
            b = thr_mma.make_fragment_A(thr_mma.partition_A(cute.local_tile(sQ_p, (16, 16), (0, 0))))
            cute.copy(s2r_q, s2r_q.partition_S(sQ_c), s2r_q.retile(a))
            m._load_pe_step(s2r_q, s2r_q.partition_S(sQ_p), s2r_q.retile(b), wg)
            frags = [a, b]
        sK = sKV[None, None, stage]
        if const_expr(self.kind == "k"):
            sK_c, sK_p = m._k_tiles(sK, wg)
            a = thr_mma.make_fragment_B(thr_mma.partition_B(sK_c))
            src, dst = s2r_k.partition_S(sK_c), s2r_k.retile(a)
            for i in cutlass.range_constexpr(cute.size(a, mode=[2])):
                cute.copy(s2r_k, src[None, None, i], dst[None, None, i])
            b = thr_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(sK_p, (BLOCK_N, 16), (0, 0))))
            m._load_pe_step(s2r_k, s2r_k.partition_S(sK_p), s2r_k.retile(b), wg)
            frags = [a, b]
        if const_expr(self.kind == "v"):
            for k in cutlass.range_constexpr(BLOCK_N // 16):
                sVt = m._v_tile(sK, k, wg)
                v = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
                cute.copy(s2r_v, s2r_v.partition_S(sVt), s2r_v.retile(v))
                frags.append(v)
        col = 0
        for f in frags:  # every loaded register is stored: nothing is optimized away
            r32 = cute.recast_tensor(f, Int32)
            for i in cutlass.range_constexpr(cute.size(r32)):
                mOut[lane, col] = r32[i]
                col += 1


def probe_ptx(kind: str, tile_q: int, stages: int) -> str:
    out = make_fake_tensor(Int32, (32, 256), (256, 1), assumed_align=16)
    with tempfile.TemporaryDirectory() as dump:
        c = cute.compile(
            Probe(kind, tile_q, stages), out, Int32(0), Int32(0), Int32(0), make_fake_stream(),
            options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump}",
        )  # fmt: skip
    ptx = c.artifacts.PTX
    return ptx if isinstance(ptx, str) else ptx.decode()
