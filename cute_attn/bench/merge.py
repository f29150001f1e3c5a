"""⊕ merge kernels vs a torch implementation of the same op; achieved bandwidth vs device copy."""

from __future__ import annotations

import torch

from .common import do_bench


def copy_bandwidth(res) -> float:
    """Device-to-device copy of 4 GiB; TB/s counting bytes read + written (the ceiling)."""
    n = 1 << 31  # bf16 elements = 4 GiB
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src))
    tbs = 2 * src.numel() * 2 / t / 1e6
    del src, dst
    print(f"device copy: {tbs:.3f} TB/s (read+write, 4 GiB, {t:.0f} us)")
    res.add("copy/4GiB", "torch", "TB/s", tbs)
    return tbs


def torch_merge_states(v, s):
    m = s.amax(dim=1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(s - m)
    den = w.sum(dim=1)
    out = (v.float() * w.unsqueeze(-1)).sum(dim=1) / den.unsqueeze(-1)
    return out.to(v.dtype), m.squeeze(1) + torch.log2(den)


def torch_merge_state(va, sa, vb, sb):
    m = torch.maximum(sa, sb)
    wa, wb = torch.exp2(sa - m), torch.exp2(sb - m)
    d = wa + wb
    out = (va.float() * wa.unsqueeze(-1) + vb.float() * wb.unsqueeze(-1)) / d.unsqueeze(-1)
    return out.to(va.dtype), m + torch.log2(d)


def _row(name, case, t_ours, t_torch, t_comp, nbytes, ceiling, res):
    bw = nbytes / t_ours / 1e6
    res.add(case, "cute_attn", "us", t_ours)
    res.add(case, "cute_attn", "TB/s", bw)
    res.add(case, "torch", "us", min(t_torch, t_comp or t_torch))
    res.add(case, "cute_attn", "ratio", min(t_torch, t_comp or t_torch) / t_ours)
    comp = f"{t_comp:9.1f}" if t_comp else "      n/a"
    print(f"{name:<34} {t_ours:9.1f} {t_torch:9.1f} {comp} {bw:8.3f} {100 * bw / ceiling:6.1f}%")


def bench_merge(res, ceiling: float, quick: bool) -> None:
    import cute_attn

    print(f"{'merge case (bf16)':<34} {'ours us':>9} {'torch us':>9} {'compiled':>9} {'TB/s':>8} {'of copy':>7}")
    try:
        compiled = torch.compile(torch_merge_states)
        compiled_pair = torch.compile(torch_merge_state)
    except Exception:  # pragma: no cover - torch.compile unavailable
        compiled = compiled_pair = None
    shapes = (
        [(8, 4096, 32, 128)]
        if quick
        else [(8, 4096, 32, 128), (2, 4096, 32, 128), (16, 2048, 32, 128), (8, 4096, 8, 256), (4, 16384, 8, 64)]
    )
    for n, seq, h, d in shapes:
        v = torch.randn(seq, n, h, d, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(seq, n, h, device="cuda") * 3
        out, lse = cute_attn.merge_states(v, s)
        ref, _ = torch_merge_states(v, s)
        assert (out.float() - ref.float()).abs().max() < 0.05, "merge_states disagrees with torch"
        nbytes = v.numel() * 2 + s.numel() * 4 + out.numel() * 2 + lse.numel() * 4
        t_ours = do_bench(lambda: cute_attn.merge_states(v, s, out=out, lse=lse))
        t_torch = do_bench(lambda: torch_merge_states(v, s))
        t_comp = None
        if compiled is not None:
            try:
                compiled(v, s)
                t_comp = do_bench(lambda: compiled(v, s))
            except Exception as e:  # pragma: no cover
                print(f"torch.compile failed: {type(e).__name__}: {e}")
                compiled = None
        _row(
            f"merge_states n{n} s{seq} h{h} d{d}",
            f"merge_states/s{n}/n{seq}/h{h}/d{d}",
            t_ours,
            t_torch,
            t_comp,
            nbytes,
            ceiling,
            res,
        )
        del v, s, out, lse
    seq, h, d = 65536, 32, 128
    va, vb = (torch.randn(seq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sa, sb = (torch.randn(seq, h, device="cuda") for _ in range(2))
    out, lse = cute_attn.merge_state(va, sa, vb, sb)
    nbytes = 3 * va.numel() * 2 + 3 * sa.numel() * 4
    t_ours = do_bench(lambda: cute_attn.merge_state(va, sa, vb, sb, out=out, lse=lse))
    t_torch = do_bench(lambda: torch_merge_state(va, sa, vb, sb))
    t_comp = None
    if compiled_pair is not None:
        try:
            compiled_pair(va, sa, vb, sb)
            t_comp = do_bench(lambda: compiled_pair(va, sa, vb, sb))
        except Exception as e:  # pragma: no cover
            print(f"torch.compile failed: {type(e).__name__}: {e}")
    _row(
        f"merge_state s{seq} h{h} d{d}", f"merge_state/n{seq}/h{h}/d{d}", t_ours, t_torch, t_comp, nbytes, ceiling, res
    )


def sweep_merge(res) -> None:
    """merge_states 8 x 4096 x 32 x 128 bf16 over load_batch (spec) x grid cap (launch)."""
    from ..runtime.arch import device_arch, sm_count
    from ..runtime.loader import kernel

    n, seq, h, d = 8, 4096, 32, 128
    v = torch.randn(seq, n, h, d, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(seq, n, h, device="cuda") * 3
    out = torch.empty(seq, h, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(seq, h, device="cuda")
    nbytes = v.numel() * 2 + s.numel() * 4 + out.numel() * 2 + lse.numel() * 4
    arch, sms = device_arch(v.device), sm_count(v.device)
    print(f"{'load_batch':>10} {'ctas/SM':>8} {'us':>8} {'TB/s':>7}")
    for batch in (1, 2, 4, 8):
        mod = kernel("merge_states", arch, dtype="bf16", head_dim=d, load_batch=batch)
        for per_sm in (8, 16, 32, 1 << 20):
            t = do_bench(lambda: mod(v, s, out, lse, sms * per_sm))
            label = "all" if per_sm > 1000 else str(per_sm)
            print(f"{batch:>10} {label:>8} {t:8.1f} {nbytes / t / 1e6:7.3f}")
