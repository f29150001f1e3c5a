"""Block-sparse attention (``cute_attn.sparse``: ``BlockSparseAttentionWrapper`` and
``VariableBlockSparseAttentionWrapper``) against the fp32 reference with the pattern expanded to
a dense ``[M, N]`` mask (per kv head for the variable one).

GPU tests (marked ``gpu``; plain paged prefill specs and the custom-mask ones of the ``all``
preset): block shapes (R, C) from (1, 16) to (128, 32), C = 1 (the cp.async gather) and
multiples of 16 (TMA page boxes), M not a multiple of R, empty row blocks, column blocks in
shuffled order, GQA 1 / 4, head dims 64 / 128 / 256, fp16 / bf16, element masks (``mask`` and
``packed_mask``) and soft-cap; variable blocks: per-head patterns and sizes (empty blocks
included), GQA 1 / 4 / 8.  Outputs and LSE pre-filled with NaN.  Tolerances as the prefill
tests: output relative L2 error bf16 2e-2 / fp16 4e-3, LSE (base 2) absolute 2e-3; rows that see
no key: out 0, LSE -inf.

CPU tests (run in CI): the same mapping with the prefill kernel emulated (``test_prefill_gpu``'s
``emu`` fixture), the mask layout conversion, and the argument errors.
"""

import random

import numpy as np
import pytest
import torch
from test_prefill_gpu import _cpu_ws, _gen, check, emu  # noqa: F401

from cute_attn.prefill import pack_custom_mask
from cute_attn.testing import single_reference

gpu = pytest.mark.gpu
DEV = "cuda"


def make_bsr(mb, nb, density, gen, empty_rows=1):
    """Random BSR pattern: (indptr, indices) with each row's column blocks in shuffled order
    and ``empty_rows`` row blocks left empty."""
    pick = torch.rand(mb, nb, generator=gen) < density
    for i in torch.randperm(mb, generator=gen)[:empty_rows]:
        pick[i] = False
    indptr, indices = [0], []
    for i in range(mb):
        cols = pick[i].nonzero().flatten()
        indices.append(cols[torch.randperm(cols.numel(), generator=gen)])
        indptr.append(indptr[-1] + cols.numel())
    return torch.tensor(indptr, dtype=torch.int32), torch.cat(indices).to(torch.int32)


