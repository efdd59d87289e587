"""Decoding one step ahead (the GPU policy) gives the turns lockstep decoding gives (issue 33, item 4).

The reference is the same rows decoded in lockstep, where the host reads every step before the
next is launched (the CPU policy, and kvmem before the profile). Rows join at different steps,
finish by length, by a stop string and by end of text, and one row starts with forced tokens
(a tool call's opening), during which the batch steps in lockstep.
"""

from __future__ import annotations

import pytest
from agreement import assert_decoded_alike
from conftest import tiny

from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.sequence import SequenceSampling, Sequence

ROWS = {  # name: (prompt, sampling, the step the row joins at)
    "a": ("The harbour master kept a ledger of ships. " * 6, SequenceSampling(max_tokens=5), 0),
    "b": ("Once upon a time in a quiet town, " * 5, SequenceSampling(max_tokens=14), 0),
    "c": ("Numbers: one two three four five six. " * 4, SequenceSampling(max_tokens=9), 3),
    "d": ("A list of fruits and their colours. " * 7, SequenceSampling(max_tokens=12, stop=("e",)), 1),
    "e": ("Call the weather tool for Paris. " * 3, SequenceSampling(max_tokens=7, forced=(5, 6, 7, 8)), 2),
}


def _decode(attention: str, run_ahead: bool) -> dict[str, Sequence]:
    lm = tiny("tiny-llama")
    seqs = {}
    for name, (prompt, params, _) in ROWS.items():
        seq = Sequence(lm, prompt, None, params, attention=attention)
        seq.logits_trace = []
        while seq.prefill_step() is None:
            pass
        assert seq.finish_reason is None
        seqs[name] = seq
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=run_ahead)
    done: set[str] = set()
    for step in range(40):
        for name, (_, _, joins_at) in ROWS.items():
            if joins_at == step:
                batch.add(seqs[name])
        for seq, _text in batch.step_once():
            if seq.finish_reason is not None:
                batch.remove(seq)  # as the engine does with a finished row, before the next step
                done.add(next(n for n, s in seqs.items() if s is seq))
        if len(done) == len(ROWS):
            break
    assert done == set(ROWS)
    return seqs


@pytest.mark.parametrize("attention", ["native", "at-rest"])
def test_one_step_ahead_decodes_what_lockstep_decodes(attention: str) -> None:
    lockstep, ahead = _decode(attention, run_ahead=False), _decode(attention, run_ahead=True)
    limit = tiny("tiny-llama").vocab_limit
    for name in ROWS:
        assert ahead[name].finish_reason == lockstep[name].finish_reason, name
        assert ahead[name].reply == lockstep[name].reply, name
        # logits within float noise, the same tokens, and the same parked tokens, text and KV:
        # the position a finished row was fed once more is not kept.
        assert_decoded_alike(lockstep[name], ahead[name], limit, atol=1e-3)
    assert ahead["e"].generated[:4] == [5, 6, 7, 8]
    assert ahead["d"].finish_reason == "stop" and lockstep["a"].finish_reason == "length"


