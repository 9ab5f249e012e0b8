#!/usr/bin/env python3
"""The arithmetic of doc/selection.md's proposal "k_hist's masses relative to each bin", checked.

Emulates in float32 (numpy) what the GPU would compute for each score: its bin as lbin does, the
bin's top r_b in nats, x = (h - r_b) + l from the exact split h + l = fl(s - max) * scale,
delta = -expm1(x) by a four-term Horner polynomial, D = round(delta * 2^21); and compares
e^(r_b) (1 - D 2^-21) with exp((double)(s - max) * scale), the CPU's term. Prints the largest
relative error per term, D's range and how often h - r_b was not exact. Run: python3 doc/selection_binmass.py
"""
import numpy as np
f32 = np.float32
rng = np.random.default_rng(7)
worst = 0.0; dmin = 1 << 30; dmax = -(1 << 30); inexact = 0; n_all = 0
for trial in range(60):
    n = 1 << 16
    scale = f32(rng.choice([0.0883883476, 0.125, 0.0625, 0.3]))
    spread = rng.choice([2.0, 8.0, 30.0, 120.0, 600.0])
    s = (rng.standard_normal(n) * spread + rng.uniform(-50, 50)).astype(f32)
    if trial % 3 == 0:
        s[: n // 64] += f32(spread * 3)  # a few heavy keys
    mx = s.max(); lo = s.min()
    span = min(f32(mx - lo), f32(f32(64.0) / scale))
    inv_w = f32(f32(2048.0) / span)
    b = np.minimum(np.trunc(((mx - s).astype(f32) * inv_w).astype(f32)), 2047).astype(np.int64)
    d = (s - mx).astype(f32)                      # fl(s - max), the CPU's
    h = (d * scale).astype(f32)
    l = ((d.astype(np.float64) * np.float64(scale)) - h.astype(np.float64)).astype(f32)  # FMA split
    w_nats = np.float64(span) * np.float64(scale) / 2048.0
    r = (-(b.astype(np.float64)) * w_nats).astype(f32)          # the bin's top, a float
    keep = h >= f32(-28.0)                                       # count-only below, as today
    hr64 = h.astype(np.float64) - r.astype(np.float64)
    hr = (h - r).astype(f32)
    inexact += int(np.sum((hr.astype(np.float64) != hr64) & keep))
    x = (hr + l).astype(f32)
    # delta = -expm1(x), Horner in float32
    p = (f32(1.0 / 24) * x + f32(1.0 / 6)).astype(f32)
    p = (p * x + f32(0.5)).astype(f32)
    p = (p * x + f32(1.0)).astype(f32)
    delta = (-(p * x)).astype(f32)
    D = np.rint((delta * f32(2.0 ** 21)).astype(f32)).astype(np.int64)
    est = np.exp(r.astype(np.float64)) * (1.0 - D.astype(np.float64) * 2.0 ** -21)
    true = np.exp(d.astype(np.float64) * np.float64(scale))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(est - true) / true
    worst = max(worst, float(rel[keep].max()))
    dmin = min(dmin, int(D[keep].min())); dmax = max(dmax, int(D[keep].max()))
    n_all += int(keep.sum())
print(f"{n_all} terms: worst relative error {worst:.3e} = 2^{np.log2(worst):.2f}; "
      f"D in [{dmin}, {dmax}] (2^{np.log2(max(dmax,1)):.2f}); inexact h - r_b: {inexact}")
