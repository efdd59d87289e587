"""The HTTP gateway on a real hypercorn server, driven by the official anthropic and openai SDKs."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import models_dir
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import gateway.sse
from gateway.testing import ServerThread
from runtime.config import Config

MODEL = "tiny-llama"
KEY = "test-key"


def _model_without_template(root: Path) -> Path:
    """A copy of the tiny model whose tokenizer has no chat template (so no tool support)."""
    from runtime.model.tiny_models import ensure_tiny_model

    source = ensure_tiny_model(MODEL, models_dir())
    target = root / "no-template-model"
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return target


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_without_template(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, no_template_model: Path) -> Iterator[ServerThread]:
    config = Config(
        model=MODEL,
        models=(str(no_template_model),),
        port=0,
        home=str(models_dir().parent),
        cache_dir=str(tmp_path_factory.mktemp("caches")),
        api_key=KEY,
        max_tokens_limit=2400,  # a reply longer than a client waits for on a GPU (below)
        max_body_bytes=64 * 1024,
        budget_mb=256,
        hot_budget_mb=64,
        graceful_timeout_s=2,
    )
    with ServerThread(config, extra_routes=_extra_routes) as running:
        yield running


def _extra_routes(rt: object, nursery: object) -> list[Route]:
    async def ping(request: Request) -> JSONResponse:
        """An extra route (the hook scenarios use)."""
        return JSONResponse({"pong": True, "live_agents": len(rt.live_agents())})  # type: ignore[attr-defined]

    return [Route("/v1/ping", ping, methods=["GET"], name="ping")]


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gpt(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as client:
        yield client


def _count(claude: anthropic.Anthropic, messages: list[dict], **kw: object) -> int:
    return claude.messages.count_tokens(model=MODEL, messages=messages, **kw).input_tokens  # type: ignore[arg-type]


# -- Anthropic ------------------------------------------------------------------


def test_anthropic_conversation_reuses_the_cache_on_turn_2(claude: anthropic.Anthropic) -> None:
    system = "You are a terse assistant."
    messages: list[dict] = [{"role": "user", "content": "Tell me about the sea."}]
    raw = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=12, system=system, messages=messages, metadata={"user_id": "anthropic-alice"}
    )
    first = raw.parse()
    assert raw.headers["x-kvmem-agent-id"] == "anthropic-alice"
    assert raw.headers["x-kvmem-tier"] == "cold"
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("max_tokens", "end_turn")
    u1 = first.usage
    prompt1 = _count(claude, messages, system=system)
    # As Anthropic reports it: input = prefilled, cache read = reused, no breakpoint writes.
    assert (u1.input_tokens, u1.cache_read_input_tokens, u1.cache_creation_input_tokens) == (prompt1, 0, 0)
    assert 1 <= u1.output_tokens <= 12

    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": "And the mountains?"}]
    raw = claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=12, system=system, messages=messages, metadata={"user_id": "anthropic-alice"}
    )
    second = raw.parse()
    u2 = second.usage
    prompt2 = _count(claude, messages, system=system)
    assert raw.headers["x-kvmem-tier"] == "hot"
    assert u2.cache_read_input_tokens >= prompt1  # turn 1's prompt and reply
    assert u2.input_tokens < prompt2 - prompt1  # only the new part is prefilled
    assert u2.cache_creation_input_tokens == 0
    # (reused + prefilled can differ from prompt2 by a few tokens: the reply's generated token ids
    # are not always how the tokenizer would split the same text)


def test_anthropic_streaming_text_and_usage(claude: anthropic.Anthropic) -> None:
    messages: list[dict] = [{"role": "user", "content": "Stream me a story."}]
    headers = {"X-Agent-ID": "anthropic-streamer"}
    with claude.messages.stream(model=MODEL, max_tokens=10, messages=messages, extra_headers=headers) as stream:
        start = next(event for event in stream if event.type == "message_start")
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    # message_start already carries the turn's input and cache counts, as the final usage does.
    prompt = _count(claude, messages)
    assert (start.message.usage.input_tokens, start.message.usage.cache_read_input_tokens) == (prompt, 0)
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (prompt, 0)
    assert final.usage.cache_creation_input_tokens == 0
    assert final.usage.output_tokens <= 10

    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    with claude.messages.stream(model=MODEL, max_tokens=10, messages=messages, extra_headers=headers) as stream:
        start2 = next(event for event in stream if event.type == "message_start")
        text2 = "".join(stream.text_stream)
        final2 = stream.get_final_message()
    assert final2.content[0].text == text2
    assert final2.usage.cache_read_input_tokens > final.usage.input_tokens
    assert final2.usage.input_tokens < _count(claude, messages) - _count(claude, messages[:1])
    started2 = start2.message.usage
    assert (started2.input_tokens, started2.cache_read_input_tokens) == (final2.usage.input_tokens,
                                                                        final2.usage.cache_read_input_tokens)


def test_anthropic_stream_event_sequence(http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "Events?"}]}
    events = []
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append(line.removeprefix("event: "))
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert set(events[3:-3]) <= {"content_block_delta"} and len(events) > 6
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_keep_alive_comments_in_a_stream_are_invisible_to_both_sdks(
    claude: anthropic.Anthropic, gpt: openai.OpenAI, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A silent stream gets ": keep-alive" comments (a long prefill); here every pause is long enough.
    monkeypatch.setattr(gateway.sse, "KEEPALIVE_S", 0.0005)
    messages = [{"role": "user", "content": "Keep me alive."}]
    greedy = {"temperature": 0}
    plain = claude.messages.create(model=MODEL, max_tokens=8, messages=messages, extra_body=greedy,
                                   extra_headers={"X-Agent-ID": "alive-plain"}).content[0].text
    with http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 8, "stream": True, **greedy,
                                                   "messages": messages},
                     headers={"X-Agent-ID": "alive-raw"}) as response:
        lines = list(response.iter_lines())
    assert ": keep-alive" in lines
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=messages, extra_body=greedy,  # type: ignore[arg-type]
                                extra_headers={"X-Agent-ID": "alive-sdk"}) as stream:
        assert "".join(stream.text_stream) == plain
    chunks = gpt.chat.completions.create(model=MODEL, max_tokens=8, messages=messages, stream=True,  # type: ignore[arg-type]
                                         temperature=0, extra_headers={"X-Agent-ID": "alive-oa"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain


def test_anthropic_stop_sequence_is_reported(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Count to ten."}]
    greedy = {"temperature": 0}  # not a parameter of this SDK's create(); the API still takes it
    full = claude.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body=greedy,
                                  extra_headers={"X-Agent-ID": "stop-a"}).content[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = claude.messages.create(model=MODEL, max_tokens=24, messages=messages, stop_sequences=[stop],
                                 extra_body=greedy, extra_headers={"X-Agent-ID": "stop-b"})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert stop not in cut.content[0].text and full.startswith(cut.content[0].text)


def test_anthropic_tools_are_rendered_by_the_chat_template(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "Sunny, 21 C"}]},
    ]
    with_tools = _count(claude, messages, tools=tools)
    assert with_tools > _count(claude, messages[:1]) + 20
    reply = claude.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=messages)  # type: ignore[arg-type]
    assert reply.usage.input_tokens == with_tools


def test_tools_on_a_model_without_a_chat_template_take_kvmem_s_generic_format(
    claude: anthropic.Anthropic, gpt: openai.OpenAI, no_template_model: Path
) -> None:
    # No template at all (the plain one): the tools go into the prompt in kvmem's generic format and the
    # reply is decoded under its grammar, so even a random model's call parses (tests/reply/test_generic_tools.py).
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    for stream in (False, True):
        kwargs = {"model": str(no_template_model), "max_tokens": 120, "tools": [{"name": "f", "input_schema": empty}],
                  "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                  "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            with claude.messages.stream(**kwargs) as events:  # type: ignore[arg-type]
                reply = events.get_final_message()
        else:
            reply = claude.messages.create(**kwargs)  # type: ignore[arg-type]
        assert reply.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in reply.content] == [("tool_use", "f", {})]  # type: ignore[union-attr]
    reply = gpt.chat.completions.create(model=str(no_template_model), max_tokens=120, tool_choice="required",
                                        parallel_tool_calls=False,
                                        tools=[{"type": "function", "function": {"name": "f", "parameters": empty}}],
                                        messages=[{"role": "user", "content": "hi"}])
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "f" and call.function.arguments == "{}"  # type: ignore[union-attr]
    # without tools the same model serves (its plain template)
    ok = claude.messages.create(model=str(no_template_model), max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.output_tokens >= 1


# -- OpenAI ---------------------------------------------------------------------


def test_openai_conversation_reports_cached_tokens_on_turn_2(gpt: openai.OpenAI) -> None:
    messages: list[dict] = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello!"}]
    raw = gpt.chat.completions.with_raw_response.create(model=MODEL, max_tokens=10, messages=messages,
                                                        user="openai-bob")
    first = raw.parse()
    assert raw.headers["x-kvmem-agent-id"] == "openai-bob"
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    reply = first.choices[0].message.content
    assert reply and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.completion_tokens <= 10
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens

    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "What next?"}]
    raw = gpt.chat.completions.with_raw_response.create(model=MODEL, max_tokens=10, messages=messages,
                                                        user="openai-bob")
    second = raw.parse()
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens
    assert int(raw.headers["x-kvmem-tokens-prefilled"]) == second.usage.prompt_tokens - cached
    assert second.usage.prompt_tokens - cached < second.usage.prompt_tokens - first.usage.prompt_tokens


def test_openai_streaming_with_usage(gpt: openai.OpenAI) -> None:
    messages: list[dict] = [{"role": "user", "content": "Stream, please."}]
    chunks = list(gpt.chat.completions.create(model=MODEL, max_tokens=8, messages=messages, stream=True,
                                              stream_options={"include_usage": True}, user="openai-stream"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and usage.completion_tokens <= 8
    assert all(c.usage is None for c in chunks[:-1])

    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    chunks = list(gpt.chat.completions.create(model=MODEL, max_tokens=8, messages=messages, stream=True,
                                              stream_options={"include_usage": True}, user="openai-stream"))
    usage2 = chunks[-1].usage
    assert usage2 is not None and usage2.prompt_tokens_details is not None
    assert (usage2.prompt_tokens_details.cached_tokens or 0) >= usage.prompt_tokens


def test_openai_seed_repeats_a_sampled_reply_and_penalties_change_it(gpt: openai.OpenAI, http: httpx.Client) -> None:
    """OpenAI's ``seed``, ``presence_penalty`` and ``frequency_penalty`` (and ``repetition_penalty``, an
    extension) are honoured, through the SDK and kvmem's agents API; out of range they are a 400."""
    messages: list[dict] = [{"role": "user", "content": "Tell me a story."}]

    def reply(user: str, **kw: Any) -> str:
        done = gpt.chat.completions.create(model=MODEL, max_tokens=12, messages=messages, user=user,
                                           **{"temperature": 1.0, **kw})
        return done.choices[0].message.content or ""

    seeded = reply("seed-a", seed=1234)
    assert reply("seed-b", seed=1234) == seeded, "another agent, the same seed: the same reply"
    assert reply("seed-c", seed=1235) != seeded
    greedy = reply("pen-a", temperature=0.0)
    assert reply("pen-b", temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0,
                 extra_body={"repetition_penalty": 1.5}) != greedy
    turn = {"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    assert http.post("/v1/agents/seed-d/messages", json=turn).json()["reply"] == seeded
    # A bias of 100 on one token all but forces it: the reply is that token, again and again.
    forced = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4,
                                                     "logit_bias": {"300": 100}, "user": "bias-a"})
    assert forced.status_code == 200, forced.text
    assert forced.json()["usage"]["completion_tokens"] == 4
    text = forced.json()["choices"][0]["message"]["content"]
    assert len(text.split()) == 4 and len(set(text.split())) == 1, text  # token 300 is " i" here
    unknown = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                      "logit_bias": {"999999": 5}})
    assert unknown.status_code == 400 and "logit_bias: token 999999" in unknown.text, unknown.text

    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("seed", 2**63), ("logit_bias", {"7": 101}), ("logit_bias", {"seven": 1})):
        refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith(field), refused.text
        refused = http.post("/v1/agents/seed-e/messages", json={"messages": messages, field: value})
        assert refused.status_code == 400 and field in refused.text, refused.text


