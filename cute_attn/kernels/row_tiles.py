"""Shared tiles of 16-bit rows under the XOR swizzle of 16-byte chunks, as the ``mma.sync``
kernels (decode, the portable prefill, their fp8 forms) lay them out: a (rows, width, n) tile
is atom columns of ``atom_w(width)`` elements, each column ``rows`` atom rows deep, so the
``cp.async`` gather and ``ldmatrix`` compute addresses themselves (``smem_off``), checked
against the CuTe layout at trace time (``check_smem_off``)."""

from __future__ import annotations

import cutlass.cute as cute


def atom_w(width: int) -> int:
    """16-bit elements per atom row of a tile ``width`` elements wide: 64 (128 B), 32 (64 B:
    fp8 rows at head dim 64, hd96's 192 B rows) or 16 (32 B: hd80's 160 B rows)."""
    return 64 if width % 64 == 0 else 32 if width % 32 == 0 else 16


def swizzle_atom(width: int):
    """The 8-row atom of a shared tile: 128 B rows under the 128-byte swizzle (XOR of the
    16-byte chunk with the row mod 8), 64 B rows under the 64-byte one (chunk XOR (row / 2)
    mod 4), 32 B rows under the 32-byte one (chunk XOR (row / 4) mod 2); each way ldmatrix's 8
    rows of one chunk hit 8 different bank groups."""
    aw = atom_w(width)
    bits = {64: 3, 32: 2, 16: 1}[aw]
    return cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, aw), stride=(aw, 1)))


def smem_off(r, c, s, rows: int, width: int):
    """Element offset of row r, 16-byte chunk c, slice s of a (rows, width, n) tile in the
    layout of ``swizzle_atom``: cpa chunks per atom row, the XOR phase advancing every 8 / cpa
    rows."""
    aw = atom_w(width)
    cpa = aw // 8
    phase = r if cpa == 8 else r // (8 // cpa)
    return s * (rows * width) + (c // cpa) * (rows * aw) + r * aw + ((c % cpa) ^ (phase % cpa)) * 8


def check_smem_off(layout, rows: int, width: int):
    """Trace time: ``smem_off`` agrees with the layout's own offsets (crd2idx applies this
    swizzle to element offsets, which is right here: it is declared on elements)."""
    for r in range(rows):
        for c in range(width // 8):
            for s in range(min(2, cute.size(layout, mode=[2]))):
                want = cute.crd2idx((r, c * 8, s), layout)
                got = smem_off(r, c, s, rows, width)
                if want != got:
                    raise AssertionError(f"smem_off({r}, {c}, {s}) = {got}, layout {want}")
