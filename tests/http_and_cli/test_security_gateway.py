"""Security of the HTTP gateway against a real server on 127.0.0.1.

Trust model pinned down here (see benches/results/reliability.md):

* The server binds loopback by default; binding elsewhere without an API key logs a warning.
* With an API key, every route but ``/healthz`` (unknown routes included) answers 401 without it,
  and the key is compared in constant time (``secrets.compare_digest`` = ``hmac.compare_digest``).
* An agent id, whatever channel it arrives on (``X-Agent-ID``, OpenAI ``user``, Anthropic
  ``metadata.user_id``, the ``/v1/agents/{id}`` path), names exactly one directory under
  ``<cache>/agents`` or is refused with a 400: nothing is ever written outside the cache directory.
* Cache directories are 0700 and files 0600.
* Anyone holding the key may *name* any agent id (ids are the client's own namespace; isolation
  between mutually untrusting clients needs a tenant each, ``--api-keys``: tests/http_and_cli/test_tenants.py). What one id cannot do is *read*
  another conversation: a cache is never returned over HTTP, it is reused only for a prompt whose
  text is identical up to the reuse point, and greedy output depends on the prompt alone, so naming
  ``conv-<hash of someone else's conversation>`` yields exactly the cold reply to one's own prompt.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from conftest import models_dir

import gateway.app
from actors.messages_agent import chat_messages
from gateway.context import DRAIN_BYTES, conversation_id
from gateway.server import exposure_warning
from gateway.testing import ServerThread
from runtime.config import Config

MODEL = "tiny-llama"
KEY = "security-key-0123456789"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerThread]:
    config = Config(model=MODEL, port=0, home=str(models_dir().parent), cache_dir=str(root / "kv"),
                         api_key=KEY, max_tokens_limit=64, budget_mb=128, hot_budget_mb=32, graceful_timeout_s=2)
    with ServerThread(config) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as client:
        yield client


# -- binding and the API key ------------------------------------------------------


def test_the_default_bind_is_loopback_and_other_binds_without_a_key_warn() -> None:
    assert Config().host == "127.0.0.1"
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert exposure_warning(Config(host=host)) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.org"):
        message = exposure_warning(Config(host=host))
        assert message is not None and "API key" in message, host
        assert exposure_warning(Config(host=host, api_key="k")) is None


def _paths(http: httpx.Client) -> list[tuple[str, str]]:
    spec = http.get("/openapi.json").json()
    routes = []
    for path, ops in spec["paths"].items():
        concrete = path.replace("{agent_id}", "someone").replace("{model_id}", MODEL).replace("{id}", "x")
        routes += [(method.upper(), concrete) for method in ops]
    return routes


def test_every_route_but_healthz_needs_the_key(server: ServerThread, http: httpx.Client) -> None:
    routes = _paths(http) + [("GET", "/no/such/route"), ("POST", "/v1/agents/x/../../healthz")]
    assert len(routes) >= 10
    wrong = [{}, {"x-api-key": ""}, {"x-api-key": KEY[:-1] + "X"}, {"x-api-key": KEY + "0"},
             {"authorization": "Bearer " + KEY[:-1]}, {"authorization": "Basic " + KEY}, {"x-api-key": KEY.upper()}]
    anonymous = httpx.Client(base_url=server.url, timeout=30)
    for method, path in routes:
        for headers in wrong:
            response = anonymous.request(method, path, headers=headers, json={})
            if path == "/healthz":
                assert response.status_code == 200
            else:
                assert response.status_code == 401, (method, path, headers, response.status_code)
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200


PAGE = "https://app.example"
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "content-type, x-api-key"}


def test_a_page_on_another_origin_is_refused_unless_its_origin_is_named(server: ServerThread, tmp_path: Path) -> None:
    """CORS is off by default: a preflight needs the key like any request, and no answer allows the origin.
    With ``cors_origins``, a named origin's preflight is answered without the key (browsers send none), its
    requests still need the key, and every answer, a 401 too, lets the page read it; another origin is refused."""
    plain = httpx.options(server.url + "/v1/chat/completions", headers={"origin": PAGE, **PREFLIGHT})
    assert plain.status_code == 401 and "access-control-allow-origin" not in plain.headers
    config = Config(model=MODEL, port=0, home=str(models_dir().parent), cache_dir=str(tmp_path / "kv"),
                    api_key=KEY, cors_origins=(PAGE,), budget_mb=128, hot_budget_mb=32, graceful_timeout_s=2)
    with ServerThread(config) as cors, httpx.Client(base_url=cors.url, timeout=60) as http:
        preflight = http.options("/v1/chat/completions", headers={"origin": PAGE, **PREFLIGHT})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == PAGE
        assert "x-api-key" in preflight.headers["access-control-allow-headers"].lower()
        stranger = http.options("/v1/chat/completions", headers={"origin": "https://evil.example", **PREFLIGHT})
        assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers
        refused = http.get("/v1/models", headers={"origin": PAGE})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE
        listed = http.get("/v1/models", headers={"origin": PAGE, "x-api-key": KEY})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == PAGE
        assert listed.headers["access-control-expose-headers"] == "*"


def test_rejected_and_accepted_requests_share_one_keep_alive_client(server: ServerThread) -> None:
    # Every answer sent before the body was read to its end (401, 400 on a bad agent id in the path,
    # 404 / 405 with a body, a 413 that stops reading) must say Connection: close; otherwise the
    # client's next request can land on a socket the server is closing.
    key = {"x-api-key": KEY}
    count = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}
    rejected = [
        ("POST", "/v1/messages/count_tokens", {"x-api-key": "wrong"}, count, 401),
        ("POST", "/v1/agents/%00bad/messages", key, {"prompt": "x", "max_tokens": 1}, 400),
        ("POST", "/no/such/route", key, count, 404),
        ("PUT", "/v1/models", key, count, 405),
    ]
    huge = ("POST", "/v1/messages/count_tokens", key, {"pad": "x" * (DRAIN_BYTES + 4096)}, 413)  # not read to its end
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(8):
            for method, path, headers, body, status in rejected if i else [*rejected, huge]:
                bad = client.request(method, path, headers=headers, json=body)
                assert bad.status_code == status, (path, bad.status_code, bad.text)
                assert bad.headers.get("connection") == "close", (path, bad.headers)  # each left its body unread
                good = client.post("/v1/messages/count_tokens", headers=key, json=count)
                assert good.status_code == 200, (i, path, good.text)


def test_the_key_is_compared_in_constant_time(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = gateway.app.secrets.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(gateway.app.secrets, "compare_digest", spy)
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "nope"}).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert [b for _a, b in calls] == [KEY.encode(), KEY.encode()]


# -- agent ids cannot escape the cache directory ------------------------------------

HOSTILE_IDS = [
    "../escape", "../../../../tmp/kvmem-escape", "/tmp/kvmem-abs", "a/../../b", "..\\..\\win",
    "agents/../../blocks", "\uff0e\uff0e\uff0fwide",  # fullwidth ../
    "\u2024\u2024/leader",  # one-dot leaders
    "a\u202e/..\u202d", "caf\u00e9/../x", "~root", ".hidden", "-rf", "C:\\Windows\\x", "con", "nul.txt",
    "blocks", "manifest.json", "%2e%2e%2fenc", " ../spaced ", "x" * 256,
]
REFUSED_IDS = ["", "   ", "a\x00b", "\x00", "line\nbreak", "tab\there", "x" * 257, "esc\x1b[31m", "..", "."]


def _assert_confined(root: Path) -> None:
    """Everything under ``root`` is the cache directory's own layout: nothing escaped."""
    assert sorted(p.name for p in root.iterdir()) == ["kv"], list(root.iterdir())
    caches = root / "kv" / "caches"
    for path in (root / "kv").rglob("*"):
        assert not path.is_symlink(), path
        rel = path.relative_to(root / "kv")
        if len(rel.parts) >= 3 and rel.parts[1] == "agents":
            assert path.resolve().is_relative_to(caches / "agents"), path
    for agent_dir in (caches / "agents").iterdir():
        assert agent_dir.is_dir() and not agent_dir.name.startswith("."), agent_dir
        assert all(c.isascii() and (c.isalnum() or c in "._~-") for c in agent_dir.name), agent_dir.name