@pytest.mark.parametrize("run_ahead", [False, True])
def test_every_step_records_where_its_time_went(run_ahead: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU actor's trace carries each step's launch / wait / host split (``StepTiming``): its parts
    are the step's own time, nothing before it or after it. Each part is held against the spans it must
    contain, timed on the same clock around the step's own calls (its launches: the graph's building; each
    row's accepting its token: the host's work), so the checks hold however slow or busy the machine is."""
    import time

    lm = tiny("tiny-llama")
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=run_ahead)
    for name in ("b", "c"):  # rows that outlast the six steps
        prompt, params, _ = ROWS[name]
        seq = Sequence(lm, prompt, None, params, attention="at-rest")
        while seq.prefill_step() is None:
            pass
        batch.add(seq)
    assert batch.last_timing is None
    spans: dict[str, float] = {"launch": 0.0, "accept": 0.0}

    def timed(what: str, fn):
        def call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[what] += (time.perf_counter() - began) * 1e3

        return call

    batch._launch = timed("launch", batch._launch)
    monkeypatch.setattr(Sequence, "accept", timed("accept", Sequence.accept))
    for _ in range(6):
        time.sleep(0.02)  # time between steps is no step's
        spans.update(launch=0.0, accept=0.0)
        t0 = time.perf_counter()
        batch.step_once()
        wall_ms = (time.perf_counter() - t0) * 1e3
        timing = batch.last_timing
        assert timing is not None
        parts = (timing.launch_ms, timing.wait_ms, timing.host_ms)
        assert all(p >= 0 for p in parts) and timing.host_ms > 0
        assert sum(parts) <= wall_ms  # nothing before the step or after it
        # and nothing of the step's own work left out: its launches are in the launch, its rows' tokens in the host's
        assert spans["launch"] > 0 and spans["accept"] > 0
        assert timing.launch_ms >= spans["launch"] - 1e-6 and timing.host_ms >= spans["accept"] - 1e-6, (timing, spans)
        # Building the graph is part of the launch; the thread ran for at most the launch's wall time.
        assert 0 < timing.build_ms <= timing.launch_ms
        assert 0 < timing.launch_cpu_ms <= timing.launch_ms + 0.5  # thread_time ticks coarser than perf_counter


def test_a_launch_that_waits_off_the_cpu_is_told_apart() -> None:
    """``launch_cpu_ms`` is the model thread's own CPU time: a launch that waits (here: for a lock
    another thread holds, as the GIL would be) shows wall time the CPU time does not have."""
    import threading
    import time

    lm = tiny("tiny-llama")
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=True)
    prompt, params, _ = ROWS["a"]
    seq = Sequence(lm, prompt, None, params, attention="at-rest")
    while seq.prefill_step() is None:
        pass
    batch.add(seq)
    batch.step_once()
    held = threading.Event()
    original = batch._launch

    def waiting_launch(inputs):  # the launch blocks 50 ms off the CPU before it builds the graph
        held.wait(0.05)
        return original(inputs)

    batch._launch = waiting_launch
    batch.step_once()
    timing = batch.last_timing
    assert timing is not None
    assert timing.launch_ms >= 50
    # The 50 ms off the CPU are in the launch's wall time, neither in its CPU time nor in the build (the
    # wait came before the build, not in it): true on a machine of any speed (CPU time never passes wall
    # time; thread_time ticks coarser than perf_counter, hence the 1 ms).
    assert timing.launch_ms - timing.launch_cpu_ms >= 49, timing
    assert timing.launch_ms - timing.build_ms >= 49, timing


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_every_prefill_chunk_records_where_its_time_went(profile: str) -> None:
    """A prefill chunk's result carries its ``StepTiming``: a middle chunk is launched and (in lockstep)
    waited for; the last one also reads the first token back and accepts it."""
    import time

    from engine_turns import COLD, tiny_engine

    from runtime.plan.sampling import SamplingOptions

    with tiny_engine(profile) as engine:
        prompt = "User: " + "Tell me about the harbour and its boats. " * 8 + "\nAssistant:"
        engine.start(1, prompt, COLD, engine.tokenize(prompt, COLD), SamplingOptions(max_tokens=2))
        results = []
        while True:
            t0 = time.perf_counter()
            result = engine.prefill(1, 16)
            results.append((result, (time.perf_counter() - t0) * 1e3))
            if not result.remaining:
                break
        assert len(results) >= 3
        for result, wall_ms in results:
            timing = result.timing
            assert timing is not None
            assert 0 < timing.build_ms <= timing.launch_ms
            assert timing.launch_ms + timing.wait_ms + timing.host_ms <= wall_ms
        last = results[-1][0].timing
        assert last is not None and last.host_ms > 0 and results[-1][0].text is not None  # the first token, accepted
        engine.discard(1)


def test_the_first_step_ahead_is_submitted_alone_then_each_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing in flight, the first step is launched and submitted before the next one is built (as
    ``generate_step`` does): reading its tokens waits for it alone. Every later submit holds one step."""
    import collections

    import mlx.core as mx

    from benches.gpu.gpu_probe import graph_operation_names

    lm = tiny("tiny-llama")
    prompt, params, _ = ROWS["b"]
    seq = Sequence(lm, prompt, None, params, attention="at-rest")
    while seq.prefill_step() is None:
        pass
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=True)
    batch.add(seq)
    forwards: list[int] = []  # each submit's forward passes (one argmax a greedy step)
    submit = mx.async_eval

    def counted(*arrays: mx.array) -> None:
        forwards.append(collections.Counter(graph_operation_names(list(arrays)))["ArgReduce"])
        submit(*arrays)

    monkeypatch.setattr(mx, "async_eval", counted)
    for _ in range(4):
        batch.step_once()
    assert forwards == [1] * 5  # the first step_once submits two steps, one at a time
