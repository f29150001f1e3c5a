"""The paged decode kernel (``kernels/decode.py``), compiled and executed on the CPU: its PTX
(sm_90a) run by ``tests/ptx_interp.py`` on the exact tensors the decode wrapper passes, every CTA
of small plans (two emulated SMs), checked against the fp32 reference (``test_decode_gpu``'s
tolerances).  For the head-dim-64 geometries the H200 measured (issue 24): four kv heads per item
at GQA 8 (32-row tiles, one kv head per warp: ``PagedDecode.head_split``) and 128-row stages
(``families/decode.BLOCK_N``), next to the shipped geometry, with the threads run in forward and
reverse order between synchronizations (a race between warps shows as a difference).

Pure Python (~1 us an instruction and thread): small batches only."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_interp  # noqa: E402
from test_mla_ptx_emulated import ptx_of  # noqa: E402,F401  (the fixture: spec -> kernel.ptx)
from test_prefill_gpu import _cpu_ws, _emulate_merge, _FakeEvent, _plain  # noqa: E402

pytestmark = pytest.mark.compile
LOG2E = 1.0 / np.log(2.0)


class _Interpreted:
    """A ``paged_decode`` module stand-in: the real argument packer, then every CTA of the grid
    run by the PTX interpreter on the tensors' bytes (written back into them)."""

    def __init__(self, params, ptx_of, order):
        from cute_attn.families.base import get_family
        from cute_attn.families.spec import Spec
        from cute_attn.runtime.loader import make_packer

        self.abi = get_family("paged_decode").abi(params)
        self.pack = make_packer(self.abi)
        self.params = params
        self.ptx = ptx_of(Spec.make("paged_decode", "sm_90a", **params))
        self.order = order
        self.steps = 0

    def __call__(self, *args, **kw):
        args = [_plain(a) for a in args]
        self.pack(*args)
        tensors = args[:11]
        group, sm_scale, num_ctas = args[11:14]
        assert not args[14:], "variant arguments are not interpreted here"
        mem = ptx_interp.Memory()
        bases, regions = {}, {}
        for t in tensors:
            st = t.untyped_storage()  # views sharing a buffer (the workspace's sections) map to one region
            if st.data_ptr() not in regions:
                regions[st.data_ptr()] = mem.add(torch.empty(0, dtype=torch.uint8).set_(st).numpy())
            bases[id(t)] = regions[st.data_ptr()] + t.storage_offset() * t.element_size()
        # the host function's launch values (kernels/decode.py ``host``), in fp32
        scale_log2 = np.float32(sm_scale) * np.float32(LOG2E)
        if self.params["head_dim"] == 512:
            # kernels/decode_wide.py runs the MLA kernel's body: the ABI's tensors, group, causal 0
            params = ptx_interp.pack_params(self.abi[:11], tensors, mem, bases)
            params += [int(group).to_bytes(4, "little"), (0).to_bytes(4, "little"), np.float32(scale_log2).tobytes()]
        else:
            params = ptx_interp.pack_params(self.abi[:11], tensors, mem, bases)
            params += [int(group).to_bytes(4, "little"), np.float32(scale_log2).tobytes()]
            params.append(np.float32(sm_scale).tobytes())
        for cta in range(num_ctas):
            c = ptx_interp.CTA(self.ptx, params, mem, 128, ctaid=cta, order=self.order)
            c.run()
            self.steps += c.executed


