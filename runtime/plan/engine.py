"""The engine's contract: what the GPU actor asks of it, and what it reports back.

An :class:`Engine` holds the loaded model, the running sequences and the decode batch. Every
method runs on the MLX thread (:mod:`actors.mlx_thread`) and does one bounded piece of work —
tokenize a turn's new text, build a sequence, one prefill chunk, one decode step for the whole
batch, park a finished sequence — so the GPU actor can interleave agents token by token. It
executes decisions made elsewhere: what a turn reuses comes in its plan
(:mod:`runtime.plan.turn_plan`), a donor prefix to adopt from the scheduler's step
(:meth:`runtime.plan.kv_manager.KVCacheManager.donor_for`); it never matches prompts itself.

Pure (no trio, no mlx): the planner, the actors and the engines all import it. Implementations:
:class:`runtime.execution.mlx_engine.MlxEngine` (the real one),
:class:`runtime.distributed.leader.LeaderEngine` (rank 0 of ``kvmem serve --distributed``: the
real one, each call also sent to the other ranks) and ``tests/fake_engine.py`` (deterministic,
no MLX; actor tests use it to pin down scheduling and lifecycle quickly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from runtime.backend import BackendProfile
from runtime.reply.logprobs import TokenLogprob
from runtime.spec import CacheSnapshot, LayerKind
from runtime.plan.prefix import MatchKind
from runtime.plan.sampling import SamplingOptions
from runtime.plan.tools import ToolCall, ToolChoice
from runtime.plan.turn_plan import FromShared, ParkedView, Tokenized, TurnPlan

__all__ = ["Engine", "ModelInfo", "TurnStats", "SequenceStarted", "PrefillResult", "StepToken", "StepTiming", "Finished", "MemoryReading"]


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The loaded model, as code off the MLX thread knows it.

    Attributes:
        name: the name it was loaded by (recipe, folder, GGUF file or Hugging Face id).
        tag: model + KV format; caches with another tag are never served.
        block_bytes: at-rest bytes of one 256-token block (hot tier accounting).
        active_token_bytes: bytes of one token's KV while a sequence runs
            (float under the ``at-rest`` attention), the unit of admission.
        sequence_bytes: fixed bytes per running sequence (sliding windows).
        model_bytes: bytes of the weights.
        context_length: the most positions (prompt plus reply) the model takes, from
            its config (``max_position_embeddings``); None when kvmem cannot read it,
            and then only the KV budget limits a prompt.
        profile: the backend profile the load settled (:mod:`runtime.backend`); None for
            engines that have none (tests' fakes).
        layer_kinds: how each layer's KV is held at rest. A turn may start from whole blocks read off
            the disk by their hash chain only when none is ``sliding`` (a window lives in an agent's
            state file, not in blocks); empty: never.
        max_token_bytes: the most UTF-8 bytes of prompt text one token covers (the longest entry of
            the vocabulary), so a prompt of N bytes has at least N / this many tokens: a prompt that
            cannot fit the context is refused from its length, before it is tokenized. None: unknown.
    """

    name: str
    tag: str
    block_bytes: int
    active_token_bytes: int
    sequence_bytes: int
    model_bytes: int
    context_length: int | None = None
    profile: BackendProfile | None = None
    layer_kinds: tuple[LayerKind, ...] = ()
    max_token_bytes: int | None = None


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


@dataclass
class TurnStats:
    """A turn's tokens and timings, counted where they are computed: the one record of them the engine keeps
    (its sequence fills it in as it runs) and reports (:class:`SequenceStarted`, :class:`Finished`). The GPU
    actor turns the finished one into the turn's usage (:class:`actors.messages_common.TurnUsage`), adding
    what only it knows (the cache's tier, the wait before admission, the first token's time from submission).

    ``tokens_prefilled``: the prompt tokens the turn runs through the model (all of them once it started,
    those that went through once it finished); ``prefill_s``, ``ttft_s`` and ``decode_s`` on the engine's
    clock, from the sequence's start.
    """

    match: str = MatchKind.EMPTY.value
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_generated: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tps(self) -> float:
        """Reply tokens per second after the first."""
        n = self.tokens_generated - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class SequenceStarted:
    """A sequence built from its prompt and starting cache: its :class:`TurnStats` as it starts (what it reuses,
    how it matched, what it will prefill) and ``token_ids``, the whole prompt's."""

    stats: TurnStats
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    """One prefill chunk: ``text`` is None until the last chunk samples the first token;
    ``remaining`` is how many prompt tokens are still to prefill. ``text`` and
    ``tool_calls`` as in :class:`StepToken`; ``timing``: where the chunk's time went
    on the model's thread (a group prefilled together shares its pass's; None: not measured)."""

    text: str | None
    finished: bool
    context: int
    remaining: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    timing: StepTiming | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class StepToken:
    """One batch member's result of a decode step.

    ``text`` is the reply's new streamable text; in a turn with tools, only its
    content (tool-call markup held back), followed by the ``tool_calls`` completed
    at this step.
    """

    request_id: int
    text: str
    finished: bool
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # the scores of the tokens ``text`` completes (a turn asking for them)


