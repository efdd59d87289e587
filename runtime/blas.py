"""Load Debian's OpenBLAS before MLX so that MLX's CPU matmuls use it.

MLX's Linux CPU wheel bundles a reference BLAS that is ~30x slower than
OpenBLAS. Loading ``libopenblas`` with ``RTLD_GLOBAL`` before the first
``import mlx`` makes MLX's ``cblas_*``/``sgemm`` symbols resolve to it.

Every kvmem entry point imports this module first (``runtime/__init__.py``
does). It is a no-op on macOS (Accelerate) and when the library is absent,
with a one-line warning on Linux in the latter case. Set ``KVMEM_NO_OPENBLAS=1``
to skip it (the benchmark of the effect uses that).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from pathlib import Path

__all__ = ["openblas_path", "load_openblas"]

log = logging.getLogger("kvmem.blas")

_CANDIDATE_DIRS = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp",
    "/usr/lib/{arch}-linux-gnu/openblas-serial",
    "/usr/lib/{arch}-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)

_loaded: str | None = None


def _find_openblas() -> str | None:
    arch = platform.machine()
    for template in _CANDIDATE_DIRS:
        candidate = Path(template.format(arch=arch)) / "libopenblas.so.0"
        if candidate.exists():
            return str(candidate)
    return ctypes.util.find_library("openblas")


def load_openblas() -> str | None:
    """Load OpenBLAS globally (once); return its path, or None when not loaded."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if sys.platform != "linux" or os.environ.get("KVMEM_NO_OPENBLAS") == "1":
        return None
    path = _find_openblas()
    if path is None:
        log.warning(
            "OpenBLAS not found: MLX will use its slow reference BLAS "
            "(apt-get install libopenblas0-pthread)"
        )
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before kvmem could load OpenBLAS; matmuls stay slow")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _loaded = path
    return path


def openblas_path() -> str | None:
    """The OpenBLAS library this process loaded, if any."""
    return _loaded


load_openblas()
