"""Compile probe for the sm90 prefill plan (CPU only; see prefill_sm90_plan.md).

Run: CUTE_DSL_ARCH=sm_90a [HD=256 TN=80] python docs/notes/prefill_sm90_probe.py /tmp/probe_out
Not a kernel: nothing here is numerically checked; it only proves the APIs compile together.

Checks: TMA atom over a tensor with dynamic (64-bit) strides built at compile time; export_to_c
ABI of the TMA arguments; PipelineTmaAsync + PipelineCpAsync; cp.async gather into the very
same swizzled (GMMA K_SW128) smem layout the TMA writes; paged TMA of 16-row pages into
that tile; wgmma SS QK^T and RS PV; setmaxnreg.
"""

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
from cutlass.utils import LayoutEnum

D = int(os.environ.get("HD", 128))
TM, TN, ST = 128, int(os.environ.get("TN", 128)), 2
dt = cutlass.BFloat16


class Probe:
    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mKp: cute.Tensor, mS: cute.Tensor, row0: Int32, stream: cuda.CUstream
    ):
        # mQ/mK: [tokens, heads, D] (dynamic tokens/heads/strides) -> (tokens, D, heads) view
        q3 = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
        k3 = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, D), dt)
        sQ_l = cute.tile_to_shape(atom, (TM, D), (0, 1))
        sK_l = cute.tile_to_shape(atom, (TN, D, ST), (0, 1, 2))
        sV_l = sK_l
        print("GMMA atom:", atom)
        print("sK layout:", sK_l)
        tma_q, tQ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q3, sQ_l, (TM, D))
        tma_k, tK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k3, cute.select(sK_l, mode=[0, 1]), (TN, D)
        )
        PS = 16
        kp4 = cute.make_tensor(mKp.iterator, cute.select(mKp.layout, mode=[1, 3, 2, 0]))  # (ps, D, heads, pages)
        sub = cute.select(
            cute.local_tile(
                cute.make_tensor(cute.make_ptr(dt, 0, cute.AddressSpace.smem, assumed_align=1024), sK_l.outer)[
                    None, None, 0
                ],
                (PS, D),
                (0, 0),
            ).layout,
            mode=[0, 1],
        )
        print("page sub-tile layout:", sub)
        tma_p, tP = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), kp4, cute.make_composed_layout(sK_l.inner, 0, sub), (PS, D)
        )
        mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (2, 1, 1), (64, TN)
        )
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            (2, 1, 1),
            (64, D),
            warpgroup.OperandSource.RMEM,
        )

        @cute.struct
        class Smem:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * ST]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * ST]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_l)], 1024]

        print("smem bytes:", Smem.size_in_bytes())
        self.kernel(tma_q, tQ, tma_k, tK, tma_p, tP, mKp, mS, row0, sQ_l, sK_l, sV_l, mma_qk, mma_pv, Smem).launch(
            grid=[132, 1, 1], block=[384, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        tQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,
        tma_p: cute.CopyAtom,
        tP: cute.Tensor,
        mKp: cute.Tensor,
        mS: cute.Tensor,
        row0: Int32,
        sQ_l: cute.ComposedLayout,
        sK_l: cute.ComposedLayout,
        sV_l: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        Smem: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Smem)
        sQ = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sK = st.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sV = st.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
        T = pipeline.Agent.Thread
        p_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar_q.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(T, 1),
            consumer_group=pipeline.CooperativeGroup(T, 8),
            tx_count=TM * D * 2,
            defer_sync=True,
        )
        p_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar_k.data_ptr(),
            num_stages=ST,
            producer_group=pipeline.CooperativeGroup(T, 1),
            consumer_group=pipeline.CooperativeGroup(T, 8),
            tx_count=TN * D * 2,
            defer_sync=True,
        )
        # V: cp.async gather by the 128 producer threads into the same kind of swizzled tile
        p_v = pipeline.PipelineCpAsync.create(
            barrier_storage=st.mbar_v.data_ptr(),
            num_stages=ST,
            producer_group=pipeline.CooperativeGroup(T, 128),
            consumer_group=pipeline.CooperativeGroup(T, 256),
            defer_sync=True,
        )
        # NB: PipelineTmaAsync releases with one thread per warp (count = consumer warps); the plain
        # PipelineAsync/PipelineCpAsync release arrives from every calling thread (count = threads).
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()
        wg = tidx // 128
        if wg == 0:
            cute.arch.setmaxregister_decrease(40)
            ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ST)
            if warp == 0:
                gQ = cute.local_tile(tQ[None, None, 0], (TM, D), (row0, 0))
                tQs, tQg = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
                )
                p_q.producer_acquire(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))
                cute.copy(
                    tma_q,
                    tQg,
                    tQs,
                    tma_bar_ptr=p_q.producer_get_barrier(
                        pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                    ),
                )
                gK = cute.local_tile(tK[None, None, 1], (TN, D), (None, 0))
                tKs, tKg = cpasync.tma_partition(
                    tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
                )
                for n in cutlass.range(4, unroll=1):
                    p_k.producer_acquire(ps)
                    cute.copy(tma_k, tKg[None, n], tKs[None, ps.index], tma_bar_ptr=p_k.producer_get_barrier(ps))
                    ps.advance()
                for j in cutlass.range_constexpr(TN // 16):
                    gP = cute.local_tile(tP[None, None, 0, row0 + j], (16, D), (0, 0))
                    sP = cute.local_tile(sK[None, None, 1], (16, D), (j, 0))
                    tPs, tPg = cpasync.tma_partition(
                        tma_p, 0, cute.make_layout(1), cute.group_modes(sP, 0, 2), cute.group_modes(gP, 0, 2)
                    )
                    cute.copy(tma_p, tPg, tPs, tma_bar_ptr=p_k.producer_get_barrier(ps))
            # paged gather of V: token p of head 0 lives at mKp[page(p), p % page_size, 0, :]
            g2s = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dt, num_bits_per_copy=128
            )
            chunks = D // 8
            pv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ST)
            page_size = mKp.shape[1]
            for n in cutlass.range(4, unroll=1):
                p_v.producer_acquire(pv)
                for i in cutlass.range_constexpr(TN * chunks // 128):
                    idx = tidx + i * 128
                    r = idx // chunks
                    c = idx % chunks
                    p = n * TN + r
                    cute.copy(
                        g2s,
                        cute.local_tile(mKp[p // page_size, p % page_size, 0, None], (8,), (c,)),
                        cute.local_tile(sV[r, None, pv.index], (8,), (c,)),
                    )
                p_v.producer_commit(pv)
                pv.advance()
        else:
            cute.arch.setmaxregister_increase(232)
            t = tidx - 128
            thr_qk = mma_qk.get_slice(t)
            thr_pv = mma_pv.get_slice(t)
            tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
            sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
            tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TM, TN)), Float32)
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TM, D)), Float32)
            acc_O.fill(0.0)
            cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ST)
            p_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            for _n in cutlass.range(4, unroll=1):
                p_k.consumer_wait(cs)
                mma_qk.set(warpgroup.Field.ACCUMULATE, False)
                warpgroup.fence()
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    cute.gemm(mma_qk, acc_S, tSrQ[None, None, k], tSrK[None, None, k, cs.index], acc_S)
                    mma_qk.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                p_k.consumer_release(cs)
                # P (bf16) as the register A operand of PV
                rP = cute.make_fragment_like(acc_S, dt)
                rP.store(acc_S.load().to(dt))
                tOrP = cute.make_tensor(rP.iterator, _acc_to_frgA(rP.layout))
                p_v.consumer_wait(cs)
                warpgroup.fence()
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(mma_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, cs.index], acc_O)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                p_v.consumer_release(cs)
                cs.advance()
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((TM, D)))
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                mS[tOcO[i]] = acc_O[i]


