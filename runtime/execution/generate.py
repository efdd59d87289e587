"""The synchronous single-agent path: prompt + optional cache → streamed text + new cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from runtime.reply.grammar import mask_rows
from runtime.kv.kvstate import ParkedCache, AttentionMode
from runtime.model.loaded import LoadedModel
from runtime.execution.sequence import SequenceSampling, Sequence
from runtime.plan.engine import TurnStats

__all__ = ["generate", "GenerationResult", "decode_alone"]


@dataclass(frozen=True)
class GenerationResult:
    """What a finished turn returns: the reply, why it stopped, stats and the new cache."""

    reply: str
    finish_reason: str
    tokens: list[int]
    stats: TurnStats
    cache: ParkedCache | None


def decode_alone(seq: Sequence) -> Iterator[str]:
    """Prefill ``seq`` and decode it without batching, yielding text deltas."""
    first = seq.prefill_step()
    while first is None:
        first = seq.prefill_step()
    if first:
        yield first
    while seq.next_input is not None:
        logits = seq.lm.forward(mx.array([[seq.next_input]]), seq.kv.caches)[:, -1, :]
        seq.observe(logits)
        token = seq.sample(mask_rows([seq.grammar], logits))
        mx.eval(token)
        delta = seq.accept(int(token.item()))
        if delta:
            yield delta


def generate(
    lm: LoadedModel,
    prompt: str,
    cache: ParkedCache | None = None,
    params: SequenceSampling | None = None,
    *,
    attention: AttentionMode = "at-rest",
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate a reply to ``prompt`` reusing ``cache`` where the texts agree.

    Args:
        lm: the loaded model.
        prompt: the full prompt text.
        cache: the agent's parked cache from its previous turn, or None.
        params: sampling parameters (greedy, 256 tokens by default).
        attention: ``at-rest`` (float while active) or ``native`` (quantized SDPA).
        on_text: called with each streamable piece of the reply.
    """
    seq = Sequence(lm, prompt, cache, params or SequenceSampling(), attention=attention)
    for delta in decode_alone(seq):
        if on_text is not None:
            on_text(delta)
    parked = seq.park()
    return GenerationResult(seq.reply, seq.finish_reason or "stop", list(seq.generated), seq.stats, parked)

