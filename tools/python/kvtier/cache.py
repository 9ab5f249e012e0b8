# SPDX-License-Identifier: MIT
"""Pythonic objects over kvtier's C interface: Cache and Sequence (Config, the records and the calls
that need no cache are in _config.py, re-exported here).

Conventions (lib/kvtier.h): tensors are dense row-major in the cache's dtype (prefill, append,
attend and extend also take numpy or torch views with contiguous head rows, kvt_io_layout); host
memory (numpy arrays or CPU torch tensors) for the CPU backend, torch CUDA tensors on the cache's
device for the CUDA backend, where every call is queued on torch's current stream of that device.
Calls on one Cache must be serialized by the caller (one thread at a time), as in C.
"""

from __future__ import annotations

import ctypes
import errno
from typing import Any, Iterable, Optional, Sequence as Seq, Union

from . import _abi
from ._tensor import (DTYPE_I32, empty_like_kind, is_torch, pointer, slot_pointer, stream_of,
                      strided_pointer)
from .errors import U32_MAX, Error, check, refuse, whole
from ._config import (NONE, NONE64, NVME_KEEP_FILES, Capacity, Config, Footprint, Gathered,
                      LayerStats, ProbeInfo, Stats,
                      _config_of, _fill, footprint, probe, strerror, version, version_number)


SeqLike = Union["Sequence", int]


class Sequence:
    """One open sequence (a request's context) of a Cache; `id` is kvt_seq_open's id. Closing it
    (close(), or leaving a `with` block) frees its rows; a closed Sequence is refused by every
    call (-ENOENT) even if the library has reused its id."""

    def __init__(self, cache: "Cache", seq_id: int):
        self.cache, self.id, self.closed = cache, seq_id, False

    def __repr__(self) -> str:
        return "<kvtier.Sequence %d%s>" % (self.id, " closed" if self.closed else "")

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """kvt_seq_close. Closing twice is a no-op."""
        if not self.closed:
            self.cache._close_seq(self)

    def length(self, layer: int = 0) -> int:
        """Tokens held on `layer`."""
        return self.cache.length(self, layer)

    def prefill(self, layer: int, q: Any, k: Any, v: Any) -> None:
        """Cache.prefill for this sequence."""
        self.cache.prefill(self, layer, q, k, v)

    def status(self) -> "tuple[int, str]":
        """Cache.status for this sequence."""
        return self.cache.status(self)

    def spill(self) -> int:
        """Cache.spill for this sequence."""
        return self.cache.spill(self)

    def restore(self) -> int:
        """Cache.restore for this sequence."""
        return self.cache.restore(self)

    def truncate(self, n_tokens: int) -> None:
        """Cache.truncate for this sequence."""
        self.cache.truncate(self, n_tokens)

    def fork(self) -> "Sequence":
        """Cache.fork of this sequence."""
        return self.cache.fork(self)


