"""Options shared by ``kvmem`` subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_model_options"]


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --kv-bits, --attention, --weights and --home."""
    p.add_argument("--model", help="tiny model name, model folder, or Hugging Face id (default: kvmem-default)")
    p.add_argument("--kv-bits", help="4, 8, or 'float' for unquantized KV (default 4)")
    p.add_argument("--attention", choices=("auto", "at-rest", "native"), help="attention strategy for Q4 KV (default auto)")
    p.add_argument(
        "--weights",
        choices=("auto", "float32", "float16", "bfloat16", "quantized"),
        help="how GGUF weights are held (default auto: float32 on CPU, as stored on GPUs)",
    )
    p.add_argument("--home", type=Path, help="kvmem home folder (default $KVMEM_HOME or ~/.local/share/kvmem)")
