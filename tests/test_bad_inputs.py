"""The reliability battery (issue "No bad input reaches a kernel"): one table of bad and edge
inputs across decode, prefill (ragged, paged), cascade, sparse (block and variable) and the ⊕
merge ops.  Each row is a ``Case(name, op, build, expect)``: ``build(env)`` makes the wrapper and
the inputs and performs the call; ``expect`` is

* ``("raises", ExcType, regex)``: a clear error naming the offending argument, raised BEFORE any
  kernel launch, or
* ``("ok", checker)``: ``checker(result, env)`` judges what ``build`` returned (a correct result,
  or on the CPU the launch the call reached, see below).

Host-side cases run on the CPU: CPU tensors stand in for CUDA ones (``_fake_cuda`` workspaces
and graph buffers; the wrappers' device is then the CPU, and "another device" is ``meta``), the
arch / SM queries are stubbed, and ``kernel`` is replaced in every wrapper module that imports it
(``wrappers/decode.py``, ``wrappers/prefill_base.py``, ``wrappers/merge.py``) by a stub that
records each requested spec and returns a module whose call raises ``AssertionError("launched
...")``: a case that reaches a launch fails loudly.  A case whose correct outcome is "accepted"
catches that launch (``_to_launch``) and checks it (family, launch scalars).

Cases whose correct behaviour needs the GPU (a kernel result, device-resident state) are rows with
``gpu=True``, marked ``gpu``: they run for real against the fp32 reference (``cute_attn.testing``),
outputs pre-filled with NaN, fresh random inputs per test, with the real kernels wrapped so that
a "raises" case can assert that nothing launched before the error.

Rows that fail because the library does not behave correctly yet carry ``xfail`` (strict): they
stay in the table as the specification; the reason says what the library does today.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
from test_cascade import _two_level, make_cascade, plan_args
from test_prefill_gpu import _cumsum, _fake_cuda, _FakeEvent, check, make_paged, make_ragged

import cute_attn.wrappers.decode as _D
import cute_attn.wrappers.merge as _M
import cute_attn.wrappers.prefill_base as _P
from cute_attn import (
    BatchDecodeWithPagedKVCacheWrapper,
    BlockSparseAttentionWrapper,
    MultiLevelCascadeAttentionWrapper,
    VariableBlockSparseAttentionWrapper,
    merge_state,
    merge_state_in_place,
    merge_states,
)
from cute_attn.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from cute_attn.testing import merge_state_reference, merge_states_reference, paged_reference, ragged_reference
from cute_attn.variants.builtins import ALiBi, Causal
from cute_attn.wrappers.guards import UNIFORM_SCALE

BF, F16 = torch.bfloat16, torch.float16
NAN, INF = float("nan"), float("inf")
FP8 = torch.float8_e4m3fn
SM_SCALE_ARG = 12  # position of sm_scale in the decode / prefill kernels' launch arguments


# =========================================================================== the environment


class Launched(AssertionError):
    """Raised by a stub kernel module when called: the call reached a launch."""

    def __init__(self, record):
        super().__init__(f"launched {record['family']} {record['params']}")
        self.record = record


class _StubModule:
    def __init__(self, env, family, arch, params):
        self.env, self.family, self.arch, self.params = env, family, arch, params

    def __call__(self, *args, **kw):
        rec = dict(family=self.family, params=self.params, args=args)
        self.env.launched.append(rec)
        raise Launched(rec)


class _CountingModule:
    """GPU: the real module, each launch recorded."""

    def __init__(self, env, family, mod):
        self._env, self._family, self._mod = env, family, mod

    def __call__(self, *args, **kw):
        self._env.launched.append(dict(family=self._family, args=args))
        return self._mod(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._mod, name)


class _FakeDev0Tensor(torch.Tensor):
    """A CPU tensor that reports CUDA device 0 (the merge ops check ``get_device()``)."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


def _dev0(t):
    return torch.Tensor._make_subclass(_FakeDev0Tensor, t)


class Env:
    """Where a case runs: ``dev`` (the wrappers' device), ``other`` (another device), ``ws()`` /
    ``buf()`` (workspace / int32 index buffer on ``dev``), ``gen`` (a fresh generator),
    ``launched`` (launch records), ``capturing`` (CPU: what is_current_stream_capturing says)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.dev = "cuda" if gpu else "cpu"
        self.other = "cpu" if gpu else "meta"
        self.launched: list = []
        self.specs: list = []
        self.capturing = False
        self.gen = torch.Generator().manual_seed(random.randrange(1 << 30))

    def ws(self, mb=64):
        t = torch.empty(mb << 20, dtype=torch.uint8, device=self.dev)
        return t if self.gpu else _fake_cuda(t)

    def buf(self, n):
        t = torch.zeros(n, dtype=torch.int32, device=self.dev)
        return t if self.gpu else _fake_cuda(t)

    def to(self, t):
        return t.to(self.dev)


def _cpu_env(monkeypatch) -> Env:
    env = Env(gpu=False)
    env.mp = monkeypatch

    def stub_kernel(family, arch, **params):
        env.specs.append((family, arch, dict(params)))
        return _StubModule(env, family, arch, dict(params))

    for mod in (_D, _P, _M):
        monkeypatch.setattr(mod, "kernel", stub_kernel)
        monkeypatch.setattr(mod, "arch_of_index", lambda i: "sm_90a")
    for mod in (_D, _P):
        monkeypatch.setattr(mod, "sm_count_of_index", lambda i: 8)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: env.capturing)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return env


def _gpu_env(monkeypatch) -> Env:
    env = Env(gpu=True)
    env.mp = monkeypatch
    for mod in (_D, _P, _M):
        real = mod.kernel

        def counting(family, arch, _real=real, **params):
            env.specs.append((family, arch, dict(params)))
            return _CountingModule(env, family, _real(family, arch, **params))

        monkeypatch.setattr(mod, "kernel", counting)
    return env


def _to_launch(fn):
    """CPU: run ``fn`` up to the launch it must reach; returns that launch's record."""
    try:
        fn()
    except Launched as e:
        return e.record
    raise AssertionError("the call returned without reaching a launch")


# =========================================================================== the table


@dataclass
class Case:
    name: str
    op: str
    build: Callable[[Env], Any]
    expect: tuple
    gpu: bool = False
    xfail: Optional[str] = None

    @property
    def id(self):
        return f"{self.op}-{self.name}"


class X:
    """An argument derived from the case's inputs: ``X(lambda x, env: ...)``."""

    def __init__(self, fn):
        self.fn = fn


def _val(v, x, env):
    return v.fn(x, env) if isinstance(v, X) else v


def raises(exc, rx):
    return ("raises", exc, rx)


def ok(checker):
    return ("ok", checker)


def _launched(family, sm_scale=None):
    def checker(rec, env):
        assert rec["family"] == family, rec["family"]
        if sm_scale is not None:
            assert rec["args"][SM_SCALE_ARG] == sm_scale, rec["args"][SM_SCALE_ARG]

    return checker


def _planned(res, env):
    w = res
    assert w._state is not None


def _values(res, env):
    """GPU: (out, lse, ref_o, ref_lse, dtype[, rows]) -> the prefill tests' tolerances."""
    out, lse, ref_o, ref_lse, dtype = res[:5]
    rows = res[5] if len(res) > 5 else None
    check(out, lse, ref_o, ref_lse, dtype, rows=rows)


CASES: list = []


def case(name, op, build, expect, gpu=False, xfail=None):
    CASES.append(Case(name, op, build, expect, gpu, xfail))


# --------------------------------------------------------------------------- decode

DEC = "decode"
HQ, HK, D, PS = 8, 2, 128, 16
KV_LENS = (5, 17, 40)


def _dec_inputs(env, kv_lens=KV_LENS, ps=PS, hq=HQ, hk=HK, d=D, dtype=BF):
    cache, indptr, indices, last, _, _ = make_paged(kv_lens, ps, hk, d, dtype, "NHD", False, env.gen, env.dev)
    q = torch.randn(len(kv_lens), hq, d, generator=env.gen).to(dtype).to(env.dev)
    return SimpleNamespace(
        cache=cache, indptr=indptr, indices=indices, last=last, q=q, hq=hq, hk=hk, d=d, ps=ps, dtype=dtype
    )


def _dec_args(x, **over):
    args = dict(
        indptr=x.indptr,
        indices=x.indices,
        last_page_len=x.last,
        num_qo_heads=x.hq,
        num_kv_heads=x.hk,
        head_dim=x.d,
        page_size=x.ps,
        q_data_type=x.dtype,
    )
    args.update(over)
    return args


def dec_plan(ctor=None, ws_mb=64, kv_lens=KV_LENS, **over):
    """Build: plan() of a decode wrapper with some plan arguments replaced."""

    def build(env):
        x = _dec_inputs(env, kv_lens)
        w = BatchDecodeWithPagedKVCacheWrapper(env.ws(ws_mb), **(ctor or {}))
        w.plan(**_dec_args(x, **{k: _val(v, x, env) for k, v in over.items()}))
        return w

    return build


def dec_run(plan=None, q=None, cache=None, to_launch=False, kv_lens=KV_LENS, **run_kw):
    """Build: a good plan (``plan`` overrides), then run() with q / cache / run arguments replaced."""

    def build(env):
        x = _dec_inputs(env, kv_lens)
        w = BatchDecodeWithPagedKVCacheWrapper(env.ws())
        w.plan(**_dec_args(x, **{k: _val(v, x, env) for k, v in (plan or {}).items()}))
        qq = _val(q, x, env) if q is not None else x.q
        cc = _val(cache, x, env) if cache is not None else x.cache
        call = lambda: w.run(qq, cc, **{k: _val(v, x, env) for k, v in run_kw.items()})  # noqa: E731
        return _to_launch(call) if to_launch else call()

    return build


def dec_values(kv_lens=(5, 17, 300), indices=None, **plan_kw):
    """GPU build: plan (``indices`` may replace the page ids), run into NaN-filled out / lse, reference."""

    def build(env):
        x = _dec_inputs(env, kv_lens)
        idx = _val(indices, x, env) if indices is not None else x.indices
        w = BatchDecodeWithPagedKVCacheWrapper(env.ws())
        w.plan(**_dec_args(x, indices=idx, **plan_kw))
        out = torch.full_like(x.q, NAN)
        lse = torch.full((x.q.shape[0], x.hq), NAN, device=env.dev)
        w.run(x.q, x.cache, out=out, lse=lse)
        ref_o, ref_lse = paged_reference(
            x.q,
            x.cache,
            None,
            x.indptr,
            x.indices,
            x.last,
            sm_scale=plan_kw.get("sm_scale"),
            logits_soft_cap=plan_kw.get("logits_soft_cap"),
        )
        return out, lse, ref_o, ref_lse, x.dtype

    return build


