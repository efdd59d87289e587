"""Options shared by ``kvmem`` subcommands, and the one place flags become a :class:`runtime.config.Config`.

The settings' flags are generated from :class:`runtime.config.Config`'s fields
(:func:`runtime.config.settings`): one flag per setting, named and documented
as the TOML key and the ``KVMEM_`` variable are, so the three surfaces cannot
drift apart. A flag's value stays a string (booleans excepted) and is checked
with the environment's and the TOML file's values, by :func:`runtime.config.load_config`.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.config import Config

__all__ = ["add_setting_options", "config_from_args", "the_one_error", "kvmem_version", "HOME_SETTINGS"]


def kvmem_version() -> str:
    """kvmem's installed version (``kvmem --version``, ``/healthz``); a checkout never installed says so."""
    from importlib import metadata

    try:
        return metadata.version("kvmem")
    except metadata.PackageNotFoundError:
        return "0 (not installed)"


HOME_SETTINGS = frozenset({"home", "cache_dir", "models_dir", "model", "fsync", "store"})
"""The settings a command that only reads or changes a home's agents takes (``kvmem agents``, ``kvmem forget``):
where the caches are, the model whose caches they are, and the shared tier a forget must reach."""


def add_setting_options(p: argparse.ArgumentParser, *, server: bool = False,
                        only: frozenset[str] | None = None) -> None:
    """A flag for every setting (``--kv-bits`` for ``kv_bits``), and ``--config``.

    ``server``: the HTTP server's settings too (:data:`runtime.config.SERVER_FIELDS`;
    ``kvmem serve``); ``only``: just these settings (:data:`HOME_SETTINGS`), for a command the
    others do not touch. A flag's destination is the setting's name: :func:`config_from_args`
    relies on it. Defaults are None ("not given"), so the environment and TOML still apply.
    """
    from runtime.config import settings

    group = p.add_argument_group("settings", "flags > KVMEM_* environment > TOML (--config) > defaults; "
                                             "see docs/configuration.md")
    group.add_argument("--config", help="TOML file with settings (also $KVMEM_CONFIG)")
    for setting in settings():
        if (setting.server_only and not server) or (only is not None and setting.name not in only):
            continue
        shown = setting.default not in ("", "[]")
        help_text = _plain(setting.meaning) + (f" (default: {setting.default})" if shown else "")
        if setting.boolean:
            group.add_argument(setting.flag, dest=setting.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(setting.flag, dest=setting.name, choices=setting.choices or None, help=help_text)


def _plain(rest: str) -> str:
    """A docstring entry as help text: no reST markup, ``%`` escaped for argparse."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", rest).replace("``", "")
    return text.replace("%", "%%")


def config_from_args(args: argparse.Namespace, **defaults: Any) -> Config:
    """The configuration of this command: flags > ``KVMEM_*`` environment > TOML (``--config``) > defaults.

    Every parsed option named like a setting is a flag (None: not given).
    ``defaults`` are the command's own, below every source.

    Raises:
        ConfigError: a bad value (named), or an unreadable TOML file.
    """
    from runtime.config import FIELDS, load_config

    flags = {name: getattr(args, name, None) for name in FIELDS}
    return load_config(flags, config_file=getattr(args, "config", None), defaults=defaults)


def the_one_error(group: BaseExceptionGroup, expected: tuple[type[Exception], ...]) -> BaseException:
    """The first of ``expected`` in ``group`` when the group holds nothing else but cancellations and
    interruptions (the nursery's other tasks, stopped by it); else the group itself, traceback and all."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    found = [e for e in leaves if isinstance(e, expected)]
    stopped = (*expected, KeyboardInterrupt)
    others = [e for e in leaves if not isinstance(e, stopped) and type(e).__name__ != "Cancelled"]
    if found and not others:
        return found[0]
    if leaves and all(isinstance(e, KeyboardInterrupt) for e in leaves):
        return leaves[0]
    return group