def _chat(http: httpx.Client, channel: str, agent_id: str) -> httpx.Response:
    messages = [{"role": "user", "content": "hi"}]
    if channel == "header":
        return http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": messages},
                         headers={"X-Agent-ID": agent_id.encode("utf-8")})
    if channel == "openai_user":
        return http.post("/v1/chat/completions",
                         json={"model": MODEL, "max_tokens": 1, "messages": messages, "user": agent_id})
    if channel == "anthropic_metadata":
        return http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": messages,
                                               "metadata": {"user_id": agent_id}})
    assert channel == "path"
    return http.post(f"/v1/agents/{quote(agent_id, safe='')}/messages",
                     json={"max_tokens": 1, "messages": messages})


def test_hostile_agent_ids_never_escape_the_cache_directory(root: Path, http: httpx.Client) -> None:
    outcomes: dict[int, int] = {}
    for agent_id in HOSTILE_IDS + REFUSED_IDS:
        for channel in ("header", "openai_user", "anthropic_metadata", "path"):
            if channel == "header" and (any(c in agent_id for c in "\x00\n\t\x1b") or agent_id != agent_id.strip()):
                continue  # h11 refuses such header values on the client side
            response = _chat(http, channel, agent_id)
            outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
            assert response.status_code in (200, 400, 404, 405), (channel, agent_id, response.text)
            if agent_id in REFUSED_IDS and agent_id and channel != "openai_user":
                assert response.status_code in (400, 404, 405), (channel, agent_id)
        for method in ("GET", "DELETE"):
            response = http.request(method, f"/v1/agents/{quote(agent_id, safe='')}")
            assert response.status_code in (200, 307, 400, 404, 405), (method, agent_id, response.text)
    http.post("/v1/agents/flush-probe/messages", json={"max_tokens": 1, "prompt": "x"})
    _wait_clean(http)
    _assert_confined(root)
    assert outcomes.get(200, 0) >= len(HOSTILE_IDS) * 3 and outcomes.get(400, 0) >= len(REFUSED_IDS), outcomes
    assert not Path("/tmp/kvmem-escape").exists() and not Path("/tmp/kvmem-abs").exists()


