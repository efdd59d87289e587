"""The ``kvmem`` command line.

Each group of subcommands lives in its own module with a ``register(subparsers)``
function; this module only assembles the parser and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import runtime  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from gateway.cli_common import kvmem_version

__all__ = ["main"]

COMMAND_MODULES = (
    "gateway.cli_chat",
    "gateway.cli_serve",
    "gateway.cli_scenario",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmem", description="Persistent Q4 KV caches for LLM agents.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"kvmem {kvmem_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvmem`` console script."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from gateway.cli_common import the_one_error
    from runtime.config import ConfigError
    from runtime.errors import KvmemError

    try:
        try:
            return int(args.func(args) or 0)
        except BaseExceptionGroup as group:  # raised in a nursery (``serve``'s): one refusal is one line
            raise the_one_error(group, (ConfigError, KvmemError)) from None
    except ConfigError as exc:
        print(f"kvmem {args.command}: {exc}", file=sys.stderr)
        return 2
    except KvmemError as exc:
        print(f"kvmem: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
