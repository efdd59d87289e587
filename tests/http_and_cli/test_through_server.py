"""One home, one server, every command (issue 59, item 1).

With ``kvmem serve`` holding a home, ``kvmem scenario run`` / ``resume``, ``kvmem chat`` and a
program's ``open_runtime`` act through the server (``actors.owner_client``) instead of stopping at
the lock: each is run here against a live server started with ``--api-key`` (the control socket
needs no key: the file system decides who may connect) and alone on a home of its own, and
their output, exit codes and every turn's reply and accounting agree. That the turns ran in the
server, not in a runtime of the command's own, shows in the server's own listing of its agents.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import models_dir
from serve_process import SMALL_SCENARIO, ServeProcess, home_env, kvmem_cli, kvmem_serve

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
KEY = "K-issue-59"
PROGRAM = """
import trio
from actors import open_runtime

async def main() -> None:
    async with open_runtime(model="tiny-llama", prewarm_mb=0) as rt:
        print(type(rt).__name__)
        alice = rt.agent("alice")
        messages = [{"role": "user", "content": "Log: fog at dawn."}]
        first = await alice.send(messages, max_tokens=6)
        print("send", first.usage.tier, first.usage.tokens_prefilled, repr(first.reply))
        messages += [{"role": "assistant", "content": first.reply}, {"role": "user", "content": "Log: wind."}]
        async with alice.stream(messages, max_tokens=6) as stream:
            deltas = [delta async for delta in stream]
        usage = stream.result.usage
        print("stream", usage.tier, usage.tokens_reused, usage.tokens_prefilled, repr("".join(deltas)))
        print("forget", await rt.agent("alice").forget())
        bob = rt.agent("bob")  # two samples with their logprobs, streamed (issue 59, item 4)
        texts = {}
        async with bob.stream(messages[:1], max_tokens=4, temperature=1.0, seed=3, n=2, logprobs=1) as stream:
            async for index, item in stream.choices():
                texts[index] = texts.get(index, "") + item
        results = (stream.result, *stream.result.samples)
        print("samples", texts == {i: r.content for i, r in enumerate(results)}, len(results),
              [len(r.logprobs) for r in results], repr(texts))
        print("forget", await bob.forget())

trio.run(main)
"""



@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    """A live ``kvmem serve --api-key`` on a home of its own: (the server, its home)."""
    home = tmp_path_factory.mktemp("served")
    with kvmem_serve("--model", MODEL, "--port", "0", "--api-key", KEY, env=home_env(home)) as server:
        yield server, home


def _server_agents(server: ServeProcess) -> dict[str, dict[str, Any]]:
    response = httpx.get(server.url + "/v1/agents", headers={"x-api-key": KEY}, timeout=30)
    assert response.status_code == 200, response.text
    return {row["id"]: row for row in response.json()["data"]}


def _with_models(home: Path) -> None:
    """A home whose ``models/`` is the suite's built models (a program's ``open_runtime`` reads only the home)."""
    home.mkdir(mode=0o700, exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(models_dir(), target_is_directory=True)


def _steady(text: str) -> str:
    """A command's output without what differs from run to run: timings, run ids and folders, and the
    model load's progress (alone, the command loads the model; the server has it loaded)."""
    text = re.sub(r"^kvmem: load(ing|ed) .*\n", "", text, flags=re.M)
    text = re.sub(r"ttft=\S+", "ttft=T", text)
    text = re.sub(r'"(ttft_ms|queue_wait_ms|decode_tps)": [\d.eE+-]+', r'"\1": T', text)
    text = re.sub(r"\d+(\.\d+)?( ?ms| s\b)", "T", text)
    text = re.sub(r"small-\S+", "RUN", text)
    text = re.sub(r"run-(alone|served)", "run-X", text)
    return re.sub(r" +", " ", text)  # columns padded to the timings' widths


def _turns(run: Path) -> list[tuple[Any, ...]]:
    state = json.loads((run / "state.json").read_text())
    return [(t["phase"], t["agent"], t["usage"]["match"], t["usage"]["tokens_reused"], t["usage"]["tokens_prefilled"],
             t["usage"]["tokens_generated"], t["reply"]) for t in state["turns"]]


