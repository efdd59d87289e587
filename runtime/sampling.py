"""Sampling parameters, the vocab-limited sampler, and stop-string handling."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

__all__ = ["SamplingParams", "StopMatcher", "build_sampler"]


@dataclass(frozen=True)
class SamplingParams:
    """What to generate: length, randomness and where to stop.

    ``temperature == 0`` is greedy. ``top_p`` / ``top_k`` follow mlx-lm's sampler.
    ``logit_bias`` adds to the logits of the given token ids before sampling.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def build_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for these parameters (log-probabilities in, token ids out)."""
    top_p = params.top_p if 0.0 < params.top_p < 1.0 else 0.0
    return make_sampler(temp=params.temperature, top_p=top_p, top_k=params.top_k)


class StopMatcher:
    """Finds stop strings in a growing text and says how much is safe to stream.

    Text that could still become the start of a stop string is held back.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) - 1 for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index where the earliest stop string begins, searching from ``start``."""
        hits = [i for s in self.stops if (i := text.find(s, max(0, start - len(s)))) >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How many leading characters of ``text`` cannot be part of a stop string."""
        if not self._hold:
            return len(text)
        for cut in range(max(0, len(text) - self._hold), len(text)):
            tail = text[cut:]
            if any(s.startswith(tail) for s in self.stops):
                return cut
        return len(text)
