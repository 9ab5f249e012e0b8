#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""kvt_extend on the CUDA backend against PyTorch's scaled_dot_product_attention with everything
in HBM, on the shapes of bench/gpu_extend (Llama-3.1-8B attention: 32 query heads, 8 KV heads,
head_dim 128, fp16, batch 1): a chunk of C query rows attends causally to N stored keys and to
itself. Runs the gpu_extend binary (its "csv" lines), times SDPA in the same run (CUDA events,
median after warm-up), and prints each kvtier figure as a ratio to SDPA's time.

    python3 bench/extend_vs_sdpa.py BUILD/bench/gpu_extend [--contexts 8192,32768] [--chunks 16,4096]
"""
import argparse
import subprocess
import sys


def sdpa_ms(torch, N, C, reps):
    F = torch.nn.functional
    dev = "cuda"
    q = torch.randn(1, 32, C, 128, device=dev, dtype=torch.float16)
    k = torch.randn(1, 8, N + C, 128, device=dev, dtype=torch.float16)
    v = torch.randn(1, 8, N + C, 128, device=dev, dtype=torch.float16)
    # query row j sits at position N + j: it sees keys 0 .. N + j (bottom-right causal)
    mask = None
    if N > 0:
        kpos = torch.arange(N + C, device=dev)
        qpos = torch.arange(C, device=dev) + N
        mask = (kpos[None, :] <= qpos[:, None])[None, None]

    def run():
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    times = []
    for i in range(3 + reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        if i >= 3:
            times.append(e0.elapsed_time(e1))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--chunks", default="16,512,4096")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    r = subprocess.run([a.binary, "--contexts", a.contexts, "--chunks", a.chunks, "--reps",
                        str(a.reps)], capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        return r.returncode
    try:
        import torch
    except ImportError:
        print("extend_vs_sdpa: no PyTorch here: no SDPA to compare with")
        return 0
    if not torch.cuda.is_available():
        print("extend_vs_sdpa: PyTorch sees no CUDA device: no SDPA to compare with")
        return 0
    print("ratios to PyTorch SDPA (flash or efficient kernel, causal, GQA, all in HBM):")
    for line in r.stdout.splitlines():
        if not line.startswith("csv,"):
            continue
        _, N, C, call, stage, h2d, attend = line.split(",")
        N, C = int(N), int(C)
        s = sdpa_ms(torch, N, C, a.reps)
        print(f"N {N:7d} C {C:5d}: SDPA {s:8.3f} ms | kvt_extend {float(call) / s:7.2f}x | "
              f"its attention alone {float(attend) / s:6.2f}x | the PCIe copy of the rows "
              f"{float(h2d) / s:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
