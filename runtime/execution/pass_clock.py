"""Where one forward pass's time goes on the model's thread: a decode step or a prefill chunk.

On a GPU a pass is bound by whichever is slower: the host building its graph and handing it to the
device, or the device computing it. :class:`PassClock` marks the phases as the pass goes (building,
launched, read back) and turns them into a :class:`runtime.plan.engine.StepTiming`, which the GPU
actor's trace carries, so a device run can tell which without a profiler.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from runtime.plan.engine import StepTiming

__all__ = ["PassClock"]


class PassClock:
    """One pass's phases on the model's thread, from its construction to :meth:`timing`.

    ``building()`` wraps the lazy graph construction (more than once when a pass builds two
    graphs, as a decode step that runs ahead does), ``launched()`` marks the graph handed to
    the device, ``read()`` the results back on the host; what follows until :meth:`timing` is
    the host's work on them.
    """

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._cpu_started = time.thread_time()
        self._built_s = 0.0
        self._launched: tuple[float, float] | None = None  # (wall, the thread's CPU time)
        self._read: float | None = None

    @contextmanager
    def building(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._built_s += time.perf_counter() - began

    def launched(self) -> None:
        self._launched = (time.perf_counter(), time.thread_time())

    def read(self) -> None:
        self._read = time.perf_counter()

    def timing(self) -> StepTiming:
        """The pass's :class:`StepTiming` until now (a phase never marked takes no time)."""
        done = time.perf_counter()
        launched, launched_cpu = self._launched or (done, time.thread_time())
        read = self._read if self._read is not None else launched
        return StepTiming(launch_ms=(launched - self._started) * 1e3, wait_ms=(read - launched) * 1e3,
                          host_ms=(done - read) * 1e3, build_ms=self._built_s * 1e3,
                          launch_cpu_ms=(launched_cpu - self._cpu_started) * 1e3)
