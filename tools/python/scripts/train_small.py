#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a small Llama-architecture model on real text present on this machine, for kvtier's
proofs (a randomly initialised model attends almost uniformly, so Top-p would keep almost
everything and agreement would be trivially high).

Text: the Python source files of the installed packages (bytes, a 256-token byte vocabulary), one
package (--eval-package, default transformers) held out for evaluation. Model: transformers'
LlamaForCausalLM (GQA, RoPE), by default 6 layers, 8 query / 2 KV heads, head_dim 128, 8K context,
trained for --minutes with AdamW under bf16 autocast and SDPA attention, then saved with
save_pretrained (bf16) beside kvtier_tokenizer.json and train_meta.json. Prints one JSON line per
evaluation.

    tools/python/scripts/train_small.py --out /tmp/small --minutes 5
    tools/python/scripts/train_small.py --out /tmp/small-quick --quick      # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import batches, emit, eval_docs, save_bytes_tokenizer, train_text  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for save_pretrained")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time (default 5)")
    ap.add_argument("--quick", action="store_true",
                    help="4 layers, hidden 512, context 4096, 1.5 minutes")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-package", default="transformers",
                    help="installed package held out for evaluation (default transformers)")
    ap.add_argument("--train-bytes", type=int, default=400 << 20,
                    help="training text read, at most (default 400 MiB)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.quick:
        a.layers, a.hidden, a.context, a.batch = 4, 512, 4096, 8
        a.minutes = min(a.minutes, 1.5)
        a.train_bytes = min(a.train_bytes, 120 << 20)
    return a


def held_out_loss(model, torch, data: np.ndarray, ctx: int, n: int) -> float:
    """Mean next-byte loss (nats) over n windows of ctx bytes of the held-out text."""
    model.eval()
    losses = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for i in range(n):
            s = (len(data) - ctx - 1) * i // max(1, n)
            x = torch.from_numpy(data[s:s + ctx + 1].astype(np.int64)).cuda()
            logits = model(input_ids=x[None, :-1]).logits[0].float()
            losses.append(float(torch.nn.functional.cross_entropy(logits, x[1:])))
    model.train()
    return float(np.mean(losses))


def main() -> None:
    a = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        sys.exit("train_small: needs a CUDA GPU")
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    t0 = time.time()
    data = train_text(a.eval_package, a.train_bytes)
    held = np.frombuffer(b"".join(eval_docs(a.eval_package, a.context + 1, 8)), dtype=np.uint8)
    emit("train_data", train_bytes=int(len(data)), eval_package=a.eval_package,
         eval_bytes=int(len(held)), read_s=round(time.time() - t0, 1))

    cfg = LlamaConfig(vocab_size=256, hidden_size=a.hidden,
                      intermediate_size=int(a.hidden * 8 / 3) // 64 * 64,
                      num_hidden_layers=a.layers, num_attention_heads=a.q_heads,
                      num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                      max_position_embeddings=max(a.context, 131072),
                      bos_token_id=None, eos_token_id=None, pad_token_id=0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).cuda().train()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    budget, warm = a.minutes * 60.0, 50
    start, step, tokens, last_eval = time.time(), 0, 0, 0.0
    loss_avg = None
    while True:
        frac = (time.time() - start) / budget
        if frac >= 1.0:
            break
        cosine = 0.5 * (1 + math.cos(math.pi * frac))
        lr = a.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * cosine)
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(batches(data, a.context, a.batch, rng)).cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.shape[0] * a.context
        v = float(loss) if step % 10 == 0 else None
        if v is not None:
            loss_avg = v if loss_avg is None else 0.9 * loss_avg + 0.1 * v
        if time.time() - last_eval > 60 and step > 1:
            last_eval = time.time()
            emit("train_progress", step=step, tokens=tokens, loss=loss_avg, lr=lr,
                 elapsed_s=round(time.time() - start, 1))
    ev = held_out_loss(model, torch, held, a.context, 4)
    emit("train_done", steps=step, tokens=tokens, params=n_params, train_loss_nats=loss_avg,
         eval_loss_nats=ev, eval_bits_per_byte=ev / math.log(2), eval_package=a.eval_package,
         minutes=round((time.time() - start) / 60, 2))
    os.makedirs(a.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(a.out)
    why = save_bytes_tokenizer(a.out)
    if why:
        emit("train_tokenizer", saved=False, reason=why,
             note="proof.py reads kvtier_tokenizer.json; capture_trace.py --prompt-file needs "
                  "the transformers tokenizer")
    with open(os.path.join(a.out, "train_meta.json"), "w") as f:
        json.dump({"eval_package": a.eval_package, "context": a.context, "steps": step,
                   "tokens": tokens, "eval_loss_nats": ev, "train_loss_nats": loss_avg,
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "tool": "tools/python/scripts/train_small.py"}, f, indent=2)
    emit("train_saved", out=a.out)


if __name__ == "__main__":
    main()
