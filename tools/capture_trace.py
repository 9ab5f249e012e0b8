#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Record a kvtier trace (doc/trace-format.md) from a Hugging Face causal LM.

The trace holds, per layer, the post-RoPE queries and the keys and values that the model's
attention actually receives, for a prefill of T tokens and then S greedy decode steps (one token
each), batch 1, no padding. `kvbench --trace DIR` replays it through kvtier.

How the tensors are caught: transformers (>= 4.48) routes every attention call of the models
ported to its attention interface through a function chosen by name (`attn_implementation`). This
script registers one ("kvtier_capture") that records (query, key, value) and then runs PyTorch's
scaled_dot_product_attention path (transformers' own "sdpa" function), so the model computes
exactly what it computes with attn_implementation="sdpa". The query and key it receives are after
RoPE (and after any q/k norm), the key and value after the cache update and before GQA repetition:
the last q_len positions are the new tokens. This is more robust than recomputing q/k/v in a
forward hook (fused qkv projections, partial rotary, q/k norms and scaling differ per family) or
patching `apply_rotary_pos_emb` (which does not see the values). A forward pre-hook on the model
numbers the attention calls of each forward pass, for models whose attention modules have no
`layer_idx`.

Model families whose transformers code calls the attention interface with post-RoPE q/k (written
against that code; see doc/trace-format.md for what was run): Llama 2/3/3.x, Mistral, Mixtral,
Qwen2/2.5/3, Gemma 1/2/3 (note: Gemma 2 logit softcapping and sliding-window layers are recorded
in meta.json but kvtier attends to every token without softcapping), Phi-3, Granite, OLMo 2,
SmolLM. Models still on the old code paths (e.g. GPT-2, GPT-J) are refused with a message.

Runs offline: either --model DIR (a local directory holding config, weights and tokenizer) or
--random-tiny (a randomly initialised 2-layer Llama, 4 query heads, 2 KV heads, head dim 64, built
from a LlamaConfig without any download).

Examples:
  tools/capture_trace.py --random-tiny --prefill 512 --decode 32 traces/tiny
  tools/capture_trace.py --model ~/models/Llama-3.2-1B --prompt-file book.txt --prefill 8192 \
      --decode 64 --device cuda traces/llama32-1b
  build/tools/kvbench --trace traces/llama32-1b --p 0.9
"""

import argparse
import json
import os
import sys

FORMAT = "kvtier-trace"
VERSION = 1
ATTN_NAME = "kvtier_capture"
ARRAYS = ("prefill.q", "prefill.k", "prefill.v", "decode.q", "decode.k", "decode.v")


def file_name(layer, array):
    return "layer%d.%s.npy" % (layer, array)


def save_npy(path, arr, dtype):
    """Write [tokens, heads, head_dim] little-endian C-order float16/float32 with numpy only."""
    import numpy as np

    want = np.dtype("<f2") if dtype == "float16" else np.dtype("<f4")
    out = np.ascontiguousarray(arr.astype(want, copy=False))
    if out.ndim != 3:
        raise ValueError("%s: want 3 dims, got shape %s" % (path, out.shape))
    if not np.isfinite(out).all():
        bad = np.argwhere(~np.isfinite(out))[0]
        raise ValueError("%s: element (token %d, head %d, dim %d) is not finite in %s%s"
                         % (path, bad[0], bad[1], bad[2], dtype,
                            " (use --dtype float32)" if dtype == "float16" else ""))
    np.save(path, out, allow_pickle=False)


def write_meta(out_dir, meta):
    """meta: the fields of doc/trace-format.md except format, version and files."""
    doc = {"format": FORMAT, "version": VERSION}
    doc.update(meta)
    doc["files"] = [file_name(l, a) for l in range(meta["n_layers"]) for a in ARRAYS]
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, ensure_ascii=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "meta.json"))


class Recorder:
    """Collects what the attention function sees, per layer, for one phase at a time."""

    def __init__(self, out_dir, dtype):
        self.out_dir, self.dtype = out_dir, dtype
        self.phase = None           # "prefill" or "decode"
        self.call = 0               # attention calls in the current forward pass
        self.decode = {}            # layer -> {"q": [..], "k": [..], "v": [..]} numpy rows
        self.shape = None           # (n_q_heads, n_kv_heads, head_dim)
        self.layers = set()
        self.scale = None
        self.notes = set()

    def pre_forward(self, module, args, kwargs):
        self.call = 0

    def record(self, module, query, key, value, kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = self.call
        self.call += 1
        b, hq, n, d = query.shape
        if b != 1 or key.shape[0] != 1:
            raise RuntimeError("capture needs batch 1, got %d" % b)
        hkv, kv_len = key.shape[1], key.shape[2]
        if kv_len < n or value.shape[:3] != key.shape[:3]:
            raise RuntimeError("layer %d: key %s / value %s do not hold the %d new tokens"
                               % (layer, tuple(key.shape), tuple(value.shape), n))
        shape = (hq, hkv, d)
        if self.shape is None:
            self.shape = shape
        elif self.shape != shape:
            raise RuntimeError("layer %d: heads/head_dim %s differ from %s: kvtier needs one "
                               "shape for all layers" % (layer, shape, self.shape))
        scale = kwargs.get("scaling")
        if scale is None:
            scale = getattr(module, "scaling", None)
        if scale is not None:
            scale = float(scale)
            if self.scale is None:
                self.scale = scale
            elif abs(self.scale - scale) > 1e-6 * abs(scale):
                raise RuntimeError("layer %d: attention scale %g differs from %g" %
                                   (layer, scale, self.scale))
        if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None):
            self.notes.add("attention logit softcapping (not modelled by kvtier)")
        if kwargs.get("sliding_window") is not None:
            self.notes.add("layer %d: sliding window %s (kvtier attends every token)"
                           % (layer, kwargs.get("sliding_window")))
        # [1, H, n, D] -> [n, H, D] floats on the host; bf16 -> f32 is exact
        rows = [t[0, :, -n:, :].transpose(0, 1).detach().float().cpu().numpy()
                for t in (query, key, value)]
        self.layers.add(layer)
        if self.phase == "prefill":
            for a, arr in zip(("q", "k", "v"), rows):
                save_npy(os.path.join(self.out_dir, file_name(layer, "prefill." + a)), arr,
                         self.dtype)
        else:
            if n != 1:
                raise RuntimeError("decode step with %d new tokens" % n)
            acc = self.decode.setdefault(layer, {"q": [], "k": [], "v": []})
            for a, arr in zip(("q", "k", "v"), rows):
                acc[a].append(arr)

    def write_decode(self):
        import numpy as np

        for layer, acc in self.decode.items():
            for a in ("q", "k", "v"):
                save_npy(os.path.join(self.out_dir, file_name(layer, "decode." + a)),
                         np.concatenate(acc[a], axis=0), self.dtype)


def install_attention(model, rec):
    """Register the capturing attention function and switch the model to it."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        sys.exit("capture_trace: this transformers has no attention interface (need >= 4.48)")

    def capture(module, query, key, value, attention_mask, **kwargs):
        rec.record(module, query, key, value, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    try:
        from transformers import AttentionInterface
        AttentionInterface.register(ATTN_NAME, capture)
    except ImportError:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS[ATTN_NAME] = capture
    try:  # the masks of sdpa (newer transformers build masks per implementation)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    except (ImportError, AttributeError):
        pass
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:
        model.config._attn_implementation = ATTN_NAME
    model.register_forward_pre_hook(rec.pre_forward, with_kwargs=True)


def tiny_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=max(4096, args.prefill + args.decode),
                      rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    # weights larger than the default init, so that attention is not uniform
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model, None


def load_model(args, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                 torch_dtype=torch_dtype)
    tok = None
    if args.prompt is not None or args.prompt_file is not None:
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    return model, tok


def prompt_ids(args, model, tok):
    import torch

    if args.prompt is None and args.prompt_file is None:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, model.config.vocab_size, (1, args.prefill), generator=g)
    text = args.prompt
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    ids = tok(text, return_tensors="pt").input_ids
    if ids.shape[1] < args.prefill:
        # repeat the text to reach the length: the trace stays a real model's attention, on a
        # context whose repetitions retrieval heads will latch onto (documented)
        reps = (args.prefill + ids.shape[1] - 1) // ids.shape[1]
        ids = ids.repeat(1, reps)
    return ids[:, :args.prefill]


def forward_last_logits(model, **kw):
    """A forward pass that computes the logits of the last position only, where the model can
    (T x vocab logits of a long prompt would take gigabytes)."""
    for extra in ({"logits_to_keep": 1}, {"num_logits_to_keep": 1}, {}):
        try:
            return model(**kw, **extra)
        except TypeError:
            continue
    raise RuntimeError("unreachable")


def rope_text(config):
    parts = []
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings",
                "sliding_window", "attn_logit_softcapping", "query_pre_attn_scalar"):
        val = getattr(config, key, None)
        if val is not None:
            parts.append("%s=%s" % (key, json.dumps(val, sort_keys=True, default=str)))
    return "; ".join(parts) if parts else "none"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="trace directory to create (must not exist or be empty)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local model directory (no download)")
    src.add_argument("--random-tiny", action="store_true",
                     help="a random 2-layer Llama (4 q heads, 2 KV heads, head dim 64)")
    ap.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    ap.add_argument("--prompt-file", help="file whose text is the prompt")
    ap.add_argument("--prefill", type=int, default=1024, help="prefill tokens T (default 1024)")
    ap.add_argument("--decode", type=int, default=16, help="decode steps S (default 16)")
    ap.add_argument("--dtype", choices=("float16", "float32"),
                    help="stored dtype (default: float16 for fp16 models, else float32)")
    ap.add_argument("--model-dtype", choices=("float16", "bfloat16", "float32"),
                    help="dtype to run the model in (default: the checkpoint's)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.prefill < 1 or args.decode < 1:
        ap.error("--prefill and --decode must be at least 1")
    if args.random_tiny and (args.prompt or args.prompt_file):
        ap.error("--random-tiny has no tokenizer: it uses random token ids")
    if args.prompt is not None and args.prompt_file is not None:
        ap.error("give --prompt or --prompt-file, not both")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        ap.error("%s exists and is not an empty directory" % args.out)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                   "float32": torch.float32, None: "auto"}[args.model_dtype]
    if args.random_tiny:
        model, tok = tiny_model(args)
        if args.model_dtype:
            model = model.to(torch_dtype)
        name = "random-tiny-llama (seed %d)" % args.seed
    else:
        model, tok = load_model(args, torch_dtype)
        name = os.path.basename(os.path.normpath(args.model))
    model = model.to(args.device).eval()
    run_dtype = next(model.parameters()).dtype
    dtype = args.dtype or ("float16" if run_dtype == torch.float16 else "float32")
    ids = prompt_ids(args, model, tok).to(args.device)
    if ids.shape[1] != args.prefill:
        sys.exit("capture_trace: the prompt has %d tokens, fewer than --prefill %d"
                 % (ids.shape[1], args.prefill))

    os.makedirs(args.out, exist_ok=True)
    rec = Recorder(args.out, dtype)
    install_attention(model, rec)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        rec.phase = "prefill"
        out = forward_last_logits(model, input_ids=ids, use_cache=True)
        if len(rec.layers) != n_layers:
            sys.exit("capture_trace: %d of the %d layers went through the attention interface: "
                     "this model's code does not use it (see the list of families in --help)"
                     % (len(rec.layers), n_layers))
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        rec.phase = "decode"
        for step in range(args.decode):
            pos = torch.tensor([[args.prefill + step]], device=args.device)
            out = forward_last_logits(model, input_ids=nxt, past_key_values=cache,
                                      position_ids=pos, cache_position=pos[0], use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            print("capture_trace: decode %d/%d" % (step + 1, args.decode), end="\r",
                  file=sys.stderr)
    print(file=sys.stderr)
    rec.write_decode()
    hq, hkv, d = rec.shape
    meta = {
        "model": name,
        "n_layers": n_layers,
        "n_q_heads": hq,
        "n_kv_heads": hkv,
        "head_dim": d,
        "dtype": dtype,
        "rope": rope_text(model.config),
        "scale": rec.scale if rec.scale is not None else 0,
        "prefill_tokens": args.prefill,
        "decode_steps": args.decode,
        "capture": {
            "tool": "tools/capture_trace.py",
            "model_type": getattr(model.config, "model_type", "?"),
            "model_dtype": str(run_dtype).replace("torch.", ""),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "prompt": "random token ids" if tok is None else "text",
            "decode": "greedy",
            "notes": sorted(rec.notes),
        },
    }
    write_meta(args.out, meta)
    print("capture_trace: wrote %s: %d layers, %d/%d/%d heads/kv/dim, %d + %d tokens, %s"
          % (args.out, n_layers, hq, hkv, d, args.prefill, args.decode, dtype), file=sys.stderr)


if __name__ == "__main__":
    main()
