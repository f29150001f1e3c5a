"""The compiled MLA kernel, executed on the CPU: its PTX (sm_90a) run by ``tests/ptx_interp.py``
on the exact tensors the wrapper passes, every CTA of a small plan (a few CTAs, so items are
split and merged), checked against the fp32 reference.  This is what the GPU tests check,
at the level of the code the DSL emits, for machines without a GPU: the first kernel passed
every CPU test (the contract emulated in Python) and failed on the H200 (``ldmatrix`` read the
wrong rows); this test fails on that kernel.

A pure-Python interpreter (~10 s a case), so the cases are small: 16 and 32 rows per tile,
decode and multi-token causal, page sizes 1, 16 and 64, fp16 and bf16, a split item, SGLang's
strided views; each with the threads run in forward and in reverse order between
synchronizations (a race between warps would show as a difference)."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_interp  # noqa: E402
from mla_helpers import CKV, KPE, check, gen, make_batch, reference  # noqa: E402
from test_mla import _ws  # noqa: E402
from test_prefill_gpu import _emulate_merge, _FakeEvent, _plain  # noqa: E402

from cute_attn.mla import BatchMLAPagedAttentionWrapper  # noqa: E402

pytestmark = pytest.mark.compile
SM = 1.0 / math.sqrt(192)
LOG2E = 1.0 / math.log(2.0)


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    """spec -> its kernel.ptx, compiled once per spec into a module-wide cache."""
    from cute_attn.runtime.cache import lookup

    root = tmp_path_factory.mktemp("mla_ptx")
    seen = {}

    def get(spec):
        if spec not in seen:
            cmd = [sys.executable, "-m", "cute_attn", "compile", "--arch", spec.arch, "--spec", spec.cli(), "--out",
                   str(root)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            seen[spec] = (lookup(spec, root).path / "kernel.ptx").read_text()
        return seen[spec]

    return get


class _Interpreted:
    """An ``mla_decode`` module stand-in: the real argument packer, then every CTA of the grid
    run by the PTX interpreter on the tensors' bytes (written back into them)."""

    def __init__(self, params, ptx_of, order="forward"):
        from cute_attn.families.base import get_family
        from cute_attn.families.spec import Spec
        from cute_attn.kernels.mla_decode import THREADS_PER_ROW
        from cute_attn.runtime.loader import make_packer

        self.abi = get_family("mla_decode").abi(params)
        self.pack = make_packer(self.abi)
        self.ptx = ptx_of(Spec.make("mla_decode", "sm_90a", **params))
        self.threads = params["tile_q"] * THREADS_PER_ROW
        self.kv_dtype = params.get("kv_dtype")
        self.steps = 0
        self.order = order

    def __call__(self, *args):
        args = [_plain(a) for a in args]
        self.pack(*args)
        tensors = args[:12]
        group, causal, sm_scale, num_ctas = args[12:]
        mem = ptx_interp.Memory()
        bases, regions = {}, {}
        for t in tensors:
            # the interpreter reads and writes the tensor's own storage (views and tensors
            # sharing a buffer -- the workspace's partials, 576-wide q -- map to one region)
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in regions:
                whole = torch.empty(0, dtype=torch.uint8).set_(st)
                regions[key] = mem.add(whole.numpy())
            bases[id(t)] = regions[key] + t.storage_offset() * t.element_size()
        scale_log2 = float(np.float32(sm_scale) * np.float32(LOG2E))
        params = ptx_interp.pack_params(self.abi[:12], tensors, mem, bases) + [
            int(group).to_bytes(4, "little"),
            int(causal).to_bytes(4, "little"),
            np.float32(scale_log2).tobytes(),
        ]
        for cta in range(num_ctas):
            c = ptx_interp.CTA(self.ptx, params, mem, self.threads, ctaid=cta, order=self.order)
            c.run()
            self.steps += c.executed


