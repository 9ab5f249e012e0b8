# SPDX-License-Identifier: MIT
"""ctypes mirror of the public ABI in lib/kvtier.h, and loading of libkvtier.

Only the public header's functions and structs are used. The structs are mirrored field for field
in header order (tests/test_abi.py compares the names with the header); each one's `size` is set to
the mirror's own sizeof, which the library accepts by the size rules of doc/abi.md as long as the
mirror is at least the struct's first release (KVT_*_SIZE_VER0), checked at load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import List, Optional

# lib/kvtier.h: the version this mirror was written against
VERSION_MAJOR = 0
VERSION_MINOR = 1
VERSION_PATCH = 0
VERSION_NUMBER = VERSION_MAJOR * 10000 + VERSION_MINOR * 100 + VERSION_PATCH

DTYPE_DEFAULT, DTYPE_F16, DTYPE_BF16, DTYPE_F32 = 0, 1, 2, 3
SPILL_NONE, SPILL_LRU = 0, 1
BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA = 0, 1, 2
EXTEND_TOPP = 1 << 0  # kvt_extend_flags
NONE32 = 0xFFFFFFFF
NONE64 = 0xFFFFFFFFFFFFFFFF
PROBE_MAX_DEVICES = 16

DEFAULT_HOST_BYTES = 1 << 30
DEFAULT_NVME_CACHE_BYTES = 64 << 20
DEFAULT_MAX_SEQS = 256
DEFAULT_NVME_QUEUE_DEPTH = 32
DEFAULT_P = 0.9
DEFAULT_N_SINK = 4
DEFAULT_WINDOW = 64
DEFAULT_FLUSH_BATCH = 64
DEFAULT_BUDGET_MIN = 64
DEFAULT_SEED = 0x6B767469

u32, i32, u64, f32 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_float
size_t, c_char_p = ctypes.c_size_t, ctypes.c_char_p


class KvtConfig(ctypes.Structure):
    """kvt_config (input struct: `size` through gpu_cache_bytes is the first release)."""
    _fields_ = [
        ("size", size_t),
        ("n_layers", u32), ("n_q_heads", u32), ("n_kv_heads", u32), ("head_dim", u32),
        ("dtype", u32), ("out_dtype", u32),
        ("backend", u32), ("device", i32),
        ("host_bytes", u64),
        ("nvme_paths", ctypes.POINTER(c_char_p)),
        ("nvme_bytes", ctypes.POINTER(u64)),
        ("nvme_cache_bytes", u64),
        ("max_seqs", u32), ("n_nvme", u32), ("nvme_queue_depth", u32), ("spill_policy", u32),
        ("p", f32), ("scale", f32),
        ("n_sink", u32), ("window", u32), ("flush_batch", u32),
        ("budget_min", u32), ("budget_max", u32), ("pad0", u32),
        ("seed", u64),
        ("gpu_cache_bytes", u64),
        ("nvme_flags", u32), ("pad1", u32),
        ("device_busid", c_char_p),
        ("host_pool", c_char_p),
        ("host_pool_bytes", u64),
        ("correction_steps", u32), ("pad2", u32),
        ("gpu_cache_max_bytes", u64),
        ("rescore_p", f32), ("pad3", u32),
        ("keep_weight", f32), ("keep_steps", u32),
    ]


class KvtStats(ctypes.Structure):
    """kvt_stats (output struct)."""
    _fields_ = [("size", size_t), ("backend", c_char_p)] + [
        (n, u64) for n in ("seqs_open", "tokens", "tokens_indexed", "host_bytes_used",
                           "host_bytes_capacity")
    ] + [("host_placement", c_char_p), ("host_numa_node", i32), ("host_pinned", u32)] + [
        (n, u64) for n in (
            "index_bytes", "index_bytes_per_token_head", "steps", "selected_tokens",
            "candidate_tokens", "budget_max_hits", "budget_min_hits", "flushes", "rows_fetched",
            "bytes_fetched", "hot_hits", "hot_misses", "pcie_bytes", "errors",
            "spills", "restores", "auto_spills", "nvme_bytes_used", "nvme_bytes_capacity",
            "nvme_bytes_written", "nvme_bytes_read", "nvme_reads", "nvme_ios",
            "nvme_lat_ns_sum", "nvme_lat_ns_max", "nvme_cache_hits", "nvme_cache_misses",
            "ns_nvme", "ns_index", "ns_store", "ns_score", "ns_select", "ns_attend")
    ] + [("device", i32), ("pad0", u32)] + [
        (n, u64) for n in ("host_pool_bytes", "host_pool_used", "host_pool_mine",
                           "rescored_tokens", "rescored_unselected", "scan_hist_hits")
    ]


class KvtLayerStats(ctypes.Structure):
    """kvt_layer_stats (output struct)."""
    _fields_ = [("size", size_t)] + [
        (n, u64) for n in ("steps", "hot_hits", "hot_misses", "pcie_bytes", "selected_tokens",
                           "rows_attended", "hot_rows")
    ]


class KvtProbeInfo(ctypes.Structure):
    """kvt_probe_info (output struct)."""
    _fields_ = [
        ("size", size_t),
        ("cuda_built", u32), ("cuda_devices", u32),
        ("cuda_busid", (ctypes.c_char * 16) * PROBE_MAX_DEVICES),
        ("io_uring_built", u32), ("io_uring_usable", u32), ("hwloc_built", u32),
        ("numa_built", u32), ("numa_nodes", u32), ("pad0", u32),
        ("thp_mode", ctypes.c_char * 16),
    ] + [(n, u64) for n in ("hugepage_bytes", "hugepages_total", "hugepages_free",
                            "memlock_soft", "memlock_hard", "host_memory_bytes",
                            "host_available_bytes")]


class KvtFootprint(ctypes.Structure):
    """kvt_footprint (output struct)."""
    _fields_ = [("size", size_t)] + [
        (n, u64) for n in (
            "row_bytes", "block_bytes", "nvme_block_bytes", "index_token_bytes",
            "index_tokens", "seq_blocks", "host_bytes", "nvme_bytes", "hbm_index_bytes",
            "hbm_centroid_bytes", "hbm_window_bytes", "hbm_selection_bytes",
            "hbm_block_table_bytes", "hbm_seq_bytes", "hbm_rotation_bytes", "hbm_hot_bytes",
            "hbm_hot_rows", "hbm_cache_bytes")
    ]


class KvtCapacity(ctypes.Structure):
    """kvt_capacity (output struct)."""
    _fields_ = [("size", size_t)] + [
        (n, u64) for n in ("host_bytes_free", "host_bytes_capacity", "nvme_bytes_free",
                           "nvme_bytes_capacity", "block_bytes", "block_tokens",
                           "row_bytes_per_token", "index_bytes_per_token")
    ] + [("seqs_open", u32), ("max_seqs", u32), ("nvme_block_bytes", u64)]


def _end_of(struct: type, field: str) -> int:
    f = getattr(struct, field)
    return f.offset + f.size


# KVT_*_SIZE_VER0: the first release's size of each struct (the header's macros)
SIZE_VER0 = {
    KvtConfig: _end_of(KvtConfig, "gpu_cache_bytes"),
    KvtStats: _end_of(KvtStats, "host_pool_mine"),
    KvtLayerStats: _end_of(KvtLayerStats, "hot_rows"),
    KvtProbeInfo: _end_of(KvtProbeInfo, "host_available_bytes"),
    KvtFootprint: _end_of(KvtFootprint, "hbm_cache_bytes"),
    KvtCapacity: _end_of(KvtCapacity, "max_seqs"),
}
STRUCTS = {"kvt_config": KvtConfig, "kvt_stats": KvtStats, "kvt_layer_stats": KvtLayerStats,
           "kvt_probe_info": KvtProbeInfo, "kvt_footprint": KvtFootprint,
           "kvt_capacity": KvtCapacity}


class KvtRowsLayout(ctypes.Structure):
    """kvt_rows_layout: where the rows of kvt_seq_read_rows_at / write_rows_at go (slot mapping,
    slot and head strides in elements)."""
    _fields_ = [("size", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("slot_mapping", ctypes.c_void_p), ("slot_stride", ctypes.c_uint64),
                ("head_stride", ctypes.c_uint64)]


class KvtIoView(ctypes.Structure):
    """kvt_io_view: where the rows of one tensor lie (token and head strides in elements, 0: the
    dense default)."""
    _fields_ = [("token_stride", ctypes.c_uint64), ("head_stride", ctypes.c_uint64)]


class KvtIoLayout(ctypes.Structure):
    """kvt_io_layout: the views of q, k, v and out of kvt_prefill_at, kvt_append_at,
    kvt_attend_at and kvt_extend_at."""
    _fields_ = [("size", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("q", KvtIoView),
                ("k", KvtIoView), ("v", KvtIoView), ("out", KvtIoView)]


class KvtGraphBatch(ctypes.Structure):
    """kvt_graph_batch: the slots of kvt_attend_graph (sequence ids, expected lengths and the
    valid mask: device pointers on the CUDA backend, host pointers on the CPU backend)."""
    _fields_ = [("n_slots", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("seqs", ctypes.c_void_p), ("lengths", ctypes.c_void_p),
                ("valid", ctypes.c_void_p)]


class LoadError(ImportError):
    """libkvtier could not be loaded or does not match this package."""


_P = ctypes.c_void_p
_PROTOTYPES = {
    # name: (restype, argtypes)
    "kvt_cache_create": (ctypes.c_int, [ctypes.POINTER(KvtConfig), ctypes.POINTER(_P)]),
    "kvt_cache_destroy": (None, [_P]),
    "kvt_seq_open": (ctypes.c_int, [_P, ctypes.POINTER(u32)]),
    "kvt_seq_close": (ctypes.c_int, [_P, u32]),
    "kvt_seq_spill": (ctypes.c_int64, [_P, u32]),
    "kvt_seq_restore": (ctypes.c_int64, [_P, u32]),
    "kvt_seq_length": (ctypes.c_int64, [_P, u32, u32]),
    "kvt_seq_truncate": (ctypes.c_int, [_P, u32, u32, _P]),
    "kvt_seq_fork": (ctypes.c_int, [_P, u32, ctypes.POINTER(u32), _P]),
    "kvt_seq_read_rows": (ctypes.c_int, [_P, u32, u32, u32, u32, _P, _P, _P]),
    "kvt_seq_write_rows": (ctypes.c_int, [_P, u32, u32, u32, u32, _P, _P, _P]),
    "kvt_seq_read_rows_at": (ctypes.c_int, [_P, u32, u32, u32, u32, _P, _P,
                                             ctypes.POINTER(KvtRowsLayout), _P]),
    "kvt_seq_write_rows_at": (ctypes.c_int, [_P, u32, u32, u32, u32, _P, _P,
                                              ctypes.POINTER(KvtRowsLayout), _P]),
    "kvt_prefill": (ctypes.c_int, [_P, u32, u32, _P, _P, _P, u32, _P]),
    "kvt_append": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), _P, _P, _P]),
    "kvt_attend": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), _P, _P, _P]),
    "kvt_select": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), _P, _P]),
    "kvt_gather": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), u32,
                                  ctypes.POINTER(i32), _P, _P, _P, _P]),
    "kvt_extend": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), ctypes.POINTER(u32), _P,
                                  _P, _P, _P, u32, _P]),
    "kvt_prefill_at": (ctypes.c_int, [_P, u32, u32, _P, _P, _P, u32,
                                       ctypes.POINTER(KvtIoLayout), _P]),
    "kvt_append_at": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), _P, _P,
                                      ctypes.POINTER(KvtIoLayout), _P]),
    "kvt_attend_at": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), _P, _P,
                                      ctypes.POINTER(KvtIoLayout), _P]),
    "kvt_select_at": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), _P,
                                      ctypes.POINTER(KvtIoLayout), _P]),
    "kvt_extend_at": (ctypes.c_int, [_P, u32, u32, ctypes.POINTER(u32), ctypes.POINTER(u32), _P,
                                      _P, _P, _P, u32, ctypes.POINTER(KvtIoLayout), _P]),
    "kvt_get_stats": (ctypes.c_int, [_P, ctypes.POINTER(KvtStats)]),
    "kvt_get_layer_stats": (ctypes.c_int, [_P, u32, ctypes.POINTER(KvtLayerStats)]),
    "kvt_get_capacity": (ctypes.c_int, [_P, ctypes.POINTER(KvtCapacity)]),
    "kvt_seq_bytes": (ctypes.c_int, [_P, u32, ctypes.POINTER(u64), ctypes.POINTER(u64)]),
    "kvt_probe": (ctypes.c_int, [ctypes.POINTER(KvtProbeInfo)]),
    "kvt_footprint_of": (ctypes.c_int, [ctypes.POINTER(KvtConfig), u64,
                                        ctypes.POINTER(KvtFootprint)]),
    "kvt_strerror": (c_char_p, [ctypes.c_int]),
    "kvt_last_error": (c_char_p, [_P]),
    "kvt_last_error_entry": (ctypes.c_int, [_P]),
    "kvt_seq_status": (ctypes.c_int, [_P, u32, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                                      ctypes.c_size_t]),
    "kvt_graph_reserve": (ctypes.c_int, [_P, u32, u32, _P]),
    "kvt_attend_graph": (ctypes.c_int, [_P, u32, ctypes.POINTER(KvtGraphBatch), _P, _P, _P]),
    "kvt_version_number": (ctypes.c_uint, []),
    "kvt_version_string": (c_char_p, []),
}


def _candidates() -> "tuple[List[str], List[str]]":
    """Where the library is looked for, in order: $KVTIER_LIBRARY, next to the package, the
    system loader. Returns the paths to try and notes on the places that gave none."""
    out, notes = [], []
    env = os.environ.get("KVTIER_LIBRARY")
    if env:
        out.append(env)
    else:
        notes.append("$KVTIER_LIBRARY (unset)")
    here = os.path.dirname(os.path.abspath(__file__))
    beside = [os.path.join(here, n) for n in ("libkvtier.so", "libkvtier.so.0")]
    present = [p for p in beside if os.path.exists(p)]
    out += present
    if not present:
        notes.append("%s (absent)" % os.path.join(here, "libkvtier.so[.0]"))
    found = ctypes.util.find_library("kvtier")
    if found:
        out.append(found)
    else:
        notes.append("ctypes.util.find_library('kvtier') (nothing)")
    out.append("libkvtier.so.0")
    return out, notes


def _check_version(lib: ctypes.CDLL, where: str) -> None:
    got = lib.kvt_version_number()
    major, minor = got // 10000, got // 100 % 100
    # 0.x: the minor plays the major's part (doc/abi.md); from 1.0 a later minor only adds
    compatible = major == VERSION_MAJOR and (
        minor == VERSION_MINOR if major == 0 else minor >= VERSION_MINOR)
    if not compatible:
        raise LoadError("%s is kvtier %s (version number %d); this package mirrors the ABI of "
                        "%d.%d.x (%d) and needs a library compatible with it (doc/abi.md)"
                        % (where, lib.kvt_version_string().decode(), got, VERSION_MAJOR,
                           VERSION_MINOR, VERSION_NUMBER))


def _check_sizes() -> None:
    for name, st in STRUCTS.items():
        if ctypes.sizeof(st) < SIZE_VER0[st]:
            raise LoadError("the mirror of %s is %d bytes, below its first release's size %d"
                            % (name, ctypes.sizeof(st), SIZE_VER0[st]))


def _bind(lib: ctypes.CDLL, where: str) -> None:
    for name, (res, args) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LoadError("%s does not export %s: not a kvtier library of this ABI"
                            % (where, name)) from None
        fn.restype, fn.argtypes = res, args


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """Load libkvtier (from `path`, or the first of the candidates that loads) and check it."""
    cands, tried = ([path], []) if path else _candidates()
    for cand in cands:
        try:
            lib = ctypes.CDLL(cand)
        except OSError as e:
            tried.append("%s (%s)" % (cand, e))
            continue
        where = getattr(lib, "_name", cand)
        _bind(lib, where)
        _check_version(lib, where)
        _check_sizes()
        return lib
    raise LoadError("libkvtier not found; looked in: " + "; ".join(tried) +
                    ". Set KVTIER_LIBRARY to the path of libkvtier.so (e.g. build/lib/"
                    "libkvtier.so), put it next to the kvtier package, or install it where the "
                    "system loader finds it")


_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        _lib = load()
    return _lib
