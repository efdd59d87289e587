"""``serve(config)``: the runtime and hypercorn (trio worker) in one nursery.

Start order: the runtime (cache store, then the GPU actor, which loads the model —
before the port opens), then hypercorn bound to ``config.host:port``.
Shutdown (SIGINT/SIGTERM when running in the main thread, or the
``shutdown_trigger`` given) is graceful: hypercorn stops accepting, gives
running requests ``graceful_timeout_s`` to finish (then cancels them, which
cancels their generations), and only then does the runtime close — its cache
store writes every dirty cache to disk before :func:`serve` returns.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.routing import BaseRoute

from actors.signals import watch_signals
from gateway.app import create_app
from gateway.tenants import load_tenant_keys
from runtime.config import Config

if TYPE_CHECKING:
    from actors.supervisor import Runtime
    from runtime.plan.engine import Engine
    from runtime.persist import CacheDirectory

__all__ = ["serve", "ServerStarted", "RoutesFactory", "hypercorn_config", "exposure_warning"]

log = logging.getLogger("kvmem.server")


class ServerStarted(msgspec.Struct, frozen=True, kw_only=True):
    """What ``nursery.start(serve, config)`` returns: the bound URLs (``http://127.0.0.1:PORT``) and the
    backend profile the model loaded under, as one line (:meth:`runtime.backend.BackendProfile.line`; None
    for an engine without one)."""

    urls: tuple[str, ...]
    profile: str | None = None

    @property
    def url(self) -> str:
        return self.urls[0]


def hypercorn_config(config: Config) -> HypercornConfig:
    """Hypercorn settings for ``config`` (bind address, graceful timeout, quiet access log)."""
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = config.graceful_timeout_s
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    # Hypercorn closes a connection its client has already closed only when this idle timer ends
    # (the socket waits in CLOSE_WAIT meanwhile): a long timer turns a stream of short-lived client
    # connections into thousands of open sockets. 5 s (Hypercorn's default) bounds that; a client
    # idle longer simply reconnects.
    hc.keep_alive_timeout = 5
    return hc


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard limit (servers hold one per connection); returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def exposure_warning(config: Config) -> str | None:
    """A warning when ``config`` binds beyond loopback without an API key, else None."""
    if config.api_key or config.api_keys:
        return None
    host = config.host.strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"binding {config.host} without an API key: anyone who can reach port {config.port} can read "
            "and overwrite every agent's cache; set --api-key (or KVMEM_API_KEY)")


RoutesFactory = Callable[["Runtime", trio.Nursery], Sequence[BaseRoute]]
"""Makes extra routes once the runtime is open; the nursery runs their background work until shutdown."""


async def serve(
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    extra_routes: RoutesFactory | None = None,
    engine: Engine | None = None,
    directory: CacheDirectory | None = None,
    task_status: trio.TaskStatus[ServerStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run kvmem's HTTP server until shutdown (see the module docstring).

    Args:
        config: the settings (validated here).
        shutdown_trigger: returns when the server should stop (besides SIGINT/SIGTERM in the main thread).
        extra_routes: more routes for ``create_app`` (e.g. scenarios), built from the open runtime
            and a nursery that is cancelled when the HTTP server has stopped.
        engine: the engine to run (default: MLX, configured from ``config``; tests pass their own).
        directory: the cache directory (default: ``config``'s; ``kvmem serve --distributed`` passes rank 0's).
        task_status: started with a :class:`ServerStarted` once the port is open.
    """
    from actors import open_runtime  # the runtime loads MLX; the gateway modules never import it

    config = config.replace()  # validated: tests and notebooks may construct a Config directly
    log.debug("open-file limit: %d", raise_open_file_limit())
    warning = exposure_warning(config)
    if warning:
        log.warning("%s", warning)
    # A bad key file fails now, before the model loads, naming the problem.
    tenants = load_tenant_keys(config.api_keys) if config.api_keys is not None else None
    if tenants is not None:
        log.info("%d tenants from %s", len(tenants.tenants), config.api_keys)
    shutdown = trio.Event()
    async with open_runtime(
        config,
        through_owner=False,  # a second server on a home is refused, never a client of the first
        engine=engine,
        directory=directory,
        handle_signals=False,
    ) as rt:
        async with trio.open_nursery() as nursery:
            app = create_app(rt, config, extra_routes=extra_routes(rt, nursery) if extra_routes else (),
                             tenants=tenants)
            if threading.current_thread() is threading.main_thread():
                def on_signal(signum: int) -> None:
                    log.warning("received %s: shutting down", signal.Signals(signum).name)
                    shutdown.set()

                nursery.start_soon(watch_signals, on_signal)
            if shutdown_trigger is not None:

                async def forward() -> None:
                    await shutdown_trigger()
                    shutdown.set()

                nursery.start_soon(forward)

            async def run_http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                # cast: hypercorn's ASGI type and Starlette's differ only in their annotations
                await hypercorn_serve(cast(Any, app), hypercorn_config(config), shutdown_trigger=shutdown.wait,
                                      task_status=task_status)
                nursery.cancel_scope.cancel()  # stop the signal watcher and the trigger

            urls = await nursery.start(run_http)
            profile = rt.stats().registry.profile
            log.info("kvmem serving %s on %s", config.model, ", ".join(urls))
            task_status.started(ServerStarted(urls=tuple(urls), profile=profile.line() if profile else None))
        log.info("HTTP server stopped; flushing caches")
    log.info("caches flushed; bye")