def test_openai_stream_without_usage_ends_with_done(http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert all("usage" not in json.loads(d) for d in data[:-1])


def test_models_are_listed_for_both_sdks(gpt: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    assert next(m.id for m in gpt.models.list()) == MODEL
    assert claude.models.list().data[0].id == MODEL


# -- identity -------------------------------------------------------------------


def test_agent_identity_rules(http: httpx.Client) -> None:
    def agent(path: str, body: dict, headers: dict | None = None) -> str:
        response = http.post(path, json=body, headers=headers or {})
        assert response.status_code == 200, response.text
        return response.headers["x-kvmem-agent-id"]

    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Same start"}]}
    a = agent("/v1/messages", {**base, "system": "S"})
    b = agent("/v1/messages", {**base, "system": [{"type": "text", "text": "S"}]})
    c = agent("/v1/messages", {**base, "system": "T"})
    assert a == b != c and a.startswith("conv-") and len(a) == len("conv-") + 64
    longer = {**base, "system": "S", "messages": [*base["messages"], {"role": "assistant", "content": "r"},
                                                   {"role": "user", "content": "next"}]}
    assert agent("/v1/messages", longer) == a  # same conversation, same agent
    assert agent("/v1/messages", {**base, "metadata": {"user_id": "u1"}}) == "u1"
    assert agent("/v1/messages", {**base, "metadata": {"user_id": "u1"}}, {"X-Agent-ID": "hdr"}) == "hdr"
    oai = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": "S"},
                                                         {"role": "user", "content": "Same start"}]}
    assert agent("/v1/chat/completions", oai) == a  # same system + first message, same cache
    assert agent("/v1/chat/completions", {**oai, "user": "u2"}) == "u2"
    assert agent("/v1/chat/completions", {**oai, "user": "u2"}, {"X-Agent-ID": "hdr2"}) == "hdr2"


