"""A prompt plus ``max_tokens`` beyond the model's context is refused before any prefill.

Issue 32 item 4: 10,001 one-character messages (70,011 tokens) to tiny-llama (a
4,096-token context) were prefilled for 200 s and answered 200 with meaningless text.
Now the GPU actor compares the prompt's tokens plus ``max_tokens`` with the context
``ModelInfo.context_length`` names, before the budget check and before any prefill:
a non-streaming request gets a 400 (OpenAI ``context_length_exceeded``, Anthropic
``invalid_request_error``) naming both numbers; a streaming one an error event.
A model whose config names no context says so at load, and only the KV budget applies.
A request that names no ``max_tokens`` (OpenAI's, kvmem's agents API) gets the server's default
shrunk to the room the context leaves, and a 400 only when the prompt leaves none.

The fake engine (one character, one token; ``fake_render`` adds 17 characters around
one user message) runs the API tests without MLX; tiny-llama shows the real model.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import models_dir
from fake_engine import FakeEngine, fake_render

from actors import open_runtime
from gateway.testing import ServerThread
from runtime.config import Config
from runtime.errors import ContextLengthExceededError

FAKE = "fake-a"
CONTEXT = 256
DEFAULT_MAX_TOKENS = 32


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _sized(prompt_tokens: int) -> list[dict[str, str]]:
    """One user message whose fake prompt is ``prompt_tokens`` tokens."""
    messages = _user("x" * (prompt_tokens - len(fake_render(_user("")))))
    assert len(fake_render(messages)) == prompt_tokens
    return messages


# -- the runtime, on the fake engine ----------------------------------------------------


async def test_a_prompt_beyond_the_context_is_refused_before_any_prefill(tmp_path: Path) -> None:
    engine = FakeEngine(context_length=CONTEXT)
    async with open_runtime(model=FAKE, home=tmp_path, engine=engine, fsync=False, handle_signals=False) as rt:
        agent = rt.agent("a")
        with pytest.raises(ContextLengthExceededError) as refused:
            await agent.send(_sized(CONTEXT - 15), max_tokens=16)  # one token past the context
        assert str(refused.value) == (
            f"the prompt ({CONTEXT - 15} tokens) plus max_tokens (16) exceeds the model's context of {CONTEXT} tokens")
        assert isinstance(refused.value, ValueError)
        gpu = rt.stats().gpu
        assert gpu.admitted_total == 0 and gpu.prefill_chunks == 0 and gpu.steps == 0
        # exactly at the context is accepted, and the agent that was refused still works
        result = await agent.send(_sized(CONTEXT - 16), max_tokens=16)
        assert result.usage.tokens_prefilled == CONTEXT - 16 and len(result.reply) == 16


async def test_a_model_with_no_known_context_is_limited_by_the_budget_only(tmp_path: Path) -> None:
    async with open_runtime(model=FAKE, home=tmp_path, engine=FakeEngine(), fsync=False, handle_signals=False) as rt:
        result = await rt.agent("a").send(_sized(10 * CONTEXT), max_tokens=4)
        assert result.usage.tokens_prefilled == 10 * CONTEXT


async def test_a_conversation_that_grows_past_the_context_is_refused_on_the_turn_that_passes_it(
    tmp_path: Path,
) -> None:
    """The count is the whole prompt, the reused cache included (``reuse_tokens`` + the suffix)."""
    engine = FakeEngine(context_length=CONTEXT)
    async with open_runtime(model=FAKE, home=tmp_path, engine=engine, fsync=False, handle_signals=False) as rt:
        agent = rt.agent("a")
        first = await agent.send(_sized(200), max_tokens=8)
        history = [*_sized(200), {"role": "assistant", "content": first.reply}, {"role": "user", "content": "y" * 40}]
        with pytest.raises(ContextLengthExceededError, match=r"the prompt \(\d+ tokens\) plus max_tokens \(8\)"):
            await agent.send(history, max_tokens=8)


# -- the HTTP APIs, on the fake engine ---------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("context")
    config = Config(model=FAKE, port=0, home=str(root / "home"), cache_dir=str(root / "caches"), fsync=False,
                    default_max_tokens=DEFAULT_MAX_TOKENS, graceful_timeout_s=2)
    with ServerThread(config, engine=FakeEngine(context_length=CONTEXT)) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=20) as client:
        yield client


OVER = {"model": FAKE, "max_tokens": 16, "messages": _sized(CONTEXT - 15)}
AT = {"model": FAKE, "max_tokens": 16, "messages": _sized(CONTEXT - 16)}
NAMES_BOTH = f"the prompt ({CONTEXT - 15} tokens) plus max_tokens (16) exceeds the model's context of {CONTEXT} tokens"
NO_ROOM = "the prompt ({tokens} tokens) fills the model's context of " + f"{CONTEXT} tokens: no room is left for a reply"


def test_openai_answers_400_context_length_exceeded(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=OVER)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"message": NAMES_BOTH, "type": "invalid_request_error",
                                         "param": "messages", "code": "context_length_exceeded"}
    assert http.post("/v1/chat/completions", json=AT).status_code == 200


def test_a_request_that_names_no_limit_gets_the_room_the_context_leaves(http: httpx.Client) -> None:
    """OpenAI's and the agents API's ``max_tokens`` left out: the server's ``default_max_tokens``, shrunk to
    what the context leaves (OpenAI, vLLM and llama.cpp generate up to the context), and a 400 only when
    the prompt leaves no room at all."""
    for room in (DEFAULT_MAX_TOKENS + 5, DEFAULT_MAX_TOKENS - 7, 1):
        body = {"model": FAKE, "messages": _sized(CONTEXT - room), "user": f"room-{room}"}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == min(room, DEFAULT_MAX_TOKENS)
        assert response.json()["choices"][0]["finish_reason"] == "length"
    agents = http.post("/v1/agents/ctx-room/messages", json={"messages": _sized(CONTEXT - 3)})
    assert agents.status_code == 200 and agents.json()["usage"]["tokens_generated"] == 3, agents.text
    full = NO_ROOM.format(tokens=CONTEXT)
    for refused in (http.post("/v1/chat/completions", json={"model": FAKE, "messages": _sized(CONTEXT)}),
                    http.post("/v1/agents/ctx-full/messages", json={"messages": _sized(CONTEXT)})):
        assert refused.status_code == 400 and refused.json()["error"]["message"] == full, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    named = {"model": FAKE, "max_tokens": DEFAULT_MAX_TOKENS, "messages": _sized(CONTEXT - 3)}
    assert http.post("/v1/chat/completions", json=named).status_code == 400, "a limit the client names is kept"


def test_anthropic_answers_400_invalid_request_error(http: httpx.Client) -> None:
    response = http.post("/v1/messages", json=OVER)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"] == {"type": "invalid_request_error", "message": NAMES_BOTH}
    assert http.post("/v1/messages", json=AT).status_code == 200


def test_the_agents_api_answers_400(http: httpx.Client) -> None:
    response = http.post("/v1/agents/ctx-agent/messages", json={"messages": OVER["messages"], "max_tokens": 16})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == NAMES_BOTH and error["code"] == "context_length_exceeded"


def test_a_streaming_request_is_refused_with_a_400_before_any_event(http: httpx.Client) -> None:
    """The turn is refused before it is accepted, so the status is a 400 in the API's shape, not an
    error event in a 200 stream."""
    streamed = {**OVER, "stream": True}
    anthropic = http.post("/v1/messages", json=streamed)
    assert anthropic.status_code == 400 and "text/event-stream" not in anthropic.headers["content-type"]
    assert anthropic.json()["error"] == {"type": "invalid_request_error", "message": NAMES_BOTH}
    openai = http.post("/v1/chat/completions", json=streamed)
    assert openai.status_code == 400
    assert openai.json()["error"]["code"] == "context_length_exceeded" and openai.json()["error"]["message"] == NAMES_BOTH
    agents = http.post("/v1/agents/ctx-stream/messages", json={"messages": OVER["messages"], "max_tokens": 16,
                                                             "stream": True})
    assert agents.status_code == 400 and agents.json()["error"]["code"] == "context_length_exceeded"


# -- the real model: tiny-llama (4,096 positions) ------------------------------------------

TINY = "tiny-llama"
TINY_CONTEXT = 4096


def _long(words: int) -> list[dict[str, str]]:
    return _user(" ".join(f"w{i % 97}" for i in range(words)))


async def test_tiny_llama_refuses_a_prompt_past_its_context_before_prefill_and_takes_one_at_it(
    tmp_path: Path,
) -> None:
    async with open_runtime(model=TINY, home=tmp_path, models_dir=models_dir(), fsync=False,
                            handle_signals=False) as rt:
        assert rt.stats().gpu.model == TINY
        over = _long(2000)
        prompt_tokens = await rt.count_tokens(over)
        assert prompt_tokens > TINY_CONTEXT
        with pytest.raises(ContextLengthExceededError) as refused:
            await rt.agent("long").send(over, max_tokens=8)
        assert str(refused.value) == (f"the prompt ({prompt_tokens:,} tokens) plus max_tokens (8) exceeds "
                                      f"the model's context of {TINY_CONTEXT:,} tokens")
        gpu = rt.stats().gpu
        assert gpu.admitted_total == 0 and gpu.prefill_chunks == 0  # refused before any prefill (counted, not timed)

        at = _long(1650)
        prompt_tokens = await rt.count_tokens(at)
        assert TINY_CONTEXT - 256 < prompt_tokens < TINY_CONTEXT, prompt_tokens
        with pytest.raises(ContextLengthExceededError):
            await rt.agent("at").send(at, max_tokens=TINY_CONTEXT - prompt_tokens + 1)
        result = await rt.agent("at").send(at, max_tokens=TINY_CONTEXT - prompt_tokens)  # the boundary
        assert result.usage.tokens_prefilled == prompt_tokens


# -- which context a model's config names --------------------------------------------------


def test_the_context_is_read_from_the_config_or_its_text_config() -> None:
    from runtime.model.loaded import read_context_length

    assert read_context_length({"model_type": "llama", "max_position_embeddings": 4096}) == 4096
    assert read_context_length({"model_type": "gpt2", "n_positions": 1024}) == 1024
    assert read_context_length({"model_type": "gemma3", "text_config": {"max_position_embeddings": 131072}}) == 131072
    assert read_context_length({"model_type": "mystery"}) is None
    assert read_context_length({"max_position_embeddings": None, "text_config": None}) is None


def test_a_model_whose_context_kvmem_cannot_read_says_so_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    from runtime.execution.mlx_engine import MlxEngine
    from runtime.model.loaded import prepare_model_files

    folder = tmp_path / "no-context"
    shutil.copytree(prepare_model_files(TINY, models_dir()), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    engine = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention="auto")
    with caplog.at_level(logging.WARNING, logger="kvmem.engine"):
        info = engine.load(str(folder))
    assert info.context_length is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"model {folder}: no context length in its config; prompts are limited by the KV budget only"]
    assert engine.load(TINY).context_length == TINY_CONTEXT
    engine.unload()  # not close(): that clears the MLX streams of this (the test) thread