def _dec_graph(env, batch_cap=4, pages_cap=64):
    bufs = dict(
        paged_kv_indptr_buffer=env.buf(batch_cap + 1),
        paged_kv_indices_buffer=env.buf(pages_cap),
        paged_kv_last_page_len_buffer=env.buf(batch_cap),
    )
    return BatchDecodeWithPagedKVCacheWrapper(env.ws(), use_cuda_graph=True, **bufs)


def dec_graph_replan(first=None, **second):
    def build(env):
        x = _dec_inputs(env)
        w = _dec_graph(env)
        w.plan(**_dec_args(x, **(first or {})))
        w.plan(**_dec_args(x, **second))
        return w

    return build


def _dec_graph_batch_beyond(env):
    x = _dec_inputs(env, (5, 17, 40, 9, 3))
    _dec_graph(env, batch_cap=4).plan(**_dec_args(x))


def _dec_capture_plan(env):
    x = _dec_inputs(env)
    w = BatchDecodeWithPagedKVCacheWrapper(env.ws())
    env.capturing = True
    w.plan(**_dec_args(x))


def _dec_capture_run(env):
    x = _dec_inputs(env)
    w = BatchDecodeWithPagedKVCacheWrapper(env.ws())
    w.plan(**_dec_args(x))
    env.capturing = True
    w.run(x.q, x.cache)


def _dec_run_before_plan(env):
    x = _dec_inputs(env)
    BatchDecodeWithPagedKVCacheWrapper(env.ws()).run(x.q, x.cache)


def _dec_run_after_failed_plan_ws(env):
    """A second plan that fails on the workspace size (a 1 MiB workspace cannot hold the plan of
    4000 requests even with the partial-output room cut down)."""
    x = _dec_inputs(env)
    w = BatchDecodeWithPagedKVCacheWrapper(env.ws(1))
    w.plan(**_dec_args(x))
    big = _dec_inputs(env, [1] * 4000, hq=32, hk=8)
    with pytest.raises(ValueError, match="float_workspace_buffer has"):
        w.plan(**_dec_args(big))
    w.run(x.q, x.cache)


def _dec_run_after_failed_plan_graph(env):
    """CUDA-graph mode: a second plan whose page ids overflow the indices buffer (after it has
    written its work lists and indptr into the fixed buffers)."""
    x = _dec_inputs(env)
    w = _dec_graph(env, batch_cap=4, pages_cap=8)
    w.plan(**_dec_args(x))
    big = _dec_inputs(env, (100, 100, 100))
    with pytest.raises(ValueError, match="CUDA-graph buffer"):
        w.plan(**_dec_args(big))
    w.run(x.q, x.cache)


def _padded(x, env):
    return torch.cat([x.indices, torch.tensor([10**6, 2**31 - 1, 123456], dtype=torch.int32)])


def _noncontig_gpu(x, env):
    wide = torch.full((x.indices.numel(), 2), 10**6, dtype=torch.int32, device=env.dev)
    wide[:, 0] = x.indices.to(env.dev)
    return wide[:, 0]  # stride 2


def _dec_zero_page_request(env):
    x = _dec_inputs(env, (5, 0, 40))
    w = BatchDecodeWithPagedKVCacheWrapper(env.ws())
    w.plan(**_dec_args(x))
    if not env.gpu:
        return _to_launch(lambda: w.run(x.q, x.cache))
    out = torch.full_like(x.q, NAN)
    lse = torch.full((3, x.hq), NAN, device=env.dev)
    w.run(x.q, x.cache, out=out, lse=lse)
    ref_o, ref_lse = paged_reference(x.q, x.cache, None, x.indptr, x.indices, x.last)
    return out, lse, ref_o, ref_lse, x.dtype


def _dec_empty_batch(env):
    x = _dec_inputs(env)
    w = BatchDecodeWithPagedKVCacheWrapper(env.ws())
    e = torch.zeros(0, dtype=torch.int32)
    w.plan(**_dec_args(x, indptr=torch.zeros(1, dtype=torch.int32), indices=e, last_page_len=e))
    return w.run(x.q[:0], x.cache, return_lse=True)


def _empty_result(res, env):
    out, lse = res
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ) and not env.launched


I32 = dict(dtype=torch.int32)

