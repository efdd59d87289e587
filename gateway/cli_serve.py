"""``kvmem serve``: the HTTP gateway (Anthropic, OpenAI and agent APIs) on one kvmem runtime.

Settings come from flags > ``KVMEM_*`` environment variables > a TOML file
(``--config``) > defaults; see :mod:`runtime.config`.

``--distributed`` (under ``mlx.launch``): every rank runs this command; rank 0
serves, with its engine and cache directory extended to the other ranks, and
every other rank follows it (:mod:`runtime.distributed`).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

from gateway.cli_common import add_model_options, config_from_args

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``kvmem serve`` to the ``kvmem`` parser."""
    p = sub.add_parser("serve", help="serve the Anthropic / OpenAI / agent HTTP APIs")
    add_model_options(p)
    p.add_argument("--models", help="other models requests may name, comma-separated")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--cache-dir", help="folder for the KV caches (default: the kvmem home)")
    p.add_argument("--store", help="shared tier for several nodes: redis://HOST:PORT/DB (default: this disk only)")
    p.add_argument("--lease-s", type=float, help="with --store: how long an agent's cluster lease lasts (s)")
    p.add_argument("--budget-mb", type=float, help="KV memory budget for running sequences (MiB)")
    p.add_argument("--hot-budget-mb", type=float, help="memory for idle caches kept in RAM (MiB)")
    p.add_argument(
        "--prewarm-mb", type=float, help="memory touched at start and kept, so the first turn is fast (MiB; 0: off)"
    )
    p.add_argument("--keep-float-mb", type=float,
                   help="float KV kept after turns so the next hot turn skips dequantizing (MiB; 0: off)")
    p.add_argument("--prefetch-mb", type=float,
                   help="at start, read the newest caches from disk while the model loads (MiB; 0: off)")
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=None,
                   help="answer a turn only once its cache is on disk (default off: write-behind; "
                        "per request: X-Kvmem-Durable)")
    p.add_argument("--api-key", help="require this key (x-api-key or Authorization: Bearer)")
    p.add_argument("--api-keys", help="TOML file of keys, each naming a tenant, and tenant limits (not with --api-key)")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask for")
    p.add_argument("--max-body-bytes", type=int, help="largest request body")
    p.add_argument("--body-timeout-s", type=float, help="seconds a request body may take to arrive (then 408)")
    p.add_argument("--distributed", action="store_true",
                   help="one model over the ranks mlx.launch started (tensor parallel; see the README)")
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
        engine, directory, leader = rank.engine, rank.directory, rank

    def scenarios(rt: Any, nursery: trio.Nursery) -> list[Any]:
        from gateway.scenario_routes import scenario_routes
        from runtime.home import KvmemHome

        return scenario_routes(rt, home=KvmemHome(config.home_path).root, nursery=nursery)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            started: ServerStarted = await nursery.start(
                partial(serve, config, extra_routes=scenarios, engine=engine, directory=directory))
            if started.profile is not None:  # every CPU-versus-GPU decision, in one line (runtime.backend)
                print(f"kvmem: {started.profile}", file=sys.stderr, flush=True)
            print(f"kvmem: serving {config.model} on {started.url}", file=sys.stderr, flush=True)

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


def _follow(follower: Any) -> int:
    """A rank other than 0: follow rank 0 until it stops. Signals are rank 0's to handle.

    SIGINT (Ctrl-C reaches every local rank) is ignored: rank 0 shuts down,
    flushes every cache (this rank saves its parts then) and says when to exit.
    SIGTERM (``mlx.launch`` sends it when another rank failed) leaves 30 s for that.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: signal.alarm(30))
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
