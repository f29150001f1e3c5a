"""Block-sparse attention: ``BlockSparseAttentionWrapper`` against FlexAttention with the same
block mask (its natural baseline: 128 x 128 blocks, Flex's block size) and against dense
attention (SDPA cuDNN, the whole M x N).  bf16, 32 / 8 heads, hd128, one sequence.  Then
``VariableBlockSparseAttentionWrapper`` (per-head patterns over blocks of varying sizes, as in
video diffusion's sparse attention) against Flex with a mask_mod that looks the blocks up.

TFLOP/s counts the FLOPs of the kept blocks only (4 x head_dim per query-key pair and head).
Our output is checked against Flex's before timing.
"""

from __future__ import annotations

import torch

from .common import cudnn_time, do_bench, flex_bench

HQ, HK, D, BLK = 32, 8, 128, 128


def _bsr(mb, nb, density, gen):
    table = torch.rand(mb, nb, generator=gen) < density
    table[:, 0] = True  # every row block sees at least one block (Flex and we agree on empty rows anyway)
    indptr = torch.zeros(mb + 1, dtype=torch.int32)
    indptr[1:] = table.sum(1).cumsum(0)
    indices = table.nonzero()[:, 1].to(torch.int32)
    return table, indptr, indices


def _flex(q, k, v, table):
    """(time, output) of FlexAttention compiled for this shape with the block table as its
    block mask, or (None, None), the reason printed (an unfused fallback is a skip)."""
    t = table.cuda()

    def mask_mod(b, h, qi, kvi):
        return t[qi // BLK, kvi // BLK]

    try:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cuda", BLOCK_SIZE=BLK)
    except Exception as e:  # pragma: no cover
        print(f"  flex skipped: {type(e).__name__}: {str(e)[:200]}")
        return None, None
    tf, out, why = flex_bench(lambda fa: fa(q, k, v, block_mask=bm, enable_gqa=True))
    if why is not None:
        print(f"  flex skipped: {why}")
    return tf, out


def sparse_cases(quick: bool):
    cases = [(8192, 0.1), (8192, 0.3), (8192, 0.5), (32768, 0.05)]
    return cases[1:2] if quick else cases


def bench_sparse(res, quick: bool) -> None:
    from cute_attn import BlockSparseAttentionWrapper

    gen = torch.Generator().manual_seed(0)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(
        f"{'block sparse (bf16, 32/8 heads, d128, 128x128)':<46} {'ours us':>8} {'TFLOP/s':>8} {'flex us (x)':>16} "
        f"{'cudnn dense us (x)':>19}"
    )
    for n, density in sparse_cases(quick):
        table, indptr, indices = _bsr(n // BLK, n // BLK, density, gen)
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, HK, D, device="cuda", dtype=torch.bfloat16)
        w = BlockSparseAttentionWrapper(ws)
        w.plan(indptr, indices, n, n, BLK, BLK, HQ, HK, D, q_data_type=torch.bfloat16)
        out = torch.empty_like(q)
        w.run(q, k, v, out=out)
        t = do_bench(lambda: w.run(q, k, v, out=out))
        flops = 4 * D * HQ * int(indptr[-1]) * BLK * BLK
        qf, kf, vf = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, seq, d]
        t_flex, out_flex = _flex(qf, kf, vf, table)
        err = None
        if out_flex is not None:
            ref = out_flex[0].transpose(0, 1).float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"block-sparse output disagrees with FlexAttention: {err:.3e}"
        t_dense = cudnn_time(qf, kf, vf)
        case = f"sparse/hd128/gqa4/s{n}/blk{BLK}/density{density}"
        res.add(case, "cute_attn", "us", t)
        res.add(case, "cute_attn", "TFLOP/s", flops / t / 1e6)
        cols = []
        for impl, tb in (("flex", t_flex), ("sdpa_cudnn", t_dense)):
            if tb is not None:
                res.add(case, impl, "us", tb)
                res.add(case, impl, "ratio", tb / t)
                cols.append(f"{tb:8.1f} ({tb / t:5.2f}x)")
            else:
                cols.append("n/a")
        name = f"s{n} density {density} ({int(indptr[-1])} blocks)"
        e = f"err {err:.1e}" if err is not None else ""
        print(f"{name:<46} {t:8.1f} {flops / t / 1e6:8.1f} {cols[0]:>16} {cols[1]:>19}  {e}")
        del q, k, v, qf, kf, vf, out, out_flex
    bench_variable_sparse(res, quick)


def _cuts(total, n, gen):
    cuts = torch.sort(torch.randint(1, total, (n - 1,), generator=gen)).values
    edges = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.full((1,), total)])
    return (edges[1:] - edges[:-1]).to(torch.int32)


def bench_variable_sparse(res, quick: bool) -> None:
    from cute_attn import VariableBlockSparseAttentionWrapper

    gen = torch.Generator().manual_seed(1)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    h, n, nblk, density = 16, 16384, 128, 0.15
    bmap = torch.rand(h, nblk, nblk, generator=gen) < density
    bmap[:, :, 0] = True
    rows = torch.stack([_cuts(n, nblk, gen) for _ in range(h)])
    cols = torch.stack([_cuts(n, nblk, gen) for _ in range(h)])
    q = torch.randn(h, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(h, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(h, n, D, device="cuda", dtype=torch.bfloat16)
    w = VariableBlockSparseAttentionWrapper(ws)
    w.plan(bmap, rows, cols, h, h, D, q_data_type=torch.bfloat16)
    out = w.run(q, k, v)
    t = do_bench(lambda: w.run(q, k, v))
    pairs = int((bmap.long() * rows.long()[:, :, None] * cols.long()[:, None, :]).sum())
    flops = 4 * D * pairs
    # Flex: per head, each token's block id, the block table looked up per element
    rid = torch.stack([torch.repeat_interleave(torch.arange(nblk), r.long()) for r in rows]).cuda()
    cid = torch.stack([torch.repeat_interleave(torch.arange(nblk), c.long()) for c in cols]).cuda()
    tbl = bmap.cuda()
    t_flex, err = None, None
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, hh, qi, kvi):
            return tbl[hh, rid[hh, qi], cid[hh, kvi]]

        bm = create_block_mask(mask_mod, 1, h, n, n, device="cuda", BLOCK_SIZE=BLK)
        t_flex, ref, why = flex_bench(lambda fa: fa(q[None], k[None], v[None], block_mask=bm))
        if why is not None:
            print(f"  flex skipped: {why}")
        else:
            ref = ref[0]
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-2, f"variable block-sparse output disagrees with FlexAttention: {err:.3e}"
    except AssertionError:
        raise
    except Exception as e:  # pragma: no cover  (no Flex, or its block mask failed)
        t_flex = None
        print(f"  flex skipped: {type(e).__name__}: {str(e)[:200]}")
    case = f"sparse_variable/hd128/h{h}/s{n}/blocks{nblk}/density{density}"
    res.add(case, "cute_attn", "us", t)
    res.add(case, "cute_attn", "TFLOP/s", flops / t / 1e6)
    flex = "n/a"
    if t_flex is not None:
        res.add(case, "flex", "us", t_flex)
        res.add(case, "flex", "ratio", t_flex / t)
        flex = f"{t_flex:8.1f} ({t_flex / t:5.2f}x)"
    print(
        f"{'variable: 16 heads, s16384, 128x128 blocks of mean 128, 0.15':<46} {t:8.1f} {flops / t / 1e6:8.1f} "
        f"{flex:>16}  err {err:.1e}"
        if err is not None
        else f"variable: {t:.1f} us"
    )
