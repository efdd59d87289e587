"""A turn's end off the decode loop (issue 33, item 4): the GPU policy's copy for the save, made after the turn.

Under the GPU policy (``BackendProfile.copy_after_turn``) the engine launches a finished
turn's park without waiting for it and leaves the host copy its save needs for later; the
GPU actor owes it (:class:`actors.gpu_caches.OwedCopy`) and makes it when it has
nothing to run, or between two loop passes once it is wanted (a durable turn's, a flush's) or
overdue, then hands it to the store in a ``Save``. These
tests hold that to what a user relies on: the copy made later is the copy made at once; a
busy batch never stops for it; a durable turn still answers with its cache on disk; a cache
superseded or forgotten before its copy is never copied (nor written); a failed copy fails
only that save. (Shutdown writing every completed turn: ``tests/actor_runtime/test_actors_lifecycle.py``.)
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from conftest import models_dir

from actors import open_runtime
from actors.client import TurnFailedError
from engine_turns import COLD, run_turn
from fake_engine import FakeEngine
from runtime.errors import CacheMiss
from runtime.persist import CacheDirectory
from runtime.plan import save_queue

TAG = "fake-a@0000/fake"
PROMPT = "Tell me about the sea and the ships on it. " * 30


def _open(tmp_path: Path, engine: FakeEngine, **kw):
    kw.setdefault("handle_signals", False)
    kw.setdefault("durable", False)  # these tests watch write-behind saves; a turn asks for durability itself
    return open_runtime(model="fake-a", home=tmp_path, engine=engine, fsync=False, **kw)


def _disk(tmp_path: Path) -> CacheDirectory:
    return CacheDirectory(tmp_path / "caches", fsync=False)


# -- the engine: the copy made later is the copy made at once -------------------------------------


def _engine(attention: str):
    from runtime.execution.mlx_engine import MlxEngine

    engine = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention=attention, profile="gpu",
                       prefill_chunk=128, keep_float_mb=64)
    engine.load("tiny-llama")
    return engine


def _in_parts(engine, parked):
    """The copy as an idle GPU actor makes it when messages keep coming: a part per call, resumed."""
    done: list = []
    calls = 0
    while (snapshot := engine.snapshot(parked, stop=lambda: True, done=done)) is None:
        calls += 1
        assert done[0].made == calls  # one part per call, none copied twice
    assert calls == len(done[0].parts) - 1 and len(done[0].parts) >= 2 * len(snapshot.layers)
    return snapshot


@pytest.mark.parametrize("attention", ["at-rest", "native"])
def test_a_copy_made_after_the_next_turn_ran_on_the_kept_buffers_is_the_copy_made_at_once(attention: str) -> None:
    """Two engines run the same turns. One copies the first turn's cache at once; the other only
    after the agent's next turn ran from it (at-rest: on the float buffers the park kept, written in
    place), and a part at a time, as an idle actor whose copies messages interrupt makes it. Any
    buffer the unwaited park still read and the next turn overwrote would show here."""
    from runtime.cpu import kv_copy
    from runtime.plan.turn_plan import FromHot, TurnPlan

    at_once, later = _engine(attention), _engine(attention)
    try:
        copies = []
        for engine, copy_first in ((at_once, True), (later, False)):
            first = run_turn(engine, 1, PROMPT, COLD, max_tokens=6)
            assert first.parked is not None and first.snapshot is None
            copy = engine.snapshot(first.parked) if copy_first else None
            parked = first.parked
            hot = TurnPlan(tier="hot", source=FromHot(parked=parked), match="extend", reuse_tokens=parked.num_tokens,
                           reuse_chars=len(parked.text))
            second = run_turn(engine, 2, parked.text + " And the harbour?", hot, max_tokens=6)
            assert second.parked is not None and second.parked.num_tokens > parked.num_tokens
            copies.append(copy if copy is not None else _in_parts(engine, parked))
        made_at_once, made_later = copies
        assert made_later.token_ids == made_at_once.token_ids and made_later.text == made_at_once.text
        for a, b in zip(made_at_once.layers, made_later.layers, strict=True):
            assert a.arrays.keys() == b.arrays.keys()
            for name in a.arrays:
                np.testing.assert_array_equal(a.arrays[name], b.arrays[name], err_msg=name)
    finally:
        at_once.unload()
        later.unload()
        kv_copy.use_host_views(None)


# -- the actors: when the copy is made, and what each save does with it ------------------------------


@contextlib.asynccontextmanager
async def _busy_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, overdue_s: float, **engine_args: Any):
    """A runtime whose batch decodes a long turn: (runtime, engine, the long turn's cancel scope)."""
    monkeypatch.setattr(save_queue, "COPY_OVERDUE_S", overdue_s)
    engine = FakeEngine(step_delay_s=0.005, copy_after_turn=True, **engine_args)
    busy, started = trio.CancelScope(), trio.Event()

    async def keep_decoding() -> None:
        with busy:
            async with rt.agent("busy").stream_prompt("keep the batch decoding", max_tokens=400) as stream:
                async for _ in stream:
                    started.set()

    async with _open(tmp_path, engine) as rt, trio.open_nursery() as nursery:
        nursery.start_soon(keep_decoding)
        await started.wait()
        yield rt, engine, busy
        busy.cancel()


def _copy_when_started(engine: FakeEngine, prompt: str) -> list[tuple[int, int]]:
    """The copy's parts made and the copies finished when ``prompt``'s turn started on the model's thread (read there,
    in order with the copy's parts: no later scheduling of the test's own task moves it)."""
    seen: list[tuple[int, int]] = []
    start = engine.start

    def recording(request_id: int, text: str, *args: Any) -> Any:
        if text == prompt:
            seen.append((engine.copied_layers, len(engine.snapshots)))
        return start(request_id, text, *args)

    engine.start = recording  # type: ignore[method-assign]
    return seen


async def _until_written(rt, writes: int) -> None:
    with trio.fail_after(30):  # a safety: what a test asks is that it happens, not how soon
        while rt.stats().store.writes < writes:
            await trio.sleep(0.02)


async def test_a_busy_batch_never_stops_for_a_copy_and_an_idle_actor_makes_it_at_once(tmp_path, monkeypatch):
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=60.0) as (rt, engine, busy):
        result = await rt.agent("a").send_prompt("a short turn", max_tokens=3)
        await trio.sleep(0.2)  # many steps of the busy turn
        assert engine.snapshots == [] and rt.stats().store.writes == 0  # owed, not made
        assert rt.stats().gpu.batch_size == 1
        busy.cancel()  # the busy client leaves: its turn ends, the actor idles
        await _until_written(rt, 2)  # both turns' copies made and written, not at shutdown
    assert _disk(tmp_path).load("a", model_tag=TAG).text == "a short turn" + result.reply[:-1]


