"""2^x on the FMA pipe, to take work off the MUFU unit.

Hopper's MUFU (``ex2``, ``tanh``, ``rcp``) issues 16 results per clock per SM, an eighth of the
FP32 pipe.  Plain softmax needs one MUFU op per score; soft-capping (``tanh``) or a sigmoid
(``rcp``) doubles that, and then MUFU, not the tensor cores, bounds the kernel (hd128: one
score costs ~0.135 tensor-core clocks and two MUFU ops cost 0.125).  ``exp2_fma`` computes 2^x
with a range reduction and a degree-3 polynomial (8 FP32/INT ops, no MUFU), so a kernel can
send part of its exponentials there.

Accuracy: relative error < 7.6e-5 over the whole range (a minimax fit of 2^f on [-1/2, 1/2]),
far below the bf16 rounding of the probabilities that feed P·V.  x <= -126 (and -inf, NaN)
gives exactly 0 -- a masked score must contribute nothing, not 2^-126 -- and x >= 127 gives
2^127 (so 1 / (1 + 2^x) still underflows to 0 for a sigmoid).  11 instructions.
"""
from __future__ import annotations

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# minimax coefficients of 2^f, f in [-1/2, 1/2] (c0 + c1 f + c2 f^2 + c3 f^3), as f32 hex
_C0, _C1, _C2, _C3 = "0f3F7FFB48", "0f3F317975", "0f3E786F3E", "0f3D620402"

# Written as one PTX block: the rounding trick (t = x + 1.5 * 2^23 leaves round(x) in t's low
# mantissa bits) must not be re-associated away by fast-math, and ptxas keeps PTX arithmetic as
# written.  2^round(x) is applied by adding round(x) << 23 to the polynomial's exponent bits;
# below x = -126 that addition would wrap into the sign bit, hence the final select.
_PTX = f"""{{
.reg .f32 xc, t, r, f, p;
.reg .b32 ti, pb;
.reg .pred big;
min.ftz.f32 xc, $1, 0f42FE0000;
add.rn.ftz.f32 t, xc, 0f4B400000;
sub.rn.ftz.f32 r, t, 0f4B400000;
sub.rn.ftz.f32 f, xc, r;
fma.rn.ftz.f32 p, f, {_C3}, {_C2};
fma.rn.ftz.f32 p, p, f, {_C1};
fma.rn.ftz.f32 p, p, f, {_C0};
mov.b32 ti, t;
shl.b32 ti, ti, 23;
mov.b32 pb, p;
add.s32 pb, pb, ti;
setp.gt.ftz.f32 big, $1, 0fC2FC0000;
selp.b32 $0, pb, 0, big;
}}"""


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None) -> Float32:
    """2^x without the MUFU unit (see the module docstring for range and accuracy)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _PTX, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
