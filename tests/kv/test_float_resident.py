"""The float KV kept after a turn (runtime/kv/float_resident.py) is a cache of the activation, nothing more.

The tests that can fail: a turn that starts from the kept float buffers holds, layer by layer,
exactly the floats that dequantizing the parked Q4 cache gives (bitwise), and computes exactly
the same logits, also when the park was launched without a wait (the GPU policy); the buffers serve one turn only; the pool's budget drops the oldest; and a
runtime with the buffers kept replies as one without them, through the decode batch.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

import runtime  # noqa: F401
from actors import open_runtime
from conftest import mlx_with, models_dir, tiny
from runtime.kv.float_resident import FloatResident, ResidentPool
from runtime.kv.kvstate import ActiveKV
from runtime.execution.sequence import SequenceSampling, Sequence

PROMPT = "The lighthouse keeper counted the ships every evening and wrote their names in a green book."
FOLLOW_UP = " One night a ship with no name came past the rocks, and he wrote a question mark instead."


def _turn(lm, prompt: str, parked=None, *, tokens: int = 6) -> Sequence:
    seq = Sequence(lm, prompt, parked, SequenceSampling(max_tokens=tokens))
    while seq.prefill_step() is None:
        pass
    while seq.next_input is not None:
        logits = lm.forward(mx.array([[seq.next_input]]), seq.kv.caches)[:, -1, :]
        seq.accept(int(seq.sample(logits).item()))
    return seq


def _layer_floats(kv: ActiveKV) -> list[tuple[mx.array, mx.array]]:
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in kv.caches]


# wait=False: the GPU policy's turn end, which launches the park without waiting for it and leaves the
# kept buffers' last writes to the turn that takes them (runtime/kv/float_resident.py PendingKV), or to
# the save's host copy after the turn, which settles them ("settled").
@pytest.mark.parametrize("wait", [True, False, "settled"], ids=["park-waited", "park-launched", "settled"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_kept_floats_are_bitwise_the_dequantized_parked_cache(model: str, wait: bool | str) -> None:
    lm = tiny(model)
    first = _turn(lm, PROMPT)
    parked = first.park(keep_float=True, wait=wait is True)
    assert parked is not None and parked.resident is not None and parked.resident.held
    assert parked.resident.pending == (wait is not True)
    if wait == "settled":
        parked.resident.settle()
        assert not parked.resident.pending and parked.resident.held
    without = replace(parked, resident=None)  # the same Q4 layers: the ordinary activation

    kept_kv = ActiveKV(parked, lm.spec, "at-rest")
    assert kept_kv.resumed_float and not parked.resident.held  # taken, once
    fresh_kv = ActiveKV(without, lm.spec, "at-rest")
    assert not fresh_kv.resumed_float
    compared = 0
    # Bitwise on any backend: both sides come from the same elementwise dequantization of the same Q4
    # values (runtime.kv.q4_packing.dequantize_kv), which has no reduction whose order a device could change.
    for (k1, v1), (k2, v2) in zip(_layer_floats(kept_kv), _layer_floats(fresh_kv), strict=True):
        assert k1.shape == k2.shape and mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()
        compared += 1
    assert compared == len(lm.spec.layers)
    assert not ActiveKV(parked, lm.spec, "at-rest").resumed_float  # a second reader dequantizes


@pytest.mark.parametrize("wait", [True, False], ids=["park-waited", "park-launched"])
def test_a_turn_from_kept_floats_computes_the_same_logits_over_several_turns(wait: bool) -> None:
    lm = tiny("tiny-llama")
    kept = without = None
    prompt = PROMPT
    for turn in range(3):
        a = Sequence(lm, prompt, kept, SequenceSampling(max_tokens=4))
        b = Sequence(lm, prompt, without, SequenceSampling(max_tokens=4))
        assert a.kv.resumed_float == (turn > 0) and not b.kv.resumed_float
        a.logits_trace, b.logits_trace = [], []
        for seq in (a, b):
            while seq.prefill_step() is None:
                pass
            while seq.next_input is not None:
                logits = lm.forward(mx.array([[seq.next_input]]), seq.kv.caches)[:, -1, :]
                seq.observe(logits)
                seq.accept(int(seq.sample(logits).item()))
        # Bitwise on any backend: the same kernels, one device, on bit-identical KV (the test above).
        assert a.generated == b.generated
        for x, y in zip(a.logits_trace, b.logits_trace, strict=True):
            assert mx.array_equal(x, y).item()
        kept, without = a.park(keep_float=True, wait=wait), b.park(wait=wait)
        assert kept is not None and without is not None and without.resident is None
        prompt = kept.text + FOLLOW_UP


def test_a_turn_from_kept_floats_builds_nothing_over_its_parked_q4(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of several turns is parked as a chunk a turn; a turn that starts from its kept floats neither
    joins nor dequantizes those chunks (a GPU's host pays for every operation built, evaluated or not)."""
    from runtime.kv import kvstate

    lm = tiny("tiny-llama")
    first = _turn(lm, PROMPT).park(wait=True)
    parked = _turn(lm, first.text + FOLLOW_UP, first).park(keep_float=True, wait=True)
    assert parked is not None and parked.resident is not None
    assert all(len(layer.chunks) == 2 for layer in parked.layers)  # each turn's tokens a chunk
    built: list[str] = []
    monkeypatch.setattr(kvstate, "dequantize_kv", lambda *a, **k: built.append("dequantize"))

    def concatenate(*a: object, **k: object) -> object:
        built.append("concatenate")
        return mx.concatenate(*a, **k)

    monkeypatch.setattr(kvstate, "mx", mlx_with(concatenate=concatenate))
    assert ActiveKV(parked, lm.spec, "at-rest").resumed_float and built == []


