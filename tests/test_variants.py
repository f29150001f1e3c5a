"""The variant interface on the CPU: fingerprints, spec encoding, ABI, runtime arguments, and
(compile marker) that variant specs compile in a separate process."""

import json
import subprocess
import sys

import pytest

from cute_attn.abi.args import ScalarArg, TensorArg
from cute_attn.families.base import spec_variant as _spec_variant
from cute_attn.families.base import variant_params
from cute_attn.families.decode import decode_abi as _decode_abi
from cute_attn.families.decode import decode_spec
from cute_attn.families.spec import Spec
from cute_attn.testing.matrices import variant_decode_specs
from cute_attn.variants import (
    ALiBi,
    AttentionSink,
    Causal,
    Compose,
    CustomMask,
    FlashSigmoid,
    RoPE,
    ScalarParam,
    SlidingWindow,
    SoftCap,
    TensorParam,
    Variant,
    abi_args,
    decode,
    encode,
    fingerprint,
    get_alibi_slopes,
    runtime_values,
)
from cute_attn.variants.examples import RelativePositionBias

USER_SRC = """
from cute_attn.variants import TensorParam, Variant, dsl

def _times(x, k):  # a module-level helper of the hook: part of the variant's code
    return x * HELPER_EXPR

class HeadBias(Variant):
    static = {"scale": 1.0}
    runtime = (TensorParam("bias", "f32", 1),)

    def logits(self, ctx, s):
        return s + _times(ctx.args.bias[ctx.qo_head], SCALE_EXPR)
"""


def _write_user_module(tmp_path, expr="self.scale", name="user_variant_mod", helper="k"):
    (tmp_path / f"{name}.py").write_text(USER_SRC.replace("SCALE_EXPR", expr).replace("HELPER_EXPR", helper))
    return name


