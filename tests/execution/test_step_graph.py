"""A decode step's graph under the GPU policy, against plain mlx-lm's (issue 33, item 4).

On a GPU a decode step of a small model is the host's work: each operation in the step's graph is
built in Python and handed to the device by MLX's submit (H200 run 5, a 1B step: 0.8 ms building,
1.5 ms submitting, the device idle meanwhile). So a step that builds more operations than mlx-lm's
`generate_step` is slower than it on a GPU, whatever the CPU says. These tests count the operations
(MLX's graph, as ``export_to_dot`` draws it) of decode steps through the actors, with the GPU policy
forced on the CPU, after a cold, a hot and a warm turn (the three ways a cache reaches its step),
against mlx-lm's own steps on the same model folder: an extra mask, cast or copy per layer shows here
before it costs a lent GPU's run. On the CPU MLX builds its fused operations (attention, RoPE, norms, a
dequantization) from their fallbacks' smaller ones, so the counts are larger than a GPU's; both sides
expand alike.
"""

from __future__ import annotations

import collections
import statistics
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from conftest import mlx_with, models_dir

from benches.gpu.gpu_probe import graph_operation_names
from runtime.execution import decode_batch
from runtime.model import tiny_models

MODEL = "tiny-llama"


def _mlx_lm_step(fused: bool) -> list[str]:
    """The operations of one of plain mlx-lm's steady decode steps (``generate_step``, greedy), its layers'
    projections ``fused`` as the GPU policy's are (:mod:`runtime.model.fused_projections`): the same model on
    both sides, so what differs is what a step adds around it."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from runtime.model.fused_projections import fuse_projections

    model, _tokenizer = load(str(tiny_models.ensure_tiny_model(MODEL, models_dir())))
    if fused:
        assert fuse_projections(model) > 0
    steps: list[list[str]] = []
    launch = mx.async_eval

    def counted(*arrays: mx.array) -> None:
        mx.synchronize()  # the step before is evaluated, so the count is this step's alone
        steps.append(graph_operation_names(arrays[0]))
        launch(*arrays)

    mx.async_eval = counted
    try:
        for _ in generate_step(mx.array(list(range(5, 200))), model, max_tokens=10):
            pass
    finally:
        mx.async_eval = launch
    return steps[len(steps) // 2]


class Steps:
    """The operations of each decode step the runtime launches, with its number of rows."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[str]]] = []

    def middle(self) -> tuple[int, list[str]]:
        """A steady step of what ran since the last call (not the first: it may hold a join's work)."""
        steps, self.steps = self.steps, []
        assert len(steps) >= 3, steps
        return steps[len(steps) // 2]


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> Steps:
    seen = Steps()
    launch = decode_batch.DecodeBatch._launch

    def counted(self: decode_batch.DecodeBatch, inputs: mx.array) -> mx.array:
        mx.synchronize()  # the step in flight is evaluated: its graph is not counted again in this one's
        tokens = launch(self, inputs)
        seen.steps.append((len(self.members), graph_operation_names(tokens)))
        return tokens

    monkeypatch.setattr(decode_batch.DecodeBatch, "_launch", counted)
    return seen


def _open(home: Path) -> Any:
    from actors import open_runtime

    return open_runtime(home=home, models_dir=models_dir(), model=MODEL, prewarm_mb=0, profile="gpu")


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_a_lone_rows_step_builds_no_more_than_mlx_lms_after_a_cold_hot_or_warm_turn(
        tmp_path: Path, steps: Steps) -> None:
    from runtime.backend import decide_profile

    reference = _mlx_lm_step(fused=decide_profile(device="cpu", backend="cpu", profile="gpu").fused_projections)
    seen = {}
    async with _open(tmp_path) as rt:
        agent = rt.agent("a")
        await agent.send(_ask("Tell me about the harbour and its ships. " * 20), max_tokens=12)
        seen["cold"] = steps.middle()
        await agent.send(_ask("And the lighthouse?"), max_tokens=12)
        seen["hot"] = steps.middle()
    async with _open(tmp_path) as rt:  # a restart: the cache comes back from disk
        await rt.agent("a").send(_ask("And the keeper?"), max_tokens=12)
        seen["warm"] = steps.middle()
    for tier, (rows, operations) in seen.items():
        assert rows == 1, tier
        extra = collections.Counter(operations) - collections.Counter(reference)
        # mlx-lm also takes the log-softmax of every step's logits (for its logprobs): kvmem needs no more.
        assert len(operations) <= len(reference) and not extra, (tier, len(operations), len(reference), extra)


async def test_a_batch_step_builds_as_much_for_eight_rows_as_for_two(tmp_path: Path, steps: Steps) -> None:
    """Rows of different lengths need a mask, built once a step for every layer; a row adds no operation
    (each is paid on a GPU's host at every step)."""
    seen = {}
    async with _open(tmp_path) as rt:
        for count in (2, 8):
            async with trio.open_nursery() as nursery:
                for i in range(count):
                    text = f"Agent {i} asks about the harbour. " * (2 + 3 * i)  # every row its own length
                    nursery.start_soon(lambda i=i, text=text, count=count:
                                       rt.agent(f"{count}-{i}").send(_ask(text), max_tokens=12))
            batched = [s for s in steps.steps if s[0] == count]
            steps.steps.clear()
            assert len(batched) >= 3, f"{count} rows never stepped together"
            seen[count] = statistics.median_low(len(ops) for _, ops in batched)
    assert seen[8] == seen[2], seen



async def test_a_batch_rows_park_builds_a_few_operations_a_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents finishing together each park their row of the batch (copied out with room for their next turn, their
    turn's tokens quantized) in a job of their own on the model's thread, one after another: H200 run 6's 8 finishes
    came about 4 ms apart, the last 40 ms after the round's final step, each launching some 380 operations on the
    1B (24 a layer: the row's copy was a gather of five nodes an array). Now a layer's keys and values are each
    two views (the row, the turn's tokens), one pad, one cast and one quantization."""
    from runtime.kv import kvstate

    parks: list[collections.Counter[str]] = []

    def counted(*arrays: Any) -> None:  # kvstate's launches: a park's only
        parks.append(collections.Counter(graph_operation_names(list(arrays))))
        mx.async_eval(*arrays)

    async with _open(tmp_path) as rt:
        for turn in range(2):  # the second turn's rows park their rows of a float batch, the first's warmed up
            if turn:
                monkeypatch.setattr(kvstate, "mx", mlx_with(async_eval=counted))
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    text = f"Agent {i} asks about the harbour, turn {turn}. " * (3 + i)
                    # Agents of their own that share nothing: rows that began cold (a row that began from a
                    # cache also views each chunk it began from; the seeds' 80% rule once sent these cold too).
                    agent = rt.agent(f"r{i}-{turn}", share_prefix=False)
                    nursery.start_soon(lambda agent=agent, text=text: agent.send(_ask(text), max_tokens=8))
    assert len(parks) == 4, parks
    for ops in parks:
        layers = ops["Quantize"] // 2
        assert layers >= 2 and set(ops) <= {"Slice", "Pad", "AsType", "Quantize"}, ops
        assert ops["Pad"] == ops["AsType"] == 2 * layers and sum(ops.values()) <= 12 * layers, ops
