"""The scenario format: decoding, validation messages, template rendering and visibility (no model)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.scenario.catalog import library_names, library_text, resolve_scenario
from actors.scenario.prompts import render_template, turn_message
from actors.scenario.report import visible_turns
from actors.scenario.runner import agent_id_for, new_run_state
from actors.scenario.spec import ScenarioError, check_scenario, load_scenario
from actors.messages_common import TurnUsage
from actors.scenario.state import STATE_VERSION, RunOptions, ScenarioTurn, load_state, save_state

BASE = """
name: test
agents:
  alice: {name: Alice, system: You are Alice.}
  bob: {name: Bob, system: You are Bob.}
  eve: {name: Eve, system: You are Eve.}
phases:
"""


def _load(phases: str) -> object:
    return load_scenario(BASE + textwrap.indent(textwrap.dedent(phases), "  "), source="test.yaml")


def _problem(phases: str) -> str:
    with pytest.raises(ScenarioError) as info:
        _load(phases)
    return str(info.value)


def test_every_shipped_scenario_validates_without_warnings():
    assert {"gossip", "prisoners_dilemma", "design_review"} <= set(library_names())
    for name in library_names():
        spec = load_scenario(library_text(name), source=name)
        problems, warnings = check_scenario(spec)
        assert (problems, warnings) == ([], []), name


def test_seed_scenarios_have_the_seed_shape():
    gossip = load_scenario(library_text("gossip"))
    assert list(gossip.agents) == ["alice", "bob", "eve"] and len(gossip.phases) == 3
    pd = load_scenario(library_text("prisoners_dilemma"))
    assert [p.name for p in pd.phases] == ["room_a", "room_b", "yard", "final_reckoning", "verdict"]
    assert pd.agents["analyst"].lifecycle == "ephemeral"
    assert all(pd.permanent(k) for k in ("warden", "marco", "danny"))
    review = load_scenario(library_text("design_review"))
    assert len(review.context) > 4000  # the long shared document


def test_unknown_agent_in_a_phase_is_rejected_naming_phase_and_agent():
    message = _problem(
        """
        - name: chat
          agents: [alice, zed]
        """
    )
    assert "phase 'chat'" in message and "unknown agent 'zed'" in message and "agents: alice, bob, eve" in message


def test_unknown_agent_in_turn_order_and_prompts_is_rejected():
    message = _problem(
        """
        - name: chat
          agents: [alice, bob]
          turn_order: [bob, alice, mallory]
          prompts: {trent: hello}
        """
    )
    assert "unknown agent 'mallory' in turn_order" in message
    assert "unknown agent 'trent' in prompts" in message


def test_bad_template_references_are_rejected_naming_the_reference():
    message = _problem(
        """
        - name: first
          agents: [alice, bob]
        - name: second
          agents: [alice, bob]
          prompts:
            alice: "${first.msgs[alice]} and ${first.messages[alice]"
            bob: "${nowhere.messages[bob]} ${first.messages[zed]}"
        """
    )
    assert "bad template reference '${first.msgs[alice]}'" in message
    assert "no closing '}'" in message
    assert "unknown phase 'nowhere'" in message
    assert "unknown agent 'zed'" in message


def test_a_reference_to_a_later_phase_or_itself_is_a_cycle_naming_both_phases():
    message = _problem(
        """
        - name: early
          agents: [alice, bob]
          opening: "Later, this will happen: ${late.messages[alice]}"
        - name: late
          agents: [alice, bob]
          prompts:
            bob: "${late.messages[bob]}"
        """
    )
    assert "phase 'early' depend on phase 'late' (a later phase): a dependency cycle" in message
    assert "phase 'late' depend on phase 'late' (itself): a dependency cycle" in message


def test_a_reference_that_would_leak_a_private_phase_is_rejected():
    message = _problem(
        """
        - name: alice_eve
          agents: [alice, eve]
        - name: reunion
          agents: [alice, bob, eve]
          prompts:
            bob: "${alice_eve.messages[alice]}"
        """
    )
    assert "would show private phase 'alice_eve' to 'bob' (visible to alice, eve)" in message


def test_visible_to_grants_an_observer_and_public_phases_are_visible_to_all():
    spec = _load(
        """
        - name: private
          agents: [alice, bob]
          visible_to: [eve]
        - name: open
          agents: [alice, bob]
          public: true
        - name: later
          agents: [eve]
          prompts:
            eve: "${private.messages[eve]} / ${open.messages[alice]}"
        """
    )
    assert spec.phases[0].audience(list(spec.agents)) == ["alice", "bob", "eve"]


def test_type_errors_and_unknown_fields_name_their_path():
    assert "$.phases[0].rounds" in _problem(
        """
        - name: chat
          agents: [alice]
          rounds: three
        """
    )
    assert "auto_rounds" in _problem(
        """
        - name: chat
          agents: [alice]
          auto_rounds: 3
        """
    )
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario("name: [unclosed", source="x")


def _line(phase: str, agent: str, reply: str, index: int = 0) -> ScenarioTurn:
    return ScenarioTurn(
        index=index,
        phase=phase,
        round=1,
        agent=agent,
        agent_id=agent,
        lifecycle="permanent",
        reply=reply,
        finish_reason="stop",
        prompt_messages=2,
        usage=TurnUsage(tokens_reused=0, tokens_prefilled=1, tokens_generated=1, tier="cold", match="empty",
                        queue_wait_ms=0, ttft_ms=0, decode_tps=0),
        wall_ms=0,
        visible_to=[],
        public=False,
    )


def test_templates_render_from_the_agents_perspective_with_its_own_lines_as_you():
    spec = load_scenario(library_text("prisoners_dilemma"))
    lines = [_line("final_reckoning", "warden", " Decide. "), _line("final_reckoning", "marco", "I stay silent.")]
    text = render_template(
        spec, "${final_reckoning.messages[marco]}", reader="marco", transcripts={"final_reckoning": lines}
    )
    assert text == "Warden: Decide.\nYou: I stay silent."
    as_analyst = render_template(
        spec, spec.phase("verdict").prompts["analyst"], reader="analyst", transcripts={"final_reckoning": lines}
    )
    assert "Warden: Decide.\nMarco: I stay silent." in as_analyst
    with pytest.raises(PermissionError):
        render_template(spec, "${room_a.messages[marco]}", reader="danny", transcripts={})


def test_turn_messages_hold_the_phase_intro_once_then_only_what_others_said():
    spec = load_scenario(library_text("gossip"))
    phase = spec.phase("alice_bob")
    first_bob = turn_message(spec, phase, "bob", phase_lines=[], transcripts={})
    assert first_bob.startswith("[Phase 1: Alice & Bob (private)]") and "break room" in first_bob
    lines = [_line("alice_bob", "bob", "Psst.")]
    first_alice = turn_message(spec, phase, "alice", phase_lines=lines, transcripts={})
    assert first_alice.endswith("Bob: Psst.") and "break room" in first_alice
    lines.append(_line("alice_bob", "alice", "Tell me!"))
    assert turn_message(spec, phase, "bob", phase_lines=lines, transcripts={}) == "Alice: Tell me!"


def test_views_never_show_a_private_phase_to_the_public_or_to_an_outsider():
    spec = load_scenario(library_text("gossip"))
    state = new_run_state(spec, "", source="x", options=RunOptions(model="m"))
    for i, (phase, agent) in enumerate([("alice_bob", "bob"), ("alice_eve", "eve"), ("reunion", "alice")]):
        p = spec.phase(phase)
        record = _line(phase, agent, f"line {i}", i)
        record.visible_to, record.public = p.audience(list(spec.agents)), p.public
        state.turns.append(record)
    assert [t.phase for t in visible_turns(spec, state, "public")] == ["reunion"]
    assert [t.phase for t in visible_turns(spec, state, "bob")] == ["alice_bob", "reunion"]
    assert [t.phase for t in visible_turns(spec, state, "eve")] == ["alice_eve", "reunion"]
    assert len(visible_turns(spec, state, "full")) == 3


def test_cache_keys_are_identities_for_permanent_agents_and_per_run_for_ephemeral_ones():
    spec = load_scenario(library_text("prisoners_dilemma"))
    assert agent_id_for(spec, "run-1", "warden") == "scenario:prisoners_dilemma:warden"
    assert agent_id_for(spec, "run-1", "analyst") == "scenario:run-1:analyst"


def test_resolve_scenario_accepts_a_path_or_a_shipped_name(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(library_text("gossip"))
    assert resolve_scenario(str(path))[1] == str(path)
    assert resolve_scenario("gossip")[1] == "library:gossip"
    with pytest.raises(FileNotFoundError, match="shipped: "):
        resolve_scenario("no-such-scenario")


def test_cli_validate_names_the_problem_and_fails(tmp_path, capsys):
    from gateway.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE + "  - {name: chat, agents: [alice, zed]}\n")
    assert main(["scenario", "validate", str(bad)]) == 1
    assert "unknown agent 'zed'" in capsys.readouterr().err
    assert main(["scenario", "validate", "gossip", "prisoners_dilemma"]) == 0
    assert main(["scenario", "list"]) == 0
    assert "prisoners_dilemma" in capsys.readouterr().out


def test_the_scenario_gateway_modules_do_not_import_mlx():
    code = (
        "import sys, gateway.scenario_routes, gateway.cli_scenario, actors.scenario.runner, actors.scenario.report;"
        "print([m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "[]"


def test_an_escaped_reference_stays_literal_text():
    spec = load_scenario(library_text("gossip"))
    lines = [_line("alice_bob", "bob", "costs $${x}")]
    text = render_template(
        spec, "$${alice_bob.messages[bob]} = ${alice_bob.messages[bob]}", reader="bob", transcripts={"alice_bob": lines}
    )
    assert text == "${alice_bob.messages[bob]} = You: costs $${x}"


def test_a_run_state_of_version_1_is_read_with_each_turns_usage_nested(tmp_path):
    """A run saved before the usage record was nested (its fields flat on each turn and its cold replay)
    resumes: it is read as the current version, numbers unchanged."""
    text = library_text("gossip")
    state = new_run_state(load_scenario(text), text, source="gossip", options=RunOptions(model="tiny-llama"))
    state.turns.append(_line("alice_bob", "alice", "Hello.", index=0))
    save_state(tmp_path, state)
    raw = json.loads((tmp_path / "state.json").read_text())
    turn = raw["turns"][0]
    turn.update(turn.pop("usage") | {"tokens_reused": 7, "ttft_ms": 12.5})
    turn["cold"] = {"tokens_prefilled": 40, "tokens_generated": 1, "ttft_ms": 90.0, "wall_ms": 95.0}
    raw["version"] = 1
    (tmp_path / "state.json").write_text(json.dumps(raw))

    upgraded = load_state(tmp_path)
    assert upgraded.version == STATE_VERSION == 2
    line = upgraded.turns[0]
    assert (line.usage.tokens_reused, line.usage.tokens_prefilled, line.usage.ttft_ms, line.usage.tier) == (
        7, 1, 12.5, "cold")
    assert line.cold is not None and line.cold.wall_ms == 95.0
    assert (line.cold.usage.tokens_prefilled, line.cold.usage.tokens_generated, line.cold.usage.ttft_ms) == (40, 1, 90.0)
    raw["version"] = 3
    (tmp_path / "state.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="state version 3"):
        load_state(tmp_path)
