"""The scenario file format: msgspec structs, decoding and validation.

A scenario is a YAML file (shipped ones live in ``actors/scenario/library/``)::

    name: gossip                 # identity: permanent agents' caches are scenario:<name>:<agent>
    title: Gossip Network
    max_tokens: 24               # reply length (a phase may override it)
    context: |                   # optional text every agent's system prompt starts with
      ...                        # (a shared document: its KV blocks are shared between agents)
    agents:
      alice:
        name: Alice              # display name, used in transcripts ("Alice: ...")
        system: You are Alice...
        lifecycle: permanent     # permanent (default): cache survives the run | ephemeral
    phases:
      - name: alice_bob          # an identifier: templates refer to it
        label: "Phase 1: Alice & Bob (private)"
        agents: [alice, bob]
        turn_order: [bob, alice] # one round; default: the agents' order
        rounds: 3
        opening: Alice and Bob meet...   # shown to every participant at its first turn
        prompts:                 # per-agent text, shown to that agent only
          alice: "From your chat with Bob: ${alice_bob.messages[alice]}"
        visible_to: [...]        # who else may see this phase's messages (its agents always do)
        public: false            # true: part of the public transcript, visible to all

``${phase.messages[agent]}`` (in ``opening`` and ``prompts``) is phase
``phase``'s transcript seen from ``agent`` (its own lines as ``You``); ``$${``
is a literal ``${``. :func:`load_scenario` rejects, naming the problem, an
unknown agent, a reference to an unknown phase or to one that does not come
earlier (a dependency cycle), and a reference that would show a phase to an
agent outside its ``visible_to``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from runtime.errors import KvmemError

__all__ = [
    "AgentSpec",
    "PhaseSpec",
    "ScenarioSpec",
    "ScenarioError",
    "TemplateRef",
    "load_scenario",
    "decode_scenario",
    "validate_scenario",
    "template_refs",
    "check_scenario",
]

Identifier = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=64)]
ScenarioName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=64)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=8192)]
Lifecycle = Literal["permanent", "ephemeral"]


class ScenarioError(KvmemError, ValueError):
    """A scenario file that cannot be decoded or is inconsistent; the message names every problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"invalid scenario {source}:\n{lines}" if len(problems) > 1 else f"invalid scenario {source}: {problems[0]}"
        )


class AgentSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One agent: display name, system prompt and lifecycle."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    system: str = ""
    lifecycle: Lifecycle = "permanent"


class PhaseSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One phase: who takes part, in which order, for how many rounds, and what they are told."""

    name: Identifier
    agents: Annotated[list[Identifier], msgspec.Meta(min_length=1)]
    label: str = ""
    rounds: Annotated[int, msgspec.Meta(ge=1, le=100)] = 1
    turn_order: list[Identifier] | None = None
    opening: str = ""
    prompts: dict[Identifier, str] = {}
    cue: str = "(It is your turn.)"
    visible_to: list[Identifier] | None = None
    public: bool = False
    max_tokens: MaxTokens | None = None

    @property
    def title(self) -> str:
        return self.label or self.name

    @property
    def order(self) -> list[str]:
        """The speakers of one round, in order."""
        return list(self.turn_order) if self.turn_order is not None else list(self.agents)

    def schedule(self) -> list[tuple[int, str]]:
        """Every turn of the phase as ``(round, agent)``, rounds counted from 1."""
        return [(r, a) for r in range(1, self.rounds + 1) for a in self.order]

    def can_see(self, agent: str) -> bool:
        """Whether ``agent`` may see this phase's messages (it takes part, is in ``visible_to``, or it is public)."""
        return self.public or agent in self.agents or agent in (self.visible_to or ())

    def audience(self, all_agents: list[str]) -> list[str]:
        """The agents that may see this phase's messages (``visible_to``)."""
        if self.public:
            return list(all_agents)
        return list(dict.fromkeys([*self.agents, *(self.visible_to or [])]))


class ScenarioSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole scenario file (see the module docstring)."""

    name: ScenarioName
    agents: Annotated[dict[Identifier, AgentSpec], msgspec.Meta(min_length=1)]
    phases: Annotated[list[PhaseSpec], msgspec.Meta(min_length=1)]
    title: str = ""
    description: str = ""
    context: str = ""
    max_tokens: MaxTokens = 48
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] = 0.0

    def phase(self, name: str) -> PhaseSpec:
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(name)

    def phase_index(self, name: str) -> int:
        return [p.name for p in self.phases].index(name)

    def display(self, key: str) -> str:
        return self.agents[key].name

    def permanent(self, key: str) -> bool:
        return self.agents[key].lifecycle == "permanent"

    def system_prompt(self, key: str) -> str:
        """The agent's system message: the shared ``context`` first (so agents share its blocks), then its own."""
        parts = [p.strip("\n") for p in (self.context, self.agents[key].system) if p.strip()]
        return "\n\n".join(parts)


@dataclass(frozen=True)
class TemplateRef:
    """One ``${phase.messages[agent]}`` in a template."""

    text: str
    phase: str
    agent: str
    start: int
    end: int


_REF = re.compile(r"\$(\$?)\{([^}]*)\}")
_REF_BODY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\.messages\[\s*([A-Za-z_][A-Za-z0-9_]*)\s*\]\s*$")


