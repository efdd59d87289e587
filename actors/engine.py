"""The synchronous generation engine the GPU actor drives, one job at a time.

An :class:`Engine` holds the loaded model, the running sequences and the
decode batch. Every method runs on the MLX thread (:mod:`actors.mlx_thread`)
and does one bounded piece of work — build a sequence, one prefill chunk, one
decode step for the whole batch, park a finished sequence — so the GPU actor
can interleave agents token by token.

Two implementations: :class:`actors.mlx_engine.MlxEngine` (the real one, on
``runtime``) and :class:`actors.fake_engine.FakeEngine` (deterministic, no
MLX; actor tests use it to pin down scheduling and lifecycle quickly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from actors.messages_common import HotCache
from actors.messages_gpu import CacheSource, ModelInfo, SamplingOptions
from runtime.snapshot import CacheSnapshot

__all__ = ["Engine", "Started", "PrefillResult", "StepToken", "Finished", "MemoryReading"]


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
    """A sequence built from its prompt and starting cache."""

    tokens_reused: int
    tokens_to_prefill: int
    match: str


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

    def measure(self, prompt: str, source: CacheSource) -> int:
        """Tokens the sequence will hold once ``prompt`` is prefilled from ``source``."""

    def start(
        self, request_id: int, prompt: str, source: CacheSource, sampling: SamplingOptions, *, share: bool = False
    ) -> Started:
        """Build the sequence (prefix match, tokenization, cache activation).

        ``share``: the prompt's prefix may be shared with other sharing sequences in
        flight, both ways (an engine may ignore it)."""

    def prefill(self, request_id: int, chunk: int | None) -> PrefillResult:
        """Run one prefill chunk of ``chunk`` tokens (None: the engine's adaptive size)."""

    def join(self, request_id: int) -> None:
        """Merge a prefilled sequence into the running batch."""

    def step(self) -> list[StepToken]:
        """One decode step for every batch member."""

    def finish(self, request_id: int) -> Finished:
        """Take the sequence out of the batch and park its cache (finished or cancelled)."""

    def discard(self, request_id: int) -> None:
        """Drop a sequence without parking it."""
