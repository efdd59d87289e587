"""Scenarios on a real tiny model: visibility, cross-phase cache extension, identity keys, resume, cold replay.

Replies of random-weight models are not meaningful text, so "text of a phase"
is checked as the lines the phase's transcript injects (``Name: reply``) that
occur nowhere an agent may legitimately see, plus the phase's own opening.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import models_dir
from serve_process import SMALL_SCENARIO

from actors import open_runtime
from actors.scenario.catalog import library_text
from actors.scenario.report import build_report, transcript_markdown, write_outputs
from actors.scenario.runner import ScenarioRunner, new_run_state
from actors.scenario.spec import ScenarioSpec, load_scenario
from actors.scenario.state import RunOptions, RunState, load_state
from runtime.persist import CacheDirectory

MODEL = "tiny-llama"


def _open(home: Path, **kw: Any):
    return open_runtime(model=MODEL, home=home, models_dir=models_dir(), fsync=False, handle_signals=False, **kw)


class SpyRuntime:
    """Passes everything to the runtime and records every message list each agent id was sent."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.sent: dict[str, list[list[dict[str, str]]]] = defaultdict(list)

    def agent(self, agent_id: str, **kw: Any) -> Any:
        handle = self.rt.agent(agent_id, **kw)
        sent = self.sent[agent_id]

        class Handle:
            async def send(self, messages: Any, **options: Any) -> Any:
                sent.append(copy.deepcopy(list(messages)))
                return await handle.send(messages, **options)

            async def forget(self) -> bool:
                return await handle.forget()

        return Handle()

    async def flush(self) -> int:
        return await self.rt.flush()

    def stats(self) -> Any:
        return self.rt.stats()


def _run(
    home: Path, name: str, *, max_tokens: int | None = None, compare_cold: bool = False, stop_after: str | None = None
) -> tuple[ScenarioSpec, RunState, SpyRuntime]:
    text = library_text(name)
    spec = load_scenario(text, source=name)
    state = new_run_state(
        spec, text, source=name, options=RunOptions(model=MODEL, max_tokens=max_tokens, compare_cold=compare_cold)
    )
    spy: list[SpyRuntime] = []

    async def main() -> None:
        async with _open(home) as rt:
            spy.append(SpyRuntime(rt))
            await ScenarioRunner(spy[0], spec, state, run_dir=home / "run", stop_after=stop_after).run()  # type: ignore[arg-type]

    trio.run(main)
    return spec, state, spy[0]


@pytest.fixture(scope="module")
def gossip(tmp_path_factory: pytest.TempPathFactory) -> tuple[ScenarioSpec, RunState, SpyRuntime, Path]:
    home = tmp_path_factory.mktemp("gossip")
    spec, state, spy = _run(home, "gossip")  # the file's own max_tokens
    return spec, state, spy, home


def _prompt_text(spy: SpyRuntime, agent_id: str) -> str:
    return "\n".join(m["content"] for messages in spy.sent[agent_id] for m in messages)


def _private_lines(spec: ScenarioSpec, state: RunState, phase: str, outsider: str) -> list[str]:
    """The lines ``phase`` would inject (``Name: reply``) that ``outsider`` cannot legitimately have seen."""
    legit = [f"{spec.display(t.agent)}: {t.reply.strip()}" for t in state.turns if outsider in t.visible_to]
    legit += [t.reply.strip() for t in state.turns if t.agent == outsider]
    lines = [
        f"{spec.display(t.agent)}: {t.reply.strip()}" for t in state.phase_turns(phase) if len(t.reply.strip()) >= 8
    ]
    return [line for line in lines if not any(line in seen for seen in legit)]


