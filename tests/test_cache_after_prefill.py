"""The GPU policy empties MLX's buffer cache once a prompt of several prefill chunks has its first token
(``runtime.backend``'s ``clear_cache_after_prefill``), as mlx-lm's ``generate_step`` empties it after every
chunk: a cache grows by concatenation, chunk by chunk, and the longer buffers each chunk frees fit no later
request, while MLX keeps freed buffers up to 95% of a CUDA device. Here: when it is emptied, and that the
turn is the same either way."""

from __future__ import annotations

import pytest
from conftest import tiny

from runtime.backend import decide_profile
from runtime.execution import sequence
from runtime.execution.sequence import Sequence, SequenceSampling

PROMPT = "The harbour master kept a ledger of ships and their cargo. " * 12


def test_the_gpu_policy_empties_the_cache_after_a_long_prompt_and_the_cpu_policy_does_not() -> None:
    gpu = decide_profile(device="gpu", backend="cuda")
    cpu = decide_profile(device="cpu", backend="cpu")
    assert gpu.clear_cache_after_prefill and "MLX's cache emptied after a long prompt" in gpu.line()
    assert not cpu.clear_cache_after_prefill and "MLX's cache" not in cpu.line()


def _first_token(monkeypatch: pytest.MonkeyPatch, *, clear: bool, chunk: int) -> tuple[int, list[int], int]:
    """The first token, every chunk's ``mx.clear_cache`` calls so far, and the chunks run."""
    calls: list[int] = []
    monkeypatch.setattr(sequence.mx, "clear_cache", lambda: calls.append(1))
    seq = Sequence(tiny("tiny-llama"), PROMPT, None, SequenceSampling(max_tokens=2), attention="at-rest")
    seq.clear_cache_after_prefill = clear
    seen, chunks = [], 0
    while seq.prefill_step(chunk) is None:
        chunks += 1
        seen.append(len(calls))  # none while the prompt is prefilled
    seen.append(len(calls))
    return seq.generated[0], seen, chunks + 1


def test_the_cache_is_emptied_once_when_a_prompt_of_several_chunks_has_its_first_token(monkeypatch) -> None:
    token, seen, chunks = _first_token(monkeypatch, clear=True, chunk=32)
    assert chunks > 2 and seen == [0] * (chunks - 1) + [1]
    one_chunk = _first_token(monkeypatch, clear=True, chunk=4096)  # one chunk: the cache did not grow by chunks
    off = _first_token(monkeypatch, clear=False, chunk=32)
    assert one_chunk[1] == [0] and off[1] == [0] * chunks
    assert token == one_chunk[0] == off[0]