def _acc_to_frgA(l):
    """wgmma accumulator ((2,2,N/8),MMA_M,MMA_N) -> A-operand ((2,2,2),MMA_M,(N/16)) view."""
    d = cute.logical_divide(l, ((None, None, 2), None, None))
    return cute.make_layout(
        ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], (d.shape[0][2][1], d.shape[2])),
        stride=((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1], (d.stride[0][2][1], d.stride[2])),
    )


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefill_probe_out"
    os.makedirs(out, exist_ok=True)
    s64 = lambda: cute.sym_int(64, divisibility=8)
    mQ = make_fake_tensor(dt, (cute.sym_int(), cute.sym_int(), D), (s64(), s64(), 1), assumed_align=16)
    mK = make_fake_tensor(dt, (cute.sym_int(), cute.sym_int(), D), (s64(), s64(), 1), assumed_align=16)
    mKp = make_fake_tensor(
        dt, (cute.sym_int(), cute.sym_int(), cute.sym_int(), D), (s64(), s64(), s64(), 1), assumed_align=16
    )
    mS = make_fake_tensor(Float32, (TM, D), (D, 1), assumed_align=16)
    c = cute.compile(
        Probe(),
        mQ,
        mK,
        mKp,
        mS,
        Int32(0),
        make_fake_stream(),
        options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {out}",
    )
    c.export_to_c(file_path=out, file_name="kernel", function_prefix="probe")
    ptx = c.artifacts.PTX
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    open(f"{out}/kernel.ptx", "w").write(ptx)
    open(f"{out}/kernel.cubin", "wb").write(c.artifacts.CUBIN)
    print("compiled OK")
