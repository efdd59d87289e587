"""Pre-warmed memory, so that the first turn after a (re)start costs what a later one does.

MLX's CPU allocator is plain ``malloc``. glibc hands buffers above its adaptive
mmap threshold straight back to the kernel when they are freed, and trims the
heap top, so a fresh process faults in new zeroed pages for every large
activation (a 4K-token Q4 cache unpacked to float is ~190 MB for kvmem-default)
and its first turn pays for all of them. Measured on a 2-core VM: a 4K warm
turn's activate + forward took 1.1-1.3 s in a fresh process and 0.8 s repeated;
with the thresholds fixed and 400 MB pre-touched, the first turn took the same
0.8 s as later ones, and later turns varied less (``benches/results/README.md``).

:func:`prewarm_memory` fixes the thresholds (freed buffers up to 32 MiB stay in
the process, as MLX's Metal buffer cache keeps its buffers) and touches that
memory once at start. A throwaway warm-up turn at model load (first calls
through every code path) was measured too and made no difference once the
memory was pre-touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time

import mlx.core as mx

__all__ = ["keep_freed_memory", "prewarm_memory"]

# mallopt parameters (malloc.h). 32 MiB is the largest mmap threshold glibc accepts on 64-bit;
# the trim threshold is an int, so 2 GiB - 1 is the most it can say.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 32 * 2**20
_TRIM_THRESHOLD_BYTES = 2**31 - 1
_TOUCH_BUFFER_BYTES = 16 * 2**20  # below the mmap threshold, so freed buffers stay in the heap

_kept = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed buffers up to 32 MiB in the process (Linux only; once per process).

    Returns True where the allocator was tuned, False elsewhere (macOS, musl).
    """
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _kept = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
    return _kept


def prewarm_memory(megabytes: float) -> float:
    """Touch ``megabytes`` of memory through MLX once and keep it for later activations.

    Must run on the thread that runs the model (its MLX stream allocates from the
    same heap). Returns the seconds it took; 0.0 where nothing was done (no
    megabytes asked for, or an allocator that cannot be told to keep them).
    """
    if megabytes <= 0 or not keep_freed_memory():
        return 0.0
    started = time.perf_counter()
    count = max(1, int(megabytes * 2**20) // _TOUCH_BUFFER_BYTES)
    buffers = [mx.ones((_TOUCH_BUFFER_BYTES // 4,), dtype=mx.float32) for _ in range(count)]
    mx.eval(buffers)
    del buffers
    return time.perf_counter() - started
