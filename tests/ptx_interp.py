"""A small PTX interpreter: runs one CTA of a compiled kernel on the CPU, thread by thread.

Written to check kernels this project cannot run (no GPU on the development machine) at the
level of the code the DSL emits: it executes the PTX text of ``kernel.ptx`` with the kernel's
real arguments (the packed ``{ptr, extents, strides}`` structs), global memory backed by the
tensors' bytes and a shared-memory array, and the warp-wide instructions (``mma.sync``,
``ldmatrix``, ``shfl.sync``) and ``bar.sync`` executed when every thread that takes part has
reached them (a named barrier, ``bar.sync ID, COUNT``, when COUNT threads have waited at it or
passed it with ``bar.arrive``).  ``cp.async`` copies land at the ``cp.async.wait_group`` that covers their group
(not at issue), so a read of a stage before its wait sees stale bytes, as it could on a GPU.

Only the instructions the MLA, the portable prefill and the kept-plan update kernels use are
implemented (an unknown one raises); floats are fp32 with exact ``ex2`` / ``lg2`` / ``rcp`` / ``tanh`` standing in for
the approximate ones.  Slow (pure
Python, ~1 us an instruction and thread): for small problems only."""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field

import numpy as np

M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(np.float32(x))))[0]


def bf16_to_f32(h: int) -> float:
    return f32((h & 0xFFFF) << 16)