def test_the_pool_keeps_the_newest_within_its_budget_and_forgets_the_dead() -> None:
    def resident(tokens: int) -> FloatResident:
        k = mx.zeros((1, 2, tokens, 8))
        mx.eval(k)
        return FloatResident([(k, k)], tokens)

    one = resident(16).nbytes
    pool = ResidentPool(max_bytes=2 * one)
    a, b, c = resident(16), resident(16), resident(16)
    assert pool.add(a) and pool.add(b) and pool.bytes == 2 * one
    assert pool.add(c)  # over budget: the oldest (a) goes
    assert not a.held and b.held and c.held and pool.bytes == 2 * one and pool.dropped == 1
    assert b.take(16) is not None and not b.held and pool.bytes == one  # taken: no longer counted
    del c
    gc.collect()
    assert pool.bytes == 0  # its parked cache is gone, so is it
    big = resident(64)
    assert not pool.add(big) and not big.held  # larger than the whole budget


async def test_a_runtime_keeping_floats_replies_as_one_that_does_not(tmp_path: Path) -> None:
    conversation = [{"role": "user", "content": PROMPT}]
    results = {}
    for keep in (0, 256):
        # at-rest named: under the GPU policy ``auto`` is native, where keep_float_mb keeps nothing.
        async with open_runtime(model="tiny-llama", home=tmp_path / str(keep), models_dir=models_dir(),
                                fsync=False, handle_signals=False, keep_float_mb=keep, attention="at-rest") as rt:
            messages = list(conversation)
            seen = []
            for turn in range(3):
                result = await rt.agent("keeper").send(messages, max_tokens=8)
                seen.append((result.reply, result.usage.tier, result.usage.tokens_reused))
                messages += [{"role": "assistant", "content": result.reply},
                             {"role": "user", "content": f"And then? ({turn})"}]
            results[keep] = seen
    assert [tier for _, tier, _ in results[256]] == ["cold", "hot", "hot"]
    assert results[256] == results[0]


