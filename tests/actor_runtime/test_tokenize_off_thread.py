"""Prompts are rendered and tokenized off the model's thread (actors.gpu: ``_submit``), a long one on a worker
of its own, and one that cannot fit the context is refused from its length before it is tokenized.

On an H200's host a prompt took about 4 ms per 1K tokens to tokenize (run 4: a 32K prompt waited
120-206 ms before admission). On the model's thread every running turn waited for it too; on a
worker thread (one at a time, in arrival order) the batch decodes on, and turns that arrive
together on an idle actor are still admitted together.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trio

from actors import open_runtime
from actors.gpu import LONG_TEXT_CHARS
from fake_engine import FakeEngine, fake_reply
from runtime.errors import ContextLengthExceededError

TOKENIZE_S = 0.3
WAIT_S = 10.0
"""The longest a tokenization waits for the running turn's tokens (a safety: one that waited this long failed)."""


class SlowTokenizer(FakeEngine):
    """A fake engine whose tokenizer takes ``TOKENIZE_S`` for prompts that ask for it ("slow ..."); ``spans``
    holds each slow tokenization's (thread, start, end), in the order they ran."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spans: list[tuple[int, float, float]] = []

    def tokenize(self, prompt, plan):
        if prompt.startswith("slow"):
            began = time.perf_counter()
            time.sleep(TOKENIZE_S)
            self.spans.append((threading.get_ident(), began, time.perf_counter()))
        return super().tokenize(prompt, plan)


def _one_at_a_time(spans: list[tuple[int, float, float]]) -> bool:
    """Whether the tokenizations ran one after another: each began once the one before it had ended."""
    return all(end <= began for (_, _, end), (_, began, _) in zip(spans, spans[1:]))


def _open(tmp_path: Path, engine: FakeEngine):
    return open_runtime(model="fake-a", home=tmp_path, engine=engine, fsync=False, handle_signals=False, trace=True)


async def test_a_long_tokenization_does_not_stall_the_running_turns(tmp_path):
    """b's tokenization waits (on whichever thread runs it) for three more of a's tokens to reach a's client:
    on the model's thread it would wait in vain, since a's next step could not run meanwhile."""
    received = [0]  # a's deltas so far
    stalled: list[str] = []

    class WaitsForTheRunningTurn(SlowTokenizer):
        def tokenize(self, prompt, plan):
            if prompt.startswith("slow"):
                wanted, deadline = received[0] + 3, time.monotonic() + WAIT_S
                while received[0] < wanted:
                    if time.monotonic() > deadline:
                        stalled.append(f"a's client got {received[0] - wanted + 3} of 3 tokens meanwhile")
                        break
                    time.sleep(0.001)
            return super().tokenize(prompt, plan)

    engine = WaitsForTheRunningTurn(step_delay_s=0.005)
    async with _open(tmp_path, engine) as rt, trio.open_nursery() as nursery:
        slow: list = []

        async def send_slow() -> None:
            slow.append(await rt.agent("b").send_prompt("slow prompt", max_tokens=4))

        async with rt.agent("a").stream_prompt("tell me", max_tokens=150) as stream:
            async for _ in stream:
                received[0] += 1
                if received[0] == 10:
                    nursery.start_soon(send_slow)
        assert stream.result is not None and stream.result.reply == fake_reply("tell me", 150)
        model_thread = rt._gpu.thread_ident
    assert slow and slow[0].reply == fake_reply("slow prompt", 4)
    assert not stalled, stalled  # a's tokens kept coming while b's prompt was tokenized
    assert model_thread is not None and len(engine.spans) == 1 and engine.spans[0][0] != model_thread  # off its thread


async def test_turns_that_arrive_together_on_an_idle_actor_are_admitted_together(tmp_path):
    engine = SlowTokenizer()
    async with _open(tmp_path, engine) as rt:
        results = []

        async def one(i: int) -> None:
            results.append(await rt.agent(f"a{i}").send_prompt(f"slow {i}", max_tokens=3))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        events = rt.gpu_events()
    assert len(results) == 4
    first_step = next(e for e in events if e.kind == "step")
    assert len(first_step.request_ids) == 4  # the first waited for the others' tokenization: one batch
    tokenized = [e.at for e in events if e.kind == "tokenized"]
    assert len(tokenized) == 4 and len(engine.spans) == 4 and _one_at_a_time(engine.spans)


async def test_turns_admitted_together_start_in_one_job_on_the_models_thread(tmp_path, monkeypatch):
    """Each job is a hop to the model's thread and back (H200 run 5: a batch's 8 joins were admitted 0.45 ms
    apart, one job each, before their joint pass): the turns admitted together start in one."""
    from actors.mlx_thread import MlxThread

    engine = SlowTokenizer()
    jobs, started_in = [0], []
    run = MlxThread.run

    async def counted(self, fn, *args):
        jobs[0] += 1
        return await run(self, fn, *args)

    def start(request_id, *args):
        started_in.append(jobs[0])
        return FakeEngine.start(engine, request_id, *args)

    monkeypatch.setattr(MlxThread, "run", counted)
    engine.start = start
    async with _open(tmp_path, engine) as rt, trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(lambda i=i: rt.agent(f"a{i}").send_prompt(f"slow {i}", max_tokens=3))
    assert len(started_in) == 4 and len(set(started_in)) == 1, started_in


async def test_prompts_that_queue_while_one_is_tokenized_go_together_in_the_next_hop(tmp_path):
    """A hop to the text worker and back each cost a batch's 8 joins 0.3 ms apiece (H200 run 5): the prompts
    that queue while one is tokenized now go to the worker together, still one at a time and in order there."""
    engine = SlowTokenizer()
    async with _open(tmp_path, engine) as rt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rt.agent("a0").send_prompt("slow 0", max_tokens=3))
            while not any(e.kind == "planned" for e in rt.gpu_events()):  # its tokenization is under way
                await trio.sleep(0.001)
            for i in range(1, 4):
                nursery.start_soon(lambda i=i: rt.agent(f"a{i}").send_prompt(f"slow {i}", max_tokens=3))
        hops = rt._gpu._text_jobs.hops
        events = rt.gpu_events()
    assert hops == 2  # the first prompt alone, then the three that queued meanwhile
    tokenized = [e.at for e in events if e.kind == "tokenized"]
    assert len(tokenized) == 4 and len(engine.spans) == 4 and _one_at_a_time(engine.spans)  # in order there
    assert len({thread for thread, _, _ in engine.spans}) == 1  # on the one worker


# -- huge prompts (issue 58, item 1) ------------------------------------------------------------


async def test_a_long_prompt_is_tokenized_by_its_own_worker_and_never_holds_up_a_short_one(tmp_path):
    """The long prompt's tokenization does not end until the short turn has its reply: on one worker the
    short turn would queue behind it and this would wait in vain (then fail, ``stalled``)."""
    short_done = threading.Event()
    stalled: list[str] = []

    class WaitsForTheShortTurn(FakeEngine):
        def tokenize(self, prompt, plan):
            if prompt.startswith("long"):
                if not short_done.wait(WAIT_S):
                    stalled.append("the short turn did not end while the long prompt was being tokenized")
            return super().tokenize(prompt, plan)

    long_prompt = "long " + "x" * LONG_TEXT_CHARS
    async with _open(tmp_path, WaitsForTheShortTurn()) as rt, trio.open_nursery() as nursery:
        ended: list[str] = []

        async def long_turn() -> None:
            await rt.agent("big").send_prompt(long_prompt, max_tokens=2)
            ended.append("long")

        nursery.start_soon(long_turn)
        while not rt._gpu._tokenizing:  # the long turn has reached its tokenizer
            await trio.sleep(0.001)
        short = await rt.agent("small").send_prompt("a short one", max_tokens=3)
        ended.append("short")
        short_done.set()
    assert short.reply == fake_reply("a short one", 3)
    assert ended == ["short", "long"] and not stalled, (ended, stalled)


async def test_a_prompt_too_long_for_the_context_is_refused_from_its_length_before_tokenizing(tmp_path):
    """FakeEngine has a token a character (``max_token_bytes`` 4): 400 ASCII bytes are at least 100 tokens,
    over a context of 64, and are never tokenized; 200 bytes pass the bound and the exact count refuses them."""
    tokenized: list[int] = []

    class Counting(FakeEngine):
        def tokenize(self, prompt, plan):
            tokenized.append(len(prompt))
            return super().tokenize(prompt, plan)

    async with _open(tmp_path, Counting(context_length=64)) as rt:
        with pytest.raises(ContextLengthExceededError, match=r"400 bytes: at least 100 tokens"):
            await rt.agent("huge").send_prompt("h" * 400, max_tokens=2)
        assert tokenized == []
        with pytest.raises(ContextLengthExceededError, match=r"the prompt \(200 tokens\)"):
            await rt.agent("large").send_prompt("l" * 200, max_tokens=2)
        assert tokenized == [200]
        assert (await rt.agent("fits").send_prompt("f" * 20, max_tokens=2)).reply == fake_reply("f" * 20, 2)


async def test_a_queued_prompt_whose_client_left_is_never_tokenized(tmp_path):
    """Two long prompts queue on the long worker; the second's client leaves while the first is tokenized:
    when the worker comes to it, it is dropped unrun (``actors.text_jobs.Abandoned``)."""
    release = threading.Event()
    tokenized: list[str] = []

    class Gated(FakeEngine):
        def tokenize(self, prompt, plan):
            if prompt.startswith("first"):
                release.wait(WAIT_S)
            tokenized.append(prompt[:6])
            return super().tokenize(prompt, plan)

    pad = "x" * LONG_TEXT_CHARS
    async with _open(tmp_path, Gated()) as rt, trio.open_nursery() as nursery:
        first: list = []

        async def first_turn() -> None:
            first.append(await rt.agent("one").send_prompt("first " + pad, max_tokens=2))

        nursery.start_soon(first_turn)
        while not rt._gpu._tokenizing:
            await trio.sleep(0.001)
        with trio.CancelScope() as leave:
            async def leave_once_queued() -> None:
                while len(rt._gpu._tokenizing) < 2:  # the second turn waits for the worker
                    await trio.sleep(0.001)
                leave.cancel()  # its client leaves

            nursery.start_soon(leave_once_queued)
            async with rt.agent("two").stream_prompt("second " + pad, max_tokens=2) as stream:
                async for _ in stream:
                    pass
        release.set()
        while rt._gpu._tokenizing:
            await trio.sleep(0.001)
    assert first and tokenized == ["first "], tokenized
