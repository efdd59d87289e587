"""Hostile HTTP input against a real server on 127.0.0.1.

* Property-based fuzzing (hypothesis): JSON bodies for every POST endpoint, from arbitrary JSON
  to near-valid requests with wrong types, odd unicode and edge values, plus raw non-JSON bytes and
  random agent-id headers. Every response is a 4xx or a 200 within its timeout: never a 5xx,
  never a hang; the server's memory stays bounded over the run.
* Limits: bodies over ``max_body_bytes`` get 413 (declared or chunked), oversized headers are
  refused without harm.
* Slow clients: one that sends its headers and trickles the body, and one that never reads its
  SSE stream, do not block another agent's turn; a body slower than ``body_timeout_s`` gets a 408
  and its connection is closed; connections that trickle their headers (slow-loris) are closed
  by Hypercorn's keep-alive timer while other agents are served.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import models_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.context import DRAIN_BYTES
from gateway.testing import ServerThread
from runtime.config import Config

MODEL = "tiny-llama"
LIMIT = 64 * 1024
TIMEOUT = httpx.Timeout(30, connect=5)
BODY_TIMEOUT_S = 3.0
CASES = {"n": 0, "by_status": {}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    config = Config(model=MODEL, port=0, home=str(models_dir().parent),
                         cache_dir=str(tmp_path_factory.mktemp("fuzz")), max_tokens_limit=16,
                         default_max_tokens=8, max_body_bytes=LIMIT, budget_mb=128, hot_budget_mb=32,
                         graceful_timeout_s=2, body_timeout_s=BODY_TIMEOUT_S)
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    # One connection per request: the server closes a connection after some rejected requests
    # (e.g. a body it did not read), and a pooled connection closed that way races the next
    # request ("Server disconnected"); these tests check status codes, not keep-alive.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
        yield client


def _check(response: httpx.Response, what: object) -> None:
    CASES["n"] += 1
    CASES["by_status"][response.status_code] = CASES["by_status"].get(response.status_code, 0) + 1
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:300]


# -- strategies -------------------------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | text
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                        max_leaves=12)
odd_ints = st.sampled_from([-1, 0, 1, 2, 16, 17, 2**31, 2**63, -(2**63)]) | st.integers(-5, 20)
roles = st.sampled_from(["user", "assistant", "system", "tool", "developer", "", "USER"]) | text
content_blocks = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "bogus"]),
                           "text": text}, optional={"id": text, "input": any_json, "content": any_json}),
    max_size=3)
message = st.fixed_dictionaries({"role": roles, "content": text | content_blocks | any_json})
messages = st.lists(message, max_size=4) | any_json


def _maybe(base: dict[str, Any], extra: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries(base, optional=extra)


anthropic_body = _maybe({"model": st.sampled_from([MODEL, "", "nope"]) | text, "messages": messages},
                        {"max_tokens": odd_ints | any_json, "system": text | content_blocks | any_json,
                         "stream": st.booleans() | any_json, "temperature": finite | any_json,
                         "metadata": st.fixed_dictionaries({}, optional={"user_id": text | any_json}),
                         "stop_sequences": st.lists(text, max_size=3) | any_json, "tools": any_json,
                         "top_k": odd_ints, "top_p": finite})
openai_body = _maybe({"model": st.sampled_from([MODEL, "", "nope"]) | text, "messages": messages},
                     {"max_tokens": odd_ints | any_json, "max_completion_tokens": odd_ints, "user": text | any_json,
                      "stream": st.booleans(), "temperature": finite | any_json, "n": odd_ints,
                      "stop": text | st.lists(text, max_size=5) | any_json, "tools": any_json, "seed": odd_ints,
                      "stream_options": any_json, "response_format": any_json, "logprobs": any_json})
agent_body = _maybe({}, {"messages": messages, "prompt": text | any_json, "system": text | any_json,
                         "max_tokens": odd_ints | any_json, "stream": st.booleans(), "share_prefix": any_json,
                         "temperature": finite | any_json, "stop": st.lists(text, max_size=20) | any_json,
                         "model": text})
ENDPOINTS = {
    "/v1/messages": anthropic_body,
    "/v1/messages/count_tokens": anthropic_body,
    "/v1/chat/completions": openai_body,
    "/v1/agents/fuzz/messages": agent_body,
}
header_ids = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=0, max_size=80)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


def _post(http: httpx.Client, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    response = http.post(path, json=body, headers=headers)
    response.read()
    return response


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_json_bodies_never_get_a_5xx(http: httpx.Client, path: str) -> None:
    @FUZZ
    @given(body=ENDPOINTS[path] | any_json, agent=st.none() | header_ids)
    def run(body: Any, agent: str | None) -> None:
        headers = {"x-agent-id": agent} if agent is not None and agent == agent.strip() else None
        _check(_post(http, path, body, headers), (path, body, agent))

    run()


@FUZZ
@given(raw=st.binary(max_size=300) | text.map(str.encode),
       path=st.sampled_from([*ENDPOINTS, "/v1/agents/x", "/v1/models", "/metrics"]),
       ctype=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]))
def test_fuzzed_raw_bytes_never_get_a_5xx(http: httpx.Client, raw: bytes, path: str, ctype: str) -> None:
    response = http.post(path, content=raw, headers={"content-type": ctype} if ctype else {})
    _check(response, (path, raw))


@FUZZ
@given(agent=st.text(min_size=1, max_size=300))
def test_fuzzed_path_ids_never_get_a_5xx(http: httpx.Client, agent: str) -> None:
    from urllib.parse import quote
    for method in ("GET", "DELETE"):
        _check(http.request(method, "/v1/agents/" + quote(agent, safe="")), agent)
    _check(http.post("/v1/agents/" + quote(agent, safe="") + "/messages", json={"prompt": "hi", "max_tokens": 1}),
           agent)


VALID = {
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi é"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/agents/fuzz-bytes/messages": {"prompt": "hi", "max_tokens": 2},
}


def _mutations(path: str) -> Iterator[tuple[str, bytes, str]]:
    """Byte-level damage to a valid body: every truncation, bad UTF-8, duplicate keys, huge numbers, deep nesting."""
    body = json.dumps(VALID[path], ensure_ascii=False).encode()
    for cut in range(len(body)):
        yield f"truncated at {cut}", body[:cut], "application/json"
    for bad in (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"):
        yield f"bytes {bad!r} in a string", body.replace(b"hi", b"h" + bad, 1), "application/json"
    key = b'"max_tokens"' if b'"max_tokens"' in body else b'"model"'
    yield "duplicate keys", body[:-1] + b"," + key + b": 1" + body[-1:], "application/json"
    for number in (b"1e400", b"-1e400", b"99999999999999999999999999999", b"1.5", b"-0", b"NaN", b"Infinity"):
        yield f"number {number!r}", body.replace(b": 2", b": " + number, 1), "application/json"
    yield "deep nesting", b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", "application/json"
    yield "a bare string", b'"hello"', "application/json"
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        yield f"content type {ctype!r}", body, ctype


@pytest.mark.parametrize("path", list(VALID))
def test_damaged_bytes_of_valid_bodies_get_a_4xx_in_the_apis_shape(http: httpx.Client, path: str) -> None:
    flavor = "anthropic" if path.startswith("/v1/messages") else "openai" if "chat" in path else "kvmem"
    for what, raw, ctype in _mutations(path):
        response = http.post(path, content=raw, headers={"content-type": ctype} if ctype else {})
        _check(response, (path, what))
        if response.status_code >= 400:
            error = response.json()
            if flavor == "anthropic":
                assert error["type"] == "error" and error["error"]["type"], (what, error)
            else:
                assert error["error"]["message"], (what, error)
            assert "Traceback" not in response.text, what
    # and the server still serves this route
    assert http.post(path, json=VALID[path]).status_code == 200


def test_a_fixed_budget_of_random_damage_never_gets_a_5xx(server: ServerThread) -> None:
    from benches.reliability.fuzz import fuzz

    report = fuzz(server.url, seconds=10.0, seed=1)
    assert report.cases > 50 and report.liveness_checks >= 2
    assert report.failures == [], report.failures[:5]
    CASES["n"] += report.cases


def test_memory_stays_bounded_over_the_fuzzing(http: httpx.Client) -> None:
    """Runs after the fuzzers (file order): the server survived them and memory did not balloon."""
    assert http.get("/healthz").status_code == 200
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(20):
        _check(http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": f"bounded {i}"}]}), i)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"fuzz cases: {CASES['n']}, by status: {CASES['by_status']}, peak RSS growth {grown_mib:.1f} MiB")
    assert grown_mib < 256
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # under xdist the fuzzers may run in other workers
        assert CASES["n"] >= 300


# -- size and header limits -----------------------------------------------------------------


def test_oversized_bodies_get_413_declared_or_chunked(http: httpx.Client) -> None:
    big = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "' + b"a" * (LIMIT * 4) + b'"}]}'
    declared = http.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["type"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i: i + 8192]

    chunked = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    # a declared length over the limit is refused before the body arrives
    sock = _raw_connection(str(http.base_url).rstrip("/"))
    try:
        sock.sendall(b"POST /v1/agents/liar/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: " + str(DRAIN_BYTES + 1).encode() + b"\r\n\r\n{\"prompt\": \"hi\"")
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    finally:
        sock.close()


def test_huge_or_many_headers_are_refused_without_harm(server: ServerThread, http: httpx.Client) -> None:
    for headers in ({"x-agent-id": "a" * 100_000}, {f"x-h-{i}": "v" * 100 for i in range(2000)}):
        try:
            response = httpx.post(server.url + "/v1/messages", json={}, headers=headers, timeout=TIMEOUT)
            assert response.status_code < 500 or response.status_code == 431, response.status_code
        except httpx.TransportError:
            pass  # the server may just close the connection
    assert http.get("/healthz").status_code == 200
    assert http.post("/v1/agents/" + "b" * 300 + "/messages", json={"prompt": "x"}).status_code == 400


# -- slow clients ---------------------------------------------------------------------------


def _raw_connection(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_client_trickling_its_body_does_not_block_other_agents(server: ServerThread, http: httpx.Client) -> None:
    body = b'{"prompt": "slow and steady", "max_tokens": 2}'
    slow = _raw_connection(server.url)
    slow.sendall(b"POST /v1/agents/trickler/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
    stop = threading.Event()

    def trickle() -> None:
        for byte in body[5:-1]:
            if stop.wait(0.2):
                return
            slow.sendall(bytes([byte]))

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:  # (the client's timeout, TIMEOUT, stops a request the trickler blocked)
        other = http.post("/v1/agents/punctual/messages", json={"prompt": "on time", "max_tokens": 2})
        assert other.status_code == 200
    finally:
        stop.set()
        thread.join(5)
        slow.close()


def _read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection (or ``within_s`` passes)."""
    sock.settimeout(0.5)
    data, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, True
        if not piece:
            return data, True
        data += piece
    return data, False


