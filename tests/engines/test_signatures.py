"""Every parameter of FlashInfer 0.7.2's (0.7.2.post1, git beabf500) public wrapper methods and
functions that vLLM's and SGLang's FlashInfer backends reach -- the wrappers' ``__init__`` /
``plan`` / ``run`` / ``forward`` / ``forward_return_lse`` / ``begin_forward`` /
``run_return_lse`` / ``workspace_size``, ``fast_decode_plan``, ``single_decode_with_kv_cache``,
``single_prefill_with_kv_cache``, the cascade and shared-prefix wrappers, the merge ops -- is
accepted by cute_attn's: by name, and positional parameters at the same positions.  The
reference is ``flashinfer_0_7_2_signatures.json`` (FlashInfer's source read with ``ast``)."""

import ast
import importlib
import inspect
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SIGS = json.load(open(os.path.join(HERE, "flashinfer_0_7_2_signatures.json")))
KEYS = [k for k in SIGS if not k.startswith("_")]


def _ours(key):
    mod, *path = key.split(".")
    obj = importlib.import_module(f"cute_attn.{mod}")
    for p in path:
        obj = getattr(obj, p)
    return obj


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


@pytest.mark.parametrize("key", KEYS)
def test_flashinfer_parameters_accepted(key):
    theirs = SIGS[key]
    ours = _ours(key)
    assert callable(ours), key
    if theirs and theirs[0] == "alias":
        target = theirs[1]
        if target in ("plan", "run"):
            cls = _ours(key.rsplit(".", 1)[0])
            assert inspect.signature(ours) == inspect.signature(getattr(cls, target)), key
        return
    mine = _params(ours)
    by_name = {p.name: p for p in mine}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in mine)
    positional = [p for p in mine if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    pos_i = 0
    for name, kind, _default in theirs:
        if kind == "varargs":
            assert any(p.kind is p.VAR_POSITIONAL for p in mine), f"{key}: FlashInfer takes *{name}"
            continue
        if kind == "varkw":
            assert var_kw, f"{key}: FlashInfer takes **{name}"
            continue
        if kind == "positional":
            assert pos_i < len(positional) and positional[pos_i].name == name, (
                f"{key}: FlashInfer's positional parameter {pos_i} is {name!r}, ours "
                f"{positional[pos_i].name if pos_i < len(positional) else None!r}"
            )
            pos_i += 1
            continue
        p = by_name.get(name)
        assert p is not None and p.kind is not p.POSITIONAL_ONLY, f"{key}: keyword {name!r} not accepted"


# FlashInfer defaults cute_attn does not keep, and why (each documented at the parameter)
DEFAULT_EXCEPTIONS = {
    # None: the query dtype; FlashInfer's float16 for any query dtype would be an output dtype
    # other than the query's, which cute_attn's kernels do not write
    ("sparse.BlockSparseAttentionWrapper.plan", "o_data_type"),
    # None stands for "not given" so that the legacy ``data_type`` fills it, then float16
    ("decode.BatchDecodeWithPagedKVCacheWrapper._plan_impl", "q_data_type"),
}


@pytest.mark.parametrize("key", [k for k in KEYS if SIGS[k] and SIGS[k][0] != "alias"])
def test_flashinfer_defaults_kept(key):
    """A parameter FlashInfer gives a literal default has the same default here (a caller that
    leaves it out gets the same behaviour), except ``DEFAULT_EXCEPTIONS``."""
    mine = inspect.signature(_ours(key)).parameters
    for name, kind, default in SIGS[key]:
        if default is None or kind in ("varargs", "varkw") or name not in mine:
            continue
        try:
            theirs = ast.literal_eval(default)
        except ValueError:
            continue  # an expression (a module constant): not comparable here
        ours = mine[name].default
        same = ours is not inspect.Parameter.empty and type(ours) is type(theirs) and ours == theirs
        assert same or (key, name) in DEFAULT_EXCEPTIONS, f"{key}: {name}={ours!r}, FlashInfer's {default}"


def test_decode_plan_keywords_and_legacy_order():
    """FlashInfer's decode plan() forwards its keywords to _plan_impl; its legacy positional order."""
    from cute_attn.decode import BatchDecodeWithPagedKVCacheWrapper as W
    from cute_attn.wrappers.compat import DECODE_PLAN_LEGACY

    assert list(DECODE_PLAN_LEGACY) == SIGS["_legacy_decode_plan_positional"]
    mine = {p.name for p in _params(W._plan_impl)}
    for name, _kind, _ in SIGS["decode.BatchDecodeWithPagedKVCacheWrapper._plan_impl"]:
        assert name in mine, name
    ext = {p.name for p in _params(W._plan_impl) if p.kind is p.KEYWORD_ONLY} - {
        n for n, _, _ in SIGS["decode.BatchDecodeWithPagedKVCacheWrapper._plan_impl"]
    }
    assert ext == {"variant", "custom_mask", "packed_custom_mask", "heads_per_item"}, ext  # keyword-only extensions


def test_top_level_names():
    import cute_attn

    for name in (
        "fast_decode_plan",
        "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
        "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
        "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    ):
        assert name in cute_attn.__all__ and callable(getattr(cute_attn, name))
