"""``kvmem chat`` and ``kvmem serve`` are one turn path: same replies, tiers and token accounting.

The same three-turn conversation (tiny-llama, greedy) goes through both:

* chat: turn 1 in one process (cold); turns 2 and 3 in a second, interactive
  process (turn 2 warm from disk, turn 3 hot);
* serve: turn 1 on a server (OpenAI ``/v1/chat/completions``, ``X-Agent-ID``),
  which is then stopped (SIGTERM flushes); turns 2 and 3 on a restarted server.

Each turn must give the same reply text, tier, prefix match and reused /
prefilled / generated token counts on both paths. Both read one configuration
the same way (here ``KVMEM_MODELS_DIR`` and ``KVMEM_PREWARM_MB`` from the
environment, the rest from flags).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from conftest import models_dir
from serve_process import kvmem_serve

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
MAX_TOKENS = 10
SYSTEM = "You are a terse assistant."
MESSAGES = ["Remember the number 7 and the colour blue.", "Which number did I give you?", "And the colour?"]
KEYS = ("reply", "tier", "match", "tokens_reused", "tokens_prefilled", "tokens_generated", "finish_reason")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    return {**env, "KVMEM_HOME": str(home), "KVMEM_MODELS_DIR": str(models_dir()), "KVMEM_PREWARM_MB": "0"}


def _chat(home: Path, *, message: str | None = None, stdin: str | None = None) -> list[dict[str, Any]]:
    args = ["chat", "--agent", "alice", "--json", "--model", MODEL, "--max-tokens", str(MAX_TOKENS),
            "--system", SYSTEM]
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", *args, *([message] if message else [])],
                          input=stdin, capture_output=True, text=True, env=_env(home), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    turns = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [{**turn, **turn.pop("usage")} for turn in turns]  # the usage record's fields beside the reply


def _completion(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One OpenAI turn as agent alice, in the shape of ``kvmem chat --json`` (checked against the usage block)."""
    response = httpx.post(
        url + "/v1/chat/completions",
        headers={"X-Agent-ID": "alice"},
        json={"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body, h = response.json(), response.headers
    turn = {
        "reply": body["choices"][0]["message"]["content"],
        "tier": h["x-kvmem-tier"],
        "match": h["x-kvmem-match"],
        "tokens_reused": int(h["x-kvmem-tokens-reused"]),
        "tokens_prefilled": int(h["x-kvmem-tokens-prefilled"]),
        "tokens_generated": int(h["x-kvmem-tokens-generated"]),
        "finish_reason": body["choices"][0]["finish_reason"],
    }
    usage = body["usage"]
    assert usage["prompt_tokens"] == turn["tokens_reused"] + turn["tokens_prefilled"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == turn["tokens_reused"]
    assert usage["completion_tokens"] == turn["tokens_generated"]
    return turn


def test_chat_and_serve_give_the_same_turns_cold_warm_and_hot(tmp_path: Path) -> None:
    chat = _chat(tmp_path / "chat", message=MESSAGES[0])
    chat += _chat(tmp_path / "chat", stdin="\n".join(MESSAGES[1:]) + "\n")  # a new process, interactive

    served: list[dict[str, Any]] = []
    messages = [{"role": "system", "content": SYSTEM}]
    for run in (MESSAGES[:1], MESSAGES[1:]):  # a restart between turn 1 and turn 2
        with kvmem_serve("--model", MODEL, "--port", "0", env=_env(tmp_path / "serve")) as server:
            url = server.url
            for text in run:
                messages.append({"role": "user", "content": text})
                served.append(_completion(url, messages))
                messages.append({"role": "assistant", "content": served[-1]["reply"]})

    assert [t["tier"] for t in chat] == ["cold", "warm", "hot"]
    assert chat[1]["tokens_reused"] >= chat[0]["tokens_prefilled"] + chat[0]["tokens_generated"] - 1
    for i, (c, s) in enumerate(zip(chat, served, strict=True)):
        c = {**c, "finish_reason": "length" if c["finish_reason"] == "length" else "stop"}  # OpenAI's two reasons
        assert {k: c[k] for k in KEYS} == s, f"turn {i + 1}"
    conversation = json.loads((tmp_path / "chat" / "conversations" / "alice.json").read_text())
    assert conversation["messages"] == messages  # the conversation the CLI kept is the one the client sent