# -- agents API, health, metrics, OpenAPI --------------------------------------


def test_agent_api_turns_listing_and_forget(http: httpx.Client) -> None:
    turn = {"messages": [{"role": "user", "content": "Remember the number 7."}], "max_tokens": 6}
    first = http.post("/v1/agents/carol/messages", json=turn)
    assert first.status_code == 200, first.text
    r1 = first.json()
    assert r1["agent_id"] == "carol" and r1["usage"]["tier"] == "cold" and r1["reply"]
    assert set(r1["usage"]) >= {"tokens_reused", "tokens_prefilled", "tokens_generated", "tier", "match",
                                "queue_wait_ms", "ttft_ms", "decode_tps"}
    convo = [*turn["messages"], {"role": "assistant", "content": r1["reply"]}, {"role": "user", "content": "Which?"}]
    events: list[tuple[str, str]] = []
    with http.stream("POST", "/v1/agents/carol/messages", json={"messages": convo, "max_tokens": 6,
                                                                 "stream": True}) as response:
        name = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, line.removeprefix("data: ")))
    assert {n for n, _ in events[:-1]} == {"delta"} and events[-1][0] == "done"
    done = json.loads(events[-1][1])
    assert "".join(json.loads(d)["text"] for _, d in events[:-1]) == done["reply"]
    assert done["usage"]["tier"] == "hot" and done["usage"]["tokens_reused"] > 0

    info = http.get("/v1/agents/carol").json()
    assert info["id"] == "carol" and info["cached_tokens"] > 0 and info["hot"]
    assert "carol" in [a["id"] for a in http.get("/v1/agents").json()["data"]]
    assert http.delete("/v1/agents/carol").json() == {"id": "carol", "object": "agent", "deleted": True}
    assert http.delete("/v1/agents/carol").status_code == 404
    again = http.post("/v1/agents/carol/messages", json=turn).json()
    assert again["usage"]["tier"] == "cold"


