"""Every parameter of FlashInfer 0.7.2's (0.7.2.post1, git beabf500) ``BatchMLAPagedAttentionWrapper``
``__init__`` / ``plan`` / ``run`` is accepted by cute_attn's ``cute_attn.mla`` wrapper: by name,
and positional parameters at the same positions (SGLang's flashinfer_mla backend calls plan()
with 12 positional arguments and run() with 4).  The reference is
``flashinfer_0_7_2_mla_signatures.json`` (FlashInfer's source read with ``ast``, as
``flashinfer_0_7_2_signatures.json`` for the other wrappers)."""

import importlib
import inspect
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SIGS = json.load(open(os.path.join(HERE, "flashinfer_0_7_2_mla_signatures.json")))
KEYS = [k for k in SIGS if not k.startswith("_")]


def _ours(key):
    mod, *path = key.split(".")
    obj = importlib.import_module(f"cute_attn.{mod}")
    for p in path:
        obj = getattr(obj, p)
    return obj


@pytest.mark.parametrize("key", KEYS)
def test_flashinfer_mla_parameters_accepted(key):
    mine = list(inspect.signature(_ours(key)).parameters.values())
    by_name = {p.name: p for p in mine}
    positional = [p for p in mine if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    pos_i = 0
    for name, kind, default in SIGS[key]:
        if kind == "positional":
            assert pos_i < len(positional) and positional[pos_i].name == name, (
                f"{key}: FlashInfer's positional parameter {pos_i} is {name!r}, ours "
                f"{positional[pos_i].name if pos_i < len(positional) else None!r}"
            )
            pos_i += 1
        else:
            p = by_name.get(name)
            assert p is not None and p.kind is not p.POSITIONAL_ONLY, f"{key}: keyword {name!r} not accepted"
        p = by_name[name]
        # same defaults where FlashInfer has one (None / False / 'none' / 'default' / 'auto')
        if default is not None and name != "self":
            assert repr(p.default) == default or str(p.default) == default.strip("'"), (key, name, p.default, default)


def test_module_path_and_top_level():
    import cute_attn
    import cute_attn.mla as mla

    assert mla.BatchMLAPagedAttentionWrapper is cute_attn.BatchMLAPagedAttentionWrapper
    assert hasattr(mla, "MLAPlanMetadata") and hasattr(mla.MLAPlanMetadata, "csr")
    assert "BatchMLAPagedAttentionWrapper" in cute_attn.__all__
