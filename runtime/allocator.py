"""glibc's allocator told to keep freed memory, so large buffers are not faulted in again.

MLX's CPU allocator is plain ``malloc``. glibc hands buffers above its adaptive
mmap threshold straight back to the kernel when they are freed, trims the heap
top, and gives each new thread an arena of its own whose freed memory goes back
to the kernel too; the next buffer of the same size is then zero pages faulted
in one by one. This module imports neither MLX nor trio: the actor layer calls
it before it starts the model's thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

# mallopt parameters (malloc.h). 32 MiB is the largest mmap threshold glibc accepts on 64-bit;
# the trim threshold is an int, so 2 GiB - 1 is the most it can say.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD_BYTES = 32 * 2**20
_TRIM_THRESHOLD_BYTES = 2**31 - 1

_kept = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed buffers up to 32 MiB in the process (Linux only; once per process).

    Also one malloc arena for every thread started after this call: glibc gives a new
    thread its own arena, and an arena other than the main one hands freed memory back
    to the kernel whatever the trim threshold says, so the model's thread would fault
    in every batch buffer again. Measured here: 60 buffers of 9.4 MB (an 8-agent batch's
    keys and values) allocated and zeroed on a thread took 115-122 ms each time with
    its own arena, 22-28 ms with the main one. Call it before that thread starts
    (:class:`actors.mlx_thread.MlxThread` does).

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
    _kept = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
                 and mallopt(_M_ARENA_MAX, 1))
    return _kept
