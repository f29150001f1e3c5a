"""The shared-memory addresses the MLA kernel's ``ldmatrix`` reads, checked without a GPU.

The first MLA kernel read the wrong bytes on the H200 (relative error ~1): ``local_tile`` of a
swizzled tile at a runtime column offset inside a 64-wide swizzle atom (warp w's k16 step
16 (w + 4 i)) is lowered by the DSL (4.8.1) with the offset applied twice, inside the XOR
swizzle and again to the address.  Nothing on the CPU computed those addresses.

Here small probe kernels run the kernel's own tile helpers (``MlaDecode._q_tiles`` /
``_k_tiles`` / ``_v_tile`` / ``_load_pe_step``) and copies (``warp_copies``) for one warp, with
the group, the warp index and the stage as runtime parameters, exactly as the kernel forms
them; their PTX is executed per lane by a small integer interpreter, and the set of 16-byte
rows the ``ldmatrix`` instructions address must be exactly the rows the warp should read, by
``smem_off`` (the layout the copies write, itself checked against the tile layouts at trace
time).  A wrong offset, a missing or duplicated row shows as a set difference."""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.compile

MASK32 = (1 << 32) - 1


def _probe(kind: str, tile_q: int, stages: int) -> str:
    """The PTX of a one-warp probe of ``kind`` ("q", "k", "v"): ``tests/mla_probe_kernels.py``
    (imports the DSL, so only here)."""
    import mla_probe_kernels

    return mla_probe_kernels.probe_ptx(kind, tile_q, stages)


# ---- a tiny PTX interpreter: integer ops, predicates, branches; records ldmatrix addresses ----
def _body(ptx: str) -> list:
    start = ptx.index("{", ptx.index(".entry"))
    lines = []
    for raw in ptx[start + 1 :].splitlines():
        ln = raw.split("//")[0].strip()
        if not ln or ln.startswith(".reg") or ln in ("{", "}"):
            continue
        lines.append(ln)
    return lines


def _val(tok: str, regs: dict, params: dict):
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    if tok == "%tid.x":
        return regs["__lane"]
    if tok in ("%tid.y", "%tid.z", "%ctaid.x", "%ctaid.y", "%ctaid.z"):
        return 0
    if re.fullmatch(r"-?\d+", tok):
        return int(tok) & MASK32
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", tok):
        return int(tok, 16)
    if "shmem" in tok or tok.startswith("__"):
        return 0  # the shared-memory window's base
    raise KeyError(tok)


def _s32(x):
    x &= MASK32
    return x - (1 << 32) if x >> 31 else x


def run_lane(lines: list, lane: int, params: list) -> list:
    """Execute the probe for one lane; the addresses (bytes, relative to shared memory) of the
    rows it gives each ldmatrix, in program order."""
    regs = {"__lane": lane}
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if ln.endswith(":")}
    out, pc, steps = [], 0, 0
    while pc < len(lines):
        steps += 1
        assert steps < 100000, "runaway probe"
        ln = lines[pc]
        pc += 1
        if ln.endswith(":"):
            continue
        pred = None
        m = re.match(r"@(!?)(%p\d+)\s+(.*)", ln)
        if m:
            neg, p, ln = m.group(1), m.group(2), m.group(3)
            pred = (not regs[p]) if neg else bool(regs[p])
            if not pred:
                continue
        ln = ln.rstrip(";")
        op, _, rest = ln.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)] if rest else []
        base = op.split(".")[0]
        if base == "ret" or base == "exit":
            break
        if base == "bra":
            pc = labels[args[0]]
            continue
        if base == "ld" and ".param" in op:
            idx = int(re.search(r"param_(\d+)", args[1]).group(1))
            regs[args[0]] = params[idx]
            continue
        if base == "ldmatrix":
            addr = re.match(r"\[(%r\d+)(?:\+(-?\d+))?\]", args[1])
            out.append((regs[addr.group(1)] + int(addr.group(2) or 0)) & MASK32)
            continue
        if base in ("st", "bar", "membar", "fence"):
            continue
        d = args[0]
        v = [_val(a, regs, {}) for a in args[1:]]
        ty = op.split(".")[-1]
        if base == "mov" or base == "cvt":
            r = v[0]
        elif base == "shfl":
            r = v[0]  # the probes shuffle only warp-uniform values (the shared base)
        elif base == "add":
            r = v[0] + v[1]
        elif base == "sub":
            r = v[0] - v[1]
        elif base == "mul":
            r = (v[0] & MASK32) * (v[1] & MASK32) if ".wide" in op else v[0] * v[1]
        elif base == "mad":
            r = v[0] * v[1] + v[2]
        elif base == "shl":
            r = v[0] << (v[1] & 31)
        elif base == "shr":
            r = (_s32(v[0]) >> (v[1] & 31)) if ty == "s32" else ((v[0] & MASK32) >> (v[1] & 31))
        elif base == "and":
            r = v[0] & v[1]
        elif base == "or":
            r = v[0] | v[1]
        elif base == "xor":
            r = v[0] ^ v[1]
        elif base == "not":
            r = ~v[0]
        elif base == "selp":
            r = v[0] if v[2] else v[1]
        elif base == "setp":
            cmp = op.split(".")[1]
            a, b = (_s32(v[0]), _s32(v[1])) if ty == "s32" else (v[0] & MASK32, v[1] & MASK32)
            r = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[cmp]
        elif base in ("min", "max"):
            a, b = _s32(v[0]), _s32(v[1])
            r = min(a, b) if base == "min" else max(a, b)
        else:
            raise NotImplementedError(f"probe interpreter: {ln}")
        regs[d] = r if isinstance(r, bool) else (r & ((1 << 64) - 1) if ty.endswith("64") else r & MASK32)
    return out


