"""A scenario run's state: what it takes to resume it and to report on it.

The runner rewrites ``state.json`` in the run folder (atomically) after every
turn, so a run interrupted anywhere — between phases, or by a crash or Ctrl-C
mid-phase — resumes from its next turn. The state holds the scenario's source
text (a resumed run does not depend on the file still being there), each
agent's conversation exactly as it was sent (the prompts of its next turns
must extend it character for character) and every turn's reply and cache
statistics.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from actors.messages_common import TurnUsage
from runtime.persist.files import write_atomic

__all__ = [
    "STATE_FILE",
    "STATE_VERSION",
    "RunStatus",
    "ScenarioTurn",
    "ColdTurn",
    "AgentMemory",
    "RunOptions",
    "RunState",
    "new_run_id",
    "save_state",
    "load_state",
]

STATE_FILE = "state.json"
STATE_VERSION = 2
"""2: a turn's usage nested as :class:`actors.messages_common.TurnUsage` (1: its fields copied flat; read and
upgraded)."""
# Version 1's flat names as they were (not TurnUsage's own fields, which may grow).
_USAGE_FIELDS = ("tokens_reused", "tokens_prefilled", "tokens_generated", "tier", "match", "queue_wait_ms",
                 "ttft_ms", "decode_tps")

RunStatus = Literal["running", "stopped", "interrupted", "failed", "done"]


class ColdTurn(msgspec.Struct, kw_only=True):
    """The same turn replayed from no cache (``--compare-cold``): its usage and its wall time."""

    usage: TurnUsage
    wall_ms: float


class ScenarioTurn(msgspec.Struct, kw_only=True):
    """One turn: who spoke where, what it said, and its usage (the record every API reports).

    Attributes:
        index: the turn's number in the whole run (from 0).
        prompt_messages: how many messages of the agent's conversation the
            prompt held (the cold comparison replays exactly these).
        visible_to: the agents that may see this line; ``public`` lines also
            appear in the public transcript.
        wall_ms: the turn's wall time as the client saw it (submit to reply).
    """

    index: int
    phase: str
    round: int
    agent: str
    agent_id: str
    lifecycle: str
    reply: str
    finish_reason: str
    prompt_messages: int
    usage: TurnUsage
    wall_ms: float
    visible_to: list[str]
    public: bool
    cold: ColdTurn | None = None


class AgentMemory(msgspec.Struct, kw_only=True):
    """An agent's conversation as sent so far: its cache covers the rendering of ``messages``."""

    key: str
    agent_id: str
    lifecycle: str
    messages: list[dict[str, str]] = []


class RunOptions(msgspec.Struct, kw_only=True):
    """How the run was started (kept so ``resume`` continues the same way).

    Attributes:
        model: the model the turns ran on (for the record).
        request_model: a configured model name each turn asks for (None: the
            runtime's default model).
    """

    model: str
    request_model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    compare_cold: bool = False
    command: str = ""


class RunState(msgspec.Struct, kw_only=True):
    """Everything about one run (see the module docstring)."""

    run_id: str
    scenario: str
    title: str
    source: str
    scenario_text: str
    options: RunOptions
    agents: dict[str, AgentMemory]
    version: int = STATE_VERSION
    status: RunStatus = "running"
    error: str = ""
    phase_index: int = 0
    turn_in_phase: int = 0
    turns: list[ScenarioTurn] = []
    phases_done: list[str] = []
    started_at: float = msgspec.field(default_factory=time.time)
    finished_at: float | None = None
    sessions: int = 1
    forgot_ephemeral: bool = False
    cold_wall_s: float | None = None
    environment: dict[str, Any] = {}

    def phase_turns(self, phase: str) -> list[ScenarioTurn]:
        return [t for t in self.turns if t.phase == phase]

    @property
    def wall_s(self) -> float:
        """Sum of the turns' wall times (the cached run, excluding model load and restarts)."""
        return sum(t.wall_ms for t in self.turns) / 1000.0


def new_run_id(scenario: str) -> str:
    """``<scenario>-<UTC time>-<random>``: sortable, unique, safe as a folder and agent-id part."""
    return f"{scenario}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


_encoder = msgspec.json.Encoder()


def save_state(run_dir: Path, state: RunState) -> None:
    """Write ``run_dir/state.json`` so a crash leaves the old file or the new one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / STATE_FILE, msgspec.json.format(_encoder.encode(state), indent=1))


def load_state(run_dir: Path) -> RunState:
    """Read a run's saved state (one of version 1 upgraded as it is read).

    Raises:
        FileNotFoundError: no ``state.json`` in ``run_dir``.
        ValueError: the file is not a run state of this version or the one before.
    """
    path = run_dir / STATE_FILE if run_dir.is_dir() or not run_dir.name.endswith(".json") else run_dir
    try:
        raw = msgspec.json.decode(path.read_bytes())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        version = raw.get("version", STATE_VERSION)
        if version == 1:
            raw = _upgraded_from_1(raw)
        elif version != STATE_VERSION:
            raise ValueError(f"{path}: state version {version}, expected {STATE_VERSION}")
        return msgspec.convert(raw, RunState)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a scenario run state ({exc})") from None


def _upgraded_from_1(raw: dict[str, Any]) -> dict[str, Any]:
    """A version 1 state as version 2: each turn's usage fields (and its cold replay's) nested."""
    turns = []
    for turn in raw.get("turns", []):
        turn = dict(turn)
        turn["usage"] = {name: turn.pop(name) for name in _USAGE_FIELDS}
        cold = turn.get("cold")
        if cold is not None:  # version 1 kept only these of the cold replay's usage
            turn["cold"] = {"wall_ms": cold["wall_ms"], "usage": {
                "tokens_reused": 0, "tokens_prefilled": cold["tokens_prefilled"],
                "tokens_generated": cold["tokens_generated"], "tier": "cold", "match": "empty",
                "queue_wait_ms": 0.0, "ttft_ms": cold["ttft_ms"], "decode_tps": 0.0}}
        turns.append(turn)
    return {**raw, "turns": turns, "version": STATE_VERSION}