@dataclass(frozen=True)
class StepTiming:
    """Where one decode step's (or prefill chunk's) time went on the model's thread, in milliseconds.

    On a GPU a decode loop is bound by whichever is slower: the device computing a step, or the
    host building the next one and handling the last one's tokens. ``wait_ms`` near zero says the
    device was done before the host asked (the host is the bottleneck); the GPU actor's trace
    carries these, so a device run can tell which without a profiler.

    Attributes:
        launch_ms: building the step's graph (the forward pass and sampling, lazily) and handing
            it to the device (``mx.async_eval``, or the launch part of a lockstep step).
        wait_ms: waiting for the device to hand back the tokens this step reads.
        host_ms: the host's work on those tokens: detokenizing, stop strings, tool calls.
        build_ms: the part of ``launch_ms`` spent building the graph in Python; the rest is MLX
            handing it to the device (on CUDA: recording kernels, instantiating or updating graphs).
        launch_cpu_ms: the model thread's CPU time over ``launch_ms`` (``time.thread_time``). Far
            below ``launch_ms``, the thread was not running: waiting for the GIL (another Python
            thread held it), for MLX's queue of work in flight, or for a core.
    """

    launch_ms: float
    wait_ms: float
    host_ms: float
    build_ms: float = 0.0
    launch_cpu_ms: float = 0.0


@dataclass(frozen=True)
class Finished:
    """A sequence out of the batch, parked (when anything new was computed).

    ``reply`` is the text as generated, tool-call markup included (what the cache
    holds); ``content`` the reply without its tool calls (None: the turn parsed
    none, the content is the reply) and ``tool_calls`` the calls parsed out of it.
    ``finish_reason`` is ``tool_calls`` when the reply stopped after calling tools.
    ``snapshot`` is ``parked``'s host copy for the save; None with a parked cache when the
    engine leaves the copy for later (``BackendProfile.copy_after_turn``): :meth:`Engine.snapshot`.
    """

    reply: str
    finish_reason: str | None
    stats: TurnStats
    parked: ParkedView | None
    snapshot: CacheSnapshot | None
    stop_sequence: str | None = None  # the caller's stop string that ended the reply
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # every reply token's scores (a turn asking for them)


class Engine(Protocol):
    """What the GPU actor needs from a model runtime. One thread (the model's) calls it, except
    :meth:`render`, :meth:`count_tokens` and :meth:`tokenize`: the GPU actor calls those on a
    worker thread, one at a time, while the model's thread runs other turns. They must not touch
    MLX, and may see a model swapped under them (they then raise, or the turn is refused after)."""

    @property
    def memory(self) -> MemoryReading: ...

    @property
    def profile(self) -> BackendProfile | None:
        """The backend profile (None: an engine without one); ``load`` refines it for each model."""

    def load(self, name: str) -> ModelInfo:
        """Unload the current model and load ``name``."""

    def unload(self) -> None:
        """Drop the model, every sequence and the batch."""

    def close(self) -> None:
        """Unload and release the thread's resources; the last call on the thread."""

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
    ) -> str:
        """Chat messages (and tool definitions) → prompt text (the model's template).

        A ``tool_choice`` the model cannot honour raises ``ValueError``."""

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is, for the loaded model."""

    def tokenize(self, prompt: str, plan: TurnPlan) -> Tokenized:
        """The part of ``prompt`` the plan leaves to prefill, tokenized (once per turn)."""

    def start(
        self, request_id: int, prompt: str, plan: TurnPlan, tokens: Tokenized, sampling: SamplingOptions
    ) -> SequenceStarted:
        """Build the sequence: the plan's cache, truncated to what it reuses and activated, then ``tokens``."""

    def prefill(self, request_id: int, chunk: int | None, *, adopt: FromShared | None = None) -> PrefillResult:
        """Run one prefill chunk of ``chunk`` tokens (None: the engine's adaptive size).

        ``adopt`` (first chunk only): start from these whole blocks of a donor's
        prompt instead; they are this prompt's first tokens."""

    def prefill_together(self, request_ids: list[int]) -> dict[int, PrefillResult]:
        """Prefill some of these turns (none started, each short) in one pass, and join them.

        Returns the turns it took: their whole prompt prefilled, first token sampled,
        already in the batch (no :meth:`join`; one its first token finished leaves it at
        :meth:`finish`). The others are untouched; ``{}`` where the engine does not group prefills."""

    def prepare(self, snapshot: CacheSnapshot) -> ParkedView | None:
        """``snapshot`` restored ahead of its turn (float kept where there is room); None: not this model's."""

    def park_prompt(self, request_id: int) -> ParkedView | None:
        """Park the prompt's KV (a donor for turns that share it): right after its prefill, or while it
        decodes (for a turn that came after its prefill ended)."""

    def join(self, request_id: int) -> None:
        """Merge a prefilled sequence into the running batch."""

    def step(self) -> list[StepToken]:
        """One decode step for every batch member."""

    @property
    def last_step_timing(self) -> StepTiming | None:
        """Where the last :meth:`step`'s time went on the model's thread (None: not measured)."""

    def finish(self, request_id: int) -> Finished:
        """Take the sequence out of the batch and park its cache (finished or cancelled)."""

    def snapshot(self, parked: ParkedView, *, stop: Callable[[], bool] | None = None,
                 done: list[Any] | None = None) -> CacheSnapshot | None:
        """``parked``'s host copy for its save, when :meth:`finish` left it for later.

        With ``stop``, the copy may go a part at a time: ``done`` (a list the caller keeps, empty at
        first) holds the copy's progress, which only the engine reads; the copy resumes from it,
        and once at least one part was made by this call, ``stop()`` returning True between two
        parts ends it with None (the GPU actor asks so while a message waits). An engine may also
        make it whole and never stop.
        """

    def discard(self, request_id: int) -> None:
        """Drop a sequence without parking it."""
