# SPDX-License-Identifier: MIT
"""KvtierCache's data path and batch operations without a model or a GPU: CPU tensors (the CPU
backend), fp16, p = 1, driven layer by layer through update() and the "kvtier" attention as a
transformers attention module would, against full attention over K/V kept here and put through
the same operations (index the rows, slice the tokens): prefill, decode, several tokens over a
non-empty cache, crop (negative, to a length, to 0), reorder_cache, batch_repeat_interleave,
batch_select_indices; a fork refused (max_seqs) leaves the batch as it was. Needs torch and
transformers (skips without); no CUDA. Each run with the three ways of attending several tokens
over a non-empty cache (chunks=)."""

import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

import kvtier  # noqa: E402
import kvtier.hf as hf  # noqa: E402

L, HQ, HKV, D = 2, 4, 2, 64
SCALE = D ** -0.5
CFG = types.SimpleNamespace(num_hidden_layers=L, num_attention_heads=HQ,
                            num_key_value_heads=HKV, head_dim=D, hidden_size=HQ * D,
                            _attn_implementation="kvtier")
# as a transformers attention module: transformers' SDPA path repeats the KV heads by
# num_key_value_groups (or passes enable_gqa) only when the module has it
MODS = [types.SimpleNamespace(layer_idx=i, training=False, num_key_value_groups=HQ // HKV,
                              is_causal=True) for i in range(L)]


def full_attention(q, k, v):
    """q [b, Hq, n, D] for the last n of the T tokens of k, v [b, Hkv, T, D] -> [b, n, Hq, D]."""
    n, t = q.shape[2], k.shape[2]
    k = k.float().repeat_interleave(HQ // HKV, 1)
    v = v.float().repeat_interleave(HQ // HKV, 1)
    s = (q.float() @ k.transpose(-1, -2)) * SCALE
    causal = torch.ones(n, t, dtype=torch.bool).tril(t - n)
    return (s.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)


class Driver:
    """A batch through KvtierCache and through full attention over kept K/V."""

    def __init__(self, batch, **opts):
        self.cache = hf.KvtierCache(CFG, p=1.0, n_sink=4, window=16, flush_batch=16, **opts)
        self.k, self.v, self.b = [None] * L, [None] * L, batch
        self.g = torch.Generator().manual_seed(batch)

    def forward(self, n):
        err = 0.0
        for layer in range(L):
            q = (torch.randn(self.b, HQ, n, D, generator=self.g) * 2).half()
            k = (torch.randn(self.b, HKV, n, D, generator=self.g) * 2).half()
            v = torch.randn(self.b, HKV, n, D, generator=self.g).half()
            kk, vv = self.cache.update(k, v, layer)
            out, _ = hf.attention(MODS[layer], q, kk, vv, None, scaling=SCALE)
            self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], 2)
            self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], 2)
            want = full_attention(q, self.k[layer], self.v[layer])
            assert out.shape == want.shape
            err = max(err, float((out.float() - want).abs().max()))
        assert err < 5e-3, "attention differs from full attention by %g" % err

    def rows(self, rows, op, arg):
        getattr(self.cache, op)(arg)
        self.k = [x[rows] for x in self.k]
        self.v = [x[rows] for x in self.v]
        self.b = len(rows)

    def crop(self, max_length):
        self.cache.crop(max_length)
        t = self.cache.get_seq_length()
        self.k = [x[:, :, :t] for x in self.k]
        self.v = [x[:, :, :t] for x in self.v]


@pytest.mark.parametrize("chunks", ["exact", "topp", "steps"])
def test_data_path_and_batch_operations(chunks):
    """Several tokens over a non-empty cache go through kvt_extend (exact, or Top-p per query
    row, which at p = 1 is exact too) or one token at a time: all equal full attention."""
    d = Driver(3, chunks=chunks)
    with d.cache:
        d.forward(300)
        d.forward(1)
        d.forward(1)
        d.rows([2, 0, 0], "reorder_cache", torch.tensor([2, 0, 0]))
        d.forward(1)
        d.forward(5)                                   # a verification pass of 5 tokens
        d.crop(-3)
        assert d.cache.get_seq_length() == 300 + 2 + 1 + 5 - 3
        for _ in range(40):                            # past two flushes
            d.forward(1)
        d.crop(d.cache.get_seq_length() - 37)          # back before both
        d.forward(1)
        d.rows([0, 0, 1, 1, 2, 2], "batch_repeat_interleave", 2)
        d.forward(1)
        d.rows([5, 0, 0, 3], "batch_select_indices", torch.tensor([5, 0, 0, 3]))
        d.forward(1)
        d.forward(3)
        d.rows([1, 0, 3, 2], "reorder_cache", torch.tensor([1, 0, 3, 2]))
        d.forward(1)
        st = d.cache.stats()
        assert st.seqs_open == 4 == len({s.id for s in d.cache.seqs}) and st.flushes > 0
        n = d.cache.get_seq_length()
        assert [d.cache.kvtier.length(s, layer) for s in d.cache.seqs for layer in range(L)] \
            == [n] * (4 * L)
        d.crop(0)                                      # empty again: the next pass prefills
        assert d.cache.get_seq_length() == 0
        d.forward(50)
        d.forward(1)


def test_fork_refused_leaves_the_batch():
    d = Driver(3, max_seqs=3)
    with d.cache:
        d.forward(40)
        ids = [s.id for s in d.cache.seqs]
        with pytest.raises(kvtier.Error) as e:
            d.cache.batch_repeat_interleave(2)
        assert e.value.name == "ENOSPC"
        assert [s.id for s in d.cache.seqs] == ids and d.cache.stats().seqs_open == 3
        d.forward(1)                                   # still usable
        d.cache.update(torch.zeros(3, HKV, 1, D).half(), torch.zeros(3, HKV, 1, D).half(), 0)
        with pytest.raises(hf.Unsupported, match="between a layer's update and its attention"):
            d.cache.crop(-1)


def test_chunks_option_checked():
    with pytest.raises(ValueError, match="chunks = 'fast'"):
        hf.KvtierCache(CFG, chunks="fast")


def test_graph_warmup_checked():
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="graph_warmup = "):
            hf.KvtierCache(CFG, graph_warmup=bad)
    assert hf.KvtierCache(CFG).graph_warmup == 8
    assert hf.KvtierCache(CFG, graph_warmup=1).graph_warmup == 1


def test_graphs_need_cuda():
    """graphs=True on CPU tensors is refused when the cache is made, not silently ignored."""
    cache = hf.KvtierCache(CFG, graphs=True, p=1.0)
    k = torch.zeros(1, HKV, 4, D, dtype=torch.float16)
    with pytest.raises(hf.Unsupported, match="graphs=True"):
        cache.update(k, k, 0)
