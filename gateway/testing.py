"""A real kvmem server in a background thread, for tests and notebooks.

::

    with ServerThread(Config(model="tiny-llama", port=0, cache_dir=tmp)) as server:
        httpx.get(server.url + "/healthz")

The thread runs ``trio.run(serve, ...)``: hypercorn on a loopback port and the
runtime, exactly as ``kvmem serve`` does (without the signal handlers, which
belong to the main thread). Leaving the ``with`` block shuts it down
gracefully, flushing the caches.
"""

from __future__ import annotations

import threading
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Self

import trio

from gateway.server import RoutesFactory, ServerStarted, serve
from runtime.config import Config

if TYPE_CHECKING:
    from runtime.plan.engine import Engine

__all__ = ["ServerThread"]


class ServerThread:
    """``serve(config)`` on its own thread; ``url`` is set once the port is open.

    Args:
        config: the settings (``port=0`` picks a free port).
        extra_routes, engine: passed to :func:`gateway.server.serve`.
        start_timeout_s: how long to wait for the model to load and the port to open.
    """

    def __init__(
        self, config: Config, *, extra_routes: RoutesFactory | None = None, engine: Engine | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.config = config
        self.extra_routes = extra_routes
        self.engine = engine
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kvmem-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                started: ServerStarted = await nursery.start(
                    partial(serve, self.config, shutdown_trigger=self._stop.wait, extra_routes=self.extra_routes,
                            engine=self.engine)
                )
                self.url = started.url
                self._ready.set()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - reported to the thread that waits
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> Self:
        self._thread.start()
        if not self._ready.wait(self.start_timeout_s):
            raise TimeoutError(f"the server did not start within {self.start_timeout_s} s")
        if self.error is not None or not self.url:
            raise RuntimeError("the server failed to start") from self.error
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut down gracefully (caches flushed) and wait for the thread."""
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout_s)
        if self.error is not None:
            raise RuntimeError("the server failed") from self.error

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
