"""The engine's contract: the plan a turn hands it, what the GPU actor asks of it, and what it reports back.

**The plan.** A :class:`TurnPlan` says what one turn reuses, from where
(:data:`CacheSource`), and what it prefills. It is decided once per turn by
:class:`runtime.plan.kv_manager.KVCacheManager` (prefix match against the agent's
own cache, else a whole-block prefix of another agent's) and then carried,
unchanged, by the agent actor to the GPU actor and the engine: nobody
downstream matches the prompt again. The engine tokenizes only
``plan.suffix(prompt)``, once (:class:`Tokenized`).

**The engine.** An :class:`Engine` holds the loaded model, the running
sequences and the decode batch. Every method runs on the MLX thread
(:mod:`actors.mlx_thread`) and does one bounded piece of work — tokenize a
turn's new text, build a sequence, one prefill chunk, one decode step for the
whole batch, park a finished sequence — so the GPU actor can interleave agents
token by token. It executes decisions made elsewhere: what a turn reuses comes
in its plan, and a donor prefix to adopt from
:meth:`runtime.plan.kv_manager.KVCacheManager.adopt`; it never matches prompts itself.

This module is pure (msgspec, llguidance's schema check and the standard library; no trio, no mlx): the
manager, the actors and the engines all import it. Implementations:
:class:`runtime.execution.mlx_engine.MlxEngine` (the real one),
:class:`runtime.distributed.leader.LeaderEngine` (rank 0 of ``kvmem serve --distributed``: the
real one, each call also sent to the other ranks) and
``tests/fake_engine.py`` (deterministic, no MLX; actor tests use it to pin down
scheduling and lifecycle quickly).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from runtime.backend import BackendProfile
from runtime.plan.prefix import MatchKind
from runtime.reply.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from runtime.reply.reply_format import check_grammar, schema_error
from runtime.spec import CacheSnapshot, LayerKind

__all__ = [
    # the plan
    "ParkedView",
    "SamplingOptions",
    "Penalties",
    "PENALTY_CONTEXT",
    "SEED_RANGE",
    "Tier",
    "ColdStart",
    "FromHot",
    "FromWarm",
    "FromShared",
    "CacheSource",
    "TurnPlan",
    "Tokenized",
    "COLD",
    # tool calls
    "ToolChoice",
    "ToolUse",
    "ResponseFormat",
    "ToolCall",
    # the engine
    "Engine",
    "ModelInfo",
    "SequenceStarted",
    "PrefillResult",
    "StepToken",
    "StepTiming",
    "Finished",
    "MemoryReading",
]


# -- the plan: what a turn reuses, and what it prefills ------------------------

Tier = Literal["hot", "warm", "remote", "shared", "cold"]
"""Where a turn's starting cache came from: the agent's hot (RAM) or warm (disk)
cache, its cache another node published in the shared tier (remote: Redis),
another agent's cache via a shared prefix, or nothing."""


class ParkedView(Protocol):
    """What code off the MLX thread may read of a parked cache.

    :class:`runtime.kv.kvstate.ParkedCache` satisfies it; the arrays it holds are
    MLX arrays that only the MLX thread computes with. Everything else only passes
    the object along and reads these plain attributes.
    """

    @property
    def model_tag(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


# -- tool calls: what a turn lets the model do with its tools, and what comes out --


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """What a turn with tools lets the model do (OpenAI's and Anthropic's ``tool_choice``, one shape).

    Attributes:
        mode: ``auto`` (call or answer), ``none`` (answer, never call) or
            ``required`` (call a tool).
        name: with ``required``, the one function to call (None: any).

    Raises:
        ValueError: an unknown mode, or a name with a mode other than ``required``.
    """

    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice must be 'auto', 'none' or 'required', not {self.mode!r}")
        if self.name is not None and (self.mode != "required" or not self.name):
            raise ValueError("tool_choice: a function name goes with mode 'required'")

    @classmethod
    def of(cls, value: str | Mapping[str, Any] | ToolChoice | None) -> ToolChoice:
        """``"auto"`` / ``"none"`` / ``"required"``, ``{"name": "f"}`` (call ``f``) or a ``ToolChoice``."""
        if value is None:
            return cls()
        if isinstance(value, ToolChoice):
            return value
        if isinstance(value, str):
            return cls(mode=value)  # type: ignore[arg-type]  # checked in __post_init__
        name = value.get("name")
        if not isinstance(name, str) or set(value) != {"name"}:
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'name': <function name>}")
        return cls(mode="required", name=name)


