"""``kernels.fastmath.exp2_fma``: its PTX emulated bit for bit in numpy (f32 arithmetic, the same
constants parsed from the PTX text), so a wrong coefficient, clamp or select shows here; the
GPU tests of soft-cap and FlashSigmoid run it in the kernels."""
import re

import numpy as np

from cute_attn.kernels import fastmath


def _f32(hexlit):
    return np.uint32(int(hexlit[2:], 16)).view(np.float32)


def _emulate(x):
    """The PTX block, instruction by instruction (round-to-nearest f32, flush-to-zero irrelevant
    above 2^-126)."""
    ptx = fastmath._PTX
    consts = {m: _f32(m) for m in re.findall(r"0f[0-9A-F]{8}", ptx)}
    hi = _f32(re.search(r"min\.ftz\.f32 xc, \$1, (0f\w+);", ptx).group(1))
    magic = _f32(re.search(r"add\.rn\.ftz\.f32 t, xc, (0f\w+);", ptx).group(1))
    lo = _f32(re.search(r"setp\.gt\.ftz\.f32 big, \$1, (0f\w+);", ptx).group(1))
    c3, c2 = (consts[m] for m in re.search(r"fma\.rn\.ftz\.f32 p, f, (0f\w+), (0f\w+);", ptx).groups())
    c1 = consts[re.search(r"fma\.rn\.ftz\.f32 p, p, f, (0f\w+);\nfma", ptx).group(1)]
    c0 = consts[re.findall(r"fma\.rn\.ftz\.f32 p, p, f, (0f\w+);", ptx)[-1]]
    x = x.astype(np.float32)
    with np.errstate(all="ignore"):
        xc = np.where(np.isnan(x), hi, np.minimum(x, hi)).astype(np.float32)  # PTX min drops NaN
        t = (xc + magic).astype(np.float32)
        f = (xc - (t - magic).astype(np.float32)).astype(np.float32)
        p = (f * c3 + c2).astype(np.float32)
        p = (p * f + c1).astype(np.float32)
        p = (p * f + c0).astype(np.float32)
        bits = (p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))).astype(np.uint32)
        return np.where(x > lo, bits.view(np.float32), np.float32(0.0))


def test_exp2_fma_accuracy_and_edges():
    x = np.concatenate([np.linspace(-125.99, 127.0, 1_000_001), np.random.default_rng().uniform(-30, 0, 100_000)])
    y = _emulate(x).astype(np.float64)
    rel = np.abs(y / np.exp2(x.astype(np.float32).astype(np.float64)) - 1)
    assert rel.max() < 7.6e-5, rel.max()
    edge = np.array([-np.inf, np.nan, -126.0, -1000.0, np.inf, 128.0, 1e30], np.float32)
    out = _emulate(edge)
    assert (out[:4] == 0).all()  # masked scores contribute exactly nothing
    assert np.isfinite(out[4:]).all() and (out[4:] > 1e38).all()
    assert not (_emulate(np.linspace(-200, 200, 100_001)) < 0).any()