@pytest.fixture(params=["forward", "reverse"])
def interp(request, monkeypatch, ptx_of):
    import cute_attn.wrappers.mla as M

    mods = []

    class Merge:
        def __init__(self, params):
            self.params = params

        def __call__(self, *args):
            _emulate_merge(self.params, *[_plain(a) for a in args])

    def kernel(family, arch, **params):
        if family == "mla_decode":
            m = _Interpreted(params, ptx_of, request.param)
            mods.append(m)
            return m
        return Merge(params)

    monkeypatch.setattr(M, "arch_of_index", lambda i: "sm_90a")
    monkeypatch.setattr(M, "sm_count_of_index", lambda i: 3)  # three CTAs: splits where kv is long
    monkeypatch.setattr(M, "kernel", kernel)
    # the mma.sync kernel is the one interpreted (wgmma is not): keep the wrapper off the sm_90a
    # wgmma kernel it picks for requests of more than 32 packed rows
    from cute_attn.families.backends import MLA_WGMMA, backends_for

    monkeypatch.setattr(M, "backends_for", lambda op, arch: [b for b in backends_for(op, arch) if b.name != MLA_WGMMA])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return mods


CASES = [
    # qo_lens, kv_lens, heads, page_size, causal, dtype, packed (SGLang's 576-wide views)
    ([1, 1], [70, 5], 16, 16, False, torch.bfloat16, False),  # decode, tile 16, a block past the end
    ([2, 1], [45, 1], 16, 1, True, torch.bfloat16, False),  # tile 32 (two warp groups), page size 1
    ([1, 0, 1, 1], [300, 3, 0, 40], 16, 16, False, torch.bfloat16, False),  # split + merged, empty rows
    ([4, 3], [40, 2], 16, 16, True, torch.float16, True),  # multi-token causal, fp16, strided views
    # SGLang's views at page sizes 1 and 64 (test_mla_gpu's test_mla_sglang_views, smaller): tile 32
    # with requests of one group's rows, an empty request
    ([1, 1, 2], [0, 33, 70], 16, 1, True, torch.bfloat16, True),
    ([1, 1, 2], [0, 33, 70], 16, 64, True, torch.bfloat16, True),
]
# an fp8 latent cache (kernels/mla_decode_fp8.py): (case, cache dtype); the reference reads the
# dequantized cache
FP8_CASES = [
    (([1, 0, 1], [300, 3, 37], 16, 16, False, torch.bfloat16, False), torch.float8_e4m3fn),  # split + merged
    (([2, 1], [45, 1], 16, 1, True, torch.float16, True), torch.float8_e5m2),  # tile 32, page size 1, views
    (([1, 2], [70, 9], 8, 64, True, torch.bfloat16, False), torch.float8_e5m2),  # 8 heads, bf16, tile 16
]


@pytest.mark.parametrize("qo_lens,kv_lens,heads,page_size,causal,dtype,packed", CASES)
def test_compiled_kernel_matches_reference(interp, qo_lens, kv_lens, heads, page_size, causal, dtype, packed):
    _check_case(interp, qo_lens, kv_lens, heads, page_size, causal, dtype, packed, None)


@pytest.mark.parametrize("case,kv_dtype", FP8_CASES)
def test_compiled_fp8_kernel_matches_reference(interp, case, kv_dtype):
    _check_case(interp, *case, kv_dtype)
    assert interp[0].kv_dtype == {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}[kv_dtype]


def _check_case(interp, qo_lens, kv_lens, heads, page_size, causal, dtype, packed, kv_dtype):
    b = make_batch(qo_lens, kv_lens, heads, page_size, dtype, gen(), packed=packed, kv_dtype=kv_dtype)
    qn, qp, ckv, kpe, qo, kvp, idx, kvl = b
    w = BatchMLAPagedAttentionWrapper(_ws())
    w.plan(qo, kvp, idx, kvl, heads, CKV, KPE, page_size, causal, SM, dtype, kv_dtype or dtype)
    out = torch.full((qn.shape[0], heads, CKV), float("nan"), dtype=dtype)
    lse = torch.full((qn.shape[0], heads), float("nan"))
    w.run(qn, qp, ckv, kpe, out=out, lse=lse)
    check(out, lse, *reference(b, SM, causal), dtype)
    assert interp and interp[0].steps > 0
    assert interp[0].threads == 8 * (32 if max(q * heads for q in qo_lens) > 16 else 16)
    if max(kv_lens) >= 300:
        assert w._plan.has_split  # the merge folded partials the interpreted kernel wrote
    if packed:  # query= / kv_cache= reach the kernel as the same views: the same bits
        q576 = torch.as_strided(qn, (qn.shape[0], heads, CKV + KPE), qn.stride())
        assert torch.equal(w.run(query=q576, kv_cache=(ckv, kpe)), out)
