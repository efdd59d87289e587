"""Helpers for tests that drive a real ``kvmem serve`` over HTTP: a server on the default model, SSE data."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from conftest import models_dir

from gateway.testing import ServerThread
from runtime.config import Config
from runtime.model.default_model import DEFAULT_MODEL


@contextmanager
def default_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A server on kvmem-default with its own cache directory (the real model: nothing scripted)."""
    config = Config(model=DEFAULT_MODEL, port=0, home=str(models_dir().parent),
                    cache_dir=str(tmp_path_factory.mktemp("c")), max_tokens_limit=256, budget_mb=512,
                    hot_budget_mb=128, graceful_timeout_s=2)
    with ServerThread(config) as running:
        yield running


def openai_stream_choices(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streamed chat completion; its chunks' first choices, after checking it ends with ``[DONE]``."""
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d)["choices"][0] for d in data[:-1]]
