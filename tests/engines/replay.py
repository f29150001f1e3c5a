"""What the engine tests share: the environment (CPU with fake-CUDA tensors and the kernels
emulated, or a real GPU), the models (plain, sliding window, soft-cap; bf16), batches laid out
as the engines keep them, and the fp32 reference checks."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import torch

from cute_attn.testing import paged_reference

BF16 = torch.bfloat16


@dataclass
class Model:
    name: str
    hq: int
    hk: int
    d: int
    window_left: int = -1  # vLLM: sliding_window - 1
    soft_cap: float = 0.0

    @property
    def sm_scale(self) -> float:
        return self.d**-0.5

    @property
    def cap_or_none(self):
        return self.soft_cap or None


def models(hq, hk, d):
    return [
        Model("plain", hq, hk, d),
        Model("window", hq, hk, d, window_left=23),
        Model("softcap", hq, hk, d, soft_cap=30.0),
    ]


class Env:
    """``cpu``: index / graph buffers and workspaces are fake-CUDA CPU tensors, kernels emulated
    (``demu``), a "capture" records the launches and a "replay" re-issues them with the same
    arguments; ``gpu``: real tensors, ``torch.cuda.CUDAGraph``."""

    def __init__(self, kind, emu=None):
        self.kind, self.emu = kind, emu
        self.dev = "cuda" if kind == "gpu" else "cpu"
        self.gen = torch.Generator().manual_seed(random.randrange(1 << 30))

    def buf(self, t):
        """A "CUDA" tensor the wrappers keep (graph buffers, indices on the device)."""
        if self.kind == "gpu":
            return t.cuda()
        from emu_helpers import _fake_cuda

        return _fake_cuda(t.clone())

    def ws(self, mb=128):
        return self.buf(torch.zeros(mb << 20, dtype=torch.uint8))

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(BF16).to(self.dev)

    def nan(self, *shape):
        return torch.full(shape, float("nan"), dtype=BF16, device=self.dev)

    @contextlib.contextmanager
    def capture(self):
        """Yields a replay() function."""
        if self.kind == "gpu":
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                yield g.replay
            return
        n0 = len(self.emu.replayable)
        self.emu.state["capturing"] = True
        recorded = []
        try:
            yield lambda: [m(*a) for m, a in recorded]
        finally:
            self.emu.state["capturing"] = False
            recorded.extend(self.emu.replayable[n0:])

    def merge_state(self, v_a, s_a, v_b, s_b):
        if self.kind == "gpu":
            from cute_attn.cascade import merge_state

            return merge_state(v_a, s_a, v_b, s_b)
        from cute_attn.testing import merge_state_reference

        o, s = merge_state_reference(v_a.float(), s_a, v_b.float(), s_b)
        return o.to(v_a.dtype), s

    def sync(self):
        if self.kind == "gpu":
            torch.cuda.synchronize()


def check(out, ref, what, tol=2e-2):
    out = out.float().cpu()
    ref = ref.float().cpu()
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    assert err < tol, f"{what}: relative error {err:.3e}"


def check_lse(lse, ref, what):
    lse, ref = lse.cpu(), ref.cpu()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), fin), what
    assert (lse[fin] - ref[fin]).abs().max() < 2e-2, what


class PagedPool:
    """A paged KV pool as the engines hold it: pages of ``page_size`` tokens ``[pages, 2,
    page_size, hk, d]`` (vLLM's layout, NHD), shuffled page ids per request."""

    def __init__(self, env, m, page_size, num_pages):
        self.env, self.m, self.ps = env, m, page_size
        self.kv = env.randn(num_pages, 2, page_size, m.hk, m.d)
        self.free = list(range(num_pages))
        random.shuffle(self.free)

    def pages_for(self, lens):
        out = []
        for n in lens:
            k = (n + self.ps - 1) // self.ps
            out.append([self.free.pop() for _ in range(k)])
        return out

    @staticmethod
    def tables(pages, lens, ps):
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + len(p))
        flat = [i for p in pages for i in p]
        last = [(n - 1) % ps + 1 if n else 0 for n in lens]
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        return i32(indptr), i32(flat), i32(last)

    def reference(self, q, qo_indptr, pages, lens, m, causal, **kw):
        indptr, indices, last = self.tables(pages, lens, self.ps)
        cache = (self.kv[:, 0].cpu().float(), self.kv[:, 1].cpu().float())
        return paged_reference(
            q.cpu().float(),
            cache,
            qo_indptr.cpu(),
            indptr,
            indices,
            last,
            causal=causal,
            sm_scale=kw.pop("sm_scale", m.sm_scale),
            logits_soft_cap=kw.pop("logits_soft_cap", m.cap_or_none),
            window_left=kw.pop("window_left", m.window_left),
        )
