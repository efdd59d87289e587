"""An agent's mailbox (:data:`AgentInbox`) and the public result of a turn.

Requests and their replies::

    Turn(messages | prompt, sampling, ...)  -> TurnDone(result) | Failed   (+ text deltas on ``deltas``)
    ForgetAgent()                           -> Forgot(existed)  | Failed

:class:`TurnResult` and :class:`TurnUsage` are what ``AgentHandle.send``
returns; they encode to JSON with ``msgspec.json.encode`` unchanged.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from actors.messages_common import Failed, Message
from actors.messages_gpu import SamplingOptions, Tier

__all__ = [
    "TurnUsage",
    "TurnResult",
    "Turn",
    "TurnDone",
    "ForgetAgent",
    "Forgot",
    "TurnReply",
    "ForgetReply",
    "AgentInbox",
]


class TurnUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request accounting.

    Attributes:
        tokens_reused: cached tokens the turn started from (not prefilled).
        tokens_prefilled: prompt tokens that went through the model.
        tokens_generated: reply tokens sampled.
        tier: where the starting cache came from: ``hot`` (RAM), ``warm``
            (disk), ``shared`` (another agent's prefix) or ``cold`` (none).
        match: how the prompt matched the cache (exact/extend/partial/diverge/empty).
        queue_wait_ms: from submission until the GPU admitted the turn (waiting
            behind the agent's earlier turns, the cache fetch, the memory budget).
        ttft_ms: from submission to the first token.
        decode_tps: reply tokens per second after the first.
    """

    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    tier: Tier
    match: str
    queue_wait_ms: float
    ttft_ms: float
    decode_tps: float


class TurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished turn: the reply, why it stopped (``stop``, ``length``, ``cancelled``), usage.

    ``stop_sequence`` is the caller's stop string that ended the reply (not part
    of ``reply``); None when the turn stopped at end-of-sequence or for another reason.
    """

    agent_id: str
    request_id: int
    model: str
    reply: str
    finish_reason: str
    usage: TurnUsage
    stop_sequence: str | None = None


class TurnDone(Message, frozen=True, kw_only=True):
    result: TurnResult


class Forgot(Message, frozen=True, kw_only=True):
    existed: bool


TurnReply = TurnDone | Failed
ForgetReply = Forgot | Failed


class Turn(Message, frozen=True, kw_only=True):
    """One turn of the conversation: ``messages`` (rendered with the model's template) or a raw ``prompt``.

    Attributes:
        model: a configured model name (None: the runtime's default).
        share_prefix: start from another agent's cached prefix, and let others
            start from this agent's cache.
        submitted_at: ``time.perf_counter()`` at submission (queue wait, TTFT).
        tools: tool definitions rendered by the model's chat template (``messages`` only).
        deltas: streamed text (None: not streaming); the agent closes it when
            the generation is over, then answers on ``reply``.
        reply: the one-shot reply. Closing its receive end cancels the turn.
    """

    request_id: int
    messages: list[dict[str, Any]] | None
    prompt: str | None
    model: str | None
    sampling: SamplingOptions
    share_prefix: bool
    submitted_at: float
    deltas: trio.MemorySendChannel[str] | None
    reply: trio.MemorySendChannel[TurnReply]
    tools: list[dict[str, Any]] | None = None


class ForgetAgent(Message, frozen=True, kw_only=True):
    """Delete the agent's cache, hot and on disk."""

    reply: trio.MemorySendChannel[ForgetReply]


AgentInbox = Turn | ForgetAgent