def test_agent_api_raw_prompt_and_errors(http: httpx.Client) -> None:
    ok = http.post("/v1/agents/dave/messages", json={"prompt": "Once upon a time", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["tokens_prefilled"] > 0
    both = http.post("/v1/agents/dave/messages", json={"prompt": "x", "messages": []})
    assert both.status_code == 400 and both.json()["error"]["type"] == "invalid_request"
    assert http.get("/v1/agents/nobody-here").status_code == 404
    bad_id = http.get("/v1/agents/%20")
    assert bad_id.status_code == 400 and bad_id.json()["error"]["code"] == "invalid_agent_id"


def test_health_metrics_and_openapi(server: ServerThread, http: httpx.Client) -> None:
    health = httpx.get(server.url + "/healthz")  # no API key needed
    assert health.status_code == 200 and health.json()["model"] == MODEL
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ("kvmem_requests_total", "kvmem_tokens_reused_total", "kvmem_tokens_prefilled_total",
                 "kvmem_tokens_generated_total", 'kvmem_cache_hits_total{tier="hot"}',
                 'kvmem_ttft_seconds_bucket{le="+Inf"}', "kvmem_queue_wait_seconds_count", "kvmem_batch_size",
                 "kvmem_memory_active_bytes", "kvmem_http_requests_total"):
        assert name in text, name
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/models",
                 "/v1/agents", "/v1/agents/{agent_id}", "/v1/agents/{agent_id}/messages", "/healthz", "/metrics"):
        assert path in spec["paths"], path
    assert "MessagesRequest" in spec["components"]["schemas"]


def test_a_missing_api_key_is_a_401_in_each_shape(server: ServerThread) -> None:
    response = httpx.post(server.url + "/v1/messages", json={})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


# -- a client that leaves mid-stream --------------------------------------------


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_client_disconnect_cancels_generation_and_keeps_the_cache_consistent(http: httpx.Client) -> None:
    cancelled = _metric(http, "kvmem_requests_cancelled_total")
    essay = "Please write a very long essay about rivers, mountains, cities and the sea. " * 20
    body = {"model": MODEL, "max_tokens": 256, "stream": True, "messages": [{"role": "user", "content": essay}]}
    prompt_tokens = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]})
    prompt_tokens = prompt_tokens.json()["input_tokens"]
    with http.stream("POST", "/v1/messages", json=body, headers={"X-Agent-ID": "leaver"}) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += line.startswith("event: content_block_delta")
            if deltas >= 3:
                break  # leave: closing the response drops the connection
    deadline = time.monotonic() + 30
    while _metric(http, "kvmem_requests_cancelled_total") <= cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert _metric(http, "kvmem_batch_size") == 0 and _metric(http, "kvmem_prefilling") == 0
    assert _metric(http, "kvmem_waiting") == 0
    info = http.get("/v1/agents/leaver").json()
    print("cached after disconnect:", info["cached_tokens"], "prompt:", prompt_tokens)
    # the partial turn is cached: the prompt and the reply tokens generated before the cancel, not 256
    assert prompt_tokens <= info["cached_tokens"] < prompt_tokens + 255
    # the agent serves its next turn from that cache (the prompt is most of it: a PARTIAL match)
    again = http.post("/v1/messages", json={**body, "stream": False, "max_tokens": 4},
                      headers={"X-Agent-ID": "leaver"})
    assert again.status_code == 200, again.text
    assert again.headers["x-kvmem-tier"] == "hot", again.headers
    usage = again.json()["usage"]
    assert usage["cache_read_input_tokens"] >= prompt_tokens - 2 and usage["input_tokens"] <= 2