def dense_mask(M, N, R, C, indptr, indices, mask=None):
    """The [M, N] bool mask the BSR pattern (and its element mask [nnz, R, C]) describes."""
    full = torch.zeros(-(-M // R) * R, N, dtype=torch.bool)
    ip = indptr.tolist()
    for i in range(len(ip) - 1):
        for z in range(ip[i], ip[i + 1]):
            j = int(indices[z])
            full[i * R : (i + 1) * R, j * C : (j + 1) * C] = True if mask is None else mask[z].cpu()
    return full[:M]


def run_bsr(
    M,
    N,
    R,
    C,
    hq,
    hk,
    d,
    dtype,
    *,
    density=0.3,
    with_mask=None,
    soft_cap=None,
    device=DEV,
    workspace=None,
    seed=None,
    **plan_kw,
):
    from cute_attn import BlockSparseAttentionWrapper

    gen = _gen(seed)
    indptr, indices = make_bsr(-(-M // R), N // C, density, gen)
    q = torch.randn(M, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(N, hk, d, generator=gen).to(dtype).to(device)
    v = torch.randn(N, hk, d, generator=gen).to(dtype).to(device)
    mask = None
    kw = dict(plan_kw)
    if with_mask is not None:
        mask = torch.rand(int(indptr[-1]), R, C, generator=gen) < 0.7
        if with_mask == "packed":
            from cute_attn.sparse import convert_bsr_mask_layout

            nblk = (indptr[1:] - indptr[:-1]).numpy()
            kw["packed_mask"] = pack_custom_mask(
                convert_bsr_mask_layout(mask, indptr), np.full(nblk.shape, R), nblk * C
            )[0].to(device)
        else:
            kw["mask"] = mask.to(device)
    w = BlockSparseAttentionWrapper(
        workspace if workspace is not None else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    )
    w.plan(indptr, indices, M, N, R, C, hq, hk, d, q_data_type=dtype, logits_soft_cap=soft_cap, **kw)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((M, hq), float("nan"), device=device)
    got = w.run(q, k, v, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    ref_o, ref_lse = single_reference(
        q, k, v, custom_mask=dense_mask(M, N, R, C, indptr, indices, mask).to(device), logits_soft_cap=soft_cap
    )
    check(out, lse, ref_o, ref_lse, dtype)
    return w


def _sizes(total, n, gen):
    """n block sizes >= 0 summing to total (random cut points)."""
    cuts = torch.sort(torch.randint(0, total + 1, (n - 1,), generator=gen)).values.tolist()
    edges = [0] + cuts + [total]
    return [b - a for a, b in zip(edges, edges[1:])]


def run_vbsr(
    hq, hk, M, N, mb, nb, d, dtype, *, density=0.4, soft_cap=None, device=DEV, workspace=None, seed=None, **plan_kw
):
    from cute_attn import VariableBlockSparseAttentionWrapper

    gen = _gen(seed)
    bmap = torch.rand(hk, mb, nb, generator=gen) < density
    rows = torch.tensor([_sizes(M, mb, gen) for _ in range(hk)], dtype=torch.int32)
    cols = torch.tensor([_sizes(N, nb, gen) for _ in range(hk)], dtype=torch.int32)
    q = torch.randn(hq, M, d, generator=gen).to(dtype).to(device)
    k = torch.randn(hk, N, d, generator=gen).to(dtype).to(device)
    v = torch.randn(hk, N, d, generator=gen).to(dtype).to(device)
    w = VariableBlockSparseAttentionWrapper(
        workspace if workspace is not None else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    )
    w.plan(
        bmap.to(device),
        rows.to(device),
        cols.to(device),
        hq,
        hk,
        d,
        q_data_type=dtype,
        logits_soft_cap=soft_cap,
        **plan_kw,
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, M), float("nan"), device=device)
    got = w.run(q, k, v, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    g = hq // hk
    ref_o, ref_lse = [], []
    for h in range(hk):
        r_off = [0] + torch.cumsum(rows[h], 0).tolist()
        c_off = [0] + torch.cumsum(cols[h], 0).tolist()
        dense = torch.zeros(M, N, dtype=torch.bool)
        for i, j in bmap[h].nonzero().tolist():
            dense[r_off[i] : r_off[i + 1], c_off[j] : c_off[j + 1]] = True
        o, s = single_reference(
            q[h * g : (h + 1) * g].transpose(0, 1),
            k[h].unsqueeze(1),
            v[h].unsqueeze(1),
            custom_mask=dense.to(device),
            logits_soft_cap=soft_cap,
        )
        ref_o.append(o.transpose(0, 1))
        ref_lse.append(s.transpose(0, 1))
    check(
        out.transpose(0, 1),
        lse.transpose(0, 1),
        torch.cat(ref_o).transpose(0, 1),
        torch.cat(ref_lse).transpose(0, 1),
        dtype,
    )
    return w


# =========================================================================== GPU tests


@gpu
@pytest.mark.parametrize(
    "M,N,R,C,hq,hk,d,dtype",
    [
        (1000, 1024, 64, 64, 32, 8, 128, torch.bfloat16),  # M % R != 0, TMA page boxes
        (512, 512, 16, 16, 8, 8, 64, torch.float16),
        (300, 256, 1, 16, 16, 4, 128, torch.bfloat16),  # one query row per block
        (257, 96, 32, 1, 4, 1, 256, torch.bfloat16),  # C = 1: the cp.async gather
        (1024, 2048, 128, 32, 32, 8, 128, torch.float16),
        (640, 4096, 64, 128, 32, 8, 128, torch.bfloat16),  # long rows: split KV + merge
    ],
)
def test_block_sparse(M, N, R, C, hq, hk, d, dtype):
    run_bsr(M, N, R, C, hq, hk, d, dtype, density=random.choice([0.2, 0.5]))


@gpu
@pytest.mark.parametrize("with_mask", ["mask", "packed"])
def test_block_sparse_element_mask(with_mask):
    """mask= / packed_mask= within the blocks (32 x 4 = 128 packed rows: the tile the custom-mask
    kernel of the ``all`` preset is built for)."""
    run_bsr(512, 512, 32, 16, 32, 8, 128, torch.bfloat16, density=0.4, with_mask=with_mask)


@gpu
def test_block_sparse_soft_cap_kv_pass():
    """Soft-cap (its kernel exists for ragged KV, tile 128): the KV pass gathers the blocks first."""
    run_bsr(768, 1024, 64, 64, 16, 4, 128, torch.bfloat16, soft_cap=30.0, kv_pass=True)


@gpu
@pytest.mark.parametrize(
    "hq,hk,M,N,mb,nb,d,dtype",
    [
        (8, 2, 1000, 1200, 7, 9, 128, torch.bfloat16),
        (4, 4, 333, 500, 5, 4, 64, torch.float16),
        (16, 2, 2048, 4096, 16, 32, 128, torch.bfloat16),
        (8, 1, 700, 300, 3, 6, 256, torch.bfloat16),
    ],
)
def test_variable_block_sparse(hq, hk, M, N, mb, nb, d, dtype):
    run_vbsr(hq, hk, M, N, mb, nb, d, dtype)


@gpu
def test_variable_block_sparse_soft_cap():
    """Soft-cap through the KV pass (the ragged soft-cap kernel, tile 128: 8 x ~128 rows per request)."""
    run_vbsr(16, 2, 2048, 2048, 16, 16, 128, torch.bfloat16, soft_cap=30.0, kv_pass=True)


# =========================================================================== CPU tests


@pytest.mark.parametrize("M,N,R,C,hq,hk", [(100, 64, 16, 8, 4, 2), (33, 48, 1, 16, 2, 2), (64, 40, 64, 1, 8, 2)])
def test_cpu_block_sparse_wiring(emu, M, N, R, C, hq, hk):
    w = run_bsr(M, N, R, C, hq, hk, 64, torch.bfloat16, density=0.5, device="cpu", workspace=_cpu_ws(64), seed=7)
    fam, params = emu.calls[0]
    assert fam == "batch_prefill_sm90" and params["paged"] and not params["causal"]
    assert w._prefill._page_size == C


def test_cpu_mask_layout():
    """convert_bsr_mask_layout (FlashInfer's layout) against the dense mask, row block by row block."""
    from cute_attn.sparse import convert_bsr_mask_layout

    gen = _gen(3)
    M, N, R, C = 48, 64, 16, 8
    indptr, indices = make_bsr(M // R, N // C, 0.5, gen, empty_rows=0)
    mask = torch.rand(int(indptr[-1]), R, C, generator=gen) < 0.5
    flat = convert_bsr_mask_layout(mask, indptr)
    dense = dense_mask(M, N, R, C, indptr, indices, mask)
    off = 0
    for i in range(M // R):
        cols = torch.cat([torch.arange(int(j) * C, (int(j) + 1) * C) for j in indices[indptr[i] : indptr[i + 1]]])
        blk = dense[i * R : (i + 1) * R][:, cols].reshape(-1)
        assert torch.equal(flat[off : off + blk.numel()], blk)
        off += blk.numel()
    assert off == flat.numel()


def test_cpu_block_sparse_errors(emu):
    from cute_attn import BlockSparseAttentionWrapper

    w = BlockSparseAttentionWrapper(_cpu_ws(16))
    ip, idx = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    args = (32, 64, 16, 16, 4, 4, 64)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(torch.zeros(32, 4, 64), torch.zeros(64, 4, 64), torch.zeros(64, 4, 64))
    with pytest.raises(NotImplementedError, match="causal"):
        w.plan(ip, idx, *args, causal=True)
    with pytest.raises(NotImplementedError, match="ROPE_LLAMA"):
        w.plan(ip, idx, *args, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="multiple of the block width"):
        w.plan(ip, idx, 32, 60, 16, 16, 4, 4, 64)
    with pytest.raises(ValueError, match=r"ceil\(M / R\) \+ 1 = 3"):
        w.plan(torch.tensor([0, 2], dtype=torch.int32), idx, *args)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, N / C = 4\)"):
        w.plan(ip, torch.tensor([0, 4], dtype=torch.int32), *args)
    with pytest.raises(ValueError, match=r"mask must be \[nnz, R, C\]"):
        w.plan(ip, idx, *args, mask=torch.ones(2, 16, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_mask needs M"):
        w.plan(ip, idx, 31, 64, 16, 16, 4, 4, 64, packed_mask=torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(NotImplementedError, match="block_mask"):
        w.plan(ip, idx, *args, block_mask=torch.ones(4, 2, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="backend"):
        BlockSparseAttentionWrapper(_cpu_ws(16), backend="fa3")
    from cute_attn.variants.builtins import ALiBi, Causal, RoPE, SoftCap

    for v in (Causal(), RoPE(), ALiBi(), SoftCap(logits_soft_cap=5.0) + RoPE()):
        with pytest.raises(NotImplementedError, match="gathered positions"):
            w.plan(ip, idx, *args, variant=v)
    w.plan(ip, idx, *args, q_data_type=torch.float16)
    with pytest.raises(ValueError, match=r"k must be \[N, num_kv_heads, head_dim\] = \[64, 4, 64\]"):
        w.run(
            torch.zeros(32, 4, 64, dtype=torch.float16),
            torch.zeros(60, 4, 64, dtype=torch.float16),
            torch.zeros(64, 4, 64, dtype=torch.float16),
        )


@pytest.mark.parametrize("hq,hk", [(4, 2), (2, 2), (8, 1)])
def test_cpu_variable_block_sparse_wiring(emu, hq, hk):
    w = run_vbsr(hq, hk, 70, 90, 4, 5, 64, torch.float16, device="cpu", workspace=_cpu_ws(64), seed=11)
    assert w._prefill._page_size == 1 and w._prefill._hk == 1


def test_cpu_variable_block_sparse_errors(emu):
    from cute_attn import VariableBlockSparseAttentionWrapper

    w = VariableBlockSparseAttentionWrapper(_cpu_ws(16))
    bm = torch.ones(2, 2, 3, dtype=torch.bool)
    rows = torch.tensor([[4, 4], [3, 5]], dtype=torch.int32)
    cols = torch.tensor([[2, 2, 2], [1, 1, 4]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(torch.zeros(4, 8, 64), torch.zeros(2, 6, 64), torch.zeros(2, 6, 64))
    with pytest.raises(NotImplementedError, match="causal"):
        w.plan(bm, rows, cols, 4, 2, 64, causal=True)
    with pytest.raises(ValueError, match="sum to the same lengths"):
        w.plan(bm, torch.tensor([[4, 4], [3, 4]], dtype=torch.int32), cols, 4, 2, 64)
    with pytest.raises(ValueError, match=r"block_mask_map must be \[num_kv_heads, MB, NB\]"):
        w.plan(bm[:1], rows, cols, 4, 2, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        w.plan(bm, rows, cols, 3, 2, 64)
    from cute_attn.variants.builtins import AttentionSink, Causal

    with pytest.raises(NotImplementedError, match="gathered positions"):
        w.plan(bm, rows, cols, 4, 2, 64, variant=Causal())
    with pytest.raises(NotImplementedError, match="runtime tensors"):
        w.plan(bm, rows, cols, 4, 2, 64, variant=AttentionSink())
    w.plan(bm, rows, cols, 4, 2, 64, q_data_type=torch.float16)
    with pytest.raises(ValueError, match=r"q must be \[num_qo_heads, M, head_dim\] = \[4, 8, 64\]"):
        w.run(
            torch.zeros(8, 4, 64, dtype=torch.float16),
            torch.zeros(2, 6, 64, dtype=torch.float16),
            torch.zeros(2, 6, 64, dtype=torch.float16),
        )