def test_a_cache_restored_ahead_keeps_its_float_when_the_float_itself_fits_the_budget(tmp_path: Path) -> None:
    """The budget check at ``prepare`` (a cache read ahead at start) sizes the float buffers it
    would make: the model's dtype, the room a turn writes into. It used to take eight times the
    Q4 size, which refused a bfloat16 model's caches (their float is 3.6 times the Q4 size) where
    they fit: a GPU's warm turn after a restart then dequantized its whole cache at the turn."""
    from gguf_writer import write_gguf

    from runtime.cpu import kv_copy
    from runtime.execution.mlx_engine import MlxEngine, kept_float_bytes
    from runtime.model import tiny_models
    from runtime.plan.sampling import SamplingOptions
    from runtime.plan.turn_plan import ColdStart, TurnPlan

    gguf = write_gguf(tiny_models.ensure_tiny_model("tiny-llama", models_dir()), tmp_path / "tiny.gguf")

    def engine(keep_float_mb: float) -> MlxEngine:
        built = MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention="at-rest",
                          keep_float_mb=keep_float_mb, prewarm_mb=0, profile="gpu", weights="bfloat16")
        built.load(str(gguf))
        return built

    first = engine(1024)
    try:
        prompt = "The harbour wakes at dawn. " * 120
        plan = TurnPlan(tier="cold", source=ColdStart(), match="empty", reuse_tokens=0, reuse_chars=0)
        first.start(1, prompt, plan, first.tokenize(prompt, plan), SamplingOptions(max_tokens=2))
        while first.prefill(1, None).remaining:
            pass
        parked = first.finish(1).parked
        assert parked is not None
        snapshot, spec = first.snapshot(parked), first.lm.spec
    finally:
        first.unload()
    need = kept_float_bytes(spec, len(snapshot.token_ids))
    assert spec.dtype_bytes == 2 and 8 * parked.nbytes > 1.5 * need  # the old rule would have refused it
    second = engine(1.05 * need / 2**20)
    try:
        prepared = second.prepare(snapshot)
        assert prepared is not None and prepared.resident is not None and prepared.resident.held
        assert prepared.resident.nbytes == need  # the estimate is the buffers' size
    finally:
        second.unload()
        kv_copy.use_host_views(None)


def test_the_saves_host_copy_settles_the_kept_floats_pending_writes() -> None:
    """Under the GPU policy a turn's park is launched without a wait and its kept floats' last writes are
    pending; the save's host copy after the turn (``Engine.snapshot``) makes them, so the next hot turn's
    first pass builds none of them (four operations a layer), and that turn replies as one from the
    unsettled floats would (the kept floats are bitwise the same: the test above)."""
    from engine_turns import run_turn, tiny_engine

    from benches.gpu.gpu_probe import counting_submits
    from runtime.plan.sampling import SamplingOptions
    from runtime.plan.turn_plan import FromHot, TurnPlan

    replies, first_passes = [], []
    for settle in (False, True):
        with tiny_engine("gpu", keep_float_mb=64) as engine:
            first = run_turn(engine, 1, PROMPT, max_tokens=6)
            parked = first.parked
            assert parked is not None and parked.resident is not None and parked.resident.pending
            if settle:
                assert engine.snapshot(parked) is not None
                assert not parked.resident.pending and parked.resident.held
            hot = TurnPlan(tier="hot", source=FromHot(parked=parked), match="extend", reuse_tokens=parked.num_tokens,
                           reuse_chars=len(parked.text))
            prompt = parked.text + FOLLOW_UP
            engine.start(2, prompt, hot, engine.tokenize(prompt, hot), SamplingOptions(max_tokens=6))
            with counting_submits() as first_pass:  # the message is one chunk: its first token's pass
                result = engine.prefill(2, None)
            assert result.remaining == 0 and not result.finished
            first_passes.append(first_pass.operations)
            engine.join(2)
            while not any(t.finished for t in engine.step()):
                pass
            replies.append(engine.finish(2).reply)
    assert replies[0] == replies[1]
    unsettled, settled = first_passes
    assert unsettled - settled >= 4 * len(tiny("tiny-llama").spec.layers), first_passes