def test_a_body_slower_than_the_body_timeout_gets_408_and_the_connection_closes(server: ServerThread) -> None:
    body = b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "slow"}]}'
    started = time.monotonic()  # before the server can have seen the request: it can time out no sooner
    slow = _raw_connection(server.url)
    slow.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
    stop = threading.Event()

    def trickle() -> None:  # one byte a second: the whole body would take over a minute
        for byte in body[5:]:
            if stop.wait(1.0):
                return
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        answer, closed = _read_until_closed(slow, BODY_TIMEOUT_S + 30)  # (a safety: the server closes it)
    finally:
        stop.set()
        thread.join(5)
        slow.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(payload)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    assert "did not arrive within" in error["error"]["message"]
    assert closed and time.monotonic() - started >= BODY_TIMEOUT_S - 0.5  # the timeout's doing, not sooner


def test_slow_loris_connections_are_closed_while_other_agents_are_served(server: ServerThread,
                                                                        http: httpx.Client) -> None:
    # Each connection sends a request line and then one header byte every half second, never
    # finishing its headers. Hypercorn's keep-alive timer (5 s, gateway/server.py) runs until a
    # request's headers are complete, so it closes them; meanwhile the server keeps serving.
    loris = [_raw_connection(server.url) for _ in range(40)]
    stop = threading.Event()

    def trickle() -> None:
        header = b"x-slow: " + b"a" * 200
        for byte in header:
            if stop.wait(0.5):
                return
            for sock in loris:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    pass

    for sock in loris:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        for j in range(2):  # (the client's timeout, TIMEOUT, stops a request the connections blocked)
            other = http.post(f"/v1/agents/patient-{j}/messages", json={"prompt": "still served", "max_tokens": 2})
            assert other.status_code == 200
        deadline = time.monotonic() + 12
        still_open = list(loris)
        while still_open and time.monotonic() < deadline:
            still_open = [sock for sock in still_open if not _read_until_closed(sock, 0.2)[1]]
        assert not still_open, f"{len(still_open)} of {len(loris)} slow-loris connections still open"
        assert http.get("/healthz").status_code == 200
    finally:
        stop.set()
        thread.join(5)
        for sock in loris:
            sock.close()


