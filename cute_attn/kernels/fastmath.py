"""2^x on the FMA pipe, for softmaxes whose multi-function unit (MUFU) is the bottleneck
(the prefill kernel's ``exp_emu`` knob: how many of every 8 score columns use it).

Hopper's MUFU issues 16 results per clock per SM.  In the prefill softmax each score costs one
MUFU.EX2 -- half the tensor cores' time per block at head_dim 128 -- and a soft-cap adds a
MUFU.TANH per score, which makes the MUFU exactly as busy as the tensor cores (run 9: 1.19x the
plain kernel's time).  Packed ``ex2.approx.f16x2`` does not help: ptxas splits it into two
MUFU.EX2.F16 (checked in SASS).  So a share of the exponentials is computed here, with FADD /
FFMA / integer ops only (the idea FA4 uses on Blackwell; the code and coefficients are ours):

    t = max(x, -127);  n = floor(t);  f = t - n in [0, 1)
    2^t = 2^n * p(f),  p(f) = 1 + c1 f + c2 f^2 + c3 f^3

``floor`` is one FADD rounding down: adding 1.5 * 2^23 leaves n in the sum's low mantissa bits,
and ``2^n * p`` is ``p``'s bit pattern plus ``n << 23`` (the exponent field).  p's coefficients
minimize the maximum relative error on [0, 1) (Lawson's iteration, constrained to p(0) = 1);
it is 8.6e-5, far below a bf16 / fp16 probability's rounding (2e-3 / 2.4e-4).  x = -inf (a
masked score) gives t = -127, n = -127, f = 0, p = 1 exactly: the bits 0x3F800000 - (127 <<
23) = 0, i.e. +0.0 exactly, as MUFU.EX2 gives.  Nothing larger than 2^0 is ever asked for
(x = s - max <= 0), so no overflow handling.  9 instructions instead of one MUFU issue.
"""
from __future__ import annotations

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

# p(f) = 1 + C1 f + C2 f^2 + C3 f^3 ~ 2^f on [0, 1), max relative error 8.6e-5 (fp32 Horner)
C1, C2, C3 = 0.69511679, 0.22764498, 0.07706706


def _hex(v: float) -> str:
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


_EXP2_PTX = (
    "{\n"
    " .reg .f32 t, j, n, f, p;\n"
    " .reg .b32 pb, jb;\n"
    " max.f32 t, $1, 0fC2FE0000;\n"          # t = max(x, -127)
    " add.rm.f32 j, t, 0f4B400000;\n"        # j = 1.5 * 2^23 + floor(t)
    " sub.f32 n, j, 0f4B400000;\n"           # n = floor(t)
    " sub.f32 f, t, n;\n"                    # f in [0, 1)
    f" fma.rn.f32 p, f, {_hex(C3)}, {_hex(C2)};\n"
    f" fma.rn.f32 p, p, f, {_hex(C1)};\n"
    " fma.rn.f32 p, p, f, 0f3F800000;\n"     # p(f) = 1 + f (C1 + f (C2 + f C3))
    " mov.b32 jb, j;\n"
    " shl.b32 jb, jb, 23;\n"                 # floor(t) << 23 (the low 9 bits of j's mantissa)
    " mov.b32 pb, p;\n"
    " add.s32 pb, pb, jb;\n"                 # p's exponent + floor(t)
    " mov.b32 $0, pb;\n"
    "}"
)


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 0 (also -inf -> +0.0) without the MUFU; relative error < 1e-4."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)], _EXP2_PTX, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))
