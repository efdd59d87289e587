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
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from gateway.errors import ApiError
from runtime.errors import InvalidAgentIdError
from runtime.persist import safe_agent_dirname

__all__ = ["AGENT_HEADER", "resolve_agent_id", "conversation_id", "check_agent_id"]

AGENT_HEADER = "x-agent-id"
HASH_PREFIX = "conv-"


def conversation_id(system: str | None, messages: Sequence[Mapping[str, Any]]) -> str:
    """``conv-<sha256>`` of the system prompt and the first user message."""
    first_user = next((m for m in messages if m.get("role") == "user"), None)
    payload = msgspec.json.encode(
        {"system": system or "", "first_user": first_user.get("content") if first_user else None}
    )
    return HASH_PREFIX + hashlib.sha256(payload).hexdigest()


def check_agent_id(agent_id: str, *, param: str) -> str:
    """``agent_id`` if it can name a cache, else a 400 naming where it came from."""
    try:
        safe_agent_dirname(agent_id)
    except InvalidAgentIdError as exc:
        raise ApiError(400, "invalid_request", f"invalid agent id in {param}: {exc}", param=param,
                       code="invalid_agent_id") from None
    return agent_id


def resolve_agent_id(
    headers: Mapping[str, str],
    *,
    user_field: str | None,
    user_param: str,
    system: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> str:
    """The agent id for a chat request (see the module docstring).

    Args:
        headers: the request headers (case-insensitive mapping).
        user_field: the API's user field value (OpenAI ``user``, Anthropic ``metadata.user_id``).
        user_param: its JSON path, for error messages.
        system: the system prompt text.
        messages: the conversation as chat dicts (``role``, ``content``).
    """
    header = headers.get(AGENT_HEADER)
    if header is not None:
        return check_agent_id(header, param="X-Agent-ID")
    if user_field:
        return check_agent_id(user_field, param=user_param)
    return conversation_id(system, messages)