class Cache:
    """A kvtier cache (kvt_cache_create / kvt_cache_destroy), usable as a context manager.

    Cache(Config(n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128)) or
    Cache(n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128, backend="cpu").
    Attributes: config (the Config given), backend ("cpu" or "cuda"), dtype and out_dtype (kvt
    codes), device (CUDA ordinal).
    """

    def __init__(self, config: Union[Config, dict, None] = None, **kwargs: Any):
        self.config = _config_of(config, kwargs)
        c, keep = self.config.to_c()
        handle = ctypes.c_void_p()
        check(_abi.lib().kvt_cache_create(ctypes.byref(c), ctypes.byref(handle)), None,
              "kvt_cache_create")
        del keep
        self._h: Optional[int] = handle.value
        self._seqs: dict = {}
        self.n_layers, self.n_q_heads = c.n_layers, c.n_q_heads
        self.n_kv_heads, self.head_dim = c.n_kv_heads, c.head_dim
        self.dtype = c.dtype or _abi.DTYPE_F16
        self.out_dtype = c.out_dtype or self.dtype
        self.device = c.device
        self.backend = self.stats().backend

    # ---- lifetime
    def close(self) -> None:
        """kvt_cache_destroy: frees every sequence. Closing twice is a no-op."""
        if self._h is not None:
            for s in list(self._seqs.values()):
                s.closed = True
            self._seqs.clear()
            _abi.lib().kvt_cache_destroy(self._h)
            self._h = None

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    @property
    def closed(self) -> bool:
        return self._h is None

    def _handle(self) -> int:
        if self._h is None:
            raise refuse("the cache is closed")
        return self._h

    def _check(self, rc: int, what: str) -> int:
        return check(rc, self._h, what)

    def last_error(self) -> str:
        """kvt_last_error: the detail of this cache's last error, or ""."""
        raw = _abi.lib().kvt_last_error(self._handle())
        return raw.decode("utf-8", "replace") if raw else ""

    # ---- sequences
    def open(self) -> Sequence:
        """kvt_seq_open: a new empty Sequence. Errors: -ENOSPC (max_seqs open), -ENOMEM."""
        sid = ctypes.c_uint32()
        self._check(_abi.lib().kvt_seq_open(self._handle(), ctypes.byref(sid)), "kvt_seq_open")
        s = Sequence(self, sid.value)
        self._seqs[sid.value] = s
        return s

    def _close_seq(self, s: Sequence) -> None:
        self._check(_abi.lib().kvt_seq_close(self._handle(), s.id), "kvt_seq_close")
        s.closed = True
        self._seqs.pop(s.id, None)

    def _seq_id(self, s: SeqLike) -> int:
        if isinstance(s, Sequence):
            if s.cache is not self:
                raise refuse("sequence %d belongs to another cache" % s.id)
            if s.closed:
                raise refuse("sequence %d is closed" % s.id, -errno.ENOENT)
            return s.id
        if isinstance(s, bool) or not isinstance(s, int):
            raise refuse("sequence: a %s, want a kvtier.Sequence or an int id"
                         % type(s).__name__)
        if s not in self._seqs:
            raise refuse("sequence %d is not open in this cache" % s, -errno.ENOENT)
        return s

    def _seq_array(self, seqs: Union[SeqLike, Iterable[SeqLike]]) -> "ctypes.Array":
        """The batch's ids; a sequence refused names its index in Error.entry, as C does (a
        duplicate: its second place)."""
        if isinstance(seqs, (Sequence, int)):
            seqs = [seqs]
        ids: list = []
        first: dict = {}  # id -> its first place, so a batch is checked in one pass
        for i, s in enumerate(seqs):
            try:
                sid = self._seq_id(s)
            except Error as e:
                raise refuse("seqs[%d]: %s" % (i, e.detail), e.code, entry=i) from None
            if sid in first:
                raise refuse("seqs[%d] = seqs[%d] = %d: a sequence appears twice in one batch"
                             % (first[sid], i, sid), entry=i)
            first[sid] = i
            ids.append(sid)
        if not ids:
            raise refuse("seqs is empty: want at least one sequence")
        return (ctypes.c_uint32 * len(ids))(*ids)

    @staticmethod
    def _rows(start: int, stop: int) -> "tuple[int, int]":
        start, stop = whole("start", start, U32_MAX), whole("stop", stop, U32_MAX)
        if stop <= start:
            raise refuse("rows [%d, %d): want start < stop" % (start, stop))
        return start, stop

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not \
                0 <= layer < self.n_layers:
            raise refuse("layer = %r, must be in [0, %d)" % (layer, self.n_layers))
        return layer

    def _ptr(self, name: str, x: Any, shape: tuple, dtype: Optional[int] = None,
             writable: bool = False) -> int:
        return pointer(name, x, shape, self.dtype if dtype is None else dtype, self.backend,
                       self.device, writable)

    def _sptr(self, name: str, x: Any, shape: tuple, dtype: Optional[int] = None,
              writable: bool = False) -> "tuple[int, Any]":
        return strided_pointer(name, x, shape, self.dtype if dtype is None else dtype,
                               self.backend, self.device, writable)

    @staticmethod
    def _layout(**views: Any) -> Any:
        """A pointer to the kvt_io_layout of the strided ones among views (q, k, v, out: None or
        (token_stride, head_stride) in elements), or None (NULL: all dense, no copy in C)."""
        if all(s is None for s in views.values()):
            return None
        lo = _abi.KvtIoLayout(size=ctypes.sizeof(_abi.KvtIoLayout))
        for name, s in views.items():
            if s is not None:
                setattr(lo, name, _abi.KvtIoView(*s))
        return ctypes.pointer(lo)

    def length(self, seq: SeqLike, layer: int = 0) -> int:
        """kvt_seq_length: tokens held by `seq` on `layer`."""
        sid = self._seq_id(seq)
        return self._check(_abi.lib().kvt_seq_length(self._handle(), sid, self._layer(layer)),
                           "kvt_seq_length")

    def status(self, seq: SeqLike) -> "tuple[int, str]":
        """kvt_seq_status: (0, "") or the negative code and text of an error found in a step
        after its call returned (the CUDA kernels'); such a sequence fails the calls that compute
        with it until it is truncated."""
        sid = self._seq_id(seq)
        code = ctypes.c_int(0)
        text = ctypes.create_string_buffer(256)
        self._check(_abi.lib().kvt_seq_status(self._handle(), sid, ctypes.byref(code), text,
                                              len(text)), "kvt_seq_status")
        return code.value, text.value.decode(errors="replace")

    def spill(self, seq: SeqLike) -> int:
        """kvt_seq_spill: move the sequence's full indexed blocks to the NVMe tier; returns the
        bytes moved. -EOPNOTSUPP without an NVMe tier (or liburing)."""
        sid = self._seq_id(seq)
        return self._check(_abi.lib().kvt_seq_spill(self._handle(), sid), "kvt_seq_spill")

    def restore(self, seq: SeqLike) -> int:
        """kvt_seq_restore: bring its spilled blocks back to the host tier; returns the bytes."""
        sid = self._seq_id(seq)
        return self._check(_abi.lib().kvt_seq_restore(self._handle(), sid), "kvt_seq_restore")

    def truncate(self, seq: SeqLike, n_tokens: int) -> None:
        """kvt_seq_truncate: drop the last n_tokens tokens of `seq` on every layer (speculative
        rollback); appending the same tokens again attends as if they had never been dropped.
        CUDA backend: synchronizes the device."""
        sid, n_tokens = self._seq_id(seq), whole("n_tokens", n_tokens, U32_MAX)
        self._check(_abi.lib().kvt_seq_truncate(self._handle(), sid, n_tokens,
                                                stream_of([], self.backend)), "kvt_seq_truncate")

    def fork(self, seq: SeqLike) -> Sequence:
        """kvt_seq_fork: a new Sequence holding what `seq` holds; full blocks are shared copy on
        write, the index and window copied. CUDA backend: synchronizes the device."""
        sid, child = self._seq_id(seq), ctypes.c_uint32()
        self._check(_abi.lib().kvt_seq_fork(self._handle(), sid, ctypes.byref(child),
                                            stream_of([], self.backend)), "kvt_seq_fork")
        s = Sequence(self, child.value)
        self._seqs[child.value] = s
        return s

    def read_rows(self, seq: SeqLike, layer: int, start: int, stop: int) -> "tuple[Any, Any]":
        """kvt_seq_read_rows: (k, v) of tokens [start, stop) of `seq` on `layer`, each
        [stop - start, n_kv_heads, head_dim] in dtype: numpy arrays (CPU backend) or torch tensors
        on the cache's device (CUDA backend, queued on torch's current stream)."""
        import numpy as np
        sid, layer = self._seq_id(seq), self._layer(layer)
        start, stop = self._rows(start, stop)
        shape = (stop - start, self.n_kv_heads, self.head_dim)
        if self.backend == "cuda":
            import torch
            ref = torch.empty(0, device="cuda:%d" % self.device)
        else:
            ref = np.empty(0)
        k, v = empty_like_kind(ref, shape, self.dtype), empty_like_kind(ref, shape, self.dtype)
        pk = self._ptr("k", k, shape, writable=True)
        pv = self._ptr("v", v, shape, writable=True)
        self._check(_abi.lib().kvt_seq_read_rows(self._handle(), sid, layer, start, stop, pk, pv,
                                                 stream_of([k, v], self.backend)),
                    "kvt_seq_read_rows")
        return k, v

    def write_rows(self, seq: SeqLike, layer: int, k: Any, v: Any) -> None:
        """kvt_seq_write_rows: append rows computed elsewhere at the end of `seq` on `layer`,
        indexed as a prefill chunk without queries. k, v: [n_tokens, n_kv_heads, head_dim]."""
        sid, layer = self._seq_id(seq), self._layer(layer)
        if not hasattr(k, "shape") or len(k.shape) != 3:
            raise refuse("k: want [n_tokens, n_kv_heads, head_dim], got %s"
                         % (getattr(k, "shape", type(k).__name__),))
        n, start = int(k.shape[0]), self.length(seq, layer)
        shape = (n, self.n_kv_heads, self.head_dim)
        pk, pv = self._ptr("k", k, shape), self._ptr("v", v, shape)
        self._check(_abi.lib().kvt_seq_write_rows(self._handle(), sid, layer, start, start + n,
                                                  pk, pv, stream_of([k, v], self.backend)),
                    "kvt_seq_write_rows")

    def _paged(self, what: str, k_cache: Any, v_cache: Any, slots: Any, n: int,
               write: bool) -> "tuple[Any, Any, Any]":
        """Check a runtime's paged K/V buffers ([n_slots, n_kv_heads, head_dim], any slot and head
        strides, elements contiguous, k and v alike: numpy arrays or CPU torch tensors for the
        CPU backend, torch tensors on the cache's device for the CUDA backend) and the slot mapping
        (n int64 slots, each < n_slots; -1 skips a token on read; numpy or torch, read on the
        host); returns the layout, the slots kept alive, and the pointers. C cannot know the
        buffers' size: the slots are checked against it here."""
        import numpy as np
        torch_kv = is_torch(k_cache)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if is_torch(x) != torch_kv or not (torch_kv or isinstance(x, np.ndarray)):
                raise refuse("%s: %s takes numpy arrays or torch tensors, both of one kind, got %s"
                             % (name, what, type(x).__name__))
            shape = tuple(x.shape)
            if len(shape) != 3 or shape[1:] != (self.n_kv_heads, self.head_dim):
                raise refuse("%s: want [n_slots, %d, %d], got %s"
                             % (name, self.n_kv_heads, self.head_dim, shape))
            if torch_kv:
                cuda = x.device.type == "cuda"
                if cuda != (self.backend == "cuda") or (cuda and x.device.index != self.device):
                    raise refuse("%s: on %s, the %s backend wants %s" % (
                        name, x.device, self.backend,
                        "cuda:%d" % self.device if self.backend == "cuda" else "the CPU"))
                if x.stride(2) != 1 or x.stride(0) <= 0 or x.stride(1) <= 0:
                    raise refuse("%s: the elements of a head must be contiguous and the strides "
                                 "positive, got strides %s" % (name, tuple(x.stride())))
            else:
                if self.backend == "cuda":
                    raise refuse("%s: numpy memory, the cuda backend takes torch tensors on "
                                 "cuda:%d" % (name, self.device))
                if x.strides[2] != x.itemsize or any(s % x.itemsize or s <= 0
                                                     for s in x.strides):
                    raise refuse("%s: the elements of a head must be contiguous and the strides "
                                 "positive multiples of the element size, got strides %s"
                                 % (name, x.strides))
                if not write and not x.flags.writeable:
                    raise refuse("%s is read-only: read_rows_paged writes into it" % name)
        if torch_kv:
            import torch
            want = {_abi.DTYPE_F16: torch.float16, _abi.DTYPE_BF16: torch.bfloat16}.get(self.dtype)
            same = (k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride() and
                    k_cache.shape == v_cache.shape)
            strides, n_slots = tuple(k_cache.stride()), int(k_cache.shape[0])
            ptrs = (k_cache.data_ptr(), v_cache.data_ptr())
        else:
            want = {_abi.DTYPE_F16: np.float16, _abi.DTYPE_BF16: np.uint16}.get(self.dtype)
            same = (k_cache.dtype == v_cache.dtype and k_cache.strides == v_cache.strides and
                    k_cache.shape == v_cache.shape)
            strides = tuple(st // k_cache.itemsize for st in k_cache.strides)
            n_slots, ptrs = int(k_cache.shape[0]), (k_cache.ctypes.data, v_cache.ctypes.data)
        if not same:
            raise refuse("k_cache and v_cache must have the same shape, dtype and strides")
        if k_cache.dtype != want:
            raise refuse("k_cache: dtype %s, the cache stores %s" % (k_cache.dtype, want))
        if is_torch(slots):
            slots = slots.detach().cpu().numpy()
        slots = np.asarray(slots)
        if slots.size and not np.issubdtype(slots.dtype, np.integer):
            raise refuse("slot_mapping: dtype %s, want integers (slots are not rounded)"
                         % slots.dtype)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if slots.shape != (n,):
            raise refuse("slot_mapping: want %d slots, got shape %s" % (n, slots.shape))
        lo = -1 if not write else 0
        if n and (slots.min() < lo or slots.max() >= n_slots):
            raise refuse("slot_mapping: slots must be in [%d, n_slots = %d), got [%d, %d]"
                         % (lo, n_slots, slots.min(), slots.max()))
        layout = _abi.KvtRowsLayout(size=ctypes.sizeof(_abi.KvtRowsLayout), flags=0,
                                    slot_mapping=slots.ctypes.data, slot_stride=strides[0],
                                    head_stride=strides[1])
        return layout, slots, ptrs

    def read_rows_paged(self, seq: SeqLike, layer: int, start: int, stop: int, k_cache: Any,
                        v_cache: Any, slot_mapping: Any) -> None:
        """kvt_seq_read_rows_at: the rows of tokens [start, stop) of `seq` on `layer` into slot
        slot_mapping[i] of a runtime's paged buffers k_cache, v_cache ([n_slots, n_kv_heads,
        head_dim] in dtype, any slot and head strides: numpy or CPU torch for the CPU backend,
        torch on the cache's device for the CUDA backend, queued on torch's current stream); a
        slot of -1 skips the token, the others must be distinct."""
        sid, layer = self._seq_id(seq), self._layer(layer)
        start, stop = self._rows(start, stop)
        layout, slots, (pk, pv) = self._paged("read_rows_paged", k_cache, v_cache, slot_mapping,
                                              stop - start, False)
        self._check(_abi.lib().kvt_seq_read_rows_at(self._handle(), sid, layer, start, stop, pk,
                                                    pv, ctypes.byref(layout),
                                                    stream_of([k_cache], self.backend)),
                    "kvt_seq_read_rows_at")

    def write_rows_paged(self, seq: SeqLike, layer: int, k_cache: Any, v_cache: Any,
                         slot_mapping: Any) -> None:
        """kvt_seq_write_rows_at: append len(slot_mapping) rows taken from slots slot_mapping[i]
        of a runtime's paged buffers at the end of `seq` on `layer`, stored and indexed as a
        prefill chunk without queries. Buffers as read_rows_paged's."""
        sid, layer = self._seq_id(seq), self._layer(layer)
        shape = tuple(getattr(slot_mapping, "shape", (len(slot_mapping),)))
        n = int(shape[0]) if len(shape) == 1 else -1
        if n <= 0:
            raise refuse("slot_mapping: want a non-empty 1-D array of slots")
        layout, slots, (pk, pv) = self._paged("write_rows_paged", k_cache, v_cache,
                                              slot_mapping, n, True)
        start = self.length(seq, layer)
        self._check(_abi.lib().kvt_seq_write_rows_at(self._handle(), sid, layer, start,
                                                     start + n, pk, pv, ctypes.byref(layout),
                                                     stream_of([k_cache], self.backend)),
                    "kvt_seq_write_rows_at")

    # ---- data path
    def prefill(self, seq: SeqLike, layer: int, q: Any, k: Any, v: Any) -> None:
        """kvt_prefill: one prefill chunk of `seq` on `layer`.

        q: [n_tokens, n_q_heads, head_dim] in dtype, or None (the query centroid is then zero)
        k, v: [n_tokens, n_kv_heads, head_dim] in dtype
        q, k, v (numpy or torch) may be strided views with contiguous head rows (a fused qkv
        split, a [B, H, T, D] transpose): passed with their strides (kvt_prefill_at), not
        copied. So may the tensors of append, attend (out too) and extend.
        CUDA backend: queued on torch's current stream.
        """
        sid, layer = self._seq_id(seq), self._layer(layer)
        if not hasattr(k, "shape") or len(k.shape) != 3:
            raise refuse("k: want [n_tokens, n_kv_heads, head_dim], got %s"
                         % (getattr(k, "shape", type(k).__name__),))
        n = int(k.shape[0])
        kv_shape = (n, self.n_kv_heads, self.head_dim)
        pk, sk = self._sptr("k", k, kv_shape)
        pv, sv = self._sptr("v", v, kv_shape)
        pq, sq = (None, None) if q is None else \
            self._sptr("q", q, (n, self.n_q_heads, self.head_dim))
        stream = stream_of([k, v], self.backend)
        self._check(_abi.lib().kvt_prefill_at(self._handle(), sid, layer, pq, pk, pv, n,
                                              self._layout(q=sq, k=sk, v=sv), stream),
                    "kvt_prefill_at")

    def append(self, layer: int, seqs: Union[SeqLike, Iterable[SeqLike]], k: Any,
               v: Any) -> None:
        """kvt_append: one decode token for each sequence of `seqs` on `layer`.

        k, v: [n_seqs, n_kv_heads, head_dim] in dtype. All or nothing.
        """
        ids, layer = self._seq_array(seqs), self._layer(layer)
        shape = (len(ids), self.n_kv_heads, self.head_dim)
        (pk, sk), (pv, sv) = self._sptr("k", k, shape), self._sptr("v", v, shape)
        self._check(_abi.lib().kvt_append_at(self._handle(), layer, len(ids), ids, pk, pv,
                                             self._layout(k=sk, v=sv),
                                             stream_of([k, v], self.backend)), "kvt_append_at")

    def attend(self, layer: int, seqs: Union[SeqLike, Iterable[SeqLike]], q: Any,
               out: Any = None) -> Any:
        """kvt_attend: one decode step of attention on `layer` for `seqs`.

        q: [n_seqs, n_q_heads, head_dim] in dtype
        out: [n_seqs, n_q_heads, head_dim] in out_dtype, or None: a new array / tensor of the same
            kind and device as q. Returns out.
        """
        ids, layer = self._seq_array(seqs), self._layer(layer)
        shape = (len(ids), self.n_q_heads, self.head_dim)
        pq, sq = self._sptr("q", q, shape)
        if out is None:
            out = empty_like_kind(q, shape, self.out_dtype)
        po, so = self._sptr("out", out, shape, self.out_dtype, writable=True)
        self._check(_abi.lib().kvt_attend_at(self._handle(), layer, len(ids), ids, pq, po,
                                             self._layout(q=sq, out=so),
                                             stream_of([q, out], self.backend)), "kvt_attend_at")
        return out

    def graph_reserve(self, max_slots: int, max_tokens: int) -> None:
        """kvt_graph_reserve: size every decode step once for batches of up to `max_slots` slots
        of sequences holding up to `max_tokens` tokens, and keep the device records attend_graph
        reads (max_slots 0 drops the reservation). Within it attend and attend_graph give
        bit-equal outputs; on the CUDA backend a batch beyond it is refused (E2BIG)."""
        max_slots = whole("max_slots", max_slots, U32_MAX)
        max_tokens = whole("max_tokens", max_tokens, U32_MAX)
        self._check(_abi.lib().kvt_graph_reserve(self._handle(), max_slots, max_tokens, None),
                    "kvt_graph_reserve")

    def attend_graph(self, layer: int, seqs: Any, q: Any, out: Any, lengths: Any = None,
                     valid: Any = None) -> Any:
        """kvt_attend_graph: attend's step over slots whose sequence ids (and the lengths the
        caller expects, and which slots are valid) are read from buffers when the step runs, so
        that a CUDA graph captured over this call replays each step's batch.

        seqs: int32 [n_slots] sequence ids (Sequence.id), < 0 pads the slot
        lengths: int32 [n_slots] or None; valid: uint8 / bool [n_slots] or None (0 pads)
            (torch CUDA tensors on the cache's device for the CUDA backend; numpy arrays or CPU
            tensors for the CPU backend)
        q: [n_slots, n_q_heads, head_dim] in dtype; out: the same shape in out_dtype, written
            for the valid slots only. Needs graph_reserve(n_slots or more, ...). Returns out.
        """
        layer = self._layer(layer)
        ps, n = slot_pointer("seqs", seqs, None, "int32", self.backend, self.device)
        pl = None if lengths is None else \
            slot_pointer("lengths", lengths, n, "int32", self.backend, self.device)[0]
        pv = None if valid is None else \
            slot_pointer("valid", valid, n, "uint8", self.backend, self.device)[0]
        shape = (n, self.n_q_heads, self.head_dim)
        pq = self._ptr("q", q, shape)
        po = self._ptr("out", out, shape, self.out_dtype, writable=True)
        gb = _abi.KvtGraphBatch(n_slots=n, seqs=ps, lengths=pl, valid=pv)
        self._check(_abi.lib().kvt_attend_graph(self._handle(), layer, ctypes.byref(gb), pq, po,
                                                stream_of([q, out], self.backend)),
                    "kvt_attend_graph")
        return out

    def extend(self, layer: int, seqs: Union[SeqLike, Iterable[SeqLike]], lengths: Seq[int],
               q: Any, k: Any, v: Any, out: Any = None, top_p: bool = False) -> Any:
        """kvt_extend: several new tokens per sequence (chunked prefill, a prefix hit, speculative
        verification) attending everything stored before them, varlen over `seqs` on `layer`.

        lengths: new tokens of each sequence, in the order of `seqs` (0: the sequence is left
            untouched); their sum is `total`, and sequence i's rows follow those of 0 .. i - 1
        q: [total, n_q_heads, head_dim] in dtype
        k, v: [total, n_kv_heads, head_dim] in dtype
        out: [total, n_q_heads, head_dim] in out_dtype, or None: a new array of q's kind.
        top_p: False: exact attention; True (KVT_EXTEND_TOPP): each query row attends what an
            attend step would select for it among the tokens up to it (speculative verification)
        The rows are stored and indexed as prefill stores a chunk; query row j of a sequence holding
        n tokens before the call attends its tokens 0 .. n + j exactly (as attend at p = 1), or with
        top_p the sinks and window among them and its Top-p selection of the indexed ones (indexed
        tokens past it are not scored): each sequence's last row then equals attend of its query.
        All or nothing. Returns out. Both backends serve both (CUDA: top_p as one decode step
        per query row).
        """
        ids, layer = self._seq_array(seqs), self._layer(layer)
        lengths = list(lengths)
        if len(lengths) != len(ids):
            raise refuse("lengths = %r: want %d ints >= 0, one per sequence" % (lengths, len(ids)))
        cu = [0]
        for i, n in enumerate(lengths):
            cu.append(cu[-1] + whole("lengths[%d]" % i, n, U32_MAX))
        total = whole("sum(lengths)", cu[-1], U32_MAX)
        q_shape, kv_shape = (total, self.n_q_heads, self.head_dim), \
            (total, self.n_kv_heads, self.head_dim)
        (pq, sq), (pk, sk), (pv, sv) = self._sptr("q", q, q_shape), \
            self._sptr("k", k, kv_shape), self._sptr("v", v, kv_shape)
        if out is None:
            out = empty_like_kind(q, q_shape, self.out_dtype)
        po, so = self._sptr("out", out, q_shape, self.out_dtype, writable=True)
        c_cu = (ctypes.c_uint32 * len(cu))(*cu)
        flags = _abi.EXTEND_TOPP if top_p else 0
        self._check(_abi.lib().kvt_extend_at(self._handle(), layer, len(ids), ids, c_cu, pq, pk,
                                             pv, po, flags, self._layout(q=sq, k=sk, v=sv, out=so),
                                             stream_of([q, k, v, out], self.backend)),
                    "kvt_extend_at")
        return out

    def select(self, layer: int, seqs: Union[SeqLike, Iterable[SeqLike]], q: Any) -> int:
        """kvt_select: the selection of attend without the attention. q as attend's. Returns the
        largest token count of any (sequence, KV head): the max_tokens gather needs."""
        ids, layer = self._seq_array(seqs), self._layer(layer)
        pq, sq = self._sptr("q", q, (len(ids), self.n_q_heads, self.head_dim))
        return self._check(_abi.lib().kvt_select_at(self._handle(), layer, len(ids), ids, pq,
                                                    self._layout(q=sq),
                                                    stream_of([q], self.backend)),
                           "kvt_select_at")

    def gather(self, layer: int, seqs: Union[SeqLike, Iterable[SeqLike]], max_tokens: int,
               positions: bool = True, kv: bool = True) -> Gathered:
        """kvt_gather: the tokens chosen by the last select/attend of these sequences on `layer`
        (same list, same order), in ascending position order. Buffers are allocated here: numpy
        for the CPU backend, torch tensors on the cache's device for the CUDA backend (counts is
        always a host numpy int32 array [n_seqs, n_kv_heads])."""
        import numpy as np
        ids, layer = self._seq_array(seqs), self._layer(layer)
        n, h, d = len(ids), self.n_kv_heads, self.head_dim
        m = whole("max_tokens", max_tokens, U32_MAX)
        counts = np.zeros((n, h), dtype=np.int32)
        if self.backend == "cuda":
            import torch
            ref = torch.empty(0, device="cuda:%d" % self.device)
        else:
            ref = counts
        pos = empty_like_kind(ref, (n, h, m), DTYPE_I32) if positions else None
        k = empty_like_kind(ref, (n, h, m, d), self.dtype) if kv else None
        v = empty_like_kind(ref, (n, h, m, d), self.dtype) if kv else None
        pk = None if k is None else self._ptr("k_out", k, (n, h, m, d), writable=True)
        pv = None if v is None else self._ptr("v_out", v, (n, h, m, d), writable=True)
        pp = None if pos is None else (pos.data_ptr() if is_torch(pos) else pos.ctypes.data)
        total = self._check(_abi.lib().kvt_gather(
            self._handle(), layer, n, ids, m,
            counts.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), pp, pk, pv,
            stream_of([x for x in (k, pos) if x is not None], self.backend)), "kvt_gather")
        return Gathered(total, counts, pos, k, v)

    # ---- counters
    def stats(self) -> "Stats":
        """kvt_get_stats as a Stats dataclass (CUDA backend: waits for queued work)."""
        st = _abi.KvtStats()
        st.size = ctypes.sizeof(st)
        self._check(_abi.lib().kvt_get_stats(self._handle(), ctypes.byref(st)), "kvt_get_stats")
        return _fill(Stats, st)

    def capacity(self) -> "Capacity":
        """kvt_get_capacity as a Capacity dataclass: free host and NVMe bytes, bytes per token and
        per block. Never synchronizes the device, so a scheduler may ask at every step."""
        k = _abi.KvtCapacity()
        k.size = ctypes.sizeof(k)
        self._check(_abi.lib().kvt_get_capacity(self._handle(), ctypes.byref(k)),
                    "kvt_get_capacity")
        return _fill(Capacity, k)

    def seq_bytes(self, seq: SeqLike) -> "tuple[int, int]":
        """kvt_seq_bytes: (host-tier bytes, NVMe bytes) the sequence holds now."""
        host, nvme = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(_abi.lib().kvt_seq_bytes(self._handle(), self._seq_id(seq),
                                             ctypes.byref(host), ctypes.byref(nvme)),
                    "kvt_seq_bytes")
        return host.value, nvme.value

    def layer_stats(self, layer: int) -> "LayerStats":
        """kvt_get_layer_stats of `layer` as a LayerStats dataclass (zeros on the CPU backend)."""
        st = _abi.KvtLayerStats()
        st.size = ctypes.sizeof(st)
        self._check(_abi.lib().kvt_get_layer_stats(self._handle(), self._layer(layer),
                                                   ctypes.byref(st)), "kvt_get_layer_stats")
        return _fill(LayerStats, st)
