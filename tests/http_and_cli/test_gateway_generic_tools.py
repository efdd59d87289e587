"""Tools and structured output on kvmem-default through both official SDKs (issue 29, items 3, 4 and 6).

kvmem-default (SmolLM2-135M-Instruct) has no tool syntax in its chat template, so its
tools travel in kvmem's generic format and its replies are decoded under a grammar
(``runtime.reply.generic_tools``). Nothing is scripted here: the real model writes every call.
What it answers is not the point; that every reply is well-formed and that the tool
result turn extends the cache (``usage`` reads back every token of the call turn) is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from gateway_helpers import default_model_server, openai_stream_choices

from gateway.testing import ServerThread
from runtime.model.default_model import DEFAULT_MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
GPT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": WEATHER}}]
CLAUDE_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> Iterator[ServerThread]:
    with default_model_server(tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="module")
def gpt(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=120)


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _valid_weather(arguments: dict[str, Any]) -> bool:
    return isinstance(arguments.get("city"), str) and set(arguments) <= {"city", "unit"} and \
        arguments.get("unit", "celsius") in ("celsius", "fahrenheit")


# -- OpenAI ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_loop_on_the_default_model_extends_the_cache(gpt: openai.OpenAI, stream: bool) -> None:
    options: dict[str, Any] = {"model": DEFAULT_MODEL, "max_tokens": 48, "temperature": 0, "tools": GPT_TOOLS,
                               "user": f"generic-oa-{stream}"}
    messages: list[dict[str, Any]] = list(ASK)
    if stream:
        with gpt.chat.completions.stream(messages=messages, tool_choice="required",  # type: ignore[arg-type]
                                         stream_options={"include_usage": True}, **options) as events:
            first = events.get_final_completion()
    else:
        first = gpt.chat.completions.create(messages=messages, tool_choice="required", **options)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert all(_valid_weather(json.loads(c.function.arguments)) for c in calls)

    messages += [choice.message.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": c.id, "content": "Sunny, 21 C"} for c in calls)]
    raw = gpt.chat.completions.with_raw_response.create(messages=messages, **{**options, "max_tokens": 12})  # type: ignore[arg-type]
    second = raw.parse()
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in second.choices[0].message.tool_calls or []:
        assert _valid_weather(json.loads(call.function.arguments))
    u1, u2 = first.usage, second.usage
    assert u1 is not None and u2 is not None and u2.prompt_tokens_details is not None
    assert raw.headers["x-kvmem-match"] == "extend"
    # every token of the call turn is read back but its end-of-turn token, which the template re-renders
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1


def test_openai_stream_of_a_generic_call_is_a_start_chunk_then_its_arguments(http: httpx.Client) -> None:
    # Greedy: sampled at OpenAI's default temperature a call once ran past max_tokens (finish_reason length).
    body = {"model": DEFAULT_MODEL, "max_tokens": 48, "stream": True, "tools": GPT_TOOLS, "messages": ASK,
            "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}
    deltas = openai_stream_choices(http, body)
    calls = [c["delta"]["tool_calls"] for c in deltas if "tool_calls" in c["delta"]]
    assert calls[0] == [{"index": 0, "id": calls[0][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]
    assert len(calls) == 2 and calls[1][0]["index"] == 0  # parallel_tool_calls false: one call
    assert _valid_weather(json.loads(calls[1][0]["function"]["arguments"]))
    assert all(not c["delta"].get("content") for c in deltas)  # no markup as content
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_json_schema_response_format_gives_a_valid_object(gpt: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Invent a person."}]
    if stream:
        chunks = list(gpt.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=40,  # type: ignore[arg-type]
                                                  response_format=fmt, stream=True, temperature=0))  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = gpt.chat.completions.create(model=DEFAULT_MODEL, messages=ask, max_tokens=40,  # type: ignore[arg-type]
                                            response_format=fmt, temperature=0)  # type: ignore[arg-type]
        text = reply.choices[0].message.content or ""
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)


@pytest.mark.parametrize("how", ["json_schema", "response_format.schema"])
def test_llama_cpps_json_schema_fields_give_a_valid_object(http: httpx.Client, how: str) -> None:
    """llama.cpp's top-level ``json_schema`` and ``response_format: {"type": "json_object", "schema": ...}`` were
    ignored with a 200 (issue 59): each now constrains the reply as a ``json_schema`` response format does."""
    body: dict[str, Any] = {"model": DEFAULT_MODEL, "max_tokens": 40, "temperature": 0,
                            "messages": [{"role": "user", "content": "Invent a person."}]}
    if how == "json_schema":
        body["json_schema"] = PERSON
    else:
        body["response_format"] = {"type": "json_object", "schema": PERSON}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    value = json.loads(response.json()["choices"][0]["message"]["content"])
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_llama_cpps_gbnf_grammar_constrains_the_reply(http: httpx.Client, stream: bool) -> None:
    body = {"model": DEFAULT_MODEL, "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Is the sea salty? Answer yes or no."}],
            "grammar": 'root ::= ("yes" | "no") "."'}
    if stream:
        text = "".join(c["delta"].get("content") or "" for c in openai_stream_choices(http, body))
    else:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
    assert text in ("yes.", "no."), text


@pytest.mark.parametrize(("extra", "param"), [
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": PERSON}, "grammar"),
    ({"json_schema": PERSON, "response_format": {"type": "json_object"}}, "json_schema"),
    ({"json_schema": {"type": "object", "properties": {"x": {"type": "banana"}}}}, "json_schema"),
    ({"grammar": 'root ::= "a"', "tools": GPT_TOOLS}, None),
])
def test_a_grammar_or_schema_that_cannot_be_used_is_a_400_naming_it(http: httpx.Client, extra: dict[str, Any],
                                                                    param: str | None) -> None:
    body = {"model": DEFAULT_MODEL, "max_tokens": 4, "messages": ASK, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param, response.json()


def test_openai_refuses_a_schema_it_cannot_use_naming_the_field(http: httpx.Client) -> None:
    bad = {"type": "object", "properties": {"city": {"type": "banana"}}}
    body = {"model": DEFAULT_MODEL, "max_tokens": 8, "messages": ASK,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools[0].function.parameters" and "banana" in error["message"]
    body = {"model": DEFAULT_MODEL, "max_tokens": 8, "messages": ASK, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format.json_schema.schema"
    body = {"model": DEFAULT_MODEL, "max_tokens": 8, "messages": ASK, "response_format": {"type": "xml"}}
    assert http.post("/v1/chat/completions", json=body).status_code == 400


@pytest.mark.parametrize(("tool", "field"), [
    ({"type": "function", "function": {"parameters": WEATHER}}, "name"),
    ({"type": "function", "function": {"name": "f", "parameters": "city: str"}}, "parameters"),
    ({"type": "function"}, "function"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}},
     "tools[0].function.parameters"),
])
def test_openai_refuses_a_malformed_tool_definition_naming_it(http: httpx.Client, tool: dict[str, Any], field: str) -> None:
    response = http.post("/v1/chat/completions", json={"model": DEFAULT_MODEL, "max_tokens": 4, "messages": ASK,
                                                       "tools": [tool]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and field in error["message"], error


@pytest.mark.parametrize(("tool", "field"), [
    ({"input_schema": WEATHER}, "name"),
    ({"name": "f", "input_schema": "city: str"}, "input_schema"),
    ({"name": "f"}, "tools[0].input_schema"),
    ({"name": "f", "input_schema": {"type": "object", "properties": {"x": {"enum": 3}}}}, "tools[0].input_schema"),
])
def test_anthropic_refuses_a_malformed_tool_definition_naming_it(http: httpx.Client, tool: dict[str, Any],
                                                                 field: str) -> None:
    response = http.post("/v1/messages", json={"model": DEFAULT_MODEL, "max_tokens": 4, "messages": ASK,
                                               "tools": [tool]})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"], body


def test_the_agents_api_takes_a_response_format(http: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    response = http.post("/v1/agents/json-agent/messages", json={
        "messages": [{"role": "user", "content": "Invent a person."}], "max_tokens": 40, "response_format": fmt})
    assert response.status_code == 200, response.text
    value = json.loads(response.json()["content"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}
    response = http.post("/v1/agents/json-agent/messages", json={"prompt": "hi", "response_format": bad})
    assert response.status_code == 400 and "banana" in response.json()["error"]["message"]


# -- Anthropic ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_loop_on_the_default_model_extends_the_cache(claude: anthropic.Anthropic, stream: bool) -> None:
    options: dict[str, Any] = {"model": DEFAULT_MODEL, "max_tokens": 48, "tools": CLAUDE_TOOLS,
                               "extra_body": {"temperature": 0}, "metadata": {"user_id": f"generic-an-{stream}"}}
    messages: list[dict[str, Any]] = list(ASK)
    if stream:
        with claude.messages.stream(messages=messages, tool_choice={"type": "any"}, **options) as events:  # type: ignore[arg-type]
            first = events.get_final_message()
    else:
        first = claude.messages.create(messages=messages, tool_choice={"type": "any"}, **options)  # type: ignore[arg-type]
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and [b.type for b in first.content] == ["tool_use"] * len(uses)
    assert all(u.name == "get_weather" and _valid_weather(u.input) for u in uses)  # type: ignore[arg-type]

    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 21 C"}
                                              for u in uses]}]
    options["max_tokens"] = 12  # the answer's words are not the point: its usage is
    if stream:
        with claude.messages.stream(messages=messages, **options) as events:  # type: ignore[arg-type]
            second = events.get_final_message()
    else:
        second = claude.messages.create(messages=messages, **options)  # type: ignore[arg-type]
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    u1, u2 = first.usage, second.usage
    # EXTEND: all of turn 1 is read (its prompt: what it read, from another agent too, and what it prefilled)
    assert u2.cache_read_input_tokens == u1.cache_read_input_tokens + u1.input_tokens + u1.output_tokens - 1


def test_anthropic_stream_of_a_generic_call_opens_a_tool_use_block(http: httpx.Client) -> None:
    # Greedy, with room to spare: a sampled call can ramble past a tight max_tokens and end as text.
    body = {"model": DEFAULT_MODEL, "max_tokens": 96, "temperature": 0, "stream": True, "tools": CLAUDE_TOOLS,
            "messages": ASK, "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    events = []
    with http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ")]
    kinds = [(e["type"], e.get("index")) for e in events if e["type"] != "content_block_delta"]
    assert kinds == [("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_stop", 0),
                     ("message_delta", None), ("message_stop", None)]
    start = next(e["content_block"] for e in events if e["type"] == "content_block_start")
    assert start == {"type": "tool_use", "id": start["id"], "name": "get_weather", "input": {}}
    [delta] = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert delta["type"] == "input_json_delta" and _valid_weather(json.loads(delta["partial_json"]))
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_output_config_gives_a_valid_object_and_bad_schemas_are_named(
    claude: anthropic.Anthropic, http: httpx.Client
) -> None:
    reply = claude.messages.create(model=DEFAULT_MODEL, max_tokens=40, messages=[{"role": "user", "content": "Invent a person."}],
                                   extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema",
                                                                                               "schema": PERSON}}})
    value = json.loads(reply.content[0].text)  # type: ignore[union-attr]
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    body = {"model": DEFAULT_MODEL, "max_tokens": 8, "messages": ASK,
            "tools": [{"name": "f", "input_schema": {"type": "object", "required": "city"}}]}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["message"].startswith("tools[0].input_schema: ")
