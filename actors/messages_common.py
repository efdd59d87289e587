"""Message types every mailbox shares: the tagged ``Failed`` reply, a turn's :class:`TurnUsage` (and ``ParkedView``, re-exported).

Every request/reply in kvmem is a frozen, keyword-only, tagged
:class:`msgspec.Struct`. A request carries its own one-shot reply channel; an
actor that cannot serve a request answers :class:`Failed` on it instead of
raising across actors.
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.plan.turn_plan import ParkedView, Tier

__all__ = ["ChatMessage", "Failed", "ParkedView", "failed_from", "Message", "TurnUsage"]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of every actor message: frozen, keyword-only, tagged with its class name."""


class Failed(Message, frozen=True, kw_only=True):
    """A request could not be served.

    Attributes:
        kind: the exception class name (``BudgetExceededError``, ``ModelError``,
            ``ValueError``, ...), so the API can re-raise the right type.
        error: a human-readable message.
    """

    kind: str
    error: str


def failed_from(exc: BaseException) -> Failed:
    """A :class:`Failed` reply describing ``exc``."""
    return Failed(kind=type(exc).__name__, error=str(exc) or type(exc).__name__)


class TurnUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's accounting: one record from the GPU actor, where it is measured, to both APIs' usage.

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

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the whole prompt: what the turn would have prefilled without any cache."""
        return self.tokens_reused + self.tokens_prefilled

    @property
    def reuse_fraction(self) -> float:
        """The part of the prompt that came from a cache."""
        return self.tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One chat message as the model's template takes it: the one form a conversation keeps from each API's
    request (or a caller's dicts, :func:`actors.messages_agent.chat_messages`) until the template renders it.

    ``tool_calls`` (an assistant's, OpenAI's shape) and ``tool_call_id`` (a
    ``tool`` result's) are rendered by templates that support tools.
    """

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None
