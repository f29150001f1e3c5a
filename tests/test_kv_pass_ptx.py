"""The KV pass (``kernels/kv_pass.py``: gather a paged cache into contiguous K / V, dequantize an
fp8 one), compiled and executed on the CPU: its PTX (sm_90a) run by ``tests/ptx_interp.py`` over
every CTA of a small grid, on a paged cache whose unowned slots are NaN and outputs pre-filled
with NaN; the outputs must equal the gathered (and exactly converted) cache bit for bit.  Head
dims whose rows the pass cuts unevenly: 80 (fp8 rows of 80 bytes: 8-byte loads), 96 (a row of 6
thread pairs, threads past the CTA's whole rows idle), and 128 as the control.  Pure Python:
small caches only."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ptx_interp  # noqa: E402
from test_mla_ptx_emulated import ptx_of  # noqa: E402,F401  (the fixture: spec -> kernel.ptx)

pytestmark = pytest.mark.compile
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _run_pass(ptx_of, d, kv, kv_lens, page_size, hk, seed, num_ctas=2):  # noqa: F811
    from cute_attn.families.base import get_family
    from cute_attn.families.kv_pass import kv_pass_spec

    spec = kv_pass_spec("sm_90a", "bf16", d, True, None, kv)
    abi = get_family("kv_pass").abi(spec.pdict)
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages) + 2
    order = torch.randperm(total, generator=gen)[: sum(pages)].to(torch.int32)
    cdt = FP8[kv] if kv else torch.bfloat16
    k = torch.full((total, page_size, hk, d), float("nan")).to(cdt)
    v = torch.full((total, page_size, hk, d), float("nan")).to(cdt)
    tokens, p0 = [], 0
    for n, npg in zip(kv_lens, pages):
        for t in range(n):
            page, slot = int(order[p0 + t // page_size]), t % page_size
            k[page, slot] = (torch.randn(hk, d, generator=gen) * 4).to(cdt)
            v[page, slot] = (torch.randn(hk, d, generator=gen) * 4).to(cdt)
            tokens.append((page, slot))
        p0 += npg
    n_tok = len(tokens)
    k_out = torch.full((1, n_tok, hk, d), float("nan"), dtype=torch.bfloat16)
    v_out = torch.full((1, n_tok, hk, d), float("nan"), dtype=torch.bfloat16)
    cum = lambda xs: torch.tensor(np.concatenate([[0], np.cumsum(xs)]), dtype=torch.int32)  # noqa: E731
    qo_indptr, kv_indptr, page_indptr = cum([1] * len(kv_lens)), cum(kv_lens), cum(pages)
    tensors = [k, v, k_out, v_out, qo_indptr, kv_indptr, page_indptr, order]
    mem = ptx_interp.Memory()
    bases = {}
    for t in tensors:
        bases[id(t)] = mem.add(t.view(-1).view(torch.uint8).numpy())  # writes land in the tensor's own bytes
    params = ptx_interp.pack_params(abi[:8], tensors, mem, bases)
    params += [int(len(kv_lens)).to_bytes(4, "little"), np.float32(1.0).tobytes()]
    ptx = ptx_of(spec)
    for cta in range(num_ctas):
        ptx_interp.CTA(ptx, params, mem, 256, ctaid=cta, grid=num_ctas).run()
    want_k = torch.stack([k[p, s] for p, s in tokens]).to(torch.bfloat16)
    want_v = torch.stack([v[p, s] for p, s in tokens]).to(torch.bfloat16)
    return k_out[0], v_out[0], want_k, want_v


@pytest.mark.parametrize("d,kv", [(80, "e4m3"), (80, "e5m2"), (80, None), (96, "e4m3"), (128, "e4m3")])
def test_kv_pass_gathers_and_converts(ptx_of, d, kv):  # noqa: F811
    ko, vo, wk, wv = _run_pass(ptx_of, d, kv, [17, 0, 40, 5], 16, 2, seed=d + len(kv or ""))
    assert torch.equal(ko.view(torch.int16), wk.view(torch.int16))
    assert torch.equal(vo.view(torch.int16), wv.view(torch.int16))
