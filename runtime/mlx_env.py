"""MLX settings kvmem needs on CUDA, set in the environment before MLX reads them.

MLX's CUDA backend keeps its per-shape work in LRU caches (cuDNN attention graphs by
``MLX_CUDA_SDPA_CACHE_SIZE``, CUDA graphs by ``MLX_CUDA_GRAPH_CACHE_SIZE``, ...) and, unless
``MLX_ENABLE_CACHE_THRASHING_CHECK=0``, each cache counts its misses over the process's whole
life and *throws* ("Cache thrashing is happening ...") from inside an evaluation once they pass
twice its capacity (``mlx/backend/cuda/lru_cache.h``; the string is in MLX 0.32.4's CUDA build).
The counter never resets, so after that every new shape fails. A kvmem server makes new shapes
by design: every turn of a growing conversation prefills at a new cache length, and a batch's
rows change as agents come and go. A long-running server would start failing turns after a few
hundred of them, so kvmem turns the check off, as MLX's own test runner does. The caches keep
their sizes: a miss costs a rebuild (about 65 ms for a cuDNN attention graph on an H200), not
an error.

A value the operator exported is kept. Importing :mod:`runtime` applies this before any MLX
import (as :mod:`runtime.blas` loads OpenBLAS); elsewhere these variables mean nothing.
"""

from __future__ import annotations

import os

__all__ = ["MLX_DEFAULTS", "apply_mlx_defaults"]

MLX_DEFAULTS: dict[str, str] = {
    # A lifetime miss counter that throws: wrong for a server whose shapes grow with every turn.
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}
"""MLX environment variables kvmem sets where they are unset, and their values."""


def apply_mlx_defaults(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set each of :data:`MLX_DEFAULTS` not already in ``environ``; returns the ones this call set."""
    applied = {name: value for name, value in MLX_DEFAULTS.items() if name not in environ}
    environ.update(applied)
    return applied