case("kv_layout_bad", DEC, dec_plan(ctor=dict(kv_layout="NDH")), raises(ValueError, "kv_layout"))
case(
    "workspace_on_cpu",
    DEC,
    lambda env: BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8)),
    raises(ValueError, "float_workspace_buffer must be a CUDA tensor"),
)
case(
    "workspace_non_contiguous",
    DEC,
    lambda env: BatchDecodeWithPagedKVCacheWrapper(_fake_cuda(torch.empty(1024, 2048, dtype=torch.uint8)[:, :1024])),
    raises(ValueError, "float_workspace_buffer must be contiguous"),
)
case(
    "workspace_too_small",
    DEC,
    lambda env: BatchDecodeWithPagedKVCacheWrapper(_fake_cuda(torch.empty(1 << 16, dtype=torch.uint8))).plan(
        **_dec_args(_dec_inputs(env))
    ),
    raises(ValueError, r"float_workspace_buffer has 65536 bytes; this plan needs \d+"),
)
case("num_kv_heads_0", DEC, dec_plan(num_kv_heads=0), raises(ValueError, "num_kv_heads must be a positive int"))
case(
    "num_qo_heads_not_multiple",
    DEC,
    dec_plan(num_qo_heads=6, num_kv_heads=4),
    raises(ValueError, r"num_qo_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
)
# (72: served by neither the decode nor the prefill kernels)
case("head_dim_72", DEC, dec_plan(head_dim=72), raises(ValueError, "head_dim 72 is not supported"))
case(
    "indptr_float_fractional",
    DEC,
    dec_plan(indptr=torch.tensor([0.0, 1.5, 3.0, 5.0])),
    raises(ValueError, "indptr must hold integers"),
)
case(
    "indptr_decreasing",
    DEC,
    dec_plan(indptr=torch.tensor([0, 3, 2, 5], **I32)),
    raises(ValueError, "indptr is not non-decreasing at index 2"),
)
case(
    "indptr_empty",
    DEC,
    dec_plan(indptr=torch.zeros(0, **I32), last_page_len=torch.zeros(0, **I32)),
    raises(ValueError, "indptr must have at least one element"),
)
case(
    "indptr_negative",
    DEC,
    dec_plan(indptr=torch.tensor([-1, 1, 2, 5], **I32)),
    raises(ValueError, r"indptr\[0\] must be 0, got -1"),
)
case(
    "last_page_len_above_page_size",
    DEC,
    dec_plan(last_page_len=torch.tensor([5, 17, 8], **I32)),
    raises(ValueError, r"last_page_len\[1\] = 17 is outside \[1, page_size=16\]"),
)
case(
    "last_page_len_0_with_pages",
    DEC,
    dec_plan(last_page_len=torch.tensor([5, 0, 8], **I32)),
    raises(ValueError, r"last_page_len\[1\] = 0 is outside"),
)
case(
    "last_page_len_wrong_length",
    DEC,
    dec_plan(last_page_len=torch.tensor([5, 1], **I32)),
    raises(ValueError, "last_page_len must have length 3"),
)
case(
    "indices_negative_host",
    DEC,
    dec_plan(indices=X(lambda x, env: torch.cat([x.indices[:-1], torch.tensor([-1], **I32)]))),
    raises(ValueError, r"indices\[\d+\] = -1 is outside"),
)
case(
    "indices_too_short_host",
    DEC,
    dec_plan(indices=X(lambda x, env: x.indices[:2])),
    raises(ValueError, "indices has 2 entries, kv_indptr\\[-1\\] needs 6"),
)
case(
    "indices_out_of_range_host",
    DEC,
    dec_run(plan=dict(indices=X(lambda x, env: torch.cat([x.indices[:-1], torch.tensor([1000], **I32)])))),
    raises(ValueError, "indices reference page 1000, the cache has 9 pages"),
)
case(
    "indices_padded_with_large_ids_accepted",
    DEC,
    dec_run(plan=dict(indices=X(_padded)), to_launch=True),
    ok(_launched("paged_decode")),
)
case("indices_padded_with_large_ids_values", DEC, dec_values(indices=X(_padded)), ok(_values), gpu=True)
case("indices_non_contiguous_gpu", DEC, dec_values(indices=X(_noncontig_gpu)), ok(_values), gpu=True)
case("q_wrong_shape", DEC, dec_run(q=X(lambda x, env: x.q[:, :, :64])), raises(ValueError, "q must be"))
case("q_wrong_dtype", DEC, dec_run(q=X(lambda x, env: x.q.half())), raises(ValueError, "q must be"))
case("q_wrong_rows", DEC, dec_run(q=X(lambda x, env: x.q[:2])), raises(ValueError, r"q must be .*\[3, 8, 128\]"))
case("q_other_device", DEC, dec_run(q=X(lambda x, env: x.q.to(env.other))), raises(ValueError, "q must be"))
case(
    "kv_wrong_dtype",
    DEC,
    dec_run(cache=X(lambda x, env: tuple(t.half() for t in x.cache))),
    raises(ValueError, "paged_kv_cache must be"),
)
case(
    "kv_wrong_page_size",
    DEC,
    dec_run(cache=X(lambda x, env: tuple(t[:, :8] for t in x.cache))),
    raises(ValueError, "paged_kv_cache .*page_size"),
)
case(
    "kv_wrong_heads",
    DEC,
    dec_run(cache=X(lambda x, env: tuple(t.repeat(1, 1, 2, 1) for t in x.cache))),
    raises(ValueError, "paged_kv_cache .*kv_heads"),
)
case(
    "kv_tuple_of_three",
    DEC,
    dec_run(cache=X(lambda x, env: x.cache + (x.cache[0],))),
    raises(ValueError, "paged_kv_cache"),
)
case(
    "out_other_device",
    DEC,
    dec_run(out=X(lambda x, env: torch.empty_like(x.q, device=env.other))),
    raises(ValueError, "out must be"),
)
case(
    "out_on_cpu",
    DEC,
    dec_run(out=X(lambda x, env: torch.empty_like(x.q, device="cpu"))),
    raises(ValueError, "out must be"),
    gpu=True,
)
case(
    "lse_other_device",
    DEC,
    dec_run(lse=X(lambda x, env: torch.empty(3, HQ, device=env.other))),
    raises(ValueError, "lse must be"),
)
case("lse_on_cpu", DEC, dec_run(lse=X(lambda x, env: torch.empty(3, HQ))), raises(ValueError, "lse must be"), gpu=True)
case(
    "out_wrong_dtype",
    DEC,
    dec_run(out=X(lambda x, env: torch.empty_like(x.q, dtype=F16))),
    raises(ValueError, "out must be"),
)
case(
    "lse_wrong_shape",
    DEC,
    dec_run(lse=X(lambda x, env: torch.empty(3, HQ + 1, device=env.dev))),
    raises(ValueError, "lse must be"),
)
case(
    "soft_cap_nan",
    DEC,
    dec_plan(logits_soft_cap=NAN),
    raises(ValueError, "logits_soft_cap"),
)
case(
    "soft_cap_negative",
    DEC,
    dec_plan(logits_soft_cap=-1.0),
    raises(ValueError, "logits_soft_cap must be finite and >= 0"),
)
case(
    "sm_scale_nan",
    DEC,
    dec_plan(sm_scale=NAN),
    raises(ValueError, "sm_scale"),
)
case(
    "sm_scale_inf",
    DEC,
    dec_plan(sm_scale=INF),
    raises(ValueError, "sm_scale"),
)
case(
    "sm_scale_0_accepted",
    DEC,
    dec_run(plan=dict(sm_scale=0.0), to_launch=True),
    ok(_launched("paged_decode", UNIFORM_SCALE)),
)
case("sm_scale_negative", DEC, dec_plan(sm_scale=-0.05), raises(ValueError, "sm_scale must be finite and >= 0"))
case("sm_scale_0_uniform", DEC, dec_values(sm_scale=0.0), ok(_values), gpu=True)
case("window_left_-2", DEC, dec_plan(window_left=-2), raises(ValueError, "window_left must be >= -1"))
case("pos_encoding_mode_bad", DEC, dec_plan(pos_encoding_mode="ROPE"), raises(ValueError, "pos_encoding_mode"))
case("variant_not_a_variant", DEC, dec_plan(variant="causal"), raises(TypeError, "variant must be a cute_attn"))
case("run_before_plan", DEC, _dec_run_before_plan, raises(RuntimeError, "before plan"))
case(
    "run_after_failed_plan_workspace",
    DEC,
    _dec_run_after_failed_plan_ws,
    raises((RuntimeError, ValueError), "plan|float_workspace_buffer"),
)
case(
    "run_after_failed_plan_graph_buffers",
    DEC,
    _dec_run_after_failed_plan_graph,
    raises((RuntimeError, ValueError), "plan|buffer"),
)
case("fixed_split_size_0", DEC, dec_plan(fixed_split_size=0), raises(ValueError, "fixed_split_size must be a positive"))
case(
    "fixed_split_size_-2", DEC, dec_plan(fixed_split_size=-2), raises(ValueError, "fixed_split_size must be a positive")
)
case(
    "fixed_split_size_-1_is_off",
    DEC,
    dec_plan(fixed_split_size=-1),
    ok(_planned),
)
case("heads_per_item_3", DEC, dec_plan(heads_per_item=3), raises(ValueError, "heads_per_item=3"))
case(
    "packed_custom_mask_too_short",
    DEC,
    dec_plan(packed_custom_mask=torch.zeros(3, dtype=torch.uint8)),
    raises(ValueError, "packed_custom_mask has 3 bytes"),
)
case(
    "packed_custom_mask_wrong_dtype",
    DEC,
    dec_plan(packed_custom_mask=torch.zeros(64, dtype=torch.int32)),
    raises(ValueError, "packed_custom_mask must be uint8"),
)
case(
    "custom_mask_wrong_size",
    DEC,
    dec_plan(custom_mask=torch.ones(61, dtype=torch.bool)),
    raises(ValueError, "custom_mask has 61 entries, expected .* = 62"),
)
case("sinks_wrong_shape", DEC, dec_run(sinks=torch.zeros(HQ + 1)), raises(ValueError, "sinks must be"))
case(
    "sinks_other_device",
    DEC,
    dec_run(sinks=X(lambda x, env: torch.zeros(HQ, device=env.other))),
    raises(ValueError, "sinks must be"),
)
case("run_window_left_differs", DEC, dec_run(window_left=8), raises(ValueError, r"run\(window_left=...\) differs"))
case("run_q_scale_nan", DEC, dec_run(q_scale=NAN), raises(ValueError, "q_scale must be finite and > 0"))
case("run_k_scale_0", DEC, dec_run(k_scale=0.0), raises(ValueError, "k_scale must be finite and > 0"))
case("run_v_scale_tensor_of_3", DEC, dec_run(v_scale=torch.ones(3)), raises(ValueError, r"one per kv head \(\[2\]\)"))
case("run_q_scale_per_kv_head", DEC, dec_run(q_scale=torch.ones(HK)), raises(ValueError, r"one per query head"))
case("run_k_scale_2d", DEC, dec_run(k_scale=torch.ones(1, HK)), raises(ValueError, "k_scale must be a float"))
case("run_k_scale_int", DEC, dec_run(k_scale=torch.ones(HK, dtype=torch.int32)), raises(ValueError, "float32"))
case(
    "run_k_scale_per_head_other_device",
    DEC,
    dec_run(k_scale=X(lambda x, env: torch.ones(HK, device=env.other))),
    raises(ValueError, "per-head k_scale must be on"),
)
case(
    "run_v_scale_per_head_nan",
    DEC,
    dec_run(v_scale=X(lambda x, env: torch.tensor([1.0, NAN], device=env.dev))),
    raises(ValueError, "finite and positive in every head"),
)
case(
    "run_k_scale_per_head_zero",
    DEC,
    dec_run(k_scale=X(lambda x, env: torch.tensor([0.0, 1.0], device=env.dev))),
    raises(ValueError, "finite and positive in every head"),
)
case(
    "run_per_head_scales_accepted",
    DEC,
    dec_run(
        to_launch=True,
        q_scale=X(lambda x, env: torch.rand(HQ, device=env.dev) + 0.5),
        k_scale=X(lambda x, env: torch.rand(HK, device=env.dev) + 0.5),
        v_scale=X(lambda x, env: torch.rand(HK, device=env.dev) + 0.5),
    ),
    ok(_launched("paged_decode", sm_scale=1.0 / D**0.5)),  # per-head scales stay out of the launch scalar
)
case("graph_batch_beyond_buffers", DEC, _dec_graph_batch_beyond, raises(ValueError, "exceeds paged_kv_indptr_buffer"))
case(
    "graph_replan_changes_sm_scale",
    DEC,
    dec_graph_replan(sm_scale=0.5),
    raises(ValueError, "sm_scale"),
)
case(
    "graph_replan_changes_soft_cap",
    DEC,
    dec_graph_replan(logits_soft_cap=30.0),
    raises(ValueError, "soft_cap|variant"),
)
case(
    "graph_replan_changes_soft_cap_value",
    DEC,
    dec_graph_replan(dict(logits_soft_cap=30.0), logits_soft_cap=50.0),
    raises(ValueError, "logits_soft_cap"),
)
case(
    "graph_replan_changes_window_value",
    DEC,
    dec_graph_replan(dict(window_left=8), window_left=16),
    raises(ValueError, "window_left"),
)
case("graph_replan_same_values_accepted", DEC, dec_graph_replan(dict(window_left=8), window_left=8), ok(_planned))
case("plan_during_capture", DEC, _dec_capture_plan, raises(RuntimeError, "must not be captured"))
case("run_captured_without_graph_mode", DEC, _dec_capture_run, raises(RuntimeError, "use_cuda_graph=False"))
case("fp8_q", DEC, dec_plan(q_data_type=FP8), raises(NotImplementedError, "fp8"))


def _dec_fp8_planned(kv_name):
    def checker(w, env):
        specs = {f: p for f, _, p in env.specs}
        assert specs["paged_decode"].get("kv_dtype") == kv_name, specs["paged_decode"]
        assert w._state.kv_dtype == {"e4m3": FP8, "e5m2": E5M2}[kv_name]

    return checker


case("fp8_kv_accepted", DEC, dec_plan(kv_data_type=FP8), ok(_dec_fp8_planned("e4m3")))
case("fp8_kv_e5m2_accepted", DEC, dec_plan(kv_data_type="float8_e5m2"), ok(_dec_fp8_planned("e5m2")))
case(
    "fp8_kv_rope", DEC, dec_plan(kv_data_type=FP8, pos_encoding_mode="ROPE_LLAMA"), raises(NotImplementedError, "RoPE")
)
case("kv_dtype_ne_q_dtype", DEC, dec_plan(kv_data_type=F16), raises(ValueError, "q/kv dtypes must be"))
case("q_dtype_float32", DEC, dec_plan(q_data_type=torch.float32), raises(ValueError, "q/kv dtypes must be"))
case("q_dtype_bad_name", DEC, dec_plan(q_data_type="float17"), raises(ValueError, "q_data_type 'float17'"))
case(
    "block_tables",
    DEC,
    dec_plan(block_tables=torch.zeros(3, 4, **I32)),
    raises(NotImplementedError, "block_tables"),
)
case("jit_args", DEC, dec_plan(ctor=dict(jit_args=["x"])), raises(NotImplementedError, "jit_args"))
case(
    "graph_mode_without_buffers",
    DEC,
    dec_plan(ctor=dict(use_cuda_graph=True)),
    raises(ValueError, "use_cuda_graph=True needs paged_kv_indptr_buffer"),
)
case("request_with_no_pages_accepted", DEC, _dec_zero_page_request, ok(_launched("paged_decode")))
case("request_with_no_pages_values", DEC, _dec_zero_page_request, ok(_values), gpu=True)
case("empty_batch", DEC, _dec_empty_batch, ok(_empty_result))


# --------------------------------------------------------------------------- prefill

RAG, PAG = "prefill_ragged", "prefill_paged"
PHQ, PHK, PD = 8, 2, 64
QO, KVL = (7, 30), (20, 30)


def _rag_inputs(env, qo=QO, kv=KVL, dtype=BF):
    q, k, v, qo_t, kv_t, ref_kv = make_ragged(qo, kv, PHQ, PHK, PD, dtype, "NHD", env.gen, env.dev)
    return SimpleNamespace(q=q, k=k, v=v, qo=qo_t, kv=kv_t, ref_kv=ref_kv, dtype=dtype)


def _rag_args(x, **over):
    args = dict(qo_indptr=x.qo, kv_indptr=x.kv, num_qo_heads=PHQ, num_kv_heads=PHK, head_dim_qk=PD, q_data_type=x.dtype)
    args.update(over)
    return args


def rag_plan(ctor=None, qo=QO, kv=KVL, **over):
    def build(env):
        x = _rag_inputs(env, qo, kv)
        w = BatchPrefillWithRaggedKVCacheWrapper(env.ws(), **(ctor or {}))
        w.plan(**_rag_args(x, **{k: _val(v, x, env) for k, v in over.items()}))
        return w

    return build


def rag_run(plan=None, q=None, k=None, v=None, to_launch=False, qo=QO, kv=KVL, **run_kw):
    def build(env):
        x = _rag_inputs(env, qo, kv)
        w = BatchPrefillWithRaggedKVCacheWrapper(env.ws())
        w.plan(**_rag_args(x, **{kk: _val(vv, x, env) for kk, vv in (plan or {}).items()}))
        qq = _val(q, x, env) if q is not None else x.q
        kk_ = _val(k, x, env) if k is not None else x.k
        vv_ = _val(v, x, env) if v is not None else x.v
        call = lambda: w.run(qq, kk_, vv_, **{a: _val(b, x, env) for a, b in run_kw.items()})  # noqa: E731
        return _to_launch(call) if to_launch else call()

    return build


def rag_values(qo=QO, kv=KVL, **plan_kw):
    def build(env):
        x = _rag_inputs(env, qo, kv)
        w = BatchPrefillWithRaggedKVCacheWrapper(env.ws())
        w.plan(**_rag_args(x, **plan_kw))
        out = torch.full_like(x.q, NAN)
        lse = torch.full((x.q.shape[0], PHQ), NAN, device=env.dev)
        w.run(x.q, x.k, x.v, out=out, lse=lse)
        ref_o, ref_lse = ragged_reference(
            x.q, *x.ref_kv, x.qo, x.kv, causal=plan_kw.get("causal", False), sm_scale=plan_kw.get("sm_scale")
        )
        return out, lse, ref_o, ref_lse, x.dtype

    return build


def _pag_inputs(env, qo=QO, kv=KVL, ps=16, dtype=BF):
    cache, indptr, indices, last, _, _ = make_paged(kv, ps, PHK, PD, dtype, "NHD", False, env.gen, env.dev)
    q = torch.randn(sum(qo), PHQ, PD, generator=env.gen).to(dtype).to(env.dev)
    qo_t = torch.tensor(_cumsum(qo), dtype=torch.int32)
    return SimpleNamespace(q=q, cache=cache, qo=qo_t, indptr=indptr, indices=indices, last=last, ps=ps, dtype=dtype)


def _pag_args(x, **over):
    args = dict(
        qo_indptr=x.qo,
        paged_kv_indptr=x.indptr,
        paged_kv_indices=x.indices,
        paged_kv_last_page_len=x.last,
        num_qo_heads=PHQ,
        num_kv_heads=PHK,
        head_dim_qk=PD,
        page_size=x.ps,
        q_data_type=x.dtype,
    )
    args.update(over)
    return args


def pag_plan(ctor=None, qo=QO, kv=KVL, **over):
    def build(env):
        x = _pag_inputs(env, qo, kv)
        w = BatchPrefillWithPagedKVCacheWrapper(env.ws(), **(ctor or {}))
        w.plan(**_pag_args(x, **{k: _val(v, x, env) for k, v in over.items()}))
        return w

    return build


def pag_run(plan=None, q=None, cache=None, to_launch=False, qo=QO, kv=KVL, **run_kw):
    def build(env):
        x = _pag_inputs(env, qo, kv)
        w = BatchPrefillWithPagedKVCacheWrapper(env.ws())
        w.plan(**_pag_args(x, **{k: _val(v, x, env) for k, v in (plan or {}).items()}))
        qq = _val(q, x, env) if q is not None else x.q
        cc = _val(cache, x, env) if cache is not None else x.cache
        call = lambda: w.run(qq, cc, **{a: _val(b, x, env) for a, b in run_kw.items()})  # noqa: E731
        return _to_launch(call) if to_launch else call()

    return build


def pag_values(qo=QO, kv=KVL, **plan_kw):
    def build(env):
        x = _pag_inputs(env, qo, kv)
        w = BatchPrefillWithPagedKVCacheWrapper(env.ws())
        w.plan(**_pag_args(x, **plan_kw))
        out = torch.full_like(x.q, NAN)
        lse = torch.full((x.q.shape[0], PHQ), NAN, device=env.dev)
        w.run(x.q, x.cache, out=out, lse=lse)
        ref_o, ref_lse = paged_reference(
            x.q,
            x.cache,
            x.qo,
            x.indptr,
            x.indices,
            x.last,
            causal=plan_kw.get("causal", False),
            sm_scale=plan_kw.get("sm_scale"),
        )
        return out, lse, ref_o, ref_lse, x.dtype

    return build


def _pag_graph(env, batch_cap=4, pages_cap=64):
    return BatchPrefillWithPagedKVCacheWrapper(
        env.ws(),
        use_cuda_graph=True,
        qo_indptr_buf=env.buf(batch_cap + 1),
        paged_kv_indptr_buf=env.buf(batch_cap + 1),
        paged_kv_indices_buf=env.buf(pages_cap),
        paged_kv_last_page_len_buf=env.buf(batch_cap),
    )


def _pag_graph_kv_pass(env):
    x = _pag_inputs(env)
    _pag_graph(env).plan(**_pag_args(x, kv_pass=True))


def _pag_run_after_failed_plan_graph(env):
    x = _pag_inputs(env)
    w = _pag_graph(env, pages_cap=8)
    w.plan(**_pag_args(x))
    big = _pag_inputs(env, (7, 30), (200, 30))
    with pytest.raises(ValueError, match="CUDA-graph buffer"):
        w.plan(**_pag_args(big))
    w.run(x.q, x.cache)


def _rag_graph_replan_sm_scale(env):
    x = _rag_inputs(env)
    w = BatchPrefillWithRaggedKVCacheWrapper(
        env.ws(), use_cuda_graph=True, qo_indptr_buf=env.buf(5), kv_indptr_buf=env.buf(5)
    )
    w.plan(**_rag_args(x))
    w.plan(**_rag_args(x, sm_scale=0.5))


def _rag_extra_positional(env):
    x = _rag_inputs(env)
    w = BatchPrefillWithRaggedKVCacheWrapper(env.ws())
    w.plan(**_rag_args(x))
    w.run(x.q, x.k, x.v, torch.zeros(1))


def _rag_run_before_plan(env):
    x = _rag_inputs(env)
    BatchPrefillWithRaggedKVCacheWrapper(env.ws()).run(x.q, x.k, x.v)


def _pag_gpu_ids_beyond_cache(env, checked=False):
    """Page ids on the GPU (never read back by plan()), one beyond the cache, in request 0:
    the kernels clamp the id (request 0 wrong, request 1 right, the context alive); with
    ``CUTE_ATTN_CHECK_INDICES=1`` run() names the bad id instead."""
    env.mp.setenv("CUTE_ATTN_CHECK_INDICES", "1" if checked else "0")
    x = _pag_inputs(env, (7, 30), (20, 30))
    bad = x.indices.clone()
    bad[0] = x.cache[0].shape[0] + 4096
    w = BatchPrefillWithPagedKVCacheWrapper(env.ws())
    out = torch.full_like(x.q, NAN)
    lse = torch.full((x.q.shape[0], PHQ), NAN, device=env.dev)
    err = None
    try:
        w.plan(**_pag_args(x, paged_kv_indices=bad.to(env.dev)))
        w.run(x.q, x.cache, out=out, lse=lse)
    except (RuntimeError, ValueError) as e:
        err = e
    torch.cuda.synchronize()  # the CUDA context must survive
    torch.zeros(1, device=env.dev).add_(1).item()
    ref_o, ref_lse = paged_reference(x.q, x.cache, x.qo, x.indptr, x.indices, x.last)
    return err, out, lse, ref_o, ref_lse, x


def _bounds_contained(res, env):
    err, out, lse, ref_o, ref_lse, x = res
    assert err is None, err  # unchecked: the clamp contains it, no error
    r1 = int(x.qo[1])  # request 1's rows: all its pages valid, so they must be right
    check(out[r1:], lse[r1:], ref_o[r1:], ref_lse[r1:], x.dtype)


# head_dim_qk 192 with head_dim_vo 128 (DeepSeek's prefill; tests/test_prefill_head_dims.py has the grid)
AQK, AVO = 192, 128


def _asym(env, paged, ps=16):
    """Inputs at 192 / 128 and a wrapper: ragged (q, k, v) or paged (q, (k_cache, v_cache))."""
    if paged:
        cache, indptr, indices, last, ref_kv, kv_tok = make_paged(
            KVL, ps, PHK, AQK, BF, "NHD", False, env.gen, env.dev, dv=AVO
        )
        q = torch.randn(sum(QO), PHQ, AQK, generator=env.gen).to(BF).to(env.dev)
        x = SimpleNamespace(q=q, cache=cache, qo=torch.tensor(_cumsum(QO), **I32), indptr=indptr, indices=indices,
                            last=last, ps=ps, dtype=BF, ref_kv=ref_kv, kv=kv_tok)  # fmt: skip
        return x, BatchPrefillWithPagedKVCacheWrapper(env.ws()), _pag_args
    q, k, v, qo_t, kv_t, ref_kv = make_ragged(QO, KVL, PHQ, PHK, AQK, BF, "NHD", env.gen, env.dev, dv=AVO)
    x = SimpleNamespace(q=q, k=k, v=v, qo=qo_t, kv=kv_t, ref_kv=ref_kv, dtype=BF)
    return x, BatchPrefillWithRaggedKVCacheWrapper(env.ws()), _rag_args


def asym(paged, plan=None, run=None, to_launch=False, values=False, ps=16):
    """Plan at 192 / 128 (``plan``: overrides), then, if ``run`` is given, run with its overrides
    (``q`` / ``k`` / ``v`` / ``cache`` / ``out``: X values)."""

    def build(env):
        x, w, args = _asym(env, paged, ps)
        w.plan(**args(x, **dict(dict(head_dim_qk=AQK, head_dim_vo=AVO), **(plan or {}))))
        if run is None and not values:
            return w
        kw = {k: _val(v, x, env) for k, v in (run or {}).items()}
        q = kw.pop("q", x.q)
        kv = (kw.pop("cache", x.cache),) if paged else (kw.pop("k", x.k), kw.pop("v", x.v))
        if values:
            out = torch.full((q.shape[0], PHQ, AVO), NAN, dtype=BF, device=env.dev)
            lse = torch.full((q.shape[0], PHQ), NAN, device=env.dev)
            w.run(q, *kv, out=out, lse=lse)
            ref_o, ref_lse = ragged_reference(q, *x.ref_kv, x.qo, x.kv, causal=(plan or {}).get("causal", False))
            return out, lse, ref_o, ref_lse, BF
        call = lambda: w.run(q, *kv, **kw)  # noqa: E731
        return _to_launch(call) if to_launch else call()

    return build


def _asym_launched(rec, env):
    assert rec["family"] == "batch_prefill_sm90", rec["family"]
    assert rec["params"]["head_dim"] == AQK and rec["params"]["head_dim_vo"] == AVO, rec["params"]
    assert rec["args"][5].shape[-1] == AVO  # out


for op, paged in ((RAG, False), (PAG, True)):
    case("asym_192_128_accepted", op, asym(paged, run={}, to_launch=True), ok(_asym_launched))
    case("asym_192_128_values", op, asym(paged, plan=dict(causal=True), values=True), ok(_values), gpu=True)
    case("asym_vo_unserved", op, asym(paged, plan=dict(head_dim_vo=64)), raises(ValueError, "head_dim_vo 64"))
    case("asym_rope", op, asym(paged, plan=dict(pos_encoding_mode="ROPE_LLAMA")), raises(NotImplementedError, "RoPE"))
    case(
        "asym_fp8_kv",
        op,
        asym(paged, plan=dict(kv_data_type=FP8)),
        raises(NotImplementedError, "fp8 KV cache with head_dim_vo"),
    )
    case(
        "asym_out_like_q",
        op,
        asym(paged, run=dict(out=X(lambda x, env: torch.empty_like(x.q)))),
        raises(ValueError, r"out must be .*128\)"),
    )
    case(
        "asym_q_of_vo_dim",
        op,
        asym(paged, run=dict(q=X(lambda x, env: x.q[..., :AVO].contiguous()))),
        raises(ValueError, "q must be"),
    )
case("asym_v_of_qk_dim", RAG, asym(False, run=dict(v=X(lambda x, env: x.k))), raises(ValueError, r"192 \(k\) / 128"))
case(
    "asym_v_cache_of_qk_dim",
    PAG,
    asym(True, run=dict(cache=X(lambda x, env: (x.cache[0], x.cache[0])))),
    raises(ValueError, "v: head_dim 192"),
)
case(
    "asym_single_tensor_cache",
    PAG,
    asym(True, run=dict(cache=X(lambda x, env: torch.stack([x.cache[0], x.cache[0]], 1)))),
    raises(ValueError, "v: head_dim 192"),
)
case(
    "asym_kv_heads_differ",
    PAG,
    asym(True, run=dict(cache=X(lambda x, env: (x.cache[0], x.cache[1][:, :, :1])))),
    raises(ValueError, "equal but for the head dim"),
)
case("asym_kv_pass_true", PAG, asym(True, plan=dict(kv_pass=True)), raises(NotImplementedError, "kv_pass=True"))
case("asym_page1_values", PAG, asym(True, plan=dict(causal=True), values=True, ps=1), ok(_values), gpu=True)
case("hd96_rope", RAG, rag_plan(head_dim_qk=96, pos_encoding_mode="ROPE_LLAMA"), raises(NotImplementedError, "RoPE"))


for op, plan_b, run_b, values_b in ((RAG, rag_plan, rag_run, rag_values), (PAG, pag_plan, pag_run, pag_values)):
    case(
        "indptr_lengths_differ",
        op,
        plan_b(qo_indptr=torch.tensor([0, 7, 30, 37], **I32)),
        raises(ValueError, "must have the same length"),
    )
    case(
        "causal_kv_shorter_than_qo_accepted",
        op,
        run_b(plan=dict(causal=True), qo=(12, 30), kv=(5, 30), to_launch=True),
        ok(_launched("batch_prefill_sm90")),
    )
    case(
        "causal_kv_shorter_than_qo_values",
        op,
        values_b(qo=(12, 30), kv=(5, 30), causal=True),
        ok(_values),
        gpu=True,
    )
    case(
        "fixed_split_size_-1_is_off",
        op,
        plan_b(fixed_split_size=-1),
        ok(_planned),
    )
    case(
        "fixed_split_size_0", op, plan_b(fixed_split_size=0), raises(ValueError, "fixed_split_size must be a positive")
    )
    case(
        "head_dim_vo_unserved_pair", op, plan_b(head_dim_vo=128), raises(ValueError, "head_dim_vo 128 is not supported")
    )
    case("head_dim_72", op, plan_b(head_dim_qk=72), raises(ValueError, "head_dim 72 is not supported"))
    case("head_dim_vo_not_int", op, plan_b(head_dim_vo="64"), raises(ValueError, "head_dim_vo must be a positive int"))
    case(
        "soft_cap_nan",
        op,
        plan_b(logits_soft_cap=NAN),
        raises(ValueError, "logits_soft_cap"),
    )
    case(
        "sm_scale_nan",
        op,
        plan_b(sm_scale=NAN),
        raises(ValueError, "sm_scale"),
    )
    case(
        "sm_scale_inf",
        op,
        plan_b(sm_scale=INF),
        raises(ValueError, "sm_scale"),
    )
    case(
        "sm_scale_0_accepted",
        op,
        run_b(plan=dict(sm_scale=0.0), to_launch=True),
        ok(_launched("batch_prefill_sm90", UNIFORM_SCALE)),
    )
    case("sm_scale_0_uniform", op, values_b(sm_scale=0.0), ok(_values), gpu=True)
    case("q_rows_ne_qo_indptr", op, run_b(q=X(lambda x, env: x.q[:-1])), raises(ValueError, r"q must be.*qo_indptr"))
    case(
        "out_other_device",
        op,
        run_b(out=X(lambda x, env: torch.empty_like(x.q, device=env.other))),
        raises(ValueError, "out must be"),
    )
    case(
        "lse_other_device",
        op,
        run_b(lse=X(lambda x, env: torch.empty(x.q.shape[0], PHQ, device=env.other))),
        raises(ValueError, "lse must be"),
    )
    case(
        "out_on_cpu",
        op,
        run_b(out=X(lambda x, env: torch.empty_like(x.q, device="cpu"))),
        raises(ValueError, "out must be"),
        gpu=True,
    )
    case("jit_args", op, plan_b(ctor=dict(jit_args=["x"])), raises(NotImplementedError, "jit_args"))
    case(
        "packed_custom_mask_wrong_dtype",
        op,
        plan_b(packed_custom_mask=torch.zeros(4096, dtype=torch.int32)),
        raises(ValueError, "packed_custom_mask must be uint8"),
    )
    case(
        "packed_custom_mask_too_short",
        op,
        plan_b(packed_custom_mask=torch.zeros(10, dtype=torch.uint8)),
        raises(ValueError, "packed_custom_mask has 10 bytes"),
    )
    case(
        "custom_mask_wrong_size",
        op,
        plan_b(custom_mask=torch.ones(7 * 20, dtype=torch.bool)),
        raises(ValueError, "custom_mask has 140 entries"),
    )
    case("window_left_-2", op, plan_b(window_left=-2), raises(ValueError, "window_left must be >= -1"))
    case("sinks_wrong_shape", op, run_b(sinks=torch.zeros(PHQ - 1)), raises(ValueError, "sinks must be"))

case(
    "qo_indptr_decreasing",
    RAG,
    rag_plan(qo_indptr=torch.tensor([0, 30, 7], **I32)),
    raises(ValueError, "qo_indptr is not non-decreasing"),
)
case(
    "kv_indptr_not_from_0",
    RAG,
    rag_plan(kv_indptr=torch.tensor([1, 21, 51], **I32)),
    raises(ValueError, r"kv_indptr\[0\] must be 0"),
)
case(
    "k_wrong_shape",
    RAG,
    rag_run(k=X(lambda x, env: x.k[:, :1]), v=X(lambda x, env: x.v[:, :1])),
    raises(ValueError, "k/v"),
)
case("k_v_differ", RAG, rag_run(v=X(lambda x, env: x.v[:-1])), raises(ValueError, "k/v must be equal"))
case(
    "k_too_few_tokens",
    RAG,
    rag_run(k=X(lambda x, env: x.k[:-1]), v=X(lambda x, env: x.v[:-1])),
    raises(ValueError, r"k/v .*must hold 50 \(kv_indptr\[-1\]\) tokens"),
)
case("extra_positional_without_variant", RAG, _rag_extra_positional, raises(TypeError, "extra positional"))
case("run_before_plan", RAG, _rag_run_before_plan, raises(RuntimeError, "before plan"))
case("graph_replan_changes_sm_scale", RAG, _rag_graph_replan_sm_scale, raises(ValueError, "sm_scale"))
case("page_size_0", PAG, pag_plan(page_size=0), raises(ValueError, "page_size must be a positive int"))
case(
    "page_ids_beyond_cache_host",
    PAG,
    pag_run(plan=dict(paged_kv_indices=X(lambda x, env: torch.cat([x.indices[:-1], torch.tensor([77], **I32)])))),
    raises(ValueError, "paged_kv_indices reference page 77"),
)
case(
    "kv_cache_wrong_heads",
    PAG,
    pag_run(cache=X(lambda x, env: tuple(t.repeat(1, 1, 2, 1) for t in x.cache))),
    raises(ValueError, "paged_kv_cache .*kv_heads"),
)
case(
    "kv_cache_wrong_dtype",
    PAG,
    pag_run(cache=X(lambda x, env: tuple(t.half() for t in x.cache))),
    raises(ValueError, "paged_kv_cache must be"),
)
case("kv_pass_true_in_graph_mode", PAG, _pag_graph_kv_pass, raises(ValueError, "kv_pass=True is not available"))
case(
    "run_after_failed_plan_graph_buffers",
    PAG,
    _pag_run_after_failed_plan_graph,
    raises((RuntimeError, ValueError), "plan|buffer"),
)


# --------------------------------------------------------------------------- prefill, fp8 KV cache
# (tests/test_fp8_prefill.py has the wiring and the GPU grid; here: what must fail before any launch)

E5M2 = torch.float8_e5m2


def _fp8_planned(kv_name):
    def checker(w, env):
        specs = {f: p for f, _, p in env.specs}
        assert specs["kv_pass"].get("kv_dtype") == kv_name, specs["kv_pass"]
        assert not specs["batch_prefill_sm90"]["paged"]  # the pass's contiguous output, 16-bit
        assert w._state.kv_dtype == {"e4m3": FP8, "e5m2": E5M2}[kv_name]

    return checker


def _as(dtype, kind):
    """X: the case's 16-bit K / V (ragged) or cache (paged) as ``dtype``."""
    if kind == RAG:
        return dict(k=X(lambda x, env: x.k.to(dtype)), v=X(lambda x, env: x.v.to(dtype)))
    return dict(cache=X(lambda x, env: tuple(t.to(dtype) for t in x.cache)))


def _fp8_values(op):
    """GPU: an e4m3 cache with scales against the reference on its dequantization."""

    def build(env):
        x = (_rag_inputs if op == RAG else _pag_inputs)(env)
        if op == RAG:
            w = BatchPrefillWithRaggedKVCacheWrapper(env.ws())
            w.plan(**_rag_args(x, kv_data_type=FP8, causal=True))
            kv_args, ref_kv = (x.k.to(FP8), x.v.to(FP8)), (x.k.to(FP8).float(), x.v.to(FP8).float())
        else:
            w = BatchPrefillWithPagedKVCacheWrapper(env.ws())
            w.plan(**_pag_args(x, kv_data_type=FP8, causal=True))
            kv_args = (tuple(t.to(FP8) for t in x.cache),)
            ref_kv = tuple(t.to(FP8).float() for t in x.cache)
        out = torch.full_like(x.q, NAN)
        lse = torch.full((x.q.shape[0], PHQ), NAN, device=env.dev)
        w.run(x.q, *kv_args, out=out, lse=lse, k_scale=0.5, v_scale=2.0)
        sm = 0.5 / PD**0.5
        if op == RAG:
            ref_o, ref_lse = ragged_reference(x.q, *ref_kv, x.qo, x.kv, causal=True, sm_scale=sm)
        else:
            ref_o, ref_lse = paged_reference(x.q, ref_kv, x.qo, x.indptr, x.indices, x.last, causal=True, sm_scale=sm)
        return out, lse, 2.0 * ref_o, ref_lse, x.dtype

    return build


_BAD_SCALES = (
    ("nan", NAN),
    ("inf", INF),
    ("negative", -1.0),
    ("zero", 0.0),
    ("zero_tensor", torch.tensor(0.0)),
    ("three_elements", X(lambda x, env: torch.ones(3, device=env.dev))),
    ("per_head_negative", X(lambda x, env: torch.tensor([1.0, -1.0], device=env.dev))),
    ("other_device", X(lambda x, env: torch.ones(1, device=env.other))),
)

for op, plan_b, run_b in ((RAG, rag_plan, rag_run), (PAG, pag_plan, pag_run)):
    fp8 = dict(kv_data_type=FP8)
    case("fp8_kv_e4m3_accepted", op, plan_b(kv_data_type=FP8), ok(_fp8_planned("e4m3")))
    case("fp8_kv_e5m2_accepted", op, plan_b(kv_data_type="float8_e5m2"), ok(_fp8_planned("e5m2")))
    case(
        "fp8_q_fp8_kv",
        op,
        plan_b(q_data_type=FP8, kv_data_type=FP8),
        raises(NotImplementedError, "fp8 attention"),
    )
    case("fp8_q_bf16_kv", op, plan_b(q_data_type=FP8, kv_data_type=BF), raises(NotImplementedError, "fp8 queries"))
    case(
        "fp8_kv_fnuz",
        op,
        plan_b(kv_data_type=torch.float8_e4m3fnuz),
        raises(NotImplementedError, "float8_e4m3fn and float8_e5m2"),
    )
    case("kv_f16_q_bf16", op, plan_b(kv_data_type=F16), raises(ValueError, "q/kv dtypes must be"))
    case("fp8_plan_bf16_cache", op, run_b(plan=fp8), raises(ValueError, "must be torch.float8_e4m3fn"))
    case("fp8_plan_e5m2_cache", op, run_b(plan=fp8, **_as(E5M2, op)), raises(ValueError, "must be torch.float8_e4m3fn"))
    case("bf16_plan_fp8_cache", op, run_b(**_as(FP8, op)), raises(ValueError, "must be torch.bfloat16"))
    case(
        "fp8_scales_accepted",
        op,
        run_b(plan=fp8, to_launch=True, k_scale=0.5, v_scale=torch.tensor([2.0]), **_as(FP8, op)),
        ok(_launched("kv_pass")),  # the pass first: it dequantizes the cache for the kernel
    )
    for which in ("k_scale", "v_scale"):
        for bad_name, bad in _BAD_SCALES:
            build = run_b(plan=fp8, **{which: bad}, **_as(FP8, op))
            case(f"fp8_{which}_{bad_name}", op, build, raises(ValueError, which))
    case("fp8_values_with_scales", op, _fp8_values(op), ok(_values), gpu=True)

case(
    "fp8_kv_pass_false",
    PAG,
    pag_plan(kv_data_type=FP8, kv_pass=False),
    raises(ValueError, "kv_pass=False with an fp8 KV cache"),
)


# --------------------------------------------------------------------------- cascade

CAS = "cascade"


def _cas_inputs(env, batch=3):
    groups, segs = _two_level(batch, 50, [4, 5, 6][:batch])
    q, cache, levels, _ = make_cascade(groups, segs, [1] * batch, 16, 4, 4, 64, F16, "NHD", env.gen, env.dev)
    return q, cache, list(plan_args(levels))


def cas_plan(num_levels=2, ws_mb=64, mutate=None, **kw):
    def build(env):
        q, cache, arrs = _cas_inputs(env)
        if mutate is not None:
            mutate(arrs)
        w = MultiLevelCascadeAttentionWrapper(num_levels, env.ws(ws_mb))
        w.plan(*arrs, 4, 4, 64, 16, **dict(dict(q_data_type=F16), **kw))
        return w

    return build


def _cas_run_before_plan(env):
    q, cache, _ = _cas_inputs(env)
    MultiLevelCascadeAttentionWrapper(2, env.ws()).run(q, cache)


def _cas_run_after_failed_plan(env):
    q, cache, arrs = _cas_inputs(env)
    w = MultiLevelCascadeAttentionWrapper(2, env.ws())
    w.plan(*arrs, 4, 4, 64, 16, q_data_type=F16)
    bad = [list(a) for a in arrs]
    bad[0][1] = torch.tensor([0, 1, 2], **I32)  # level 1 ends at another row count
    with pytest.raises(ValueError, match="same number of query rows"):
        w.plan(*bad, 4, 4, 64, 16, q_data_type=F16)
    w.run(q, cache)


def _cas_accepted(env):
    q, cache, arrs = _cas_inputs(env)
    w = MultiLevelCascadeAttentionWrapper(2, env.ws())
    w.plan(*arrs, 4, 4, 64, 16, q_data_type=F16)
    return _to_launch(lambda: w.run(q, cache))


def _set(level_arr, level, value):
    def mutate(arrs):
        arrs[level_arr] = list(arrs[level_arr])
        arrs[level_arr][level] = value(arrs[level_arr][level])

    return mutate


case(
    "qo_indptr_ends_differ",
    CAS,
    cas_plan(mutate=_set(0, 1, lambda a: torch.tensor([0, 1, 2], **I32))),
    raises(ValueError, "same number of query rows"),
)
case(
    "num_levels_0",
    CAS,
    lambda env: MultiLevelCascadeAttentionWrapper(0, env.ws()),
    raises(ValueError, "num_levels must be a positive int"),
)
case("causal_variant", CAS, cas_plan(variant=Causal()), raises(ValueError, "Causal"))
case("workspace_too_small_for_levels", CAS, cas_plan(ws_mb=1), raises(ValueError, r"cascade level 0 \(1/2 of"))
case(
    "workspace_below_one_slice",
    CAS,
    lambda env: MultiLevelCascadeAttentionWrapper(8, _fake_cuda(torch.empty(4096, dtype=torch.uint8))),
    raises(ValueError, "too small to give each of 8 cascade levels a slice"),
)
case(
    "fewer_level_arrays_than_levels",
    CAS,
    cas_plan(mutate=lambda a: a.__setitem__(2, a[2][:1])),
    raises(ValueError, r"paged_kv_indices_arr must be a list with one entry per level \(2\), got a list of 1"),
)
case(
    "level_indptr_lengths_differ",
    CAS,
    cas_plan(mutate=_set(1, 1, lambda a: a[:-1])),
    raises(ValueError, "level 1: qo_indptr and paged_kv_indptr must have the same length"),
)
case(
    "level_last_page_len_length",
    CAS,
    cas_plan(mutate=_set(3, 1, lambda a: a[:-1])),
    raises(ValueError, "last_page_len must have length 3"),
)
case(
    "level_page_ids_too_few",
    CAS,
    cas_plan(mutate=_set(2, 0, lambda a: a[:1])),
    raises(ValueError, "indices has 1 entries"),
)
case("run_before_plan", CAS, _cas_run_before_plan, raises(RuntimeError, "before plan"))
case("run_after_failed_plan", CAS, _cas_run_after_failed_plan, raises(RuntimeError, "before plan"))
case("plain_plan_accepted", CAS, _cas_accepted, ok(_launched("batch_prefill_sm90")))  # the shared level runs first


# --------------------------------------------------------------------------- sparse

BSR, VBSR = "sparse_block", "sparse_variable"
BSR_ARGS = (32, 64, 16, 16, 4, 4, 64)  # M, N, R, C, hq, hk, d


def _bsr_ip():
    return torch.tensor([0, 1, 2], **I32), torch.tensor([0, 3], **I32)


def bsr_plan(args=BSR_ARGS, ip=None, idx=None, **kw):
    def build(env):
        ip0, idx0 = _bsr_ip()
        w = BlockSparseAttentionWrapper(env.ws(16))
        w.plan(ip0 if ip is None else ip, idx0 if idx is None else idx, *args, **dict(dict(q_data_type=F16), **kw))
        return w

    return build


def bsr_run(q_rows=32, k_rows=64, hk=4):
    def build(env):
        ip, idx = _bsr_ip()
        w = BlockSparseAttentionWrapper(env.ws(16))
        w.plan(ip, idx, *BSR_ARGS, q_data_type=F16)
        z = lambda *s: torch.zeros(*s, dtype=F16, device=env.dev)  # noqa: E731
        return w.run(z(q_rows, 4, 64), z(k_rows, hk, 64), z(k_rows, hk, 64))

    return build


case(
    "N_not_multiple_of_C",
    BSR,
    bsr_plan(args=(32, 60, 16, 16, 4, 4, 64)),
    raises(ValueError, r"N \(60\) must be a multiple of the block width C \(16\)"),
)
case("causal", BSR, bsr_plan(causal=True), raises(NotImplementedError, "causal"))
case("rope", BSR, bsr_plan(pos_encoding_mode="ROPE_LLAMA"), raises(NotImplementedError, "ROPE_LLAMA"))
case("alibi", BSR, bsr_plan(pos_encoding_mode="ALIBI"), raises(NotImplementedError, "ALIBI"))
case("alibi_variant", BSR, bsr_plan(variant=ALiBi()), raises(NotImplementedError, "gathered positions"))
case(
    "indices_beyond_N_over_C",
    BSR,
    bsr_plan(idx=torch.tensor([0, 4], **I32)),
    raises(ValueError, r"indices must lie in \[0, N / C = 4\)"),
)
case(
    "indices_negative",
    BSR,
    bsr_plan(idx=torch.tensor([-1, 3], **I32)),
    raises(ValueError, r"indices must lie in \[0, N / C = 4\), got \[-1"),
)
case(
    "indices_too_few",
    BSR,
    bsr_plan(idx=torch.tensor([0], **I32)),
    raises(ValueError, r"indices must be 1-D with at least indptr\[-1\] = 2"),
)
case(
    "indptr_wrong_length",
    BSR,
    bsr_plan(ip=torch.tensor([0, 2], **I32)),
    raises(ValueError, r"indptr must have ceil\(M / R\) \+ 1 = 3 entries"),
)
case(
    "mask_wrong_shape",
    BSR,
    bsr_plan(mask=torch.ones(2, 16, 8, dtype=torch.bool)),
    raises(ValueError, r"mask must be \[nnz, R, C\] = \[2, 16, 16\]"),
)
case("R_zero", BSR, bsr_plan(args=(32, 64, 0, 16, 4, 4, 64)), raises(ValueError, "R must be a positive int"))
case("k_wrong_shape", BSR, bsr_run(k_rows=48), raises(ValueError, r"k must be \[N, num_kv_heads, head_dim\]"))
case("q_wrong_rows", BSR, bsr_run(q_rows=31), raises(ValueError, "q must be"))

VB_MAP = torch.ones(2, 2, 3, dtype=torch.bool)
VB_ROWS = torch.tensor([[4, 4], [3, 5]], **I32)
VB_COLS = torch.tensor([[2, 2, 2], [1, 1, 4]], **I32)


def vbsr_plan(bm=VB_MAP, rows=VB_ROWS, cols=VB_COLS, hq=4, hk=2, **kw):
    def build(env):
        w = VariableBlockSparseAttentionWrapper(env.ws(16))
        w.plan(bm, rows, cols, hq, hk, 64, **dict(dict(q_data_type=F16), **kw))
        return w

    return build


def vbsr_run(q_shape=(4, 8, 64), k_shape=(2, 6, 64)):
    def build(env):
        w = VariableBlockSparseAttentionWrapper(env.ws(16))
        w.plan(VB_MAP, VB_ROWS, VB_COLS, 4, 2, 64, q_data_type=F16)
        z = lambda s: torch.zeros(s, dtype=F16, device=env.dev)  # noqa: E731
        return w.run(z(q_shape), z(k_shape), z(k_shape))

    return build


case(
    "row_sizes_not_summing_to_M",
    VBSR,
    vbsr_plan(rows=torch.tensor([[4, 4], [3, 4]], **I32)),
    raises(ValueError, r"sum to the same lengths: rows \[8, 7\]"),
)
case(
    "col_sizes_not_summing_to_N",
    VBSR,
    vbsr_plan(cols=torch.tensor([[2, 2, 2], [1, 1, 3]], **I32)),
    raises(ValueError, r"sum to the same lengths: .*columns \[6, 5\]"),
)
case(
    "negative_block_size",
    VBSR,
    vbsr_plan(rows=torch.tensor([[4, 4], [9, -1]], **I32)),
    raises(ValueError, "block_row_sz and block_col_sz must be >= 0"),
)
case("causal", VBSR, vbsr_plan(causal=True), raises(NotImplementedError, "causal"))
case("rope", VBSR, vbsr_plan(pos_encoding_mode="ROPE_LLAMA"), raises(NotImplementedError, "RoPE"))
case("alibi", VBSR, vbsr_plan(pos_encoding_mode="ALIBI"), raises(NotImplementedError, "ALiBi"))
case(
    "map_wrong_shape",
    VBSR,
    vbsr_plan(bm=VB_MAP[:1]),
    raises(ValueError, r"block_mask_map must be \[num_kv_heads, MB, NB\]"),
)
case("q_wrong_M", VBSR, vbsr_run(q_shape=(4, 7, 64)), raises(ValueError, r"q must be .* = \[4, 8, 64\]"))
case("k_wrong_N", VBSR, vbsr_run(k_shape=(2, 5, 64)), raises(ValueError, r"k must be .* = \[2, 6, 64\]"))


# --------------------------------------------------------------------------- merge

MRG = "merge"


def _rn(env, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=env.gen).to(dtype).to(env.dev)


def _states(env, seq=4, n=3, h=2, d=64, dtype=BF):
    return _rn(env, seq, n, h, d, dtype=dtype), _rn(env, seq, n, h)


def _pair(env, seq=4, h=2, d=64, dtype=BF, fake=False):
    t = [_rn(env, seq, h, d, dtype=dtype), _rn(env, seq, h), _rn(env, seq, h, d, dtype=dtype), _rn(env, seq, h)]
    return [_dev0(x) for x in t] if fake else t


def _in_place_mask(mask_fn):
    def build(env):
        va, sa, vb, sb = _pair(env, fake=not env.gpu)
        m = mask_fn().to(env.dev)
        merge_state_in_place(va, sa, vb, sb, mask=m if env.gpu else _dev0(m))

    return build


case(
    "states_v_wrong_rank",
    MRG,
    lambda env: merge_states(_rn(env, 4, 3, 64, dtype=BF), _rn(env, 4, 3)),
    raises(ValueError, "v must have 4 dims"),
)
case(
    "states_s_not_float32",
    MRG,
    lambda env: merge_states(_states(env)[0], _states(env)[1].half()),
    raises(TypeError, r"s \(LSE\) must be float32"),
)
case(
    "states_s_wrong_shape",
    MRG,
    lambda env: merge_states(_states(env)[0], _rn(env, 4, 3, 3)),
    raises(ValueError, r"s must have shape \(4, 3, 2\)"),
)
case(
    "states_head_dim_not_vector_multiple",
    MRG,
    lambda env: merge_states(*_states(env, d=12)),
    raises(ValueError, "head_dim 12 must be a multiple of 8"),
)
case(
    "states_v_int",
    MRG,
    lambda env: merge_states(torch.zeros(4, 3, 2, 64, dtype=torch.int32), _states(env)[1]),
    raises(TypeError, "float16/bfloat16/float32 values"),
)
case(
    "states_out_wrong_dtype",
    MRG,
    lambda env: merge_states(*_states(env), out=torch.empty(4, 2, 64, dtype=F16)),
    raises(ValueError, "out must be"),
)
case(
    "state_v_wrong_rank",
    MRG,
    lambda env: merge_state(_rn(env, 4, 64, dtype=BF), _rn(env, 4), _rn(env, 4, 64, dtype=BF), _rn(env, 4)),
    raises(ValueError, "v_a must have 3 dims"),
)
case(
    "state_s_not_float32",
    MRG,
    lambda env: merge_state(*(lambda p: (p[0], p[1], p[2], p[3].double()))(_pair(env))),
    raises(TypeError, r"s_b \(LSE\) must be float32"),
)
case(
    "state_head_dim_not_vector_multiple",
    MRG,
    lambda env: merge_state(*_pair(env, d=20)),
    raises(ValueError, "head_dim 20 must be a multiple of 8"),
)
case(
    "state_v_a_v_b_shapes_differ",
    MRG,
    lambda env: merge_state(*(lambda p: (p[0], p[1], p[2][:, :1], p[3]))(_pair(env))),
    raises(ValueError, "v_a and v_b must match"),
)
case(
    "state_v_a_v_b_dtypes_differ",
    MRG,
    lambda env: merge_state(*(lambda p: (p[0], p[1], p[2].half(), p[3]))(_pair(env))),
    raises(ValueError, "v_a and v_b must match"),
)
case(
    "in_place_mask_wrong_shape",
    MRG,
    _in_place_mask(lambda: torch.ones(5, dtype=torch.bool)),
    raises(ValueError, r"mask must be a bool tensor of shape \(4,\)"),
)
case(
    "in_place_mask_wrong_dtype",
    MRG,
    _in_place_mask(lambda: torch.ones(4, dtype=torch.float32)),
    raises(ValueError, "mask must be a bool tensor"),
)
case(
    "states_cpu_tensors",
    MRG,
    lambda env: merge_states(*[t.cpu() for t in _states(env)]),
    raises(ValueError, "cute_attn kernels run on CUDA tensors"),
)
case(
    "state_cpu_tensors",
    MRG,
    lambda env: merge_state(*[t.cpu() for t in _pair(env)]),
    raises(ValueError, "cute_attn kernels run on CUDA tensors"),
)


def _merge_pair_values(empty_b_nan=True, all_empty=False, in_place=False):
    """GPU: state b empty (LSE -inf) with NaN values, or both empty: no NaN may leak."""

    def build(env):
        va, sa, vb, sb = _pair(env, seq=64, h=4, d=128)
        vb.fill_(NAN)
        sb.fill_(-INF)
        if all_empty:
            sa.fill_(-INF)
        ref_o, ref_lse = merge_state_reference(va, sa, vb, sb)
        if in_place:
            merge_state_in_place(va, sa, vb, sb)
            out, lse = va, sa
        else:
            out, lse = merge_state(va, sa, vb, sb)
        return out, lse, ref_o, ref_lse

    return build


def _merge_states_values(all_empty=False):
    def build(env):
        v, s = _states(env, seq=64, n=4, h=4, d=128)
        v[:, 1] = NAN
        s[:, 1] = -INF
        if all_empty:
            s.fill_(-INF)
        ref_o, ref_lse = merge_states_reference(v, s)
        out, lse = merge_states(v, s)
        return out, lse, ref_o, ref_lse

    return build


def _merged(res, env):
    out, lse, ref_o, ref_lse = res
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN leaked into the merged state"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "LSE -inf pattern differs"
    assert (out[~fin] == 0).all(), "an all-empty row must merge to 0"
    if fin.any():
        assert (lse[fin] - ref_lse[fin].float()).abs().max().item() < 1e-3
        err = ((out[fin].float() - ref_o[fin].float()).norm() / ref_o[fin].float().norm().clamp_min(1e-6)).item()
        assert err < 1e-2, err


case("state_nan_v_in_empty_state", MRG, _merge_pair_values(), ok(_merged), gpu=True)
case("state_all_empty_rows", MRG, _merge_pair_values(all_empty=True), ok(_merged), gpu=True)
case("in_place_nan_v_in_empty_state", MRG, _merge_pair_values(in_place=True), ok(_merged), gpu=True)
case("states_nan_v_in_empty_state", MRG, _merge_states_values(), ok(_merged), gpu=True)
case("states_all_empty_rows", MRG, _merge_states_values(all_empty=True), ok(_merged), gpu=True)


# --------------------------------------------------------------------------- last: may hurt the context


def _bounds_reported(res, env):
    err = res[0]
    assert isinstance(err, ValueError) and "page id" in str(err), err


case(
    "gpu_page_ids_beyond_cache_checked",
    PAG,
    lambda env: _pag_gpu_ids_beyond_cache(env, checked=True),
    ok(_bounds_reported),
    gpu=True,
)
case(
    "gpu_page_ids_beyond_cache",
    PAG,
    _pag_gpu_ids_beyond_cache,
    ok(_bounds_contained),
    gpu=True,
)


# --------------------------------------------------------------------------- found by the session-35 audit
# (a static and emulated probe of each wrapper with plausible mistakes; each of these launched or
# failed obscurely before)


def _strided(t):
    """``t``'s values in a tensor whose last dim has stride 2 (a view of a wider buffer)."""
    wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _dec_set_attr(name, value):
    def build(env):
        w = dec_plan()(env)
        setattr(w, name, value)

    return build


def _dec_fast_plan(**kw):
    def build(env):
        from cute_attn import fast_decode_plan

        x = _dec_inputs(env)
        w = dec_plan()(env)
        fast_decode_plan(w, x.indptr, x.indices, x.last, x.hq, x.hk, x.d, x.ps, **kw)

    return build


def _dec_fast_plan_indices(env):
    from cute_attn import fast_decode_plan

    x = _dec_inputs(env)
    w = dec_plan()(env)
    fast_decode_plan(w, x.indptr, x.indices[:2], x.last, x.hq, x.hk, x.d, x.ps)


def _dec_cached_plan_beyond_pages(env):
    x = _dec_inputs(env)
    w = dec_plan()(env)
    kv_lens = torch.tensor(KV_LENS, dtype=torch.int32)
    kv_lens[1] = 33  # request 1 holds 2 pages of 16: 32 tokens at most
    qo = torch.arange(len(KV_LENS) + 1, dtype=torch.int32)
    w._cached_module.plan(None, None, None, qo, x.indptr, kv_lens, len(KV_LENS), len(KV_LENS), HQ, HK, PS, False, D, D,
                          False, -1)  # fmt: skip


def _pag_graph_indptr_into_own_buffer(env):
    """vLLM-style: the indices already sit in the graph buffer after two stale entries, and
    indptr starts at 2 (rebased by the wrapper): the copy must not overlap itself."""
    x = _pag_inputs(env)
    w = _pag_graph(env)
    n = x.indices.numel()
    w._indices_buf[2 : 2 + n].copy_(x.indices)
    w._indices_buf[:2] = 99
    w.plan(**_pag_args(x, paged_kv_indptr=x.indptr + 2, paged_kv_indices=w._indices_buf))
    return w, x


def _indices_rebased(res, env):
    w, x = res
    assert torch.equal(w._indices_buf[: x.indices.numel()].cpu(), x.indices.cpu())


def _cas_level0_beyond_cache(env):
    """Level 0's pages reach past the cache, the last level's do not: the error comes before
    any level launches, and the caller's ``out`` is untouched."""
    q, (k, v), arrs = _cas_inputs(env)
    arrs = [list(a) for a in arrs]
    idx0 = arrs[2][0].clone()
    idx0[0] = k.shape[0]  # one past the last page
    arrs[2][0] = idx0
    w = MultiLevelCascadeAttentionWrapper(2, env.ws())
    w.plan(*arrs, 4, 4, 64, 16, q_data_type=F16)
    out = torch.full_like(q, 7.0)
    try:
        w.run(q, (k, v), out=out)
    finally:
        assert bool((out == 7.0).all()), "out was written before the error"


case(
    "v_cache_dtype_differs",
    DEC,
    dec_run(cache=X(lambda x, env: (x.cache[0], x.cache[1].to(F16)))),
    raises(ValueError, "k/v caches must share a dtype and device"),
)
case(
    "custom_mask_float",
    DEC,
    dec_plan(custom_mask=X(lambda x, env: torch.zeros(sum(KV_LENS)))),
    raises(ValueError, r"custom_mask must be bool .* an additive mask converts as \(mask == 0\)"),
)
case(
    "custom_mask_int_not_0_1",
    DEC,
    dec_plan(custom_mask=X(lambda x, env: torch.full((sum(KV_LENS),), 2, dtype=torch.int32))),
    raises(ValueError, "must hold only 0 / 1"),
)
case(
    "q_last_dim_strided",
    DEC,
    dec_run(q=X(lambda x, env: _strided(x.q))),
    raises(ValueError, "q's last dim must be contiguous"),
)
case("sm_scale_attr_nan", DEC, _dec_set_attr("_sm_scale", NAN), raises(ValueError, "sm_scale must be finite"))
case(
    "soft_cap_attr_nan",
    DEC,
    _dec_set_attr("_logits_soft_cap", NAN),
    raises(ValueError, "logits_soft_cap must be finite"),
)
case("window_left_attr_fraction", DEC, _dec_set_attr("_window_left", 2.7), raises(ValueError, r"\(an int\), got 2.7"))
case("window_left_fraction", DEC, dec_plan(window_left=2.7), raises(ValueError, r"\(an int\), got 2.7"))
case(
    "fast_plan_soft_cap_nan",
    DEC,
    _dec_fast_plan(logits_soft_cap=NAN),
    raises(ValueError, "logits_soft_cap must be finite"),
)
case(
    "fast_plan_sm_scale_neg", DEC, _dec_fast_plan(sm_scale=-1.0), raises(ValueError, "sm_scale must be finite and >= 0")
)
case(
    "fast_plan_indices_too_short",
    DEC,
    lambda env: _dec_fast_plan_indices(env),
    raises(ValueError, r"indices has 2 entries, indptr\[-1\] needs 6"),
)
case(
    "cached_plan_kv_len_beyond_pages",
    DEC,
    _dec_cached_plan_beyond_pages,
    raises(ValueError, "request 1: kv length 33 exceeds its 2 pages of 16 tokens"),
)
case(
    "rope_scale_0",
    DEC,
    dec_plan(pos_encoding_mode="ROPE_LLAMA", rope_scale=0.0),
    raises(ValueError, "rope_scale must be finite and > 0"),
)
case(
    "rope_theta_nan",
    PAG,
    pag_plan(pos_encoding_mode="ROPE_LLAMA", rope_theta=NAN),
    raises(ValueError, "rope_theta must be finite and > 0"),
)
case(
    "custom_mask_float",
    RAG,
    rag_plan(custom_mask=X(lambda x, env: torch.zeros(sum(q * k for q, k in zip(QO, KVL))))),
    raises(ValueError, "custom_mask must be bool"),
)
case("window_left_bool", RAG, rag_plan(window_left=True), raises(ValueError, r"\(an int\), got True"))
case("k_last_dim_strided", RAG, rag_run(k=X(lambda x, env: _strided(x.k))), raises(ValueError, "k's last dim must be"))
case(
    "out_last_dim_strided",
    RAG,
    rag_run(out=X(lambda x, env: _strided(torch.empty_like(x.q)))),
    raises(ValueError, "out's last dim must be contiguous"),
)
case(
    "indices_2d_on_device",
    PAG,
    pag_plan(paged_kv_indices=X(lambda x, env: _fake_cuda(x.indices.reshape(1, -1).clone()))),
    raises(ValueError, "paged_kv_indices must be 1-D"),
)
case("graph_indptr_rebased_into_own_buffer", PAG, _pag_graph_indptr_into_own_buffer, ok(_indices_rebased))
case("level0_page_beyond_cache", CAS, _cas_level0_beyond_cache, raises(ValueError, "page"))


# =========================================================================== the test


def _params():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    out = []
    for c in CASES:
        marks = [pytest.mark.gpu] if c.gpu else []
        if c.xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=c.xfail))
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


