"""Log-probabilities of a reply's tokens: what OpenAI's ``logprobs`` / ``top_logprobs`` return.

A turn that asks for them (``SamplingOptions.logprobs``: how many alternatives a token, 0 to
:data:`MAX_TOP_LOGPROBS`) scores each step's logits before sampling
(:func:`runtime.execution.sampling.score`, on the MLX thread): the
model's own distribution, ``log_softmax`` of its logits, as vLLM (``raw_logprobs``, its
default) and llama.cpp's server report it: before temperature, top-p / top-k, repeat penalties
and ``logit_bias`` — after the mask of a grammar when one constrains the reply (the tokens
it forbids are ``-inf``). A forced token (a required tool call's opening) is scored too.

Each accepted token becomes a :class:`TokenLogprob` (:func:`runtime.execution.sampling.token_logprob`): its
text, its UTF-8 bytes (a character split over tokens has a partial one each; its bytes say which), its
log-probability and its alternatives, most likely first. This module holds what travels (no MLX): the actors
and the gateway import it.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["LEAST_LOGPROB", "MAX_TOP_LOGPROBS", "TokenLogprob", "TopLogprob"]

MAX_TOP_LOGPROBS = 20
"""The most alternatives a token reports: OpenAI's bound on ``top_logprobs``."""

LEAST_LOGPROB = -9999.0
"""What a token a grammar forbids (``-inf``) reports: OpenAI's value for a token of no chance, and JSON
has no infinity."""


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One candidate for a position: its text, UTF-8 bytes and log-probability."""

    token: str
    bytes: tuple[int, ...]
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A reply token as the model scored it: ``token``, ``bytes``, ``logprob`` as :class:`TopLogprob`;
    ``top``: the position's most likely tokens, most likely first (empty when the turn asked for none)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TopLogprob, ...] = ()
