"""tests/ptx_interp.py's fp8 instructions (what the fp8 kernels' inline asm uses) against torch:
``cvt.rn.f16x2.e4m3x2`` / ``.e5m2x2`` over all 65536 byte pairs' 256 values per lane (exact
conversions: every fp8 value is an fp16 value), the ``mov.b32 {lo, hi}`` unpack / pack of an
inline-asm block, ``cvt.f32.f16`` / ``cvt.f32.bf16`` and ``prmt.b32``, run by the interpreter
from a hand-written kernel (no compiler needed)."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_interp  # noqa: E402

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# thread t: x = src[t]; out[4 t ..] = (cvt of x's bytes (0, 1), of bytes (2, 3), f32 of the
# first f16, prmt(x, y = src[t] ^ 0x5a5a5a5a, selector))
KERNEL = """
.visible .entry k(.param .u64 p_src, .param .u64 p_out)
{{
    .reg .b32 %r<20>;
    .reg .b64 %rd<8>;
    .reg .f32 %f<4>;
    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.b32 %r2, [%rd4];
    // begin inline asm
    {{ .reg .b16 l, h; mov.b32 {{l, h}}, %r2; cvt.rn.f16x2.{kind}x2 %r3, l; cvt.rn.f16x2.{kind}x2 %r4, h; }}
    // end inline asm
    {{ .reg .b16 a, b; .reg .f32 fa; mov.b32 {{a, b}}, %r3; cvt.f32.f16 fa, a; mov.b32 %r5, fa;
       mov.b32 %r9, {{b, a}}; }}
    xor.b32 %r6, %r2, 1515870810;
    prmt.b32 %r7, %r2, %r6, {sel};
    mul.wide.u32 %rd5, %r1, 24;
    add.s64 %rd6, %rd2, %rd5;
    st.global.v4.b32 [%rd6], {{%r3, %r4, %r5, %r7}};
    st.global.b32 [%rd6+16], %r9;
    ret;
}}
"""


def _run(kind: str, words: np.ndarray, sel: int) -> np.ndarray:
    mem = ptx_interp.Memory()
    out = np.zeros((len(words), 6), dtype=np.uint32)
    src_base, out_base = mem.add(words), mem.add(out)
    params = [src_base.to_bytes(8, "little"), out_base.to_bytes(8, "little")]
    cta = ptx_interp.CTA(KERNEL.format(kind=kind, sel=hex(sel)), params, mem, len(words))
    cta.run()
    return out


def _f16_bits_of(kind: str, b: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(b.astype(np.uint8)).view(TORCH_FP8[kind]).to(torch.float16)
    return t.view(torch.int16).numpy().astype(np.uint16)


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_pair_conversion_all_bytes(kind):
    rng = np.random.default_rng()
    b = np.arange(256, dtype=np.uint32)
    # every byte value in each of the 4 byte lanes (the other lanes random)
    rand = rng.integers(0, 2**32, (4, 256), dtype=np.uint64).astype(np.uint32)
    keep = [np.uint32(0xFFFFFFFF ^ (0xFF << (8 * i))) for i in range(4)]
    words = np.concatenate([(rand[i] & keep[i]) | (b << (8 * i)) for i in range(4)]).astype(np.uint32)
    sel = 0x7351
    out = _run(kind, words, sel)
    lanes = [(words >> (8 * i)) & 0xFF for i in range(4)]
    got = [out[:, 0] & 0xFFFF, out[:, 0] >> 16, out[:, 1] & 0xFFFF, out[:, 1] >> 16]
    for lane, g in zip(lanes, got):
        want = _f16_bits_of(kind, lane)
        g16 = g.astype(np.uint16)
        wf, gf = want.view(np.float16), g16.view(np.float16)
        nan = np.isnan(wf)
        assert np.array_equal(np.isnan(gf), nan)  # e4m3: only S.1111.111; e5m2: exponent 31, mantissa != 0
        assert np.array_equal(g16[~nan], want[~nan])  # bit-exact, signed zeros and e5m2's infinities included
    if kind == "e4m3":
        assert np.isnan(_f16_bits_of(kind, np.array([0x7F, 0xFF])).view(np.float16)).all()
        assert _f16_bits_of(kind, np.array([0x7E])).view(np.float16)[0] == 448.0
    # cvt.f32.f16 of the low half, the pack in the swapped order
    want_f = (out[:, 0] & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    got_f = out[:, 2].view(np.float32)
    assert np.array_equal(np.isnan(got_f), np.isnan(want_f))
    assert np.array_equal(got_f[~np.isnan(want_f)], want_f[~np.isnan(want_f)])
    assert np.array_equal(out[:, 4], ((out[:, 0] & 0xFFFF) << 16) | (out[:, 0] >> 16))
    # prmt: selector nibbles 1, 5, 3, 7 -> a.b1, b.b1, a.b3, b.b3
    y = words ^ 0x5A5A5A5A
    want_p = ((words >> 8) & 0xFF) | (((y >> 8) & 0xFF) << 8) | (((words >> 24) & 0xFF) << 16) | ((y >> 24) << 24)
    assert np.array_equal(out[:, 3], want_p)


def test_prmt_sign_replicate_and_fp8_helper_selector():
    assert ptx_interp.prmt(0x80402010, 0, 0x3120) == 0x80204010  # kernels/fp8.py's interleave
    assert ptx_interp.prmt(0x80402010, 0x01020304, 0x000B) == 0x101010FF  # nibble 0xB: a.b3's sign; 0: a.b0
    assert ptx_interp.prmt(0x00000000, 0xFFEEDDCC, 0x7654) == 0xFFEEDDCC


def test_fp8_values_match_torch():
    for kind, tdt in TORCH_FP8.items():
        b = torch.arange(256, dtype=torch.uint8)
        want = b.view(tdt).to(torch.float32).tolist()
        got = [ptx_interp.fp8_to_f32(i, kind) for i in range(256)]
        for w, g in zip(want, got):
            assert (np.isnan(w) and np.isnan(g)) or w == g
