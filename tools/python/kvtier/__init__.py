# SPDX-License-Identifier: MIT
"""kvtier: Python bindings (ctypes over the public C ABI of libkvtier) and a Hugging Face
transformers integration (kvtier.hf, needs torch and transformers).

    import kvtier
    with kvtier.Cache(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=64, backend="cpu") as c:
        s = c.open()
        c.prefill(s, 0, q, k, v)            # numpy float16 [T, H, D] / [T, Hkv, D]
        c.append(0, [s], k1, v1)            # [1, Hkv, D]
        out = c.attend(0, [s], q1)          # [1, H, D]

The library is found through $KVTIER_LIBRARY, then next to this package, then the system loader.
"""

from ._abi import LoadError, VERSION_NUMBER as ABI_VERSION_NUMBER
from .cache import (NONE, NONE64, NVME_KEEP_FILES, Cache, Capacity, Config, Footprint, Gathered,
                    LayerStats, ProbeInfo, Sequence, Stats, footprint, probe, strerror, version,
                    version_number)
from .errors import Error

__all__ = ["Cache", "Config", "Sequence", "Stats", "LayerStats", "ProbeInfo", "Footprint",
           "Gathered", "Capacity", "Error", "LoadError", "NONE", "NONE64", "NVME_KEEP_FILES", "ABI_VERSION_NUMBER", "version",
           "version_number", "strerror", "probe", "footprint"]
__version__ = "0.1.0"
