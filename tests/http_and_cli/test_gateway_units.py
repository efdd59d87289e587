"""Gateway pieces without a server: identity, error shapes, SSE framing, imports (configuration: test_config.py)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from actors.messages_agent import ChatMessage, chat_messages
from gateway.errors import ApiError, error_dict, from_decode_error
from gateway.context import conversation_id, resolve_agent_id
from gateway.schemas_anthropic import messages_decoder
from gateway.sse import sse, sse_data
from runtime.config import Config

ROOT = Path(__file__).resolve().parents[2]


# -- identity --------------------------------------------------------------------


def test_conversation_id_is_a_full_sha256_of_system_and_first_user_message() -> None:
    msgs = chat_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    cid = conversation_id("sys", msgs)
    assert re.fullmatch(r"conv-[0-9a-f]{64}", cid)
    expected = hashlib.sha256(msgspec.json.encode({"system": "sys", "first_user": "hi"})).hexdigest()
    assert cid == "conv-" + expected
    assert conversation_id("sys", [*msgs, ChatMessage(role="user", content="later")]) == cid
    assert conversation_id("sys2", msgs) != cid and conversation_id("sys", [ChatMessage(role="user", content="h")]) != cid
    # no concatenation ambiguity between the two fields
    assert conversation_id("ab", [ChatMessage(role="user", content="c")]) != conversation_id(
        "a", [ChatMessage(role="user", content="bc")])


def test_explicit_identity_wins_over_the_hash() -> None:
    msgs = [ChatMessage(role="user", content="hi")]
    kw = {"user_param": "user", "system": None, "messages": msgs}
    assert resolve_agent_id({"x-agent-id": "h"}, user_field="u", **kw) == ("h", "X-Agent-ID")  # type: ignore[arg-type]
    assert resolve_agent_id({}, user_field="u", **kw) == ("u", "user")  # type: ignore[arg-type]
    hashed = resolve_agent_id({}, user_field=None, **kw)  # type: ignore[arg-type]
    assert hashed.agent_id.startswith("conv-") and hashed.param == "messages"


async def test_an_id_that_cannot_name_a_cache_is_a_400_naming_where_it_came_from(tmp_path) -> None:
    from actors import open_runtime
    from fake_engine import FakeEngine
    from runtime.config import Config
    from gateway.context import Gateway

    async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(), fsync=False, handle_signals=False) as rt:
        gw = Gateway(rt=rt, config=Config(model="fake-a"), models=("fake-a",))
        assert gw.agent("fine").agent_id == "fine"
        with pytest.raises(ApiError) as bad:
            gw.agent("a\x00b", param="X-Agent-ID")
    assert bad.value.status == 400 and bad.value.param == "X-Agent-ID" and bad.value.code == "invalid_agent_id"


# -- errors ------------------------------------------------------------------------


def test_validation_errors_name_their_json_path() -> None:
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    with pytest.raises(msgspec.ValidationError) as exc:
        messages_decoder.decode(json.dumps(body))
    error = from_decode_error(exc.value)
    assert error.status == 400 and error.param == "messages[0].content[0].text"
    assert error.message.startswith("messages[0].content[0].text: ")
    with pytest.raises(msgspec.DecodeError) as malformed:
        messages_decoder.decode(b"{")
    assert from_decode_error(malformed.value).code == "invalid_json"


def test_error_shapes_per_api() -> None:
    error = ApiError(404, "not_found", "nope", param="model", code="model_not_found")
    assert error_dict(error, "anthropic", request_id="r") == {
        "type": "error", "error": {"type": "not_found_error", "message": "nope"}, "request_id": "r"}
    assert error_dict(error, "openai", request_id="r") == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert error_dict(error, "kvmem", request_id="r")["error"]["type"] == "not_found"  # type: ignore[index]


def test_sse_framing() -> None:
    assert sse("ping", {"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert sse_data(b"[DONE]") == b"data: [DONE]\n\n"


# -- layering ----------------------------------------------------------------------


def test_gateway_never_imports_mlx() -> None:
    for path in (ROOT / "gateway").glob("*.py"):
        source = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+mlx", source, re.MULTILINE), path
    modules = sorted(f"gateway.{p.stem}" for p in (ROOT / "gateway").glob("*.py") if p.stem != "__init__")
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules if m.startswith('mlx')))"
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_model_names_unknown_ones_are_404_unless_any_model_is_accepted() -> None:
    from gateway.context import Gateway

    strict = Gateway(rt=None, config=Config(), models=("m", "other"))  # type: ignore[arg-type]
    assert strict.model_for(None) is None and strict.model_for("m") is None and strict.model_for("other") == "other"
    with pytest.raises(ApiError) as unknown:
        strict.model_for("claude-x")
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
    lenient = Gateway(rt=None, config=Config(accept_any_model=True), models=("m",))  # type: ignore[arg-type]
    assert lenient.model_for("claude-x") is None


async def test_a_silent_event_stream_gets_keep_alive_comments(autojump_clock, monkeypatch) -> None:
    import trio

    import gateway.sse
    from gateway.sse import EventStreamResponse

    monkeypatch.setattr(gateway.sse, "KEEPALIVE_S", 1.0)
    sent: list[tuple[float, bytes]] = []

    async def receive():
        await trio.sleep_forever()

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append((trio.current_time(), message["body"]))

    async def producer(emit):
        await emit(b"data: 1\n\n")
        await trio.sleep(3.5)  # a long prefill
        await emit(b"data: 2\n\n")
        await trio.sleep(0.5)  # shorter than the interval: no comment
        await emit(b"data: 3\n\n")

    start = trio.current_time()
    await EventStreamResponse(producer)({"type": "http"}, receive, send)
    bodies = [b for _t, b in sent]
    assert bodies == [b"data: 1\n\n", *[b": keep-alive\n\n"] * 3, b"data: 2\n\n", b"data: 3\n\n", b""]
    assert [round(t - start, 1) for t, b in sent if b.startswith(b":")] == [1.0, 2.0, 3.0]


def test_each_api_gives_its_messages_in_the_one_form_the_template_renders() -> None:
    """Issue 60, item 3: a request's messages become ``ChatMessage``s once, in the API's route, and stay so
    until the text worker makes the template's plain dicts of them (``Chat.template_messages``)."""
    from actors.messages_gpu import Chat
    from gateway import anthropic_api, openai_api
    from gateway.schemas_anthropic import messages_decoder as anthropic_decoder
    from gateway.schemas_openai import chat_decoder

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    expected = [{"role": "user", "content": "add 1"}, {"role": "assistant", "content": "", "tool_calls": (call,)},
                {"role": "tool", "content": "1", "tool_call_id": "c1"}]
    openai = chat_decoder.decode(msgspec.json.encode({"model": "m", "messages": [
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}))
    anthropic = anthropic_decoder.decode(msgspec.json.encode({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "1"}]}]}))
    for chat in (openai_api.to_chat(openai)[0], anthropic_api.to_chat(anthropic)[1]):
        assert all(type(m) is ChatMessage for m in chat)
        assert Chat(messages=tuple(chat)).template_messages() == expected
