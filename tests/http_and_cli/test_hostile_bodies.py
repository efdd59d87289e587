"""Malformed and hostile requests are 4xx in the API's own shape, and no error shows a server path (issue 58, item 4).

Against a real hypercorn server on :class:`fake_engine.FakeEngine`:

* a body nested deeper than :data:`gateway.json_depth.MAX_JSON_DEPTH`, wherever the nesting sits (an
  unknown field, Anthropic ``metadata``, a tool's schema, ``response_format``, ``output_config``, the
  agents API, a scenario), is a 400 ``too_deeply_nested`` before any decoder recurses; so is deep
  nesting inside a string field that kvmem parses (a tool call's ``arguments``, a scenario's YAML);
* a failed forget on a cache directory that cannot be written is a 503 that says the agent was not
  forgotten, names no path, and the agent is still there after a restart (as the client was told);
* an internal error's body names no absolute path (:func:`gateway.errors.without_server_paths`);
* a stream asked with ``Connection: close`` is closed once its last event is out (item 5).
"""

from __future__ import annotations

import errno
import socket
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from gateway.errors import from_exception, without_server_paths
from gateway.json_depth import MAX_JSON_DEPTH, json_depth
from gateway.scenario_routes import scenario_routes
from gateway.testing import ServerThread
from runtime.config import Config
from runtime.persist import CacheDirectory

MODEL = "fake-a"
DEEP = 100_000


