"""How one sequence picks its tokens: mlx-lm's sampler and logits processors, a turn's own seed.

:class:`SequenceSampling` is what a sequence is told (from the turn's
:class:`runtime.plan.sampling.SamplingOptions` plus its reply rules); :func:`build_sampler` and
:func:`penalty_processors` turn it into mlx-lm's pieces, which :class:`runtime.execution.sequence.Sequence`
applies to each step's logits.

A seed gives a turn its own random stream (:class:`SeededSampler`): MLX's sampling draws from one
process-wide key, which every sampled row of every agent advances, so without one a reply depends on
what else ran. With one, the turn draws exactly what mlx-lm's sampler draws after
``mx.random.seed(seed)`` (mlx-lm's own server's ``seed``), whatever runs beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors, make_sampler

from runtime.plan.sampling import PENALTY_CONTEXT, Penalties, SamplingOptions
from runtime.reply.logprobs import LEAST_LOGPROB, TokenLogprob, TopLogprob

__all__ = ["LogitsProcessor", "Scored", "SeededSampler", "SequenceSampling", "build_sampler", "penalty_processors",
           "score", "token_logprob"]

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's logits processor: (the latest tokens, logits ``(1, V)``) in, logits out."""


@dataclass(frozen=True)
class SequenceSampling:
    """How one sequence samples: what to generate, its randomness and where to stop.

    Built from a turn's :class:`runtime.plan.sampling.SamplingOptions` (what the client asked)
    plus what its reply rules enforce (forced tokens, banned tokens, a grammar):
    :meth:`runtime.execution.mlx_engine.MlxEngine.sampling_params`.

    ``temperature == 0`` is greedy. ``top_p`` / ``top_k`` follow mlx-lm's sampler.
    ``seed``: the sequence's own random stream (:class:`SeededSampler`); None draws from MLX's global one.
    ``penalties``: repeat penalties, mlx-lm's logits processors (:func:`penalty_processors`).
    ``logit_bias`` adds to the logits of the given token ids before sampling.
    ``forced``: token ids the reply starts with, whatever the model predicts (the
    opening of a tool call a ``tool_choice`` requires; tests force whole replies).
    ``grammar``: the Lark grammar the reply is decoded under (:mod:`runtime.reply.grammar`:
    a generic-format tool call, a ``response_format``); None: unconstrained.
    ``logprobs``: score each token and its this many most likely alternatives
    (:mod:`runtime.reply.logprobs`); None: no scores.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    penalties: Penalties | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    forced: tuple[int, ...] = ()
    grammar: str | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, options: SamplingOptions, **given: Any) -> SequenceSampling:
        """What a turn's options say of its sequence: each field of ours that ``options`` has, by name (a
        new option needs no line here), ``logit_bias`` as a mapping; ``given`` (the engine's own) wins."""
        taken = {f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)}
        return cls(**{**taken, "logit_bias": dict(options.logit_bias), **given})


def build_sampler(params: SequenceSampling, *, width: int) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for these parameters (log-probabilities in, token ids out): a
    :class:`SeededSampler` when they name a seed and sample. ``width``: the model's output width."""
    top_p = params.top_p if 0.0 < params.top_p < 1.0 else 0.0
    if params.seed is None or params.greedy:
        return make_sampler(temp=params.temperature, top_p=top_p, top_k=params.top_k)
    return SeededSampler(params.seed, temperature=params.temperature, top_p=top_p, top_k=params.top_k, width=width)


class SeededSampler:
    """mlx-lm's sampler drawing from its own random stream: the same filters (``apply_top_p``, then
    ``apply_top_k``), then the categorical draw at the temperature, keyed by the next key of
    ``mx.random.key(seed)``, split as MLX splits its global key for each draw.

    So a seed draws what ``make_sampler``'s sampler draws after ``mx.random.seed(seed)``. The draw is
    over the model's whole output width (``width``), the rows past the log-probabilities given (the
    padded vocabulary kvmem never samples) at ``-inf``, as mlx-lm's sampler sees a padded model's logits
    once they are masked: the noise has the same shape, so the same tokens win.
    """

    def __init__(self, seed: int, *, temperature: float, top_p: float = 0.0, top_k: int = 0, width: int) -> None:
        self._key = mx.random.key(seed % 2**64)  # a negative seed: its two's complement
        self._scale = 1.0 / temperature
        self._top_p, self._top_k, self._width = top_p, top_k, width

    def __call__(self, logprobs: mx.array) -> mx.array:
        if logprobs.shape[-1] < self._width:
            logprobs = mx.pad(logprobs, [(0, 0), (0, self._width - logprobs.shape[-1])], constant_values=-mx.inf)
        if 0.0 < self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        if self._top_k > 0:
            logprobs = apply_top_k(logprobs, self._top_k)
        self._key, draw = mx.random.split(self._key)
        return mx.random.categorical(logprobs * self._scale, key=draw)


def penalty_processors(penalties: Penalties | None) -> list[LogitsProcessor]:
    """mlx-lm's logits processors for ``penalties`` (none for None), each over the last
    :data:`~runtime.plan.sampling.PENALTY_CONTEXT` tokens."""
    if penalties is None:
        return []
    return make_logits_processors(
        repetition_penalty=None if penalties.repetition == 1.0 else penalties.repetition,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=penalties.presence, presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=penalties.frequency, frequency_context_size=PENALTY_CONTEXT,
    )


# -- logprobs (runtime.reply.logprobs): the model's distribution, before any of the above ----------
@dataclass(frozen=True)
class Scored:
    """One position's scores, lazily (MLX arrays, evaluated when its token is accepted):
    the log-probabilities ``(V,)`` and the ids and log-probabilities of its top ``k``."""

    logprobs: mx.array
    top_ids: mx.array
    top_logprobs: mx.array


def score(logits: mx.array, top: int) -> Scored:
    """The log-probabilities of one row of logits ``(1, V)`` and its ``top`` most likely tokens (lazy)."""
    row = logits[0].astype(mx.float32)
    logprobs = row - mx.logsumexp(row, keepdims=True)
    if top == 0:
        return Scored(logprobs, mx.array([], dtype=mx.int32), mx.array([], dtype=mx.float32))
    top_ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    return Scored(logprobs, top_ids, logprobs[top_ids])


def token_logprob(scored: Scored, token: int, spell: Callable[[int], tuple[str, tuple[int, ...]]]) -> TokenLogprob:
    """``token`` as ``scored`` rates it; ``spell(id)`` is its ``(text, UTF-8 bytes)``."""
    mx.eval(scored.logprobs, scored.top_ids, scored.top_logprobs)
    pairs = sorted(zip(scored.top_ids.tolist(), scored.top_logprobs.tolist(), strict=True), key=lambda p: -p[1])
    top = tuple(TopLogprob(token=text, bytes=raw, logprob=_finite(value))
                for i, value in pairs for text, raw in (spell(i),))
    text, raw = spell(token)
    return TokenLogprob(token=text, bytes=raw, logprob=_finite(scored.logprobs[token].item()), top=top)


def _finite(value: float) -> float:
    return value if value > LEAST_LOGPROB else LEAST_LOGPROB
