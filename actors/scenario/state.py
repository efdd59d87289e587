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
STATE_VERSION = 1

RunStatus = Literal["running", "stopped", "interrupted", "failed", "done"]


class ColdTurn(msgspec.Struct, kw_only=True):
    """The same turn replayed from no cache (``--compare-cold``)."""

    tokens_prefilled: int
    tokens_generated: int
    ttft_ms: float
    wall_ms: float


class ScenarioTurn(msgspec.Struct, kw_only=True):
    """One turn: who spoke where, what it said, and its cache statistics.

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
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    tier: str
    match: str
    ttft_ms: float
    queue_wait_ms: float
    decode_tps: float
    wall_ms: float
    visible_to: list[str]
    public: bool
    cold: ColdTurn | None = None

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the whole prompt: what a turn without any cache prefills."""
        return self.tokens_reused + self.tokens_prefilled

    @property
    def reuse_fraction(self) -> float:
        return self.tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0


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
_decoder = msgspec.json.Decoder(RunState)


def save_state(run_dir: Path, state: RunState) -> None:
    """Write ``run_dir/state.json`` so a crash leaves the old file or the new one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / STATE_FILE, msgspec.json.format(_encoder.encode(state), indent=1))


def load_state(run_dir: Path) -> RunState:
    """Read a run's saved state.

    Raises:
        FileNotFoundError: no ``state.json`` in ``run_dir``.
        ValueError: the file is not a run state of this version.
    """
    path = run_dir / STATE_FILE if run_dir.is_dir() or not run_dir.name.endswith(".json") else run_dir
    try:
        state = _decoder.decode(path.read_bytes())
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a scenario run state ({exc})") from None
    if state.version != STATE_VERSION:
        raise ValueError(f"{path}: state version {state.version}, expected {STATE_VERSION}")
    return state
