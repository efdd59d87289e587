"""A model family MLX's CUDA backend computes wrongly with ``mx.compile`` on turns it off at load, on CUDA only.

The wrong results were measured on an H200 (``runtime.model.cuda_compile``); here (CPU) what holds
is the decision: which families and backends, that loading one on CUDA calls ``mx.disable_compile``,
and that loading it anywhere else, or loading another family on CUDA, does not.
"""

from __future__ import annotations

import pytest
from conftest import models_dir

from runtime.model import cuda_compile, loaded
from runtime.model.cuda_compile import compile_off_for


@pytest.mark.parametrize(("model_type", "backend", "off"), [
    ("gpt_oss", "cuda", True), ("gpt_oss", "cpu", False), ("gpt_oss", "metal", False),
    ("llama", "cuda", False), ("qwen2", "cuda", False), (None, "cuda", False)])
def test_which_models_on_which_backends(model_type: str | None, backend: str, off: bool) -> None:
    assert compile_off_for(model_type, backend) is off


@pytest.mark.parametrize(("model", "backend", "off"), [
    ("tiny-gpt-oss", "cuda", True), ("tiny-gpt-oss", "cpu", False), ("tiny-llama", "cuda", False)])
def test_loading_turns_compile_off_only_where_it_computes_wrongly(model: str, backend: str, off: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(loaded, "detect_device", lambda: ("gpu" if backend != "cpu" else "cpu", backend))
    monkeypatch.setattr(cuda_compile.mx, "disable_compile", lambda: calls.append(True))  # this process keeps its compile
    lm = loaded.load_model(model, models_dir=models_dir())
    assert lm.config.get("model_type") == model.removeprefix("tiny-").replace("-", "_")
    assert calls == ([True] if off else [])

