"""The one OS thread that makes every MLX call.

MLX ties streams to the thread that created them, and servers that ran
generation on pooled threads crashed with "There is no Stream(gpu, N) in
current thread" (mlx-lm #1181, #1256). So kvmem runs all MLX work — loading
the model, building sequences, prefill chunks, decode steps, parking — on one
dedicated :class:`threading.Thread`, never on ``trio.to_thread``'s pool.

Trio code submits a *job* (a plain callable) with :meth:`MlxThread.run`; the
job goes through a :class:`queue.SimpleQueue`, runs on the thread, and its
outcome comes back through a one-shot trio memory channel, delivered with
``TrioToken.run_sync_soon`` so the thread never waits for the event loop.
Jobs run one at a time, in submission order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from runtime.allocator import keep_freed_memory

__all__ = ["MlxThread"]

log = logging.getLogger("kvmem.mlx_thread")

T = TypeVar("T")

_Job = tuple[Callable[[], Any], trio.MemorySendChannel[outcome.Outcome[Any]]]


def _deliver(reply: trio.MemorySendChannel[outcome.Outcome[Any]], result: outcome.Outcome[Any]) -> None:
    """Runs on the event loop: hand a job's outcome to its waiter, if it still waits."""
    try:
        reply.send_nowait(result)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # the waiter was cancelled; the job's effects stand, its result is dropped
    finally:
        reply.close()


class MlxThread:
    """A dedicated worker thread for MLX jobs.

    Use as an async context manager inside a trio run::

        async with MlxThread() as mlx:
            model = await mlx.run(load_model, "tiny-llama", models_dir=path)

    Args:
        name: the thread's name (shows in debuggers and ``threading.enumerate``).
        on_exit: called on the thread after the last job, before it ends
            (MLX wants ``mx.clear_streams()`` there: streams a thread leaves
            behind can crash the process at exit, mlx #3126 / #4110).
    """

    def __init__(self, name: str = "kvmem-mlx", *, on_exit: Callable[[], None] | None = None,
                 tune_allocator: bool = True) -> None:
        self._name = name
        self._tune_allocator = tune_allocator  # the backend profile's (a CPU policy: runtime.backend)
        self._on_exit = on_exit
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.jobs_run = 0

    @property
    def ident(self) -> int | None:
        """The worker thread's id once started (tests check that every job ran there)."""
        return None if self._thread is None else self._thread.ident

    async def __aenter__(self) -> MlxThread:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        """Start the thread; call from inside the trio run that will submit jobs."""
        if self._thread is not None:
            raise RuntimeError("MlxThread already started")
        self._token = trio.lowlevel.current_trio_token()
        if self._tune_allocator:
            keep_freed_memory()  # before the thread's first allocation: it then shares the main malloc arena
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Let queued jobs finish, then end the thread (waits for it, cancellation-proof)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        with trio.CancelScope(shield=True):
            # Joining is not MLX work: a pool thread may wait for ours.
            await trio.to_thread.run_sync(thread.join, 30.0)
        if thread.is_alive():
            log.warning("MLX thread still busy after 30 s; leaving it (daemon)")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the MLX thread and return its result (or raise its error).

        If the caller is cancelled, the job still runs to completion (MLX work
        cannot be interrupted); its result is dropped.
        """
        if self._thread is None:
            raise RuntimeError("MlxThread is not running")
        send, receive = trio.open_memory_channel[outcome.Outcome[Any]](1)
        self._queue.put((lambda: fn(*args), send))
        async with receive:
            result = await receive.receive()
        value: T = result.unwrap()
        return value

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """From a job on the MLX thread: run the plain function ``fn(*args)`` on trio soon.

        Callbacks run in the order they were posted, and before the result of the job that
        posted them is delivered. ``fn`` must not raise (trio cannot report it to anyone)."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass  # trio is gone; nobody listens

    def _main(self) -> None:
        token = self._token
        assert token is not None
        while True:
            job = self._queue.get()
            if job is None:
                break
            fn, reply = job
            result = outcome.capture(fn)
            self.jobs_run += 1
            try:
                token.run_sync_soon(_deliver, reply, result)
            except trio.RunFinishedError:
                pass  # trio is gone; nobody waits
        if self._on_exit is not None:
            try:
                self._on_exit()
            except Exception:  # noqa: BLE001 - the thread is ending anyway
                log.exception("MLX thread cleanup failed")
