#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write bench/gpu_decode's synthetic workload as a kvtier trace (doc/trace-format.md), so that
`kvbench --trace DIR` replays it on the CPU and simulates the hot cache on its queries beside the
traces of trained models (tools/kvbench_hotsim.c: hit rates at 1/32 .. 1/2 of a layer's rows and
the self-sized rule's).

The generator is gpu_decode_workload.cuh's, drawn with numpy's generator instead of its hashes (so
the same distribution, not the same numbers): per KV head NTOPIC random topic directions (norm
about 1) and a bias; passages of TOPIC_RUN tokens, each about one topic; a key is
a * topic + bias + N(0, 1) per element with a uniform in [4.8, 8]; a value N(0, 1). A decode query
of KV head h's group looks for its own topic (that of a passage at a position fixed per KV head),
12 * topic + N(0, 0.3^2) noise fresh per step and query head; with --drift D also for a second
topic, drawn afresh at each step: 12 * (sqrt(1 - D) own + sqrt(D) second) + noise. Prefill queries
look for a random topic each. One sequence, one layer (fp16), 32 query heads, 8 KV heads, head
dim 128.

How the second topic is drawn (--second):
  uniform    gpu_decode's: the topic of a passage at a uniform position of the context, so over
             the steps every passage's topic comes back about equally often;
  zipf:A     the passage of rank k (in an order drawn once per KV head) with probability
             proportional to (k + 1)^-A: some passages come back often and most rarely, as the
             tokens a trained model's queries return to.

Usage: bench/drift_trace.py OUT_DIR [--context N] [--steps S] [--drift D] [--second uniform|zipf:A]
       [--seed N]; then build/tools/kvbench --trace OUT_DIR --backend cpu --json --quiet.
"""
import argparse
import json
import os
import sys

import numpy as np

HKV, HQ, D = 8, 32, 128
G = HQ // HKV
NTOPIC, TOPIC_RUN = 32, 512
KEY_A0, KEY_A1, KEY_NOISE, BIAS, Q_STRENGTH, Q_NOISE = 4.8, 3.2, 1.0, 0.7, 12.0, 0.3
CHUNK = 8192  # tokens generated at a time


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=8192, help="prefill tokens (default 8192)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps (default 64)")
    ap.add_argument("--drift", type=float, default=0.5, help="weight of the second topic (0.5)")
    ap.add_argument("--second", default="uniform", help="uniform (default) or zipf:A")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if not 0.0 <= a.drift <= 1.0:
        ap.error(f"--drift {a.drift}: must be in [0, 1]")
    if a.context < TOPIC_RUN or a.steps < 1:
        ap.error(f"--context {a.context} must be >= {TOPIC_RUN} and --steps {a.steps} >= 1")
    if a.second == "uniform":
        a.zipf = None
    elif a.second.startswith("zipf:"):
        try:
            a.zipf = float(a.second[5:])
        except ValueError:
            ap.error(f"--second {a.second}: zipf:A needs a number A")
        if not a.zipf >= 0.0:
            ap.error(f"--second {a.second}: A must be >= 0")
    else:
        ap.error(f"--second {a.second}: must be uniform or zipf:A")
    return a


def main():
    a = parse()
    rng = np.random.default_rng(a.seed)
    topic = (rng.standard_normal((HKV, NTOPIC, D)) / np.sqrt(D)).astype(np.float32)
    bias = (BIAS * rng.standard_normal((HKV, D))).astype(np.float32)
    T, S = a.context, a.steps
    n_pass = (T + S + TOPIC_RUN - 1) // TOPIC_RUN
    pass_topic = rng.integers(0, NTOPIC, size=(HKV, n_pass))  # tok_topic per (head, passage)
    os.makedirs(a.out, exist_ok=True)

    def kv(g, p0, n):
        """K and V [n, HKV, D] of positions p0 .. p0 + n, noise from generator g."""
        pos = np.arange(p0, p0 + n)
        t = pass_topic[:, pos // TOPIC_RUN]  # [HKV, n]
        amp = KEY_A0 + KEY_A1 * g.random((n, HKV), dtype=np.float32)
        k = amp[:, :, None] * topic[np.arange(HKV)[None, :], t.T] + bias[None]
        k += KEY_NOISE * g.standard_normal((n, HKV, D), dtype=np.float32)
        v = g.standard_normal((n, HKV, D), dtype=np.float32)
        return k, v

    def open_npy(name, shape):
        return np.lib.format.open_memmap(os.path.join(a.out, name), mode="w+", dtype="<f2",
                                         shape=shape)

    # prefill K and V, in chunks
    g = np.random.default_rng([a.seed, 1])
    pk, pv = open_npy("layer0.prefill.k.npy", (T, HKV, D)), open_npy("layer0.prefill.v.npy",
                                                                     (T, HKV, D))
    for p0 in range(0, T, CHUNK):
        n = min(CHUNK, T - p0)
        k, v = kv(g, p0, n)
        pk[p0:p0 + n], pv[p0:p0 + n] = k.astype(np.float16), v.astype(np.float16)
    pk.flush()
    pv.flush()
    del pk, pv

    # prefill queries: each query head looks for a random topic
    r = np.random.default_rng([a.seed, 3])
    heads = np.arange(HQ) // G
    pq = open_npy("layer0.prefill.q.npy", (T, HQ, D))
    for p0 in range(0, T, CHUNK):
        n = min(CHUNK, T - p0)
        t = r.integers(0, NTOPIC, size=(n, HQ))
        q = Q_STRENGTH * topic[heads[None, :], t]
        q += Q_NOISE * r.standard_normal((n, HQ, D), dtype=np.float32)
        pq[p0:p0 + n] = q.astype(np.float16)
    pq.flush()
    del pq

    # decode: token T + s is appended at step s, then its query attends
    r = np.random.default_rng([a.seed, 4])
    own_pos = r.integers(0, T, size=HKV)  # focus: a position per KV head (the sequence's)
    own = pass_topic[np.arange(HKV), own_pos // TOPIC_RUN]
    if a.zipf is not None:
        n_ctx_pass = (T + TOPIC_RUN - 1) // TOPIC_RUN
        order = np.stack([r.permutation(n_ctx_pass) for _ in range(HKV)])  # rank -> passage
        w = (np.arange(n_ctx_pass) + 1.0) ** -a.zipf
        w /= w.sum()
    dk = np.zeros((S, HKV, D), np.float32)
    dv = np.zeros((S, HKV, D), np.float32)
    dq = np.zeros((S, HQ, D), np.float32)
    g = np.random.default_rng([a.seed, 5])
    for s in range(S):
        k, v = kv(g, T + s, 1)
        dk[s], dv[s] = k[0], v[0]
        if a.zipf is None:
            f2 = r.integers(0, T, size=HKV)
            second = pass_topic[np.arange(HKV), f2 // TOPIC_RUN]
        else:
            rank = r.choice(len(w), size=HKV, p=w)
            second = pass_topic[np.arange(HKV), order[np.arange(HKV), rank]]
        for j in range(HQ):
            h = j // G
            x = np.sqrt(1.0 - a.drift) * topic[h, own[h]] + np.sqrt(a.drift) * topic[h, second[h]]
            dq[s, j] = Q_STRENGTH * x + Q_NOISE * r.standard_normal(D, dtype=np.float32)
    for name, arr in (("k", dk), ("v", dv), ("q", dq)):
        np.save(os.path.join(a.out, f"layer0.decode.{name}.npy"),
                np.ascontiguousarray(arr.astype("<f2")))
    meta = {
        "format": "kvtier-trace",
        "version": 1,
        "model": f"gpu_decode synthetic workload, drift {a.drift}, second topic {a.second}",
        "n_layers": 1,
        "n_q_heads": HQ,
        "n_kv_heads": HKV,
        "head_dim": D,
        "dtype": "float16",
        "rope": "none (synthetic)",
        "scale": None,
        "prefill_tokens": T,
        "decode_steps": S,
        "files": [f"layer0.{ph}.{x}.npy" for ph in ("prefill", "decode") for x in "qkv"],
        "capture": {"tool": "bench/drift_trace.py", "seed": a.seed},
    }
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"drift_trace: {T} + {S} tokens, drift {a.drift}, second topic {a.second} -> {a.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
