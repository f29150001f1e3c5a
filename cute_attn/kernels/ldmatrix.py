"""``ldmatrix`` by address, for kernels that compute their own shared-memory offsets (a byte
tile read as 16-bit pairs, whose layout no DSL copy partition describes)."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def ldmatrix_x4(addr, trans: bool = False, *, loc=None, ip=None):
    """``ldmatrix.x4`` of 8 x 8 16-bit matrices: this lane gives the shared byte address of row
    ``lane % 8`` of matrix ``lane / 8``; returns the lane's register of each matrix (an fp8
    tile is read as 16-bit pairs: 4 bytes per register)."""
    ty = llvm.StructType.get_literal([T.i32()] * 4)
    op = "ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"
    res = llvm.inline_asm(
        ty,
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        op + " {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]