def _fp_in_subprocess(tmp_path, module, ctor="HeadBias()"):
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {module} as m; "
        f"from cute_attn.variants import fingerprint, encode; v = m.{ctor}; print(encode(v)); print(fingerprint(v))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def test_fingerprint_stable_across_instances_and_processes(tmp_path):
    mod = _write_user_module(tmp_path)
    enc1, fp1 = _fp_in_subprocess(tmp_path, mod)
    enc2, fp2 = _fp_in_subprocess(tmp_path, mod)
    assert (enc1, fp1) == (enc2, fp2)
    assert enc1 == f"{mod}:HeadBias(scale=1.0)"
    # built-ins: same across instances here and in another process
    v = ALiBi() + SoftCap()
    assert fingerprint(v) == fingerprint(ALiBi() + SoftCap())
    out = subprocess.run(
        [sys.executable, "-c", "from cute_attn.variants import *; print(fingerprint(ALiBi() + SoftCap()))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == fingerprint(v)
    # runtime values do not enter the identity
    assert fingerprint(SoftCap(logits_soft_cap=30.0)) == fingerprint(SoftCap(logits_soft_cap=50.0))
    assert variant_params(SoftCap(logits_soft_cap=3.0)) == variant_params(SoftCap())


def test_fingerprint_changes_with_code_and_static_params(tmp_path):
    mod = _write_user_module(tmp_path)
    enc, fp = _fp_in_subprocess(tmp_path, mod)
    enc_p, fp_p = _fp_in_subprocess(tmp_path, mod, "HeadBias(scale=2.0)")  # static parameter
    assert fp_p != fp and enc_p != enc
    _write_user_module(tmp_path, expr="(self.scale * 2.0)")  # code edit, same name/params
    enc_c, fp_c = _fp_in_subprocess(tmp_path, mod)
    assert enc_c == enc and fp_c != fp
    _write_user_module(tmp_path, helper="(k + 1.0)")  # the class untouched, a helper it calls edited
    enc_h, fp_h = _fp_in_subprocess(tmp_path, mod)
    assert enc_h == enc and fp_h not in (fp, fp_c)
    _write_user_module(tmp_path)  # back to the original code: the original fingerprint
    assert _fp_in_subprocess(tmp_path, mod) == (enc, fp)
    # built-ins: distinct per class, composition order matters, static params of the example
    fps = {
        fingerprint(v)
        for v in (
            Causal(),
            SlidingWindow(),
            SoftCap(),
            ALiBi(),
            AttentionSink(),
            CustomMask(),
            FlashSigmoid(),
            RoPE(),
            ALiBi() + SoftCap(),
            SoftCap() + ALiBi(),
            None,
        )
    }
    assert len(fps) == 11
    assert fingerprint(RelativePositionBias(num_buckets=16)) != fingerprint(RelativePositionBias())


def test_encode_decode_and_spec_round_trip():
    for v in [
        None,
        SoftCap(),
        SoftCap() + SlidingWindow(),
        RelativePositionBias(bucket_size=8, num_buckets=64),
        RoPE() + AttentionSink(),
        ALiBi() + SoftCap() + SlidingWindow() + CustomMask(),
    ]:
        text = encode(v)
        assert "," not in text
        back = decode(text)
        assert encode(back) == text and fingerprint(back) == fingerprint(v)
        spec = decode_spec("sm_90a", "bf16", 128, v)
        again = Spec.parse(spec.cli(), "sm_90a")
        assert again.key == spec.key
        assert encode(_spec_variant(again.pdict)) == text
    keys = {decode_spec("sm_90a", "bf16", 128, v).key for v in (None, SoftCap(), SlidingWindow(), ALiBi())}
    assert len(keys) == 4
    assert isinstance(decode("SoftCap+ALiBi"), Compose)


def test_spec_with_stale_fingerprint_is_rejected():
    spec = decode_spec("sm_90a", "bf16", 128, ALiBi())
    p = dict(spec.pdict, variant_fp="x0000000000000000")
    with pytest.raises(ValueError, match="changed since the spec was made"):
        _spec_variant(p)


def test_abi_and_runtime_values():
    v = RelativePositionBias() + SoftCap() + AttentionSink()
    args = abi_args(v)
    assert [a.name for a in args] == ["v0_bias_table", "v2_sinks", "v1_logits_soft_cap"]
    assert isinstance(args[0], TensorArg) and args[0].shape == (None, None) and args[0].stride == (None, 1)
    assert isinstance(args[2], ScalarArg) and args[2].dtype == "f32"
    full = _decode_abi(decode_spec("sm_90a", "f16", 64, v).pdict)
    assert [a.name for a in full[-3:]] == ["v0_bias_table", "v2_sinks", "v1_logits_soft_cap"]
    assert full[-4].name == "num_ctas"
    import torch

    # constructor values, then fill(), then run()'s positional arguments in declaration order
    table = torch.randn(4, 32)
    vals = runtime_values(SoftCap(logits_soft_cap=30.0) + RelativePositionBias(), {}, (table,))
    assert vals[0] is table and vals[1:] == [30.0]
    # runtime tensors as declared (dtype, rank, device, per-head rows), before any launch
    with pytest.raises(TypeError, match="must be a tensor"):
        runtime_values(RelativePositionBias(), {}, ("TABLE",))
    with pytest.raises(ValueError, match="2-D float32"):
        runtime_values(RelativePositionBias(), {}, (table.to(torch.bfloat16),))
    with pytest.raises(ValueError, match="2-D float32"):
        runtime_values(RelativePositionBias(), {}, (table[0],))
    with pytest.raises(ValueError, match="has 3 rows, the plan's num_qo_heads is 8"):
        runtime_values(ALiBi(alibi_slopes=torch.ones(3)), {"num_qo_heads": 8, "device": "cpu"})
    with pytest.raises(ValueError, match="must be on meta"):
        runtime_values(ALiBi(alibi_slopes=torch.ones(8)), {"num_qo_heads": 8, "device": torch.device("meta")})
    assert runtime_values(ALiBi(alibi_slopes=torch.ones(9)), {"num_qo_heads": 8, "device": "cpu"})[0].shape == (9,)
    with pytest.raises(ValueError, match="bias_table"):
        runtime_values(RelativePositionBias(), {})
    with pytest.raises(ValueError, match="extra positional"):
        runtime_values(SoftCap(logits_soft_cap=1.0), {}, (1,))
    assert runtime_values(RoPE(), {}) == [1.0, 10000.0]  # scalar defaults (FlashInfer's)
    slopes = runtime_values(ALiBi(), {"num_qo_heads": 12, "device": "cpu"})[0]
    assert slopes.shape == (12,) and abs(float(slopes[0]) - 2**-1) < 1e-7  # n = 8: 2^(-8/8)
    assert torch.allclose(get_alibi_slopes(8), torch.tensor([2.0 ** (-(i + 1)) for i in range(8)]))


def test_declaration_errors():
    class Bad(Variant):
        static = {"n": 3}

    with pytest.raises(TypeError):
        Bad(m=1)
    with pytest.raises(TypeError):
        Bad(n=[1, 2])
    with pytest.raises(ValueError):
        Bad(n="a,b")
    assert Bad(n=5).n == 5

    class Sig(Variant):
        softmax = False

        def finalize(self, ctx, m, l):
            return m, l

    from cute_attn.variants import Hooks

    with pytest.raises(ValueError):
        Hooks(Sig())
    h = Hooks(SoftCap() + SlidingWindow() + Causal())
    assert h.has_logits and h.has_kv_range and not h.has_mask and h.causal and h.softmax
    assert not Hooks(None).per_row
    assert TensorParam("x").ndim == 1 and ScalarParam("y").dtype == "f32"


def test_variant_specs_listed():
    specs = variant_decode_specs("sm_90a")
    assert len(specs) == len({s.key for s in specs}) >= 10
    assert all(s.family == "paged_decode" for s in specs)


@pytest.mark.compile
def test_variant_specs_compile_in_a_separate_process(tmp_path):
    """The compile CLI re-creates the variants from the spec text in a worker process (the
    example is imported by module:qualname); no spills; the plain spec keeps its registers."""
    specs = [decode_spec("sm_90a", "bf16", 128, v) for v in (None, RelativePositionBias(), RoPE() + AttentionSink())]
    cmd = [sys.executable, "-m", "cute_attn", "_compile_worker", "--arch", "sm_90a", "--out", str(tmp_path)]
    for s in specs:
        cmd += ["--spec", s.cli()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(recs) == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in recs:
        assert r["ok"], r
        assert all(r["instructions"].values()), r
        assert r["resources"].get("local", 0) == 0, r
    # the plain decode kernel still fits two 128-thread CTAs per SM (the wrapper launches two)
    assert (recs[0]["resources"].get("registers") or 0) <= 255, recs[0]


def test_variant_binding_selects_module_and_values():
    """The wrappers' run(): the plan's module with values computed once in plan(); run(*args)
    values; with sinks, the variant + AttentionSink module, loaded once."""
    import torch

    from cute_attn.variants import ALiBi
    from cute_attn.variants.binding import VariantBinding

    info = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64, "sm_scale": 0.125, "device": "cpu", "batch": 1}
    loads = []
    b = VariantBinding(ALiBi(), info, "plan-module", lambda v: loads.append(type(v).__name__) or "sink-module")
    module, vals = b.select()
    assert module == "plan-module" and len(vals) == 1 and vals is b.values  # precomputed, not recomputed
    sinks = torch.zeros(4)
    for _ in range(2):
        module, vals = b.select((), sinks)
        assert module == "sink-module" and len(vals) == 2 and vals[-1] is sinks
    assert len(loads) == 1  # the sink module is loaded once
    none = VariantBinding(None, info, "plain", lambda v: "sink-only")
    assert none.select() == ("plain", [])
    assert none.select((), sinks)[0] == "sink-only"


def test_ctx_float_positions_follow_the_positions():
    """``kv_pos_f32`` / ``rel_pos_f32`` are what the kernel supplied, and a new ``kv_pos`` or
    ``q_pos`` without them drops them (a stale float position would silently shift a bias)."""
    from cute_attn.variants.base import Ctx

    c = Ctx(batch=0, q_pos=3, kv_pos=5, kv_pos_f32="f5", rel_pos_f32="r2")
    assert (c.kv_pos_f32, c.rel_pos_f32) == ("f5", "r2")
    assert (c.replace(batch=1).kv_pos_f32, c.replace(batch=1).rel_pos_f32) == ("f5", "r2")
    assert c.replace(kv_pos=6, kv_pos_f32="f6", rel_pos_f32="r3").rel_pos_f32 == "r3"
    for moved in (c.replace(kv_pos=7), c.replace(q_pos=1)):
        assert moved._kv_pos_f32 is None and moved._rel_pos_f32 is None
    assert c.replace(kv_pos=7, kv_pos_f32="f7")._rel_pos_f32 is None
    with pytest.raises(TypeError):
        Ctx(kv_pos_f=1.0)


def test_bias_hooks_seeded_before_the_first_logits_hook():
    """``bias`` components before the first ``logits`` one are the kernel's to seed (prefill:
    into the QK accumulator) when it asks (``seed_bias``); a bias after a logits hook, or any
    bias in a kernel that does not seed, is applied by ``logits`` in component order."""
    from cute_attn.variants import Hooks
    from cute_attn.variants.base import Ctx

    class B(Variant):
        static = {"b": 1.0}

        def bias(self, ctx, scale):
            return self.b * scale

    class Twice(Variant):
        def logits(self, ctx, s):
            return 2.0 * s

    ctx, args = Ctx(), [None] * 3
    h = Hooks(ALiBi(), seed_bias=True)
    assert h.has_bias and not h.has_logits and h.per_row
    h = Hooks(B(b=3.0) + Twice() + B(b=5.0), seed_bias=True)  # 2 (s + 3) + 5, the 3 seeded
    assert h.has_bias and h.has_logits
    assert h.bias(ctx, args, 0.5) == 1.5 and h.logits(ctx, args, 10.0 + 3.0) == 31.0
    h = Hooks(B(b=3.0) + Twice() + B(b=5.0))  # nothing seeded: all in the logits chain
    assert not h.has_bias and h.has_logits and h.logits(ctx, args, 10.0) == 31.0
    h = Hooks(Twice() + B(b=3.0), seed_bias=True)
    assert not h.has_bias and h.logits(ctx, args, 10.0) == 23.0
    # soft-cap stays the prefill kernel's flag next to a seeded bias (it caps q·k + bias), and
    # joins the chain when a bias is meant to follow it
    from cute_attn.wrappers.options import resolve_variant

    assert resolve_variant(pos_encoding_mode="ALIBI", logits_soft_cap=5.0)[1] is True
    _, cap, _, v = resolve_variant(pos_encoding_mode="ALIBI", logits_soft_cap=5.0, variant=B())
    assert cap is False and [type(c).__name__ for c in v.parts] == ["ALiBi", "SoftCap", "B"]


def test_ctx_float_positions_as_base_plus_column_offset():
    """Kernels may give a float position as (per-block base, column constant): the properties
    return the sum, and ``rel_pos_times(x)`` is ``x * rel_pos`` written as ``x * offset + x *
    base`` (one FFMA per score in a kernel), also for offset 0 and for a plain value."""
    from cute_attn.variants.base import Ctx

    c = Ctx(kv_pos=13, q_pos=20, kv_pos_f32=(8.0, 5.0), rel_pos_f32=(-12.0, 5.0))
    assert (c.kv_pos_f32, c.rel_pos_f32) == (13.0, -7.0)
    assert c.rel_pos_times(0.25) == -1.75
    assert c.replace(batch=2).rel_pos_times(2.0) == -14.0  # the pair survives a replace
    z = Ctx(rel_pos_f32=(-3.0, 0.0))
    assert (z.rel_pos_f32, z.rel_pos_times(0.5)) == (-3.0, -1.5)
    assert Ctx(rel_pos_f32=6.0).rel_pos_times(0.5) == 3.0


def test_builtins_fill_without_the_dsl():
    """A GPU machine has no CuTe DSL: the wrappers' variant plumbing (fill() of the built-ins,
    dsl's host helpers) must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['cutlass'] = None\n"
        "from cute_attn.variants import RoPE, ALiBi\n"
        "from cute_attn.variants.base import runtime_values\n"
        "from cute_attn.variants.dsl import sincos_multiple\n"
        "v = runtime_values(ALiBi() + RoPE(), {'head_dim': 64, 'num_qo_heads': 4, 'device': 'cpu'})\n"
        "assert v[0].shape == (4,) and v[1:] == [1.0, 10000.0]\n"
        "print('ok')\n"
    )
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)  # this checkout's cute_attn, not an installed one
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
