"""Bad input gets a 4xx in the API's own error shape — never a 500, never a hang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import models_dir

from gateway.testing import ServerThread
from runtime.config import Config

MODEL = "tiny-llama"
LIMIT = 64 * 1024
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    config = Config(model=MODEL, port=0, home=str(models_dir().parent),
                         cache_dir=str(tmp_path_factory.mktemp("caches")), max_tokens_limit=128,
                         max_body_bytes=LIMIT, graceful_timeout_s=1, budget_mb=1)  # 1 MiB: ~256 tokens
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=20) as client:  # a hang fails the test
        yield client


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    assert body["request_id"] == response.headers["request-id"]
    return body["error"]


def _openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


ANTHROPIC_OK = {"model": MODEL, "max_tokens": 4, "messages": MSG}
OPENAI_OK = {"model": MODEL, "max_tokens": 4, "messages": MSG}

# (body, JSON path the error must name)
ANTHROPIC_BAD = [
    ({**ANTHROPIC_OK, "max_tokens": "4"}, "max_tokens"),
    ({**ANTHROPIC_OK, "max_tokens": 0}, "max_tokens"),
    ({**ANTHROPIC_OK, "messages": "hi"}, "messages"),
    ({**ANTHROPIC_OK, "messages": []}, "messages"),
    ({**ANTHROPIC_OK, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({**ANTHROPIC_OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({**ANTHROPIC_OK, "messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]},
     "messages[0].content[0].type"),
    ({**ANTHROPIC_OK, "temperature": 1.5}, "temperature"),
    ({**ANTHROPIC_OK, "top_k": -1}, "top_k"),
    ({**ANTHROPIC_OK, "stop_sequences": "END"}, "stop_sequences"),
    ({**ANTHROPIC_OK, "system": 5}, "system"),
    ({**ANTHROPIC_OK, "stream": "yes"}, "stream"),
    ({**ANTHROPIC_OK, "metadata": {"user_id": 7}}, "metadata.user_id"),
    ({"model": MODEL, "messages": MSG}, "max_tokens"),
    ({"max_tokens": 4, "messages": MSG}, "model"),
    ({"model": MODEL, "max_tokens": 4}, "messages"),
]

OPENAI_BAD = [
    ({**OPENAI_OK, "max_tokens": 1.5}, "max_tokens"),
    ({**OPENAI_OK, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({**OPENAI_OK, "messages": [{"content": "x"}]}, "messages[0].role"),
    ({**OPENAI_OK, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**OPENAI_OK, "temperature": 3}, "temperature"),
    ({**OPENAI_OK, "top_p": 0}, "top_p"),
    ({**OPENAI_OK, "n": 17}, "n"),
    ({**OPENAI_OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**OPENAI_OK, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({**OPENAI_OK, "user": ["x"]}, "user"),
    ({"messages": MSG}, "model"),
    ({"model": MODEL}, "messages"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "path"), ANTHROPIC_BAD)
def test_anthropic_wrong_types_and_missing_fields_are_400_naming_the_path(
    http: httpx.Client, body: dict, path: str, stream: bool
) -> None:
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    error = _anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert path in error["message"].replace("$.", ""), error


@pytest.mark.parametrize(("body", "path"), OPENAI_BAD)
def test_openai_wrong_types_and_missing_fields_are_400_naming_the_path(
    http: httpx.Client, body: dict, path: str
) -> None:
    error = _openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == path, error


@pytest.mark.parametrize("raw", [b"{", b"not json", b"[]", b"", b"\xff\xfe{}", b'{"model": "tiny-llama",}', b"null"])
def test_malformed_json_is_a_400(http: httpx.Client, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    _anthropic_error(http.post("/v1/messages", content=raw, headers=headers), 400, "invalid_request_error")
    _anthropic_error(http.post("/v1/messages/count_tokens", content=raw, headers=headers), 400,
                     "invalid_request_error")
    assert _openai_error(http.post("/v1/chat/completions", content=raw, headers=headers), 400)["type"] == \
        "invalid_request_error"
    agents = http.post("/v1/agents/x/messages", content=raw, headers=headers)
    assert agents.status_code == 400 and agents.json()["error"]["type"] == "invalid_request"


def test_oversize_bodies_are_413_in_each_shape(http: httpx.Client) -> None:
    big = {**ANTHROPIC_OK, "messages": [{"role": "user", "content": "x" * (LIMIT + 10)}]}
    _anthropic_error(http.post("/v1/messages", json=big), 413, "request_too_large")
    assert _openai_error(http.post("/v1/chat/completions", json=big), 413)["code"] == "request_too_large"
    # without a Content-Length (chunked): refused while reading
    payload = json.dumps(big).encode()
    chunks = (payload[i: i + 8192] for i in range(0, len(payload), 8192))
    _anthropic_error(http.post("/v1/messages", content=chunks), 413, "request_too_large")
    assert http.post("/v1/agents/big/messages", json=big).status_code == 413


def test_max_tokens_above_the_limit_is_a_400(http: httpx.Client) -> None:
    error = _anthropic_error(http.post("/v1/messages", json={**ANTHROPIC_OK, "max_tokens": 129}), 400,
                             "invalid_request_error")
    assert "128" in error["message"]
    for key in ("max_tokens", "max_completion_tokens"):
        error = _openai_error(http.post("/v1/chat/completions", json={**OPENAI_OK, key: 10_000}), 400)
        assert error["param"] == key
    agents = http.post("/v1/agents/a/messages", json={"prompt": "x", "max_tokens": 129})
    assert agents.status_code == 400 and agents.json()["error"]["param"] == "max_tokens"


def test_unknown_model_is_a_404(http: httpx.Client) -> None:
    for stream in (False, True):
        _anthropic_error(http.post("/v1/messages", json={**ANTHROPIC_OK, "model": "claude-x", "stream": stream}),
                         404, "not_found_error")
        error = _openai_error(http.post("/v1/chat/completions", json={**OPENAI_OK, "model": "gpt-x",
                                                                         "stream": stream}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
    _anthropic_error(http.post("/v1/messages/count_tokens", json={"model": "x", "messages": MSG}), 404,
                     "not_found_error")
    assert _openai_error(http.get("/v1/models/gpt-x"), 404)["code"] == "model_not_found"
    agents = http.post("/v1/agents/a/messages", json={"prompt": "x", "model": "nope"})
    assert agents.status_code == 404


def test_unsupported_content_is_a_clear_400(http: httpx.Client) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    error = _anthropic_error(http.post("/v1/messages", json={**ANTHROPIC_OK, "messages": [
        {"role": "user", "content": [image]}]}), 400, "invalid_request_error")
    assert "image" in error["message"]
    server_tool = {**ANTHROPIC_OK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    _anthropic_error(http.post("/v1/messages", json=server_tool), 400, "invalid_request_error")
    part = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    error = _openai_error(http.post("/v1/chat/completions", json={**OPENAI_OK, "messages": [
        {"role": "user", "content": [part]}]}), 400)
    assert error["param"] == "messages[0].content[0]"


def test_a_prompt_larger_than_the_kv_budget_is_a_400_streaming_or_not(http: httpx.Client) -> None:
    long = [{"role": "user", "content": "many words here " * 600}]
    for stream in (False, True):  # refused before the turn is accepted: a status, not an error event
        error = _anthropic_error(http.post("/v1/messages", json={**ANTHROPIC_OK, "messages": long, "stream": stream}),
                                 400, "invalid_request_error")
        assert "budget" in error["message"]
        openai = http.post("/v1/chat/completions", json={**OPENAI_OK, "messages": long, "stream": stream})
        assert _openai_error(openai, 400)["code"] == "context_length_exceeded"


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    assert http.get("/v1/nothing").status_code == 404
    _anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    assert _openai_error(http.delete("/v1/chat/completions"), 405)["type"] == "invalid_request_error"


def test_sdks_raise_their_own_error_types(server: ServerThread) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=20)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=MSG)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=1000, messages=MSG)  # type: ignore[arg-type]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=20)
    with pytest.raises(openai.NotFoundError) as missing:
        gpt.chat.completions.create(model="gpt-nope", messages=MSG)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_many:
        gpt.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1000)  # type: ignore[arg-type]
    assert too_many.value.param == "max_tokens"


def test_no_request_above_ended_in_a_5xx(http: httpx.Client) -> None:
    statuses = [line for line in http.get("/metrics").text.splitlines()
                if line.startswith("kvmem_http_requests_total{")]
    assert statuses and not [s for s in statuses if 'status="5' in s]
    assert http.post("/v1/messages", json=ANTHROPIC_OK).status_code == 200  # and it still serves


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_last_assistant_message_is_continued_as_a_prefill(http: httpx.Client, api: str) -> None:
    """Issue 59: a trailing assistant message (Anthropic's prefill; OpenAI clients that continue a partial reply)
    was a 400 on Anthropic and a fresh reply on OpenAI. The reply now continues it: greedy, it is the reply to
    the raw prompt that ends inside that message (the agents API's ``prompt``, rendered by the test itself)."""
    from runtime.model.loaded import load_model

    lm = load_model(MODEL, models_dir=models_dir())
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    rendered = lm.render(messages)
    assert rendered.endswith("The colour is") and rendered.count("The colour is") == 1, rendered[-80:]
    reference = http.post(f"/v1/agents/prefill-ref-{api}/messages",  # a fresh agent: cold, as the turn is
                          json={"prompt": rendered, "max_tokens": 6, "temperature": 0}).json()["reply"]
    if api == "anthropic":
        response = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 6, "temperature": 0,
                                                    "messages": messages}, headers={"X-Agent-ID": "prefill-a"})
        assert response.status_code == 200, response.text
        text = "".join(block["text"] for block in response.json()["content"] if block["type"] == "text")
    else:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 6, "temperature": 0,
                                                            "messages": messages}, headers={"X-Agent-ID": "prefill-o"})
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
    assert text == reference, (text, reference)
