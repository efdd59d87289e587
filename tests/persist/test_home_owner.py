"""One owner per home, and ``forget`` from any door reaches the running server (issue 32, items 1 and 2).

Before: ``kvmem forget x`` while ``kvmem serve`` ran on the same home removed the files but
the server kept x hot, served its next turn from it and saved it again; two servers could
share one home, and one's clean-up removed the other's half-written files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fake_engine import FakeEngine
from serve_process import home_env, kvmem_cli, kvmem_serve

from actors import open_runtime
from actors.control import ForgetRequest, ListRequest, ask_owner
from runtime.persist import CacheDirectory
from runtime.errors import DirectoryInUseError
from runtime.persist.owner import CONTROL_NAME, LOCK_NAME, OwnerLock, read_owner

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Remember the number 7 and the colour blue, please."}]



def _turn(url: str, agent: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", headers={"X-Agent-ID": agent}, timeout=120,
                          json={"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": messages})
    assert response.status_code == 200, response.text
    h = response.headers
    return {"tier": h["x-kvmem-tier"], "reused": int(h["x-kvmem-tokens-reused"]),
            "reply": response.json()["choices"][0]["message"]["content"]}


# -- the lock ------------------------------------------------------------------------


def test_a_second_lock_on_one_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with OwnerLock(tmp_path, command="kvmem serve"):
        with pytest.raises(DirectoryInUseError, match=rf"pid {os.getpid()} \(kvmem serve"):
            OwnerLock(tmp_path)
    with OwnerLock(tmp_path):  # released: the next one takes it
        pass


def test_kill_9_releases_the_lock_and_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from runtime.persist.owner import OwnerLock; "
         "lock = OwnerLock(sys.argv[1], command='holder'); print('held', flush=True); time.sleep(600)",
         str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUseError, match=rf"pid {holder.pid} \(holder"):
            OwnerLock(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (tmp_path / LOCK_NAME).exists()  # the file stays; the kernel's lock is what counted
    with OwnerLock(tmp_path) as lock:
        assert read_owner(tmp_path) == lock.info


async def test_a_second_runtime_on_a_home_is_refused_and_leaves_the_owners_temp_files(tmp_path: Path) -> None:
    async with open_runtime(engine=FakeEngine(), home=tmp_path, model="fake", prefetch_mb=0) as rt:
        await rt.agent("a").send(HELLO)
        await rt.flush()
        half_written = tmp_path / "caches" / "agents" / "a" / "seg-x.safetensors.123.tmp"
        half_written.write_bytes(b"a save in progress")
        with pytest.raises(DirectoryInUseError, match=rf"pid {os.getpid()}"):
            async with open_runtime(engine=FakeEngine(), home=tmp_path, model="fake"):
                pass  # pragma: no cover
        CacheDirectory(tmp_path / "caches")  # a tool opening the directory outside the runtime
        # Opening a cache directory removes a killed save's temp files: only its owner may.
        assert half_written.exists()
    CacheDirectory(tmp_path / "caches")  # owned by nobody now: a killed save's leftovers go
    assert not half_written.exists()


async def test_forget_through_the_control_socket_reaches_hot_and_unsaved_copies(tmp_path: Path) -> None:
    async with open_runtime(engine=FakeEngine(), home=tmp_path, model="fake", prefetch_mb=0) as rt:
        first = await rt.agent("x").send(HELLO)
        assert first.usage.tier == "cold"
        owner = read_owner(tmp_path / "caches")
        assert owner is not None and owner.pid == os.getpid()
        assert owner.control == str(tmp_path / "caches" / CONTROL_NAME)
        listed = await ask_owner(owner, ListRequest())
        assert [r.agent_id for r in listed.agents] == ["x"] and listed.agents[0].hot
        assert (await ask_owner(owner, ForgetRequest(agent_id="x"))).existed
        again = await rt.agent("x").send(HELLO)
        assert (again.usage.tier, again.usage.tokens_reused) == ("cold", 0)
        bad = await ask_owner(owner, ForgetRequest(agent_id=""))
        assert bad.kind == "InvalidAgentIdError"
    assert read_owner(tmp_path / "caches") is None  # released: nothing claims the home
    assert not (tmp_path / "caches" / CONTROL_NAME).exists()


def test_cli_forget_and_chat_reach_a_live_server_and_a_second_server_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    args = ("--model", MODEL, "--port", "0", "--host", "127.0.0.1")
    with kvmem_serve(*args, env=home_env(home)) as server:
        # (issue 33) the backend profile, one line at start
        assert sum(line.startswith("kvmem: backend ") and " policy)" in line for line in server.log) == 1, server.log
        first = _turn(server.url, "x", HELLO)
        assert first["tier"] == "cold"
        hello2 = [*HELLO, {"role": "assistant", "content": first["reply"]}, {"role": "user", "content": "And?"}]
        assert _turn(server.url, "x", hello2)["tier"] == "hot"
        _turn(server.url, "keep", HELLO)
        listed = kvmem_cli(home, "agents", "--json", "--model", MODEL)  # listed by the server, hot ones too
        assert listed.returncode == 0, listed.stderr
        assert {row["agent"] for row in json.loads(listed.stdout)} == {"x", "keep"}

        forgot = kvmem_cli(home, "forget", "x", "--model", MODEL)
        assert forgot.returncode == 0, forgot.stderr
        assert forgot.stdout.strip() == "forgot x"
        assert {row["agent"] for row in json.loads(kvmem_cli(home, "agents", "--json").stdout)} == {"keep"}
        after = _turn(server.url, "x", hello2)
        assert after["tier"] in ("cold", "shared")  # its own cache is gone (keep's prefix, HELLO, may be shared)
        kvmem_cli(home, "forget", "x")  # and forget the turn just made, for the restart below

        pid = server.process.pid if server.process else None
        refused = kvmem_cli(home, "serve", *args)
        assert refused.returncode == 2
        assert f"pid {pid}" in refused.stderr and "in use" in refused.stderr, refused.stderr
        # the refusal as docs/reliability.md shows it: one line, no traceback
        assert "Traceback" not in refused.stderr and "Exception" not in refused.stderr, refused.stderr
        assert refused.stderr.splitlines()[-1].startswith("kvmem: the cache directory"), refused.stderr

        # (issue 59) kvmem chat beside the server runs its turns in the server's runtime, on its caches
        chat = kvmem_cli(home, "chat", "--agent", "y", "--model", MODEL, "--max-tokens", "3", "hi")
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip() and "[y] tier=cold" in chat.stderr, (chat.stdout, chat.stderr)
        again = kvmem_cli(home, "chat", "--agent", "y", "--model", MODEL, "--max-tokens", "3", "--json", "and then?")
        assert again.returncode == 0, again.stderr
        turn = json.loads(again.stdout)["usage"]
        assert turn["tier"] == "hot" and turn["tokens_reused"] > 0, turn  # the server's hot cache of y
        assert (home / "conversations").is_dir() and any((home / "conversations").glob("y*.json"))
        assert "y" in {row["agent"] for row in json.loads(kvmem_cli(home, "agents", "--json").stdout)}
        kvmem_cli(home, "forget", "y")
    with kvmem_serve(*args, env=home_env(home)) as server:  # after a restart: still forgotten, the other kept
        after = _turn(server.url, "x", hello2)
        assert after["tier"] in ("cold", "shared")  # its own cache is gone (keep's prefix, HELLO, may be shared)
        assert _turn(server.url, "keep", HELLO)["tier"] == "warm"


def test_cli_forget_without_a_server_still_works_and_reports_a_missing_agent(tmp_path: Path) -> None:
    home = tmp_path / "home"
    missing = kvmem_cli(home, "forget", "nobody")
    assert missing.returncode == 1 and "no agent named 'nobody'" in missing.stderr


async def test_a_holder_without_a_control_socket_is_named_by_pid(tmp_path: Path) -> None:
    from gateway.cli_chat import _forget_agent  # noqa: PLC2701 - the CLI's own forget
    from runtime.config import Config

    with OwnerLock(tmp_path / "caches", command="kvmem chat"):
        # (a safety, well short of the 60 s a control socket is given: none was waited for)
        with trio.fail_after(30), pytest.raises(DirectoryInUseError, match=rf"pid {os.getpid()} \(kvmem chat"):
            await _forget_agent(Config(home=tmp_path), "x")
        await trio.lowlevel.checkpoint()


async def test_a_tenants_cli_forget_reaches_the_runtime_that_holds_the_home(tmp_path: Path) -> None:
    from gateway.cli_chat import _forget_agent, _list_agents  # noqa: PLC2701 - the CLI's own commands
    from runtime.config import Config
    from runtime.identity import namespaced

    async with open_runtime(engine=FakeEngine(), home=tmp_path, model="fake", prefetch_mb=0) as rt:
        await rt.agent(namespaced("acme", "x")).send(HELLO)
        await rt.agent("x").send(HELLO)  # the same name without a tenant is another agent
        # The CLI's own functions, in this process: the lock is refused here too, so they ask
        # the holder through its socket like a second process would.
        assert [r.agent for r in await _list_agents(Config(home=tmp_path), "acme")] == ["x"]
        assert await _forget_agent(Config(home=tmp_path), "x", "acme")
        assert not await _forget_agent(Config(home=tmp_path), "x", "acme")
        again = await rt.agent(namespaced("acme", "x")).send(HELLO)
        assert (again.usage.tier, again.usage.tokens_reused) == ("cold", 0)
        assert [r.agent_id for r in await rt.list_agents()] == ["x"]  # the tenant-less x is kept
