"""Run a scenario through the in-process runtime (or the server's, when one holds the home), phase by phase.

Cache keys: a permanent agent is ``scenario:<scenario name>:<agent>`` — an
identity that outlives the run and a restart, so the next phase (or the next
process, after ``resume``) extends the same cache; an ephemeral agent is
``scenario:<run id>:<agent>`` and is forgotten when the run ends.

Turns run one at a time in each phase's turn order (every turn answers the
previous one). The state is saved after each turn and every hot cache is
flushed to disk at the end of each phase, so a run stopped between phases
resumes after a restart from warm (disk) caches.

``compare_cold`` replays the run's own prompts — the same message lists, turn
by turn, with the same number of reply tokens — on fresh agent ids that
neither reuse nor share any cache, and records their prefill and wall time
next to the cached turn's (random-weight models diverge after the first
differing token, so the cold run does not generate its own conversation).
Each turn is replayed right after it ran, so both runs see the same machine
load; turns that ran without the comparison (a resumed run that asks for it
later) are replayed at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from actors.scenario.prompts import turn_message
from actors.scenario.spec import PhaseSpec, ScenarioSpec
from actors.scenario.state import (
    AgentMemory,
    ColdTurn,
    RunOptions,
    RunState,
    ScenarioTurn,
    new_run_id,
    save_state,
)

if TYPE_CHECKING:
    from actors.owner_client import OwnerClient
    from actors.supervisor import Runtime

__all__ = [
    "ScenarioRunner",
    "ScenarioEvent",
    "PhaseStarted",
    "ScenarioTurnStarted",
    "TurnFinished",
    "PhaseFinished",
    "ColdTurnFinished",
    "RunFinished",
    "agent_id_for",
    "new_run_state",
    "forget_permanent_agents",
]


class PhaseStarted(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A phase begins (a :data:`ScenarioEvent`).

    Attributes:
        label: the phase's title (its label, else its name).
        index: the phase's position in the scenario (from 0), of ``count`` phases.
        agents: the scenario agents taking part.
        rounds: how many rounds they speak.
    """

    phase: str
    label: str
    index: int
    count: int
    agents: list[str]
    rounds: int


class ScenarioTurnStarted(msgspec.Struct, frozen=True, kw_only=True, tag="TurnStarted"):  # its JSON name as before
    """An agent's turn begins: ``round`` counts from 1, ``index`` is the turn's number in the run."""

    phase: str
    round: int
    agent: str
    index: int