def template_refs(template: str) -> Iterator[TemplateRef | str]:
    """Yield each reference of ``template`` as a :class:`TemplateRef`, or a malformed one as its text.

    Escaped references (``$${...}``) are skipped.
    """
    for m in _REF.finditer(template):
        if m.group(1):
            continue
        body = _REF_BODY.match(m.group(2))
        if body is None:
            yield m.group(0)
        else:
            yield TemplateRef(text=m.group(0), phase=body.group(1), agent=body.group(2), start=m.start(), end=m.end())
    stripped = _REF.sub("", template)
    if "${" in stripped:
        yield "${" + stripped.split("${", 1)[1][:30] + " (no closing '}')"


def decode_scenario(text: str, *, source: str = "<string>") -> ScenarioSpec:
    """Parse YAML and decode it into a :class:`ScenarioSpec` (types and limits only).

    Raises:
        ScenarioError: not YAML, or a field of the wrong type or out of range
            (the message names its path, e.g. ``$.phases[0].rounds``).
    """
    import yaml

    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(source, [f"not valid YAML: {exc}"]) from None
    except RecursionError:
        raise ScenarioError(source, ["the YAML nests too deeply to be read"]) from None
    if not isinstance(data, dict):
        raise ScenarioError(source, ["expected a mapping with 'name', 'agents' and 'phases' at the top level"])
    try:
        return msgspec.convert(data, ScenarioSpec)
    except msgspec.ValidationError as exc:
        raise ScenarioError(source, [str(exc)]) from None


def check_scenario(spec: ScenarioSpec) -> tuple[list[str], list[str]]:
    """Cross-field checks: ``(problems, warnings)``; a scenario with problems cannot run."""
    problems: list[str] = []
    warnings: list[str] = []
    keys = list(spec.agents)
    known = ", ".join(keys)
    seen: dict[str, int] = {}
    for index, phase in enumerate(spec.phases):
        where = f"phase {phase.name!r}"
        if phase.name in seen:
            problems.append(f"{where}: duplicate phase name (also phase #{seen[phase.name] + 1})")
        seen.setdefault(phase.name, index)
        for field, names in (
            ("agents", phase.agents),
            ("turn_order", phase.turn_order or []),
            ("visible_to", phase.visible_to or []),
            ("prompts", list(phase.prompts)),
        ):
            for key in names:
                if key not in spec.agents:
                    problems.append(f"{where}: unknown agent {key!r} in {field} (agents: {known})")
        if len(set(phase.agents)) != len(phase.agents):
            problems.append(f"{where}: an agent is listed twice in agents")
        for field, names in (("turn_order", phase.turn_order or []), ("prompts", list(phase.prompts))):
            for key in names:
                if key in spec.agents and key not in phase.agents:
                    problems.append(
                        f"{where}: {key!r} is in {field} but does not take part (agents: {', '.join(phase.agents)})"
                    )
        if phase.turn_order is not None:
            for key in phase.agents:
                if key not in phase.turn_order:
                    problems.append(f"{where}: agent {key!r} takes part but never speaks (missing from turn_order)")
        templates = [("opening", phase.opening, list(phase.agents))]
        templates += [(f"prompt for {key!r}", text, [key]) for key, text in phase.prompts.items()]
        for label, template, readers in templates:
            problems += _check_template(spec, index, f"{where}, {label}", template, readers, warnings)
    return problems, warnings


def _check_template(
    spec: ScenarioSpec, index: int, where: str, template: str, readers: list[str], warnings: list[str]
) -> list[str]:
    problems = []
    names = [p.name for p in spec.phases]
    phase = spec.phases[index]
    for ref in template_refs(template):
        if isinstance(ref, str):
            problems.append(f"{where}: bad template reference {ref!r} (expected ${{phase.messages[agent]}})")
            continue
        if ref.phase not in names:
            problems.append(f"{where}: {ref.text} names unknown phase {ref.phase!r} (phases: {', '.join(names)})")
            continue
        target_index = names.index(ref.phase)
        target = spec.phases[target_index]
        if target_index >= index:
            relation = "itself" if target_index == index else "a later phase"
            problems.append(
                f"{where}: {ref.text} makes phase {phase.name!r} depend on phase {ref.phase!r} ({relation}): "
                "a dependency cycle; a template may only use phases that come before it"
            )
            continue
        if ref.agent not in spec.agents:
            problems.append(f"{where}: {ref.text} names unknown agent {ref.agent!r} (agents: {', '.join(spec.agents)})")
            continue
        if not target.can_see(ref.agent):
            problems.append(
                f"{where}: {ref.text}: {ref.agent!r} cannot see phase {ref.phase!r} "
                f"(visible to {', '.join(target.audience(list(spec.agents)))})"
            )
        for reader in readers:
            if reader in spec.agents and not target.can_see(reader):
                problems.append(
                    f"{where}: {ref.text} would show private phase {ref.phase!r} to {reader!r} "
                    f"(visible to {', '.join(target.audience(list(spec.agents)))})"
                )
            elif reader in target.agents and reader in spec.agents and spec.permanent(reader):
                warnings.append(
                    f"{where}: {ref.text} re-injects phase {ref.phase!r}, which {reader!r} took part in and "
                    "already remembers (its cache covers it): those tokens are prefilled again"
                )
    return problems


def validate_scenario(spec: ScenarioSpec, *, source: str = "<string>") -> list[str]:
    """Raise :class:`ScenarioError` when ``spec`` has problems; return its warnings."""
    problems, warnings = check_scenario(spec)
    if problems:
        raise ScenarioError(source, problems)
    return warnings


def load_scenario(text: str, *, source: str = "<string>") -> ScenarioSpec:
    """Decode and validate a scenario file's text.

    Raises:
        ScenarioError: the file is not a valid scenario (the message names each problem).
    """
    spec = decode_scenario(text, source=source)
    validate_scenario(spec, source=source)
    return spec
