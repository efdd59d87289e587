"""Shared fixtures: tiny models built once per session, loaded once per KV format.

Tests run on whatever MLX's default device is. A test that can only hold on MLX's CPU
backend (a CPU-only code path, a host-memory measurement) carries :func:`cpu_only` with
its reason; the tiny models load as the device's backend policy would load them
(:mod:`runtime.backend`: no NumPy attention under the GPU policy).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

# Full float32 matrix products on every backend: MLX runs float32 matmuls as TF32 on
# CUDA (and M5) unless told otherwise (~1e-3 relative error per product), while the
# float32 tolerances here (FLOAT_TOL, BATCH_LOGIT_TOL, NEAR_TIE, GGUF's rtol 1e-4) were
# derived from float32 summation order. Set before MLX reads it (at its first matmul);
# a run that exports MLX_ENABLE_TF32=1 keeps TF32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import runtime  # noqa: E402,F401  (OpenBLAS before mlx)
import pytest  # noqa: E402

from runtime.backend import detect_device, device_profile  # noqa: E402
from runtime.spec import KVFormat  # noqa: E402
from runtime.model.loaded import LoadedModel, load_model  # noqa: E402

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


def cpu_only(reason: str) -> pytest.MarkDecorator:
    """Skip unless MLX's default device is the CPU; ``reason`` says why the test cannot hold elsewhere."""
    return pytest.mark.skipif(detect_device()[0] != "cpu", reason=f"CPU backend only: {reason}")


@functools.cache
def native_attention_missing() -> str | None:
    """Why native Q4 attention cannot run the tiny (float32) models on this device, or None.

    The engine's own load check decides (:func:`runtime.kv.kvstate.settle_attention`). MLX's
    CUDA backend has no quantized matmul for float32 activations (seen on an H200, MLX 0.32.4),
    so there kvmem serves such models at rest, and the native tests have nothing to run.
    """
    from runtime.kv.kvstate import settle_attention

    attention, note = settle_attention(tiny("tiny-llama"), "native")
    return None if attention == "native" else note or "native attention unavailable"


def skip_without_native_attention() -> None:
    """Skip the calling test where native Q4 attention has no kernel for the tiny models."""
    if (why := native_attention_missing()) is not None:
        pytest.skip(f"native Q4 attention cannot run float32 models on this device: {why}")


@pytest.fixture(autouse=True)
def _native_tests_need_native_kernels(request: pytest.FixtureRequest) -> None:
    """Tests parametrized with ``attention`` = ``native`` skip where it cannot run."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("attention") == "native":
        skip_without_native_attention()


@functools.cache
def numpy_attention() -> bool:
    """Whether models load with kvmem's NumPy attention: the device's policy, as the engine decides it."""
    return device_profile().numpy_attention


@functools.cache
def tiny(name: str, bits: int | None = 4, key_bits: int | None = None) -> LoadedModel:
    """A loaded tiny model (cached across tests); ``key_bits``: the keys' own bits (:class:`KVFormat`)."""
    return load_model(name, kv_format=KVFormat(bits=bits, key_bits=key_bits), models_dir=models_dir(),
                      numpy_attention=numpy_attention())


@functools.cache
def fixture_model(name: str, bits: int | None = 4) -> LoadedModel:
    path = FIXTURES / name
    if not (path / "config.json").exists():
        pytest.skip(f"fixture {name} not present at {path}")
    return load_model(str(path), kv_format=KVFormat(bits=bits), numpy_attention=numpy_attention())


@functools.cache
def _real_default() -> LoadedModel:
    return load_model("kvmem-default", models_dir=models_dir(), numpy_attention=numpy_attention())


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real default model (SmolLM2-135M-Instruct); skipped when its package is not installed."""
    from runtime.model.default_model import default_model_file
    from runtime.errors import ModelError

    try:
        default_model_file()
    except ModelError as exc:
        pytest.skip(str(exc))
    return _real_default()


def mlx_with(**replaced: object) -> object:
    """``mlx.core`` with ``replaced`` functions in its place, everything else its own: what a module's ``mx`` is
    monkeypatched to, to watch the calls that module makes (and only that module's)."""
    import mlx.core as mx

    class MLX:
        def __getattr__(self, name: str) -> object:
            return getattr(mx, name)

    proxy = MLX()
    for name, fn in replaced.items():
        setattr(proxy, name, fn)
    return proxy