class TurnFinished(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A turn is done; ``record`` is its reply and cache statistics (as saved in the run state)."""

    record: ScenarioTurn


class PhaseFinished(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A phase is done and its caches are flushed to disk.

    ``turns``, the token totals and ``wall_s`` (the turns' wall times added up) cover every turn of the
    phase, those of an earlier session of a resumed run included.
    """

    phase: str
    turns: int
    tokens_reused: int
    tokens_prefilled: int
    wall_s: float


class ColdTurnFinished(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A turn was replayed from no cache (``compare_cold``); ``record.cold`` holds the cold numbers."""

    record: ScenarioTurn


class RunFinished(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The run is done; ``status`` is ``done`` (not sent when it stops after a phase, fails or is interrupted).

    ``wall_s``: the cached turns' wall times added up; ``cold_wall_s``: the same for the cold replays
    (None: no ``compare_cold``).
    """

    status: str
    wall_s: float
    cold_wall_s: float | None


ScenarioEvent = PhaseStarted | ScenarioTurnStarted | TurnFinished | PhaseFinished | ColdTurnFinished | RunFinished
EventSink = Callable[[ScenarioEvent], None]


def agent_id_for(spec: ScenarioSpec, run_id: str, key: str) -> str:
    """The runtime agent id (cache key) of scenario agent ``key``."""
    owner = spec.name if spec.permanent(key) else run_id
    return f"scenario:{owner}:{key}"


def new_run_state(
    spec: ScenarioSpec, text: str, *, source: str, options: RunOptions, run_id: str | None = None
) -> RunState:
    """A fresh run of ``spec`` (``text`` is its source, kept for ``resume``)."""
    run_id = run_id or new_run_id(spec.name)
    agents = {
        key: AgentMemory(key=key, agent_id=agent_id_for(spec, run_id, key), lifecycle=agent.lifecycle)
        for key, agent in spec.agents.items()
    }
    return RunState(
        run_id=run_id,
        scenario=spec.name,
        title=spec.title or spec.name,
        source=source,
        scenario_text=text,
        options=options,
        agents=agents,
    )


async def forget_permanent_agents(rt: Runtime | OwnerClient, spec: ScenarioSpec) -> list[str]:
    """Forget the caches of ``spec``'s permanent agents (``--fresh``); returns the ids that existed."""
    forgotten = []
    for key in spec.agents:
        if spec.permanent(key):
            agent_id = agent_id_for(spec, "", key)
            if await rt.agent(agent_id).forget():
                forgotten.append(agent_id)
    return forgotten


class ScenarioRunner:
    """Drives one run (see the module docstring).

    Args:
        rt: the runtime the turns go to (this process's, or the server's that holds the home).
        spec: the validated scenario.
        state: the run's state (new, or loaded to resume); updated in place.
        run_dir: where ``state.json`` is saved after every turn (None: not saved).
        on_event: called with each :data:`ScenarioEvent` (live progress).
        stop_after: stop (status ``stopped``) after this phase; ``resume`` continues.
    """

    def __init__(
        self,
        rt: Runtime | OwnerClient,
        spec: ScenarioSpec,
        state: RunState,
        *,
        run_dir: Path | None = None,
        on_event: EventSink | None = None,
        stop_after: str | None = None,
    ) -> None:
        if stop_after is not None:
            spec.phase(stop_after)  # KeyError: unknown phase
        self.rt = rt
        self.spec = spec
        self.state = state
        self.run_dir = run_dir
        self._emit = on_event or (lambda event: None)
        self.stop_after = stop_after

    def save(self) -> None:
        if self.run_dir is not None:
            save_state(self.run_dir, self.state)

    async def run(self) -> RunState:
        """Run (or continue) the scenario to its end, or to ``stop_after``.

        On cancellation or an error the state is saved first (status
        ``interrupted`` or ``failed``), so the run can be resumed.
        """
        state = self.state
        if state.status == "done":
            if state.options.compare_cold and any(t.cold is None for t in state.turns):
                await self.compare_cold()  # a finished run asked for its cold comparison later
            return state
        state.status = "running"
        state.error = ""
        self.save()
        try:
            if state.options.compare_cold:
                await self.warm_up()
            while state.phase_index < len(self.spec.phases):
                phase = self.spec.phases[state.phase_index]
                await self._run_phase(phase)
                if phase.name == self.stop_after and state.phase_index < len(self.spec.phases):
                    state.status = "stopped"
                    self.save()
                    return state
            if not state.forgot_ephemeral:
                await self._forget_ephemeral()
            if state.options.compare_cold:
                await self.compare_cold()
        except BaseException as exc:
            from actors.client import TurnFailedError

            closed = isinstance(exc, TurnFailedError) and exc.kind in ("Closed", "Cancelled")
            state.status = "interrupted" if closed or not isinstance(exc, Exception) else "failed"
            state.error = f"{type(exc).__name__}: {exc}" if isinstance(exc, Exception) else type(exc).__name__
            self.save()
            raise
        state.status = "done"
        state.finished_at = time.time()
        self.save()
        self._emit(RunFinished(status=state.status, wall_s=state.wall_s, cold_wall_s=state.cold_wall_s))
        return state

    async def _run_phase(self, phase: PhaseSpec) -> None:
        state = self.state
        schedule = phase.schedule()
        self._emit(
            PhaseStarted(
                phase=phase.name,
                label=phase.title,
                index=state.phase_index,
                count=len(self.spec.phases),
                agents=list(phase.agents),
                rounds=phase.rounds,
            )
        )
        while state.turn_in_phase < len(schedule):
            round_, agent = schedule[state.turn_in_phase]
            record = await self._turn(phase, round_, agent)
            state.turn_in_phase += 1
            self.save()
            if state.options.compare_cold:
                await self._replay_cold(record)
        # Phase boundary: make every cache durable, so a restart here resumes warm.
        await self.rt.flush()
        state.phases_done.append(phase.name)
        state.phase_index += 1
        state.turn_in_phase = 0
        self.save()
        turns = state.phase_turns(phase.name)
        self._emit(
            PhaseFinished(
                phase=phase.name,
                turns=len(turns),
                tokens_reused=sum(t.usage.tokens_reused for t in turns),
                tokens_prefilled=sum(t.usage.tokens_prefilled for t in turns),
                wall_s=sum(t.wall_ms for t in turns) / 1000.0,
            )
        )

    def _sampling(self, phase: PhaseSpec) -> tuple[int, float]:
        options = self.state.options
        max_tokens = options.max_tokens or phase.max_tokens or self.spec.max_tokens
        temperature = options.temperature if options.temperature is not None else self.spec.temperature
        return max_tokens, temperature

    async def _turn(self, phase: PhaseSpec, round_: int, agent: str) -> ScenarioTurn:
        state, spec = self.state, self.spec
        memory = state.agents[agent]
        index = len(state.turns)
        self._emit(ScenarioTurnStarted(phase=phase.name, round=round_, agent=agent, index=index))
        if not memory.messages and spec.system_prompt(agent):
            memory.messages = [{"role": "system", "content": spec.system_prompt(agent)}]
        transcripts = {name: state.phase_turns(name) for name in state.phases_done}
        text = turn_message(spec, phase, agent, phase_lines=state.phase_turns(phase.name), transcripts=transcripts)
        messages = [*memory.messages, {"role": "user", "content": text}]
        max_tokens, temperature = self._sampling(phase)
        started = time.perf_counter()
        result = await self.rt.agent(memory.agent_id).send(
            messages, max_tokens=max_tokens, temperature=temperature, model=state.options.request_model
        )
        wall_ms = (time.perf_counter() - started) * 1000.0
        memory.messages = [*messages, {"role": "assistant", "content": result.reply}]
        record = ScenarioTurn(
            index=index,
            phase=phase.name,
            round=round_,
            agent=agent,
            agent_id=memory.agent_id,
            lifecycle=memory.lifecycle,
            reply=result.reply,
            finish_reason=result.finish_reason,
            prompt_messages=len(messages),
            usage=result.usage,
            wall_ms=wall_ms,
            visible_to=phase.audience(list(spec.agents)),
            public=phase.public,
        )
        state.turns.append(record)
        self._emit(TurnFinished(record=record))
        return record

    async def _forget_ephemeral(self) -> None:
        for memory in self.state.agents.values():
            if memory.lifecycle == "ephemeral" and memory.messages:
                await self.rt.agent(memory.agent_id).forget()
        self.state.forgot_ephemeral = True
        self.save()

    async def warm_up(self) -> None:
        """One short throwaway turn, so the first measured turn does not pay one-time start-up costs."""
        handle = self.rt.agent(f"scenario:{self.state.run_id}:warm-up", share_prefix=False)
        await handle.send(
            [{"role": "user", "content": "Warm up."}], max_tokens=2, model=self.state.options.request_model
        )
        await handle.forget()

    async def compare_cold(self) -> float:
        """Replay every turn's prompt from no cache (see the module docstring); returns the cold wall time."""
        state = self.state
        for record in state.turns:
            if record.cold is None:
                await self._replay_cold(record)
        state.cold_wall_s = sum(t.cold.wall_ms for t in state.turns if t.cold is not None) / 1000.0
        self.save()
        return state.cold_wall_s

    async def _replay_cold(self, record: ScenarioTurn) -> None:
        """Replay one turn's prompt on a fresh agent that neither reuses nor shares a cache, then forget it."""
        state = self.state
        memory = state.agents[record.agent]
        messages = memory.messages[: record.prompt_messages]
        phase = self.spec.phase(record.phase)
        _, temperature = self._sampling(phase)
        handle = self.rt.agent(f"scenario:{state.run_id}:cold:{record.index}", share_prefix=False)
        started = time.perf_counter()
        result = await handle.send(
            messages,
            max_tokens=max(1, record.usage.tokens_generated),
            temperature=temperature,
            model=state.options.request_model,
        )
        wall_ms = (time.perf_counter() - started) * 1000.0
        await handle.forget()
        record.cold = ColdTurn(usage=result.usage, wall_ms=wall_ms)
        self.save()
        self._emit(ColdTurnFinished(record=record))
