"""Prompt text for scenario turns, rendered from one agent's perspective.

An agent's conversation is a chat message list that only ever grows::

    system     its system prompt (the scenario ``context`` first)
    user       phase 1, first turn: "[label]", opening, its own prompt, what others said so far
    assistant  its reply, exactly as the runtime returned it
    user       what the others said since (or the phase's cue)
    assistant  ...
    user       phase 2, first turn: "[label]", opening, ...   <- appended, never rewritten

Because earlier messages are never changed, the rendered prompt of every turn
— across phases too — begins with exactly the text the agent's cache covers
(previous prompt + reply), and the runtime extends the cache instead of
recomputing it (``usage.match == "extend"``).

Only messages of phases the agent may see ever enter its list: lines of the
current phase (it takes part) and ``${phase.messages[agent]}`` references,
which validation allows only for phases visible to the agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from actors.scenario.spec import PhaseSpec, ScenarioSpec, TemplateRef, template_refs

__all__ = ["Line", "render_transcript", "render_template", "turn_message", "lines_since"]


class Line(Protocol):
    """A spoken line of a transcript (:class:`actors.scenario.state.ScenarioTurn` is one)."""

    @property
    def phase(self) -> str: ...

    @property
    def agent(self) -> str: ...

    @property
    def reply(self) -> str: ...


def _said(text: str) -> str:
    return text.strip() or "(says nothing)"


def render_transcript(spec: ScenarioSpec, lines: Sequence[Line], perspective: str) -> str:
    """``Name: text`` lines, with ``perspective``'s own lines as ``You: text``."""
    out = []
    for line in lines:
        who = "You" if line.agent == perspective else spec.display(line.agent)
        out.append(f"{who}: {_said(line.reply)}")
    return "\n".join(out) if out else "(nothing was said)"


def render_template(
    spec: ScenarioSpec, template: str, *, reader: str, transcripts: Mapping[str, Sequence[Line]]
) -> str:
    """Substitute every ``${phase.messages[agent]}`` of ``template``.

    Args:
        reader: the agent whose prompt this is; every referenced phase must be
            visible to it (validation guarantees it, this re-checks).
        transcripts: the lines of every finished phase, by phase name.

    Raises:
        PermissionError: a reference to a phase ``reader`` may not see.
    """
    out: list[str] = []
    pos = 0
    for ref in template_refs(template):
        if not isinstance(ref, TemplateRef):
            continue  # rejected by validation
        phase = spec.phase(ref.phase)
        if not phase.can_see(reader) or not phase.can_see(ref.agent):
            raise PermissionError(f"{reader!r} may not see phase {ref.phase!r}")
        out.append(template[pos : ref.start].replace("$${", "${"))
        out.append(render_transcript(spec, transcripts.get(ref.phase, ()), ref.agent))
        pos = ref.end
    out.append(template[pos:].replace("$${", "${"))
    return "".join(out)


def lines_since(phase_lines: Sequence[Line], agent: str) -> list[Line]:
    """The lines of others said after ``agent``'s last line (all of them if it has not spoken)."""
    last = max((i for i, line in enumerate(phase_lines) if line.agent == agent), default=-1)
    return [line for line in phase_lines[last + 1 :] if line.agent != agent]


def turn_message(
    spec: ScenarioSpec,
    phase: PhaseSpec,
    agent: str,
    *,
    phase_lines: Sequence[Line],
    transcripts: Mapping[str, Sequence[Line]],
) -> str:
    """The user message of ``agent``'s next turn in ``phase``.

    At its first turn of the phase: the phase label, the opening, its own
    prompt and what the others said before it (the cue when that is all
    empty); later: what the others said since its last turn, or the phase's
    cue when nobody did.
    """
    first = all(line.agent != agent for line in phase_lines)
    heard = "\n".join(f"{spec.display(line.agent)}: {_said(line.reply)}" for line in lines_since(phase_lines, agent))
    if not first:
        return heard or phase.cue
    parts = [f"[{phase.title}]"]
    for template in (phase.opening, phase.prompts.get(agent, "")):
        text = render_template(spec, template, reader=agent, transcripts=transcripts).strip()
        if text:
            parts.append(text)
    if heard or len(parts) == 1:
        parts.append(heard or phase.cue)
    return "\n\n".join(parts)