def test_gossip_bob_never_sees_the_alice_eve_phase_and_eve_never_sees_alice_bob(gossip):
    spec, state, spy, home = gossip
    assert state.status == "done" and len(state.turns) == 18
    caches = CacheDirectory(home / "caches", fsync=False)
    tag = caches.list_agents()[0].model_tag
    for outsider, private in (("bob", "alice_eve"), ("eve", "alice_bob")):
        agent_id = state.agents[outsider].agent_id
        prompts = _prompt_text(spy, agent_id)
        cached = caches.load(agent_id, model_tag=tag).text  # its working memory, as stored on disk
        phase = spec.phase(private)
        lines = _private_lines(spec, state, private, outsider)
        assert lines, "no distinctive line to look for"
        for needle in [phase.opening.strip(), phase.title, *lines]:
            assert needle not in prompts, (outsider, needle)
            assert needle not in cached, (outsider, needle)
        # ...while what it did see is there, with its own lines in its memory
        seen = [
            t for t in state.turns if t.agent != outsider and outsider in t.visible_to and len(t.reply.strip()) >= 8
        ]
        assert any(f"{spec.display(t.agent)}: {t.reply.strip()}" in prompts for t in seen)
    public = transcript_markdown(spec, state, "public")
    for private in ("alice_bob", "alice_eve"):
        assert spec.phase(private).title not in public
        for line in _private_lines(spec, state, private, "nobody"):
            assert line.split(": ", 1)[1] not in public


def test_gossip_alice_reunion_turn_reuses_over_90_percent_of_its_prompt(gossip):
    spec, state, spy, home = gossip
    first = next(t for t in state.turns if t.phase == "reunion" and t.agent == "alice")
    assert (first.usage.tier, first.usage.match) == ("hot", "extend")
    assert first.usage.reuse_fraction > 0.90, first.usage


def test_every_later_prompt_of_a_permanent_agent_begins_with_exactly_its_cached_text(gossip):
    """Across phases too: the prompt extends the previous prompt + reply, so the turn
    reuses every cached token (all but the reply's last sampled token, whose KV was never computed)."""
    spec, state, spy, home = gossip
    for agent in spec.agents:
        turns = [t for t in state.turns if t.agent == agent]
        assert turns[0].usage.tier == "cold"
        for before, turn in zip(turns, turns[1:], strict=False):
            assert turn.usage.match == "extend", (agent, turn.phase, turn.round)
            cached = before.usage.prompt_tokens + before.usage.tokens_generated - 1
            assert turn.usage.tokens_reused == cached, (agent, turn.index)
        sent = spy.sent[state.agents[agent].agent_id]
        for earlier, later in zip(sent, sent[1:], strict=False):
            assert later[: len(earlier)] == earlier  # the conversation only ever grows


def test_permanent_agents_keep_identity_cache_keys_after_the_run(gossip):
    spec, state, spy, home = gossip
    ids = {entry.agent_id for entry in CacheDirectory(home / "caches", fsync=False).list_agents()}
    assert {"scenario:gossip:alice", "scenario:gossip:bob", "scenario:gossip:eve"} <= ids


