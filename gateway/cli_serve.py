"""``kvmem serve``: the HTTP gateway (Anthropic, OpenAI and agent APIs) on one kvmem runtime.

Settings come from flags > ``KVMEM_*`` environment variables > a TOML file
(``--config``) > defaults; see :mod:`runtime.config`.

``--distributed`` (under ``mlx.launch``): every rank runs this command; rank 0
serves, with its engine and cache directory extended to the other ranks, and
every other rank follows it (:mod:`runtime.distributed`). Put ``--`` between
``mlx.launch``'s options and the command: ``mlx.launch`` takes any option it can
read as an abbreviation of its own (``--host`` for its ``--hosts``) unless a
``--`` ends its options, and it drops that ``--`` before starting the ranks::

    mlx.launch -n 2 --backend ring --python "$(which python)" -- \
        -m gateway.cli serve --distributed --model tiny-llama --host 0.0.0.0 --port 8000 --api-key "$KEY"
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

from gateway.cli_common import add_setting_options, config_from_args
from gateway.progress import Progress, ticking

__all__ = ["StartProgress", "register"]


def register(sub: Any) -> None:
    """Add ``kvmem serve`` to the ``kvmem`` parser."""
    p = sub.add_parser("serve", help="serve the Anthropic / OpenAI / agent HTTP APIs")
    add_setting_options(p, server=True)  # every setting is a flag (docs/configuration.md)
    p.add_argument("--distributed", action="store_true",
                   help="one model over the ranks mlx.launch started (tensor parallel; see docs/distributed.md)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import trio

    from gateway.server import ServerStarted, serve

    config = config_from_args(args)  # a ConfigError is reported by gateway.cli
    if config.api_keys is not None:
        from gateway.tenants import load_tenant_keys

        load_tenant_keys(config.api_keys)  # a bad key file: one line now, before the model loads
    engine, directory, leader = None, None, None
    if args.distributed:
        from runtime.distributed.launch import LeaderRank, open_rank  # imports MLX: only for distributed runs
        from runtime.errors import KvmemError

        try:
            rank = open_rank(config)
        except (KvmemError, OSError) as exc:
            print(f"kvmem serve: {exc}", file=sys.stderr, flush=True)
            return 2
        if not isinstance(rank, LeaderRank):
            return _follow(rank)
        from runtime.distributed.launch import stop_when_orphaned

        stop_when_orphaned()  # mlx.launch killed: this rank shuts down as on SIGTERM
        engine, directory, leader = rank.engine, rank.directory, rank

    def scenarios(rt: Any, nursery: trio.Nursery) -> list[Any]:
        from gateway.scenario_routes import scenario_routes
        from runtime.home import KvmemHome

        return scenario_routes(rt, home=KvmemHome(config.home_path).root, nursery=nursery)

    async def main() -> None:
        from actors.prefetch import prefetch_progress

        start = StartProgress(config.model)
        prefetch_progress.set(start.report)  # the tasks started below inherit it
        async with trio.open_nursery() as nursery:
            with ticking(start.tick):
                try:
                    started: ServerStarted = await nursery.start(
                        partial(serve, config, extra_routes=scenarios, engine=engine, directory=directory))
                except BaseException:
                    start.close(listening=False)  # erased: the error comes next
                    raise
            start.close()
            if started.profile is not None:  # every CPU-versus-GPU decision, in one line (runtime.backend)
                print(f"kvmem: {started.profile}", file=sys.stderr, flush=True)
            print(f"kvmem: serving {config.model} on {started.url}", file=sys.stderr, flush=True)
            print(f"kvmem: operator page {started.url.rstrip('/')}/ui/", file=sys.stderr, flush=True)

    try:
        trio.run(main)
    except (OSError, BaseExceptionGroup) as exc:
        cause = _first_os_error(exc)
        if cause is None:
            raise
        # an unusable cache directory or home, a port in use: one clear line, not a traceback
        print(f"kvmem serve: {cause}", file=sys.stderr, flush=True)
        return 1
    finally:
        if leader is not None:
            leader.close()  # after the flush: the other ranks saved their parts of every cache
    print("kvmem: stopped; caches flushed", file=sys.stderr, flush=True)
    return 0


class StartProgress:
    """What a start waits for, on stderr (:mod:`gateway.progress`): the model's load, then the restore-ahead.

    ``kvmem: loading M`` turns (a spinner and the time so far; the caches read from disk meanwhile as a
    note) until the restore-ahead begins or the server listens; then ``kvmem: restoring caches ahead``
    counts them (:data:`actors.prefetch.prefetch_progress` reports each). Each step ends in a line of its
    own (``kvmem: loaded M in 2.1 s``). :meth:`report` runs on trio's thread, :meth:`tick` on the ticking one.
    """

    def __init__(self, model: str, **options: Any) -> None:
        self._model = model
        self._options = options
        self._loading = Progress(f"kvmem: loading {model}", **options)
        self._restoring: Progress | None = None

    def report(self, step: str, done: int, total: int) -> None:
        """:data:`actors.prefetch.PrefetchReport`: ``done`` of ``total`` caches read (``read``) or restored."""
        if step == "read":
            self._loading.note = f"{done}/{total} recent caches read"
            self._loading.tick()
            return
        if self._restoring is None:
            self._close_loading()
            self._restoring = Progress("kvmem: restoring caches ahead", total=total, unit="caches", **self._options)
        self._restoring.update(done, total=total)

    def tick(self) -> None:
        (self._restoring or self._loading).tick()

    def close(self, *, listening: bool = True) -> None:
        """End whichever step is drawn: with its closing line once the server listens, silently if it failed."""
        self._close_loading(listening)
        if self._restoring is not None:
            done = self._restoring
            done.close(f"kvmem: restored {done.done} of {done.total} caches ahead in {done.elapsed_s:.1f} s"
                       if listening else None)

    def _close_loading(self, loaded: bool = True) -> None:
        self._loading.close(f"kvmem: loaded {self._model} in {self._loading.elapsed_s:.1f} s" if loaded else None)


def _follow(follower: Any) -> int:
    """A rank other than 0: follow rank 0 until it stops. Shutting down is rank 0's to run.

    SIGINT (Ctrl-C reaches every local rank) and SIGTERM (``mlx.launch`` sends it when another rank
    failed; an operator may send it to this rank) give rank 0 :data:`FOLLOWER_GRACE_S` to shut down,
    flush every cache (this rank saves its parts then) and say when to exit; then this rank exits
    anyway, and ``mlx.launch`` stops rank 0. The launcher gone, it stops the same way
    (:func:`runtime.distributed.launch.stop_when_orphaned`).
    """
    import signal

    from runtime.distributed.launch import FOLLOWER_GRACE_S, stop_when_orphaned

    def leave_soon(_signum: int, _frame: Any) -> None:
        remaining = signal.alarm(FOLLOWER_GRACE_S)  # SIGALRM's default action ends the process
        if remaining:
            signal.alarm(remaining)  # a second signal: the first one's deadline stands
        else:
            print(f"kvmem: rank {follower.rank}: stopping within {FOLLOWER_GRACE_S} s", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, leave_soon)
    signal.signal(signal.SIGTERM, leave_soon)
    stop_when_orphaned()
    print(f"kvmem: rank {follower.rank} of {follower.size} following rank 0", file=sys.stderr, flush=True)
    code: int = follower.run()
    return code


def _first_os_error(exc: BaseException) -> OSError | None:
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_os_error(inner)
            if found is not None:
                return found
    return None
