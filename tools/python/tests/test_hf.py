# SPDX-License-Identifier: MIT
"""kvtier.hf under transformers on a GPU: with p = 1 (every indexed token selected) greedy
generation of a tiny random Llama (2 layers, 4 query heads over 2 KV heads, head_dim 64, RoPE)
must give transformers' own tokens (SDPA + DynamicCache), batch 1 and 2, fp16 and bf16; a token
may differ only where the reference's top-2 logits nearly tie. What kvtier.hf cannot serve must
raise. Skips without torch + CUDA + transformers or without a CUDA build of libkvtier."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import kvtier  # noqa: E402

if not kvtier.probe().cuda_built:
    pytest.skip("this libkvtier was built without the CUDA backend", allow_module_level=True)

import kvtier.hf  # noqa: E402
from kvtier.hf import KvtierCache, Unsupported  # noqa: E402

PROMPT, NEW = 300, 48
# small window and flush batch so that the prompt is mostly indexed and decoding flushes
OPTS = dict(p=1.0, n_sink=4, window=16, flush_batch=16)
TIE = {torch.float16: 0.02, torch.bfloat16: 0.1}   # logit margin counted as a near-tie


def set_attn(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger q/k weights: attention far from uniform; a larger lm_head:
        for layer in model.model.layers:     # logits with margins, so ties stay rare
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
        model.lm_head.weight.mul_(16.0)
    return model.cuda().eval()


def generate(model, ids, cache=None):
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
              do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    if cache is not None:
        kw["past_key_values"] = cache
    with torch.no_grad():
        out = model.generate(ids, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_matches_sdpa_at_p1(tiny, dtype, batch):
    model = tiny.to(dtype)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 512, (batch, PROMPT), generator=g).cuda()
    set_attn(model, "sdpa")
    want, scores = generate(model, ids)
    set_attn(model, "kvtier")
    try:
        with KvtierCache(model.config, **OPTS) as cache:
            got, got_scores = generate(model, ids, cache)
            st = cache.stats()
            assert st.backend == "cuda" and st.flushes > 0
            assert st.selected_tokens == st.candidate_tokens > 0, "p = 1 selects every token"
    finally:
        set_attn(model, "sdpa")
    # while the tokens agree the logits are those of the same inputs: equal to rounding
    same = NEW
    for row in range(batch):
        diff = (got[row] != want[row]).nonzero()
        same = min(same, int(diff[0]) if len(diff) else NEW)
    a, b = got_scores[:, :same], scores[:, :same]
    ok = torch.isfinite(a) & torch.isfinite(b)
    err = float((a - b)[ok].abs().max()) if bool(ok.any()) else 0.0
    assert err <= 0.05 * float(b[ok].abs().max()), (
        "logits of the first %d steps differ by %g (max |logit| %g)"
        % (same, err, float(b[ok].abs().max())))
    for row in range(batch):
        diff = (got[row] != want[row]).nonzero()
        if len(diff) == 0:
            continue
        t = int(diff[0])
        top2 = scores[row, t].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < TIE[dtype], (
            "row %d, token %d: kvtier %d, sdpa %d, reference margin %.4f (not a near-tie)"
            % (row, t, got[row, t], want[row, t], margin))


def test_unsupported_operations_raise(tiny):
    model = tiny.to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 64)).cuda()
    set_attn(model, "sdpa")
    with pytest.raises(Unsupported, match="attn_implementation='kvtier'"):
        KvtierCache(model.config)                       # the model's attention is not kvtier
    set_attn(model, "kvtier")
    try:
        cache = KvtierCache(model.config, **OPTS)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            assert cache.get_seq_length() == 64
            with pytest.raises(Unsupported, match="second prefill chunk"):
                model(ids[:, :5], past_key_values=cache, use_cache=True)
        for op, arg, what in ((cache.crop, 10, "crop"),
                              (cache.reorder_cache, torch.zeros(1, dtype=torch.long),
                               "reorder_cache"),
                              (cache.batch_repeat_interleave, 2, "batch_repeat_interleave")):
            with pytest.raises(Unsupported, match=what):
                op(arg)
        cache.close()
        with torch.no_grad():
            with pytest.raises(Unsupported, match="KvtierCache"):   # kvtier attention alone
                model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
            pad = torch.ones(2, 64, dtype=torch.long, device="cuda")
            pad[0, :3] = 0
            with pytest.raises(Unsupported, match="padding"):
                model(ids.repeat(2, 1), attention_mask=pad,
                      past_key_values=KvtierCache(model.config), use_cache=True)
    finally:
        set_attn(model, "sdpa")
    from transformers import MistralConfig
    with pytest.raises(Unsupported, match="sliding"):
        KvtierCache(MistralConfig(num_hidden_layers=2, sliding_window=128))
    with pytest.raises(Unsupported, match="float16 or bfloat16"):
        set_attn(model, "kvtier")
        try:
            with torch.no_grad():
                model.float()(ids, past_key_values=KvtierCache(model.config), use_cache=True)
        finally:
            set_attn(model, "sdpa")
            model.to(torch.bfloat16)
