"""16-byte global -> shared copies that ask L2 to fetch the whole 128-byte line.

``cp.async.cg.shared.global.L2::128B``: the prefetch-size hint of PTX (SASS ``LDGSTS...LTC128B``).
ptxas adds it to some plain ``cp.async`` on its own and not to others, and the difference is
bandwidth: the decode gather lost it when a restructure moved its copies into a helper, and
the same kernel read 3-8 % slower on the H200.  Kernels that gather rows issue their
copies through :func:`cp_async_16` so the hint does not depend on the compiler's mood.
"""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def cp_async_16(smem_addr, gmem_addr, *, loc=None, ip=None) -> None:
    """Copy 16 bytes from global byte address ``gmem_addr`` (Int64) to shared byte address
    ``smem_addr`` (Int32, shared window; both 16-byte aligned), asynchronously (cp.async group
    semantics: commit / wait_group as for ``cute.copy`` with a ``CopyG2SOp``)."""
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
        "cp.async.cg.shared.global.L2::128B [$0], [$1], 16, 16;",
        "r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
