"""Options shared by ``kvmem`` subcommands, and the one place flags become a :class:`runtime.config.Config`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.config import Config

__all__ = ["add_model_options", "config_from_args"]


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --kv-bits, --attention, --numpy-attention, --profile, --weights, --home and --config.

    A flag's destination is the setting's name (``--kv-bits`` → ``kv_bits``):
    :func:`config_from_args` relies on it.
    """
    p.add_argument("--model", help="tiny model name, model folder, or Hugging Face id (default: kvmem-default)")
    p.add_argument("--kv-bits", help="4, 8, or 'float' for unquantized KV (default 4)")
    p.add_argument("--attention", choices=("auto", "at-rest", "native"), help="attention strategy for Q4 KV (default auto)")
    p.add_argument(
        "--numpy-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on CPU, attend in NumPy (runtime.cpu_attention; default on); --no-numpy-attention: MLX's own",
    )
    p.add_argument("--profile", choices=("auto", "cpu", "gpu"),
                   help="backend policy (default auto: the device's; cpu/gpu force one, see runtime.backend)")
    p.add_argument(
        "--weights",
        choices=("auto", "float32", "float16", "bfloat16", "quantized"),
        help="how GGUF weights are held (default auto: float32 on CPU, as stored on GPUs)",
    )
    p.add_argument("--home", type=Path, help="kvmem home folder (default $KVMEM_HOME or ~/.local/share/kvmem)")
    p.add_argument("--config", help="TOML file with settings (also $KVMEM_CONFIG)")


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
