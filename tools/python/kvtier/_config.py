# SPDX-License-Identifier: MIT
"""The configuration and the result records of kvtier's C interface: Config (kvt_config), the
frozen dataclasses of kvt_stats, kvt_layer_stats, kvt_probe_info, kvt_capacity and
kvt_footprint, Gathered, and the calls that need no cache (version, strerror, probe,
footprint). Re-exported by kvtier and kvtier.cache."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, List, NamedTuple, Optional, Union

from . import _abi
from .errors import U64_MAX, check, refuse, whole

NONE = _abi.NONE32     # explicit zero of a 32-bit field (kvtier.h KVT_NONE)
NONE64 = _abi.NONE64   # explicit zero of a 64-bit field (KVT_NONE64)
NVME_KEEP_FILES = 1    # kvt_nvme_flags: keep the NVMe files the cache created (kvtier.h)

_DTYPES = {"float16": _abi.DTYPE_F16, "f16": _abi.DTYPE_F16, "fp16": _abi.DTYPE_F16,
           "half": _abi.DTYPE_F16, "bfloat16": _abi.DTYPE_BF16, "bf16": _abi.DTYPE_BF16,
           "float32": _abi.DTYPE_F32, "f32": _abi.DTYPE_F32, "fp32": _abi.DTYPE_F32,
           "float": _abi.DTYPE_F32}
_BACKENDS = {"auto": _abi.BACKEND_AUTO, "cpu": _abi.BACKEND_CPU, "cuda": _abi.BACKEND_CUDA}
_SPILL = {"none": _abi.SPILL_NONE, "lru": _abi.SPILL_LRU}
# fields whose value 0 is meaningful: 0 given here is sent as the explicit zero (KVT_NONE[64])
_ZERO_IS_VALUE_32 = ("n_sink", "window", "budget_min", "budget_max")
_ZERO_IS_VALUE_64 = ("seed", "gpu_cache_bytes")


def _ranges(struct: type) -> dict:
    """Each integer field of a ctypes struct: (lowest, highest) value its C type holds."""
    out = {}
    for name, t in struct._fields_:
        if t in (ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64):
            out[name] = (0, (1 << 8 * ctypes.sizeof(t)) - 1)
        elif t in (ctypes.c_int8, ctypes.c_int16, ctypes.c_int32, ctypes.c_int64):
            out[name] = (-(1 << 8 * ctypes.sizeof(t) - 1), (1 << 8 * ctypes.sizeof(t) - 1) - 1)
    return out


_RANGE = _ranges(_abi.KvtConfig)


def _int_field(name: str, value: Any) -> int:
    """A Config field's int, within its C field's range (ctypes would wrap a larger one)."""
    lo, hi = _RANGE[name]
    return whole(name, value, hi, lo)


def _dtype_code(name: str, value: Any) -> int:
    if value is None:
        return _abi.DTYPE_DEFAULT
    if isinstance(value, int):
        return _int_field(name, value)
    key = str(value).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise refuse("%s = %r: want float16, bfloat16 or float32" % (name, value))
    return _DTYPES[key]


def _enum(name: str, value: Any, table: dict) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return _int_field(name, value)
    if str(value).lower() not in table:
        raise refuse("%s = %r: want one of %s" % (name, value, ", ".join(table)))
    return table[str(value).lower()]


@dataclasses.dataclass
class Config:
    """kvt_config. None (or 0) means the library's default, as in C; for the fields where zero is
    a value of its own (n_sink, window, budget_min, budget_max, seed, gpu_cache_bytes) a 0 given
    here means that zero (no sinks, no window, no floor, no cap, seed 0, no hot cache) and is sent
    as KVT_NONE / KVT_NONE64. gpu_cache_bytes None is the self-sized hot cache, bounded by
    gpu_cache_max_bytes (None: a quarter of the device memory free at creation). Strings are
    accepted for the enums: dtype "float16"/"bfloat16", out_dtype also "float32", backend
    "auto"/"cpu"/"cuda", spill_policy "none"/"lru"; torch dtypes are accepted too. An integer
    field takes an int within its C field's range (0 .. 2**32 - 1 for a uint32_t, 2**64 - 1 for
    a uint64_t; device a signed 32-bit int): anything else (a negative, a larger int, a float,
    a bool) is refused with Error -EINVAL naming the field, never wrapped as ctypes would."""
    n_layers: int = 0
    n_q_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    dtype: Any = None
    out_dtype: Any = None
    backend: Any = None
    device: Optional[int] = None
    host_bytes: Optional[int] = None
    nvme_paths: Optional[List[str]] = None
    nvme_bytes: Optional[List[int]] = None
    nvme_cache_bytes: Optional[int] = None
    max_seqs: Optional[int] = None
    nvme_queue_depth: Optional[int] = None
    spill_policy: Any = None
    p: Optional[float] = None
    scale: Optional[float] = None
    n_sink: Optional[int] = None
    window: Optional[int] = None
    flush_batch: Optional[int] = None
    budget_min: Optional[int] = None
    budget_max: Optional[int] = None
    seed: Optional[int] = None
    gpu_cache_bytes: Optional[int] = None
    nvme_flags: Optional[int] = None
    device_busid: Optional[str] = None
    host_pool: Optional[str] = None
    host_pool_bytes: Optional[int] = None
    correction_steps: Optional[int] = None
    gpu_cache_max_bytes: Optional[int] = None
    rescore_p: Optional[float] = None
    keep_weight: Optional[float] = None
    keep_steps: Optional[int] = None

    def to_c(self) -> "tuple[_abi.KvtConfig, list]":
        """The kvt_config (size = the mirror's sizeof) and the objects it points into, which must
        be kept alive while C reads it."""
        c = _abi.KvtConfig()
        c.size = ctypes.sizeof(_abi.KvtConfig)
        keep: list = []
        for f in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim", "host_bytes",
                  "nvme_cache_bytes", "max_seqs", "nvme_queue_depth", "flush_batch",
                  "correction_steps", "gpu_cache_max_bytes", "keep_steps"):
            v = getattr(self, f)
            setattr(c, f, 0 if v is None else _int_field(f, v))
        c.device = 0 if self.device is None else _int_field("device", self.device)
        c.dtype = _dtype_code("dtype", self.dtype)
        c.out_dtype = _dtype_code("out_dtype", self.out_dtype)
        c.backend = _enum("backend", self.backend, _BACKENDS)
        c.spill_policy = _enum("spill_policy", self.spill_policy, _SPILL)
        c.p = 0.0 if self.p is None else float(self.p)
        c.scale = 0.0 if self.scale is None else float(self.scale)
        c.rescore_p = 0.0 if self.rescore_p is None else float(self.rescore_p)
        c.keep_weight = 0.0 if self.keep_weight is None else float(self.keep_weight)
        for f in _ZERO_IS_VALUE_32:
            v = getattr(self, f)
            setattr(c, f, 0 if v is None else (NONE if _int_field(f, v) == 0 else int(v)))
        for f in _ZERO_IS_VALUE_64:
            v = getattr(self, f)
            setattr(c, f, 0 if v is None else (NONE64 if _int_field(f, v) == 0 else int(v)))
        for f in ("device_busid", "host_pool"):
            v = getattr(self, f)
            if v is not None:
                b = ctypes.c_char_p(str(v).encode())
                keep.append(b)
                setattr(c, f, b.value)
        for f in ("host_pool_bytes", "nvme_flags"):
            v = getattr(self, f)
            setattr(c, f, 0 if v is None else _int_field(f, v))
        paths, sizes = self.nvme_paths or [], self.nvme_bytes or []
        if len(paths) != len(sizes):
            raise refuse("nvme_paths has %d entries, nvme_bytes %d: want one size per file"
                         % (len(paths), len(sizes)))
        if paths:
            arr_p = (ctypes.c_char_p * len(paths))(*[str(p).encode() for p in paths])
            arr_b = (ctypes.c_uint64 * len(sizes))(
                *[whole("nvme_bytes[%d]" % i, b, U64_MAX) for i, b in enumerate(sizes)])
            keep += [arr_p, arr_b]
            c.nvme_paths = ctypes.cast(arr_p, ctypes.POINTER(ctypes.c_char_p))
            c.nvme_bytes = ctypes.cast(arr_b, ctypes.POINTER(ctypes.c_uint64))
            c.n_nvme = len(paths)
        return c, keep


def _dataclass_of(name: str, struct: type, doc: str) -> type:
    fields = []
    for fname, ftype in struct._fields_:
        if fname in ("size", "pad0"):
            continue
        if ftype is ctypes.c_char_p or (isinstance(ftype, type) and issubclass(ftype, ctypes.Array)
                                        and ftype._type_ is ctypes.c_char):
            fields.append((fname, str))
        elif fname == "cuda_busid":
            fields.append((fname, List[str]))
        else:
            fields.append((fname, int))
    cls = dataclasses.make_dataclass(name, fields, frozen=True)
    cls.__doc__ = doc
    cls.__module__ = __name__
    return cls


def _text(v: Any) -> str:
    if v is None:
        return ""
    return bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace") if not isinstance(v, bytes) \
        else v.decode("utf-8", "replace")


def _fill(cls: type, c: ctypes.Structure) -> Any:
    kw = {}
    for f in dataclasses.fields(cls):
        v = getattr(c, f.name)
        if f.name == "cuda_busid":
            kw[f.name] = [_text(v[i].value) for i in range(min(c.cuda_devices,
                                                                 _abi.PROBE_MAX_DEVICES))]
        elif f.type is str:
            kw[f.name] = _text(v) if not isinstance(v, bytes) else v.decode("utf-8", "replace")
        else:
            kw[f.name] = int(v)
    return cls(**kw)


Stats = _dataclass_of("Stats", _abi.KvtStats,
                      "kvt_stats: counters since the cache was created (see lib/kvtier.h).")
LayerStats = _dataclass_of("LayerStats", _abi.KvtLayerStats,
                           "kvt_layer_stats: fetch counters of one layer (CUDA backend).")
ProbeInfo = _dataclass_of("ProbeInfo", _abi.KvtProbeInfo,
                          "kvt_probe_info: what this build and machine offer.")
Capacity = _dataclass_of("Capacity", _abi.KvtCapacity,
                         "kvt_capacity: what the cache can still take (never waits for the GPU).")
Footprint = _dataclass_of("Footprint", _abi.KvtFootprint,
                          "kvt_footprint: bytes per tier for one sequence of n_tokens.")


class Gathered(NamedTuple):
    """kvt_gather's outputs. counts: numpy int32 [n_seqs, n_kv_heads]; pos: int32
    [n_seqs, n_kv_heads, max_tokens] or None; k, v: [n_seqs, n_kv_heads, max_tokens, head_dim] in
    the cache's dtype or None; only the first counts[s, h] entries of a row are written."""
    total: int
    counts: Any
    pos: Any
    k: Any
    v: Any


def version() -> str:
    """The loaded library's "MAJOR.MINOR.PATCH"."""
    return _abi.lib().kvt_version_string().decode()


def version_number() -> int:
    """The loaded library's KVT_VERSION_NUMBER (MAJOR * 10000 + MINOR * 100 + PATCH)."""
    return int(_abi.lib().kvt_version_number())


def strerror(code: int) -> str:
    """kvt_strerror(code)."""
    return _abi.lib().kvt_strerror(int(code)).decode()


def probe() -> ProbeInfo:
    """kvt_probe: backends built, CUDA devices, io_uring, NUMA, huge pages, memlock."""
    info = _abi.KvtProbeInfo()
    info.size = ctypes.sizeof(info)
    check(_abi.lib().kvt_probe(ctypes.byref(info)), None, "kvt_probe")
    return _fill(ProbeInfo, info)


def _config_of(config: Union[Config, dict, None], kwargs: dict) -> Config:
    if config is None:
        return Config(**kwargs)
    if isinstance(config, dict):
        return Config(**{**config, **kwargs})
    if kwargs:
        return dataclasses.replace(config, **kwargs)
    return config


def footprint(config: Union[Config, dict], n_tokens: int, **kwargs: Any) -> Footprint:
    """kvt_footprint_of: bytes per tier that `config` needs for one sequence of n_tokens tokens."""
    cfg = _config_of(config, kwargs)
    c, keep = cfg.to_c()
    out = _abi.KvtFootprint()
    out.size = ctypes.sizeof(out)
    n_tokens = whole("n_tokens", n_tokens, U64_MAX)
    check(_abi.lib().kvt_footprint_of(ctypes.byref(c), n_tokens, ctypes.byref(out)), None,
          "kvt_footprint_of")
    del keep
    return _fill(Footprint, out)
