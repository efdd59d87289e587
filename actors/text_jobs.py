"""The GPU actor's text jobs (chat templates, tokenizers) on one worker thread, a queue's worth a hop.

A prompt is rendered and tokenized off the model's thread (a 32K prompt took 120-206 ms on an H200's host,
run 4) and off trio's, one job at a time in arrival order. Each job was a hop to a worker thread and back:
a batch's 8 joins, arriving together, were tokenized 0.3 ms apart on an H200's host (run 5), before their
joint pass could start. :class:`TextJobs` runs the jobs that queued while a hop was under way together in
the next hop; each job's caller still gets its result as soon as that job is done. A job whose caller no
longer wants it when its hop comes (its client left) is dropped there, unrun: :class:`Abandoned`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import outcome
import trio

__all__ = ["TextJobs", "Abandoned"]


class Abandoned(Exception):
    """A text job dropped unrun: when its hop came, its caller no longer wanted it."""


class _Job:
    def __init__(self, fn: Callable[[], Any], wanted: Callable[[], bool] | None) -> None:
        self.fn = fn
        self.wanted = wanted
        self.result: outcome.Outcome[Any] | None = None
        self.done = trio.Event()


class TextJobs:
    """A worker thread for text jobs: :meth:`run` queues one and returns its result (or raises its error);
    :meth:`serve`, a task of the owner's nursery, runs them in arrival order, all that are queued in one hop.

    ``hops`` counts the hops made (tests, diagnostics).
    """

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[_Job](math.inf)
        self.hops = 0

    async def run(self, fn: Callable[..., Any], *args: Any, wanted: Callable[[], bool] | None = None) -> Any:
        """``fn(*args)`` on the worker thread; ``wanted`` (called on trio's thread as the job's hop is formed):
        False drops the job unrun, and this raises :class:`Abandoned`."""
        job = _Job(partial(fn, *args), wanted)
        self._send.send_nowait(job)
        await job.done.wait()  # a caller that stops waiting leaves its job to run, its result unread
        assert job.result is not None
        return job.result.unwrap()

    async def serve(self) -> None:
        """Run the queued jobs until cancelled."""
        token = trio.lowlevel.current_trio_token()
        async for job in self._receive:
            batch = [job]
            while True:
                try:
                    batch.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            kept = []
            for queued in batch:
                if queued.wanted is None or queued.wanted():
                    kept.append(queued)
                else:
                    queued.result = outcome.Error(Abandoned())
                    queued.done.set()
            if kept:
                self.hops += 1
                await trio.to_thread.run_sync(_run_all, kept, token)


def _run_all(batch: list[_Job], token: trio.lowlevel.TrioToken) -> None:
    """On the worker thread: each job in turn, its caller woken as it ends (not when the batch does)."""
    for job in batch:
        job.result = outcome.capture(job.fn)
        token.run_sync_soon(job.done.set)