def test_extra_routes_share_the_middleware_and_the_openapi_document(server: ServerThread, http: httpx.Client) -> None:
    response = http.get("/v1/ping")
    assert response.status_code == 200 and response.json()["pong"] and response.headers["request-id"]
    assert httpx.get(server.url + "/v1/ping").status_code == 401  # the API key applies
    spec = http.get("/openapi.json").json()
    assert spec["paths"]["/v1/ping"]["get"]["summary"] == "An extra route (the hook scenarios use)."


def test_a_client_that_leaves_a_non_streaming_request_cancels_it(server: ServerThread, http: httpx.Client) -> None:
    cancelled = _metric(http, "kvmem_requests_cancelled_total")
    # Longer than the client waits on any device: 256 tokens took under 0.3 s on an H200.
    # tiny-llama samples no end of turn here: the reply runs to max_tokens unless cancelled.
    body = {"model": MODEL, "max_tokens": 2400, "messages": [{"role": "user", "content": "Go on and on. " * 200}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY, "X-Agent-ID": "impatient"},
                   timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 30
    while _metric(http, "kvmem_requests_cancelled_total") <= cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert _metric(http, "kvmem_batch_size") == 0


def _tool(name: str, what: str, **properties: str) -> dict[str, Any]:
    return {"name": name, "description": what,
            "input_schema": {"type": "object", "required": list(properties)[:1],
                             "properties": {k: {"type": "string", "description": v} for k, v in properties.items()}}}


CODING_TOOLS = [
    _tool("Bash", "Run a shell command in the working directory and return its output.",
          command="the command line", description="what it does, in a few words"),
    _tool("Read", "Read a file from the local filesystem.", file_path="absolute path", offset="first line",
          limit="number of lines"),
    _tool("Write", "Write a file to the local filesystem, replacing it.", file_path="absolute path",
          content="the new contents"),
    _tool("Edit", "Replace one exact string in a file.", file_path="absolute path", old_string="text to replace",
          new_string="replacement"),
    _tool("Glob", "Find files by glob pattern.", pattern="a glob such as **/*.py", path="directory to search"),
    _tool("Grep", "Search file contents with a regular expression.", pattern="the regex", path="file or folder",
          glob="file filter"),
    _tool("TodoWrite", "Update the session's task list.", todos="the list as JSON"),
    _tool("WebFetch", "Fetch a URL and answer a question about it.", url="the URL", prompt="the question"),
]


def test_a_claude_code_shaped_session_reuses_the_agent_cache_every_turn(claude: anthropic.Anthropic) -> None:
    """System as blocks with cache_control, a realistic tools list, tool_use / tool_result history,
    anthropic-beta / anthropic-version headers, count_tokens before each turn, thinking requested."""
    headers = {"X-Agent-ID": "claude-code", "anthropic-beta": "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14"}
    system = [
        {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "<env>\nWorking directory: /repo\nIs directory a git repo: Yes\nPlatform: linux\n</env>"},
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "The test in tests/test_math.py fails. Fix it."}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me read the test first."},
            {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/repo/tests/test_math.py"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "def test_add():\n    assert add(2, 2) == 5\n"},
            {"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}},
        ]},
    ]
    follow_ups = ["Run the tests now.", "Summarize what you changed."]
    seen = []
    for turn in range(1 + len(follow_ups)):
        counted = claude.messages.count_tokens(model=MODEL, system=system, tools=CODING_TOOLS,  # type: ignore[arg-type]
                                               messages=messages, extra_headers=headers).input_tokens  # type: ignore[arg-type]
        raw = claude.messages.with_raw_response.create(
            model=MODEL, max_tokens=12, system=system, tools=CODING_TOOLS, messages=messages,  # type: ignore[arg-type]
            # Greedy: at Anthropic's default temperature (1) the reply was drawn from the process's random stream,
            # so its text, and how far its re-tokenization parts from the tokens kvmem generated (the count below
            # allows a few), depended on every test that ran before in the process (25 tokens once, a fresh clone).
            thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0}, extra_headers=headers)
        reply = raw.parse()
        # thinking is declined cleanly: an ordinary answer, no thinking blocks
        assert [block.type for block in reply.content] == ["text"]
        usage = reply.usage
        seen.append((raw.headers["x-kvmem-tier"], usage.input_tokens, usage.cache_read_input_tokens, counted))
        # every prompt token is either prefilled or read (a reply's own token split may differ by a few)
        assert abs(usage.input_tokens + usage.cache_read_input_tokens - counted) <= 3, seen
        if turn:
            previous = seen[-2]
            assert raw.headers["x-kvmem-tier"] == "hot", seen
            assert usage.cache_read_input_tokens >= previous[1] + previous[2], seen  # all of the last prompt...
            assert usage.input_tokens < 40, seen  # ...and only the new reply and message prefilled
        if turn < len(follow_ups):
            messages += [{"role": "assistant", "content": [{"type": "text", "text": reply.content[0].text}]},
                         {"role": "user", "content": [{"type": "text", "text": follow_ups[turn],
                                                       "cache_control": {"type": "ephemeral"}}]}]
    assert seen[0][0] == "cold" and seen[0][3] > 300  # the tools list is most of the first prompt