def f16_to_f32(h: int) -> float:
    return float(np.array([h & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def f32_to_bf16(x: float) -> int:
    b = bits32(x)
    if (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF):
        return 0x7FC0
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def f32_to_f16(x: float) -> int:
    return int(np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0])


def fp8_to_f32(b: int, kind: str) -> float:
    """An e4m3 (no infinities, NaN = S.1111.111) or e5m2 (IEEE-like) byte's value."""
    b &= 0xFF
    sign = -1.0 if b >> 7 else 1.0
    mbits, bias = (3, 7) if kind == "e4m3" else (2, 15)
    e, m = (b & 0x7F) >> mbits, b & ((1 << mbits) - 1)
    emax = (1 << (7 - mbits)) - 1
    if kind == "e4m3" and e == emax and m == (1 << mbits) - 1:
        return math.nan
    if kind == "e5m2" and e == emax:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - mbits)
    return sign * math.ldexp((1 << mbits) + m, e - bias - mbits)


def prmt(a: int, b: int, sel: int) -> int:
    """``prmt.b32`` (default mode): byte i of the result is byte ``sel`` nibble i (bits 2:0) of
    {b, a} (a = bytes 0-3, b = 4-7), sign-replicated when the nibble's bit 3 is set."""
    src = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def s32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x >> 31 else x


def s64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


@dataclass
class Ins:
    pred: str | None
    neg: bool
    op: str
    args: list
    parts: tuple = ()  # op split at '.', made once (the interpreter runs each instruction ~1e5 times)
    base: str = ""

    def __post_init__(self):
        self.parts = tuple(self.op.split("."))
        self.base = self.parts[0]


def _split_args(rest: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse(ptx: str):
    """(parameter names in order with their sizes, instructions, labels) of the one ``.entry``."""
    head = ptx.index(".entry")
    open_p = ptx.index("(", head)
    close_p = ptx.index(")", open_p)
    params = []
    for ln in ptx[open_p + 1 : close_p].split(","):
        ln = ln.strip()
        if not ln:
            continue
        m = re.search(r"\.b8\s+(\S+)\[(\d+)\]", ln)
        if m:
            params.append((m.group(1), int(m.group(2))))
        else:
            m = re.search(r"\.(u32|s32|b32|f32|u64|b64)\s+(\S+)", ln)
            params.append((m.group(2), 8 if m.group(1).endswith("64") else 4))
    body = ptx[ptx.index("{", close_p) + 1 :]
    text = "\n".join(raw.split("//")[0] for raw in body.splitlines())
    prog, labels = [], {}
    # statements end with ';' (an instruction may span lines); a label ends with ':'
    for stmt in re.split(r";", text):
        # an inline-asm block's closing brace may stand before the next label
        stmt = stmt.strip().lstrip("{} ").strip()
        while True:  # labels before the statement
            m = re.match(r"(\$?[\w$]+):\s*(.*)", stmt, re.S)
            if not m or m.group(1).startswith("%"):
                break
            labels[m.group(1)] = len(prog)
            stmt = m.group(2).strip()
        stmt = " ".join(stmt.split())
        # an inline-asm block's braces (``{ .reg .b16 l, h; ...; }``) around its statements:
        # its registers are plain names, held in the thread's registers like the others
        stmt = stmt.lstrip("{} ").strip()
        if not stmt or stmt.startswith("."):
            continue
        pred, neg = None, False
        m = re.match(r"@(!?)(%p\d+)\s+(.*)", stmt)
        if m:
            neg, pred, stmt = m.group(1) == "!", m.group(2), m.group(3)
        op, _, rest = stmt.partition(" ")
        prog.append(Ins(pred, neg, op.strip(), _split_args(rest.strip())))
    return params, prog, labels


class Memory:
    """Global memory: numpy byte arrays at fake base addresses."""

    def __init__(self):
        self.regions = []  # (base, bytearray view)
        self._next = 1 << 32

    def add(self, arr: np.ndarray) -> int:
        buf = arr.view(np.uint8).reshape(-1)
        base = self._next
        self._next += ((buf.size + 4095) // 4096 + 1) * 4096
        self.regions.append((base, buf))
        return base

    def _find(self, addr: int, n: int):
        for base, buf in self.regions:
            if base <= addr and addr + n <= base + buf.size:
                return buf, addr - base
        raise IndexError(f"global access at {addr:#x} (+{n}) outside every tensor")

    def read(self, addr: int, n: int) -> bytes:
        buf, o = self._find(addr, n)
        return bytes(buf[o : o + n])

    def write(self, addr: int, data: bytes) -> None:
        buf, o = self._find(addr, len(data))
        buf[o : o + len(data)] = np.frombuffer(data, dtype=np.uint8)


@dataclass
class Thread:
    tid: int
    regs: dict = field(default_factory=dict)
    pc: int = 0
    done: bool = False
    waiting: str | None = None  # "bar" or "warp" (a warp-wide instruction)
    bar: tuple = (0, None)  # the barrier it waits at: (id, thread count; None: the whole CTA)
    groups: list = field(default_factory=list)  # committed cp.async groups (lists of copies)
    pending: list = field(default_factory=list)  # copies issued since the last commit


_LITERALS: dict = {}  # literal operand token -> its value


class CTA:
    """One CTA of the kernel: ``run()`` executes it to completion."""

    def __init__(self, ptx: str, param_bytes: list, mem: Memory, nthreads: int, ctaid: int = 0, smem_bytes: int = 0,
                 order: str = "forward", grid: int = 1):  # fmt: skip
        self.params, self.prog, self.labels = parse(ptx)
        assert len(param_bytes) == len(self.params), (len(param_bytes), len(self.params))
        self.param_data = {name: data for (name, _), data in zip(self.params, param_bytes)}
        for (name, size), data in zip(self.params, param_bytes):
            assert len(data) == size, (name, size, len(data))
        self.mem = mem
        self.smem = bytearray(smem_bytes or 232448)
        self.threads = [Thread(t) for t in range(nthreads)]
        self.ctaid, self.grid = ctaid, grid
        self.executed = 0
        self.arrived: dict = {}  # barrier id -> threads that arrived (bar.arrive) and did not wait
        self.arrived_total = 0  # bar.arrive executed, by thread
        # the order threads run in between synchronizations: a kernel whose warps race (one
        # writes what another reads with no barrier between) gives different results in the
        # forward and the reverse order
        self.order = self.threads if order == "forward" else self.threads[::-1]

    # ---- operands ----
    def val(self, th: Thread, tok: str) -> int:
        r = th.regs.get(tok)
        if r is not None:
            return r
        r = _LITERALS.get(tok)
        if r is not None:
            return r
        tok = tok.strip()
        r = th.regs.get(tok)
        if r is not None:
            return r
        if tok.startswith("%"):
            special = {"%tid.x": th.tid, "%tid.y": 0, "%tid.z": 0, "%ctaid.x": self.ctaid, "%ctaid.y": 0,
                       "%ctaid.z": 0, "%ntid.x": len(self.threads), "%laneid": th.tid % 32, "%nctaid.x": self.grid,
                       "%nctaid.y": 1, "%nctaid.z": 1}  # fmt: skip
            if tok in special:
                return special[tok]
            if re.fullmatch(r"%[a-z]+\d+", tok):
                return 0  # read before written: only in dead code paths of the interpreter
            raise KeyError(tok)
        if tok.startswith("0f") and len(tok) == 10:
            r = int(tok[2:], 16)
        elif tok.startswith("0d") and len(tok) == 18:
            r = int(tok[2:], 16)
        elif re.fullmatch(r"-?\d+", tok):
            r = int(tok)
        elif re.fullmatch(r"-?0[xX][0-9a-fA-F]+", tok):
            r = int(tok, 16)
        elif tok == "__dynamic_shmem__0":
            r = 0
        else:
            raise KeyError(tok)
        _LITERALS[tok] = r  # a literal's value, whatever the thread
        return r

    def addr(self, th: Thread, tok: str):
        inner = tok.strip()[1:-1]
        m = re.match(r"([^+\-]+)([+\-]\d+)?$", inner)
        base, off = m.group(1).strip(), int(m.group(2) or 0)
        if base in self.param_data:
            return ("param", base, off)
        return self.val(th, base) + off

    def regs_of(self, tok: str) -> list:
        return [t.strip() for t in tok.strip()[1:-1].split(",")]

    # ---- execution ----
    def run(self, max_steps: int = 50_000_000) -> None:
        while True:
            progressed = False
            for th in self.order:
                if not th.done and th.waiting is None:
                    self._run_thread(th)
                    progressed = True
            live = [t for t in self.threads if not t.done]
            if not live:
                return
            if self._release_barriers(live):
                continue
            released = False
            for w in range(0, len(self.threads), 32):
                lanes = [t for t in self.threads[w : w + 32] if not t.done]
                if lanes and all(t.waiting == "warp" for t in lanes):
                    pcs = {t.pc for t in lanes}
                    assert len(pcs) == 1, f"warp {w // 32} diverged at a warp-wide instruction: {pcs}"
                    assert len(lanes) == 32, "a warp-wide instruction with exited lanes"
                    self._warp_op(lanes, self.prog[lanes[0].pc])
                    for t in lanes:
                        t.waiting = None
                        t.pc += 1
                    released = True
            if not released and not progressed:
                raise RuntimeError("deadlock: " + str(sorted({(t.waiting, t.pc) for t in live})[:8]))
            if self.executed > max_steps:
                raise RuntimeError("step limit")

    def _release_barriers(self, live: list) -> bool:
        """Let the threads at each barrier go once it is complete: a CTA-wide ``bar.sync``
        (no count) when every live thread waits there, ``bar.sync ID, COUNT`` when its waiting
        threads and the arrivals (``bar.arrive``) since it last completed make COUNT."""
        at: dict = {}
        for t in live:
            if t.waiting == "bar":
                at.setdefault(t.bar[0], []).append(t)
        done = False
        for bid, ths in at.items():
            counts = {t.bar[1] for t in ths}
            assert len(counts) == 1, f"barrier {bid} waited on with thread counts {counts}"
            count = counts.pop()
            if count is None:
                if len(ths) < len(live):
                    continue
            else:
                assert count % 32 == 0, f"barrier {bid}: a thread count of {count}, not whole warps"
                arrived = self.arrived.get(bid, 0)
                if len(ths) + arrived < count:
                    continue
                assert len(ths) <= count, f"barrier {bid}: {len(ths)} threads wait for a count of {count}"
                self.arrived[bid] = arrived - (count - len(ths))
            for t in ths:
                t.waiting = None
                t.pc += 1
            done = True
        return done

    def _run_thread(self, th: Thread) -> None:
        prog = self.prog
        while True:
            ins = prog[th.pc]
            self.executed += 1
            if ins.pred is not None:
                p = th.regs.get(ins.pred, 0)
                if bool(p) == ins.neg:
                    th.pc += 1
                    continue
            base = ins.base
            if base in ("mma", "ldmatrix", "shfl", "vote"):
                th.waiting = "warp"
                return
            if ins.op.startswith("bar.warp"):  # bar.warp.sync: the warp's lanes run to each warp-wide op together
                th.pc += 1
                continue
            if base == "bar":  # bar.sync ID[, COUNT] waits; bar.arrive ID, COUNT counts and goes on
                bid = self.val(th, ins.args[0])
                count = self.val(th, ins.args[1]) if len(ins.args) > 1 else None
                if ins.parts[1] == "arrive":
                    assert count is not None, "bar.arrive without a thread count"
                    self.arrived[bid] = self.arrived.get(bid, 0) + 1
                    self.arrived_total += 1
                    th.pc += 1
                    continue
                assert ins.parts[1] == "sync", ins.op
                th.waiting, th.bar = "bar", (bid, count)
                return
            if base in ("ret", "exit"):
                th.done = True
                return
            if base == "bra":
                th.pc = self.labels[ins.args[0]]
                continue
            self._exec(th, ins, base)
            th.pc += 1

    def _exec(self, th: Thread, ins: Ins, base: str) -> None:  # noqa: C901 (one dispatch)
        op, a = ins.op, ins.args
        parts = ins.parts
        ty = parts[-1]
        R = th.regs
        if base == "ld":
            space = parts[1]
            vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            width = {"b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "b16": 2, "u16": 2, "u8": 1,
                     "b8": 1}[ty]  # fmt: skip
            where = self.addr(th, a[1])
            dsts = self.regs_of(a[0]) if vec > 1 else [a[0]]
            if space == "param":
                _, name, off = where
                data = self.param_data[name][off : off + width * vec]
            elif space == "shared":
                data = bytes(self.smem[where : where + width * vec])
            elif space == "global":
                data = self.mem.read(where, width * vec)
            else:
                raise NotImplementedError(op)
            for i, d in enumerate(dsts):
                R[d] = int.from_bytes(data[i * width : (i + 1) * width], "little")
            return
        if base in ("atom", "red") and "add" in parts and ty in ("u32", "s32"):
            # threads run one at a time between synchronizations: a read-modify-write is atomic
            dst, where, v = (None, a[0], a[1]) if base == "red" else (a[0], a[1], a[2])
            addr = self.addr(th, where)
            shared = "shared" in parts or any(p.startswith("shared") for p in parts)
            old = int.from_bytes(bytes(self.smem[addr : addr + 4]) if shared else self.mem.read(addr, 4), "little")
            new = ((old + self.val(th, v)) & M32).to_bytes(4, "little")
            if shared:
                self.smem[addr : addr + 4] = new
            else:
                self.mem.write(addr, new)
            if dst is not None:
                R[dst] = old
            return
        if base == "st":
            space = parts[1]
            vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            width = {"b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "b16": 2, "u16": 2, "b8": 1,
                     "u8": 1}[ty]  # fmt: skip
            where = self.addr(th, a[0])
            srcs = self.regs_of(a[1]) if vec > 1 else [a[1]]
            data = b"".join((self.val(th, s) & ((1 << (8 * width)) - 1)).to_bytes(width, "little") for s in srcs)
            if space == "shared":
                self.smem[where : where + len(data)] = data
            elif space == "global":
                self.mem.write(where, data)
            else:
                raise NotImplementedError(op)
            return
        if base == "cp":
            if parts[1] == "async":
                if parts[2] == "commit_group":
                    th.groups.append(th.pending)
                    th.pending = []
                elif parts[2] == "wait_group":
                    keep = int(a[0])
                    while len(th.groups) > keep:
                        for dst, data in th.groups.pop(0):
                            self.smem[dst : dst + len(data)] = data
                elif parts[2] == "wait_all":
                    for g in th.groups + [th.pending]:
                        for dst, data in g:
                            self.smem[dst : dst + len(data)] = data
                    th.groups, th.pending = [], []
                else:  # cp.async.cg.shared.global [dst], [src], 16, 16
                    dst, src, n = self.addr(th, a[0]), self.addr(th, a[1]), int(a[2])
                    th.pending.append((dst, self.mem.read(src, n)))
                return
            raise NotImplementedError(op)
        if base in ("griddepcontrol", "membar", "fence", "prefetch"):
            return
        d = a[0]
        if "|" in d:
            d = d.split("|")[0]
        v = [0 if x.startswith("{") else self.val(th, x) for x in a[1:]]  # a {lo, hi} pack: by mov
        if ty == "f32" and base not in ("cvt", "setp", "selp", "mov"):
            x = [f32(t) for t in v]
            if base == "add":
                r = np.float32(x[0]) + np.float32(x[1])
            elif base == "sub":
                r = np.float32(x[0]) - np.float32(x[1])
            elif base == "mul":
                r = np.float32(x[0]) * np.float32(x[1])
            elif base == "fma":
                r = np.float32(np.float64(x[0]) * np.float64(x[1]) + np.float64(x[2]))
            elif base == "max":
                r = x[1] if math.isnan(x[0]) else x[0] if math.isnan(x[1]) else max(x[0], x[1])
            elif base == "min":
                r = x[1] if math.isnan(x[0]) else x[0] if math.isnan(x[1]) else min(x[0], x[1])
            elif base == "ex2":
                r = 2.0 ** x[0] if x[0] < 128 else math.inf
            elif base == "lg2":
                r = math.log2(x[0]) if x[0] > 0 else (-math.inf if x[0] == 0 else math.nan)
            elif base == "rcp":
                r = 1.0 / x[0] if x[0] != 0 else math.inf
            elif base == "tanh":
                r = math.tanh(x[0])
            elif base == "div":
                with np.errstate(divide="ignore", invalid="ignore"):
                    r = np.float32(x[0]) / np.float32(x[1])
            elif base == "neg":
                r = -x[0]
            elif base == "abs":
                r = abs(x[0])
            else:
                raise NotImplementedError(op)
            R[d] = bits32(r)
            return
        if base == "mov":
            if a[0].startswith("{"):  # unpack: mov.b32 {lo, hi}, x (16-bit halves, low first)
                halves = self.regs_of(a[0])
                w = 64 // len(halves) if ty == "b64" else 32 // len(halves)
                for i, h in enumerate(halves):
                    R[h] = (v[0] >> (w * i)) & ((1 << w) - 1)
            elif a[1].startswith("{"):  # pack: mov.b32 x, {lo, hi}
                halves = self.regs_of(a[1])
                w = 64 // len(halves) if ty == "b64" else 32 // len(halves)
                R[d] = sum((self.val(th, h) & ((1 << w) - 1)) << (w * i) for i, h in enumerate(halves))
            else:
                R[d] = v[0]
            return
        if base == "prmt":
            if len(parts) > 2:
                raise NotImplementedError(op)  # the .f4e / .b4e / .rc8 / .ecl / .ecr / .rc16 modes
            R[d] = prmt(v[0], v[1], v[2])
            return
        if base == "setp":
            cmp = parts[1]
            if ty == "f32":
                x, y = f32(v[0]), f32(v[1])
                unordered = math.isnan(x) or math.isnan(y)
                core = cmp.rstrip("u") if cmp not in ("eq", "ne", "lt", "le", "gt", "ge") else cmp
                res = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y}[core]
                res = (res or unordered) if cmp.endswith("u") and cmp not in ("eq", "ne", "lt", "le", "gt", "ge") \
                    else (res and not unordered)  # fmt: skip
            else:
                bits = int(re.sub(r"\D", "", ty) or 32)
                if ty[0] == "s":
                    sx = (lambda t: s64(t)) if bits == 64 else (lambda t: s32(t) if bits == 32 else _sext(t, bits))
                    x, y = sx(v[0]), sx(v[1])
                else:
                    x, y = v[0] & ((1 << bits) - 1), v[1] & ((1 << bits) - 1)
                res = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y,
                       "lo": x < y, "ls": x <= y, "hi": x > y, "hs": x >= y}[cmp]  # fmt: skip
            R[d] = int(res)
            return
        if base == "selp":
            R[d] = v[0] if v[2] else v[1]
            return
        if base in ("and", "or", "xor", "not") and ty == "pred":
            R[d] = int({"and": lambda: v[0] and v[1], "or": lambda: v[0] or v[1], "xor": lambda: v[0] != v[1],
                        "not": lambda: not v[0]}[base]())  # fmt: skip
            return
        if base == "cvt":
            self._cvt(th, parts, d, v[0] if len(v) == 1 else v)
            return
        bits = 64 if ty.endswith("64") else 16 if ty.endswith("16") else 32
        mask = (1 << bits) - 1
        sx = s64 if bits == 64 else (s32 if bits == 32 else lambda t: _sext(t, 16))
        signed = ty[0] == "s"
        if base == "add":
            r = v[0] + v[1]
        elif base == "sub":
            r = v[0] - v[1]
        elif base == "mul":
            if parts[1] == "wide":
                x, y = (sx(v[0]), sx(v[1])) if signed else (v[0] & mask, v[1] & mask)
                R[d] = (x * y) & (M64 if bits == 32 else M32)
                return
            x, y = (sx(v[0]), sx(v[1])) if signed else (v[0] & mask, v[1] & mask)
            r = (x * y) >> bits if parts[1] == "hi" else x * y
        elif base == "mad":
            x, y = (sx(v[0]), sx(v[1])) if signed else (v[0] & mask, v[1] & mask)
            if parts[1] == "wide":
                R[d] = (x * y + v[2]) & M64
                return
            r = (x * y) >> bits if parts[1] == "hi" else x * y
            r += v[2]
        elif base == "shl":
            r = (v[0] << min(v[1] & 0xFF, bits)) if (v[1] & 0xFF) < bits else 0
        elif base == "shr":
            n = v[1] & 0xFF
            r = (sx(v[0]) >> min(n, bits - 1)) if signed else ((v[0] & mask) >> n if n < bits else 0)
        elif base == "and":
            r = v[0] & v[1]
        elif base == "or":
            r = v[0] | v[1]
        elif base == "xor":
            r = v[0] ^ v[1]
        elif base == "not":
            r = ~v[0]
        elif base == "neg":
            r = -v[0]
        elif base == "abs":
            r = abs(sx(v[0]))
        elif base in ("min", "max"):
            x, y = (sx(v[0]), sx(v[1])) if signed else (v[0] & mask, v[1] & mask)
            r = min(x, y) if base == "min" else max(x, y)
            if "relu" in parts:
                r = max(r, 0)
        elif base in ("div", "rem"):
            x, y = (sx(v[0]), sx(v[1])) if signed else (v[0] & mask, v[1] & mask)
            q = int(x / y) if signed else x // y  # C semantics: truncation toward zero
            r = q if base == "div" else x - q * y
        else:
            raise NotImplementedError(op)
        R[d] = r & mask

    def _cvt(self, th: Thread, parts, d, v) -> None:
        R = th.regs
        if parts[-1] in ("e4m3x2", "e5m2x2"):  # cvt.rn.f16x2.e4m3x2 d, a (b16): exact, byte 1 -> d.hi
            if parts[-2] != "f16x2":
                raise NotImplementedError(".".join(parts))
            kind = parts[-1][:4]
            lo, hi = (f32_to_f16(fp8_to_f32(v >> (8 * i), kind)) for i in range(2))
            R[d] = (hi << 16) | lo
            return
        if parts[1] == "rn" and parts[2] in ("bf16x2", "f16x2"):  # d.hi = cvt(a), d.lo = cvt(b)
            conv = f32_to_bf16 if parts[2] == "bf16x2" else f32_to_f16
            R[d] = (conv(f32(v[0])) << 16) | conv(f32(v[1]))
            return
        types = [p for p in parts[1:] if re.fullmatch(r"(bf|[subf])\d+", p)]
        dst_t, src_t = types[0], types[1]
        x = v
        if src_t[0] == "s":
            x = _sext(x, int(src_t[1:]))
        elif src_t[0] in "ub":
            x &= (1 << int(src_t[1:])) - 1
        elif src_t == "f32":
            x = f32(x)
        elif src_t in ("f16", "bf16"):
            x = (f16_to_f32 if src_t == "f16" else bf16_to_f32)(x)
        if dst_t == "f32":
            R[d] = bits32(float(x))
        elif dst_t[0] in "subf":
            if isinstance(x, float):
                x = int(x)
            R[d] = x & ((1 << int(dst_t[1:])) - 1)

    # ---- warp-wide instructions ----
    def _warp_op(self, lanes, ins: Ins) -> None:
        base = ins.base
        if base == "shfl":
            self._shfl(lanes, ins)
        elif base == "vote":
            self._vote(lanes, ins)
        elif base == "ldmatrix":
            self._ldmatrix(lanes, ins)
        else:
            self._mma(lanes, ins)

    def _shfl(self, lanes, ins: Ins) -> None:
        mode = ins.parts[2]
        d = ins.args[0].split("|")[0]
        vals = [self.val(t, ins.args[1]) for t in lanes]
        bs = [self.val(t, ins.args[2]) for t in lanes]
        for i, t in enumerate(lanes):
            src = {"bfly": i ^ bs[i], "idx": bs[i] & 31, "up": i - bs[i], "down": i + bs[i]}[mode]
            t.regs[d] = vals[src] if 0 <= src < 32 else vals[i]

    def _vote(self, lanes, ins: Ins) -> None:
        mode = ins.parts[2]  # vote.sync.any.pred d, p, membermask
        d = ins.args[0]
        ps = [bool(self.val(t, ins.args[1].lstrip("!"))) != ins.args[1].startswith("!") for t in lanes]
        res = {"any": any(ps), "all": all(ps), "uni": len(set(ps)) == 1}[mode]
        for t in lanes:
            t.regs[d] = int(res)

    def _ldmatrix(self, lanes, ins: Ins) -> None:
        trans = ".trans" in ins.op
        num = int(re.search(r"\.x(\d)", ins.op).group(1))
        addrs = [self.addr(t, ins.args[1]) for t in lanes]
        mats = []
        for m in range(num):
            rows = []
            for r in range(8):
                a = addrs[8 * m + r]
                rows.append(struct.unpack("<8H", bytes(self.smem[a : a + 16])))
            mats.append(rows)
        dsts = self.regs_of(ins.args[0])
        for i, t in enumerate(lanes):
            for m in range(num):
                rows = mats[m]
                if not trans:
                    lo, hi = rows[i >> 2][2 * (i & 3)], rows[i >> 2][2 * (i & 3) + 1]
                else:
                    lo, hi = rows[2 * (i & 3)][i >> 2], rows[2 * (i & 3) + 1][i >> 2]
                t.regs[dsts[m]] = lo | (hi << 16)

    def _mma(self, lanes, ins: Ins) -> None:
        parts = ins.parts
        shape = parts[3]
        assert shape == "m16n8k16", ins.op
        in_t = parts[7]
        conv = bf16_to_f32 if in_t == "bf16" else f16_to_f32
        D, A, B, C = (self.regs_of(x) for x in ins.args)
        Am = np.zeros((16, 16), np.float32)
        Bm = np.zeros((16, 8), np.float32)
        Cm = np.zeros((16, 8), np.float32)
        for i, t in enumerate(lanes):
            g, q = i >> 2, i & 3
            av = [self.val(t, x) for x in A]
            for r, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
                Am[row, col], Am[row, col + 1] = conv(av[r]), conv(av[r] >> 16)
            bv = [self.val(t, x) for x in B]
            for r, k in enumerate([2 * q, 2 * q + 8]):
                Bm[k, g], Bm[k + 1, g] = conv(bv[r]), conv(bv[r] >> 16)
            cv = [f32(self.val(t, x)) for x in C]
            Cm[g, 2 * q], Cm[g, 2 * q + 1], Cm[g + 8, 2 * q], Cm[g + 8, 2 * q + 1] = cv
        Dm = (Am.astype(np.float64) @ Bm.astype(np.float64) + Cm).astype(np.float32)
        for i, t in enumerate(lanes):
            g, q = i >> 2, i & 3
            for reg, (row, col) in zip(D, [(g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1)]):
                t.regs[reg] = bits32(Dm[row, col])


def _sext(x: int, bits: int) -> int:
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


def pack_params(abi, tensors, mem: Memory, bases: dict) -> list:
    """The kernel's parameter bytes for ``abi`` (``cute_attn.abi.args`` descriptors) and the
    values: per tensor ``{ptr; int32 dynamic extents; pad to 8; int64 dynamic strides}``,
    scalars as 4 bytes.  ``bases``: id(tensor) -> its address in ``mem``."""
    from cute_attn.abi.args import TensorArg

    out = []
    for a, t in zip(abi, tensors):
        if isinstance(a, TensorArg):
            data = struct.pack("<Q", bases[id(t)])
            data += b"".join(struct.pack("<i", t.shape[k]) for k in a.dyn_shape_modes)
            data += b"\0" * ((-len(data)) % 8)
            data += b"".join(struct.pack("<q", t.stride()[k]) for k in a.dyn_stride_modes)
            out.append(data)
        elif a.dtype == "f32":
            out.append(struct.pack("<f", float(t)))
        else:
            out.append(struct.pack("<i", int(t)))
    return out
