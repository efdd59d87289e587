"""Scenario runs in the background of a server: what the HTTP routes start, resume and describe.

Runs live under ``<home>/scenarios/<run id>/`` (state, transcripts, report),
so a run stays readable — and resumable — after the server restarts.

Background runs need a nursery that outlives the request that started them.
Pass one (the app's) as ``nursery``; without one the service opens its own in
a trio *system task* on first use (cancelled when ``trio.run`` ends; a run cut
short that way is saved as ``interrupted`` and can be resumed).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from actors.scenario.report import build_report, visible_turns, write_outputs
from actors.scenario.runner import ScenarioRunner, forget_permanent_agents, new_run_state
from actors.scenario.spec import ScenarioError, ScenarioSpec, load_scenario
from actors.scenario.state import RunOptions, RunState, load_state

if TYPE_CHECKING:
    from actors.supervisor import Runtime

__all__ = ["ScenarioService", "RunConflictError", "RunNotFoundError"]

log = logging.getLogger("kvmem.scenario")

_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,127}$")
Job = Callable[[], Awaitable[None]]


class RunConflictError(Exception):
    """The run cannot start now (the same scenario is running, or the run is still going)."""


class RunNotFoundError(KeyError):
    """No run with that id."""


@dataclass
class _Run:
    spec: ScenarioSpec
    state: RunState
    run_dir: Path
    fresh: bool = False
    stop_after: str | None = None
    done: trio.Event = field(default_factory=trio.Event)


class ScenarioService:
    """Starts, resumes and describes scenario runs on one runtime.

    Args:
        rt: the runtime the turns go to.
        home: the kvmem home; runs are kept in ``home/scenarios``.
        nursery: where runs execute (None: a nursery of the service's own, see the module docstring).
    """

    def __init__(self, rt: Runtime, *, home: Path, nursery: trio.Nursery | None = None) -> None:
        self.rt = rt
        self.root = Path(home) / "scenarios"
        self._nursery = nursery
        self._jobs: trio.MemorySendChannel[Job] | None = None
        self._runs: dict[str, _Run] = {}

    # -- starting ---------------------------------------------------------------

    async def start(
        self,
        text: str,
        *,
        source: str,
        max_tokens: int | None = None,
        temperature: float | None = None,
        compare_cold: bool = False,
        fresh: bool = False,
        stop_after: str | None = None,
        model: str | None = None,
    ) -> RunState:
        """Validate a scenario and start running it in the background.

        Raises:
            ScenarioError: the scenario (or ``stop_after``) is invalid.
            RunConflictError: a run of the same scenario is still going (they
                would share the permanent agents' caches).
        """
        spec = load_scenario(text, source=source)
        if stop_after is not None and stop_after not in [p.name for p in spec.phases]:
            raise ScenarioError(source, [f"stop_after names unknown phase {stop_after!r}"])
        self._refuse_concurrent(spec.name)
        options = RunOptions(
            model=model or self.rt.stats().registry.default_model,
            request_model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            compare_cold=compare_cold,
            command="POST /v1/scenarios",
        )
        state = new_run_state(spec, text, source=source, options=options)
        run = _Run(spec=spec, state=state, run_dir=self.root / state.run_id, fresh=fresh, stop_after=stop_after)
        await self._launch(run)
        return state

    async def resume(self, run_id: str, *, compare_cold: bool | None = None, stop_after: str | None = None) -> RunState:
        """Continue a stopped or interrupted run from its saved state.

        Raises:
            RunNotFoundError: no such run.
            RunConflictError: it is still running, or its scenario is running in another run.
            ScenarioError: the saved scenario no longer validates.
        """
        current = self._runs.get(run_id)
        if current is not None and not current.done.is_set():
            raise RunConflictError(f"run {run_id} is still running")
        state = self.load(run_id)
        if state.status == "done":
            raise RunConflictError(f"run {run_id} is already done")
        spec = load_scenario(state.scenario_text, source=state.source)
        if stop_after is not None and stop_after not in [p.name for p in spec.phases]:
            raise ScenarioError(state.source, [f"stop_after names unknown phase {stop_after!r}"])
        self._refuse_concurrent(spec.name)
        if compare_cold is not None:
            state.options.compare_cold = compare_cold
        state.sessions += 1
        await self._launch(_Run(spec=spec, state=state, run_dir=self.root / run_id, stop_after=stop_after))
        return state

    def _refuse_concurrent(self, scenario: str) -> None:
        for run in self._runs.values():
            if run.spec.name == scenario and not run.done.is_set():
                raise RunConflictError(f"scenario {scenario!r} is already running (run {run.state.run_id})")

    async def _launch(self, run: _Run) -> None:
        run.state.status = "running"  # from now on, until the runner says otherwise
        self._runs[run.state.run_id] = run
        run.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            await self._spawn(lambda: self._execute(run))
        except BaseException:
            run.done.set()
            raise

    async def _spawn(self, job: Job) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(job)
            return
        if self._jobs is None:
            send, receive = trio.open_memory_channel[Job](16)
            self._jobs = send
            trio.lowlevel.spawn_system_task(self._host, receive, name="kvmem scenario runs")
        await self._jobs.send(job)

    @staticmethod
    async def _host(receive: trio.MemoryReceiveChannel[Job]) -> None:
        async with receive, trio.open_nursery() as nursery:
            async for job in receive:
                nursery.start_soon(job)

    async def _execute(self, run: _Run) -> None:
        try:
            if run.fresh:
                await forget_permanent_agents(self.rt, run.spec)
            runner = ScenarioRunner(self.rt, run.spec, run.state, run_dir=run.run_dir, stop_after=run.stop_after)
            await runner.run()
        except Exception as exc:  # the state says failed/interrupted; the client reads it with GET
            log.warning("scenario run %s ended with %s: %s", run.state.run_id, type(exc).__name__, exc)
        finally:
            run.done.set()
            try:
                write_outputs(run.run_dir, run.spec, run.state, plot=False)
            except OSError as exc:
                log.warning("cannot write the outputs of run %s: %s", run.state.run_id, exc)

    # -- reading ----------------------------------------------------------------

    async def wait(self, run_id: str) -> RunState:
        """Wait until run ``run_id`` (started here) is no longer running."""
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFoundError(run_id)
        await run.done.wait()
        return run.state

    def load(self, run_id: str) -> RunState:
        """The state of run ``run_id``: live when it runs here, else from disk.

        Raises:
            RunNotFoundError: no such run.
        """
        run = self._runs.get(run_id)
        if run is not None:
            return run.state
        if not _RUN_ID.match(run_id):
            raise RunNotFoundError(run_id)
        try:
            return load_state(self.root / run_id)
        except (FileNotFoundError, ValueError):
            raise RunNotFoundError(run_id) from None

    def describe(self, run_id: str, *, view: str = "public") -> dict[str, Any]:
        """A run as JSON: status, progress per phase, per-turn statistics, the transcript of ``view``
        (``public``, ``full`` or an agent key) and the working-memory report.

        Raises:
            RunNotFoundError: no such run.
            ValueError: an unknown view.
        """
        state = self.load(run_id)
        spec = load_scenario(state.scenario_text, source=state.source)
        if view not in ("public", "full") and view not in spec.agents:
            raise ValueError(f"unknown view {view!r}: use public, full or an agent key ({', '.join(spec.agents)})")
        turns = visible_turns(spec, state, view)
        phases = []
        for index, phase in enumerate(spec.phases):
            done = len(state.phase_turns(phase.name))
            total = len(phase.schedule())
            if phase.name in state.phases_done:
                status = "done"
            elif index == state.phase_index and state.status == "running":
                status = "running"
            else:
                status = "partial" if done else "pending"
            phases.append(
                {
                    "name": phase.name,
                    "label": phase.title,
                    "agents": list(phase.agents),
                    "rounds": phase.rounds,
                    "public": phase.public,
                    "visible_to": phase.audience(list(spec.agents)),
                    "status": status,
                    "turns_done": done,
                    "turns_total": total,
                }
            )
        current = spec.phases[state.phase_index].name if state.phase_index < len(spec.phases) else None
        usage = ("tier", "match", "tokens_reused", "tokens_prefilled", "tokens_generated", "ttft_ms")
        return {
            "id": state.run_id,
            "scenario": state.scenario,
            "title": state.title,
            "status": state.status,
            "error": state.error or None,
            "model": state.options.model,
            "phase": current if state.status != "done" else None,
            "turns_done": len(state.turns),
            "turns_total": sum(len(p.schedule()) for p in spec.phases),
            "phases": phases,
            "turns": [{"index": t.index, "phase": t.phase, "round": t.round, "agent": t.agent}
                      | {k: getattr(t.usage, k) for k in usage}
                      | {"wall_ms": t.wall_ms, "prompt_tokens": t.usage.prompt_tokens} for t in state.turns],
            "view": view,
            "transcript": [
                {
                    "phase": t.phase,
                    "round": t.round,
                    "agent": t.agent,
                    "speaker": spec.display(t.agent),
                    "text": t.reply,
                }
                for t in turns
            ],
            "report": msgspec.to_builtins(build_report(spec, state)),
        }
