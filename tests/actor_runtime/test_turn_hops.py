"""What one turn costs the house (issue 60, item 2): typed messages, MLX jobs, text jobs and thread hand-offs, counted.

A tracer records every msgspec message sent on a trio memory channel, once (trio's ``send`` tries
``send_nowait`` first: a trace of both methods counts a message sent with ``await send`` twice, as the
issue's 16 did for ``Turn``, ``Acquire``, ``CheckOut`` and ``Generate``), the text deltas apart, every job handed
to the MLX thread and to the text worker, and every hand-off to a worker thread, during one streaming turn of tiny-llama: cold (a new agent), hot (the next turn,
its cache in RAM), warm (after a restart, its cache on disk) and batched (four agents at once, per
turn). The counts may fall, never grow: :data:`CEILING` holds today's, so a change that adds a hop
fails here and says which; a change that removes one lowers the ceiling with it.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import trio
from conftest import models_dir

from actors import open_runtime
from actors.mlx_thread import MlxThread
from actors.text_jobs import TextJobs

_SENDING: contextvars.ContextVar[bool] = contextvars.ContextVar("sending", default=False)  # per trio task
MESSAGES = [{"role": "user", "content": "Log: fog at dawn over the harbour."}]
STEPS = 6


@dataclass
class Costs:
    """What the traced turns sent and ran: message types, deltas, MLX jobs, text jobs."""

    messages: Counter[str] = field(default_factory=Counter)
    order: list[str] = field(default_factory=list)  # the message types, as they were sent
    deltas: int = 0
    mlx_jobs: int = 0
    text_jobs: int = 0
    thread_jobs: int = 0  # hand-offs to a worker thread (trio.to_thread): the text worker's batches, the store's disk
    jobs: Counter[str] = field(default_factory=Counter)  # MLX jobs by function

    def per_turn(self, turns: int) -> dict[str, float]:
        return {"messages": sum(self.messages.values()) / turns, "mlx_jobs": self.mlx_jobs / turns,
                "text_jobs": self.text_jobs / turns, "thread_jobs": self.thread_jobs / turns}


@contextmanager
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[Costs]:
    """Count, while inside, what every memory channel carries and every MLX and text job."""
    costs = Costs()
    send, send_nowait = trio.MemorySendChannel.send, trio.MemorySendChannel.send_nowait
    mlx_run, text_run, to_thread = MlxThread.run, TextJobs.run, trio.to_thread.run_sync

    def note(value: object) -> None:
        if isinstance(value, str):
            costs.deltas += 1
        elif isinstance(value, msgspec.Struct):
            costs.messages[type(value).__name__] += 1
            costs.order.append(type(value).__name__)

    async def traced_send(self, value):  # type: ignore[no-untyped-def]
        note(value)
        token = _SENDING.set(True)  # trio's send tries send_nowait first: one message, counted once
        try:
            return await send(self, value)
        finally:
            _SENDING.reset(token)

    def traced_send_nowait(self, value):  # type: ignore[no-untyped-def]
        if not _SENDING.get():
            note(value)
        return send_nowait(self, value)

    async def traced_mlx(self, fn, *args):  # type: ignore[no-untyped-def]
        costs.mlx_jobs += 1
        costs.jobs[getattr(fn, "__name__", type(fn).__name__)] += 1
        return await mlx_run(self, fn, *args)

    async def traced_text(self, fn, *args, **kw):  # type: ignore[no-untyped-def]
        costs.text_jobs += 1
        return await text_run(self, fn, *args, **kw)

    async def traced_to_thread(fn, *args, **kw):  # type: ignore[no-untyped-def]
        costs.thread_jobs += 1
        return await to_thread(fn, *args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(trio.MemorySendChannel, "send", traced_send)
        patch.setattr(trio.MemorySendChannel, "send_nowait", traced_send_nowait)
        patch.setattr(MlxThread, "run", traced_mlx)
        patch.setattr(TextJobs, "run", traced_text)
        patch.setattr(trio.to_thread, "run_sync", traced_to_thread)
        yield costs


async def _turn(rt, agent_id: str, messages) -> str:  # type: ignore[no-untyped-def]
    async with rt.agent(agent_id).stream(messages, max_tokens=STEPS) as stream:
        async for _ in stream:
            pass
    assert stream.result is not None
    return stream.result.usage.tier


CEILING = {  # per streaming turn of STEPS tokens, measured at this commit; lower them as hops go
    # A hot or cold turn, 6 messages: Turn (to the agent); Generate (to the GPU actor, which holds the model
    # and the agents' hot caches, and knows which caches the store holds: no lease, no registry, no
    # checkout); TurnStarted (to the client: it started at once, so it is accepted too; a turn that waits
    # gets a TurnAccepted first); Save (the GPU actor hands the new cache's host copy to the store, with the
    # turn's reply: the turn is durable); Generated (the store sends the agent that reply once the cache is
    # on disk); TurnDone. A warm turn adds one round trip, Load and Loaded: its cache is the store's (here
    # read ahead at start). 8 for every turn before the hot tier moved to the GPU actor (CheckOut and
    # CheckedOut always), 13 when issue 60 began (the model registry's Acquire, Granted and Release; the
    # agent's own CheckOut and CheckIn; a TurnAccepted always; Generated and the store's Saved apart). 9 MLX
    # jobs: start, the prefill (its first token), joining the batch, 5 decode steps, finish. A batched
    # turn's jobs depend on when its rows arrive: at most a lone turn's; one that waits for the others'
    # prefill gets its TurnAccepted. Thread hand-offs: the text worker's two (render, tokenize) and the save;
    # a warm turn's cache was read ahead at start. Batched turns share text batches: at most a lone turn's.
    "cold": {"messages": 6, "mlx_jobs": 9, "text_jobs": 2, "thread_jobs": 3},
    "hot": {"messages": 6, "mlx_jobs": 9, "text_jobs": 2, "thread_jobs": 3},
    "warm": {"messages": 8, "mlx_jobs": 9, "text_jobs": 2, "thread_jobs": 3},
    "batched": {"messages": 6, "mlx_jobs": 9, "text_jobs": 2, "thread_jobs": 3},
}


def _diagram() -> list[str]:
    """The message types ARCHITECTURE.md's diagram of a turn names, in order (its deltas apart)."""
    text = (Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text()
    block = text.split("## A turn's messages", 1)[1].split("```mermaid", 1)[1].split("```", 1)[0]
    labels = [line.split(":", 1)[1].strip() for line in block.splitlines() if "->>" in line]
    return [label.split()[0] for label in labels if label[0].isupper()]


def _open(home: Path):  # type: ignore[no-untyped-def]
    return open_runtime(model="tiny-llama", home=home, models_dir=models_dir(), fsync=False, prewarm_mb=0,
                        through_owner=False)


async def test_a_turn_costs_no_more_messages_and_jobs_than_it_did(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    measured: dict[str, dict[str, float]] = {}
    kinds: dict[str, Counter[str]] = {}
    jobs: dict[str, Counter[str]] = {}
    async with _open(tmp_path) as rt:
        await _turn(rt, "warm-up", MESSAGES)  # the first turn of a process compiles and allocates
        with traced(monkeypatch) as cold:
            assert await _turn(rt, "a", MESSAGES) == "cold"
        follow = [*MESSAGES, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Log: wind."}]
        with traced(monkeypatch) as hot:
            assert await _turn(rt, "a", follow) in ("hot", "shared")
        with traced(monkeypatch) as batched:
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(_turn, rt, f"b{i}", [{"role": "user", "content": f"Log {i}: calm seas."}])
    async with _open(tmp_path) as rt:
        await _turn(rt, "warm-up", [*MESSAGES, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
        again = [*follow, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Log: rain."}]
        with traced(monkeypatch) as warm:
            assert await _turn(rt, "a", again) == "warm"
    for name, costs, turns in (("cold", cold, 1), ("hot", hot, 1), ("warm", warm, 1), ("batched", batched, 4)):
        measured[name], kinds[name], jobs[name] = costs.per_turn(turns), costs.messages, costs.jobs
    assert hot.order == _diagram(), f"ARCHITECTURE.md's diagram says {_diagram()}; a hot turn sent {hot.order}"
    for name, ceiling in CEILING.items():
        for what, most in ceiling.items():
            assert measured[name][what] <= most, f"a {name} turn now costs {measured[name][what]} {what} " \
                                                 f"(at most {most}); its messages: {dict(kinds[name])}, " \
                                                 f"its MLX jobs: {dict(jobs[name])}"
