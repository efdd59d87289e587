"""Pre-warmed memory, so that the first turn after a (re)start costs what a later one does.

MLX's CPU allocator is plain ``malloc``. glibc hands buffers above its adaptive
mmap threshold straight back to the kernel when they are freed, and trims the
heap top, so a fresh process faults in new zeroed pages for every large
activation (a 4K-token Q4 cache unpacked to float is ~190 MB for kvmem-default)
and its first turn pays for all of them. Measured on a 2-core VM: a 4K warm
turn's activate + forward took 1.1-1.3 s in a fresh process and 0.8 s repeated;
with the thresholds fixed and 400 MB pre-touched, the first turn took the same
0.8 s as later ones, and later turns varied less (``benches/results/README.md``).

:func:`prewarm_memory` fixes the thresholds (:func:`runtime.allocator.keep_freed_memory`:
freed buffers up to 32 MiB stay in the process, as MLX's Metal buffer cache keeps
its buffers) and touches that memory once at start. A throwaway warm-up turn at model load (first calls
through every code path) was measured too and made no difference once the
memory was pre-touched; that was before NumPy attention (``runtime.cpu.attention``), and
since then :func:`warm_up` at model load is what makes a restored agent's first turn as fast as
a hot one.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from runtime.allocator import keep_freed_memory

__all__ = ["prewarm_memory", "warm_up"]

_TOUCH_BUFFER_BYTES = 16 * 2**20  # below the mmap threshold, so freed buffers stay in the heap


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


WARM_UP_PROMPT = "Warm up. " * 40
"""The throwaway turn's prompt: about 120 tokens, so prefill takes the NumPy attention path."""


def warm_up(lm: Any, attention: str) -> float:
    """Run a throwaway turn and a continuation of it through ``lm``; returns the seconds it took.

    A restarted server's first turn otherwise pays for every code path's first run
    (prefill and NumPy attention over a cache, activation, parking, the buffers they
    allocate): measured at 4K tokens, the first turn after a restart took 40-60 ms
    longer than the same turn hot even with its cache restored ahead; with this at
    model load, 0.91-1.11x hot (``benches/results/README.md``). Must run on the model's thread.
    """
    from runtime.execution.sequence import SequenceSampling, Sequence

    started = time.perf_counter()
    first = Sequence(lm, WARM_UP_PROMPT, None, SequenceSampling(max_tokens=1), attention=attention)
    while first.prefill_step() is None:
        pass
    parked = first.park()
    if parked is not None:
        # Four tokens or more, as a turn's new text usually is: prefill over a cache through NumPy attention.
        again = Sequence(lm, parked.text + " Once more, the warm up.", parked, SequenceSampling(max_tokens=1),
                         attention=attention)
        while again.prefill_step() is None:
            pass
    return time.perf_counter() - started
