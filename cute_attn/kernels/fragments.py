"""Register fragments of the attention kernels' MMAs: views of an accumulator as (rows,
columns) and as the A operand of the next MMA (P = softmax(S) feeding P V from registers), and
the reductions over the four threads that share an accumulator row.

Two MMA families: ``mma.sync`` m16n8k16 (decode, any arch: ``mma_*``) and Hopper's
``wgmma`` (prefill: ``wgmma_*``).  In both, a row of a thread's accumulator is spread over the
4 threads of a quad (lanes 4i .. 4i+3), hence ``quad_max`` / ``quad_sum``.

``pin_fragment`` fixes where a fragment is computed (see there).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

WG = 128  # threads per warpgroup (wgmma's unit)


@cute.jit
def quad_max(v: Float32) -> Float32:
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2))
    return cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1))


@cute.jit
def quad_sum(v: Float32) -> Float32:
    v = v + cute.arch.shuffle_sync_bfly(v, offset=2)
    return v + cute.arch.shuffle_sync_bfly(v, offset=1)


def mma_mn_view(t: cute.Tensor) -> cute.Tensor:
    """View an m16n8 accumulator partition ((2 cols, 2 rows), M, N) as (rows, cols)."""
    l = cute.make_layout(t.layout.shape)
    mn = cute.make_layout(
        ((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[2])),
        stride=((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


@cute.jit
def lazy_rescale(O: cute.Tensor, corr: cute.Tensor):
    """O (rows, cols) *= corr per row, skipped where no row of the warp moved its max: with a
    lazily raised max (the portable prefill's softmax) most blocks leave every corr at 1."""
    moved = corr[0] != Float32(1.0)
    for r in cutlass.range_constexpr(1, cute.size(corr)):
        moved = moved | (corr[r] != Float32(1.0))
    if cute.arch.vote_any_sync(moved):
        for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                O[r, c] = O[r, c] * corr[r]


def mma_acc_as_a(t: cute.Tensor) -> cute.Tensor:
    """Reuse an m16n8 accumulator fragment (4, M, N) as the A operand of m16n8k16:
    two adjacent n8 tiles form one k16 step -> ((4, 2), M, N/2)."""
    d = cute.logical_divide(t.layout, (None, None, 2))
    a = cute.make_layout(
        ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
        stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]),
    )
    return cute.make_tensor(t.iterator, a)


def wgmma_mn_view(t: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator partition ((2 cols, 2 rows, N/8), M, N) as (rows, cols)."""
    l = cute.make_layout(t.layout.shape)
    s, d = l.shape, l.stride
    mn = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])), stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def wgmma_acc_as_a(l):
    """wgmma accumulator *layout* ((2,2,N/8), M, N) -> the layout of the A operand of the next
    wgmma from registers (a layout, where ``mma_acc_as_a`` takes and returns a tensor),
    ((2,2,2), M, (N/16, N)): two adjacent n8 column groups form one k16 step."""
    d = cute.logical_divide(l, ((None, None, 2), None, None))
    return cute.make_layout(
        ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], (d.shape[0][2][1], d.shape[2])),
        stride=((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1], (d.stride[0][2][1], d.stride[2])),
    )


@dsl_user_op
def _pinned(x, *, loc=None, ip=None) -> Int32:
    """x through an empty asm with side effects: x must exist here, and stays the same value."""
    res = llvm.inline_asm(
        T.i32(),
        [Int32(x).ir_value(loc=loc, ip=ip)],
        "",
        "=r,0",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(res)


@cute.jit
def pin_fragment(frag: cute.Tensor):
    """Make every 32-bit word of a register fragment be computed at this point of the program.

    Why: a conversion such as P = S.to(bf16) at the end of a block is pure, so LLVM sinks it to
    its first use -- the next block's P V, issued *after* that block's Q K^T.  S's old fp32
    values then stay live while the next Q K^T writes its accumulator, and ptxas, short of
    registers for both, serializes every wgmma (C7512): the Hopper prefill needed 256 registers
    for 128-key blocks with the sunk conversion and 192 with it pinned.  An empty asm with side
    effects per word is not moved across the wgmma issue (itself such an asm) and emits no
    instruction."""
    words = cute.recast_tensor(frag, Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = _pinned(words[i])
