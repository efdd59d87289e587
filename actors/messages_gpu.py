"""The GPU actor's mailbox: model loading, prompt rendering and generation requests.

Requests (:data:`GpuInbox`)::

    LoadModel(name)        -> ModelReady(info)  | Failed
    UnloadModel()          -> Unloaded()        | Failed
    Render(messages)       -> Rendered(prompt)  | Failed
    Generate(prompt, ...)  -> Generated(...)    | Failed    (+ text deltas on ``deltas``)

A :class:`Generate` names where its cache comes from (:data:`CacheSource`): the
agent's own hot or warm cache, a prefix of another agent's hot cache, or none.
"""

from __future__ import annotations

from typing import Any, Literal

import trio

from actors.messages_common import Failed, HotCache, Message
from runtime.snapshot import CacheSnapshot

__all__ = [
    "SamplingOptions",
    "ModelInfo",
    "ColdStart",
    "FromHot",
    "FromWarm",
    "FromShared",
    "CacheSource",
    "Tier",
    "LoadModel",
    "UnloadModel",
    "Render",
    "Generate",
    "ModelReady",
    "Unloaded",
    "Rendered",
    "Generated",
    "GpuInbox",
    "LoadReply",
    "UnloadReply",
    "RenderReply",
    "GenerateReply",
]

Tier = Literal["hot", "warm", "shared", "cold"]
"""Where a turn's starting cache came from: the agent's hot (RAM) or warm (disk)
cache, another agent's hot cache via a shared prefix, or nothing."""


class SamplingOptions(Message, frozen=True, kw_only=True):
    """Sampling parameters as they travel between actors (see ``runtime.sampling``)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


class ModelInfo(Message, frozen=True, kw_only=True):
    """The loaded model, as actors outside the GPU actor know it.

    Attributes:
        name: the name it was loaded by (recipe, folder or Hugging Face id).
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


# -- where a turn's cache comes from -------------------------------------------


class ColdStart(Message, frozen=True, kw_only=True):
    """No cache: prefill the whole prompt."""


class FromHot(Message, frozen=True, kw_only=True):
    """The agent's own parked cache from the hot tier."""

    parked: HotCache


class FromWarm(Message, frozen=True, kw_only=True):
    """The agent's own cache read from disk (numpy); restored on the MLX thread."""

    snapshot: CacheSnapshot


class FromShared(Message, frozen=True, kw_only=True):
    """The first ``keep_tokens`` tokens of another agent's hot cache.

    Only text the requesting agent sent itself is covered: the donor's cached
    text up to ``keep_tokens`` is a prefix of the new prompt.
    """

    parked: HotCache
    keep_tokens: int
    donor: str


CacheSource = ColdStart | FromHot | FromWarm | FromShared


# -- requests ------------------------------------------------------------------


class ModelReady(Message, frozen=True, kw_only=True):
    info: ModelInfo


class Unloaded(Message, frozen=True, kw_only=True):
    pass


class Rendered(Message, frozen=True, kw_only=True):
    prompt: str
    num_tokens: int | None = None  # set when the Render asked for a token count


class Generated(Message, frozen=True, kw_only=True):
    """A finished (or cancelled) generation and the agent's updated cache.

    Attributes:
        finish_reason: ``stop``, ``length`` or ``cancelled``.
        match: how the prompt matched the starting cache (``runtime.prefix.MatchKind``).
        queue_wait_s: submission to admission (agent queue, cache fetch, memory wait).
        ttft_s: submission to the first token.
        parked: the updated cache (None when nothing new was computed or a
            sliding window could not be kept); ``snapshot`` is its numpy copy
            for the write-behind save.
    """

    request_id: int
    reply: str
    finish_reason: str
    match: str
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    queue_wait_s: float
    ttft_s: float
    decode_tps: float
    parked: HotCache | None
    snapshot: CacheSnapshot | None
    stop_sequence: str | None = None


LoadReply = ModelReady | Failed
UnloadReply = Unloaded | Failed
RenderReply = Rendered | Failed
GenerateReply = Generated | Failed


class LoadModel(Message, frozen=True, kw_only=True):
    """Unload the current model (if any) and load ``name``."""

    name: str
    reply: trio.MemorySendChannel[LoadReply]


class UnloadModel(Message, frozen=True, kw_only=True):
    reply: trio.MemorySendChannel[UnloadReply]


class Render(Message, frozen=True, kw_only=True):
    """Render chat messages with the loaded model's template (tokenizer work: MLX thread).

    Attributes:
        tools: tool definitions for templates that support them (a template
            that does not makes the render fail with ``ValueError``).
        count_tokens: also count the prompt's tokens (``Rendered.num_tokens``).
    """

    model_tag: str
    messages: list[dict[str, Any]]
    reply: trio.MemorySendChannel[RenderReply]
    tools: list[dict[str, Any]] | None = None
    count_tokens: bool = False


class Generate(Message, frozen=True, kw_only=True):
    """Generate a reply to ``prompt`` starting from ``source``.

    Attributes:
        deltas: where streamable text goes (``send_nowait``; text that does not
            fit is coalesced into the next delta). The GPU actor never closes it.
        client: the caller's own reply channel. When its receive end is closed
            (the client left), the generation is cancelled; nothing is sent on it.
        submitted_at: ``time.perf_counter()`` when the client submitted the turn.
        share_prefix: this turn's prompt prefix may be shared with other agents'
            sequences in flight, both ways (the agent's ``share_prefix`` setting).
    """

    request_id: int
    agent_id: str
    model_tag: str
    prompt: str
    source: CacheSource
    sampling: SamplingOptions
    submitted_at: float
    deltas: trio.MemorySendChannel[str] | None
    client: trio.MemorySendChannel[Any] | None
    reply: trio.MemorySendChannel[GenerateReply]
    share_prefix: bool = False


GpuInbox = LoadModel | UnloadModel | Render | Generate
