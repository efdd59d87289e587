"""Tool calls out, end to end: both official SDKs and kvmem's own APIs on a real hypercorn server.

The model is tiny-qwen2 (random weights, a Qwen-style template with tools, mlx-lm's
``json_tools`` parser). It cannot write a tool call by itself, so the tests that need one
force its reply (:class:`scripted_engine.ScriptedEngine`: the real model runs, only the
sampled tokens are dictated). Every loop is tool call -> tool result -> answer, and the
tool-result turn must be an EXTEND of the agent's cache: its ``usage`` reads back every
token of the first turn, the call included.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from conftest import models_dir
from gateway_helpers import openai_stream_choices
from scripted_engine import ScriptedEngine

from actors import open_runtime
from gateway.testing import ServerThread
from runtime.config import Config

MODEL = "tiny-qwen2"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLAUDE_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA}]
GPT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": SCHEMA}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _engine() -> ScriptedEngine:
    return ScriptedEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention="auto")


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return _engine()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, engine: ScriptedEngine) -> Iterator[ServerThread]:
    config = Config(model=MODEL, port=0, home=str(models_dir().parent), cache_dir=str(tmp_path_factory.mktemp("c")),
                    max_tokens_limit=256, budget_mb=256, hot_budget_mb=64, graceful_timeout_s=2)
    with ServerThread(config, engine=engine) as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_script(engine: ScriptedEngine) -> Iterator[None]:
    engine.reset()
    yield
    engine.reset()


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gpt(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=60)


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


# -- OpenAI ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_loop_through_the_sdk_extends_the_cache(
    gpt: openai.OpenAI, engine: ScriptedEngine, stream: bool
) -> None:
    agent = f"oa-loop-{stream}"
    engine.script("Let me look.\n" + CALL, "It is sunny in Paris.")
    messages: list[dict[str, Any]] = list(ASK)
    options: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "temperature": 0, "tools": GPT_TOOLS, "user": agent}
    if stream:
        with gpt.chat.completions.stream(messages=messages, stream_options={"include_usage": True},  # type: ignore[arg-type]
                                         **options) as events:
            first = events.get_final_completion()
    else:
        first = gpt.chat.completions.create(messages=messages, **options)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    u1 = first.usage
    assert u1 is not None and u1.completion_tokens == len(engine.lm.tokenize("Let me look.\n" + CALL)[0]) + 1

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    if stream:
        chunks = list(gpt.chat.completions.create(messages=messages, stream=True,  # type: ignore[arg-type]
                                                  stream_options={"include_usage": True}, **options))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        u2, match = chunks[-1].usage, chunks[-1].model_extra["kvmem"]["match"]  # type: ignore[index]
    else:
        raw = gpt.chat.completions.with_raw_response.create(messages=messages, **options)  # type: ignore[arg-type]
        second = raw.parse()
        answer, finish, u2 = second.choices[0].message.content, second.choices[0].finish_reason, second.usage
        match = raw.headers["x-kvmem-match"]
    assert (answer, finish) == ("It is sunny in Paris.", "stop")
    assert u2 is not None and u2.prompt_tokens_details is not None
    # EXTEND: turn 1's prompt and every generated token but the end-of-turn one are read back.
    assert match == "extend"
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1
    assert u2.prompt_tokens - (u2.prompt_tokens_details.cached_tokens or 0) < 50  # the tool result and the turn markers


def test_openai_stream_sends_a_tool_call_as_a_start_chunk_then_its_arguments(
    http: httpx.Client, engine: ScriptedEngine
) -> None:
    engine.script(CALL)
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "tools": GPT_TOOLS, "messages": ASK}
    deltas = openai_stream_choices(http, body)
    calls = [c["delta"]["tool_calls"] for c in deltas if "tool_calls" in c["delta"]]
    assert calls[0] == [{"index": 0, "id": calls[0][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]
    assert calls[1] == [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    assert len(calls) == 2 and all(not c["delta"].get("content") for c in deltas)  # no markup as content
    assert deltas[-1]["finish_reason"] == "tool_calls"


# -- Anthropic ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_loop_through_the_sdk_extends_the_cache(
    claude: anthropic.Anthropic, engine: ScriptedEngine, stream: bool
) -> None:
    engine.script("Let me look.\n" + CALL, "It is sunny in Paris.")
    options: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "tools": CLAUDE_TOOLS, "extra_body": {"temperature": 0},
                               "metadata": {"user_id": f"an-loop-{stream}"}}
    messages: list[dict[str, Any]] = list(ASK)
    if stream:
        with claude.messages.stream(messages=messages, **options) as events:  # type: ignore[arg-type]
            first = events.get_final_message()
    else:
        first = claude.messages.create(messages=messages, **options)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Let me look."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_"), use.id  # Anthropic's spelling of a tool call's id

    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    if stream:
        with claude.messages.stream(messages=messages, **options) as events:  # type: ignore[arg-type]
            second = events.get_final_message()
    else:
        second = claude.messages.create(messages=messages, **options)  # type: ignore[arg-type]
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert second.content[0].text == "It is sunny in Paris."  # type: ignore[union-attr]
    u1, u2 = first.usage, second.usage
    # EXTEND: all of turn 1 is read (its prompt: what it read, from another agent too, and what it prefilled)
    assert u2.cache_read_input_tokens == u1.cache_read_input_tokens + u1.input_tokens + u1.output_tokens - 1
    assert u2.input_tokens < 50


def test_anthropic_stream_opens_a_tool_use_block_with_an_input_json_delta(
    http: httpx.Client, engine: ScriptedEngine
) -> None:
    engine.script("Checking.\n" + CALL)
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "tools": CLAUDE_TOOLS, "messages": ASK}
    events = []
    with http.stream("POST", "/v1/messages", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    kinds = [(e["type"], e.get("index")) for e in events if e["type"] != "content_block_delta"]
    assert kinds == [("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_stop", 1), ("message_delta", None),
                     ("message_stop", None)]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[0] == {"type": "text", "text": ""}
    assert starts[1] == {"type": "tool_use", "id": starts[1]["id"], "name": "get_weather", "input": {}}
    assert starts[1]["id"].startswith("toolu_"), starts[1]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "Checking."
    assert [d for d in deltas if d["type"] == "input_json_delta"] == [
        {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


# -- tool_choice ----------------------------------------------------------------


def test_tool_choice_required_and_named_make_the_model_open_a_call(
    gpt: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    # The random model cannot finish a call, so it comes back as text: the forced opening shows.
    opening = '<tool_call>\n{"name": "get_weather", "arguments": {'
    for choice, starts in (("required", "<tool_call>"),
                           ({"type": "function", "function": {"name": "get_weather"}}, opening)):
        reply = gpt.chat.completions.create(model=MODEL, max_tokens=24, messages=ASK, tools=GPT_TOOLS,  # type: ignore[arg-type]
                                            tool_choice=choice, user="choice-oa")  # type: ignore[arg-type]
        assert (reply.choices[0].message.content or "").startswith(starts)
    for choice, starts in (({"type": "any"}, "<tool_call>"), ({"type": "tool", "name": "get_weather"}, opening)):
        message = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, tools=CLAUDE_TOOLS,  # type: ignore[arg-type]
                                         tool_choice=choice, metadata={"user_id": "choice-an"})  # type: ignore[arg-type]
        assert message.content[0].text.startswith(starts)  # type: ignore[union-attr]


def test_tool_choice_none_keeps_a_model_that_wants_to_call_from_calling(
    gpt: openai.OpenAI, engine: ScriptedEngine
) -> None:
    engine.boost = (engine.lm.tokenize("<tool_call>")[0][0],)  # the marker now wins every step
    options: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": GPT_TOOLS,
                               "user": "choice-none"}
    wants = gpt.chat.completions.create(**options)
    assert (wants.choices[0].message.content or "").startswith("<tool_call>")
    banned = gpt.chat.completions.create(tool_choice="none", **options)
    assert "<tool_call>" not in (banned.choices[0].message.content or "")
    # The prompt is the same, tool definitions included, so the cache still serves it (all but the last token).
    assert banned.usage is not None and banned.usage.prompt_tokens_details is not None
    assert banned.usage.prompt_tokens_details.cached_tokens == banned.usage.prompt_tokens - 1


def test_tool_choices_that_cannot_be_honoured_are_400s_in_each_apis_shape(http: httpx.Client) -> None:
    oa = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": GPT_TOOLS}
    an = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": CLAUDE_TOOLS}
    cases = [
        ("/v1/chat/completions", {**oa, "tool_choice": "sometimes"}, "tool_choice"),
        ("/v1/chat/completions", {**oa, "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "allowed"),
        ("/v1/chat/completions", {**oa, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ("/v1/chat/completions", {**oa, "tool_choice": {"type": "function", "function": "get_weather"}}, "name"),
        ("/v1/chat/completions", {**oa, "tools": None, "tool_choice": "required"}, "no tools"),
        ("/v1/messages", {**an, "tool_choice": {"type": "tool"}}, "name"),
        ("/v1/messages", {**an, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ("/v1/messages", {**an, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ]
    for path, body, words in cases:
        for stream in (False, True):
            response = http.post(path, json={**body, "stream": stream})
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and words in error["message"], error


# -- kvmem's own APIs ---------------------------------------------------------


def test_agent_http_api_streams_tool_call_events(http: httpx.Client, engine: ScriptedEngine) -> None:
    engine.script(CALL)
    body = {"messages": ASK, "tools": GPT_TOOLS, "max_tokens": 64, "stream": True}
    events: list[tuple[str, Any]] = []
    with http.stream("POST", "/v1/agents/http-tools/messages", json=body) as response:
        name = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    calls = [data for name, data in events if name == "tool_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert not [data for name, data in events if name == "delta" and data["text"]]
    done = events[-1][1]
    assert events[-1][0] == "done" and done["finish_reason"] == "tool_calls" and done["reply"] == CALL
    assert done["content"] == "" and done["tool_calls"] == calls


def test_direct_api_returns_tool_calls_and_their_result_turn_extends() -> None:
    async def main() -> None:
        engine = _engine()
        with tempfile.TemporaryDirectory() as home:
            async with open_runtime(model=MODEL, home=home, engine=engine, handle_signals=False) as rt:
                alice = rt.agent("alice")
                engine.script("Let me look.\n" + CALL, "Sunny.")
                first = await alice.send(ASK, tools=GPT_TOOLS, max_tokens=64)
                assert (first.content, first.finish_reason, first.reply) == ("Let me look.", "tool_calls",
                                                                             "Let me look.\n" + CALL)
                [call] = first.tool_calls
                assert (call.name, call.input()) == ("get_weather", {"city": "Paris"})
                messages = [*ASK, first.assistant_message(),
                            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
                async with alice.stream(messages, tools=GPT_TOOLS, max_tokens=64) as stream:
                    items = [item async for item in stream.events()]
                assert "".join(i for i in items if isinstance(i, str)) == "Sunny."
                usage = stream.result.usage if stream.result else None
                assert usage is not None and usage.match == "extend"
                assert usage.tokens_reused == first.usage.tokens_reused + first.usage.tokens_prefilled + \
                    first.usage.tokens_generated - 1

    trio.run(main)
