"""fp8 -> fp16 conversions on 32-bit registers, for kernels that read an fp8 cache and multiply
in fp16 on the tensor cores.

Every e4m3 and e5m2 value is exactly an fp16 value (fp16 has more exponent range and mantissa
than either), so the MMA on converted values is exact in its inputs; ``cvt.rn.f16x2.e4m3x2``
(sm_89+, one SASS instruction) converts two at a time.  The helpers take 4 bytes as one Int32
(what a 32-bit ``ldmatrix`` / shared load gives) and return two Int32 of f16x2 pairs; the pair
conversions between fp16 and bf16 go through fp32.  No side
effects are declared, so ptxas schedules them freely with the surrounding code.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_CVT = {"e4m3": "cvt.rn.f16x2.e4m3x2", "e5m2": "cvt.rn.f16x2.e5m2x2"}


def fp8_kind(dsl_type) -> str:
    """``"e4m3"`` or ``"e5m2"`` of a DSL fp8 type."""
    name = dsl_type.__name__
    if "E4M3" in name:
        return "e4m3"
    if "E5M2" in name:
        return "e5m2"
    raise ValueError(f"not an fp8 type: {name}")


def _two_out(asm: str, args, loc, ip):
    ty = llvm.StructType.get_literal([T.i32(), T.i32()])
    res = llvm.inline_asm(
        ty,
        [Int32(a).ir_value(loc=loc, ip=ip) for a in args],
        asm,
        "=r,=r" + ",r" * len(args),
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    lo = llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)
    hi = llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


@dsl_user_op
def fp8x4_to_f16x4(x, kind: str, *, loc=None, ip=None):
    """Bytes (b0, b1, b2, b3) of ``x`` -> (f16x2 (b0, b1), f16x2 (b2, b3)), low half first."""
    cvt = _CVT[kind]
    asm = f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $2; {cvt} $0, l; {cvt} $1, h; }}"
    return _two_out(asm, [x], loc, ip)


@dsl_user_op
def fp8x4_to_f16x4_interleaved(x, kind: str, *, loc=None, ip=None):
    """Bytes (b0, b1, b2, b3) of ``x`` -> (f16x2 (b0, b2), f16x2 (b1, b3)): the transposing
    ldmatrix of an fp8 tile seen as 16-bit pairs gives a thread (row 2j: b0 b1, row 2j+1:
    b2 b3), and the MMA wants each column's two rows in one register."""
    cvt = _CVT[kind]
    asm = (
        f"{{ .reg .b32 t; .reg .b16 l, h; prmt.b32 t, $2, 0, 0x3120; mov.b32 {{l, h}}, t; {cvt} $0, l; {cvt} $1, h; }}"
    )
    return _two_out(asm, [x], loc, ip)


# fp8 -> bf16 by integer ops and one bf16 multiply (``fp8x4_to_bf16x4``): the byte's bits shifted
# into a bf16's (shift, mask: sign, then exponent and mantissa) and the exponent bias difference
# as a factor (2^120 for e4m3: bf16's bias 127 - e4m3's 7; 2^112 for e5m2)
_BF16_WIDEN = {"e4m3": (4, 0x87F087F0, 0x7B807B80), "e5m2": (5, 0x8FE08FE0, 0x77807780)}


@dsl_user_op
def fp8x4_to_bf16x4(x, kind: str, *, loc=None, ip=None):
    """Bytes (b0, b1, b2, b3) of ``x`` -> (bf16x2 (b0, b1), bf16x2 (b2, b3)), low half first,
    without conversion instructions: ``prmt`` sign-extends each byte into a 16-bit lane, a shift
    and a mask leave sign | exponent | mantissa in bf16's places, and one ``mul.rn.bf16x2`` by
    2^(127 - bias) rescales -- exact for every finite value (bf16's subnormals carry e4m3's and
    e5m2's).  NaN and Inf bytes come out finite (e4m3 NaN as +-480; e5m2 Inf / NaN as +-2^16 ..
    +-1.75 x 2^16).  Why: ``cvt`` (F2FP) conversions run on the pipe the softmax's exponentials
    use, and a kernel that widens K and V next to the softmax cannot spare it."""
    shift, mask, factor = _BF16_WIDEN[kind]
    asm = (
        "{ .reg .b32 a, b, f; "
        "prmt.b32 a, $2, 0, 0x9180; prmt.b32 b, $2, 0, 0xB3A2; "
        f"shl.b32 a, a, {shift}; shl.b32 b, b, {shift}; "
        f"and.b32 a, a, {mask:#x}; and.b32 b, b, {mask:#x}; "
        f"mov.b32 f, {factor:#x}; mul.rn.bf16x2 $0, a, f; mul.rn.bf16x2 $1, b, f; }}"
    )
    return _two_out(asm, [x], loc, ip)


