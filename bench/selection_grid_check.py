#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The arithmetic of a Top-p histogram on an absolute grid (doc/selection.md, "A scan-built
histogram without an anchor"), emulated in float32 as a kernel would compute it, against the exact
terms.

A scan that bins scores before it knows their segment's max puts score s in bin b = floor(s c),
c = fl(scale * G) for G bins a nat, and weighs it by a term relative to the bin's top edge
e_b = (b + 1) / G nats: t = exp(x), x = s scale - e_b, in (-1/G, 0] up to rounding. The decision
later multiplies a bin's sum by exp(e_b - M scale) in double. Today's threshold instead computes
d = fl(s - M) first and the term exp(d scale); its stated tolerance (doc/selection.md) assumes a
relative error below 2^-21 per term against exp(d scale). This prints, over score sets of several
spreads and scales (float32 scores, the exact values in long double):

1. x's range (it must stay near (-1/G, 0], or the fixed point's range is wrong), and whether b is
   monotone in s;
2. the worst relative error of t exp(e_b - M scale) against exp(d scale), with x computed plainly
   (fl(s scale) - e_b) and with an FMA split (h + l = s scale exactly, x = (h - e_b) + l);
3. the worst, over the sets, of the mass error relative to Z that the terms' errors add up to, and
   of the part of it that comes from not rounding s - M to float (the definition's d) at all.

Exit status 0 when the FMA split keeps every term within 2^-21 of exp(d scale) relative to the
segment's largest term (the form the tolerance's n 2^-38 and 2^-19 Z parts need), 1 otherwise.
Only numpy. Run: python3 bench/selection_grid_check.py [--grid 32]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

F32 = np.float32
LD = np.longdouble


def score_sets(rng: np.random.Generator):
    """(scores, scale) pairs: normal logits of several spreads, offsets that make |s scale| large
    (the case the absolute grid is sensitive to), heavy keys, and near-flat sets."""
    for spread in (2.0, 8.0, 30.0, 120.0):
        for scale in (0.0625, 0.088, 0.125, 0.3):
            for offset in (0.0, 40.0, -300.0):
                n = 4096
                s = rng.standard_normal(n) * (spread / scale / 3.0) + offset / scale
                s[rng.random(n) < 0.002] += 20.0 / scale  # a few heavy keys
                yield s.astype(F32), F32(scale)
    for scale in (0.0625, 0.3):
        s = (rng.random(4096) * 1e-3 + 5.0).astype(F32)  # near-flat
        yield s, F32(scale)


def emulate(s: np.ndarray, scale: F32, grid: int):
    c = F32(scale * F32(grid))
    b = np.floor(s * c).astype(np.int64)  # float32 product, then floor
    edge = ((b + 1).astype(F32) / F32(grid)).astype(F32)  # exact: grid is a power of two
    x_plain = (s * scale).astype(F32) - edge
    h = (s * scale).astype(F32)
    l_err = (s.astype(LD) * LD(scale) - h.astype(LD))  # what an FMA gives as the low part
    l = l_err.astype(F32)
    x_fma = ((h - edge).astype(F32) + l).astype(F32)
    return b, edge, x_plain.astype(F32), x_fma


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", type=int, default=32, help="bins a nat, a power of two (default 32)")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if a.grid < 1 or a.grid & (a.grid - 1):
        ap.error(f"--grid {a.grid}: must be a power of two")
    rng = np.random.default_rng(a.seed)
    w = 1.0 / a.grid
    xmin, xmax, monotone = np.inf, -np.inf, True
    worst_plain = worst_fma = 0.0  # relative to the segment's largest term
    worst_mass = worst_def = 0.0  # relative to Z
    sets = 0
    for s, scale in score_sets(rng):
        sets += 1
        order = np.argsort(s, kind="stable")
        b, edge, x_plain, x_fma = emulate(s, scale, a.grid)
        monotone &= bool(np.all(np.diff(b[order]) >= 0))
        xmin, xmax = min(xmin, float(x_fma.min())), max(xmax, float(x_fma.max()))
        m = s.max()
        d = (s - m).astype(F32)  # the definition's d = fl(s - max)
        ref = np.exp(d.astype(LD) * LD(scale))  # exact terms of the definition
        exact = np.exp((s.astype(LD) - LD(m)) * LD(scale))  # without rounding s - max
        back = np.exp(edge.astype(LD) - LD(m) * LD(scale))  # the decision's factor, as if exact
        for x, name in ((x_plain, "plain"), (x_fma, "fma")):
            t = np.exp(x.astype(F32)).astype(F32)  # expf: within an ulp or so; see below
            got = t.astype(LD) * back
            err = float(np.max(np.abs(got - ref)))  # the largest term is about 1
            if name == "plain":
                worst_plain = max(worst_plain, err)
            else:
                worst_fma = max(worst_fma, err)
                worst_mass = max(worst_mass, float(np.abs(np.sum(got) - np.sum(ref)) /
                                                   np.sum(ref)))
        worst_def = max(worst_def, float(np.abs(np.sum(exact) - np.sum(ref)) / np.sum(ref)))
    lg = lambda v: "-inf" if v == 0 else f"{np.log2(v):.1f}"  # noqa: E731
    print(f"{sets} score sets of 4096, grid 1/{a.grid} nat")
    print(f"x range with the FMA split: [{xmin:.6g}, {xmax:.6g}] (the bin's (-{w:g}, 0]); "
          f"bins monotone in the score: {'yes' if monotone else 'NO'}")
    print(f"worst term error against exp(fl(s - max) scale), relative to the largest term: "
          f"plain 2^{lg(worst_plain)}, FMA split 2^{lg(worst_fma)} (the tolerance assumes 2^-21)")
    print(f"worst mass error relative to Z with the FMA split: 2^{lg(worst_mass)}; of which the "
          f"definition's rounding of s - max, ignored by the grid: up to 2^{lg(worst_def)}")
    ok = monotone and worst_fma <= 2.0 ** -21
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