async def test_a_flush_while_the_batch_runs_writes_the_copies_owed_and_the_batch_goes_on(tmp_path, monkeypatch):
    """A flush wants every copy owed: made one a loop pass between the batch's steps, then written, and only
    then answered (the GPU actor forwards it to the store once the last copy is sent)."""
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=60.0) as (rt, engine, busy):
        result = await rt.agent("a").send_prompt("a short turn", max_tokens=3)
        assert engine.snapshots == []  # owed: not overdue for a minute
        with trio.fail_after(30):
            assert await rt.flush() == 1
        assert _disk(tmp_path).load("a", model_tag=TAG).text == "a short turn" + result.reply[:-1]
        assert rt.stats().gpu.batch_size == 1  # the busy turn decodes on


async def test_an_overdue_copy_is_made_while_the_batch_runs(tmp_path, monkeypatch):
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=0.1) as (rt, engine, busy):
        await rt.agent("a").send_prompt("a short turn", max_tokens=3)
        await _until_written(rt, 1)
        assert rt.stats().gpu.batch_size == 1  # saved while the other turn still decodes


async def test_an_overdue_copy_is_made_a_slice_a_pass_and_the_batch_waits_for_a_slice(tmp_path, monkeypatch):
    """H200 run 3: an overdue copy made whole stalled a running decode 56 ms (a 4K cache; a 32K cache
    of a 1B model took 258 ms). While turns run it now goes a few parts a loop pass. Counted in parts
    between the busy turn's steps, not in seconds: a part (0.02 s) outlasts a slice's time (``COPY_SLICE_S``)
    on any machine."""
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=0.05,
                             copy_layers=30, copy_layer_delay_s=0.02) as (rt, engine, busy):  # 0.6 s whole
        parts_at_step: list[int] = []  # the copy's parts made when each of the busy turn's steps began
        step = engine.step

        def counted() -> Any:
            parts_at_step.append(engine.copied_layers)
            return step()

        engine.step = counted
        result = await rt.agent("a").send_prompt("a short turn", max_tokens=3)
        await _until_written(rt, 1)
        assert rt.stats().gpu.batch_size == 1  # made while the other turn decodes
        during = [n for n in parts_at_step if 0 < n < 30]
        assert len(during) >= 20  # the busy turn went on between the slices
        between = [b - a for a, b in zip(parts_at_step, parts_at_step[1:])]
        assert max(between) <= 2, between  # a slice (a part or so) between two steps, never the whole copy
        assert engine.copied_layers == 30  # each layer once: resumed pass after pass, never restarted
    assert _disk(tmp_path).load("a", model_tag=TAG).text == "a short turn" + result.reply[:-1]


