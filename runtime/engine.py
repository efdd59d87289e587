"""The synchronous generation engine the GPU actor drives, one job at a time.

An :class:`Engine` holds the loaded model, the running sequences and the
decode batch. Every method runs on the MLX thread (:mod:`actors.mlx_thread`)
and does one bounded piece of work — tokenize a turn's new text, build a
sequence, one prefill chunk, one decode step for the whole batch, park a
finished sequence — so the GPU actor can interleave agents token by token.

The engine executes decisions made elsewhere: what a turn reuses comes in its
:class:`runtime.turn_plan.TurnPlan`, and a donor prefix to adopt from
:meth:`runtime.kv_manager.KVCacheManager.adopt`; it never matches prompts itself.

This module is pure (no mlx): the GPU actor imports the protocol and its result
types. Implementations: :class:`runtime.mlx_engine.MlxEngine` (the real one) and
``tests/fake_engine.py`` (deterministic, no MLX; actor tests use it to pin down
scheduling and lifecycle quickly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from runtime.snapshot import CacheSnapshot
from runtime.turn_plan import FromShared, HotCache, SamplingOptions, Tokenized, TurnPlan

__all__ = ["Engine", "ModelInfo", "Started", "PrefillResult", "StepToken", "Finished", "MemoryReading"]


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The loaded model, as code off the MLX thread knows it.

    Attributes:
        name: the name it was loaded by (recipe, folder, GGUF file or Hugging Face id).
        tag: model + KV format; caches with another tag are never served.
        block_bytes: at-rest bytes of one 256-token block (hot tier accounting).
        active_token_bytes: bytes of one token's KV while a sequence runs
            (float under the ``at-rest`` strategy), the unit of admission.
        sequence_bytes: fixed bytes per running sequence (sliding windows).
        model_bytes: bytes of the weights.
    """

    name: str
    tag: str
    block_bytes: int
    active_token_bytes: int
    sequence_bytes: int
    model_bytes: int


@dataclass(frozen=True)
class MemoryReading:
    """Accelerator memory as the engine last saw it (bytes).

    ``baseline`` is the active memory when the engine was created (before any
    model), ``peak`` the peak since then (``mx.get_peak_memory`` after a reset).
    """

    active: int = 0
    peak: int = 0
    baseline: int = 0
    model: int = 0


@dataclass(frozen=True)
class Started:
    """A sequence built from its prompt and starting cache (``token_ids``: the whole prompt's)."""

    tokens_reused: int
    tokens_to_prefill: int
    match: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    """One prefill chunk: ``text`` is None until the last chunk samples the first token;
    ``remaining`` is how many prompt tokens are still to prefill."""

    text: str | None
    finished: bool
    context: int
    remaining: int = 0


@dataclass(frozen=True)
class StepToken:
    """One batch member's result of a decode step."""

    request_id: int
    text: str
    finished: bool


@dataclass(frozen=True)
class Finished:
    """A sequence out of the batch, parked (when anything new was computed)."""

    reply: str
    finish_reason: str | None
    match: str
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    parked: HotCache | None
    snapshot: CacheSnapshot | None
    stop_sequence: str | None = None  # the caller's stop string that ended the reply


class Engine(Protocol):
    """What the GPU actor needs from a model runtime. Not thread-safe: one thread calls it."""

    @property
    def memory(self) -> MemoryReading: ...

    def load(self, name: str) -> ModelInfo:
        """Unload the current model and load ``name``."""

    def unload(self) -> None:
        """Drop the model, every sequence and the batch."""

    def close(self) -> None:
        """Unload and release the thread's resources; the last call on the thread."""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """Chat messages (and tool definitions) → prompt text (the model's template)."""

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is, for the loaded model."""

    def tokenize(self, prompt: str, plan: TurnPlan) -> Tokenized:
        """The part of ``prompt`` the plan leaves to prefill, tokenized (once per turn)."""

    def start(
        self, request_id: int, prompt: str, plan: TurnPlan, tokens: Tokenized, sampling: SamplingOptions
    ) -> Started:
        """Build the sequence: the plan's cache, truncated to what it reuses and activated, then ``tokens``."""

    def prefill(self, request_id: int, chunk: int | None, *, adopt: FromShared | None = None) -> PrefillResult:
        """Run one prefill chunk of ``chunk`` tokens (None: the engine's adaptive size).

        ``adopt`` (first chunk only): start from these whole blocks of a donor's
        prompt instead; they are this prompt's first tokens."""

    def park_prompt(self, request_id: int) -> HotCache | None:
        """Right after prefill: park the prompt's KV (a donor for turns that share it)."""

    def join(self, request_id: int) -> None:
        """Merge a prefilled sequence into the running batch."""

    def step(self) -> list[StepToken]:
        """One decode step for every batch member."""

    def finish(self, request_id: int) -> Finished:
        """Take the sequence out of the batch and park its cache (finished or cancelled)."""

    def discard(self, request_id: int) -> None:
        """Drop a sequence without parking it."""
