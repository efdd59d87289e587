"""Host round trips per turn under the GPU backend policy, counted on the CPU (issue 33, item 4).

On a GPU every ``mx.eval`` is a synchronisation with the device and every NumPy view of an MLX
array a copy to the host. The CPU policy uses both on purpose (NumPy attention, NumPy KV copies,
the shared-prefix check); the GPU policy must not. This test forces the GPU policy on the CPU
device and counts them per prefill chunk, per decode step (joins included) and at a turn's end,
so none of the CPU's host paths can silently come back on a GPU.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conftest import models_dir

from runtime.plan.sampling import SamplingOptions
from runtime.plan.turn_plan import ColdStart, TurnPlan

PROMPT = "Tell me about the sea and the ships on it. " * 60


class HostCalls:
    """``mx.eval`` / ``mx.async_eval`` calls, reads of MLX arrays (``tolist``, ``item``: each waits for the
    array, and so for the work queued before it) and NumPy conversions since the last :meth:`take`."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def take(self) -> dict[str, int]:
        counts, self.counts = dict(self.counts), collections.Counter()
        return counts


@pytest.fixture
def host_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostCalls]:
    calls = HostCalls()
    evaluate, evaluate_async, asarray, array = mx.eval, mx.async_eval, np.asarray, np.array

    def counted_eval(*args: Any, **kwargs: Any) -> Any:
        calls.counts["eval"] += 1
        return evaluate(*args, **kwargs)

    def counted_async_eval(*args: Any, **kwargs: Any) -> Any:
        calls.counts["async_eval"] += 1
        return evaluate_async(*args, **kwargs)

    def counted(name: str, fn: Any) -> Any:
        def convert(x: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(x, mx.array):
                calls.counts[name] += 1
            return fn(x, *args, **kwargs)
        return convert

    def counted_read(name: str, fn: Any) -> Any:
        def read(self: mx.array) -> Any:
            calls.counts["read"] += 1
            return fn(self)
        return read

    monkeypatch.setattr(mx, "eval", counted_eval)
    monkeypatch.setattr(mx, "async_eval", counted_async_eval)
    monkeypatch.setattr(mx.array, "tolist", counted_read("tolist", mx.array.tolist))
    monkeypatch.setattr(mx.array, "item", counted_read("item", mx.array.item))
    monkeypatch.setattr(np, "asarray", counted("to_numpy", asarray))
    monkeypatch.setattr(np, "array", counted("to_numpy", array))
    yield calls


@pytest.mark.parametrize("attention", ["native", "at-rest"])
def test_the_gpu_policy_syncs_once_per_chunk_and_step_and_waits_for_nothing_at_a_turns_end(
    host_calls: HostCalls, attention: str
) -> None:
    from runtime.cpu import kv_copy
    from runtime.execution.mlx_engine import MlxEngine

    engine = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention=attention, profile="gpu",
                       prefill_chunk=128, keep_float_mb=64)
    try:
        engine.load("tiny-llama")
        plan = TurnPlan(tier="cold", source=ColdStart(), match="empty", reuse_tokens=0, reuse_chars=0)
        for request_id in (1, 2):
            engine.start(request_id, PROMPT, plan, engine.tokenize(PROMPT, plan), SamplingOptions(max_tokens=6))
        host_calls.take()
        chunks = 0
        while engine.prefill(1, None).remaining:
            chunks += 1
        chunks += 1
        assert chunks >= 3
        # Each chunk launched without waiting for it; the last one's first token is then read back
        # (its one wait, as a decode step's). No blocking eval, no NumPy.
        assert host_calls.take() == {"async_eval": chunks, "read": 1}
        while engine.prefill(2, None).remaining:
            pass
        engine.join(1)
        engine.join(2)
        host_calls.take()
        steps = 0
        while not any(token.finished for token in engine.step()):
            steps += 1
        steps += 1
        # One launch and one read a step, run ahead (the host reads step k while the device computes
        # k+1), no blocking eval, no NumPy copies, the join's merge included. The first step is launched
        # on its own before the one ahead of it (read, it waits for itself alone): one launch more.
        assert host_calls.take() == {"async_eval": steps + 1, "read": steps}
        layers = len(engine.lm.spec.layers)
        finished = engine.finish(1)
        # The turn's end, whatever the number of layers: the park (every layer quantized, at-rest's
        # kept float overwritten) launched in one go, waited for by nothing; no copy for the save, and
        # no read of the batch's padding as the row leaves (the host keeps it: runtime/kv/decode_kv.py).
        assert host_calls.take() == {"async_eval": 1}
        assert finished.parked is not None and finished.snapshot is None
        # The copy, made later (actors.gpu: when the actor is idle or the store wants it): one wait
        # for the arrays the save copies, then those copies (six packed arrays a layer, each one part);
        # at-rest, the kept floats' last writes launched after it (FloatResident.settle), waited for by nothing.
        snapshot = engine.snapshot(finished.parked)
        settled = {"async_eval": 1} if attention == "at-rest" else {}
        assert host_calls.take() == {"eval": 1, "to_numpy": 6 * layers, **settled}
        assert snapshot.token_ids == list(finished.parked.token_ids)
    finally:
        engine.unload()
        kv_copy.use_host_views(None)


def test_the_cpu_policy_takes_its_host_paths(host_calls: HostCalls) -> None:
    """The counter sees the CPU's NumPy paths, so the test above would see them leak."""
    from runtime.execution.mlx_engine import MlxEngine

    engine = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention="auto", prefill_chunk=128,
                       profile="cpu")
    try:
        engine.load("tiny-llama")
        plan = TurnPlan(tier="cold", source=ColdStart(), match="empty", reuse_tokens=0, reuse_chars=0)
        engine.start(1, PROMPT, plan, engine.tokenize(PROMPT, plan), SamplingOptions(max_tokens=2))
        host_calls.take()
        engine.prefill(1, None)
        assert host_calls.take().get("to_numpy", 0) > 0  # NumPy attention
    finally:
        engine.unload()


@pytest.mark.parametrize("tier", ["hot", "warm"])
def test_a_turn_resumed_from_its_cache_starts_without_a_wait(host_calls: HostCalls, tier: str) -> None:
    """A hot turn (its parked Q4 cache, activated) and a warm one (a snapshot from disk, brought to the
    device) under the GPU policy: building the sequence waits for nothing and reads nothing; the short
    prefill launches once and reads its first token; the end waits for nothing."""
    from engine_turns import run_turn, tiny_engine

    from runtime.plan.turn_plan import FromHot, FromWarm, OwnCache
    from runtime.plan.kv_manager import own_plan

    with tiny_engine("gpu", keep_float_mb=0) as engine:
        first = run_turn(engine, 1, PROMPT, max_tokens=4)
        prompt = PROMPT + (first.reply or "") + "\nUser: and the harbour?\nAssistant:"
        parked = first.parked
        assert parked is not None
        source = FromHot(parked=parked) if tier == "hot" else FromWarm(snapshot=engine.snapshot(parked))
        plan = own_plan(OwnCache(source=source, tier=tier), prompt)
        assert plan is not None and plan.reuse_tokens > 0
        tokens = engine.tokenize(prompt, plan)
        host_calls.take()
        engine.start(2, prompt, plan, tokens, SamplingOptions(max_tokens=3))
        assert host_calls.take() == {}
        while engine.prefill(2, None).remaining:
            pass
        assert host_calls.take() == {"async_eval": 1, "read": 1}
        engine.join(2)
        while not any(token.finished for token in engine.step()):
            pass
        host_calls.take()
        engine.finish(2)
        assert host_calls.take() == {"async_eval": 1}
