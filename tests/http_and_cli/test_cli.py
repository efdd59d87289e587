"""`kvmem chat` keeps an agent's conversation and cache across separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kvmem(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVMEM_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_chat_resumes_agent_from_disk_in_a_new_process(tmp_path):
    model = ["--model", "tiny-llama", "--max-tokens", "12"]
    first = _kvmem(tmp_path, "chat", "--agent", "alice", "--json", *model, "Hello, who are you?")
    assert first.returncode == 0, first.stderr
    turn1 = json.loads(first.stdout)
    assert set(turn1) == {"agent", "reply", "model", "finish_reason", "usage"} and turn1["agent"] == "alice"
    assert set(turn1["usage"]) >= {"tokens_reused", "tokens_prefilled", "tokens_generated", "tier", "ttft_ms"}
    turn1 = turn1["usage"]
    assert turn1["tier"] == "cold" and turn1["tokens_reused"] == 0

    second = _kvmem(tmp_path, "chat", "--agent", "alice", "--json", *model, "Tell me more.")
    assert second.returncode == 0, second.stderr
    turn2 = json.loads(second.stdout)["usage"]
    assert turn2["tier"] == "warm"
    assert turn2["tokens_reused"] >= turn1["tokens_prefilled"] + turn1["tokens_generated"] - 1
    assert turn2["tokens_prefilled"] < turn2["tokens_reused"]

    sampled = [*model, "--temperature", "1", "--seed", "9", "Hello, who are you?"]
    other = _kvmem(tmp_path, "chat", "--agent", "bob", "--json", *sampled)
    assert json.loads(other.stdout)["usage"]["tier"] == "cold"  # agents never share caches by name
    twin = _kvmem(tmp_path, "chat", "--agent", "dave", "--json", *sampled)
    assert json.loads(twin.stdout)["reply"] == json.loads(other.stdout)["reply"]  # the same seed, the same draws

    listing = _kvmem(tmp_path, "agents", "--json")
    rows = {r["agent"]: r for r in json.loads(listing.stdout)}
    assert rows["alice"]["turns"] == 2 and rows["alice"]["cached_tokens"] > 0 and rows["alice"]["disk_bytes"] > 0

    assert _kvmem(tmp_path, "forget", "alice").returncode == 0
    rows = {r["agent"] for r in json.loads(_kvmem(tmp_path, "agents", "--json").stdout)}
    assert rows == {"bob", "dave"}
    again = json.loads(_kvmem(tmp_path, "chat", "--agent", "alice", "--json", *model, "Hi").stdout)
    assert again["usage"]["tier"] == "cold"


def test_interactive_session_serves_later_turns_hot(tmp_path):
    env = {**os.environ, "KVMEM_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "chat", "--agent", "carol", "--json", "--model", "tiny-llama",
         "--max-tokens", "8"],
        input="First message\nSecond message\n", capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    turns = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [t["usage"]["tier"] for t in turns] == ["cold", "hot"]
    assert turns[1]["usage"]["tokens_reused"] > 0


def test_unknown_model_is_a_clear_error(tmp_path):
    proc = _kvmem(tmp_path, "chat", "--agent", "x", "--model", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 2
    assert "could not load model" in proc.stderr


def test_version_names_the_installed_package(capsys):
    from importlib import metadata

    from gateway.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvmem {metadata.version('kvmem')}"


def test_kvmem_forget_takes_every_id_a_client_can_create(tmp_path):
    """Issue 58, item 3: an id with ``/``, ``%`` or spaces made by a chat is listed and forgotten by the CLI."""
    model = ["--model", "tiny-llama", "--max-tokens", "2", "--json"]
    ids = ["team/alice", "50% off", "a b"]
    for agent in ids:
        made = _kvmem(tmp_path, "chat", "--agent", agent, *model, "Hello.")
        assert made.returncode == 0, made.stderr
    assert {r["agent"] for r in json.loads(_kvmem(tmp_path, "agents", "--json").stdout)} == set(ids)
    for agent in ids:
        gone = _kvmem(tmp_path, "forget", agent)
        assert gone.returncode == 0 and gone.stdout.strip() == f"forgot {agent}", (gone.stdout, gone.stderr)
    assert json.loads(_kvmem(tmp_path, "agents", "--json").stdout) == []
    refused = _kvmem(tmp_path, "chat", "--agent", "..", *model, "Hello.")
    assert refused.returncode == 2 and "no URL can name" in refused.stderr, refused.stderr