def test_a_client_that_never_reads_its_stream_does_not_block_other_agents(server: ServerThread,
                                                                          http: httpx.Client) -> None:
    stalled = []
    for i in range(3):
        sock = _raw_connection(server.url)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        payload = (b'{"model": "tiny-llama", "max_tokens": 16, "stream": true, "messages": '
                   b'[{"role": "user", "content": "never read ' + str(i).encode() + b'"}]}')
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        stalled.append(sock)  # never read
    try:
        for j in range(3):  # (the client's timeout, TIMEOUT, stops a request the stalled streams blocked)
            other = http.post(f"/v1/agents/reader-{j}/messages", json={"prompt": "still served", "max_tokens": 4})
            assert other.status_code == 200
        assert http.get("/healthz").status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_connections_clients_close_are_released_soon(server: ServerThread) -> None:
    # Hypercorn keeps a socket its client closed until the keep-alive timer ends: that timer must be
    # short, or clients that open a connection per request exhaust the server's file descriptors.
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))  # the server runs in this process (ServerThread)

    limits = httpx.Limits(max_keepalive_connections=0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
        time.sleep(6)
        before = open_fds()
        for _ in range(200):
            assert client.post("/v1/messages/count_tokens", json=body).status_code == 200
    deadline = time.monotonic() + 12
    while open_fds() > before + 10 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert open_fds() <= before + 10, (before, open_fds())