class ToolUse(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's tool definitions (OpenAI ``{"type": "function", "function": ...}``) and its :class:`ToolChoice`.

    The engine renders the definitions and parses the reply's tool calls with the
    model's mlx-lm tool parser (``runtime.reply.tool_calls``), or in kvmem's generic format
    (``runtime.reply.generic_tools``) for a model whose template has no tool syntax.
    ``parallel`` False: one call at most (OpenAI's ``parallel_tool_calls``; enforced in the
    generic format, whose grammar decides the calls).
    """

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """The reply is JSON (OpenAI's ``response_format``): valid against ``schema``, or any JSON object.

    The engine decodes the reply under the schema's grammar (:mod:`runtime.reply.grammar`), so
    it parses, on every model; ``max_tokens`` can still cut it short (``finish_reason``
    ``length``).

    Attributes:
        schema: a JSON Schema (None: any JSON object, OpenAI's ``json_object``).
        name: the schema's name, as OpenAI's ``json_schema.name`` gives it.
        grammar: instead of JSON, a grammar the reply follows (llguidance's Lark dialect; llama.cpp's
            ``grammar`` field, GBNF, converted to it): not with tools.

    Raises:
        ValueError: a schema or grammar that cannot constrain a reply (the message says why).
    """

    schema: dict[str, Any] | None = None
    name: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.schema is not None and (error := schema_error(self.schema)):
            raise ValueError(f"response_format's schema: {error}")
        if self.grammar is not None:
            check_grammar(self.grammar)  # raises ValueError with llguidance's message

    @classmethod
    def of(cls, value: Mapping[str, Any] | ResponseFormat | None) -> ResponseFormat | None:
        """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), or one of these (None: text).

        Raises:
            ValueError: another type, or a ``json_schema`` without a schema object.
        """
        if value is None or isinstance(value, ResponseFormat):
            return value
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls()
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema: a JSON Schema object is required")
            name = spec.get("name") if isinstance(spec, Mapping) else None
            return cls(schema=schema, name=name if isinstance(name, str) else None)
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}")


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call parsed out of a reply by the model's mlx-lm tool parser.

    Attributes:
        id: the model's own id when its format writes one, else ``call_`` + 24 hex digits.
        name: the function to call.
        arguments: its arguments, a JSON object as text (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        return "call_" + secrets.token_hex(12)

    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's ``tool_use.input``)."""
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}

    def for_template(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` item for the chat template.

        OpenAI's shape with the arguments as an object, as mlx-lm's server hands them to templates.
        """
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.input()}}


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


# -- where a turn's cache comes from -------------------------------------------


class ColdStart(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """No cache: prefill the whole prompt."""


class FromHot(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The agent's own parked cache from the hot tier."""

    parked: ParkedView


class FromWarm(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The agent's own cache read from disk (numpy); restored on the MLX thread.

    ``prepared``: the same cache already restored (:meth:`Engine.prepare`, at start), or None.
    """

    snapshot: CacheSnapshot
    prepared: ParkedView | None = None


class FromShared(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The first ``reuse_tokens`` tokens (whole blocks) of another agent's cache.

    ``donor`` is that agent; ``parked`` its hot cache, or the prompt of its turn
    still in flight. Only text the requesting agent sent itself is covered: the
    donor's text up to ``reuse_tokens`` is a prefix of the new prompt.
    """

    parked: ParkedView
    reuse_tokens: int
    donor: str


CacheSource = ColdStart | FromHot | FromWarm | FromShared


class OwnCache(msgspec.Struct, frozen=True, kw_only=True):
    """The agent's own cache a turn may start from, as the store found it when the turn began.

    ``source``: its hot cache, or its cache read from disk; ``tier``: where it came from
    (``hot``, ``warm``, or ``remote`` when it was just pulled from the shared tier).
    The GPU actor matches the rendered prompt against it
    (:meth:`runtime.plan.kv_manager.KVCacheManager.plan`).
    """

    source: FromHot | FromWarm
    tier: Tier


class TurnPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One turn's reuse decision.

    Attributes:
        tier: where the reused cache comes from (``cold`` when nothing is reused).
        source: the cache itself.
        match: how the prompt matched it (:class:`runtime.plan.prefix.MatchKind` value).
        reuse_tokens: leading tokens of ``source`` the turn keeps.
        reuse_chars: characters of the prompt those tokens cover; the rest,
            ``prompt[reuse_chars:]``, is tokenized and prefilled.
    """

    tier: Tier
    source: CacheSource
    match: str
    reuse_tokens: int
    reuse_chars: int

    def suffix(self, prompt: str) -> str:
        """The part of ``prompt`` to tokenize and prefill."""
        return prompt[self.reuse_chars :]


COLD = TurnPlan(tier="cold", source=ColdStart(), match=MatchKind.EMPTY.value, reuse_tokens=0, reuse_chars=0)
"""The plan of a turn with nothing cached."""


class Tokenized(msgspec.Struct, frozen=True, kw_only=True):
    """A plan's suffix, tokenized once: token ids and each token's end offset in the suffix."""

    ids: tuple[int, ...]
    ends: tuple[int, ...]


# -- the engine: what the GPU actor asks of it, and what it reports ------------


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


@dataclass(frozen=True)
class SequenceStarted:
    """A sequence built from its prompt and starting cache (``token_ids``: the whole prompt's)."""

    tokens_reused: int
    tokens_to_prefill: int
    match: str
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
    match: str
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
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