def _blocks(kind, tile_q, grp, wg, stage, q_base):
    """The 16-byte rows each ldmatrix of the warp should address, in program order: Q, its 8
    ckv k16 steps then its kpe step (16 rows x 2 chunks each); K of S, per step its keys 0-15 then
    16-31; V, per 16 keys its 8 column blocks of 16 (16 keys x 2 chunks each)."""
    from cute_attn.kernels.mla_decode import smem_off

    def chunks(c0):
        return [(c // 8, c % 8) for c in (c0, c0 + 1)]

    steps = [chunks(16 * wg + 2 * i) for i in range(8)] + [chunks(64 + 2 * wg)]
    out = []
    if kind == "q":
        for ch in steps:
            out.append(Counter(q_base + 2 * smem_off(16 * grp + r, j, t, 0, tile_q) for r in range(16) for j, t in ch))
    elif kind == "k":
        for ch in steps:
            for h in range(2):
                out.append(Counter(2 * smem_off(16 * h + n, j, t, stage, 32) for n in range(16) for j, t in ch))
    else:
        for k in range(2):
            for nb in range(8):
                ch = chunks(16 * wg + 2 * nb)
                out.append(Counter(2 * smem_off(16 * k + n, j, t, stage, 32) for n in range(16) for j, t in ch))
    return out


@pytest.mark.parametrize("tile_q,stages", [(16, 5), (32, 4)])
@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_ldmatrix_reads_the_warps_rows(kind, tile_q, stages):
    """Each ldmatrix addresses exactly one of the blocks the warp should read, in program order
    (a step read at the wrong columns, or Q step i against K step j, would fail)."""
    from cute_attn.kernels.mla_decode import BLOCK_N, D_QK

    lines = _body(_probe(kind, tile_q, stages))
    q_base = -(-BLOCK_N * D_QK * stages * 2 // 1024) * 1024  # sQ follows the ring, 1024-aligned
    for grp in range(tile_q // 16) if kind == "q" else [0]:
        for wg in range(4):
            for stage in [0, stages - 1] if kind != "q" else [0]:
                per_lane = [run_lane(lines, lane, [0, grp, wg, stage]) for lane in range(32)]
                want = _blocks(kind, tile_q, grp, wg, stage, q_base)
                assert all(len(a) == len(want) for a in per_lane), (kind, [len(a) for a in per_lane][:4], len(want))
                for i, block in enumerate(want):
                    got = Counter(a[i] for a in per_lane)
                    assert got == block, (kind, grp, wg, stage, i, sorted((got - block).items())[:4],
                                          sorted((block - got).items())[:4])  # fmt: skip
