"""How a turn samples its reply: :class:`SamplingOptions`, the one struct the engine takes.

Pure (msgspec and the standard library): built from a :class:`actors.messages_agent.ChatTurn`,
carried by the GPU actor's ``Generate`` to the engine unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from runtime.reply.logprobs import MAX_TOP_LOGPROBS
from runtime.plan.tools import ResponseFormat, ToolUse

__all__ = ["SamplingOptions", "Penalties", "PENALTY_CONTEXT", "SEED_RANGE"]


PENALTY_CONTEXT = 20
"""How many of the latest tokens (the prompt's, then the reply's) a repeat penalty looks at: mlx-lm's default."""

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds a turn takes: a signed 64-bit integer (a negative one keys MLX's stream as its two's complement)."""


class Penalties(msgspec.Struct, frozen=True, kw_only=True):
    """Repeat penalties on the logits of the last :data:`PENALTY_CONTEXT` tokens, as mlx-lm's logits processors
    apply them (``mlx_lm.sample_utils.make_logits_processors``; OpenAI's names for the first two).

    Attributes:
        presence: subtracted once from the logit of each token among them (OpenAI's ``presence_penalty``).
        frequency: subtracted from a token's logit once for each time it occurs among them
            (``frequency_penalty``).
        repetition: a token's logit among them is divided by it when positive, multiplied by it when negative
            (CTRL's multiplicative penalty; ``repetition_penalty`` in mlx-lm, vLLM and llama.cpp); 1 is none.

    Raises:
        ValueError: a value out of range (the message names it).
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= value <= 2.0:  # OpenAI's range; also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], not {value}")
        if not (0.0 < self.repetition and math.isfinite(self.repetition)):
            raise ValueError(f"repetition_penalty must be a positive number, not {self.repetition}")

    @classmethod
    def of(cls, presence: float | None = None, frequency: float | None = None,
           repetition: float | None = None) -> Penalties | None:
        """The penalties a request names (None for an unset one), or None when none of them penalizes."""
        penalties = cls(presence=presence or 0.0, frequency=frequency or 0.0,
                        repetition=1.0 if repetition is None else repetition)
        return penalties if penalties != cls() else None


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters as they travel to the engine (see ``runtime.execution.sampling``); checked on construction.

    ``temperature == 0`` is greedy; ``top_p`` / ``top_k`` follow mlx-lm's sampler;
    ``stop`` strings end the reply (they are not part of it). ``tool_use``: the
    turn's tools; the engine then enforces its ``tool_choice`` while sampling and
    parses tool calls out of the reply (None: the reply is plain text).
    ``response_format``: the reply (its answer, in a turn with tools) is JSON.
    ``seed``: the turn's own random stream (a sampled reply repeats for the same seed, prompt and
    parameters, whatever else runs beside it); None draws from the process's.
    ``penalties``: repeat penalties (None: none).
    ``logit_bias``: (token id, bias) pairs added to those tokens' logits before sampling, as OpenAI's
    ``logit_bias`` (-100 bans a token in practice, 100 all but forces it); ids past the model's vocabulary
    are refused when the turn starts.
    ``logprobs``: report each reply token's log-probability and its this many most likely alternatives
    (0 to :data:`~runtime.reply.logprobs.MAX_TOP_LOGPROBS`; :mod:`runtime.reply.logprobs`); None: none.
    ``fit_context``: ``max_tokens`` is a default the client did not name (the server's
    ``default_max_tokens``): a prompt that leaves less room in the model's context gets what is left
    instead of a refusal, as OpenAI, vLLM and llama.cpp generate up to the context when no limit is named.

    Raises:
        ValueError: a value out of range (the message names it).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    tool_use: ToolUse | None = None
    response_format: ResponseFormat | None = None
    seed: int | None = None
    penalties: Penalties | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    fit_context: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, not {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {self.logprobs}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {token} with bias {bias}: ids are >= 0, biases in [-100, 100]")

    @classmethod
    def of(cls, *, stop: str | Sequence[str] = (), presence_penalty: float | None = None,
           frequency_penalty: float | None = None, repetition_penalty: float | None = None,
           logit_bias: Mapping[int, float] | None = None, **fields: Any) -> SamplingOptions:
        """The options from plain values, as a caller names them (:class:`actors.messages_agent.TurnOptions`,
        each API's request): ``stop`` a string or strings; the repeat penalties by OpenAI's and mlx-lm's
        names (None: unset); ``logit_bias`` token id to bias; every other option by its field's name, so a
        new option needs no line here.

        Raises:
            TypeError: a name that is no option.
            ValueError: a value out of range.
        """
        return cls(stop=(stop,) if isinstance(stop, str) else tuple(stop),
                   penalties=Penalties.of(presence_penalty, frequency_penalty, repetition_penalty),
                   logit_bias=tuple(sorted((logit_bias or {}).items())), **fields)

    @classmethod
    def of_request(cls, request: object, **given: Any) -> SamplingOptions:
        """The options an API's decoded request names: each of :meth:`of`'s names that ``request`` has as an
        attribute, unless None (unset) or ``given`` (what the API maps itself: a default of its own, a field
        of another name or meaning). A new option an API spells as kvmem does needs no line in the API."""
        named = {name: value for name in _REQUEST_NAMES
                 if name not in given and (value := getattr(request, name, None)) is not None}
        return cls.of(**named, **given)


_REQUEST_NAMES = (*(name for name in SamplingOptions.__struct_fields__ if name not in ("tool_use", "response_format",
                                                                                        "penalties")),
                  "presence_penalty", "frequency_penalty", "repetition_penalty")
"""What :meth:`SamplingOptions.of_request` reads from a request: the options a client names (the tools and the
``response_format`` are the turn's own, and the penalties come by their API names)."""
