"""Decode runs: several decode steps in one job on the model's thread (the ``decode_run_steps`` setting).

Without runs every token paid a round trip between the MLX thread and trio, during which the
model's thread had nothing to do. With them the batch decodes back to back while nothing else
needs the GPU actor, and these tests hold what a client relies on to it: every token still
streams as it is made; a turn that arrives during a run joins one step later, not a run later;
a client that leaves stops being decoded at once; an engine error in the middle of a run fails
that turn and nothing else.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trio

from actors import gpu as gpu_actor
from actors import open_runtime
from actors.client import TurnFailedError
from actors.gpu import GPUActor
from actors.mlx_thread import MlxThread
from fake_engine import FakeEngine, fake_reply
from runtime.plan.engine import StepToken

STEP_S = 0.01
WAIT_S = 10.0
"""The longest a paced engine's step waits for trio (a safety: a step that waited this long is a failure)."""


def _open(tmp_path: Path, engine: FakeEngine, run_steps: int, *, trace: bool = False):
    return open_runtime(model="fake-a", home=tmp_path, engine=engine, fsync=False, handle_signals=False,
                        decode_run_steps=run_steps, trace=trace)


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every job the GPU actor gives the MLX thread, in order."""
    names: list[str] = []
    run = MlxThread.run

    async def counted(self: MlxThread, fn, *args):
        names.append(getattr(fn, "__name__", repr(fn)))
        return await run(self, fn, *args)

    monkeypatch.setattr(MlxThread, "run", counted)
    return names


def _wait_on_the_model_thread(ready, what: str, late: list[str]) -> None:
    """On the model's thread: until ``ready()``, at most :data:`WAIT_S` (then ``what`` goes in ``late`` and no
    later call waits: a broken runtime fails the test once, not at every step)."""
    deadline = time.monotonic() + WAIT_S
    while not late and not ready():
        if time.monotonic() > deadline:
            late.append(what)
            return
        time.sleep(0.001)


@pytest.mark.parametrize("run_steps", [1, 16])
async def test_a_lone_turn_decodes_in_runs_and_streams_every_token_as_it_is_made(tmp_path, jobs, monkeypatch,
                                                                                   run_steps):
    """Streamed as made, not a run at a time: each decode step starts (on the model's thread, inside its run)
    only once the client holds every token made before it, so a run that kept its tokens back until its end
    could not go on. In counts, whatever the machine's speed: no step waited in vain, and the tokens came one
    delta each."""
    monkeypatch.setattr(gpu_actor, "DECODE_RUN_S", 60.0)  # runs end by their steps, not by time
    received = [0]  # tokens (characters) the client holds
    held_back: list[str] = []

    class Paced(FakeEngine):
        made = 1  # the prefill's token

        def step(self) -> list[StepToken]:
            _wait_on_the_model_thread(lambda: received[0] >= self.made, f"token {self.made} held back", held_back)
            tokens = super().step()
            self.made += sum(1 for t in tokens if t.text)
            return tokens

    deltas: list[str] = []
    async with _open(tmp_path, Paced(), run_steps) as rt:
        jobs.clear()
        async with rt.agent("a").stream_prompt("tell me", max_tokens=64) as stream:
            async for delta in stream:
                deltas.append(delta)
                received[0] += len(delta)
    assert "".join(deltas) == fake_reply("tell me", 64)
    assert not held_back, held_back  # every token reached the client before the next step began
    assert len(deltas) == 64  # one token a delta: none waited for another
    decode_jobs = [n for n in jobs if n in ("step", "run")]
    if run_steps == 1:
        assert len(decode_jobs) >= 62  # a job, and a round trip through trio, for every token
    else:
        assert len(decode_jobs) <= 64 // run_steps + 2


@pytest.mark.parametrize("run_steps", [1, 16])
async def test_the_trace_times_each_step_on_the_model_thread(tmp_path, run_steps):
    """A step event carries the engine's timing of it (:class:`runtime.plan.engine.StepTiming`) and,
    in a run, the time it ended on the model's thread: a device run reads the decode loop from them."""

    class Clocked(FakeEngine):
        ended: list[float] = []  # when each step ended, on the model's thread
        read: list[float] = []  # when its timing was read (run: on the model's thread; a job a step: on trio's)

        def step(self) -> list[StepToken]:
            tokens = super().step()
            self.ended.append(time.perf_counter())
            return tokens

        @property
        def last_step_timing(self):
            self.read.append(time.perf_counter())
            return super().last_step_timing

    engine = Clocked(step_delay_s=STEP_S)
    async with _open(tmp_path, engine, run_steps, trace=True) as rt:
        await rt.agent("a").send_prompt("tell me", max_tokens=12)
        steps = [e for e in rt.gpu_events() if e.kind == "step"]
    assert len(steps) == len(engine.ended) == len(engine.read) >= 10
    for event, ended, read in zip(steps, engine.ended, engine.read, strict=True):
        assert event.timing is not None and event.timing.wait_ms == pytest.approx(STEP_S * 1e3)
        assert event.at >= ended
        if run_steps > 1:
            # stamped on the model's thread as the step ended, before the run read the step's timing to post it
            # to trio: not when trio got to it
            assert event.at <= read
        else:
            assert event.at >= read  # stamped on trio, once the step's job came back


async def _long_turn_under_way(rt, nursery: trio.Nursery, max_tokens: int, *, steps_in: int) -> trio.Event:
    """After a warm-up turn, agent ``long``'s turn of ``max_tokens`` is started and ``steps_in`` steps
    under way; the event is set when it ends."""
    await rt.agent("warm").send_prompt("x", max_tokens=2)
    done = trio.Event()

    async def long_turn() -> None:
        await rt.agent("long").send_prompt("a long story", max_tokens=max_tokens)
        done.set()

    nursery.start_soon(long_turn)
    await trio.sleep(steps_in * STEP_S)
    return done


async def test_a_turn_that_arrives_during_a_run_joins_after_one_more_step(tmp_path, monkeypatch):
    """Counted in the model's steps, not in seconds: from the doorbell that says the late turn's prompt is
    tokenized to the late turn's start, the long turn's run begins one more step at most (the doorbell rang
    between its check and that step; the step in flight when it rang had begun before)."""
    log: list[tuple[str, str]] = []  # in the order it happened: the model thread's steps and starts, trio's rings

    class Logged(FakeEngine):
        def step(self) -> list[StepToken]:
            log.append(("step", ""))
            return super().step()

        def start(self, request_id, prompt, *args):
            log.append(("start", prompt))
            return super().start(request_id, prompt, *args)

    ring_for = GPUActor._ring_for

    def logged_ring(self: GPUActor, why: str) -> None:
        log.append(("ring", why))
        ring_for(self, why)

    monkeypatch.setattr(GPUActor, "_ring_for", logged_ring)
    # Runs as long as the whole turn: only the message can end one.
    monkeypatch.setattr(gpu_actor, "DECODE_RUN_S", 60.0)
    async with _open(tmp_path, Logged(step_delay_s=STEP_S), 1000) as rt, trio.open_nursery() as nursery:
        long_done = await _long_turn_under_way(rt, nursery, 400, steps_in=30)  # well into its run
        async with rt.agent("late").stream_prompt("hello", max_tokens=3) as stream:
            first = await stream.__anext__()
            late_while_long_decodes = not long_done.is_set()
            async for _ in stream:
                pass
        assert first and late_while_long_decodes  # not a run later: the long turn's run is the whole turn
        assert stream.result is not None and stream.result.reply == fake_reply("hello", 3)
        await long_done.wait()
    assert rt.stats().metrics.completed >= 3
    started = log.index(("start", "hello"))
    rang = max(i for i, (what, why) in enumerate(log[:started]) if (what, why) == ("ring", "a turn tokenized"))
    assert any(entry == ("ring", "a message (Generate)") for entry in log[:rang])  # the message ended a run too
    assert log[rang:started].count(("step", "")) <= 1, log[rang - 3 : started + 1]


async def test_the_trace_says_how_each_run_ended(tmp_path, monkeypatch):
    """Each decode run leaves a ``run`` event: its steps and why it ended (its steps done, a row finished,
    or the doorbell and what rang it), so a device run reads where runs stop short and what that costs."""

    class Held(FakeEngine):
        """Once ``hold`` is set, a step waits for a message's doorbell: the late turn is sent while a run's
        step is under way (``held``), never between two runs, however the threads are scheduled."""

        hold, held, rang, late = threading.Event(), threading.Event(), threading.Event(), []

        def step(self) -> list[StepToken]:
            if self.hold.is_set():
                self.held.set()
                _wait_on_the_model_thread(self.rang.is_set, "no message rang the doorbell", self.late)
            return super().step()

    ring_for = GPUActor._ring_for

    def ring(self: GPUActor, why: str) -> None:
        ring_for(self, why)
        if why.startswith("a message"):
            engine.rang.set()

    monkeypatch.setattr(GPUActor, "_ring_for", ring)
    engine = Held(step_delay_s=STEP_S)
    async with _open(tmp_path, engine, 8, trace=True) as rt, trio.open_nursery() as nursery:
        long_done = await _long_turn_under_way(rt, nursery, 60, steps_in=20)
        engine.hold.set()
        with trio.fail_after(WAIT_S):
            while not engine.held.is_set():
                await trio.sleep(0.001)
        await rt.agent("late").send_prompt("hello", max_tokens=3)
        await long_done.wait()
        runs = [e for e in rt.gpu_events() if e.kind == "run"]
    assert not engine.late
    details = [e.detail for e in runs]
    assert "8 steps; its steps done" in details
    assert any(d.endswith("a message (Generate)") for d in details)  # the late turn rang the doorbell
    assert details[-1].endswith("a row finished")  # the long turn's last run
    assert all(e.took_ms is not None and e.took_ms > 0 and e.request_ids for e in runs)
    # when each run's job started on the model's thread, after its call on trio: a run's end splits into both
    assert all(e.waited_ms is not None and 0 <= e.waited_ms < e.took_ms for e in runs)
    # every step a run made is a step event (a step the scheduler runs alone, beside a prefill, has no run)
    assert sum(int(d.split()[0]) for d in details) <= len([e for e in rt.gpu_events() if e.kind == "step"])


async def test_a_run_ends_by_time_whatever_its_steps(tmp_path, monkeypatch):
    """A run also ends once it has run ``DECODE_RUN_S``: the loop between runs makes a slice of any
    save copy overdue, so a long reply on long runs keeps it waiting that long at most."""
    monkeypatch.setattr(gpu_actor, "DECODE_RUN_S", 0.1)
    engine = FakeEngine(step_delay_s=STEP_S)
    async with _open(tmp_path, engine, 1000, trace=True) as rt:
        await rt.agent("a").send_prompt("tell me", max_tokens=60)
        runs = [e for e in rt.gpu_events() if e.kind == "run"]
    timed = [e for e in runs if e.detail.endswith("its time done")]
    assert timed and runs[-1].detail.endswith("a row finished")
    # Ten steps of 10 ms at most (each step sleeps that long, however slow the machine), not 1000; and never
    # before its time: a slow machine makes fewer steps a run, never a shorter run.
    for e in timed:
        assert 1 <= int(e.detail.split()[0]) <= 11 and e.took_ms >= 0.1e3, e


async def test_a_client_that_leaves_during_a_run_stops_being_decoded(tmp_path, monkeypatch):
    """Each step of the run begins once trio has handed on the step before it (as a job a step would), so the
    steps made after the client left are counted against trio's pace, whatever the machine's."""
    steps: list[int] = []
    handed_on, late = [0], []
    stepped = GPUActor._stepped

    def counted(self: GPUActor, *args) -> None:
        stepped(self, *args)
        handed_on[0] += 1

    monkeypatch.setattr(GPUActor, "_stepped", counted)

    class Counting(FakeEngine):
        def step(self) -> list[StepToken]:
            _wait_on_the_model_thread(lambda: handed_on[0] >= len(steps), "trio never took a step", late)
            tokens = super().step()
            steps.append(len(tokens))
            return tokens

    engine = Counting(step_delay_s=STEP_S)
    async with _open(tmp_path, engine, 1000) as rt:
        received = ""
        async with rt.agent("c").stream_prompt("tell me everything", max_tokens=2000) as stream:
            async for delta in stream:
                received += delta
                if len(received) >= 5:
                    break
        left_at = len(steps)
        with trio.fail_after(WAIT_S):
            while rt.stats().metrics.cancelled < 1 or rt.stats().gpu.batch_size:
                await trio.sleep(STEP_S)
        made = len(steps)
        await trio.sleep(10 * STEP_S)
        assert len(steps) == made and rt.stats().metrics.cancelled == 1  # reaped: nothing decodes it any more
        # The step in flight, and one more begun before trio handed on the step that found the client gone;
        # then the run ended and the turn was reaped.
        assert made - left_at <= 2, made - left_at
        assert not late


async def test_an_engine_error_in_the_middle_of_a_run_fails_that_turn_and_the_runtime_serves_on(tmp_path):
    class Failing(FakeEngine):
        fail_at = 5
        steps = 0

        def step(self) -> list[StepToken]:
            self.steps += 1
            if self.steps == self.fail_at:
                raise RuntimeError("the device fell over")
            return super().step()

    engine = Failing()
    async with _open(tmp_path, engine, 16) as rt:
        received = ""
        with pytest.raises(TurnFailedError, match="fell over"):
            async with rt.agent("a").stream_prompt("tell me", max_tokens=40) as stream:
                async for delta in stream:
                    received += delta
        assert fake_reply("tell me", 40).startswith(received) and len(received) >= 3  # the steps before it came
        again = await rt.agent("b").send_prompt("and now", max_tokens=8)
        assert again.reply == fake_reply("and now", 8)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
async def test_on_the_real_engine_runs_reply_exactly_as_one_step_per_job(tmp_path, profile):
    """tiny-llama under each policy: four agents arriving one after another, so they join runs in
    progress, get the replies they get with one decode step per job."""
    from conftest import models_dir

    async def replies(steps: int) -> dict[str, tuple[str, int, int]]:
        out: dict[str, tuple[str, int, int]] = {}
        async with open_runtime(model="tiny-llama", home=tmp_path / f"runs-{steps}", models_dir=models_dir(),
                                fsync=False, handle_signals=False, profile=profile, decode_run_steps=steps,
                                prefetch_mb=0) as rt:
            async def one(i: int) -> None:
                await trio.sleep(0.05 * i)
                r = await rt.agent(f"a{i}").send_prompt(f"Agent {i} tells the story of the harbour. " * 3,
                                                        max_tokens=24 + 8 * i)
                out[f"a{i}"] = (r.reply, r.usage.tokens_generated, r.usage.tokens_prefilled)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
        return out

    assert await replies(16) == await replies(1)


@pytest.mark.parametrize(("profile", "per_token"), [("cpu", True), ("gpu", False)])
async def test_unset_the_policy_decides_cpu_one_step_per_job_gpu_runs(tmp_path, jobs, profile, per_token):
    """On two cores a run's thread contends with trio for the cores and the GIL (8 agents on the
    default model decoded about 10% slower with runs), so the CPU policy keeps a job per step."""
    from conftest import models_dir

    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False,
                            handle_signals=False, profile=profile, prefetch_mb=0) as rt:
        jobs.clear()
        result = await rt.agent("a").send_prompt("Tell the story of the harbour. " * 3, max_tokens=40)
    assert result.usage.tokens_generated == 40
    decode_jobs = [n for n in jobs if n in ("step", "run")]
    assert (len(decode_jobs) >= 38) if per_token else (len(decode_jobs) <= 6), decode_jobs
