"""Bitmap masks (a variant's ``mask_bits``) tested in registers.

A row's visibility bits start at an arbitrary bit of a uint8 tensor (or of an int32 one: the same
bytes as words, fewer loads).  Per row and block, a thread loads the bytes / words covering its
keys once and shifts them into 32-bit words, bit j of word k =
the key at column ``col0 + 32k + j`` of the block (``col0``: the thread's first column).  A
thread's columns sit at static offsets from ``col0`` (the MMA accumulator layout), so each
score's test is one AND with a constant and one compare, where a per-score byte load costs an
address computation, a load and its latency.
"""

from __future__ import annotations

import cutlass
from cutlass import Uint32


def load_words(bits, start, span: int) -> list:
    """Bits ``start .. start + span - 1`` of ``bits`` (little bit order; a uint8 tensor, or a
    32-bit one holding the same bytes as little-endian words) as ``ceil(span / 32)`` Uint32
    words.  Reads are clamped to the tensor: what lies past it could only hold keys past the
    row's end, which kernels mask by their bounds anyway.  Words take ``ceil(span / 32) + 1``
    loads; bytes ``ceil(span / 8) + 1`` and the shifts that assemble them."""
    nwords = (span + 31) // 32
    last = bits.shape[0] - 1
    if bits.element_type.width == 32:
        w0, sh = start // 32, (start % 32).to(Uint32)
        raw = [bits[cutlass.min(w0 + k, last)].to(Uint32) for k in range(nwords + 1)]
    else:
        nbytes = (7 + span + 7) // 8
        b0, sh = start // 8, (start % 8).to(Uint32)
        by = [bits[cutlass.min(b0 + i, last)].to(Uint32) for i in range(nbytes)]
        raw = []
        for k in range(nwords + 1):
            w = Uint32(0)
            for j in range(4):
                if 4 * k + j < nbytes:
                    w = w | (by[4 * k + j] << Uint32(8 * j))
            raw.append(w)
    # funnel shift right by sh (0..31); the second term is written so that sh = 0 shifts by 32 safely
    return [(raw[k] >> sh) | ((raw[k + 1] << Uint32(1)) << (Uint32(31) - sh)) for k in range(nwords)]


def row_words(bits: list, blk, tScS, col_off) -> list:
    """Per ``mask_bits`` component of a row ((tensor, bit offset of the row's key 0) pairs):
    the bits of this thread's keys of the block at key ``blk`` as ``load_words``' words
    (``tScS[0, 0][1]``: the thread's first column; ``col_off``: its columns' static offsets)."""
    return [load_words(t, off + blk + tScS[0, 0][1], col_off[-1] + 1) for t, off in bits]


def bit_set(words: list, off: int):
    """Whether bit ``off`` (a Python int) of ``load_words``' result is 1."""
    return (words[off // 32] & Uint32(1 << (off % 32))) != Uint32(0)
