"""Shared fixtures: tiny models built once per session, loaded once per KV format."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
import pytest

from runtime.spec import KVFormat
from runtime.models import LoadedModel, load_model

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gemma3", "tiny-gpt-oss", "tiny-deepseek-v2"]
SHARED = Path(__file__).resolve().parents[2] / "shared"
FIXTURES = SHARED / "fixtures"


def models_dir() -> Path:
    """Where test models are built: $KVMEM_HOME/models when set, else a temp folder."""
    home = os.environ.get("KVMEM_HOME")
    root = Path(home) if home else Path(tempfile.gettempdir()) / "kvmem-test-home"
    path = root / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def tiny(name: str, bits: int | None = 4) -> LoadedModel:
    """A loaded tiny model (cached across tests)."""
    return load_model(name, kv_format=KVFormat(bits=bits), models_dir=models_dir())


@functools.cache
def fixture_model(name: str, bits: int | None = 4) -> LoadedModel:
    path = FIXTURES / name
    if not (path / "config.json").exists():
        pytest.skip(f"fixture {name} not present at {path}")
    return load_model(str(path), kv_format=KVFormat(bits=bits))


@functools.cache
def _real_default() -> LoadedModel:
    return load_model("kvmem-default", models_dir=models_dir())


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real default model (SmolLM2-135M-Instruct); skipped when its package is not installed."""
    from runtime.default_model import default_model_file
    from runtime.errors import ModelError

    try:
        default_model_file()
    except ModelError as exc:
        pytest.skip(str(exc))
    return _real_default()