async def test_a_turn_that_comes_during_an_overdue_copys_slice_waits_for_a_part_not_the_slice(tmp_path, monkeypatch):
    """While turns run, an overdue copy goes a slice of parts a loop pass; a turn that comes meanwhile now
    stops the slice after the part under way (here a slice would be the whole 0.6 s copy)."""
    monkeypatch.setattr(save_queue, "COPY_SLICE_S", 10.0)
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=0.05,
                             copy_layers=30, copy_layer_delay_s=0.02) as (rt, engine, busy):  # 0.6 s whole
        await rt.agent("a").send_prompt("a short turn", max_tokens=3)
        with trio.fail_after(5):
            while engine.copied_layers < 3:  # a's copy is overdue: a slice of it is under way
                await trio.sleep(0.005)
        when_b_started = _copy_when_started(engine, "a turn in the middle of it")
        async with rt.agent("b").stream_prompt("a turn in the middle of it", max_tokens=3) as stream:
            async for _ in stream:
                break
        [(parts, _)] = when_b_started
        assert parts < 30, parts  # the slice stopped for b's turn: b started before the slice's end
        await _until_written(rt, 1)
    assert engine.copied_layers >= 30  # a's copy, resumed after b's turn came, never restarted


async def test_an_overdue_copy_waits_for_a_prefill_under_way_to_end(tmp_path, monkeypatch):
    """H200 run 4: an overdue copy went a slice between the chunks of a cold 32K prompt, and each host
    copy waited for the chunks launched before it (15 ms a chunk, 658 ms against mlx-lm's 481). A copy
    no one waits for now lets a prefill under way finish first, then goes on between decode steps."""
    monkeypatch.setattr(save_queue, "COPY_OVERDUE_S", 0.05)
    engine = FakeEngine(chunk_delay_s=0.01, default_chunk=16, copy_after_turn=True, copy_layers=4,
                        copy_layer_delay_s=0.01)
    async with _open(tmp_path, engine, trace=True) as rt:
        await rt.agent("a").send_prompt("a short turn", max_tokens=3)  # its copy is owed from here
        long = await rt.agent("b").send_prompt("x" * 16 * 30, max_tokens=8)  # 30 chunks: 0.3 s of prefill
        await _until_written(rt, 2)
        events = rt.gpu_events()
    assert long.usage.tokens_prefilled == 16 * 30
    last_chunk = max(e.at for e in events if e.kind == "chunk")
    copies = [e.at for e in events if e.kind == "copy"]
    assert copies and min(copies) > last_chunk  # overdue after 0.05 s, made once the prefill ended
    assert engine.copied_layers == 2 * 4  # both turns' copies, each layer once


async def test_a_durable_turn_answers_with_its_cache_on_disk_while_the_batch_runs(tmp_path, monkeypatch):
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=60.0) as (rt, engine, busy):
        loose = await rt.agent("loose").send_prompt("write-behind", max_tokens=3)
        with trio.fail_after(30):  # well short of the copy's 60 s overdue: the durable turn wanted it
            result = await rt.agent("d").send_prompt("a durable turn", max_tokens=3, durable=True)
        assert _disk(tmp_path).load("d", model_tag=TAG).text == "a durable turn" + result.reply[:-1]
        assert rt.stats().gpu.batch_size == 1
        # Only its own copy was wanted: the store writes the copies it holds, so one owed for an earlier
        # write-behind turn waits for its time (here the end) and the batch never stops for it.
        assert rt.stats().store.writes == 1
    assert _disk(tmp_path).load("loose", model_tag=TAG).text == "write-behind" + loose.reply[:-1]


async def test_a_cache_superseded_or_forgotten_before_its_copy_is_never_copied_nor_written(tmp_path, monkeypatch):
    async with _busy_runtime(tmp_path, monkeypatch, overdue_s=60.0) as (rt, engine, busy):
        prompt = "turn one"
        for _ in range(3):
            result = await rt.agent("a").send_prompt(prompt, max_tokens=3)
            prompt += result.reply + "."
        await rt.agent("gone").send_prompt("soon forgotten", max_tokens=3)
        assert await rt.agent("gone").forget()
    assert [text for text in engine.snapshots if not text.startswith("keep")] == [prompt[:-2]]
    assert _disk(tmp_path).load("a", model_tag=TAG).text == prompt[:-2]
    with pytest.raises(CacheMiss):
        _disk(tmp_path).load("gone", model_tag=TAG)


async def test_turns_right_behind_their_replies_go_first_and_only_the_last_ones_copy_is_made(tmp_path, monkeypatch):
    """An agent in a tool loop sends its next turn as soon as it has the reply: on an idle actor the
    copy waits out a grace period, the next turn runs first, and its cache supersedes that copy."""
    monkeypatch.setattr(save_queue, "COPY_IDLE_GRACE_S", 2.0)
    engine = FakeEngine(copy_after_turn=True)
    async with _open(tmp_path, engine) as rt:
        prompt = "step one"
        for _ in range(4):
            result = await rt.agent("loop").send_prompt(prompt, max_tokens=3)
            prompt += result.reply + "."
        assert engine.snapshots == []
        await _until_written(rt, 1)
    assert engine.snapshots == [prompt[:-2]]


