"""The GPU policy empties MLX's buffer cache once a prompt of several prefill chunks has its first token
(``runtime.backend``'s ``clear_cache_after_prefill``), as mlx-lm's ``generate_step`` empties it after every
chunk: a cache grows by concatenation, chunk by chunk, and the longer buffers each chunk freed fit no later
request, while MLX keeps freed buffers up to 95% of a CUDA device. It is emptied at the engine's next step,
or at the turn's finish when the first token ended it, so never inside the first token's time. Here: when
it is emptied, and that the turn is the same either way."""

from __future__ import annotations

import msgspec
import pytest
from conftest import models_dir

from runtime.backend import decide_profile
from runtime.execution import mlx_engine
from runtime.plan.sampling import SamplingOptions
from runtime.plan.turn_plan import COLD

PROMPT = "The harbour master kept a ledger of ships and their cargo. " * 12


def test_the_gpu_policy_empties_the_cache_after_a_long_prompt_and_the_cpu_policy_does_not() -> None:
    gpu = decide_profile(device="gpu", backend="cuda")
    cpu = decide_profile(device="cpu", backend="cpu")
    assert gpu.clear_cache_after_prefill and "MLX's cache emptied after a long prompt" in gpu.line()
    assert not cpu.clear_cache_after_prefill and "MLX's cache" not in cpu.line()


def _turn(monkeypatch: pytest.MonkeyPatch, *, chunk: int, max_tokens: int, clear: bool = True) -> tuple[str, list[str]]:
    """A cold turn on the engine under the GPU policy (``clear``: its emptying on): its reply, and when
    ``mx.clear_cache`` was called (by engine call)."""
    calls: list[str] = []
    where = ["start"]
    monkeypatch.setattr(mlx_engine.mx, "clear_cache", lambda: calls.append(where[0]))
    engine = mlx_engine.MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention="at-rest",
                                  profile="gpu", prefill_chunk=chunk)
    engine._profile = msgspec.structs.replace(engine.profile, clear_cache_after_prefill=clear)
    engine.load("tiny-llama")
    calls.clear()  # a load's own (an unload of nothing) is not the turn's
    try:
        engine.start(1, PROMPT, COLD, engine.tokenize(PROMPT, COLD), SamplingOptions(max_tokens=max_tokens))
        where[0] = "prefill"
        chunks = 1
        while (result := engine.prefill(1, None)).text is None:
            chunks += 1
        assert chunks > 1 or chunk > 1000
        if not result.finished:
            engine.join(1)
            for step in range(max_tokens):
                where[0] = f"step {step}"
                if any(t.finished for t in engine.step()):
                    break
        where[0] = "finish"
        return engine.finish(1).reply, list(calls)
    finally:
        engine.unload()  # which empties the cache too, after the calls were read


def test_the_cache_is_emptied_once_at_the_step_after_a_long_prompts_first_token(monkeypatch) -> None:
    reply, calls = _turn(monkeypatch, chunk=32, max_tokens=4)
    assert calls == ["step 0"]
    one_chunk = _turn(monkeypatch, chunk=4096, max_tokens=4)  # the cache did not grow by chunks
    off = _turn(monkeypatch, chunk=32, max_tokens=4, clear=False)
    assert one_chunk[1] == [] and off[1] == []
    assert reply == off[0]  # the same chunks, the cache emptied or not


def test_a_turn_its_first_token_ended_empties_it_at_its_finish(monkeypatch) -> None:
    _, calls = _turn(monkeypatch, chunk=32, max_tokens=1)
    assert calls == ["finish"]
