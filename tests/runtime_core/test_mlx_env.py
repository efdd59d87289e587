"""The MLX environment kvmem sets on import (:mod:`runtime.mlx_env`): MLX's CUDA cache-thrashing
check (a lifetime miss counter that throws) is off unless the operator exported it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runtime.mlx_env import MLX_DEFAULTS, apply_mlx_defaults

ROOT = Path(__file__).resolve().parents[2]


def _after_import(**env: str) -> str:
    """``MLX_ENABLE_CACHE_THRASHING_CHECK`` as a fresh process sees it after ``import runtime``, then mlx."""
    clean = {k: v for k, v in os.environ.items() if k not in MLX_DEFAULTS} | env
    code = "import os, runtime, mlx.core; print(os.environ['MLX_ENABLE_CACHE_THRASHING_CHECK'])"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_importing_runtime_turns_the_thrashing_check_off_before_mlx_loads() -> None:
    assert _after_import() == "0"


def test_a_value_the_operator_exported_is_kept() -> None:
    assert _after_import(MLX_ENABLE_CACHE_THRASHING_CHECK="1") == "1"


def test_apply_sets_only_what_is_unset_and_says_what_it_set() -> None:
    environ = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    assert apply_mlx_defaults(environ) == {} and environ == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    empty: dict[str, str] = {}
    assert apply_mlx_defaults(empty) == MLX_DEFAULTS == empty
