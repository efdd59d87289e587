"""Agent ids that cannot merge: one name is one agent, two names are never one (issue 32, item 3).

An id reaches kvmem as bytes (the ``/v1/agents/{id}`` path, the ``X-Agent-ID``
header) or as JSON text (OpenAI ``user``, Anthropic ``metadata.user_id``). Bytes are
percent-encoded UTF-8, read strictly: what is not UTF-8 is a 400, never a U+FFFD
that another client's bytes would also decode to. Every id is NFC-normalized where
ids are checked, so the composed and decomposed spellings of a name are one agent.
Against a real hypercorn server (raw paths and header bytes as a client sends them)
on :class:`fake_engine.FakeEngine`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fake_engine import FakeEngine

from gateway.context import decode_agent_id, header_safe
from gateway.errors import ApiError
from gateway.testing import ServerThread
from runtime.config import Config
from runtime.errors import InvalidAgentIdError
from runtime.identity import check_agent_id, safe_agent_dirname

MODEL = "fake-a"
NFC = unicodedata.normalize("NFC", "café")
NFD = unicodedata.normalize("NFD", "café")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("agent-ids")
    config = Config(model=MODEL, port=0, home=str(root / "home"), cache_dir=str(root / "kv"), fsync=False,
                    max_tokens_limit=64, graceful_timeout_s=2)
    with ServerThread(config, engine=FakeEngine()) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _listed(http: httpx.Client) -> set[str]:
    return {a["id"] for a in http.get("/v1/agents").json()["data"]}


def _openai(http: httpx.Client, content: str, *, headers: dict[str, Any] | None = None,
            user: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    if user is not None:
        body["user"] = user
    return http.post("/v1/chat/completions", json=body, headers=headers or {})


def _anthropic(http: httpx.Client, content: str, *, headers: dict[str, Any] | None = None,
               user_id: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    if user_id is not None:
        body["metadata"] = {"user_id": user_id}
    return http.post("/v1/messages", json=body, headers=headers or {})


# -- the one place ids are checked ---------------------------------------------------


def test_check_agent_id_returns_the_nfc_spelling_and_one_folder_for_both_spellings() -> None:
    assert NFC != NFD
    assert check_agent_id(NFD) == check_agent_id(NFC) == NFC
    assert safe_agent_dirname(check_agent_id(NFD)) == safe_agent_dirname(check_agent_id(NFC))
    assert check_agent_id(f"acme\x1f{NFD}") == f"acme\x1f{NFC}"  # the tenant part kept, the id part normalized
    assert check_agent_id("plain-id") == "plain-id"


def test_check_agent_id_refuses_replacement_characters_and_lone_surrogates() -> None:
    for agent_id in ["\ufffd\ufffd", "a\ufffd", "\ud800", "x\udcff", f"acme\x1fa\ufffd"]:
        with pytest.raises(InvalidAgentIdError):
            check_agent_id(agent_id)


def test_decode_agent_id_is_the_inverse_of_header_safe() -> None:
    for agent_id in ["alice", NFC, NFD, "50%off", "a%41", "x y/z", "日本語"]:
        assert decode_agent_id(header_safe(agent_id).encode("ascii"), param="X-Agent-ID") == agent_id
    assert decode_agent_id(NFC.encode(), param="X-Agent-ID") == NFC  # raw UTF-8 reads as its escaped form
    for bad in [b"caf\xe9", b"%FF%FE", b"%ED%A0%80", b"50%off", b"%", b"%4"]:
        with pytest.raises(ApiError) as refused:
            decode_agent_id(bad, param="X-Agent-ID")
        assert refused.value.status == 400 and refused.value.code == "invalid_agent_id"
        assert refused.value.param == "X-Agent-ID"


# -- paths ------------------------------------------------------------------------


@pytest.mark.parametrize("segment", ["%FF%FE", "%FE%FF", "%ED%A0%80", "%C3", "ok%FFok", "%EF%BF%BD", "50%zz"])
def test_a_path_id_that_is_not_utf8_is_a_400_in_the_agent_apis_shape(http: httpx.Client, segment: str) -> None:
    for method, path in [("POST", f"/v1/agents/{segment}/messages"), ("GET", f"/v1/agents/{segment}"),
                         ("DELETE", f"/v1/agents/{segment}")]:
        body = {"max_tokens": 2, "prompt": "x"} if method == "POST" else None
        response = http.request(method, path, json=body)
        assert response.status_code == 400, (method, path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request" and error["param"] == "agent_id", error
        assert error["code"] == "invalid_agent_id", error
    assert not any("\ufffd" in a for a in _listed(http))


def test_two_invalid_paths_never_share_an_agent(http: httpx.Client) -> None:
    first = http.post("/v1/agents/%FF%FE/messages", json={"max_tokens": 2, "prompt": "secret of the first"})
    second = http.post("/v1/agents/%FE%FF/messages", json={"max_tokens": 2, "prompt": "secret of the first"})
    assert first.status_code == second.status_code == 400
    assert "\ufffd\ufffd" not in _listed(http)


def test_nfc_and_nfd_paths_name_one_agent(http: httpx.Client) -> None:
    agent = "path-" + NFD
    turn = http.post(f"/v1/agents/{quote(agent, safe='')}/messages", json={"max_tokens": 2, "prompt": "p"})
    assert turn.status_code == 200, turn.text
    assert turn.json()["agent_id"] == unicodedata.normalize("NFC", agent)
    found = http.get(f"/v1/agents/{quote(unicodedata.normalize('NFC', agent), safe='')}")
    assert found.status_code == 200 and found.json()["cached_tokens"] > 0
    assert http.delete(f"/v1/agents/{quote(agent, safe='')}").status_code == 200  # the NFD spelling forgets it


# -- headers and body fields ---------------------------------------------------------


def test_the_header_user_and_metadata_user_id_name_one_agent(http: httpx.Client) -> None:
    ask = "one agent, four doors"
    turns = [
        _anthropic(http, ask, headers={"X-Agent-ID": NFC.encode("utf-8")}),  # raw UTF-8, as curl sends it
        _openai(http, ask, headers={"X-Agent-ID": quote(NFD)}),  # the documented form, decomposed
        _openai(http, ask, user=NFD),
        _anthropic(http, ask, user_id=NFC),
        _openai(http, ask, headers={"X-Agent-ID": header_safe(NFC)}),  # the echoed header sent back as is
    ]
    assert [t.status_code for t in turns] == [200] * len(turns), [t.text for t in turns]
    assert {t.headers["x-kvmem-agent-id"] for t in turns} == {quote(NFC)}
    # every turn after the first found the first one's cache in RAM: one agent, one cache
    assert [t.headers["x-kvmem-tier"] for t in turns[1:]] == ["hot"] * (len(turns) - 1)
    assert all(int(t.headers["x-kvmem-tokens-reused"]) > 0 for t in turns[1:])
    assert NFC in _listed(http) and NFD not in _listed(http) and "caf\u00c3\u00a9" not in _listed(http)


def test_a_header_that_is_not_utf8_is_a_400_naming_the_header(http: httpx.Client) -> None:
    for raw in [b"caf\xe9", b"%FF%FE", b"%ED%A0%80", b"100%"]:
        response = _openai(http, "bad header", headers={"X-Agent-ID": raw})
        assert response.status_code == 400, (raw, response.text)
        error = response.json()["error"]
        assert error["param"] == "X-Agent-ID" and error["code"] == "invalid_agent_id", error
        assert _anthropic(http, "bad header", headers={"X-Agent-ID": raw}).status_code == 400


def test_a_percent_in_an_id_round_trips_through_the_echoed_header(http: httpx.Client) -> None:
    first = _openai(http, "percent", user="50%off")
    echoed = first.headers["x-kvmem-agent-id"]
    assert echoed == "50%25off"
    again = _openai(http, "percent", headers={"X-Agent-ID": echoed})
    assert again.headers["x-kvmem-agent-id"] == echoed and again.headers["x-kvmem-tier"] == "hot"


async def test_the_runtime_api_normalizes_too(tmp_path: Path) -> None:
    """``kvmem chat --agent`` and ``kvmem forget`` reach agents through ``Runtime.agent`` as well."""
    from actors import open_runtime

    async with open_runtime(model=MODEL, home=tmp_path, engine=FakeEngine(), fsync=False,
                            handle_signals=False) as rt:
        handle = rt.agent(NFD)
        assert handle.agent_id == NFC
        await handle.send([{"role": "user", "content": "hi"}], max_tokens=2)
        assert NFC in rt.live_agents() and NFD not in rt.live_agents()
        assert await rt.agent(NFC).forget()


# -- every id a client can create is reachable by URL (issue 58, item 3) ---------------

REACHABLE = ["team/alice", "/", "a/b/c", "50% off", "two  spaces", "...", ".x", "x/..", "x/messages", NFD,
             "é" * 256, "z" * 256]


def _url_segment(agent_id: str) -> str:
    """``agent_id`` as one path segment: every reserved character escaped, dots too (``..`` is no traversal)."""
    return quote(agent_id, safe="").replace(".", "%2E")


@pytest.mark.parametrize("agent_id", REACHABLE, ids=lambda a: repr(a[:12]))
def test_an_id_created_by_user_or_header_is_read_continued_and_forgotten_by_url(http: httpx.Client,
                                                                               agent_id: str) -> None:
    created = _openai(http, "remember the reachable id", user=agent_id)
    assert created.status_code == 200, created.text
    kept = unicodedata.normalize("NFC", agent_id)
    assert kept in _listed(http)
    path = f"/v1/agents/{_url_segment(agent_id)}"
    found = http.get(path)
    assert found.status_code == 200, found.text
    assert found.json()["id"] == kept and found.json()["cached_tokens"] > 0
    turn = http.post(f"{path}/messages", json={"max_tokens": 2, "prompt": "and continue it"})
    assert turn.status_code == 200, turn.text
    assert turn.json()["agent_id"] == kept, turn.json()
    header = _openai(http, "by its header too", headers={"X-Agent-ID": header_safe(kept)})
    assert header.status_code == 200 and header.headers["x-kvmem-agent-id"] == header_safe(kept), header.text
    gone = http.delete(path)
    assert gone.status_code == 200, gone.text
    assert http.get(path).status_code == 404 and kept not in _listed(http)


@pytest.mark.parametrize("refused", ["z" * 257, "..", "."])
def test_an_id_no_url_can_name_is_the_same_400_by_every_door(http: httpx.Client, refused: str) -> None:
    too_long = refused
    segment = _url_segment(refused)
    responses = [_openai(http, "long", user=too_long), _anthropic(http, "long", user_id=too_long),
                 _openai(http, "long", headers={"X-Agent-ID": too_long}), http.get(f"/v1/agents/{segment}"),
                 http.post(f"/v1/agents/{segment}/messages", json={"max_tokens": 2, "prompt": "x"}),
                 http.delete(f"/v1/agents/{segment}")]
    assert [r.status_code for r in responses] == [400] * len(responses), [r.text for r in responses]
    assert all(("256" if len(refused) > 2 else "no URL can name") in r.text for r in responses), \
        [r.text for r in responses]
