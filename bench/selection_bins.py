#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""How many candidates the GPU threshold's boundary bin would hold under each binning, on a trace's
decode steps (doc/selection.md, "A scan-built histogram without an anchor": its open question).

The threshold (gpu/select.cu) bins a segment's scores by their distance below its max, 2048 bins
over min(range, 64 nats), and lists the scores of the bin holding the Top-p cut as candidates: up to
512 are sorted by rank, up to 16384 (the list's length at 128K tokens) resolved by radix levels,
more take the whole-segment path; 4096 is the most the scan's ring may serve (kvt_gpu_bins). A
histogram built by the scan, before the max is known, needs either bins on an absolute grid (a
fixed width in nats) or an anchor (the previous step's max plus a margin, and a fallback when a
step's max passes it). For every decode step, layer and query head this prints:

- the cut's bin population under today's bins, under absolute grids of 1/16, 1/32, 1/64 and
  1/128 nat, and under the 1/32-nat grid with its cut bin refined by 2048 sub-bins (a second
  histogram in the candidate pass), as percentiles over the segments and the share past each of
  the resolution's limits; and today's bin width (the segment's span, at most 64 nats, over
  2048), whose median says how much finer than 1/32 nat today's bins are;
- how often a step's max lies above the previous step's max plus a margin (0.5, 1, 2 nats): the
  anchor's fallback rate;
- how often the scan's ring (gpu/scanbins.h: 2048 slots of 1/32 nat, bin b mod 2048) cannot serve
  a segment because its scores' bins span 2048 or more (about 64 nats), and the spans themselves;
  and the share the threshold takes from the ring (gpu/select.cu's hist_from_ring: the span
  within the ring and the cut's 1/32-nat bin within the limit, 512 by default, 4096 at most);
  the same for a ring of 2048 slots of 1/16 nat (128 nats; scanbins.h's KVT_BINS_GRID 16, a build
  option).

Scores are the exact logits q.k / sqrt(d) over every token the step attends (the trace's prefill
plus the decode tokens so far), or with --estimate a RaBitQ 1-bit estimate of them (per-head
centroid, a random rotation, the query in full precision: close to, not equal to, the library's
estimator, whose query is 4-bit). Only numpy is needed; a trace of a trained model comes from
tools/python/scripts/train_small.py and tools/capture_trace.py (bench/trace_spilled.sh shows the
two commands). --synthetic runs on random normal keys and queries instead, to check the script.

    python3 bench/selection_bins.py TRACE_DIR [--p 0.9] [--layers 0,3] [--estimate]
    python3 bench/selection_bins.py --synthetic
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

BINS, SPAN_NATS = 2048, 64.0
LIMITS = ((512, "rank sort"), (4096, "ring limit"), (16384, "list"))
GRIDS = (16, 32, 64, 128)  # bins per nat
RINGS = (32, 16)  # the ring's grid (2048 slots of 1/32 nat), and one spanning 128 nats
MARGINS = (0.5, 1.0, 2.0)


def load_trace(path: str, layers: list[int] | None):
    """Yields (layer, prefill q/k, decode q/k, n_q_heads, n_kv_heads, head_dim) per layer."""
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"selection_bins: {path}: not a kvtier-trace directory (doc/trace-format.md): {e}")
    n_layers = int(meta["n_layers"])
    for layer in layers if layers is not None else range(n_layers):
        if not 0 <= layer < n_layers:
            sys.exit(f"selection_bins: --layers {layer}: the trace has layers 0 to {n_layers - 1}")
        arrays = {}
        for part in ("prefill", "decode"):
            for what in ("q", "k"):
                f = os.path.join(path, f"layer{layer}.{part}.{what}.npy")
                try:
                    arrays[part, what] = np.load(f).astype(np.float32)
                except (OSError, ValueError) as e:
                    sys.exit(f"selection_bins: {f}: {e}")
        yield (layer, arrays["prefill", "k"], arrays["decode", "q"], arrays["decode", "k"],
               int(meta["n_q_heads"]), int(meta["n_kv_heads"]), int(meta["head_dim"]))


def synthetic(seed: int = 1):
    """One layer of random normal keys and queries, some keys heavy, as load_trace yields it."""
    rng = np.random.default_rng(seed)
    t, s, hq, hkv, d = 8192, 16, 8, 2, 128
    k = rng.standard_normal((t + s, hkv, d), dtype=np.float32)
    k[rng.random(t + s) < 0.01] *= 3.0
    q = rng.standard_normal((s, hq, d), dtype=np.float32) * 1.5
    yield 0, k[:t], q, k[t:], hq, hkv, d


class Estimator:
    """RaBitQ's 1-bit estimate of q.k for one KV head's keys (centroid from the prefill keys)."""

    def __init__(self, keys: np.ndarray, d: int, seed: int):
        rng = np.random.default_rng(seed)
        self.rot = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
        self.c = keys.mean(axis=0)
        self.d = d

    def codes(self, keys: np.ndarray):
        r = (keys - self.c) @ self.rot.T
        norm = np.linalg.norm(r, axis=1)
        b = np.where(r >= 0, 1.0, -1.0).astype(np.float32) / np.sqrt(self.d)
        cos = np.einsum("ij,ij->i", r, b) / np.maximum(norm, 1e-30)  # <unit r, code>
        return b, norm, cos

    def dots(self, q: np.ndarray, codes) -> np.ndarray:
        b, norm, cos = codes
        return float(q @ self.c) + norm * (b @ (self.rot @ q)) / np.maximum(cos, 1e-30)


def cut_score(x: np.ndarray, p: float) -> float:
    """The lowest selected score of Top-p over x (nats): a token is in iff the mass strictly
    above it is below p Z; ties go together."""
    s = np.sort(x)[::-1].astype(np.float64)
    w = np.exp(s - s[0])
    above = np.concatenate(([0.0], np.cumsum(w)[:-1]))
    # the mass strictly above a tie group is the mass above its first member
    first = np.searchsorted(-s, -s, side="left")
    inside = above[first] < p * w.sum()
    return float(s[np.nonzero(inside)[0][-1]])


def cut_bin_sizes(x: np.ndarray, c: float) -> dict[str, int]:
    """The population of the bin holding the cut c, under today's bins and each absolute grid."""
    mx, mn = float(x.max()), float(x.min())
    out = {}
    span = min(mx - mn, SPAN_NATS)
    if span > 0:
        inv = BINS / span
        b = np.minimum(np.floor((mx - x) * inv), BINS - 1)
        out["today"] = int(np.count_nonzero(b == min(np.floor((mx - c) * inv), BINS - 1)))
    else:
        out["today"] = x.size
    for g in GRIDS:
        pos, cpos = -x * g, -c * g
        cell = np.floor(pos) == np.floor(cpos)
        out[f"1/{g} nat"] = int(np.count_nonzero(cell))
        if g == RINGS[0]:
            # the cut's cell refined by the candidate pass with BINS sub-bins first
            sub = np.floor((pos - np.floor(pos)) * BINS)
            out[f"1/{g} refined"] = int(np.count_nonzero(
                cell & (sub == np.floor((cpos - np.floor(cpos)) * BINS))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", help="a kvtier-trace directory (doc/trace-format.md)")
    ap.add_argument("--p", type=float, default=0.9, help="Top-p mass (default 0.9)")
    ap.add_argument("--layers", help="layers, e.g. 0,3 (default all)")
    ap.add_argument("--estimate", action="store_true", help="1-bit estimates, not exact logits")
    ap.add_argument("--synthetic", action="store_true", help="random keys and queries")
    a = ap.parse_args()
    if not 0.0 < a.p < 1.0:
        ap.error(f"--p {a.p}: must lie in (0, 1)")
    if bool(a.trace) == a.synthetic:
        ap.error("give a trace directory or --synthetic, one of them")
    layers = None
    if a.layers:
        try:
            layers = [int(v) for v in a.layers.split(",")]
        except ValueError:
            ap.error(f"--layers {a.layers}: not a list of integers")
    source = synthetic() if a.synthetic else load_trace(a.trace, layers)

    sizes: dict[str, list[int]] = {}
    spans: list[float] = []
    ranges: list[float] = []
    wraps = {r: 0 for r in RINGS}
    served = {r: {lim: 0 for lim, _ in LIMITS[:2]} for r in RINGS}
    jumps = {m: 0 for m in MARGINS}
    pairs = segs = 0
    for layer, pk, dq, dk, hq, hkv, d in source:
        g = hq // hkv
        keys_all = np.concatenate([pk, dk], axis=0)  # [T + S, hkv, d]
        t = pk.shape[0]
        est = [Estimator(pk[:, h], d, 1000 * layer + h) for h in range(hkv)] if a.estimate else None
        codes = [est[h].codes(keys_all[:, h]) for h in range(hkv)] if a.estimate else None
        prev_max = [None] * hq
        for step in range(dq.shape[0]):
            n = t + step + 1
            for j in range(hq):
                h = j // g
                q = dq[step, j]
                if a.estimate:
                    b, norm, cos = codes[h]
                    dots = est[h].dots(q, (b[:n], norm[:n], cos[:n]))
                else:
                    dots = keys_all[:n, h] @ q
                x = dots / np.sqrt(d)
                cut = cut_bin_sizes(x, cut_score(x, a.p))
                for k, v in cut.items():
                    sizes.setdefault(k, []).append(v)
                mx = float(x.max())
                mn = float(x.min())
                spans.append(min(mx - mn, SPAN_NATS))
                ranges.append(mx - mn)
                # the ring's test, on the bins of the extremes (what the statistics give)
                for r in RINGS:
                    wrap = np.floor(-mn * r) - np.floor(-mx * r) >= BINS
                    wraps[r] += wrap
                    for lim in served[r]:
                        served[r][lim] += not wrap and cut[f"1/{r} nat"] <= lim
                if prev_max[j] is not None:
                    pairs += 1
                    for m in MARGINS:
                        jumps[m] += mx > prev_max[j] + m
                prev_max[j] = mx
                segs += 1
        print(f"layer {layer}: {dq.shape[0]} steps x {hq} query heads, {t} + steps tokens",
              file=sys.stderr)

    what = "1-bit estimates" if a.estimate else "exact logits"
    print(f"{segs} segments ({what}, p = {a.p}): the cut's bin population")
    print(f"{'bins':>12} {'median':>8} {'p95':>8} {'p99':>8} {'max':>8}" +
          "".join(f" {'>' + str(lim) + ' (' + name + ')':>18}" for lim, name in LIMITS))
    for k, v in sizes.items():
        arr = np.array(v)
        row = f"{k:>12} {np.median(arr):8.0f} {np.percentile(arr, 95):8.0f} " \
              f"{np.percentile(arr, 99):8.0f} {arr.max():8d}"
        row += "".join(f" {100.0 * np.mean(arr > lim):17.2f}%" for lim, _ in LIMITS)
        print(row)
    sp = np.array(spans)
    print(f"today's bin width: median 1/{BINS / np.median(sp):.0f} nat (span {np.median(sp):.1f} "
          f"nats), 5th percentile 1/{BINS / np.percentile(sp, 5):.0f}, 95th "
          f"1/{BINS / np.percentile(sp, 95):.0f}")
    rg = np.array(ranges)
    print(f"the scores' span: median {np.median(rg):.1f} nats, 95th percentile "
          f"{np.percentile(rg, 95):.1f}, max {rg.max():.1f}")
    for r in RINGS:
        option = ", a build option" if r != RINGS[0] else ""
        print(f"the scan's ring ({BINS} slots of 1/{r} nat{option}): segments whose bins span "
              f"{BINS} or more, which take the threshold's own passes: "
              f"{100.0 * wraps[r] / segs:.2f}%; the threshold takes its first histogram "
              "from the ring (span within it, the cut's bin within the limit) on " +
              ", ".join(f"{100.0 * v / segs:.2f}% at a limit of {lim}"
                        for lim, v in served[r].items()))
    if pairs:
        print(f"anchor (the previous step's max plus a margin), {pairs} consecutive pairs: a max "
              "above it, the fallback rate: " +
              ", ".join(f"margin {m} nat {100.0 * jumps[m] / pairs:.2f}%" for m in MARGINS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
