"""Wire types of kvmem's own agent API (``/v1/agents``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from actors.messages_agent import TurnResult
from actors.metrics import RunningTurn
from gateway.schemas_openai import AdditivePenalty, LogitBias, RepetitionPenalty, ResponseFormatSpec, Seed

__all__ = ["AgentMessage", "AgentTurnRequest", "AgentInfo", "AgentList", "Deleted", "turn_decoder"]


class AgentMessage(Struct, kw_only=True):
    """A chat message as the runtime takes it (``tool_calls`` / ``tool_call_id`` as in OpenAI)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class NamedTool(Struct, kw_only=True):
    """A ``tool_choice`` naming the one function the model must call."""

    name: Annotated[str, Meta(min_length=1)]


class AgentTurnRequest(Struct, kw_only=True):
    """``POST /v1/agents/{id}/messages``: the whole conversation (``messages``) or raw ``prompt`` text.

    Attributes:
        tools: OpenAI-shaped tool definitions; the reply's calls come back in ``tool_calls``.
        tool_choice: ``auto`` (default), ``none``, ``required`` or ``{"name": ...}``.
        response_format: OpenAI's shape: ``{"type": "json_object"}`` or ``{"type": "json_schema",
            "json_schema": {"name": ..., "schema": {...}}}``; the reply is JSON, decoded under the
            schema's grammar on every model.
        model: a configured model (None: the default).
        max_tokens: new tokens at most (None: the server's ``default_max_tokens``).
        seed: the turn's own random stream (the same seed, prompt and parameters give the same reply).
        presence_penalty, frequency_penalty, repetition_penalty: mlx-lm's repeat penalties over the
            last 20 tokens (OpenAI's first two, in [-2, 2]; the last multiplicative, 1 is none).
        logit_bias: the model's token ids (object keys) to biases in [-100, 100] added to their logits.
        share_prefix: start from another agent's cached prefix (or its tenant's blocks on disk) when it covers more of
            the prompt than this agent's own cache; and be a donor for others.
    """

    messages: list[AgentMessage] | None = None
    prompt: Annotated[str, Meta(min_length=1)] | None = None
    system: str | None = None
    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)] = []
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = None
    frequency_penalty: AdditivePenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    response_format: ResponseFormatSpec | None = None
    stream: bool = False
    share_prefix: bool = True


class AgentInfo(Struct, kw_only=True):
    """An agent: its cache (hot tier, disk), whether its actor is running, and its turn on the GPU if one runs.

    ``turn`` shows a long prefill's progress (``tokens_prefilled`` of ``tokens_to_prefill``)
    and then the decode (``tokens_generated``); None when no turn of the agent is running.
    ``remote``: with a shared tier, Redis holds a newer copy than this node, or the only one.
    """

    id: str
    object: Literal["agent"]
    model_tag: str | None
    cached_tokens: int
    hot: bool
    on_disk: bool
    dirty: bool
    disk_bytes: int
    updated_at: float | None
    live: bool
    turn: RunningTurn | None = None
    remote: bool = False


class AgentList(Struct, kw_only=True):
    """``GET /v1/agents``: every agent with a cache (hot or on disk) or a running actor, by id."""

    object: Literal["list"]
    data: list[AgentInfo]


class Deleted(Struct, kw_only=True):
    """``DELETE /v1/agents/{id}``: the agent's caches (every model's, hot and on disk) were deleted."""

    id: str
    object: Literal["agent"]
    deleted: bool


class TurnDelta(Struct, kw_only=True):
    """A ``delta`` event of a streamed ``POST /v1/agents/{id}/messages``: the next piece of the reply text."""

    text: str


turn_decoder = msgspec.json.Decoder(AgentTurnRequest)

__all__ += ["TurnDelta", "TurnResult"]