@pytest.fixture(params=["forward", "reverse"])
def interp(request, monkeypatch, ptx_of):  # noqa: F811
    import cute_attn.wrappers.decode as D

    mods = []

    class Merge:
        def __init__(self, params):
            self.params = params

        def __call__(self, *args, **kw):
            _emulate_merge(self.params, *[_plain(a) for a in args])

    def kernel(family, arch, **params):
        if family == "paged_decode":
            m = _Interpreted(params, ptx_of, request.param)
            mods.append(m)
            return m
        assert family == "merge_partials", family
        return Merge(params)

    monkeypatch.setattr(D, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(D, "sm_count_of_index", lambda i: 2)  # 2 SMs: long KV is split and merged
    monkeypatch.setattr(D, "kernel", kernel)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return mods


def run_decode(kv_lens, page_size, hq, hk, d, heads_per_item, seed, ctas_per_sm=2, layout="NHD"):
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper
    from cute_attn.testing import paged_reference

    gen = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages) + 3
    indptr = torch.tensor([0] + list(np.cumsum(pages)), dtype=torch.int32)
    indices = torch.randperm(total, generator=gen)[: sum(pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    k = torch.randn(total, page_size, hk, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(total, page_size, hk, d, generator=gen).to(torch.bfloat16)
    used = torch.zeros(total, dtype=torch.bool)
    used[indices.long()] = True
    k[~used], v[~used] = float("nan"), float("nan")  # pages no request owns are never read
    cache = (k, v)
    if layout == "HND":  # the same values in [pages, kv_heads, page_size, head_dim] storage
        cache = tuple(x.transpose(1, 2).contiguous() for x in (k, v))
    q = torch.randn(len(kv_lens), hq, d, generator=gen).to(torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(), kv_layout=layout, ctas_per_sm=ctas_per_sm)
    w.plan(indptr, indices, last, hq, hk, d, page_size, q_data_type=torch.bfloat16, heads_per_item=heads_per_item)
    assert w._hpi == heads_per_item
    out = torch.full_like(q, float("nan"))
    lse = torch.full((len(kv_lens), hq), float("nan"))
    w.run(q, cache, out=out, lse=lse)
    ref_o, ref_lse = paged_reference(q, (k, v), None, indptr, indices, last)
    assert not out.isnan().any() and not lse.isnan().any()
    # a request with no keys: o = 0, lse = -inf (the contract, ``cute_attn.sched``)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), (lse, ref_lse)
    fin = torch.isfinite(ref_lse)
    err_o = (out.float() - ref_o.float()).abs().max().item()
    err_l = (lse[fin] - ref_lse.float()[fin]).abs().max().item()
    assert err_o < 2e-2 and err_l < 2e-3, (err_o, err_l)
    return w


# kv lengths, page size, hq, hk, heads per item, block_n (families/decode.BLOCK_N[64]), stages
CASES = [
    ([70, 5, 130], 16, 32, 4, 4, 64, 4),  # tile 32: one kv head per warp, split + merge
    ([33, 1, 200], 1, 64, 8, 4, 64, 3),  # page 1, two head groups
    ([150, 0, 17], 16, 64, 8, 4, 128, 3),  # 128-row stages, an empty request
    ([90, 260], 16, 64, 8, 2, 128, 2),  # 128-row stages, two heads per item
    ([100, 3], 16, 16, 8, 1, 128, 3),  # 128-row stages, unpacked (GQA 2)
    ([70, 40], 16, 32, 8, 4, 64, 4),  # GQA 4: four heads in one 16-row tile (shipped geometry)
    ([300, 90, 7], 16, 32, 8, 4, 128, 2, 3),  # GQA 4, 128-row stages, 3 CTAs per SM
    ([200, 64, 129], 1, 32, 8, 2, 128, 3),  # GQA 4, two heads per item: 8 rows of 16
    ([260, 33], 16, 32, 8, 4, 64, 3, 3),  # GQA 4, 3 stages, 3 CTAs per SM
    # lognormal-like batches at 128-row stages, one head per item: many items per CTA, 1-token
    # and split requests (a device run read a wrong output for bn128 h1 on the bench's lognormal batch)
    ([1, 5, 300, 40, 1000, 2, 129, 64, 700, 33], 16, 16, 2, 1, 128, 3),
    ([3, 900, 1, 17, 128, 257, 1, 2000], 16, 16, 2, 1, 128, 3, 1),
    # MQA (32 query heads on one kv head): a token's 32 rows are two 16-row items
    ([45, 300, 2], 16, 32, 1, 1, 128, 3),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"kv{'_'.join(map(str, c[0]))}-p{c[1]}-h{c[2]}x{c[3]}-hpi{c[4]}-bn{c[5]}-s{c[6]}"
)
def test_compiled_decode_matches_reference(interp, case, monkeypatch):
    from cute_attn.families import decode

    kv, ps, hq, hk, hpi, bn, stages = case[:7]
    monkeypatch.setitem(decode.BLOCK_N, 64, bn)
    monkeypatch.setitem(decode.STAGES, 64, stages)
    w = run_decode(kv, ps, hq, hk, 64, hpi, seed=len(kv) * 7 + hpi, ctas_per_sm=(case[7:] or (2,))[0])
    assert interp and all(m.steps > 0 for m in interp)
    p = interp[0].params
    assert p.get("block_n", 64) == bn and p.get("tile_q", 16) == (32 if hpi > 1 and hpi * hq // hk > 16 else 16)
    if kv == [70, 5, 130]:  # 4 CTAs: this one is split, and the merge folds the kernel's partials
        assert w._state.plan.has_split


# head dim 96 (192-byte rows: three 64-byte atom columns gathered in turn, the epilogue's column
# pieces; one or two kv heads per item -- four would leave a thread fewer tokens than its gather
# rows, families/decode.MAX_PACKED_HEADS).
HD96 = [
    ([70, 5, 300], 16, 8, 1, 1),  # split + merge
    ([33, 1, 90], 1, 16, 4, 2),  # page 1, two heads per item (GQA 4: 8 rows of 16)
]


@pytest.mark.parametrize("case", HD96, ids=lambda c: f"kv{'_'.join(map(str, c[0]))}-p{c[1]}-h{c[2]}x{c[3]}-hpi{c[4]}")
def test_compiled_decode_hd96(interp, case):
    kv, ps, hq, hk, hpi = case
    w = run_decode(kv, ps, hq, hk, 96, hpi, seed=len(kv) * 5 + hpi)
    assert interp and all(m.steps > 0 for m in interp) and interp[0].params["head_dim"] == 96
    if hpi == 1:
        assert w._state.plan.has_split


# head dim 80 (160-byte rows in five 32-byte atom columns, the epilogue's column pieces), one, two
# and four kv heads per item (a page lookup per row where a head has fewer tokens per block than
# a thread's row step).
HD80 = [
    ([70, 5, 300], 16, 8, 1, 1),  # split + merge
    ([33, 1, 0, 90], 1, 16, 4, 1),  # page 1, GQA 4, an empty request
    ([41, 97, 3], 16, 8, 8, 4),  # MHA, four heads per item (4 of 16 rows)
    ([20, 66], 1, 16, 8, 2),  # page 1, GQA 2, two heads per item
]


@pytest.mark.parametrize("case", HD80, ids=lambda c: f"kv{'_'.join(map(str, c[0]))}-p{c[1]}-h{c[2]}x{c[3]}-hpi{c[4]}")
def test_compiled_decode_hd80(interp, case):
    kv, ps, hq, hk, hpi = case
    w = run_decode(kv, ps, hq, hk, 80, hpi, seed=len(kv) * 3 + ps + hpi)
    assert interp and all(m.steps > 0 for m in interp) and interp[0].params["head_dim"] == 80
    if kv[0] == 70:
        assert w._state.plan.has_split


# head dim 512 (kernels/decode_wide.py: the MLA kernel's split of the contraction and of the
# output columns over the warps, K and V from their own heads): split + merge, page size 1, an
# empty request, GQA 8 and MHA, HND strides.
HD512 = [
    ([70, 5, 300], 16, 8, 1, "NHD"),  # GQA 8: 8 rows of 16; split + merge
    ([33, 0, 90], 1, 4, 4, "NHD"),  # MHA, four kv heads, page size 1, an empty request
    ([41, 97], 16, 8, 2, "HND"),  # GQA 4, HND strides
]


@pytest.mark.parametrize("case", HD512, ids=lambda c: f"kv{'_'.join(map(str, c[0]))}-p{c[1]}-h{c[2]}x{c[3]}-{c[4]}")
def test_compiled_decode_hd512(interp, case):
    kv, ps, hq, hk, layout = case
    w = run_decode(kv, ps, hq, hk, 512, 1, seed=len(kv) * 11 + hq, layout=layout)
    assert interp and all(m.steps > 0 for m in interp) and interp[0].params["head_dim"] == 512
    if max(kv) >= 300:
        assert w._state.plan.has_split
