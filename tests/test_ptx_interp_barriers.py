"""tests/ptx_interp.py's named barriers (``bar.sync ID, COUNT`` / ``bar.arrive ID, COUNT``: what
a kernel with warp groups taking turns, FA3's ping-pong, synchronizes with), run by the
interpreter from hand-written kernels (no compiler needed), in both thread orders."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ptx_interp  # noqa: E402

# Two groups of 2 warps take ROUNDS turns each, group 0 first: a turn waits at the group's
# barrier (2 + g: its own 64 threads plus the other group's 64 arrivals), its leader appends
# g + 1 to a log in shared memory, and the group arrives at the other's barrier.  Then one
# CTA-wide barrier and threads 0..7 copy the log out.
PING_PONG = """
.visible .entry k(.param .u64 p_out)
{{
    .reg .b32 %r<20>;
    .reg .b64 %rd<4>;
    .reg .pred %p<4>;
    ld.param.u64 %rd1, [p_out];
    mov.u32 %r1, %tid.x;
    shr.u32 %r2, %r1, 6;
    and.b32 %r3, %r1, 63;
    setp.eq.u32 %p1, %r2, 1;
    setp.eq.u32 %p2, %r3, 0;
    add.u32 %r4, %r2, 2;
    sub.u32 %r5, 3, %r2;
    add.u32 %r12, %r2, 1;
    @%p1 bar.arrive 2, 128;
    mov.u32 %r6, 0;
$LOOP:
    bar.sync %r4, 128;
    @%p2 ld.shared.u32 %r7, [256];
    @%p2 shl.b32 %r8, %r7, 2;
    @%p2 st.shared.u32 [%r8], %r12;
    @%p2 add.u32 %r9, %r7, 1;
    @%p2 st.shared.u32 [256], %r9;
    bar.arrive %r5, 128;
    add.u32 %r6, %r6, 1;
    setp.lt.u32 %p3, %r6, {rounds};
    @%p3 bra $LOOP;
    bar.sync 0;
    setp.lt.u32 %p3, %r1, 8;
    shl.b32 %r10, %r1, 2;
    @%p3 ld.shared.u32 %r11, [%r10];
    cvt.u64.u32 %rd2, %r10;
    add.s64 %rd3, %rd1, %rd2;
    @%p3 st.global.u32 [%rd3], %r11;
    ret;
}}
"""

# Group 0 passes a barrier of its own twice (1, 64 threads), writes 22 after writing 11, and
# arrives at barrier 2, where group 1 waits (128 threads) before thread 64 copies the value out:
# 22 only if group 0's barrier held group 0 alone.
GROUP_LOCAL = """
.visible .entry k(.param .u64 p_out)
{
    .reg .b32 %r<8>;
    .reg .b64 %rd<2>;
    .reg .pred %p<4>;
    ld.param.u64 %rd1, [p_out];
    mov.u32 %r1, %tid.x;
    setp.eq.u32 %p2, %r1, 0;
    setp.eq.u32 %p3, %r1, 64;
    setp.ge.u32 %p1, %r1, 64;
    @%p1 bra $CONSUMER;
    bar.sync 1, 64;
    mov.u32 %r2, 11;
    @%p2 st.shared.u32 [0], %r2;
    bar.sync 1, 64;
    mov.u32 %r2, 22;
    @%p2 st.shared.u32 [0], %r2;
    bar.arrive 2, 128;
    ret;
$CONSUMER:
    bar.sync 2, 128;
    ld.shared.u32 %r3, [0];
    @%p3 st.global.u32 [%rd1], %r3;
    ret;
}
"""

# Group 0 waits at barrier 1 for 128 threads; nobody else arrives there.
NEVER_COMPLETE = """
.visible .entry k(.param .u64 p_out)
{
    .reg .b32 %r<4>;
    .reg .pred %p<2>;
    mov.u32 %r1, %tid.x;
    setp.lt.u32 %p1, %r1, 64;
    @%p1 bar.sync 1, 128;
    ret;
}
"""


def _run(ptx: str, order: str) -> np.ndarray:
    mem = ptx_interp.Memory()
    out = np.full(8, 0xFFFFFFFF, dtype=np.uint32)
    base = mem.add(out)
    ptx_interp.CTA(ptx, [base.to_bytes(8, "little")], mem, 128, order=order, smem_bytes=512).run()
    return out


@pytest.mark.parametrize("order", ["forward", "reverse"])
@pytest.mark.parametrize("rounds", [1, 3])
def test_groups_take_turns(order, rounds):
    got = _run(PING_PONG.format(rounds=rounds), order)
    want = [1, 2] * rounds + [0] * (8 - 2 * rounds)
    assert got.tolist() == want


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_a_group_barrier_holds_its_group_alone(order):
    assert _run(GROUP_LOCAL, order)[0] == 22


def test_incomplete_named_barrier_is_a_deadlock():
    with pytest.raises(RuntimeError, match="deadlock"):
        _run(NEVER_COMPLETE, "forward")
