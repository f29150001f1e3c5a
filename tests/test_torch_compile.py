"""``torch.compile`` of the wrappers' ``run()`` and of the single-request functions
(``cute_attn.wrappers.compiled``): one custom op per call, no graph break, output equal to the
eager call.

CPU tests (run in CI): ``backend="eager"`` and ``backend="aot_eager"`` (functionalized: the
op's ``out`` / ``lse`` mutation through ``auto_functionalized``), ``fullgraph=True`` so that a
graph break is an error, on every wrapper with the kernels emulated (``emu_helpers.demu``: the
decode, prefill, KV-pass and merge emulations of ``test_prefill_gpu``) -- the op's real impl
then calls the emulated launches.  ``compilable_run`` is applied to the classes by
monkeypatching (the wrappers are not decorated yet).  Also: re-plans between calls of one
compiled function (no recompile, the new plan's output), two wrappers in one graph, the
single functions' keyed wrappers (plan once per key, kept after a capture, refused under
capture for a key never run eagerly).

GPU tests (marked ``gpu``; bf16, 32 / 8 heads, head dim 128: specs of the ``all`` preset):
decode and ragged prefill on ``use_cuda_graph=True`` wrappers under ``fullgraph=True``
(inductor) and ``mode="reduce-overhead"`` (CUDA-graph trees: warm-up, record, replays across
re-plans), against the eager call, with ``counters["graph_break"]`` empty.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engines"))

from emu_helpers import _cpu_ws, _fake_cuda, _gen, demu, paged_batch  # noqa: E402,F401
from test_cascade import _three_level, run_cascade  # noqa: E402
from test_prefill_gpu import run_paged, run_ragged  # noqa: E402
from test_sparse import run_bsr, run_vbsr  # noqa: E402

import cute_attn.wrappers.compiled as CC  # noqa: E402
import cute_attn.wrappers.compiled_single as CS  # noqa: E402
from cute_attn import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    BlockSparseAttentionWrapper,
    MultiLevelCascadeAttentionWrapper,
    VariableBlockSparseAttentionWrapper,
)
from cute_attn.wrappers.compiled import compilable_run  # noqa: E402

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
BACKENDS = ["eager", "aot_eager"]
CLASSES = (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    BlockSparseAttentionWrapper,
    VariableBlockSparseAttentionWrapper,
)


def _decorate(monkeypatch):
    for cls in CLASSES:
        monkeypatch.setattr(cls, "run", compilable_run(cls.run))


@pytest.fixture
def cemu(demu, monkeypatch):
    """demu, the wrappers' run() decorated, the cascade's merge module stubbed, dynamo fresh."""
    import cute_attn.wrappers.cascade as C

    _decorate(monkeypatch)
    monkeypatch.setattr(C, "merge_pair_module", lambda *a, **k: None)
    monkeypatch.setattr(CS, "_alloc", lambda n, dtype, device: _fake_cuda(torch.zeros(n, dtype=dtype)))
    monkeypatch.setattr(CS, "_KEYED", type(CS._KEYED)())
    monkeypatch.setattr(CS, "_PINNED", set())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield demu
    torch._dynamo.reset()


class _Count:
    """A backend that counts the graphs it compiles (delegating to ``backend``)."""

    def __init__(self, backend):
        from torch._dynamo.backends.registry import lookup_backend

        self.inner, self.graphs = lookup_backend(backend), []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)


def _ops(gm):
    """The cute_attn ops the dynamo graph calls (``wrapper_run``, ``single_decode``, ...)."""
    return [str(n.target).split(".")[1] for n in gm.graph.nodes if str(n.target).startswith("cute_attn.")]


def _same(got, want):
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w), (g.float() - w.float()).abs().max()


def _check(fn, args, backend, n_ops=1):
    """fn compiled (fullgraph) equals fn eager; the graph holds ``n_ops`` wrapper_run ops."""
    want = fn(*args)
    count = _Count(backend)
    got = torch.compile(fn, backend=count, fullgraph=True)(*args)
    _same(got, want)
    assert len(count.graphs) == 1
    assert _ops(count.graphs[0]).count("wrapper_run") == n_ops, _ops(count.graphs[0])
    assert not torch._dynamo.utils.counters["graph_break"]
    return got


# =========================================================================== CPU tests


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("return_lse", [False, True])
def test_cpu_ragged(cemu, backend, return_lse):
    w, (q, k, v), _, _ = run_ragged([3, 40, 1], [9, 70, 33], 8, 2, 64, BF16, causal=True, device="cpu",
                                    workspace=_cpu_ws(), seed=1)  # fmt: skip
    _check(lambda q, k, v: w.run(q, k, v, return_lse=return_lse, sinks=None), (q, k, v), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_ragged_out_given(cemu, backend):
    """out= / lse= of the caller are written in place (a mutated graph input)."""
    w, (q, k, v), _, _ = run_ragged([5, 17], [5, 60], 4, 4, 64, BF16, device="cpu", workspace=_cpu_ws(), seed=3)
    want = w.run(q, k, v, return_lse=True)

    def fn(q, k, v, out, lse):
        o, s = w.run(q, k, v, out=out, lse=lse, return_lse=True)
        return o + 0, s + 0

    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"))
    got = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, out, lse)
    _same(got, want)
    _same((out, lse), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("single_tensor", [False, True])
def test_cpu_paged(cemu, backend, single_tensor):
    """A (k, v) tuple and a single [pages, 2, ...] tensor; positional q_scale / keyword v_scale."""
    w, (q, cache), _, _ = run_paged([2, 30], [20, 90], 16, 8, 2, 64, BF16, causal=True, layout="HND",
                                    single_tensor=single_tensor, device="cpu", workspace=_cpu_ws(), seed=4)  # fmt: skip
    _check(lambda q, c: w.run(q, c, k_scale=0.5, v_scale=2.0, return_lse=True), (q, cache), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_decode(cemu, backend):
    g = _gen(5)
    cache, indptr, indices, last = paged_batch([7, 80, 1, 33], 16, 2, 64, BF16, g)
    q = torch.randn(4, 8, 64, generator=g).to(BF16)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    w.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=BF16, logits_soft_cap=20.0)
    _check(lambda q, c, s: w.run(q, c, return_lse=True, v_scale=s), (q, cache, torch.tensor(0.5)), backend)
    _check(lambda q, c: w.run(q, c), (q, cache), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_replan_no_recompile(cemu, backend):
    """plan() between calls (eager, outside the compiled function): same shapes, other lengths
    and options -- the compiled function is not recompiled and gives the new plan's output."""
    g = _gen(6)
    cache, indptr, indices, last = paged_batch([7, 80, 1, 33], 16, 2, 64, BF16, g)
    q = torch.randn(4, 8, 64, generator=g).to(BF16)
    w = BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(16))
    count = _Count(backend)
    f = torch.compile(lambda q, c: w.run(q, c, return_lse=True), backend=count, fullgraph=True)
    for i, cap in enumerate((None, 30.0, None)):
        shorter = torch.clamp(last - 3 * i, min=1)  # fewer tokens in each last page
        w.plan(indptr, indices, shorter, 8, 2, 64, 16, q_data_type=BF16, logits_soft_cap=cap)
        _same(f(q, cache), w.run(q, cache, return_lse=True))
    assert len(count.graphs) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_cascade(cemu, backend):
    groups, segs = _three_level(4, 200, [40, 0], [9, 30, 2, 64])
    w, (q, cache, _), _, _ = run_cascade(groups, segs, [1, 3, 2, 5], 16, 8, 2, 64, BF16, causal=True,
                                         device="cpu", workspace=_cpu_ws(96), seed=7)  # fmt: skip
    _check(lambda q, c: w.run(q, c, return_lse=True), (q, cache), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_block_sparse(cemu, backend):
    w = run_bsr(100, 64, 16, 8, 4, 2, 64, BF16, density=0.5, device="cpu", workspace=_cpu_ws(64), seed=8)
    g = _gen(9)
    q, k, v = (torch.randn(*s, generator=g).to(BF16) for s in ((100, 4, 64), (64, 2, 64), (64, 2, 64)))
    _check(lambda q, k, v: w.run(q, k, v, return_lse=True), (q, k, v), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_variable_block_sparse(cemu, backend):
    """q [heads, M, d]: out like q, lse [heads, M]."""
    w = run_vbsr(4, 2, 70, 90, 4, 5, 64, torch.float16, device="cpu", workspace=_cpu_ws(64), seed=10)
    g = _gen(11)
    q, k, v = (torch.randn(*s, generator=g).half() for s in ((4, 70, 64), (2, 90, 64), (2, 90, 64)))
    got = _check(lambda q, k, v: w.run(q, k, v, return_lse=True), (q, k, v), backend)
    assert got[1].shape == (4, 70)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_two_wrappers_one_graph(cemu, backend):
    """Two wrappers (two handles) in one graph, mixed with torch ops."""
    w1, (q, k, v), _, _ = run_ragged([5, 17], [5, 60], 4, 4, 64, BF16, device="cpu", workspace=_cpu_ws(), seed=12)
    w2, _, _, _ = run_ragged([10, 12], [30, 2], 4, 4, 64, BF16, causal=True, device="cpu", workspace=_cpu_ws(), seed=13)

    def fn(q, k, v):
        o1, s1 = w1.run(q, k, v, return_lse=True)
        o2 = w2.run(q * 2, k, v)
        return o1 + o2, s1.exp2()

    _check(fn, (q, k, v), backend, n_ops=2)


def test_cpu_eager_path_untouched(cemu):
    """Outside compilation the decorated run() is the method itself (same objects back)."""
    w, (q, k, v), _, _ = run_ragged([5, 17], [5, 60], 4, 4, 64, BF16, device="cpu", workspace=_cpu_ws(), seed=14)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    got = w.run(q, k, v, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert BatchPrefillWithRaggedKVCacheWrapper.run.__wrapped__ is not BatchPrefillWithRaggedKVCacheWrapper.run
    assert compilable_run(BatchPrefillWithRaggedKVCacheWrapper.run) is BatchPrefillWithRaggedKVCacheWrapper.run


def test_cpu_dead_wrapper(cemu):
    w, (q, k, v), _, _ = run_ragged([5], [9], 4, 4, 64, BF16, device="cpu", workspace=_cpu_ws(), seed=15)
    f = torch.compile(lambda q, k, v: w.run(q, k, v), backend="eager", fullgraph=True)
    f(q, k, v)
    assert CC._WRAPPERS[id(w)] is w  # registered at trace time
    CC._WRAPPERS.clear()  # a registry miss at run time: found again by id
    _same(f(q, k, v), w.run(q, k, v))
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.cute_attn.wrapper_run(12345, torch.empty_like(q), torch.empty(q.shape[:2]), [q], "[0,[],{}]")


def test_cpu_flatten_roundtrip():
    t = [torch.zeros(1), torch.ones(2)]
    x = (t[0], [None, 1.5, float("inf"), True, "NHD", (t[1], 3)], {"a": torch.bfloat16}, torch.device("cpu"))
    tensors = []
    node = CC._flat(x, tensors)
    back = CC._unflat(CC._parse(CC._encode(node)), tensors)
    assert back[0] is t[0] and back[1][5][0] is t[1] and back[1][:5] == [None, 1.5, float("inf"), True, "NHD"]
    assert back[1][5][1] == 3 and isinstance(back[1][5], tuple) and isinstance(back[1], list)
    assert back[2] == {"a": torch.bfloat16} and back[3] == torch.device("cpu")


# ---- single-request functions ---------------------------------------------------------------------
def _single_eager(monkeypatch, fn_name, q, k, v, **kw):
    """The eager single function of ``single`` on fake-CUDA workspaces (a fresh private wrapper)."""
    import cute_attn.wrappers.single as S

    cpu = torch.device("cpu")
    monkeypatch.setattr(S, "_PREFILL", {(cpu, q.dtype): S._GrowingRaggedWrapper(_cpu_ws(16))})
    monkeypatch.setattr(S, "_DECODE", {(cpu, q.dtype): BatchDecodeWithPagedKVCacheWrapper(_cpu_ws(128))})
    return getattr(S, fn_name)(_fake_cuda(q), k, v, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cpu_single_prefill(cemu, monkeypatch, backend, layout):
    g = _gen(16)
    q = torch.randn(37, 8, 64, generator=g).to(BF16)
    shape = (90, 2, 64) if layout == "NHD" else (2, 90, 64)
    k, v = (torch.randn(*shape, generator=g).to(BF16) for _ in range(2))
    kw = dict(causal=True, kv_layout=layout, logits_soft_cap=25.0, return_lse=True)
    want = _single_eager(monkeypatch, "single_prefill_with_kv_cache", q, k, v, **kw)
    want = tuple(t.as_subclass(torch.Tensor) for t in want)
    count = _Count(backend)
    f = torch.compile(lambda q, k, v: CS.compiled_single_prefill(q, k, v, **kw), backend=count, fullgraph=True)
    plans = []
    real_plan = BatchPrefillWithRaggedKVCacheWrapper.plan
    monkeypatch.setattr(BatchPrefillWithRaggedKVCacheWrapper, "plan", lambda s, *a, **k: plans.append(1) or
                        real_plan(s, *a, **k))  # fmt: skip
    for _ in range(3):
        _same(f(q, k, v), want)
    assert len(plans) == 1 and len(CS._KEYED) == 1  # one keyed wrapper, planned once
    assert _ops(count.graphs[0]) == ["single_prefill"] and len(count.graphs) == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    # no lse, and the eager branch of compiled_single_prefill is the public function
    _same(f(q, k, v)[0], CS.compiled_single_prefill(_fake_cuda(q), k, v, **kw)[0].as_subclass(torch.Tensor))


def test_cpu_keyed_replan(cemu, monkeypatch):
    """_keyed_wrapper: made + planned once per key; ``replan`` (a custom mask's, whose contents are
    not in the key) on every eager call and never under capture, where the key is pinned."""
    made, replans = [], []
    make = lambda: made.append(object()) or made[-1]  # noqa: E731
    key = ("k", torch.device("cpu"))
    w = CS._keyed_wrapper(key, make, replans.append)
    assert CS._keyed_wrapper(key, make, replans.append) is w and len(made) == 1 and replans == [w]
    cemu.state["capturing"] = True
    assert CS._keyed_wrapper(key, make, replans.append) is w and replans == [w]
    assert CS._PINNED == {key}
    cemu.state["capturing"] = False


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_single_decode(cemu, monkeypatch, backend):
    g = _gen(18)
    q = torch.randn(8, 64, generator=g).to(BF16)
    k, v = (torch.randn(300, 2, 64, generator=g).to(BF16) for _ in range(2))
    kw = dict(window_left=100, logits_soft_cap=20, return_lse=True)
    want = _single_eager(monkeypatch, "single_decode_with_kv_cache", q, k, v, **kw)
    want = tuple(t.as_subclass(torch.Tensor) for t in want)
    f = torch.compile(lambda q, k, v: CS.compiled_single_decode(q, k, v, **kw), backend=backend, fullgraph=True)
    got = f(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0].shape == (8, 64) and got[1].shape == (8,)
    # an empty KV: o = 0, lse = -inf (no wrapper)
    e = torch.zeros(0, 2, 64, dtype=BF16)
    o, s = torch.compile(lambda q, k, v: CS.compiled_single_decode(q, k, v, return_lse=True), backend=backend,
                         fullgraph=True)(q, e, e)  # fmt: skip
    assert not o.any() and torch.isinf(s).all()


def test_cpu_single_keyed_capture(cemu, monkeypatch):
    """Under capture: the key's wrapper runs without plan() and is pinned; an unseen key raises."""
    g = _gen(19)
    q = torch.randn(8, 64, generator=g).to(BF16)
    k, v = (torch.randn(40, 2, 64, generator=g).to(BF16) for _ in range(2))
    monkeypatch.setattr(CS, "MAX_UNPINNED_SINGLE", 1)
    op = torch.ops.cute_attn.single_decode
    args = lambda k, v: (q, k, v, None, "NHD", "NONE", -1, None, None, None, None, [], '{"variant":null}')  # noqa: E731
    want = op(*args(k, v))
    (key,) = CS._KEYED
    cemu.state["capturing"] = True
    plans = []
    monkeypatch.setattr(BatchDecodeWithPagedKVCacheWrapper, "plan", lambda *a, **kw: plans.append(1))
    _same(op(*args(k, v)), want)
    assert not plans and CS._PINNED == {key}
    with pytest.raises(RuntimeError, match="never ran with eagerly"):
        op(*args(k[:30], v[:30]))
    cemu.state["capturing"] = False


def test_cpu_single_keyed_eviction(cemu, monkeypatch):
    monkeypatch.setattr(CS, "MAX_UNPINNED_SINGLE", 2)
    g = _gen(20)
    q = torch.randn(8, 64, generator=g).to(BF16)
    k, v = (torch.randn(40, 2, 64, generator=g).to(BF16) for _ in range(2))
    for n in (10, 20, 30, 40):
        torch.ops.cute_attn.single_decode(q, k[:n], v[:n], None, "NHD", "NONE", -1, None, None, None, None, [], "{}")
    assert [key[6] for key in CS._KEYED] == [30, 40]
    CS.clear_single_cache()
    assert not CS._KEYED


# =========================================================================== GPU tests


def _spy_run(monkeypatch, cls):
    """``cls.run`` decorated, recording whether each eager run() was under CUDA-graph capture."""
    captured, run = [], cls.run

    def spy(self, *a, **kw):
        captured.append(torch.cuda.is_current_stream_capturing())
        return run(self, *a, **kw)

    monkeypatch.setattr(cls, "run", compilable_run(spy))
    return captured


def _gpu_compile_check(fn, args, replan, mode, captured):
    """``fn`` compiled (fullgraph, inductor, ``mode``) against eager over several plans
    (``replan(i)`` before call i): no graph break, equal outputs; under reduce-overhead the op
    was recorded into a CUDA graph (no cudagraph skip)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(fn, fullgraph=True, mode=mode)
    for i in range(4):  # reduce-overhead: warm-up, record, replays (each after a new plan)
        replan(i)
        want = [t.clone() for t in fn(*args)]
        got = [t.clone() for t in f(*args)]
        torch.cuda.synchronize()
        for g_, w_ in zip(got, want):
            assert torch.equal(g_, w_), (i, (g_.float() - w_.float()).abs().max())
    assert not torch._dynamo.utils.counters["graph_break"]
    if mode == "reduce-overhead":
        assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        assert any(captured)
        # eager calls: 4 of fn, 1 warm-up; then 1 recording, and the replays run no Python
        assert captured.count(True) == 1 and len(captured) == 6, captured


@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_decode_graph_wrapper(monkeypatch, mode):
    captured = _spy_run(monkeypatch, BatchDecodeWithPagedKVCacheWrapper)
    batch, hq, hk, d, ps = 16, 32, 8, 128, 16
    g = _gen(21)
    max_pages = 64 * batch
    k = torch.randn(max_pages, ps, hk, d, generator=g).to(BF16).cuda()
    v = torch.randn(max_pages, ps, hk, d, generator=g).to(BF16).cuda()
    q = torch.randn(batch, hq, d, generator=g).to(BF16).cuda()
    bufs = dict(
        paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"),
    )
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True, **bufs
    )

    def replan(i):
        lens = torch.randint(1, 64 * ps, (batch,), generator=_gen(100 + i))
        pages = (lens + ps - 1) // ps
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).int()
        indices = torch.randperm(max_pages, generator=_gen(200 + i))[: int(indptr[-1])].int()
        last = ((lens - 1) % ps + 1).int()
        w.plan(indptr, indices, last, hq, hk, d, ps, q_data_type=BF16)

    _gpu_compile_check(lambda q, k, v: w.run(q, (k, v), return_lse=True), (q, k, v), replan, mode, captured)


@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_ragged_graph_wrapper(monkeypatch, mode):
    captured = _spy_run(monkeypatch, BatchPrefillWithRaggedKVCacheWrapper)
    batch, hq, hk, d = 4, 32, 8, 128
    total_q, total_kv = 1024, 4096
    g = _gen(22)
    q = torch.randn(total_q, hq, d, generator=g).to(BF16).cuda()
    k = torch.randn(total_kv, hk, d, generator=g).to(BF16).cuda()
    v = torch.randn(total_kv, hk, d, generator=g).to(BF16).cuda()
    w = BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
        use_cuda_graph=True,
        qo_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
        kv_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
    )

    def cuts(total, seed):
        c = torch.sort(torch.randint(0, total + 1, (batch - 1,), generator=_gen(seed))).values
        return torch.cat([torch.tensor([0]), c, torch.tensor([total])]).int()

    def replan(i):  # every plan has total_q query tokens (the first plan fixes the capacity)
        w.plan(cuts(total_q, 300 + i), cuts(total_kv, 400 + i), hq, hk, d, causal=True, q_data_type=BF16)

    _gpu_compile_check(lambda q, k, v: w.run(q, k, v, return_lse=True), (q, k, v), replan, mode, captured)


@gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_single_functions(mode):
    """compiled_single_decode / compiled_single_prefill against the eager functions; under
    reduce-overhead the keyed wrappers' launches are recorded and replayed."""
    CS.clear_single_cache()
    g = _gen(23)
    qd = torch.randn(32, 128, generator=g).to(BF16).cuda()
    kd, vd = (torch.randn(2000, 8, 128, generator=g).to(BF16).cuda() for _ in range(2))
    qp = torch.randn(300, 32, 128, generator=g).to(BF16).cuda()
    kp, vp = (torch.randn(1000, 8, 128, generator=g).to(BF16).cuda() for _ in range(2))

    def fn(qd, kd, vd, qp, kp, vp):
        od, sd = CS.compiled_single_decode(qd, kd, vd, return_lse=True)
        op, sp = CS.compiled_single_prefill(qp, kp, vp, causal=True, return_lse=True)
        return od, sd, op, sp

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(fn, fullgraph=True, mode=mode)
    args = (qd, kd, vd, qp, kp, vp)
    want = fn(*args)
    for _ in range(3):
        got = [t.clone() for t in f(*args)]
        torch.cuda.synchronize()
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=0, atol=0)
    assert not torch._dynamo.utils.counters["graph_break"]
    if mode == "reduce-overhead":
        assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        assert len(CS._PINNED) == 2  # both keyed wrappers ran under capture
    CS.clear_single_cache()


@pytest.mark.parametrize("fn_name", ["single_prefill_with_kv_cache", "single_decode_with_kv_cache"])
def test_cpu_public_single_functions_compile_and_apply_scales(cemu, monkeypatch, fn_name):
    """The public single functions themselves under torch.compile(fullgraph=True) (they hand
    over to the op while dynamo traces), and the float k_scale / v_scale applied as FlashInfer
    does: k_scale into the softmax scale, v_scale on the output -- eager and compiled alike."""
    import cute_attn.wrappers.single as S

    g = _gen(21)
    q = torch.randn(*((17, 8, 64) if "prefill" in fn_name else (8, 64)), generator=g).to(BF16)
    k, v = (torch.randn(60, 2, 64, generator=g).to(BF16) for _ in range(2))
    scales = dict(k_scale=0.5, v_scale=2.0)
    plain = _single_eager(monkeypatch, fn_name, q, k, v, sm_scale=0.5 / 8.0, return_lse=True)
    want = _single_eager(monkeypatch, fn_name, q, k, v, return_lse=True, **scales)
    torch.testing.assert_close(want[0].float(), plain[0].float() * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(want[1], plain[1], rtol=0, atol=0)  # the LSE is not scaled
    f = torch.compile(lambda q, k, v: getattr(S, fn_name)(q, k, v, return_lse=True, **scales), backend="eager",
                      fullgraph=True)  # fmt: skip
    got = f(q, k, v)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(got[0].as_subclass(torch.Tensor), want[0].as_subclass(torch.Tensor), rtol=0, atol=0)
