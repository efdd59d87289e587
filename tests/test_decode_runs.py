"""Decode runs: several decode steps in one job on the model's thread (the ``decode_run_steps`` setting).

Without runs every token paid a round trip between the MLX thread and trio, during which the
model's thread had nothing to do. With them the batch decodes back to back while nothing else
needs the GPU actor, and these tests hold what a client relies on to it: every token still
streams as it is made; a turn that arrives during a run joins one step later, not a run later;
a client that leaves stops being decoded at once; an engine error in the middle of a run fails
that turn and nothing else.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from actors import gpu as gpu_actor
from actors import open_runtime
from actors.client import TurnFailedError
from actors.mlx_thread import MlxThread
from fake_engine import FakeEngine, fake_reply
from runtime.plan.contract import StepToken

STEP_S = 0.01


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


@pytest.mark.parametrize("run_steps", [1, 16])
async def test_a_lone_turn_decodes_in_runs_and_streams_every_token_as_it_is_made(tmp_path, jobs, run_steps):
    engine = FakeEngine(step_delay_s=STEP_S)
    arrivals: list[float] = []
    text = ""
    async with _open(tmp_path, engine, run_steps) as rt:
        jobs.clear()
        async with rt.agent("a").stream_prompt("tell me", max_tokens=64) as stream:
            async for delta in stream:
                arrivals.append(time.perf_counter())
                text += delta
    assert text == fake_reply("tell me", 64)
    decode_jobs = [n for n in jobs if n in ("step", "run")]
    if run_steps == 1:
        assert len(decode_jobs) >= 62  # a job, and a round trip through trio, for every token
    else:
        assert len(decode_jobs) <= 64 // run_steps + 2
    # Streamed as made, not a run at a time: no gap near a whole run's length, and the tokens
    # spread over the turn's decoding time.
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) >= 60 and max(gaps) < 8 * STEP_S, max(gaps)
    assert arrivals[-1] - arrivals[0] >= 0.5 * 60 * STEP_S


@pytest.mark.parametrize("run_steps", [1, 16])
async def test_the_trace_times_each_step_on_the_model_thread(tmp_path, run_steps):
    """A step event carries the engine's timing of it (:class:`runtime.plan.contract.StepTiming`) and,
    in a run, the time it ended on the model's thread: a device run reads the decode loop from them."""

    class Clocked(FakeEngine):
        ended: list[float] = []

        def step(self) -> list[StepToken]:
            tokens = super().step()
            self.ended.append(time.perf_counter())
            return tokens

    engine = Clocked(step_delay_s=STEP_S)
    async with _open(tmp_path, engine, run_steps, trace=True) as rt:
        await rt.agent("a").send_prompt("tell me", max_tokens=12)
        steps = [e for e in rt.gpu_events() if e.kind == "step"]
    assert len(steps) == len(engine.ended) >= 10
    for event, ended in zip(steps, engine.ended, strict=True):
        assert event.timing is not None and event.timing.wait_ms == pytest.approx(STEP_S * 1e3)
        assert event.at >= ended
        if run_steps > 1:
            assert event.at == pytest.approx(ended, abs=2e-3)


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


async def test_a_turn_that_arrives_during_a_run_joins_after_one_more_step(tmp_path):
    engine = FakeEngine(step_delay_s=STEP_S)
    # Runs as long as the whole turn: only the message can end one.
    async with _open(tmp_path, engine, 1000) as rt, trio.open_nursery() as nursery:
        long_done = await _long_turn_under_way(rt, nursery, 400, steps_in=30)  # well into its run
        t0 = time.perf_counter()
        async with rt.agent("late").stream_prompt("hello", max_tokens=3) as stream:
            first = await stream.__anext__()
            ttft = time.perf_counter() - t0
            async for _ in stream:
                pass
        assert first and not long_done.is_set()
        assert ttft < 10 * STEP_S, ttft  # one step of the run, its own prefill, one step
        assert stream.result is not None and stream.result.reply == fake_reply("hello", 3)
        await long_done.wait()
    assert rt.stats().metrics.completed >= 3


async def test_the_trace_says_how_each_run_ended(tmp_path):
    """Each decode run leaves a ``run`` event: its steps and why it ended (its steps done, a row finished,
    or the doorbell and what rang it), so a device run reads where runs stop short and what that costs."""
    engine = FakeEngine(step_delay_s=STEP_S)
    async with _open(tmp_path, engine, 8, trace=True) as rt, trio.open_nursery() as nursery:
        long_done = await _long_turn_under_way(rt, nursery, 60, steps_in=20)
        await rt.agent("late").send_prompt("hello", max_tokens=3)
        await long_done.wait()
        runs = [e for e in rt.gpu_events() if e.kind == "run"]
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
    for e in timed:  # about 10 steps of 10 ms each, not 1000
        assert 5 <= int(e.detail.split()[0]) <= 20 and 0.1e3 <= e.took_ms < 0.3e3, e


async def test_a_client_that_leaves_during_a_run_stops_being_decoded(tmp_path):
    steps: list[int] = []

    class Counting(FakeEngine):
        def step(self) -> list[StepToken]:
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
        await trio.sleep(30 * STEP_S)
        assert rt.stats().gpu.batch_size == 0
        assert len(steps) - left_at <= 5  # the step in flight, then the run ended and the turn was reaped
        assert rt.stats().metrics.cancelled == 1


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
