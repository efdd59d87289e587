"""Which agent (and so which KV cache) a request belongs to.

Explicit identity wins, in this order:

1. the ``X-Agent-ID`` header (any API);
2. the API's own user field: OpenAI ``user``, Anthropic ``metadata.user_id``
   (the direct agent API names the agent in its path instead);

otherwise the agent is named by a content hash: ``conv-`` + the full SHA-256 of
the system prompt and the first user message (JSON-encoded, so no two
different conversations can collide by concatenation). A client that re-sends
a growing conversation keeps hitting the same agent, and two conversations
share a cache only if they begin with the same system prompt *and* the same
first message — in which case their prompts are identical up to there anyway.

An id is checked once, where it enters the actors (``Runtime.agent``, through
:meth:`gateway.context.Gateway.agent`, which names the header or field it came
from in the 400): :class:`AgentRef` carries that name along.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

__all__ = ["AGENT_HEADER", "AgentRef", "resolve_agent_id", "conversation_id"]

AGENT_HEADER = "x-agent-id"
HASH_PREFIX = "conv-"


def conversation_id(system: str | None, messages: Sequence[Mapping[str, Any]]) -> str:
    """``conv-<sha256>`` of the system prompt and the first user message."""
    first_user = next((m for m in messages if m.get("role") == "user"), None)
    payload = msgspec.json.encode(
        {"system": system or "", "first_user": first_user.get("content") if first_user else None}
    )
    return HASH_PREFIX + hashlib.sha256(payload).hexdigest()


class AgentRef(NamedTuple):
    """An agent id as a request gave it, and where (the JSON path or header, for a 400)."""

    agent_id: str
    param: str


def resolve_agent_id(
    headers: Mapping[str, str],
    *,
    user_field: str | None,
    user_param: str,
    system: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> AgentRef:
    """The agent id for a chat request, and where it came from (see the module docstring).

    Args:
        headers: the request headers (case-insensitive mapping).
        user_field: the API's user field value (OpenAI ``user``, Anthropic ``metadata.user_id``).
        user_param: its JSON path, for error messages.
        system: the system prompt text.
        messages: the conversation as chat dicts (``role``, ``content``).
    """
    header = headers.get(AGENT_HEADER)
    if header is not None:
        return AgentRef(header, "X-Agent-ID")
    if user_field:
        return AgentRef(user_field, user_param)
    return AgentRef(conversation_id(system, messages), "messages")
