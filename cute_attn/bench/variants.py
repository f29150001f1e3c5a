"""Variants: each built-in's time over plain attention (bar: <= 1.05x), FlexAttention's same
ratio beside ours, and fused RoPE vs a separate RoPE pass + plain attention.

Decode: batch 64 x 4k, bf16, 32 q / 8 kv heads, d128, page 16, run() replayed from a CUDA
graph.  FlexAttention runs the same batch dense ([64, 8, 4096, 128], GQA) with the variant as
``score_mod`` / ``mask_mod`` (n/a where it has no equivalent: sinks, sigmoid, RoPE).

Prefill: hd128, 2 x 8k tokens, 16 heads, causal, bf16, ragged (bench/prefill.py's shapes), eager
``run()`` of a planned wrapper; FlexAttention on the dense [2, 16, 8k, 128] tensors with its own
causal block mask; the custom mask row (the causal pattern given as a mask) is compared with
plain non-causal attention, the work it does (a custom mask skips no blocks).  Specializations:
the ``variants`` preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .common import do_bench, flex_bench

HQ, HK, D = 32, 8, 128
B, L, PS = 64, 4096, 16


@dataclass
class Row:
    """One variant case: wrapper plan()/run() keywords (callables of the case's tensors) and
    FlexAttention's score_mod / mask_mod builders (None: no equivalent)."""

    name: str
    plan_kw: Callable = lambda t: {}
    run_args: Callable = lambda t: ()
    run_kw: Callable = lambda t: {}
    flex_score: Optional[Callable] = None
    flex_mask: Optional[Callable] = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _record(res, case, row, t, t_plain, f, f_plain, flag_bar: bool):
    """Record one variant row (ours, and FlexAttention's time and ratio when it has the variant)
    and print it; ``flag_bar`` marks ratios over the 1.05x bar."""
    res.add(case, "cute_attn", "us", t)
    res.add(case, "cute_attn", "x_plain", t / t_plain)
    fx = ""
    if f is not None and f_plain:
        res.add(case, "flex", "us", f)
        res.add(case, "flex", "x_plain", f / f_plain)
        fx = f"{f:9.1f} {f / f_plain:7.3f}"
    flag = "  > 1.05" if flag_bar and t / t_plain > 1.05 else ""
    print(f"{row.name:<42} {t:7.1f} {t / t_plain:8.3f} {fx or 'n/a':>17}  {row.note}{flag}")


def _decode_rows():
    from ..variants import Causal, FlashSigmoid, get_alibi_slopes
    from ..variants.examples import RelativePositionBias

    def softcap_mod(t):
        return lambda s, b, h, qi, kvi: 30.0 * torch.tanh(s / 30.0)

    def alibi_mod(t):
        slopes = t["slopes"]
        return lambda s, b, h, qi, kvi: s + slopes[h] * (kvi - (L - 1)).to(s.dtype)

    def relbias_mod(t):
        table = t["table"]
        return lambda s, b, h, qi, kvi: s + table[h, ((L - 1 - kvi) // 16).clamp(0, 31)]

    return [
        Row("plain"),
        Row("causal", plan_kw=lambda t: dict(variant=Causal()), flex_mask=lambda t: lambda b, h, qi, kvi: kvi <= L - 1),
        Row("soft_cap", plan_kw=lambda t: dict(logits_soft_cap=30.0), flex_score=softcap_mod),
        Row(
            "window_1024",
            plan_kw=lambda t: dict(window_left=1024),
            flex_mask=lambda t: lambda b, h, qi, kvi: kvi >= L - 1 - 1024,
            note="reads only the window",
        ),
        Row(
            "alibi",
            plan_kw=lambda t: dict(pos_encoding_mode="ALIBI"),
            flex_score=alibi_mod,
            extra=dict(slopes=lambda: get_alibi_slopes(HQ).cuda()),
        ),
        Row("sink", run_kw=lambda t: dict(sinks=t["sinks"]), extra=dict(sinks=lambda: torch.randn(HQ, device="cuda"))),
        Row("rope", plan_kw=lambda t: dict(pos_encoding_mode="ROPE_LLAMA")),
        Row(
            "custom_mask",
            plan_kw=lambda t: dict(custom_mask=t["mask"]),
            flex_mask=lambda t: (lambda m: lambda b, h, qi, kvi: m[b, kvi])(t["mask"].view(B, L).cuda()),
            extra=dict(mask=lambda: torch.rand(B * L) < 0.9),
        ),
        Row("sigmoid", plan_kw=lambda t: dict(variant=FlashSigmoid(sigmoid_bias=-2.0))),
        Row(
            "rel_bias (user example)",
            plan_kw=lambda t: dict(variant=RelativePositionBias()),
            run_args=lambda t: (t["table"],),
            flex_score=relbias_mod,
            extra=dict(table=lambda: torch.randn(HQ, 32, device="cuda")),
        ),
    ]


def _decode_case():
    gen = torch.Generator().manual_seed(0)
    pages = L // PS
    indptr = torch.arange(0, (B + 1) * pages, pages, dtype=torch.int32)
    indices = torch.randperm(B * pages, generator=gen).to(torch.int32)
    last = torch.full((B,), PS, dtype=torch.int32)
    k = torch.randn(B * pages, PS, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B * pages, PS, HK, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, (k, v), indptr, indices, last


def _time_decode(ws, q, cache, indptr, indices, last, plan_kw, run_args, run_kw) -> float:
    from cute_attn import BatchDecodeWithPagedKVCacheWrapper

    w = BatchDecodeWithPagedKVCacheWrapper(
        ws,
        use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr.cuda(),
        paged_kv_indices_buffer=indices.cuda(),
        paged_kv_last_page_len_buffer=last.cuda(),
    )
    w.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.bfloat16, **plan_kw)
    out = torch.empty_like(q)
    w.run(q, cache, *run_args, out=out, **run_kw)  # warm-up: loads the module outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, *run_args, out=out, **run_kw)
    return do_bench(g.replay)


def _flex(q, k, v, score_mod=None, mask_mod=None):
    """Time of FlexAttention on dense [B, H, L, D] (q length 1), compiled afresh for this row
    (``common.flex_bench``: a compiled object shared by the rows passed dynamo's recompile limit
    and fell back to the unfused path), or None (the reason printed)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(mask_mod, B, None, 1, L, device="cuda") if mask_mod is not None else None
    except Exception as e:  # pragma: no cover
        print(f"  flex skipped: {type(e).__name__}: {str(e)[:200]}")
        return None
    t, _, why = flex_bench(lambda fa: fa(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True))
    if why is not None:
        print(f"  flex skipped: {why}")
    return t


def _rope_pass(x, pos, theta=1e4):
    """A separate (unfused) RoPE pass in torch ops: returns the rotated copy of x [..., n, heads, D]."""
    d = x.shape[-1]
    freq = 1.0 / theta ** (torch.arange(0, d // 2, device=x.device, dtype=torch.float32) * 2.0 / d)
    ang = pos.float()[..., None] * freq
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    xf = x.float()
    lo, hi = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], -1).to(x.dtype)


def _decode_rows_bench(res, quick: bool) -> None:
    q, cache, indptr, indices, last = _decode_case()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = _decode_rows()
    if quick:
        rows = rows[:4]
    qd = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    kd = torch.randn(B, HK, L, D, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn(B, HK, L, D, device="cuda", dtype=torch.bfloat16)
    t_plain = f_plain = None
    print(f"{'decode bs64 x 4k, bf16 32/8 d128, page 16':<42} {'us':>7} {'x plain':>8} {'flex us':>9} {'flex x':>7}")
    for row in rows:
        t_in = {k: f() for k, f in row.extra.items()}
        t = _time_decode(ws, q, cache, indptr, indices, last, row.plan_kw(t_in), row.run_args(t_in), row.run_kw(t_in))
        if row.name == "plain":
            t_plain = t
            f = f_plain = _flex(qd, kd, vd)
        elif row.flex_score is None and row.flex_mask is None:
            f = None
        else:
            f = _flex(
                qd,
                kd,
                vd,
                row.flex_score(t_in) if row.flex_score else None,
                row.flex_mask(t_in) if row.flex_mask else None,
            )
        _record(res, f"variants/decode/bs64x4k/{row.name.split()[0]}", row, t, t_plain, f, f_plain, flag_bar=False)

    # fused RoPE vs a separate RoPE pass over q and the whole KV cache (torch ops) + plain decode
    k, v = cache
    # page id -> its index in the request's page list (indices is a permutation of all pages)
    page_in_req = torch.argsort(indices.cuda().long()) % (L // PS)
    pos_of_page = page_in_req[:, None] * PS + torch.arange(PS, device="cuda")[None, :]  # [pages, PS]
    qpos = torch.full((B,), L - 1, device="cuda")
    t_fused = _time_decode(ws, q, cache, indptr, indices, last, dict(pos_encoding_mode="ROPE_LLAMA"), (), {})
    k_rot = torch.empty_like(k)

    def separate():
        k_rot.copy_(_rope_pass(k, pos_of_page))
        q_rot = _rope_pass(q, qpos)
        w_plain.run(q_rot, (k_rot, v), out=out_sep)

    from cute_attn import BatchDecodeWithPagedKVCacheWrapper

    w_plain = BatchDecodeWithPagedKVCacheWrapper(ws)
    w_plain.plan(indptr, indices, last, HQ, HK, D, PS, q_data_type=torch.bfloat16)
    out_sep = torch.empty_like(q)
    separate()
    t_sep = do_bench(separate)
    res.add("variants/decode/bs64x4k/rope_fused_vs_separate", "cute_attn", "us", t_fused)
    res.add("variants/decode/bs64x4k/rope_fused_vs_separate", "separate_rope_pass+plain", "us", t_sep)
    res.add("variants/decode/bs64x4k/rope_fused_vs_separate", "cute_attn", "speedup", t_sep / t_fused)
    print(
        f"{'RoPE fused':<42} {t_fused:7.1f}   vs separate torch RoPE pass + plain decode {t_sep:8.1f} us "
        f"({t_sep / t_fused:.2f}x)"
    )


PB, PH, PSEQ = 2, 16, 8192  # prefill: bench/prefill.py's shapes (2 x 8k tokens, 16 heads, no GQA), hd 128


def _prefill_rows():
    """Prefill rows (causal unless ``extra['noncausal']``): plan/run keywords of the ragged
    wrapper, FlexAttention's score_mod / mask_mod on dense [2, 16, 8k, 128] (q index = kv
    index: bottom-right = top-left aligned here)."""
    from ..variants import FlashSigmoid, get_alibi_slopes
    from ..variants.examples import RelativePositionBias

    def causal(b, h, qi, kvi):
        return qi >= kvi

    def alibi_mod(t):
        slopes = t["slopes"]
        return lambda s, b, h, qi, kvi: s + slopes[h] * (kvi - qi).to(s.dtype)

    def relbias_mod(t):
        table = t["table"]
        return lambda s, b, h, qi, kvi: s + table[h, ((qi - kvi).clamp(min=0) // 16).clamp(max=31)]

    def sigmoid_mod(t):
        return lambda s, b, h, qi, kvi: torch.log(torch.sigmoid(s - 2.0))  # weights, normalized by flex's softmax

    return [
        Row("plain (causal)", flex_mask=lambda t: causal),
        Row(
            "soft_cap",
            plan_kw=lambda t: dict(logits_soft_cap=30.0),
            flex_mask=lambda t: causal,
            flex_score=lambda t: lambda s, b, h, qi, kvi: 30.0 * torch.tanh(s / 30.0),
        ),
        Row(
            "window_1024",
            plan_kw=lambda t: dict(window_left=1024),
            flex_mask=lambda t: lambda b, h, qi, kvi: (qi >= kvi) & (kvi >= qi - 1024),
            note="reads only the window",
        ),
        Row(
            "alibi",
            plan_kw=lambda t: dict(pos_encoding_mode="ALIBI"),
            flex_mask=lambda t: causal,
            flex_score=alibi_mod,
            extra=dict(slopes=lambda: get_alibi_slopes(PH).cuda()),
        ),
        Row("sink", run_kw=lambda t: dict(sinks=t["sinks"]), extra=dict(sinks=lambda: torch.randn(PH, device="cuda"))),
        Row(
            "rope",
            plan_kw=lambda t: dict(pos_encoding_mode="ROPE_LLAMA"),
            note="K rotated by a pass first, Q in the kernel",
        ),
        Row(
            "custom_mask",
            plan_kw=lambda t: dict(custom_mask=t["mask"]),
            flex_mask=lambda t: (lambda m: lambda b, h, qi, kvi: m[b, qi, kvi])(t["mask_dense"]),
            extra=dict(mask=None),
            note="x over plain NON-causal (the same mask as plain causal skips the blocks it hides)",
        ),
        Row(
            "sigmoid",
            plan_kw=lambda t: dict(variant=FlashSigmoid(sigmoid_bias=-2.0)),
            flex_mask=lambda t: causal,
            flex_score=sigmoid_mod,
            note="flex: log-sigmoid score_mod (normalized, not the same math)",
        ),
        Row(
            "rel_bias (user example)",
            plan_kw=lambda t: dict(variant=RelativePositionBias()),
            run_args=lambda t: (t["table"],),
            flex_mask=lambda t: causal,
            flex_score=relbias_mod,
            extra=dict(table=lambda: torch.randn(PH, 32, device="cuda")),
        ),
    ]


def _time_prefill(ws, q, k, v, ind, causal, plan_kw, run_args, run_kw) -> float:
    from ..prefill import BatchPrefillWithRaggedKVCacheWrapper

    w = BatchPrefillWithRaggedKVCacheWrapper(ws)
    w.plan(ind, ind, PH, PH, D, causal=causal, q_data_type=torch.bfloat16, **plan_kw)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], PH, device="cuda")
    w.run(q, k, v, *run_args, out=out, lse=lse, **run_kw)
    return do_bench(lambda: w.run(q, k, v, *run_args, out=out, lse=lse, **run_kw))


def _flex_prefill(q4, k4, v4, score_mod=None, mask_mod=None):
    """The same on the prefill rows' dense [2, 16, 8k, 128] tensors."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        bm = create_block_mask(mask_mod, None, None, PSEQ, PSEQ, device="cuda") if mask_mod is not None else None
    except Exception as e:  # pragma: no cover
        print(f"  flex skipped: {type(e).__name__}: {str(e)[:200]}")
        return None
    t, _, why = flex_bench(lambda fa: fa(q4, k4, v4, score_mod=score_mod, block_mask=bm))
    if why is not None:
        print(f"  flex skipped: {why}")
    return t


def _prefill_rows_bench(res, quick: bool) -> None:
    """Prefill hd128, 2 x 8k causal, bf16, ragged: each variant's time over plain causal
    attention (the custom mask: over plain non-causal, which does the same block work), with
    FlexAttention's ratio beside (its own plain causal run as the base); then fused RoPE vs a
    separate torch RoPE pass over q and k + plain attention."""
    ind = torch.arange(0, (PB + 1) * PSEQ, PSEQ, dtype=torch.int32)
    q = torch.randn(PB * PSEQ, PH, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(PB * PSEQ, PH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(PB * PSEQ, PH, D, device="cuda", dtype=torch.bfloat16)
    q4, k4, v4 = (x.view(PB, PSEQ, PH, D).transpose(1, 2).contiguous() for x in (q, k, v))
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = _prefill_rows()
    if quick:
        rows = rows[:4]
    t_plain = _time_prefill(ws, q, k, v, ind, True, {}, (), {})
    t_plain_nc = _time_prefill(ws, q, k, v, ind, False, {}, (), {})
    f_plain = None
    print(
        f"{'prefill 2 x 8k causal, bf16 16/16 d128 ragged':<42} {'us':>7} {'x plain':>8} {'flex us':>9} {'flex x':>7}"
    )
    for row in rows:
        t_in = {}
        for name, f in row.extra.items():
            if name == "mask":  # the causal pattern as a custom mask, FlashInfer's flat layout
                dense = torch.ones(PSEQ, PSEQ, dtype=torch.bool).tril()
                t_in["mask"] = dense.reshape(-1).repeat(PB)
                t_in["mask_dense"] = dense.cuda().unsqueeze(0).expand(PB, PSEQ, PSEQ)
            else:
                t_in[name] = f()
        noncausal = row.name == "custom_mask"
        if row.name.startswith("plain"):
            t = t_plain
        else:
            t = _time_prefill(ws, q, k, v, ind, not noncausal, row.plan_kw(t_in), row.run_args(t_in), row.run_kw(t_in))
        base = t_plain_nc if noncausal else t_plain
        f = None
        if row.flex_score is not None or row.flex_mask is not None:
            if f_plain is None:
                f_plain = _flex_prefill(q4, k4, v4, mask_mod=lambda b, h, qi, kvi: qi >= kvi)
            f = _flex_prefill(
                q4,
                k4,
                v4,
                row.flex_score(t_in) if row.flex_score else None,
                row.flex_mask(t_in) if row.flex_mask else None,
            )
        _record(
            res, f"variants/prefill/hd128/causal/s8192/{row.name.split()[0]}", row, t, base, f, f_plain, flag_bar=True
        )
        if noncausal:  # the causal pattern as a mask, against the causal flag's kernel too
            res.add("variants/prefill/hd128/causal/s8192/custom_mask_vs_causal", "cute_attn", "x_plain", t / t_plain)
            print(f"{'  custom_mask over plain causal':<42} {t:7.1f} {t / t_plain:8.3f}")
        del t_in

    # fused RoPE vs a separate RoPE pass (torch ops over q and k) + plain causal prefill
    pos = torch.arange(PSEQ, device="cuda").repeat(PB)  # kv_len == qo_len: query i and key i at position i
    t_fused = _time_prefill(ws, q, k, v, ind, True, dict(pos_encoding_mode="ROPE_LLAMA"), (), {})
    from ..prefill import BatchPrefillWithRaggedKVCacheWrapper

    w_plain = BatchPrefillWithRaggedKVCacheWrapper(ws)
    w_plain.plan(ind, ind, PH, PH, D, causal=True, q_data_type=torch.bfloat16)
    out_sep = torch.empty_like(q)

    def separate():
        w_plain.run(_rope_pass(q, pos), _rope_pass(k, pos), v, out=out_sep)

    separate()
    t_sep = do_bench(separate)
    case = "variants/prefill/hd128/causal/s8192/rope_fused_vs_separate"
    res.add(case, "cute_attn", "us", t_fused)
    res.add(case, "separate_rope_pass+plain", "us", t_sep)
    res.add(case, "cute_attn", "speedup", t_sep / t_fused)
    print(
        f"{'RoPE fused':<42} {t_fused:7.1f}   vs separate torch RoPE pass + plain prefill {t_sep:8.1f} us "
        f"({t_sep / t_fused:.2f}x)"
    )


def bench_variants(res, quick: bool) -> None:
    _decode_rows_bench(res, quick)
    _prefill_rows_bench(res, quick)
