#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""kvtier's proof under transformers on a GPU (issue #12, point 4): one JSON line per figure.

  exactness_attend   p = 1: every decode attention of every layer, kvtier's output against SDPA
                     over the full K/V (a shadow copy kept for the check), in bf16 ulps
  greedy_p1          p = 1: greedy tokens after a long prompt, batch 1 and 4, against
                     transformers' own cache with SDPA; where they differ, the logit margin
  quality            p = 0.9 (kvtier's defaults): teacher-forced next-token loss on held-out text
                     against full attention, top-1 agreement, fraction of indexed tokens selected
  negative_*         controls that must visibly fail: p = 0.3 with budget_min = 0 (agreement
                     drops), a wrong attention scale (the exactness check breaks)
  long_context       a 32-layer, 8-KV-head, head_dim 128 random model: peak GPU memory and decode
                     tokens/s of transformers' DynamicCache against kvtier at each context, with
                     kvtier's time per stage; long_context_limit: the longest contexts that fit,
                     from the measured bytes per token

    tools/python/scripts/proof.py --model /tmp/small            # the full proof (~15-25 min)
    tools/python/scripts/proof.py --model /tmp/small --quick    # small settings, ~3 minutes
    tools/python/scripts/proof.py --model ~/models/Llama-3.1-8B  # real weights, unchanged

Needs torch, transformers 5.x, a CUDA GPU and a CUDA build of libkvtier (KVTIER_LIBRARY).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import Tokenizer, emit, eval_docs, held_out_of  # noqa: E402

PARTS = ("exactness", "greedy", "quality", "negative", "long")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (train_small.py's, or real weights)")
    ap.add_argument("--quick", action="store_true", help="small settings (about 3 minutes)")
    ap.add_argument("--only", default=",".join(PARTS), help="parts to run: " + ",".join(PARTS))
    ap.add_argument("--eval-package", default=None,
                    help="held-out package for text (default: the model's train_meta.json, "
                         "else transformers)")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens of the p = 1 checks")
    ap.add_argument("--new", type=int, default=256, help="greedy tokens generated")
    ap.add_argument("--batches", default="1,4", help="batch sizes of the greedy check")
    ap.add_argument("--check-steps", type=int, default=32, help="decode steps of exactness_attend")
    ap.add_argument("--tf-prompt", type=int, default=6144, help="teacher-forcing prompt tokens")
    ap.add_argument("--tf-steps", type=int, default=400, help="teacher-forced steps per row")
    ap.add_argument("--tf-batch", type=int, default=4, help="rows (held-out documents)")
    ap.add_argument("--long", default="32768,131072",
                    help="contexts of the 32-layer memory/speed run")
    ap.add_argument("--long-layers", type=int, default=32)
    ap.add_argument("--long-steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    a = ap.parse_args()
    if a.quick:
        a.prompt, a.new, a.check_steps = min(a.prompt, 2048), min(a.new, 64), 16
        a.tf_prompt, a.tf_steps, a.tf_batch = min(a.tf_prompt, 2048), 128, 2
        a.long, a.long_steps = "16384,32768", 8
    a.only = [p for p in a.only.split(",") if p]
    for p in a.only:
        if p not in PARTS:
            ap.error("--only: unknown part %r" % p)
    if any(p != "long" for p in a.only) and not a.model:
        ap.error("--model is needed for every part but long")
    return a


# ---- helpers ---------------------------------------------------------------------------------

def set_attn(model: Any, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def load_model(path: str, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM
    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    return m.cuda().eval()


def prompts(a: argparse.Namespace, tok: Tokenizer, n: int, length: int) -> Any:
    """[n, length] token ids of n held-out documents (equal lengths: no padding)."""
    import torch
    held = a.eval_package or held_out_of(a.model, "transformers")
    rows = []
    for doc in eval_docs(held, length * 6 if tok.kind == "transformers" else length + 1, n):
        ids = tok.encode(doc)
        if len(ids) < length:
            raise SystemExit("a held-out document has %d tokens, fewer than %d" % (len(ids),
                                                                                   length))
        rows.append(ids[:length])
    return torch.tensor(rows, dtype=torch.long, device="cuda")


def dynamic_cache(config: Any) -> Any:
    from transformers import DynamicCache
    try:
        return DynamicCache(config=config)
    except TypeError:
        return DynamicCache()


def generate(model: Any, ids: Any, new: int, cache: Any = None) -> Any:
    import torch
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
              do_sample=False, return_dict_in_generate=True, output_scores=True,
              pad_token_id=0)
    if cache is not None:
        kw["past_key_values"] = cache
    with torch.no_grad():
        out = model.generate(ids, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1).float()


def host_opts(config: Any, tokens: int, batch: int) -> Dict[str, Any]:
    """KvtierCache options sizing the host tier for `batch` sequences of `tokens` tokens."""
    import kvtier
    cfg = getattr(config, "get_text_config", lambda **k: config)()
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fp = kvtier.footprint(kvtier.Config(
        n_layers=cfg.num_hidden_layers, n_q_heads=cfg.num_attention_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=d), tokens + 256)
    return {"host_bytes": int(fp.host_bytes * batch * 1.05) + (64 << 20)}


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 (and the coarser of fp16) numbers at magnitude x."""
    return 2.0 ** (math.floor(math.log2(max(x, 1e-30))) - 7)


# ---- the exactness check: kvtier's attention and SDPA over a shadow full K/V ----------------

def check_attention_setup() -> Any:
    """A KvtierCache that also keeps the full K/V (on the GPU, for the check only) and an
    attention "kvtier_check" that returns kvtier's output and records its distance to SDPA."""
    import torch
    import kvtier.hf as khf
    from transformers import AttentionInterface

    class CheckCache(khf.KvtierCache):
        attn_names = ("kvtier_check",)

        def __init__(self, *args: Any, **kw: Any):
            super().__init__(*args, **kw)
            self.shadow: Dict[int, Any] = {}
            self.worst: Dict[str, float] = {"err": 0.0, "ulps": 0.0, "ref_max": 0.0}
            self.checked = 0

        def update(self, k: Any, v: Any, layer_idx: int, cache_kwargs: Any = None) -> Any:
            out = super().update(k, v, layer_idx, cache_kwargs)
            old = self.shadow.get(layer_idx)
            self.shadow[layer_idx] = (k, v) if old is None else \
                (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
            return out

    def attend(module: Any, q: Any, k: Any, v: Any, mask: Any, scaling: Any = None,
               **kw: Any) -> Any:
        out, _ = khf.attention(module, q, k, v, mask, scaling=scaling, **kw)
        cache = khf.active_cache()
        if q.shape[2] == 1:
            fk, fv = cache.shadow[module.layer_idx]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q, fk, fv, scale=scaling, enable_gqa=True).transpose(1, 2)
            err = float((out.float() - ref.float()).abs().max())
            big = float(ref.float().abs().max())
            ulps = err / bf16_ulp(big)
            if ulps > cache.worst["ulps"]:
                cache.worst = {"err": err, "ulps": ulps, "ref_max": big}
            cache.checked += 1
        return out, None

    AttentionInterface.register("kvtier_check", attend)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        ALL_MASK_ATTENTION_FUNCTIONS.register("kvtier_check", khf.mask)
    except (ImportError, AttributeError):
        pass
    return CheckCache


def run_check(model: Any, ids: Any, steps: int, CheckCache: Any, **opts: Any) -> Dict[str, Any]:
    set_attn(model, "kvtier_check")
    try:
        with CheckCache(model.config, **opts) as cache:
            generate(model, ids, steps, cache)
            return {"max_abs_err": cache.worst["err"], "max_err_bf16_ulps": cache.worst["ulps"],
                    "at_ref_magnitude": cache.worst["ref_max"], "attentions_checked":
                        cache.checked}
    finally:
        set_attn(model, "sdpa")


def part_exactness(a: argparse.Namespace, model: Any, tok: Tokenizer, CheckCache: Any) -> None:
    ids = prompts(a, tok, 1, a.prompt)
    r = run_check(model, ids, a.check_steps, CheckCache, p=1.0,
                  **host_opts(model.config, a.prompt + a.check_steps, 1))
    emit("exactness_attend", p=1.0, prompt=a.prompt, steps=a.check_steps, **r,
         ok=r["max_err_bf16_ulps"] <= 2.0,
         note="kvt_attend vs SDPA over the full K/V, every layer and step; "
              "bf16 rounding: <= 2 ulps")


def part_negative_scale(a: argparse.Namespace, model: Any, tok: Tokenizer,
                        CheckCache: Any) -> None:
    ids = prompts(a, tok, 1, a.prompt)
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    wrong = 1.5 * d ** -0.5
    r = run_check(model, ids, min(a.check_steps, 8), CheckCache, p=1.0, scale=wrong,
                  check_scale=False, **host_opts(model.config, a.prompt + 8, 1))
    emit("negative_wrong_scale", p=1.0, scale=wrong, right_scale=d ** -0.5, **r,
         must_fail=True, failed=r["max_err_bf16_ulps"] > 2.0)


# ---- greedy tokens at p = 1 ---------------------------------------------------------------------

def part_greedy(a: argparse.Namespace, model: Any, tok: Tokenizer) -> None:
    import kvtier.hf as khf
    for b in [int(x) for x in a.batches.split(",")]:
        ids = prompts(a, tok, b, a.prompt)
        set_attn(model, "sdpa")
        t0 = time.time()
        want, ref_scores = generate(model, ids, a.new)
        t_ref = time.time() - t0
        set_attn(model, "kvtier")
        try:
            with khf.KvtierCache(model.config, p=1.0,
                                 **host_opts(model.config, a.prompt + a.new, b)) as cache:
                t0 = time.time()
                got, kv_scores = generate(model, ids, a.new, cache)
                t_kvt = time.time() - t0
        finally:
            set_attn(model, "sdpa")
        rows = []
        for r in range(b):
            diff = (got[r] != want[r]).nonzero()
            if len(diff) == 0:
                rows.append({"row": r, "identical": True})
                continue
            t = int(diff[0])
            top2 = ref_scores[r, t].topk(2).values
            rows.append({"row": r, "identical": False, "first_difference": t,
                         "ref_logit_margin": float(top2[0] - top2[1]),
                         "kvtier_token": int(got[r, t]), "sdpa_token": int(want[r, t]),
                         "tokens_equal_after_prompt": t})
        emit("greedy_p1", batch=b, prompt=a.prompt, new=a.new,
             rows_identical=sum(1 for x in rows if x["identical"]), rows=rows,
             sdpa_s=round(t_ref, 2), kvtier_s=round(t_kvt, 2))


# ---- teacher-forced quality -------------------------------------------------------------------

def teacher_forced(a: argparse.Namespace, model: Any, ids: Any, **opts: Any) -> Dict[str, Any]:
    """Loss and top-1 of kvtier decode steps against full attention over the same positions.
    ids: [B, P + n]; kvtier prefills P tokens, then feeds the true tokens one by one."""
    import torch
    import torch.nn.functional as F
    import kvtier.hf as khf
    p, n = a.tf_prompt, ids.shape[1] - a.tf_prompt
    set_attn(model, "sdpa")
    with torch.no_grad():   # full attention: logits of positions P .. P+n-1, keep P .. P+n-2
        ref = model(input_ids=ids, logits_to_keep=n).logits[:, :n - 1].float()
    target = ids[:, p + 1:p + n]   # what positions P .. P+n-2 predict
    set_attn(model, "kvtier")
    logits: List[Any] = []
    try:
        opts.update(host_opts(model.config, ids.shape[1], ids.shape[0]))
        with khf.KvtierCache(model.config, **opts) as cache, torch.no_grad():
            model(input_ids=ids[:, :p], past_key_values=cache, use_cache=True, logits_to_keep=1)
            for i in range(n - 1):
                out = model(input_ids=ids[:, p + i:p + i + 1], past_key_values=cache,
                            use_cache=True)
                logits.append(out.logits[:, -1].float())
            st = cache.stats()
    finally:
        set_attn(model, "sdpa")
    kv = torch.stack(logits, 1)                                       # [B, n-1, V]
    vocab = kv.shape[-1]
    loss_ref = float(F.cross_entropy(ref.reshape(-1, vocab), target.reshape(-1)))
    loss_kvt = float(F.cross_entropy(kv.reshape(-1, vocab), target.reshape(-1)))
    agree = float((kv.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"predictions": int(target.numel()), "loss_full_nats": loss_ref,
            "loss_kvtier_nats": loss_kvt, "loss_delta_nats": loss_kvt - loss_ref,
            "top1_agreement": agree,
            "fraction_selected": st.selected_tokens / max(1, st.candidate_tokens),
            "budget_min_hits": st.budget_min_hits, "steps": st.steps}


def part_quality(a: argparse.Namespace, model: Any, tok: Tokenizer, negative: bool) -> None:
    ids = prompts(a, tok, a.tf_batch, a.tf_prompt + a.tf_steps + 1)
    if "quality" in a.only:
        r = teacher_forced(a, model, ids)
        emit("quality", p=0.9, prompt=a.tf_prompt, **r,
             goal="loss_delta <= 0.01 nats, top1 >= 0.98, fraction_selected <= 0.25",
             met=r["loss_delta_nats"] <= 0.01 and r["top1_agreement"] >= 0.98 and
             r["fraction_selected"] <= 0.25)
    if negative:
        r = teacher_forced(a, model, ids, p=0.3, budget_min=0)
        emit("negative_low_p", p=0.3, budget_min=0, prompt=a.tf_prompt, **r, must_fail=True)


# ---- memory and speed at long context ---------------------------------------------------------

def big_model(layers: int, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=1 << 20)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def decode_run(model: Any, ids: Any, steps: int, cache: Any) -> Dict[str, Any]:
    import torch
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.time()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        t_prefill = time.time() - t0
        nxt = out.logits[:, -1:].argmax(-1)
        del out
        # one untimed step (first-step allocations), then the timed ones
        nxt = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(steps):
            nxt = model(input_ids=nxt, past_key_values=cache,
                        use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    dt = time.time() - t0
    return {"prefill_s": round(t_prefill, 2), "decode_tokens_per_s": steps / dt}


def part_long(a: argparse.Namespace) -> None:
    import torch
    import kvtier
    import kvtier.hf as khf
    dtype = getattr(torch, a.dtype)
    model = big_model(a.long_layers, dtype)
    weights = torch.cuda.memory_allocated()
    cfg = model.config
    shape = dict(n_layers=cfg.num_hidden_layers, n_q_heads=cfg.num_attention_heads,
                 n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    per_token: Dict[str, float] = {}
    for ctx in [int(x) for x in a.long.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
        fig: Dict[str, Any] = {"context": ctx, "layers": cfg.num_hidden_layers,
                               "weights_gib": round(weights / 2 ** 30, 2)}
        # transformers' own cache
        set_attn(model, "sdpa")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            r = decode_run(model, ids, a.long_steps, dynamic_cache(cfg))
            peak = torch.cuda.max_memory_allocated()
            fig["dynamic"] = dict(r, peak_gib=round(peak / 2 ** 30, 2))
            per_token["dynamic"] = kv_token
        except torch.cuda.OutOfMemoryError:
            fig["dynamic"] = {"oom": True}
        gc.collect()
        torch.cuda.empty_cache()
        # kvtier
        fp = kvtier.footprint(kvtier.Config(**shape), ctx + a.long_steps + 128)
        host = int(fp.host_bytes * 1.05) + (256 << 20)
        avail = kvtier.probe().host_available_bytes
        if host > 0.85 * avail:
            fig["kvtier"] = {"skipped": "host tier of %.1f GiB > 85%% of available %.1f GiB"
                             % (host / 2 ** 30, avail / 2 ** 30)}
        else:
            set_attn(model, "kvtier")
            torch.cuda.reset_peak_memory_stats()
            free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            try:
                with khf.KvtierCache(cfg, host_bytes=host) as cache:
                    r = decode_run(model, ids, a.long_steps, cache)
                    free1, res1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
                    lib_dev = (free0 - free1) - (res1 - res0)
                    st = cache.stats()
                peak = torch.cuda.max_memory_allocated() + lib_dev
                steps = max(1, st.steps)
                fig["kvtier"] = dict(
                    r, peak_gib=round(peak / 2 ** 30, 2),
                    kvtier_device_gib=round(lib_dev / 2 ** 30, 3),
                    host_tier_gib=round(st.host_bytes_used / 2 ** 30, 2),
                    fraction_selected=st.selected_tokens / max(1, st.candidate_tokens),
                    hot_hit_rate=st.hot_hits / max(1, st.hot_hits + st.hot_misses),
                    pcie_bytes_per_layer_step=st.pcie_bytes / steps,
                    us_per_layer_step={k: round(getattr(st, "ns_" + k) / steps / 1e3, 1)
                                       for k in ("score", "select", "attend", "index", "store")})
                per_token["kvtier_hbm"] = fp.hbm_seq_bytes / max(1, ctx)
                per_token["kvtier_host"] = fp.host_bytes / max(1, ctx)
            except torch.cuda.OutOfMemoryError:
                fig["kvtier"] = {"oom": True}
            except kvtier.Error as e:   # -ENOMEM / -ENOSPC from the library: reported
                fig["kvtier"] = {"error": str(e)}
            finally:
                set_attn(model, "sdpa")
        d, k = fig.get("dynamic", {}), fig.get("kvtier", {})
        if "decode_tokens_per_s" in d and "decode_tokens_per_s" in k:
            fig["kvtier_speed_ratio"] = k["decode_tokens_per_s"] / d["decode_tokens_per_s"]
            fig["memory_saved_gib"] = round(d["peak_gib"] - k["peak_gib"], 2)
        emit("long_context", **fig)
        del ids
    total = torch.cuda.get_device_properties(0).total_memory
    room = total - weights - (8 << 30)   # 8 GiB left for prefill activations (estimate)
    avail = kvtier.probe().host_available_bytes
    lim: Dict[str, Any] = {"gpu_total_gib": round(total / 2 ** 30, 1),
                           "host_available_gib": round(avail / 2 ** 30, 1),
                           "dynamic_max_tokens": int(room / kv_token)}
    if "kvtier_host" in per_token:
        lim["kvtier_max_tokens"] = int(min(0.85 * avail / per_token["kvtier_host"],
                                           room / max(1.0, 2 * per_token["kvtier_hbm"])))
    emit("long_context_limit", **lim,
         note="estimated from bytes per token (K/V for DynamicCache; kvtier: host tier, and "
              "twice its HBM index); prefill of such contexts in one chunk may need more "
              "activation memory")


def main() -> None:
    a = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    import kvtier
    import kvtier.hf  # noqa: F401  registers "kvtier"

    if not torch.cuda.is_available():
        sys.exit("proof: needs a CUDA GPU")
    if not kvtier.probe().cuda_built:
        sys.exit("proof: this libkvtier has no CUDA backend (KVTIER_LIBRARY=%s)"
                 % os.environ.get("KVTIER_LIBRARY", ""))
    emit("environment", kvtier=kvtier.version(), torch=torch.__version__,
         transformers=transformers.__version__, gpu=torch.cuda.get_device_name(0),
         model=a.model, quick=a.quick)
    t_all = time.time()
    if any(p in a.only for p in ("exactness", "greedy", "quality", "negative")):
        dtype = getattr(torch, a.dtype)
        model = load_model(a.model, dtype)
        tok = Tokenizer(a.model)
        CheckCache = check_attention_setup()
        if "exactness" in a.only:
            part_exactness(a, model, tok, CheckCache)
        if "greedy" in a.only:
            part_greedy(a, model, tok)
        if "quality" in a.only or "negative" in a.only:
            part_quality(a, model, tok, "negative" in a.only)
        if "negative" in a.only:
            part_negative_scale(a, model, tok, CheckCache)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if "long" in a.only:
        part_long(a)
    emit("done", seconds=round(time.time() - t_all, 1))


if __name__ == "__main__":
    main()
