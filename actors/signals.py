"""SIGINT and SIGTERM for the supervisor and the HTTP server: one watcher, two reactions.

``open_runtime`` cancels the runtime (its store still flushes, shielded) and
re-raises as ``KeyboardInterrupt`` / ``SystemExit``; ``kvmem serve`` stops
accepting connections and lets running requests finish first. Signal handlers
can only be installed from the main thread: callers check that.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import trio

__all__ = ["watch_signals"]


async def watch_signals(
    on_signal: Callable[[int], None],
    *,
    stop: trio.CancelScope | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call ``on_signal(signum)`` on the first SIGINT or SIGTERM, then return.

    Args:
        on_signal: what to do (it must not block).
        stop: a scope the caller cancels to stop watching (None: cancel the task's nursery).
    """
    with stop or trio.CancelScope(), trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            on_signal(signum)
            return