def test_scenario_run_and_resume_through_a_keyed_server_match_the_run_alone(
        served: tuple[ServeProcess, Path], tmp_path: Path) -> None:
    server, served_home = served
    (tmp_path / "small.yaml").write_text(SMALL_SCENARIO)
    scenario = str(tmp_path / "small.yaml")
    common = ("--model", MODEL, "--max-tokens", "4", "--no-plot")
    runs: dict[str, tuple[Path, list[subprocess.CompletedProcess[str]]]] = {}
    _with_models(tmp_path / "alone")
    for where, home in (("alone", tmp_path / "alone"), ("served", served_home)):
        out = tmp_path / f"run-{where}"
        stopped = kvmem_cli(home, "scenario", "run", scenario, "--out", str(out), "--stop-after", "talk", *common)
        assert stopped.returncode == 0, stopped.stderr
        assert "continue with: kvmem scenario resume" in stopped.stderr
        assert json.loads((out / "state.json").read_text())["status"] == "stopped"
        resumed = kvmem_cli(home, "scenario", "resume", str(out), "--no-plot")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads((out / "state.json").read_text())["status"] == "done"
        runs[where] = (out, [stopped, resumed])

    # The turns ran in the server: its runtime lists the permanent agents (hot), as it would a client's.
    agents = _server_agents(server)
    assert {"scenario:small:alice", "scenario:small:bob"} <= set(agents), agents
    assert "in use" not in runs["served"][1][0].stderr

    alone, served_run = _turns(runs["alone"][0]), _turns(runs["served"][0])
    assert len(alone) == 5 and served_run == alone  # replies, matches and token counts, turn by turn
    # Tiers agree but where the server kept a cache hot that a resumed process reads from disk.
    tiers = {w: [t["usage"]["tier"] for t in json.loads((runs[w][0] / "state.json").read_text())["turns"]]
             for w in runs}
    assert [("warm" if t == "hot" else t) for t in tiers["served"]] == \
        [("warm" if t == "hot" else t) for t in tiers["alone"]], tiers
    for alone_done, served_done in zip(runs["alone"][1], runs["served"][1], strict=True):
        steady_alone, steady_served = _steady(alone_done.stdout), _steady(served_done.stdout)
        assert steady_served.replace(" hot ", " warm ") == steady_alone.replace(" hot ", " warm "), \
            (alone_done.stdout, served_done.stdout)


def test_a_program_and_kvmem_chat_beside_a_keyed_server_run_there_as_they_run_alone(
        served: tuple[ServeProcess, Path], tmp_path: Path) -> None:
    server, served_home = served
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    printed = {}
    _with_models(tmp_path / "alone")
    for where, home in (("alone", tmp_path / "alone"), ("served", served_home)):
        ran = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=home_env(home),
                             cwd=ROOT, timeout=300)
        assert ran.returncode == 0, ran.stderr
        printed[where] = ran.stdout.splitlines()
    assert printed["alone"][0] == "Runtime" and printed["served"][0] == "OwnerClient"
    assert printed["served"][1:] == printed["alone"][1:]  # the same replies, tiers (cold, hot) and counts
    assert printed["served"][1].startswith("send cold") and printed["served"][2].startswith("stream hot")
    assert printed["served"][3] == "forget True"
    assert printed["served"][4].startswith("samples True 2 ") and printed["served"][5] == "forget True"

    chats: dict[str, list[subprocess.CompletedProcess[str]]] = {}
    for where, home in (("alone", tmp_path / "alone"), ("served", served_home)):
        chats[where] = [
            kvmem_cli(home, "chat", "--agent", "y", "--model", MODEL, "--max-tokens", "3", "hi"),
            kvmem_cli(home, "chat", "--agent", "y", "--model", MODEL, "--max-tokens", "3", "--json", "and then?"),
        ]
        if where == "served":
            assert "y" in _server_agents(server)  # the server ran y's turns
        listed = kvmem_cli(home, "agents", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = [row for row in json.loads(listed.stdout) if row["agent"] == "y"]
        assert len(rows) == 1 and rows[0].pop("disk_bytes") > 0  # (a manifest's few bytes vary run to run)
        chats[where].append(subprocess.CompletedProcess(listed.args, 0, json.dumps(rows), ""))
        chats[where] += [kvmem_cli(home, "forget", "y"), kvmem_cli(home, "forget", "y")]
    for alone_done, served_done in zip(chats["alone"], chats["served"], strict=True):
        assert served_done.returncode == alone_done.returncode, (alone_done, served_done)
        # A new process reads y's cache from disk (warm) where the server kept it hot.
        assert _steady(served_done.stdout).replace('"hot"', '"warm"') == _steady(alone_done.stdout)
        assert _steady(served_done.stderr).replace("tier=hot", "tier=warm") == _steady(alone_done.stderr)
    assert [c.returncode for c in chats["served"]] == [0, 0, 0, 0, 1]
    assert json.loads(chats["served"][1].stdout)["usage"]["tier"] == "hot"
    assert "y" not in _server_agents(server)