def test_prisoners_dilemma_compartments_memory_and_forgets_the_ephemeral_analyst(tmp_path):
    spec, state, spy = _run(tmp_path, "prisoners_dilemma", max_tokens=4)
    assert state.status == "done" and len(state.turns) == 23
    ids = {entry.agent_id for entry in CacheDirectory(tmp_path / "caches", fsync=False).list_agents()}
    assert {f"scenario:prisoners_dilemma:{k}" for k in ("warden", "marco", "danny")} <= ids
    assert not any(":analyst" in i for i in ids)  # the ephemeral agent is forgotten
    assert state.agents["analyst"].agent_id == f"scenario:{state.run_id}:analyst"
    warden = _prompt_text(spy, "scenario:prisoners_dilemma:warden")
    marco = _prompt_text(spy, "scenario:prisoners_dilemma:marco")
    danny = _prompt_text(spy, "scenario:prisoners_dilemma:danny")
    analyst = _prompt_text(spy, state.agents["analyst"].agent_id)
    assert spec.phase("yard").opening.strip() not in warden
    assert spec.phase("room_b").opening.strip() not in marco
    assert spec.phase("room_a").opening.strip() not in danny
    assert spec.phase("room_a").opening.strip() not in analyst
    for phase, outsider, prompts in (
        ("yard", "warden", warden),
        ("room_b", "marco", marco),
        ("room_a", "danny", danny),
    ):
        for line in _private_lines(spec, state, phase, outsider):
            assert line not in prompts, (outsider, line)
    # The analyst reads the final reckoning (visible_to grants it), nothing else.
    reckoning = [t for t in state.phase_turns("final_reckoning") if t.reply.strip()]
    assert all(f"{spec.display(t.agent)}: {t.reply.strip()}" in analyst for t in reckoning)
    for private in ("room_a", "room_b", "yard"):
        for line in _private_lines(spec, state, private, "analyst"):
            assert line not in analyst
    # The warden's phase-2 and phase-4 prompts extend its cache; the report says so.
    rows = {(r.agent, r.phase): r for r in build_report(spec, state).rows}
    assert rows[("warden", "room_b")].first_match == "extend"
    assert rows[("warden", "final_reckoning")].first_match == "extend"
    assert rows[("marco", "yard")].first_match == "extend"
    public = transcript_markdown(spec, state, "public")
    assert "Phase 5: The verdict" in public and "Room A" not in public and "Final reckoning" not in public




async def test_compare_cold_replays_the_same_prompts_from_no_cache(tmp_path):
    text = SMALL_SCENARIO
    spec = load_scenario(text)
    state = new_run_state(spec, text, source="small", options=RunOptions(model=MODEL, max_tokens=6, compare_cold=True))
    async with _open(tmp_path) as rt:
        spy = SpyRuntime(rt)
        await ScenarioRunner(spy, spec, state, run_dir=tmp_path / "run").run()  # type: ignore[arg-type]
    assert state.status == "done" and state.cold_wall_s is not None
    for t in state.turns:
        assert t.cold is not None and t.cold.usage.tokens_generated == t.usage.tokens_generated
        assert t.cold.usage.tokens_prefilled >= t.usage.prompt_tokens - 2 * t.index  # the whole prompt, re-tokenized
        cold_id = f"scenario:{state.run_id}:cold:{t.index}"
        assert spy.sent[cold_id] == [
            spy.sent[t.agent_id][[x.index for x in state.turns if x.agent == t.agent].index(t.index)]
        ]
    ids = {entry.agent_id for entry in CacheDirectory(tmp_path / "caches", fsync=False).list_agents()}
    assert not any(":cold:" in i or ":judge" in i for i in ids)
    report = build_report(spec, state)
    assert report.cold_wall_s is not None and report.prefilled < report.prompt_tokens
    files = {p.name for p in write_outputs(tmp_path / "run", spec, state, plot=False)}
    assert {"transcript.md", "transcript.json", "public.md", "public.json", "report.md", "report.json"} <= files
    text = (tmp_path / "run" / "report.md").read_text()
    assert "cold recompute" in text and "replays the cached run's prompts" in text
    public = json.loads((tmp_path / "run" / "public.json").read_text())
    assert {line["phase"] for line in public["lines"]} == {"verdict"}