# what ``fp8x4_to_bf16x4_exact`` ORs into a bf16 lane whose byte has an all-ones exponent (per
# format: the exponent field of that byte, the bias step that makes its sign bit the carry, the
# bf16 bits): e4m3's NaN (S.1111.111) -> NaN; e5m2's Inf (S.11111.00) -> Inf, NaN -> NaN
_BF16_SPECIAL = {"e4m3": (0x7F7F7F7F, 0x01010101, 0x7FC07FC0), "e5m2": (0x7C7C7C7C, 0x04040404, 0x7F807F80)}


@dsl_user_op
def fp8x4_to_bf16x4_exact(x, kind: str, *, loc=None, ip=None):
    """``fp8x4_to_bf16x4`` that keeps NaN and Inf, as ``cvt`` does, still without conversion
    instructions: a byte whose exponent bits are all ones (``(b & E) + step`` sets its bit 7,
    no carry out of the byte) has its lane's exponent forced to all ones -- the widened
    mantissa then says Inf (zero) or NaN -- by a sign-replicating ``prmt`` mask and an OR."""
    shift, mask, factor = _BF16_WIDEN[kind]
    field, step, special = _BF16_SPECIAL[kind]
    asm = (
        "{ .reg .b32 a, b, f, t, ma, mb; "
        "prmt.b32 a, $2, 0, 0x9180; prmt.b32 b, $2, 0, 0xB3A2; "
        f"shl.b32 a, a, {shift}; shl.b32 b, b, {shift}; "
        f"and.b32 a, a, {mask:#x}; and.b32 b, b, {mask:#x}; "
        f"mov.b32 f, {factor:#x}; mul.rn.bf16x2 a, a, f; mul.rn.bf16x2 b, b, f; "
        f"and.b32 t, $2, {field:#x}; add.u32 t, t, {step:#x}; "
        "prmt.b32 ma, t, 0, 0x9988; prmt.b32 mb, t, 0, 0xBBAA; "
        f"and.b32 ma, ma, {special:#x}; and.b32 mb, mb, {special:#x}; "
        "or.b32 $0, a, ma; or.b32 $1, b, mb; }"
    )
    return _two_out(asm, [x], loc, ip)


def _one_out(asm: str, x, loc, ip) -> Int32:
    res = llvm.inline_asm(
        T.i32(),
        [Int32(x).ir_value(loc=loc, ip=ip)],
        asm,
        "=r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(res)


@dsl_user_op
def bf16x2_to_f16x2(x, *, loc=None, ip=None) -> Int32:
    """A bf16 pair -> the fp16 pair nearest to it (through fp32; fp16 overflows past 65504)."""
    asm = (
        "{ .reg .b32 lo, hi; .reg .f32 flo, fhi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xffff0000; "
        "mov.b32 flo, lo; mov.b32 fhi, hi; cvt.rn.f16x2.f32 $0, fhi, flo; }"
    )
    return _one_out(asm, x, loc, ip)


@dsl_user_op
def f16x2_to_bf16x2(x, *, loc=None, ip=None) -> Int32:
    """An fp16 pair -> the bf16 pair of the same values (through fp32; exact for the values of
    an fp8 cache, which bf16 holds exactly)."""
    asm = (
        "{ .reg .b16 l, h; .reg .f32 fl, fh; mov.b32 {l, h}, $1; cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; "
        "cvt.rn.bf16x2.f32 $0, fh, fl; }"
    )
    return _one_out(asm, x, loc, ip)


@dsl_user_op
def ld_shared_v2(addr, *, loc=None, ip=None):
    """8 bytes at shared byte address ``addr`` (8-byte aligned) as two Int32."""
    ty = llvm.StructType.get_literal([T.i32(), T.i32()])
    res = llvm.inline_asm(
        ty,
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v2.b32 {$0, $1}, [$2];",
        "=r,=r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    lo = llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)
    hi = llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)
    return Int32(lo), Int32(hi)
