"""Prompts are rendered and tokenized off the model's thread (actors.gpu: ``_submit``).

On an H200's host a prompt took about 4 ms per 1K tokens to tokenize (run 4: a 32K prompt waited
120-206 ms before admission). On the model's thread every running turn waited for it too; on a
worker thread (one at a time, in arrival order) the batch decodes on, and turns that arrive
together on an idle actor are still admitted together.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

from actors import open_runtime
from fake_engine import FakeEngine, fake_reply

TOKENIZE_S = 0.3


class SlowTokenizer(FakeEngine):
    """A fake engine whose tokenizer takes ``TOKENIZE_S`` for prompts that ask for it ("slow ...")."""

    def tokenize(self, prompt, plan):
        if prompt.startswith("slow"):
            time.sleep(TOKENIZE_S)
        return super().tokenize(prompt, plan)


def _open(tmp_path: Path, engine: FakeEngine):
    return open_runtime(model="fake-a", home=tmp_path, engine=engine, fsync=False, handle_signals=False, trace=True)


async def test_a_long_tokenization_does_not_stall_the_running_turns(tmp_path):
    engine = SlowTokenizer(step_delay_s=0.005)
    arrivals: list[float] = []
    async with _open(tmp_path, engine) as rt, trio.open_nursery() as nursery:
        slow: list = []

        async def send_slow() -> None:
            slow.append(await rt.agent("b").send_prompt("slow prompt", max_tokens=4))

        async with rt.agent("a").stream_prompt("tell me", max_tokens=150) as stream:
            async for _ in stream:
                arrivals.append(time.perf_counter())
                if len(arrivals) == 10:
                    nursery.start_soon(send_slow)
        assert stream.result is not None and stream.result.reply == fake_reply("tell me", 150)
    assert slow and slow[0].reply == fake_reply("slow prompt", 4)
    gaps = [b - a for a, b in zip(arrivals[10:], arrivals[11:])]
    assert max(gaps) < TOKENIZE_S / 2, max(gaps)  # a's tokens kept coming while b's prompt was tokenized


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
    assert len(tokenized) == 4 and all(b - a >= TOKENIZE_S * 0.9 for a, b in zip(tokenized, tokenized[1:]))  # one at a time


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
            for i in range(4):
                nursery.start_soon(lambda i=i: rt.agent(f"a{i}").send_prompt(f"slow {i}", max_tokens=3))
        hops = rt._gpu._text_jobs.hops
        events = rt.gpu_events()
    assert hops == 2  # the first prompt alone, then the three that queued meanwhile
    tokenized = [e.at for e in events if e.kind == "tokenized"]
    assert len(tokenized) == 4 and all(b - a >= TOKENIZE_S * 0.9 for a, b in zip(tokenized, tokenized[1:]))