async def test_a_run_stopped_between_phases_resumes_after_a_restart_with_warm_caches(tmp_path):
    text = library_text("gossip")
    spec = load_scenario(text)
    state = new_run_state(spec, text, source="gossip", options=RunOptions(model=MODEL, max_tokens=8))
    run_dir = tmp_path / "run"
    async with _open(tmp_path) as rt:
        await ScenarioRunner(rt, spec, state, run_dir=run_dir, stop_after="alice_bob").run()
    assert state.status == "stopped" and state.phases_done == ["alice_bob"]

    saved = load_state(run_dir)  # a new runtime, as after a server restart
    assert saved.agents["alice"].messages == state.agents["alice"].messages
    async with _open(tmp_path) as rt:
        await ScenarioRunner(rt, spec, saved, run_dir=run_dir).run()
    assert saved.status == "done" and len(saved.turns) == 18
    alice_before = [t for t in saved.turns if t.agent == "alice" and t.phase == "alice_bob"][-1]
    alice = next(t for t in saved.turns if t.agent == "alice" and t.phase == "alice_eve")
    assert (alice.usage.tier, alice.usage.match) == ("warm", "extend")
    assert alice.usage.tokens_reused == alice_before.usage.prompt_tokens + alice_before.usage.tokens_generated - 1
    bob = next(t for t in saved.turns if t.agent == "bob" and t.phase == "reunion")
    assert (bob.usage.tier, bob.usage.match) == ("warm", "extend")
    assert all(t.usage.tier == "hot" for t in saved.phase_turns("reunion") if t.agent != "bob" or t.round > 1)


async def test_the_long_shared_document_is_prefilled_once_and_shared(tmp_path):
    text = library_text("design_review")
    spec = load_scenario(text)
    state = new_run_state(spec, text, source="design_review", options=RunOptions(model=MODEL, max_tokens=3))
    async with _open(tmp_path) as rt:
        await ScenarioRunner(rt, spec, state, stop_after="sidebar").run()
    first = state.phase_turns("first_read")
    assert first[0].usage.tier == "cold" and first[0].usage.prompt_tokens > 2000
    assert [t.usage.tier for t in first[1:]] == ["shared", "shared"]  # the document's blocks come from the first reviewer
    assert all(t.usage.tokens_reused >= 1024 for t in first[1:])
    later = [t for t in state.turns if t.phase != "first_read" and t.lifecycle == "permanent"]
    assert all(t.usage.match == "extend" and t.usage.reuse_fraction > 0.9 for t in later)


def test_cli_run_stop_and_resume_in_a_new_runtime(tmp_path, capsys):
    from gateway.cli import main

    out = tmp_path / "run"
    common = ["--model", MODEL, "--home", str(tmp_path), "--no-plot"]
    (tmp_path / "models").mkdir()
    for built in models_dir().glob(f"{MODEL}-*"):
        (tmp_path / "models" / built.name).symlink_to(built)
    assert (
        main(
            ["scenario", "run", "gossip", "--out", str(out), "--max-tokens", "4", "--stop-after", "alice_eve", *common]
        )
        == 0
    )
    first = capsys.readouterr()
    assert "Phase 1: Alice & Bob" in first.out and "reused" in first.out and "prefilled" in first.out
    assert "kvmem scenario resume" in first.err
    assert load_state(out).status == "stopped"
    assert main(["scenario", "resume", str(out), *common]) == 0
    second = capsys.readouterr().out
    assert "Phase 3: Reunion" in second and " warm " in second and "Phase 1" not in second
    assert load_state(out).status == "done"
    for name in ("transcript.md", "transcript.json", "public.md", "report.md", "report.json"):
        assert (out / name).is_file()


def test_cli_run_refused_at_start_is_marked_failed_not_running(tmp_path, capsys):
    """A run that cannot open its runtime (another process holds the home) says so in one line and is left
    ``failed`` with the reason, not ``running`` forever in ``GET /v1/scenarios`` and the operator page."""
    from gateway.cli import main
    from runtime.persist.owner import OwnerLock

    out = tmp_path / "run"
    with OwnerLock(tmp_path / "caches", command="kvmem serve"):
        code = main(["scenario", "run", "gossip", "--out", str(out), "--model", MODEL, "--home", str(tmp_path),
                     "--no-plot", "--max-tokens", "4"])
    assert code == 2
    err = capsys.readouterr().err
    assert "in use by" in err and "Traceback" not in err, err
    state = load_state(out)
    assert state.status == "failed" and "in use by" in state.error, (state.status, state.error)
