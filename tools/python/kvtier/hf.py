# SPDX-License-Identifier: MIT
"""kvtier under Hugging Face transformers (5.x): a cache class and an attention function.

    import kvtier.hf                                   # registers attn_implementation="kvtier"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation="kvtier").cuda()
    cache = kvtier.hf.KvtierCache(model.config)        # kvtier options: p=0.9, host_bytes=...
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)

How the work is split. transformers' attention modules (Llama, Mistral, Qwen2/3 and the other
families ported to the attention interface) compute q, k, v (after RoPE), call
`past_key_values.update(k, v, layer_idx)` and then the attention function chosen by name with
(query [b, Hq, q_len, D], key, value [b, Hkv, kv_len, D], mask, scaling=...), which returns
[b, q_len, Hq, D].
- Prefill (the first forward pass, the cache empty): update() returns the chunk's own K/V, the
  attention function computes exact causal attention over them with transformers' SDPA path, then
  hands q, k, v of each sequence to kvt_prefill. Nothing of the chunk stays on the GPU.
- Decode (one new token per sequence): update() returns the new token's K/V; the attention
  function stores and attends it (kvt_append, then kvt_attend: Top-p selection over the index,
  exact attention over sinks + selected + window).
- Several new tokens over a non-empty cache (a later prefill chunk, assisted or speculative
  decoding's verification pass): by default (chunks="exact") one kvt_extend per layer stores them
  and attends each query exactly to every stored token up to its own, as a prefill chunk is
  attended (the rows are read from the host tier; nothing stays on the GPU); chunks="topp" asks
  kvt_extend for each query's Top-p selection instead; chunks="steps"
  stores and attends them one token at a time as decode does.
The K/V of the context live in kvtier's host tier; the GPU holds only kvtier's index, window ring
and hot cache.

Between forward passes the cache follows transformers' batch and length changes on top of
kvtier's sequence lifecycle: crop (assisted decoding's rollback) truncates every row
(kvt_seq_truncate, all layers at once); reorder_cache (beam search), batch_repeat_interleave
(num_return_sequences / num_beams expansion of a filled cache) and batch_select_indices keep one
kvtier sequence per row: the first new row of each source row takes its sequence, every further
one a fork (kvt_seq_fork: full blocks shared, index and window copied), and rows no longer
referenced are closed. A fork that fails closes the forks made and raises kvtier.Error with the
batch unchanged.

What is refused, with an error that says so (never a silent fall back to full K/V on the GPU):
reset, legacy indexing or iteration of the cache's K/V, padding in the attention mask (batches need
equal prompt lengths), sliding-window or chunked-attention layers, logit softcapping, fp32 models
(kvtier stores fp16 or bf16), a model whose attention is not "kvtier" used with a KvtierCache, and
the "kvtier" attention without a KvtierCache.
Calls are ordered on torch's current CUDA stream. One KvtierCache serves one generate() call
(one batch); it is closed (its host memory freed) by close(), `with`, or garbage collection.
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from typing import Any, List, Optional, Tuple

import torch

from . import _batch
from . import cache as _kc

try:
    from transformers.cache_utils import Cache as _HFCache
except ImportError:  # pragma: no cover - transformers missing: the module still imports
    _HFCache = object
try:
    from transformers.cache_utils import CacheLayerMixin as _HFLayer
except ImportError:  # pragma: no cover
    _HFLayer = object

ATTN_NAME = "kvtier"
# a weak reference to the KvtierCache whose update() ran last on this thread
_active = threading.local()


def active_cache() -> "Optional[KvtierCache]":
    """The KvtierCache whose update() ran last on this thread (the one the "kvtier" attention
    serves), or None."""
    ref = getattr(_active, "cache", None)
    return ref() if ref is not None else None


class Unsupported(NotImplementedError):
    """An operation kvtier.hf cannot serve (it never falls back to full K/V on the GPU)."""


class _Layer(_HFLayer):
    """What transformers may read from one layer of the cache: no K/V tensors (they are in
    kvtier), the token count, full (not sliding) attention."""
    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "KvtierCache", idx: int):  # no super().__init__: no tensors here
        self.owner, self.idx = owner, idx
        self.keys = self.values = None

    @property
    def is_initialized(self) -> bool:
        return self.owner._kv is not None

    def lazy_initialization(self, *a: Any, **kw: Any) -> None:
        pass

    def update(self, *a: Any, **kw: Any) -> Any:
        raise Unsupported("kvtier.hf: update the cache through KvtierCache.update")

    def get_seq_length(self) -> int:
        return self.owner._lengths[self.idx]

    def get_mask_sizes(self, query: Any, *a: Any) -> Tuple[int, int]:
        return self.owner._mask_sizes(query, self.idx)

    def get_max_cache_shape(self) -> int:
        return -1

    def __repr__(self) -> str:
        return "KvtierLayer(%d, %d tokens)" % (self.idx, self.get_seq_length())


if _HFLayer is not object:  # the mixin's abstract methods may differ between 5.x releases
    _Layer.__abstractmethods__ = frozenset()


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _check_model_config(cfg: Any, names: Tuple[str, ...] = ("kvtier",)) -> None:
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        bad = sorted({t for t in types if t != "full_attention"})
        if bad:
            raise Unsupported("kvtier.hf: layer types %s (sliding-window or chunked attention) "
                              "are not served; kvtier attends every token" % bad)
    elif getattr(cfg, "sliding_window", None) is not None and \
            getattr(cfg, "use_sliding_window", True):
        raise Unsupported("kvtier.hf: sliding_window = %s is not served; kvtier attends every "
                          "token" % cfg.sliding_window)
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(cfg, name, None):
            raise Unsupported("kvtier.hf: %s = %s is not served" % (name, getattr(cfg, name)))
    impl = getattr(cfg, "_attn_implementation", None)
    if impl is not None and impl not in names:
        raise Unsupported("kvtier.hf: the model's attention is %r; load it with "
                          "attn_implementation=%r (or model.set_attn_implementation(%r)) so that "
                          "KvtierCache serves every layer" % (impl, names[0], names[0]))


def _failing_closed(fn: Any) -> Any:
    """A failure inside the data path leaves the cache unusable (its layers may disagree):
    later calls say so instead of serving a half-updated context."""
    @functools.wraps(fn)
    def wrapper(self: "KvtierCache", *args: Any, **kwargs: Any) -> Any:
        if self._failed:
            raise Unsupported("kvtier.hf: this KvtierCache failed earlier (%s); make a new one"
                              % self._failed)
        try:
            return fn(self, *args, **kwargs)
        except BaseException as e:
            self._failed = "%s: %s" % (type(e).__name__, e)
            raise
    return wrapper


class KvtierCache(_HFCache):
    """A transformers Cache whose K/V live in kvtier (one kvtier.Cache, one sequence per batch
    row), for `model.generate(..., past_key_values=KvtierCache(model.config, ...))` with
    `attn_implementation="kvtier"`.

    Args:
        config: the model's config (PretrainedConfig): num_hidden_layers, num_attention_heads,
            num_key_value_heads, head_dim (or hidden_size / num_attention_heads).
        scale: the attention scale the model uses; None: 1/sqrt(head_dim) (Llama-family). Every
            attention call checks that the model's `scaling` equals it.
        check_scale: False skips that check (for negative controls only).
        chunks: how several new tokens over a non-empty cache are attended: "exact" (default,
            one kvt_extend per layer, exact), "topp" (kvt_extend with Top-p per query row) or
            "steps" (one token at a time, as decode).
        graphs: CUDA backend: each layer's one-token decode attention is a CUDA graph of
            kvt_attend_graph, captured after the first graph_warmup decode steps of a batch
            (eager calls of the same kvt_attend_graph) and replayed at every later one (the
            sequence ids and lengths read from device buffers this cache writes before each
            replay; kvt_append stays eager). The batch's graphs are captured anew after a crop,
            reorder or selection of rows. graph_tokens: the longest sequence the graphs serve
            (kvt_graph_reserve; default the model's max_position_embeddings). graph_warmup
            (default 8, at least 1): the eager steps before a layer's capture. The capture
            freezes the layer's self-sized hot cache (gpu_cache_bytes 0), which sizes itself on
            eager steps only: after one step it is still empty, and every selected row would
            cross PCIe at every replay. Queries whose selection drifts from step to step grow
            it for tens of steps (doc/cuda-backend.md); a fixed gpu_cache_bytes needs one.
        **options: kvtier.Config fields (p, n_sink, window, flush_batch, budget_min, budget_max,
            host_bytes, gpu_cache_bytes, seed, nvme_paths, ...). dtype, backend and device come
            from the first key tensor: CUDA tensors -> CUDA backend on their device, CPU tensors
            -> CPU backend.
    Attributes: kvtier (the kvtier.Cache once the first update has run), seqs (its Sequences).
    """

    is_compileable = False
    # attention implementations this cache serves (a subclass adding checks may add its own)
    attn_names: Tuple[str, ...] = (ATTN_NAME,)

    def __init__(self, config: Any, scale: Optional[float] = None, check_scale: bool = True,
                 **options: Any):
        cfg = _text_config(config)
        _check_model_config(cfg, self.attn_names)
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_q_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.n_q_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or
                            cfg.hidden_size // cfg.num_attention_heads)
        self.scale = float(scale) if scale is not None else self.head_dim ** -0.5
        self.check_scale = check_scale
        for k in ("dtype", "out_dtype", "backend", "device", "n_layers", "n_q_heads",
                  "n_kv_heads", "head_dim", "scale"):
            if k in options:
                raise TypeError("KvtierCache: %s is taken from the model and its tensors" % k)
        self.chunks = options.pop("chunks", "exact")
        if self.chunks not in ("exact", "topp", "steps"):
            raise ValueError("KvtierCache: chunks = %r, must be 'exact', 'topp' or 'steps'"
                             % (self.chunks,))
        self.graphs = bool(options.pop("graphs", False))
        self.graph_tokens = int(options.pop("graph_tokens", 0) or
                                getattr(cfg, "max_position_embeddings", 0) or 131072)
        warmup = options.pop("graph_warmup", 8)
        try:
            self.graph_warmup = 0 if isinstance(warmup, bool) else operator.index(warmup)
        except TypeError:
            self.graph_warmup = 0
        if self.graph_warmup < 1:
            raise ValueError("KvtierCache: graph_warmup = %r, must be an integer >= 1"
                             % (warmup,))
        self.graph_replays = 0   # decode attentions served by a replayed graph
        self._graph: Optional[dict] = None
        self.options = options
        self._kv: Optional[_kc.Cache] = None
        self.seqs: List[_kc.Sequence] = []
        self._lengths = [0] * self.n_layers
        # layer -> (phase, key, value) of the update whose attention has not run yet: the
        # attention function serves only the K/V this cache has just returned ("prefill":
        # the layer was empty; "extend": tokens over a non-empty layer)
        self._fresh: dict = {}
        self._failed = ""
        self.layers = [_Layer(self, i) for i in range(self.n_layers)]
        self.layer_class_to_replicate = None
        self.offloading = False

    # ---- what transformers reads
    @property
    def kvtier(self) -> Optional[_kc.Cache]:
        return self._kv

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._lengths[layer_idx] if layer_idx < self.n_layers else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def _mask_sizes(self, query: Any, layer_idx: int) -> Tuple[int, int]:
        q_len = query if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length(layer_idx) + q_len, 0

    def get_mask_sizes(self, query: Any, layer_idx: int = 0) -> Tuple[int, int]:
        """(kv_length, kv_offset) for the mask: every token so far plus the new ones. `query` is
        the query length (transformers >= 5.x) or the cache_position tensor (earlier)."""
        return self._mask_sizes(query, layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_max_length(self) -> Optional[int]:
        return None

    @property
    def is_sliding(self) -> List[bool]:
        return [False] * self.n_layers

    @property
    def is_initialized(self) -> bool:
        return self._kv is not None

    @property
    def max_batch_size(self) -> int:
        return len(self.seqs)

    @property
    def max_cache_len(self) -> int:
        return -1

    def __len__(self) -> int:
        return self.n_layers

    def __repr__(self) -> str:
        return "KvtierCache(%d layers, batch %d, %d tokens)" % (self.n_layers, len(self.seqs),
                                                                self._lengths[0])

    # ---- batch and length changes (kvt_seq_truncate, kvt_seq_fork)
    def _check_between_steps(self, what: str) -> None:
        if self._failed:
            raise Unsupported("kvtier.hf: this KvtierCache failed earlier (%s); make a new one"
                              % self._failed)
        if self._fresh:
            raise Unsupported("kvtier.hf: %s between a layer's update and its attention (layers "
                              "%s): the cache changes between forward passes only"
                              % (what, sorted(self._fresh)))
        if len(set(self._lengths)) > 1:
            raise Unsupported("kvtier.hf: %s with layers of different lengths %s (a forward "
                              "pass did not reach every layer)" % (what, self._lengths))

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens of every row on every layer (a negative
        max_length drops that many; nothing happens when the cache is not longer): assisted
        and speculative decoding's rollback. One kvt_seq_truncate per row covers every layer;
        appending the same tokens again attends as if they had never been dropped. A failure
        on a later row after earlier rows were truncated leaves the cache unusable."""
        self._check_between_steps("crop")
        keep = _batch.crop_target(self._lengths[0], max_length)
        if keep is None:
            return
        drop = self._lengths[0] - keep
        if self._kv is not None and self.seqs:
            try:
                _batch.truncate_rows(self._kv, self.seqs, drop)
            except BaseException as e:
                if getattr(e, "rows_done", 0):
                    self._failed = "crop(%s) truncated %d of %d rows, then %s: %s" % (
                        max_length, e.rows_done, len(self.seqs), type(e).__name__, e)
                raise
        self._lengths = [keep] * self.n_layers
        self._graph = None  # lengths change under the same ids: captured anew, to be plain

    def _select_rows(self, indices: Any, what: str) -> None:
        """New row i takes old row rows[i]: the first new row of each source keeps its kvtier
        sequence, every further one gets a fork (shared full blocks, copied index and window);
        sources no new row takes are closed. A fork that fails closes the forks made and
        raises kvtier.Error with the batch as it was."""
        self._check_between_steps(what)
        if self._kv is None or not self.seqs:  # nothing stored yet: as DynamicCache, no-op
            return
        p = _batch.plan(_batch.as_rows(indices, len(self.seqs), what), len(self.seqs))
        if p.identity:
            return
        new, old = _batch.fork_rows(self._kv, self.seqs, p)
        self.seqs = new
        self._graph = None  # other sequence ids: the graphs are captured anew
        _batch.close_all(old)

    def reorder_cache(self, beam_idx: Any) -> None:
        """Beam search: new row i continues old row beam_idx[i] (a LongTensor of the batch's
        size, as transformers passes it)."""
        self._select_rows(beam_idx, "reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Every row repeated `repeats` times in place (row i -> rows i*repeats .. ):
        num_return_sequences or num_beams expansion of a filled cache."""
        rows = _batch.repeat_rows(len(self.seqs), repeats)
        self._select_rows(rows, "batch_repeat_interleave")

    def batch_select_indices(self, indices: Any) -> None:
        """Keep only the rows `indices` (ints or a LongTensor; a repeated index is forked)."""
        self._select_rows(indices, "batch_select_indices")

    def reset(self) -> None:
        raise Unsupported("kvtier.hf: reset is not served: make a new KvtierCache")

    def __getitem__(self, layer_idx: int) -> Any:
        raise Unsupported("kvtier.hf: the K/V of layer %s are in kvtier's host tier, not "
                          "tensors (legacy cache indexing is not served)" % layer_idx)

    def __iter__(self) -> Any:
        raise Unsupported("kvtier.hf: the K/V are in kvtier's host tier (legacy cache "
                          "iteration is not served)")

    def to_legacy_cache(self) -> Any:
        raise Unsupported("kvtier.hf: no legacy cache: the K/V are in kvtier's host tier")

    # ---- the data path
    def _create(self, key: torch.Tensor) -> None:
        if key.dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported("kvtier.hf: the model runs in %s; kvtier stores float16 or "
                              "bfloat16 K/V (load the model with dtype=torch.bfloat16)"
                              % key.dtype)
        b = int(key.shape[0])
        cuda = key.device.type == "cuda"
        if self.graphs and not cuda:
            raise Unsupported("kvtier.hf: graphs=True captures CUDA graphs; the model runs on %s "
                              "(the CPU backend has no graphs to replay)" % key.device)
        opts = dict(self.options)
        # room for the forks of reorder_cache (beam search forks before it closes: up to
        # 2b - 1 open) and batch_repeat_interleave; the CUDA backend serves at most
        # max_seqs * n_q_heads <= 65535
        cap = 65535 // self.n_q_heads if cuda else 65536
        opts.setdefault("max_seqs", max(b, 1, min(cap, max(2 * b, 256))))
        self._kv = _kc.Cache(n_layers=self.n_layers, n_q_heads=self.n_q_heads,
                             n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                             dtype=key.dtype, backend="cuda" if cuda else "cpu",
                             device=(key.device.index or 0) if cuda else None,
                             scale=self.scale, **opts)
        self.seqs = [self._kv.open() for _ in range(b)]

    @_failing_closed
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Take the new tokens' K/V of `layer_idx`, [b, n_kv_heads, n_new, head_dim] (post-RoPE).

        Prefill (this layer empty): returns them unchanged for the attention function, which
        attends over them and stores them with their queries (kvt_prefill). Over a non-empty
        layer (decode: one token; assisted decoding's verification or a later prefill chunk:
        several): returns them unchanged, and the attention function stores and attends them
        (one token: kvt_append, kvt_attend; several: kvt_extend, or one token at a time with
        chunks="steps"), each query over the tokens up to its own."""
        _active.cache = weakref.ref(self)
        b, h, n, d = key_states.shape
        if (h, d) != (self.n_kv_heads, self.head_dim):
            raise Unsupported("kvtier.hf: layer %d: key [%d, %d, %d, %d] does not match the "
                              "config's %d KV heads of dim %d" % (layer_idx, b, h, n, d,
                                                                  self.n_kv_heads,
                                                                  self.head_dim))
        if layer_idx in self._fresh:
            raise Unsupported("kvtier.hf: layer %d's last update never reached the 'kvtier' "
                              "attention: the model's attention must be attn_implementation="
                              "'kvtier'" % layer_idx)
        if self._kv is None:
            self._create(key_states)
        if b != len(self.seqs):
            raise Unsupported("kvtier.hf: batch of %d rows, the cache holds %d sequences"
                              % (b, len(self.seqs)))
        if self._lengths[layer_idx] == 0:
            self._fresh[layer_idx] = ("prefill", key_states, value_states)
            self._lengths[layer_idx] = n
            return key_states, value_states
        # decode (n == 1) or several tokens over a non-empty cache (assisted decoding's
        # verification, a later prefill chunk): the attention stores and attends them, each
        # query over the tokens up to its own (causal)
        self._lengths[layer_idx] += n
        self._fresh[layer_idx] = ("extend", key_states, value_states)
        return key_states, value_states

    @_failing_closed
    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: Optional[float],
               **kwargs: Any) -> torch.Tensor:
        """The attention of `module` (layer module.layer_idx): query [b, Hq, q_len, D] ->
        [b, q_len, Hq, D]."""
        layer = module.layer_idx
        if scaling is not None and self.check_scale and \
                abs(float(scaling) - self.scale) > 1e-6 * self.scale:
            raise Unsupported("kvtier.hf: layer %d attends with scale %g, the cache was made "
                              "for %g (pass scale= to KvtierCache)" % (layer, scaling,
                                                                       self.scale))
        fresh = self._fresh.pop(layer, None)
        if fresh is None or fresh[1] is not key:
            raise Unsupported("kvtier.hf: layer %d's attention did not receive the K/V this "
                              "KvtierCache has just returned (attn_implementation='kvtier' "
                              "needs past_key_values=KvtierCache)" % layer)
        if fresh[0] == "prefill":
            out = _prefill_attention(module, query, key, value, attention_mask, scaling,
                                     **kwargs)
            for i, s in enumerate(self.seqs):
                # [T, H, D] rows of one sequence (kvt_prefill's layout): copies made here
                self._kv.prefill(s, layer, query[i].transpose(0, 1).contiguous(),
                                 key[i].transpose(0, 1).contiguous(),
                                 value[i].transpose(0, 1).contiguous())
            return out
        n = int(query.shape[2])
        if n != int(key.shape[2]):
            raise Unsupported("kvtier.hf: layer %d: %d queries for %d new tokens" % (layer, n,
                                                                                 key.shape[2]))
        if n > 1 and self.chunks != "steps":
            b, hq, _, d = query.shape
            # [b, H, n, D] -> [b * n, H, D]: each sequence's rows in turn (copies made here)
            rows = lambda x: x.transpose(1, 2).reshape(b * n, x.shape[1], d)  # noqa: E731
            out = self._kv.extend(layer, self.seqs, [n] * b, rows(query).contiguous(),
                                  rows(key).contiguous(), rows(value).contiguous(),
                                  top_p=self.chunks == "topp")
            return out.view(b, n, hq, d)
        outs = []
        for t in range(n):
            # [b, Hkv, D] and [b, Hq, D]: views of the token's slice, dense when the
            # projection's output was; copied otherwise (this integration's own staging)
            k, v, q = key[:, :, t, :], value[:, :, t, :], query[:, :, t, :]
            k = k if k.is_contiguous() else k.contiguous()
            v = v if v.is_contiguous() else v.contiguous()
            q = q if q.is_contiguous() else q.contiguous()
            self._kv.append(layer, self.seqs, k, v)
            if n == 1 and self.graphs and self._kv.backend == "cuda":
                outs.append(self._attend_graph(layer, q))
            else:
                outs.append(self._kv.attend(layer, self.seqs, q))  # [b, Hq, D]
        return outs[0].unsqueeze(1) if n == 1 else torch.stack(outs, 1)  # [b, n, Hq, D]

    def _attend_graph(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One decode attention of `layer` through its captured graph: the first graph_warmup
        times an eager call of the same kvt_attend_graph, whose result is returned (the last of
        them followed by the capture), then a replay."""
        st = self._graph
        if st is None:
            self._kv.graph_reserve(len(self.seqs), self.graph_tokens)
            dev = q.device
            st = self._graph = dict(
                seqs=torch.tensor([s.id for s in self.seqs], dtype=torch.int32, device=dev),
                lengths=torch.zeros(len(self.seqs), dtype=torch.int32, device=dev),
                q=torch.empty_like(q), out=torch.empty_like(q), graphs={}, eager={})
        # the lengths the step must find (kvt_append has run): the runtime's own bookkeeping
        st["lengths"].copy_(torch.tensor([self._kv.length(s, layer) for s in self.seqs],
                                         dtype=torch.int32))
        st["q"].copy_(q)
        args = (layer, st["seqs"], st["q"], st["out"], st["lengths"])
        g = st["graphs"].get(layer)
        if g is None:
            self._kv.attend_graph(*args)      # warm-up at the graph's shape: this step's result
            out = st["out"].clone()
            st["eager"][layer] = st["eager"].get(layer, 0) + 1
            if st["eager"][layer] >= self.graph_warmup:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._kv.attend_graph(*args)
                st["graphs"][layer] = g
            return out
        g.replay()
        self.graph_replays += 1
        return st["out"].clone()

    # ---- lifetime and counters
    def stats(self) -> "Optional[_kc.Stats]":
        """kvtier's counters (None before the first forward pass)."""
        return None if self._kv is None else self._kv.stats()

    def close(self) -> None:
        """Free kvtier's memory; the cache cannot be used afterwards."""
        self._graph = None  # the graphs read kvtier's memory: gone first
        if self._kv is not None:
            self._kv.close()
            self._kv = None
        self.seqs = []

    def __enter__(self) -> "KvtierCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


if getattr(KvtierCache, "__abstractmethods__", None):
    KvtierCache.__abstractmethods__ = frozenset()


def _prefill_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: Any, scaling: Optional[float],
                       **kwargs: Any) -> torch.Tensor:
    """Exact causal attention of a prefill chunk over its own K/V: transformers' SDPA path (the
    same computation as attn_implementation="sdpa"), [b, T, Hq, D]."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        sdpa_attention_forward = None
    if sdpa_attention_forward is not None:
        kwargs.pop("dropout", None)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                        scaling=scaling, **kwargs)
        return out
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None,
        scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
              **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """The "kvtier" attention function (transformers' attention interface).

    query: [b, Hq, q_len, D]; key, value: what KvtierCache.update returned, [b, Hkv, n, D].
    Returns ([b, q_len, Hq, D], None)."""
    if getattr(module, "training", False) and dropout:
        raise Unsupported("kvtier.hf: training (attention dropout %g) is not served" % dropout)
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise Unsupported("kvtier.hf: layer %s: %s = %s is not served"
                              % (getattr(module, "layer_idx", "?"), name, kwargs[name]))
    cache = active_cache()
    if cache is None or cache._kv is None or getattr(module, "layer_idx", None) is None:
        raise Unsupported("kvtier.hf: attn_implementation='kvtier' needs past_key_values="
                          "kvtier.hf.KvtierCache(model.config) and use_cache=True")
    return cache.attend(module, query, key, value, attention_mask, scaling, **kwargs), None


def mask(*args: Any, **kwargs: Any) -> None:
    """The "kvtier" mask function: no mask tensor (prefill is causal, decode attends every
    token); refuses padding, which kvtier cannot serve exactly yet."""
    pad = kwargs.get("attention_mask", kwargs.get("padding_mask"))
    if isinstance(pad, torch.Tensor) and pad.dim() == 2 and not bool(pad.all()):
        raise Unsupported("kvtier.hf: the attention mask has padding: batches need prompts of "
                          "equal length (no padding)")
    return None


def register() -> None:
    """Register "kvtier" with transformers' attention and mask interfaces (done at import)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, attention)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, mask)
    except (ImportError, AttributeError):
        pass


register()
