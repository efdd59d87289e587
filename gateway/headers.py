"""Response headers every route shares: the request id and kvmem's per-turn accounting.

Every response carries ``request-id``; a turn's answer also carries its
accounting as ``x-kvmem-*`` headers (tier, prefix match, tokens, timings), the
same numbers a body or stream event gives under ``kvmem``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.requests import Request

if TYPE_CHECKING:
    from actors.messages_agent import TurnResult

__all__ = ["REQUEST_ID_KEY", "request_id", "kvmem_extras", "kvmem_headers", "header_safe"]

REQUEST_ID_KEY = "kvmem_request_id"
"""Where the gateway's middleware keeps a request's id in the ASGI scope."""


def request_id(request: Request) -> str:
    """The id the gateway gave this request (also its ``request-id`` response header)."""
    return str(request.scope.get(REQUEST_ID_KEY, "req_unknown"))


def kvmem_extras(result: TurnResult) -> dict[str, Any]:
    """kvmem's own accounting of a turn (tier, prefix match, timings), for bodies and stream events."""
    u = result.usage
    return {
        "agent_id": result.agent_id,
        "tier": u.tier,
        "match": u.match,
        "tokens_reused": u.tokens_reused,
        "tokens_prefilled": u.tokens_prefilled,
        "tokens_generated": u.tokens_generated,
        "queue_wait_ms": round(u.queue_wait_ms, 3),
        "ttft_ms": round(u.ttft_ms, 3),
        "decode_tps": round(u.decode_tps, 3),
    }


def header_safe(value: str) -> str:
    """``value`` as an HTTP header value: percent-encoded (UTF-8) when it is not plain ASCII."""
    return value if value.isascii() and value.isprintable() else quote(value, safe="")


def kvmem_headers(result: TurnResult) -> dict[str, str]:
    """The same accounting as ``x-kvmem-*`` response headers (a non-ASCII agent id percent-encoded)."""
    return {f"x-kvmem-{k.replace('_', '-')}": header_safe(str(v)) for k, v in kvmem_extras(result).items()}
