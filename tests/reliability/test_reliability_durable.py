"""Durable by default (``X-Kvmem-Durable``, ``kvmem serve --no-durable``) against a real ``kvmem serve``.

A turn is answered only once its cache is on disk unless the operator (``--no-durable``) or
the request (``X-Kvmem-Durable: false``) opts out. Checked three ways:

* at the answer: the moment a default answer is in (a non-streaming response, a stream's
  ``done`` event; the agents API, OpenAI and Anthropic), the agent's manifest *on disk*
  already holds the turn — read from the cache directory, not through
  ``GET /v1/agents/{id}``, whose listing waits for a save in progress and so reads "saved"
  either way. ``X-Kvmem-Durable: true`` does the same on a ``--no-durable`` server;
* the opt-outs answer write-behind: an answer arrives before its cache is on disk (the save
  lands 2-30 ms later: benches/results/durability*.md) and the save still lands;
* ``kill -9`` the moment a durable answer is in, restart, and the turn is there
  (``benches/reliability/durability.py`` runs more trials, 0-50 ms after the answer, write-behind beside).

Write-behind turns are not asserted to be lost to a kill: whether a kill beats the save is timing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import httpx
from conftest import models_dir
from serve_process import kvmem_serve

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benches/ is not an installed package
from benches.reliability.durability import (
    DURABLE_DEFAULT,
    DURABLE_OPT_IN,
    SEED_TEXT,
    STREAM_DURABLE,
    Agent,
    kill_trials,
    stored_tokens,
    turn,
    wait_saved,
)

MODEL = "tiny-llama"
MAX_TOKENS = 8


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    return {**env, "KVMEM_HOME": str(home), "KVMEM_MODELS_DIR": str(models_dir()), "KVMEM_PREWARM_MB": "0"}


def _serve_args(cache_dir: Path, *more: str) -> tuple[str, ...]:
    return ("--model", MODEL, "--port", "0", "--host", "127.0.0.1", "--cache-dir", str(cache_dir), *more)


def _chat_turn(url: str, flavor: str, agent_id: str, text: str, durable: str | None) -> int:
    """One non-streaming OpenAI or Anthropic turn (``X-Kvmem-Durable: durable`` unless None); its cache's tokens."""
    headers = {"X-Agent-ID": agent_id, **({"X-Kvmem-Durable": durable} if durable is not None else {})}
    messages = [{"role": "user", "content": text}]
    path = "/v1/chat/completions" if flavor == "openai" else "/v1/messages"
    response = httpx.post(url + path, headers=headers, timeout=120,
                          json={"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages})
    assert response.status_code == 200, response.text
    h = response.headers
    return sum(int(h[f"x-kvmem-tokens-{k}"]) for k in ("reused", "prefilled", "generated")) - 1


def _answers_write_behind(http: httpx.Client, cache_dir: Path, agent: Agent, header: str | None) -> None:
    """Some answer of ``agent`` arrives before its cache is on disk, and the cache lands there afterwards.

    A durable answer never can (its save comes first); a write-behind save lands 2-30 ms after the
    answer, so one of a few turns read the disk before it (the disk is read at once, in this process).
    """
    early = []
    for _ in range(6):
        done = turn(http, agent, header=header, max_tokens=MAX_TOKENS)
        early.append(stored_tokens(cache_dir, agent.agent_id) < done.cache_tokens)
        wait_saved(cache_dir, agent.agent_id, done.cache_tokens)  # write-behind still saves
        if early[-1]:
            return
    raise AssertionError(f"{agent.agent_id} ({header=}): every answer found its cache on disk already: {early}")


def test_a_default_answer_arrives_with_its_cache_already_on_disk_and_the_opt_outs_do_not_wait(
        tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    with kvmem_serve(*_serve_args(cache_dir), env=_env(tmp_path / "home")) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        for stream in (False, True):  # the agents API, a response and a stream's done event; no header
            agent = Agent(f"default-{'stream' if stream else 'plain'}", SEED_TEXT)
            for _ in range(2):  # cold, then hot
                done = turn(http, agent, header=None, stream=stream, max_tokens=MAX_TOKENS)
                assert stored_tokens(cache_dir, agent.agent_id) >= done.cache_tokens, (stream, done.usage)
        for flavor in ("openai", "anthropic"):
            for k in range(2):
                tokens = _chat_turn(server.url, flavor, f"{flavor}-agent", f"Turn {k}. " + SEED_TEXT, None)
                assert stored_tokens(cache_dir, f"{flavor}-agent") >= tokens, flavor
        # the request's opt-out: answered write-behind
        _answers_write_behind(http, cache_dir, Agent("header-false", SEED_TEXT), "false")

    with kvmem_serve(*_serve_args(cache_dir, "--no-durable"), env=_env(tmp_path / "home")) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        _answers_write_behind(http, cache_dir, Agent("no-durable", SEED_TEXT), None)  # the operator's opt-out
        agent = Agent("opt-in", SEED_TEXT)
        for stream in (False, True, False):  # X-Kvmem-Durable: true on a --no-durable server
            done = turn(http, agent, header="true", stream=stream, max_tokens=MAX_TOKENS)
            assert stored_tokens(cache_dir, agent.agent_id) >= done.cache_tokens, (stream, done.usage)
        tokens = _chat_turn(server.url, "openai", "openai-opt-in", SEED_TEXT, "true")
        assert stored_tokens(cache_dir, "openai-opt-in") >= tokens


def test_a_bad_durable_header_is_a_400_in_each_apis_error_shape(tmp_path: Path) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}
    bad = {"X-Kvmem-Durable": "maybe", "X-Agent-ID": "bad-header"}
    with kvmem_serve(*_serve_args(tmp_path / "cache"), env=_env(tmp_path / "home")) as server:
        openai = httpx.post(server.url + "/v1/chat/completions", json=body, headers=bad, timeout=60)
        anthropic = httpx.post(server.url + "/v1/messages", json=body, headers=bad, timeout=60)
        agents = httpx.post(server.url + "/v1/agents/bad-header/messages", json={"prompt": "Hi.", "max_tokens": 4},
                            headers=bad, timeout=60)
        listed = httpx.get(server.url + "/v1/agents", timeout=60).json()
    assert openai.status_code == anthropic.status_code == agents.status_code == 400
    error = openai.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "X-Kvmem-Durable",
                                                              "invalid_value")
    assert "maybe" in error["message"]
    shaped = anthropic.json()
    assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
    assert "X-Kvmem-Durable" in shaped["error"]["message"]
    error = agents.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request", "X-Kvmem-Durable", "invalid_value")
    assert listed["data"] == []  # refused before any turn ran


def test_kill_9_the_moment_a_default_answer_arrives_loses_no_turn(tmp_path: Path) -> None:
    schedule = [DURABLE_DEFAULT, STREAM_DURABLE, DURABLE_OPT_IN, DURABLE_DEFAULT]
    out = kill_trials(schedule, cache_dir=tmp_path / "cache", home=str(models_dir().parent), max_tokens=MAX_TOKENS)
    print(out)
    assert len(out.trials) == len(schedule) and all(t.durable for t in out.trials)
    assert [t for t in out.trials if t.lost] == []
    assert out.disagreements == []
    assert all(t.cache_tokens > t.previous_tokens for t in out.trials)  # each turn had something to lose
