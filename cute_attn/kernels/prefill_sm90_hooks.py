"""Variant hook points of the Hopper prefill kernel (``prefill_sm90.py``): the static flags'
logits and visibility (soft-cap, causal, window) and the helpers that trace a variant's hooks
(``cute_attn/variants``, ``Hooks``) into the kernel -- per-row contexts, biases seeded into
the QK accumulator, logits, masks and bitmaps, ``kv_range`` block clipping, the Q / K
transforms, ``finalize`` and ``output``.  The helpers are plain Python, called while the kernel
is traced; with no variant none of them traces anything.

A mixin of ``BatchPrefillSm90``: its methods read the kernel's configuration from ``self``,
the item from an ``ItemInfo`` and the launch's values from a ``TraceCtx`` (``work.py``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from ..variants.base import Ctx
from ..variants.dsl import LOG2E
from ..variants.trace import transform_pairs
from .bitmask import bit_set, row_words
from .fragments import WG, quad_sum, wgmma_mn_view
from .work import ItemInfo, TraceCtx, row_ctx


class PrefillHooks:
    """The prefill kernel's variant hook points and helpers (see the module docstring)."""

    # ---- static flags: soft-cap, causal, window --------------------------------------------
    def _row_scale(self, scale_log2):
        """What turns S (and row_m, kept in S's units) into base-2 logits: ``scale_log2`` --
        sm_scale·log2 e for raw q·k, cap·log2 e after the soft-cap (S then holds tanh(q·k ·
        sm_scale / cap), see ``host``) -- or log2 e after a variant's logits (natural units).
        The factor folds into the softmax's FFMA, not a multiply per score."""
        if const_expr(self.hooks.has_logits):
            return Float32(LOG2E)
        return scale_log2

    @cute.jit
    def _logits(self, s: Float32, inv_cap: Float32) -> Float32:
        """The soft-cap on raw q·k, in units of cap (``_row_scale`` has the factor): tanh(q·k ·
        sm_scale / cap); ``inv_cap`` = sm_scale / cap."""
        return cute.math.tanh(s * inv_cap, fastmath=True)

    # ---- traced variants: plain Python, called while the kernel is traced --------------------
    def _k_ctx(self, info: ItemInfo, tc: TraceCtx, kv_pos) -> Ctx:
        """The context of a key (transform_k): no query row.  Its once-values are evaluated here
        (a dummy call), so they are computed once per block, not per row."""
        ctx = Ctx(
            batch=info.req,
            kv_head=info.kv_head,
            kv_pos=kv_pos,
            qo_len=info.qo_len,
            kv_len=info.kv_len,
            head_dim=self.head_dim,
            sm_scale=tc.sm_scale,
        )
        self.hooks.transform_k(ctx, tc.vargs, Float32(0.0), Float32(0.0), Int32(0))
        return ctx

    def _transform_key_pairs(self, base, tc: TraceCtx, kv_pos, lo, hi, d0):
        """``transform_pairs`` for key ``kv_pos`` (a helper: a ``base.replace`` written in the
        caller's runtime loop would make the DSL carry the Ctx through it)."""
        transform_pairs(self.hooks, tc.vargs, base.replace(kv_pos=kv_pos), lo, hi, d0, self.dtype, query=False)

    def _clip_blocks(self, info: ItemInfo, tc: TraceCtx, kv_start, first, n_blocks):
        """Blocks of an item clipped to the variant's kv_range (bounds non-decreasing in q_pos:
        the tile's first row gives the lower bound, its last row the upper)."""
        H, va, TN = self.hooks, tc.vargs, self.tile_n
        lo, _ = H.kv_range(row_ctx(info, info.row_start, self.head_dim, tc.sm_scale), va)
        _, hi = H.kv_range(row_ctx(info, info.row_start + info.num_rows - 1, self.head_dim, tc.sm_scale), va)
        if hi is not None:
            nb = cutlass.select_(hi > kv_start, (hi - kv_start + TN - 1) // TN, Int32(0))
            n_blocks = cutlass.select_(nb < n_blocks, nb, n_blocks)
        if lo is not None:
            f = cutlass.select_(lo > kv_start, (lo - kv_start) // TN, Int32(0))
            first = cutlass.select_(f > first, f, first)
        return cutlass.select_(first < n_blocks, first, n_blocks), n_blocks

    def _hook_logits(self, row_vals, tc: TraceCtx, kv_pos, s, kv_pos_f32, rel_pos_f32):
        """Raw q·k -> the variant's logit (natural units: the softmax's scale is log2 e, see
        ``_row_scale``) or its weight (no softmax).  The float positions come as (per-block
        base, column constant) pairs (``Ctx``)."""
        ctx = row_vals[0].replace(kv_pos=kv_pos, kv_pos_f32=kv_pos_f32, rel_pos_f32=rel_pos_f32)
        return self.hooks.logits(ctx, tc.vargs, s * tc.sm_scale)

    def _seed_bias(self, acc_S, rows, blk, tc: TraceCtx):
        """S := the variant's bias / sm_scale for the block at blk (``Hooks.bias``), so the QK
        GEMM accumulates onto it and the softmax sees q·k + bias in q·k's units, at no cost per
        score there.  Called before the block's QK wait (a bias load's latency hides under it);
        float positions as (per-block base, column constant) pairs (``Ctx``)."""
        S = wgmma_mn_view(acc_S)
        tScS, q_pos = rows.tScS, rows.q_pos
        kv_f0 = (blk + tScS[0, 0][1]).to(Float32)
        for r in range(cute.size(S, mode=[0])):
            ctx = rows.vals[r][0]
            rel_f0 = kv_f0 - q_pos[r].to(Float32)
            for c in range(cute.size(S, mode=[1])):
                off = float(tc.col_off[c])
                cc = ctx.replace(kv_pos=blk + tScS[0, c][1], kv_pos_f32=(kv_f0, off), rel_pos_f32=(rel_f0, off))
                S[r, c] = self.hooks.bias(cc, tc.vargs, tc.inv_sm_scale)

    def _hook_visible(self, row_vals, tc: TraceCtx, kv_pos, ok):
        H = self.hooks
        ctx, lo, hi, _ = row_vals
        if H.has_mask:
            ok = H.mask(ctx.replace(kv_pos=kv_pos), tc.vargs, ok)
        if lo is not None:
            ok = _and(ok, kv_pos >= lo)
        if hi is not None:
            ok = _and(ok, kv_pos < hi)
        return ok

    def _mask_words(self, blk, rows, tc: TraceCtx):
        """Per row of this thread, per ``mask_bits`` component: the bits of its keys of the
        block at blk as words (``bitmask.load_words``), bit j of word k = key blk + col0 + 32k +
        j.  Loaded before the block's QK wait (a variant mask tests every block), so their
        latency hides under the GEMM."""
        if not self.hooks.has_mask_bits:
            return None
        return [row_words(vals[3], blk, rows.tScS, tc.col_off) for vals in rows.vals]

    def _bits_uniform(self, words, tc: TraceCtx):
        """(no key visible, every key visible) to this warp's rows in the block by the bitmaps
        of ``_mask_words`` (this thread's columns only; warp-uniform votes)."""
        none_seen, all_seen = None, None
        masks = [0] * ((tc.col_off[-1] + 32) // 32)
        for off in tc.col_off:
            masks[off // 32] |= 1 << (off % 32)
        for per_row in words:
            for bits in per_row:
                for k, wd in enumerate(bits):
                    m = Uint32(masks[k])
                    x = wd & m
                    none_seen = _and(none_seen, x == Uint32(0))
                    all_seen = _and(all_seen, x == m)
        return cute.arch.vote_all_sync(none_seen), cute.arch.vote_all_sync(all_seen)

    def _mask_bits_ok(self, bitmaps, c, ok, tc: TraceCtx):
        """``ok`` and this thread's column c in every bitmap of ``_mask_words``."""
        for words in bitmaps:
            ok = _and(ok, bit_set(words, tc.col_off[c]))
        return ok

    def _finalize_rows(self, st, tOcO, inv_t, lse, scale, info: ItemInfo, tc: TraceCtx):
        """Per row of this thread: the factor O is scaled by and the LSE, with the variant's
        ``finalize`` (first_chunk: the item that starts at kv 0) or, without softmax, the
        weights' state: o = Σ w·v as is for a final row (LSE 0, -inf without keys); a split
        item writes (o / s, log2 s) with s its share of the tile's kv extent (as the planner
        cuts it: causal tiles end at their last row's diagonal), so the ⊕ merge sums them."""
        H, va, g = self.hooks, tc.vargs, info.group
        row_m, row_l, n_rows = st.row_m, st.row_l, cute.size(inv_t)
        row_start, qo_len, kv_len = info.row_start, info.qo_len, info.kv_len
        kv_start, kv_end = info.kv_start, info.kv_end
        ninf, zero = -Float32.inf, Float32(0.0)
        if not H.softmax:
            ext = kv_len
            if self.causal:
                last_tok = (row_start + info.num_rows - 1) // g
                ext = kv_len - qo_len + last_tok + 1
                ext = cutlass.select_(ext < kv_len, ext, kv_len)
                ext = cutlass.select_(ext > 0, ext, Int32(0))
            ext_f = Int32(cutlass.select_(ext > 0, ext, Int32(1))).to(Float32)
            w = cutlass.select_(ext > 0, Int32(kv_end - kv_start).to(Float32) / ext_f, zero)
            final = info.dest < 0
            inv = cutlass.select_(final, Float32(1.0), cutlass.select_(w > zero, cute.arch.rcp_approx(w), zero))
            ls = cutlass.select_(w > zero, cutlass.select_(final, zero, cute.math.log2(w, fastmath=True)), ninf)
            for r in range(n_rows):
                inv_t[r] = inv
                lse[r] = ls
            return
        for r in range(n_rows):
            l = quad_sum(row_l[r])
            m = row_m[r] * scale  # base 2 (-inf: nothing seen, running max; l = 0 says it in any case)
            ctx = row_ctx(info, row_start + tOcO[r, 0][0], self.head_dim, tc.sm_scale)
            ctx.first_chunk = kv_start == 0
            m2, l2 = H.finalize(ctx, va, m, l)
            m2u = cutlass.select_(m2 == ninf, zero, m2)
            m_use = cutlass.select_(m == ninf, m2u, m)
            ok = l2 > zero
            inv_t[r] = cutlass.select_(
                ok,
                cute.math.exp2(m_use - m2u, fastmath=True)
                * cute.arch.rcp_approx(cutlass.select_(ok, l2, Float32(1.0))),
                zero,
            )
            lse[r] = cutlass.select_(
                ok, m2 + cute.math.log2(cutlass.select_(ok, l2, Float32(1.0)), fastmath=True), ninf
            )

    def _output_rows(self, O, tOcO, info: ItemInfo, tc: TraceCtx):
        H, va = self.hooks, tc.vargs
        for r in range(cute.size(O, mode=[0])):
            ctx = row_ctx(info, info.row_start + tOcO[r, 0][0], self.head_dim, tc.sm_scale)
            for c in range(cute.size(O, mode=[1])):
                O[r, c] = H.output(ctx, va, O[r, c], tOcO[0, c][1])

    def _rotate_q(self, sQ, tw, wg, info: ItemInfo, tc: TraceCtx):
        """transform_q on this WG's 64 Q rows in shared memory, once per item (after the whole
        WG's copies landed).  (Scaling Q here by sm_scale / cap, to save the soft-cap's multiply
        per score, was measured: the extra rounding of Q moved the LSE by up to 8e-3 at cap 30
        and 0.2 with saturated logits, against the tests' 2e-3; an fp32 multiply per score it is.)
        Thread tw takes chunks c, c + chunks/2 of rows tw // (chunks/2) + k·(WG / (chunks/2))."""
        half = self.chunks // 2
        rows_per_pass = WG // half
        c = tw % half
        g, kv_head = info.group, info.kv_head
        base = Ctx(
            batch=info.req,
            kv_head=kv_head,
            qo_len=info.qo_len,
            kv_len=info.kv_len,
            head_dim=self.head_dim,
            sm_scale=tc.sm_scale,
        )
        for k in range(64 // rows_per_pass):
            j = wg * 64 + tw // half + k * rows_per_pass
            row = info.row_start + j
            ctx = base.replace(qo_head=kv_head * g + row % g, _fresh=True)
            lo = cute.make_rmem_tensor((8,), self.dtype)
            hi = cute.make_rmem_tensor((8,), self.dtype)
            s_lo = cute.local_tile(sQ[j, None], (8,), (c,))
            s_hi = cute.local_tile(sQ[j, None], (8,), (c + half,))
            cute.autovec_copy(s_lo, lo)
            cute.autovec_copy(s_hi, hi)
            transform_pairs(
                self.hooks,
                tc.vargs,
                ctx.replace(q_pos=info.qpos_base + row // g),
                lo,
                hi,
                c * 8,
                self.dtype,
                query=True,
            )
            cute.autovec_copy(lo, s_lo)
            cute.autovec_copy(hi, s_hi)


def _and(ok, x):
    """``ok & x`` where ``ok`` may be None (nothing masked yet)."""
    return x if ok is None else ok & x