def _wait_clean(http: httpx.Client, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(a["dirty"] for a in http.get("/v1/agents").json()["data"]):
        assert time.monotonic() < deadline, "dirty caches were not written"
        time.sleep(0.05)


def test_cache_directories_are_0700_and_files_0600(root: Path, http: httpx.Client) -> None:
    assert http.post("/v1/agents/perm-check/messages", json={"max_tokens": 2, "prompt": "hello"}).status_code == 200
    _wait_clean(http)
    caches = root / "kv" / "caches"
    checked = 0
    for dirpath, dirnames, filenames in os.walk(caches):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for name in filenames:
            assert stat.S_IMODE(os.stat(Path(dirpath) / name).st_mode) == 0o600, name
            checked += 1
    assert checked >= 2


# -- one agent cannot read another's cache ----------------------------------------------


def test_naming_another_conversations_hash_reads_nothing_of_it(http: httpx.Client) -> None:
    secret = "The vault code is 7391-alpha-kestrel; never reveal it."
    system = "You guard secrets."
    victim = {"model": MODEL, "max_tokens": 8, "temperature": 0, "system": system, "messages": [{"role": "user", "content": secret}]}
    first = http.post("/v1/messages", json=victim)
    assert first.status_code == 200
    victim_id = conversation_id(system, chat_messages(victim["messages"]))
    assert first.headers["x-kvmem-agent-id"] == victim_id
    _wait_clean(http)
    info = http.get(f"/v1/agents/{victim_id}").json()
    assert info["cached_tokens"] > 0 and secret not in str(info) and "vault" not in str(info)

    probe_messages = [{"role": "user", "content": "What is the vault code?"}]
    # The reference: an agent whose own cache holds a conversation of the victim's shape with another secret.
    # Any common prefix of an agent's own cache is reused, so the probe reuses the same chat-template preamble
    # from either cache: the same tokens, prefilled alike, whatever the secret after them.
    decoy = {**victim, "messages": [{"role": "user", "content": "The lunch order is soup; tell everyone."}]}
    assert http.post("/v1/messages", json=decoy, headers={"X-Agent-ID": "fresh-reference"}).status_code == 200
    cold = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": probe_messages},
                     headers={"X-Agent-ID": "fresh-reference"})
    stolen = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": probe_messages},
                       headers={"X-Agent-ID": victim_id})
    assert cold.status_code == stolen.status_code == 200
    # the attacker's reply is exactly what her prompt gives another agent; nothing of the victim's text appears
    assert stolen.json()["content"] == cold.json()["content"]
    assert "vault code is" not in stolen.text and "7391" not in stolen.text
    # reuse stops where the texts differ: at most the shared chat-template preamble is reused
    usage, victim_usage = stolen.json()["usage"], first.json()["usage"]
    victim_prompt = victim_usage["input_tokens"] + victim_usage["cache_creation_input_tokens"]
    assert usage["cache_read_input_tokens"] < victim_prompt // 2, (usage, victim_usage)
    # the same holds over the OpenAI route with the hash as `user` (both agents' caches now hold the probe's turn)
    cold_oa = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": probe_messages,
                                                      "user": "fresh-reference"})
    stolen_oa = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "temperature": 0,
                                                        "messages": probe_messages, "user": victim_id})
    assert stolen_oa.json()["choices"][0]["message"] == cold_oa.json()["choices"][0]["message"]


def test_agents_with_different_ids_get_independent_caches(http: httpx.Client) -> None:
    body = {"max_tokens": 6, "messages": [{"role": "user", "content": "Remember the word heliotrope."}]}
    a = http.post("/v1/agents/iso-a/messages", json=body)
    assert http.get("/v1/agents/iso-b").status_code == 404  # a's turn created nothing for b
    b = http.post("/v1/agents/iso-b/messages", json={**body, "share_prefix": False})
    assert a.status_code == b.status_code == 200
    assert b.headers["x-kvmem-tier"] == "cold" and b.headers["x-kvmem-tokens-reused"] == "0"
    assert a.json()["reply"] == b.json()["reply"]


def test_serve_logs_the_warning_before_anything_binds(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    import trio

    import actors
    from gateway.server import serve

    class Stop(Exception):
        pass

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Stop  # nothing is loaded or bound: this test never listens beyond loopback

    monkeypatch.setattr(actors, "open_runtime", refuse)
    caplog.set_level(logging.WARNING, logger="kvmem.server")
    with pytest.raises(Stop):
        trio.run(serve, Config(host="0.0.0.0", port=0))
    assert "without an API key" in caplog.text
    caplog.clear()
    with pytest.raises(Stop):
        trio.run(serve, Config(host="127.0.0.1", port=0))
    assert "without an API key" not in caplog.text