def _config(root: Path) -> Config:
    return Config(model=MODEL, port=0, home=str(root / "home"), cache_dir=str(root / "kv"), fsync=False,
                  max_tokens_limit=64, graceful_timeout_s=2, durable=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile-bodies")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerThread]:
    def scenarios(rt: Any, nursery: Any) -> Any:  # as ``kvmem serve`` adds them
        return scenario_routes(rt, home=root / "home", nursery=nursery)

    with ServerThread(_config(root), engine=FakeEngine(), extra_routes=scenarios) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _nested(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


def _deep_object(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


# -- the depth, measured on bytes ------------------------------------------------------


def test_json_depth_counts_objects_and_arrays_and_skips_strings() -> None:
    assert json_depth(b"1") == 0 and json_depth(b'"[[[{{{"') == 0
    assert json_depth(b'{"a": [1, {"b": "]]]}}}"}]}') == 3
    assert json_depth(json.dumps({"s": 'quote \\" and ] [ {'}).encode()) == 1
    assert json_depth(_nested(DEEP).encode()) == DEEP
    assert json_depth(b"[" * 10) == 10  # unbalanced: measured all the same, the decoder refuses it


# -- deep bodies are 400s in each API's shape ---------------------------------------------

OPENAI_MSG = '[{"role": "user", "content": "hi"}]'
DEEP_BODIES = {
    "openai unknown field": ("/v1/chat/completions", "openai",
                             f'{{"model": "{MODEL}", "messages": {OPENAI_MSG}, "extra": {_nested(DEEP)}}}'),
    "openai response_format": ("/v1/chat/completions", "openai",
                               f'{{"model": "{MODEL}", "messages": {OPENAI_MSG}, "response_format": {{"type": '
                               f'"json_schema", "json_schema": {{"name": "x", "schema": {_deep_object(DEEP)}}}}}}}'),
    "openai tool schema": ("/v1/chat/completions", "openai",
                           f'{{"model": "{MODEL}", "messages": {OPENAI_MSG}, "tools": [{{"type": "function", '
                           f'"function": {{"name": "f", "parameters": {_deep_object(DEEP)}}}}}]}}'),
    "anthropic metadata": ("/v1/messages", "anthropic",
                           f'{{"model": "{MODEL}", "max_tokens": 4, "messages": {OPENAI_MSG}, '
                           f'"metadata": {{"user_id": "u", "x": {_nested(DEEP)}}}}}'),
    "anthropic output_config": ("/v1/messages", "anthropic",
                                f'{{"model": "{MODEL}", "max_tokens": 4, "messages": {OPENAI_MSG}, "output_config": '
                                f'{{"format": {{"type": "json_schema", "schema": {_deep_object(DEEP)}}}}}}}'),
    "anthropic count_tokens": ("/v1/messages/count_tokens", "anthropic",
                               f'{{"model": "{MODEL}", "messages": {OPENAI_MSG}, "tools": [{{"name": "f", '
                               f'"input_schema": {_deep_object(DEEP)}}}]}}'),
    "agents api": ("/v1/agents/deep/messages", "kvmem", f'{{"prompt": "x", "extra": {_nested(DEEP)}}}'),
    "scenario": ("/v1/scenarios", "kvmem", f'{{"name": "gossip", "extra": {_nested(DEEP)}}}'),
    "just past the bound": ("/v1/chat/completions", "openai",
                            f'{{"model": "{MODEL}", "messages": {OPENAI_MSG}, "x": {_nested(MAX_JSON_DEPTH)}}}'),
}


def _error_of(response: httpx.Response, flavor: str) -> dict[str, Any]:
    body = response.json()
    if flavor == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]
    return body["error"]


@pytest.mark.parametrize("case", list(DEEP_BODIES))
def test_a_deeply_nested_body_is_a_400_in_the_apis_shape(http: httpx.Client, case: str) -> None:
    path, flavor, body = DEEP_BODIES[case]
    response = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = _error_of(response, flavor)
    assert "levels deep" in error["message"] and str(MAX_JSON_DEPTH) in error["message"], error
    if flavor != "anthropic":
        assert error.get("code") in ("too_deeply_nested", None), error
    assert http.get("/healthz").status_code == 200


def test_nesting_within_the_bound_is_decoded_as_usual(http: httpx.Client) -> None:
    body = f'{{"model": "{MODEL}", "max_tokens": 2, "messages": {OPENAI_MSG}, "x": {_nested(MAX_JSON_DEPTH - 1)}}}'
    response = http.post("/v1/chat/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_deep_nesting_inside_string_fields_is_no_500(http: httpx.Client) -> None:
    history = [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": _nested(DEEP)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    turn = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": history,
                                                    "tools": tools})
    assert turn.status_code < 500, turn.text
    yaml_text = "name: deep\nagents: " + _nested(DEEP)
    scenario = http.post("/v1/scenarios", json={"yaml": yaml_text})
    assert scenario.status_code == 400, scenario.text
    assert "nests too deeply" in scenario.text or "not valid YAML" in scenario.text, scenario.text


# -- no server path in what a client reads -------------------------------------------------


def test_an_internal_error_names_no_server_path() -> None:
    error = from_exception(RuntimeError("failed reading /srv/kvmem/home/kv/caches/agents/bob/manifest.json"))
    assert error.status == 500 and "/srv" not in error.message and "manifest.json" in error.message
    assert without_server_paths("see http://127.0.0.1:8000/v1/agents/x") == "see http://127.0.0.1:8000/v1/agents/x"


def test_a_forget_the_disk_refuses_is_a_503_and_the_agent_is_still_there_after_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    ask = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "keep me"}], "user": "kept"}
    with ServerThread(config, engine=FakeEngine()) as running, httpx.Client(base_url=running.url) as http:
        assert http.post("/v1/chat/completions", json=ask).status_code == 200

        def read_only(self: CacheDirectory, agent_id: str) -> None:
            raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "kv" / "agents" / "kept" / "manifest"))

        monkeypatch.setattr(CacheDirectory, "delete", read_only)
        refused = http.delete("/v1/agents/kept")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "cache_dir_not_writable" and "was not forgotten" in error["message"], error
        assert str(tmp_path) not in refused.text and "Read-only file system" in refused.text
        assert http.get("/v1/agents/kept").json()["on_disk"] is True
        monkeypatch.undo()
    with ServerThread(config, engine=FakeEngine()) as running, httpx.Client(base_url=running.url) as http:
        assert http.get("/v1/agents/kept").status_code == 200  # as the 503 said: still there
        assert http.delete("/v1/agents/kept").status_code == 200
    with ServerThread(config, engine=FakeEngine()) as running, httpx.Client(base_url=running.url) as http:
        assert http.get("/v1/agents/kept").status_code == 404  # forgotten stays forgotten


# -- Connection: close after a stream (issue 58, item 5) ---------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/agents/closer/messages"])
def test_a_finished_stream_asked_with_connection_close_closes_the_connection(server: ServerThread, path: str) -> None:
    """The server closes the socket once the stream's last event is out, as the request asked: a client that
    reads to the end of the connection (HTTP/1.0 style, some proxies) is not left waiting for a timeout."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": True,
                            "messages": [{"role": "user", "content": "close after this"}]}
    if path.startswith("/v1/agents/"):
        body = {"prompt": "close after this", "max_tokens": 3, "stream": True}
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: kvmem\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        received = b""
        while chunk := sock.recv(65536):  # a connection left open times out here (10 s) and fails the test
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower(), head
    assert rest.endswith(b"0\r\n\r\n"), rest[-200:]  # the whole stream came before the close