@pytest.mark.parametrize("case", _params())
def test_bad_input(case: Case, monkeypatch):
    env = _gpu_env(monkeypatch) if case.gpu else _cpu_env(monkeypatch)
    build = case.build
    kind = case.expect[0]
    if kind == "raises":
        _, exc, rx = case.expect
        with pytest.raises(exc, match=rx):
            build(env)
        assert not env.launched, f"launched before the error: {[r['family'] for r in env.launched]}"
    else:
        assert kind == "ok", kind
        case.expect[1](build(env), env)


def test_table_size():
    """The battery's contract: at least 70 rows, every op covered, both expectation kinds."""
    assert len(CASES) >= 70
    assert {c.op for c in CASES} == {DEC, RAG, PAG, CAS, BSR, VBSR, MRG}
    assert {c.expect[0] for c in CASES} == {"raises", "ok"}
    assert np.sum([c.gpu for c in CASES]) >= 10


def test_single_functions_check_kv_and_mask_first():
    """single_decode / single_prefill: a V of another dtype than K, and a transposed
    ``[kv_len, qo_len]`` mask (it has the right number of entries), are errors before any
    wrapper or workspace is made."""
    from cute_attn import single_decode_with_kv_cache, single_prefill_with_kv_cache

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    k = _fake_cuda(torch.randn(9, 2, 64, generator=g).to(BF))
    q1 = _fake_cuda(torch.randn(4, 64, generator=g).to(BF))
    with pytest.raises(ValueError, match="k/v must share a dtype and device"):
        single_decode_with_kv_cache(q1, k, _fake_cuda(k.to(F16)))
    q = _fake_cuda(torch.randn(5, 4, 64, generator=g).to(BF))
    with pytest.raises(ValueError, match="k/v must share a dtype and device"):
        single_prefill_with_kv_cache(q, k, _fake_cuda(k.to(F16)))
    with pytest.raises(ValueError, match=r"custom_mask must be \[qo_len, kv_len\] = \[5, 9\]"):
        single_prefill_with_kv_cache(q, k, k, custom_mask=torch.ones(9, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="custom_mask must be bool"):
        single_prefill_with_kv_cache(q, k, k, custom_mask=torch.zeros(5, 9))
