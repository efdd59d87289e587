"""Turns prefilled together in one pass (runtime.execution.batch_prefill) against each turn alone.

The reference is each turn prefilled and decoded on its own (``decode_alone``),
from the same parked cache; tolerances as in tests/kv/test_cache_correctness.py.
"""

from __future__ import annotations

import io

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from agreement import assert_decoded_alike
from conftest import skip_without_native_attention, tiny
from runtime.cpu import kv_copy
from runtime.execution.batch_prefill import MAX_PAD, LinedUpCache, choose_group, prefill_together
from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import decode_alone, generate
from runtime.execution.sequence import SequenceSampling, Sequence

FLOAT_TOL = 2e-3
STEPS = 8
TOPICS = ["the old mill by the river", "a lighthouse in a storm", "the baker's secret recipe", "a fox and a crow"]
# New messages of different lengths: the shorter rows are padded to line up with the longest.
FOLLOW_UPS = ["What next?", "And then what happened to them?", "Why?", "Tell me more about the ending, please."]


def _turns(lm, attention: str = "at-rest"):
    """Each agent's first turn (its parked cache) and its second prompt."""
    out = []
    for topic, follow_up in zip(TOPICS, FOLLOW_UPS, strict=True):
        first = [{"role": "user", "content": f"Tell me about {topic}."}]
        done = generate(lm, lm.render(first), None, SequenceSampling(max_tokens=10), attention=attention)
        second = first + [{"role": "assistant", "content": done.reply}, {"role": "user", "content": follow_up}]
        out.append((lm.render(second), done.cache))
    return out


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("bits", [4, None])
def test_a_group_replies_as_each_turn_alone(arch: str, bits: int | None) -> None:
    lm = tiny(arch, bits=bits)
    turns = _turns(lm)
    params = SequenceSampling(max_tokens=STEPS)
    alone = []
    for prompt, cache in turns:
        seq = Sequence(lm, prompt, cache, params)
        seq.logits_trace = []
        list(decode_alone(seq))
        alone.append(seq)

    rows = [Sequence(lm, prompt, cache, params) for prompt, cache in turns]
    for seq in rows:
        seq.logits_trace = []
    group = choose_group(dict(enumerate(rows)))
    assert len(group) >= 3, f"expected most rows grouped, got {group}"
    assert max(group.values()) > 0, "the shorter rows are padded"
    ids = list(group)
    grouped = [rows[i] for i in ids]
    texts, caches = prefill_together(grouped, [group[i] for i in ids])
    assert all(seq.prefill_done and len(seq.generated) == 1 for seq in grouped)
    for i in ids:  # the padding is not the turn's: usage as alone
        assert rows[i].stats.tokens_reused == alone[i].stats.tokens_reused == turns[i][1].num_tokens
        assert rows[i].context == len(rows[i].token_ids)
    batch = DecodeBatch()
    batch.add_group(grouped, caches)
    while len(batch):
        batch.step_once()
        for s in reversed([s for s in batch.members if s.finish_reason]):
            batch.remove(s)

    for i in ids:
        assert_decoded_alike(alone[i], rows[i], lm.vocab_limit, FLOAT_TOL)


def test_rows_too_far_from_the_longest_or_already_started_stay_out() -> None:
    lm = tiny("tiny-llama")
    (p0, c0), (p1, c1), (p2, c2), _ = _turns(lm)
    params = SequenceSampling(max_tokens=2)
    long_tail = p1.replace("And then what happened to them?", "And then " + "what happened to them, " * 8 + "?")
    rows = {0: Sequence(lm, p0, c0, params), 1: Sequence(lm, long_tail, c1, params), 2: Sequence(lm, p2, c2, params)}
    assert rows[1].to_prefill - rows[0].to_prefill > MAX_PAD
    group = choose_group(rows)
    assert set(group) == {0, 2}, "the long one alone would be a group of one: the two short ones go together"
    started = Sequence(lm, p0, c0, params)
    started.prefill_step(2)
    assert choose_group({0: started, 2: Sequence(lm, p2, c2, params)}) == {}


def test_sliding_window_and_native_caches_are_not_grouped() -> None:
    gemma = tiny("tiny-gemma3")
    rows = {i: Sequence(gemma, p, c, SequenceSampling(max_tokens=2)) for i, (p, c) in enumerate(_turns(gemma)[:2])}
    assert choose_group(rows) == {}
    skip_without_native_attention()  # the native rows' first turns run quantized SDPA
    llama = tiny("tiny-llama")
    native = {i: Sequence(llama, p, c, SequenceSampling(max_tokens=2), attention="native")
              for i, (p, c) in enumerate(_turns(llama, "native")[:2])}
    assert choose_group(native) == {}


def test_a_group_pass_records_where_its_time_went() -> None:
    """Every row of a group prefilled together carries its one pass's ``StepTiming`` (the GPU actor's
    trace shows it on the group's chunk): building the lined-up caches and the pass, then the wait."""
    import time

    lm = tiny("tiny-llama")
    rows = [Sequence(lm, prompt, cache, SequenceSampling(max_tokens=4)) for prompt, cache in _turns(lm)]
    group = choose_group(dict(enumerate(rows)))
    grouped = [rows[i] for i in group]
    t0 = time.perf_counter()
    prefill_together(grouped, list(group.values()))
    wall_ms = (time.perf_counter() - t0) * 1e3
    timings = {id(seq.last_chunk_timing) for seq in grouped}
    assert len(timings) == 1  # one pass, one timing
    timing = grouped[0].last_chunk_timing
    assert timing is not None
    assert 0 < timing.build_ms <= timing.launch_ms and timing.wait_ms >= 0 and timing.host_ms > 0
    assert timing.launch_ms + timing.wait_ms + timing.host_ms <= wall_ms


def _lined_up_nodes(rows: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Graph nodes of lining ``rows`` float rows up in one layer's cache and writing a group pass's KV into it."""
    monkeypatch.setattr(kv_copy, "_host_views", False)  # the GPU policy's copies
    caches = []
    for i in range(rows):
        cache = KVCache()
        cache.update_and_fetch(mx.ones((1, 2, 40 + 7 * i, 8)), mx.ones((1, 2, 40 + 7 * i, 8)))
        caches.append(cache)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    new = mx.ones((rows, 2, 12, 8))
    mx.eval(new)
    lined = LinedUpCache(caches, [i % 3 for i in range(rows)], 12)
    keys, values = lined.update_and_fetch(new, new)
    out = io.StringIO()
    mx.export_to_dot(out, keys, values)
    return out.getvalue().count("shape=rectangle")


def test_lining_rows_up_costs_the_same_graph_for_eight_rows_as_for_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group pass's caches, lined up under the GPU policy, are a gather a layer and the rows' new tokens
    chosen by a mask made once on the host: H200 run 5's joint prefill of 8 joins launched for 32 ms (1B),
    29 of them MLX's submit of about 900 merge nodes (a slice and an update a row a layer)."""
    assert _lined_up_nodes(8, monkeypatch) == _lined_up_nodes(2, monkeypatch) <= 24
