"""The online softmax of the Hopper prefill kernel's consumer warpgroups (``prefill_sm90.py``),
in registers on a wgmma accumulator: per block, the masks that cut it (item end, causal
diagonal, window, a variant's mask), the logits (soft-cap or a variant's), the block max and
the rescale of the running sum; the O rescale is left to the caller (O may still be in use by
a wgmma) and skipped while no row's max moved by more than ``LAZY_RESCALE``.

A mixin of ``BatchPrefillSm90``: its methods read the kernel's configuration from ``self``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .fragments import pin_fragment, quad_max, wgmma_mn_view
from .work import ItemInfo, TraceCtx, item_row_values, row_token

LAZY_RESCALE = 8.0  # base-2 units a row's block max may exceed its kept max by before O is rescaled
FIXED_SHIFT_MAX_SCALE = 82.0  # soft-cap: the largest cap·log2 e taking the fixed shift (_running_max)


class SoftmaxState(NamedTuple):
    """A consumer thread's online-softmax state of its rows: running max (S's units), partial
    sum, and the factor O must be rescaled by after the last block."""

    row_m: Any
    row_l: Any
    corr: Any


class ItemRows(NamedTuple):
    """A consumer thread's rows of the item: score coordinates (``tScS``), the rows' query
    positions, the tile's first / last row's position, the item's kv end and the variant's
    per-row values (``work.item_row_values``; None without per-row hooks)."""

    tScS: Any
    q_pos: Any
    q_lo: Any
    q_hi: Any
    kv_end: Any
    vals: Any


class WgMma(NamedTuple):
    """A consumer thread's GEMMs and their operand fragments (Q per buffer, K / V per stage)
    and its score coordinates (``n_rows`` rows per thread)."""

    mma_qk: Any
    mma_pv: Any
    tSrQ: Any
    tSrK: Any
    tOrV: Any
    tScS: Any
    n_rows: int


class WgAcc(NamedTuple):
    """A consumer thread's accumulators: S, P (``rP``, and its A-operand view ``tOrP``), O, the
    running softmax state ``st`` and ``done``, the statistics of the item whose epilogue is next."""

    acc_S: Any
    rP: Any
    tOrP: Any
    acc_O: Any
    st: Any
    done: Any


class PrefillSoftmax:
    """Masked / mask-free online softmax of one block (see the module docstring)."""

    @cute.jit
    def _item_rows(self, info: ItemInfo, tScS, n_rows, tc: TraceCtx) -> ItemRows:
        """Per-row query positions (bottom-right aligned causal / window) of a thread's rows."""
        q_pos = cute.make_rmem_tensor((n_rows,), Int32)
        for r in cutlass.range_constexpr(n_rows):
            q_pos[r] = info.qpos_base + row_token(info, info.row_start + tScS[r, 0][0])
        q_lo = info.qpos_base + row_token(info, info.row_start)
        q_hi = info.qpos_base + row_token(info, info.row_start + info.num_rows - 1)
        row_vals = None
        if const_expr(self.hooks.per_row):
            row_vals = item_row_values(self.hooks, info, tc, tScS, n_rows, self.head_dim)
        return ItemRows(tScS, q_pos, q_lo, q_hi, info.kv_end, row_vals)

    @cute.jit
    def _mask_softmax(self, acc_S, st: SoftmaxState, rows: ItemRows, blk, words, tc):
        """Masked softmax only where some key of the block may be invisible to some row of the
        tile (the partial last block, the causal diagonal, the window's left edge)."""
        q_lo, q_hi, kv_end, window_left = rows.q_lo, rows.q_hi, rows.kv_end, tc.window_left
        corr = st.corr
        need_mask = blk + self.tile_n > kv_end
        if const_expr(self.causal):
            need_mask = need_mask | (blk + self.tile_n - 1 > q_lo)
        if const_expr(self.window):
            need_mask = need_mask | (blk < q_hi - window_left)
        # a variant mask / range masks every block per element; the bounds (item end, causal,
        # window) only where they cut the block
        if const_expr(self.hooks.bits_only):
            # the variant masks by bitmaps alone: where a warp's bits of the block are all 0 it
            # skips the softmax; where they are all 1 it takes the mask-free path (per warp:
            # rows and columns of one warp share no reduction with another warp)
            none_seen, all_seen = self._bits_uniform(words, tc)
            if none_seen:
                acc_S.fill(0.0)
                corr.fill(1.0)
            elif need_mask:
                self._softmax(acc_S, st, rows, blk, words, tc, True, True)
            elif all_seen:
                self._softmax(acc_S, st, rows, blk, words, tc, False, False)
            else:
                self._softmax(acc_S, st, rows, blk, words, tc, True, False)
        elif need_mask:
            self._softmax(acc_S, st, rows, blk, words, tc, True, True)
        else:
            self._softmax(acc_S, st, rows, blk, words, tc, self.mask_all, False)

    @cute.jit
    def _store_p(self, acc_S, rP):
        """P = S in the value dtype.  With ``pin_p`` the conversion stays here (``pin_fragment``),
        before the next block's QK issue, so S's fp32 registers are free for it: 128-160-key blocks
        keep the wgmmas asynchronous.  Without it LLVM sinks the conversion behind that QK issue
        (off the softmax's critical path, but S live twice), which fits 112 keys at hd128 and
        measured 1.5-3 % faster there on the H200."""
        rP.store(acc_S.load().to(self.dtype))
        if const_expr(self.pin_p):
            pin_fragment(rP)

    @cute.jit
    def _softmax(
        self,
        acc_S,
        st: SoftmaxState,
        rows: ItemRows,
        blk,
        words,
        tc,
        masked: cutlass.Constexpr,
        bounds: cutlass.Constexpr,
    ):
        """Online softmax of one block in place: S -> P = exp2(S * scale - m * scale), l rescaled;
        the factor O must be rescaled by goes to ``corr`` (O may still be in use by a wgmma).
        ``row_m`` is kept in S's units (raw q·k, or the logits after a soft-cap or a variant's
        logits, see ``_row_scale``) so the scale folds into one FFMA per element.  Max and sum
        use 4 partial accumulators per row: one warp runs this alone while the other WG's GEMMs
        run, so its latency chains matter."""
        row_m, row_l, corr = st
        tScS, q_pos, kv_end, window_left = rows.tScS, rows.q_pos, rows.kv_end, tc.window_left
        scale_log2 = tc.scale_log2
        S = wgmma_mn_view(acc_S)
        ncol = cute.size(S, mode=[1])
        scale = self._row_scale(scale_log2)
        H = self.hooks
        kv_f0 = Float32(0.0)
        if const_expr(H.has_logits):
            # the float positions of ctx: a value per block (per row) plus a constant per column
            kv_f0 = (blk + tScS[0, 0][1]).to(Float32)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            if const_expr(self.soft_cap or masked or H.has_logits):
                rel_f0 = Float32(0.0)
                if const_expr(H.has_logits):
                    rel_f0 = kv_f0 - q_pos[r].to(Float32)
                bitmaps = words[r] if masked and words is not None else []
                lim = None
                if const_expr(masked and bounds):
                    lim = self._row_limits(blk + tScS[0, 0][1], kv_end, q_pos[r], window_left)
                for c in cutlass.range_constexpr(ncol):
                    v = S[r, c]
                    kv_pos = blk + tScS[0, c][1]
                    if const_expr(H.has_logits):
                        off = float(tc.col_off[c])
                        v = self._hook_logits(rows.vals[r], tc, kv_pos, v, (kv_f0, off), (rel_f0, off))
                    elif const_expr(self.soft_cap):
                        v = self._logits(v, tc.inv_cap)
                    if const_expr(masked):
                        ok = _col_ok(lim, tc.col_off[c])
                        if const_expr(self.mask_all):
                            ok = self._hook_visible(rows.vals[r], tc, kv_pos, ok)
                        ok = self._mask_bits_ok(bitmaps, c, ok, tc)
                        v = _keep(ok, v, -Float32.inf if H.softmax else Float32(0.0))
                    S[r, c] = v
            if const_expr(not H.softmax):
                corr[r] = Float32(1.0)  # weights as they are (FlashSigmoid): nothing to rescale
            else:
                if const_expr(self.cap_fixed_shift):
                    m_blk = tc.fixed_shift  # soft-cap: a fixed shift (see _running_max)
                    if self._running_max(scale):
                        m_blk = self._block_max(S, r, ncol)
                else:
                    m_blk = self._block_max(S, r, ncol)
                m_new = cute.arch.fmax(row_m[r], m_blk)
                if const_expr(self.lazy_rescale):
                    # keep the running max while the block's exceeds it by at most LAZY_RESCALE
                    # in base 2 (weights <= 2^8): corr is then exactly 1 and O is not rescaled
                    m_new = cutlass.select_((m_blk - row_m[r]) * scale <= Float32(LAZY_RESCALE), row_m[r], m_new)
                m_use = m_new if m_new != -Float32.inf else Float32(0.0)  # a row with nothing visible yet
                m_scaled = m_use * scale
                # (row_m - m_use) first: exactly 0 when the max was kept, so corr is exactly 1
                corr[r] = cute.math.exp2((row_m[r] - m_use) * scale, fastmath=True)
                for c in cutlass.range_constexpr(ncol):
                    S[r, c] = cute.math.exp2(S[r, c] * scale - m_scaled, fastmath=True)
                part = [S[r, c] for c in range(4)]
                for c in cutlass.range_constexpr(4, ncol):
                    part[c % 4] = part[c % 4] + S[r, c]
                row_l[r] = row_l[r] * corr[r] + ((part[0] + part[1]) + (part[2] + part[3]))  # quad-reduced at the end
                row_m[r] = m_new

    def _row_limits(self, kv0, kv_end, q_pos, window_left):
        """A row's item-end / causal / window bounds on the block as column offsets from kv0 (the
        thread's first key): key kv0 + off is visible iff lo <= off < hi (lo None: no window).
        Once per row, so each score costs one compare with its column's constant offset."""
        end = kv_end
        if const_expr(self.causal):
            end = cutlass.min(kv_end, q_pos + 1)
        lo = None
        if const_expr(self.window):
            lo = q_pos - window_left - kv0
        return end - kv0, lo

    def _block_max(self, S, r, ncol):
        """Row r's maximum over the block (4 partial maxima: shorter dependency chains)."""
        part = [S[r, c] for c in range(4)]
        for c in range(4, ncol):  # a plain helper: unrolled at trace time
            part[c % 4] = cute.arch.fmax(part[c % 4], S[r, c])
        return quad_max(cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3])))

    def _running_max(self, scale_log2):
        """Soft-cap: whether the softmax needs a running maximum.  S holds t = tanh values in
        [-1, 1], so it can subtract a fixed shift instead -- no max per score, no rescale of O
        per block -- as long as every weight 2^((t - shift)·C) (C = cap·log2 e) stays a normal
        fp32 and far from overflow: see ``_fixed_shift``.  That holds for C <= 82 (cap <= 56.8:
        Gemma 2's 50 included) with a bf16 P (``cap_fixed_shift``; fp16 P has too narrow a
        range).  Larger caps and fp16 keep the running max.  A runtime test on a launch scalar:
        warp-uniform."""
        return scale_log2 > Float32(FIXED_SHIFT_MAX_SCALE)

    def _fixed_shift(self, scale_log2):
        """The soft-cap's fixed shift, in S's units (cap): 1 - b / C with b = max(0, 2C - 100),
        so the weights 2^((t - 1)·C + b) span [2^(b - 2C), 2^b] = [>= 2^-100, <= 2^64] for C <= 82:
        every weight, and its products with any value of |v| >= 2^-26 in P V, is a normal fp32
        (up to rcp_approx's rounding) -- a row whose logits all sit near -cap keeps its weights,
        none flushes to 0 -- and a row's sum (keys·2^64) or P V (keys·2^64·|v|) stays below fp32's
        2^128 while keys·|v| < 2^64 (the running max allows 2^128).  b = 0 up to C = 50 (cap
        34.7).  Once per kernel (a launch scalar)."""
        b = cute.arch.fmax(scale_log2 * 2.0 - 100.0, Float32(0.0))
        return Float32(1.0) - b * cute.arch.rcp_approx(scale_log2)

    @cute.jit
    def _rescale_o(self, acc_O, corr):
        """O *= corr; with ``lazy_rescale`` only when some row of the warp has corr != 1 (its
        max moved by more than LAZY_RESCALE; the soft-cap's fixed shift never moves it)."""
        if const_expr(self.lazy_rescale):
            moved = corr[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(corr)):
                moved = moved | (corr[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                _rescale(acc_O, corr)
        else:
            _rescale(acc_O, corr)


def _col_ok(lim, off: int):
    """Whether the key at column offset ``off`` is within a row's ``_row_limits``; None
    without limits (a block the bounds do not cut)."""
    if lim is None:
        return None
    hi, lo = lim
    ok = Int32(off) < hi
    if lo is not None:
        ok = ok & (Int32(off) >= lo)
    return ok


def _keep(ok, v, fill):
    """v where ok, else fill; v itself where nothing was masked (ok None)."""
    return v if ok is None else cutlass.select_(ok, v, fill)


@cute.jit
def _rescale(acc_O: cute.Tensor, corr: cute.Tensor):
    O = wgmma_mn_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(O, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
            O[r, c] = O[r, c] * corr[r]