async def test_a_durable_turn_on_an_idle_actor_does_not_wait_out_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(save_queue, "COPY_IDLE_GRACE_S", 60.0)
    engine = FakeEngine(copy_after_turn=True)
    async with _open(tmp_path, engine) as rt:
        with trio.fail_after(30):  # a durable turn's copy is wanted at once, by an actor waiting for work too (grace: 60 s)
            result = await rt.agent("d").send_prompt("a durable turn", max_tokens=3, durable=True)
    assert _disk(tmp_path).load("d", model_tag=TAG).text == "a durable turn" + result.reply[:-1]


async def test_a_turn_that_comes_while_an_idle_actor_copies_waits_for_a_part_not_the_copy(tmp_path, monkeypatch):
    """H200 run 3: a cold 1K turn waited 410 ms behind two copies an idle actor made back to back
    (a 16K and a 32K cache, host copies at about 0.6 GB/s). A message now stops an idle copy
    between two parts; the turn runs, and the copy resumes where it stopped."""
    monkeypatch.setattr(save_queue, "COPY_IDLE_GRACE_S", 0.0)
    engine = FakeEngine(copy_after_turn=True, copy_layers=30, copy_layer_delay_s=0.02)  # 0.6 s a copy
    async with _open(tmp_path, engine) as rt:
        first = await rt.agent("a").send_prompt("the first turn", max_tokens=3)
        with trio.fail_after(5):
            while engine.copied_layers < 3:  # the idle actor is copying its cache
                await trio.sleep(0.005)
        assert engine.copied_layers < 30
        when_b_started = _copy_when_started(engine, "a turn in the middle of it")
        await rt.agent("b").send_prompt("a turn in the middle of it", max_tokens=3)
        # a's copy, stopped for b's turn, was not finished when b started: b did not wait for the rest of it
        [(parts, copies)] = when_b_started
        assert copies == 0 and parts < 30, (parts, copies)
        await _until_written(rt, 2)
    assert engine.copied_layers == 60  # both copies, each layer once: a's resumed, not restarted
    assert _disk(tmp_path).load("a", model_tag=TAG).text == "the first turn" + first.reply[:-1]


async def test_a_failed_copy_fails_only_its_save(tmp_path, caplog):
    engine = FakeEngine(copy_after_turn=True)
    real = engine.snapshot

    def failing(parked, **parts):
        if parked.text.startswith("unlucky"):
            raise RuntimeError("device lost")
        return real(parked, **parts)

    engine.snapshot = failing
    with caplog.at_level(logging.ERROR):
        async with _open(tmp_path, engine) as rt:
            with pytest.raises(TurnFailedError, match="device lost"):
                await rt.agent("u").send_prompt("unlucky turn", max_tokens=3, durable=True)
            again = await rt.agent("u").send_prompt("unlucky turn" + "x", max_tokens=3)
            assert again.usage.tier == "hot"  # the cache stayed in RAM
            fine = await rt.agent("f").send_prompt("a lucky turn", max_tokens=3, durable=True)
    assert _disk(tmp_path).load("f", model_tag=TAG).text == "a lucky turn" + fine.reply[:-1]
    assert any("device lost" in r.getMessage() for r in caplog.records)


# -- the real engine under the forced GPU policy: the deferred copy round-trips through a restart ----------


async def test_under_the_gpu_policy_a_returning_agent_is_served_from_the_copy_made_after_its_turn(tmp_path):
    from runtime.cpu import kv_copy

    messages = [{"role": "user", "content": "Describe the harbour at dawn."}]
    try:
        async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False,
                                handle_signals=False, profile="gpu") as rt:
            first = await rt.agent("returning").send(messages, max_tokens=12)
        disk = _disk(tmp_path)
        async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False,
                                handle_signals=False, profile="gpu") as rt:
            tag = rt.stats().registry.model_tag
            saved = disk.load("returning", model_tag=tag)  # verified: checksums, hash chain, shapes
            messages += [{"role": "assistant", "content": first.reply}, {"role": "user", "content": "And at night?"}]
            second = await rt.agent("returning").send(messages, max_tokens=4)
    finally:
        kv_copy.use_host_views(None)
    # Every token that went through the model: the prompt and the reply but its last sampled token.
    assert len(saved.token_ids) == first.usage.tokens_prefilled + first.usage.tokens_generated - 1
    assert saved.offsets[-1] == len(saved.text)
    assert second.usage.tier == "warm" and second.usage.tokens_reused == len(saved.token_ids)
