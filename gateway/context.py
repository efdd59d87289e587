"""What every route handler shares: the :class:`Gateway`, which agent a request names, its answer's headers.

Routes are thin: read the body (bounded), decode it with a prebuilt msgspec
decoder, check limits, the model name and the agent id, call the in-process
runtime API (giving up when the client leaves), and encode the answer. Error
mapping lives in :mod:`gateway.errors`.

**Which agent** (and so which KV cache) a request belongs to
(:func:`resolve_agent_id`). Explicit identity wins, in this order:

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
:meth:`Gateway.agent`, which names the header or field it came from in the
400): :class:`AgentRef` carries that name along. There it is also NFC-normalized
(:func:`runtime.identity.check_agent_id`). Ids that arrive as bytes (the
``X-Agent-ID`` header, the ``/v1/agents/{id}`` path) are percent-encoded UTF-8, the
encoding kvmem's ``x-kvmem-agent-id`` answers use (:func:`header_safe`), and
:func:`decode_agent_id` reads them strictly: bytes that are not UTF-8 are a 400,
never a U+FFFD that two different ids would share. With tenants, :meth:`Gateway.agent`
names the agent in the request's tenant's namespace (:mod:`runtime.identity`), and
answers show the id as the tenant gave it (:func:`public_result`).

**Durable turns**: ``X-Kvmem-Durable: true`` (:func:`durable_of`) makes a request's
answer wait until its turn's cache is on disk (the ``durable`` setting is the default).

**Response headers**: every response carries ``request-id``
(:func:`request_id`); a turn's answer also carries its accounting as
``x-kvmem-*`` headers (tier, prefix match, tokens, timings,
:func:`kvmem_headers`), the same numbers a body or stream event gives under
``kvmem`` (:func:`kvmem_extras`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import quote, unquote_to_bytes

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response

from actors.messages_common import ChatMessage
from gateway.errors import ApiError, from_decode_error, runtime_errors
from gateway.json_depth import MAX_JSON_DEPTH, json_depth
from runtime.config import Config
from runtime.errors import InvalidAgentIdError
from runtime.identity import local_id, namespaced, safe_agent_dirname

if TYPE_CHECKING:
    from actors.client import AgentHandle, TurnStream
    from actors.messages_agent import ChatTurn, TurnResult
    from actors.supervisor import Runtime
    from gateway.tenants import Tenant, TenantKeys

__all__ = [
    "Gateway",
    "CLIENT_GONE",
    "AGENT_HEADER",
    "AgentRef",
    "resolve_agent_id",
    "decode_agent_id",
    "decode_body",
    "DECODE_ON_LOOP_BYTES",
    "conversation_id",
    "REQUEST_ID_KEY",
    "AGENT_SEGMENT_KEY",
    "request_id",
    "kvmem_extras",
    "kvmem_headers",
    "header_safe",
    "TENANT_KEY",
    "tenant_of_request",
    "public_result",
]

DRAIN_BYTES = 64 * 2**20
"""How much of an oversize body is read (and dropped) so that the client sees the 413."""

T = TypeVar("T")

log = logging.getLogger("kvmem.gateway")

CLIENT_GONE = 499
"""Status logged for a request whose client left before the answer (nginx's convention; never seen by anyone)."""


# -- which agent ---------------------------------------------------------------

AGENT_HEADER = "x-agent-id"
HASH_PREFIX = "conv-"


def conversation_id(system: str | None, messages: Sequence[ChatMessage]) -> str:
    """``conv-<sha256>`` of the system prompt and the first user message."""
    first_user = next((m for m in messages if m.role == "user"), None)
    payload = msgspec.json.encode(
        {"system": system or "", "first_user": first_user.content if first_user else None}
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
    messages: Sequence[ChatMessage],
) -> AgentRef:
    """The agent id for a chat request, and where it came from (see the module docstring).

    Args:
        headers: the request headers (case-insensitive mapping).
        user_field: the API's user field value (OpenAI ``user``, Anthropic ``metadata.user_id``).
        user_param: its JSON path, for error messages.
        system: the system prompt text.
        messages: the conversation, as the request's API made it into chat messages.

    Raises:
        ApiError: 400 when the ``X-Agent-ID`` header is not percent-encoded UTF-8 (:func:`decode_agent_id`).
    """
    header = headers.get(AGENT_HEADER)
    if header is not None:
        # Starlette hands header bytes over as Latin-1; latin-1 gives the bytes back unchanged
        return AgentRef(decode_agent_id(header.encode("latin-1"), param="X-Agent-ID"), "X-Agent-ID")
    if user_field:
        return AgentRef(user_field, user_param)
    return AgentRef(conversation_id(system, messages), "messages")


_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")


def decode_agent_id(raw: bytes, *, param: str) -> str:
    """The agent id that ``raw`` (an ``X-Agent-ID`` header, a URL path) spells: percent-encoded UTF-8.

    The inverse of :func:`header_safe`. Escapes are optional (a raw UTF-8 header, as
    curl sends it, reads the same as its escaped form), but everything must be UTF-8
    once unescaped, and a ``%`` must begin an escape (a literal ``%`` is ``%25``):
    guessing instead would give one id two readings.

    Raises:
        ApiError: 400 ``invalid_agent_id`` naming ``param``.
    """
    if _BAD_ESCAPE.search(raw):
        raise ApiError(400, "invalid_request", f"invalid agent id in {param}: a '%' does not begin an escape "
                       "(%XX); write a literal '%' as %25", param=param, code="invalid_agent_id")
    try:
        return unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "invalid_request", f"invalid agent id in {param}: not valid UTF-8 once "
                       f"percent-decoded ({exc.reason}); send UTF-8, percent-encoded", param=param,
                       code="invalid_agent_id") from None


DECODE_ON_LOOP_BYTES = 256 * 1024
"""Bodies up to this size are decoded on the event loop (well under a millisecond); larger ones on a thread."""


def decode_body(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """``body`` decoded by ``decoder`` once its nesting is measured (:mod:`gateway.json_depth`).

    Raises:
        ApiError: 400 for nesting past :data:`MAX_JSON_DEPTH`, malformed JSON, text that is not
            UTF-8, or a schema violation (its JSON path as ``param``).
    """
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, "invalid_request", f"the request body nests {depth} levels deep; at most "
                       f"{MAX_JSON_DEPTH} are allowed", code="too_deeply_nested")
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except UnicodeDecodeError as exc:  # msgspec raises it for bytes that are not UTF-8 inside a string
        raise ApiError(400, "invalid_request", f"the request body is not valid UTF-8 ({exc.reason} at byte "
                       f"{exc.start})", code="invalid_json") from None


DURABLE_HEADER = "x-kvmem-durable"
"""A request header: ``true`` (or ``1``) answers the turn only once its cache is on disk; ``false`` (``0``)
answers as soon as it is generated (write-behind). Absent: the server's ``durable`` setting."""


def durable_of(headers: Mapping[str, str]) -> bool | None:
    """What the request's ``X-Kvmem-Durable`` header asks for (None: the server's setting); a bad value is a 400."""
    raw = headers.get(DURABLE_HEADER)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ApiError(400, "invalid_request", f"X-Kvmem-Durable must be true or false, not {raw!r}",
                   param="X-Kvmem-Durable", code="invalid_value")


# -- response headers ----------------------------------------------------------

REQUEST_ID_KEY = "kvmem_request_id"
"""Where the gateway's middleware keeps a request's id in the ASGI scope."""

AGENT_SEGMENT_KEY = "kvmem_agent_segment_encoded"
"""Scope key: the path's agent id segment is still percent-encoded (:func:`gateway.app.keep_agent_id_encoded`)."""


def request_id(request: Request) -> str:
    """The id the gateway gave this request (also its ``request-id`` response header)."""
    return str(request.scope.get(REQUEST_ID_KEY, "req_unknown"))


TENANT_KEY = "kvmem_tenant"
"""Where the gateway's middleware keeps the request's :class:`gateway.tenants.Tenant` in the ASGI scope."""


def tenant_of_request(request: Request) -> Tenant | None:
    """The tenant the request's key names (None: no tenants, one key or none)."""
    return request.scope.get(TENANT_KEY)


def public_result(result: TurnResult) -> TurnResult:
    """``result`` with the agent id as its tenant gave it (the same result without tenants)."""
    public = local_id(result.agent_id)
    return result if public == result.agent_id else msgspec.structs.replace(result, agent_id=public)


def kvmem_extras(result: TurnResult) -> dict[str, Any]:
    """kvmem's own accounting of a turn (tier, prefix match, timings), for bodies and stream events."""
    u = result.usage
    return {
        "agent_id": local_id(result.agent_id),
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
    """``value`` as an HTTP header value: percent-encoded (UTF-8) when it is not plain ASCII or holds a ``%``.

    A client may send an ``x-kvmem-agent-id`` back as ``X-Agent-ID`` unchanged
    (:func:`decode_agent_id` is the inverse), so a ``%`` is escaped too.
    """
    plain = value.isascii() and value.isprintable() and "%" not in value
    return value if plain else quote(value, safe="")


def kvmem_headers(result: TurnResult) -> dict[str, str]:
    """The same accounting as ``x-kvmem-*`` response headers (a non-ASCII agent id percent-encoded)."""
    return {f"x-kvmem-{k.replace('_', '-')}": header_safe(str(v)) for k, v in kvmem_extras(result).items()}


# -- the shared state ----------------------------------------------------------


ACCEPT_WAIT_S = 10.0
"""How long a streaming request waits for its turn to be accepted before its status is sent
(:meth:`Gateway.accepted_stream`): past it, proxies would see no byte at all."""


def _accepted(stream: TurnStream) -> Callable[[], Awaitable[bool]]:
    async def call() -> bool:
        await stream.accepted()
        return True

    return call


@dataclass
class Gateway:
    """Shared state of the HTTP app.

    Attributes:
        rt: the running kvmem runtime.
        config: the server's settings.
        models: the model names requests may use (the default first).
        tenants: the key file's tenants (None: one key or none).
        http_requests: responses by (route, method, status), for ``/metrics``.
    """

    rt: Runtime
    config: Config
    models: tuple[str, ...]
    tenants: TenantKeys | None = None
    started_at: float = field(default_factory=time.time)
    http_requests: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    encoder: msgspec.json.Encoder = field(default_factory=msgspec.json.Encoder)

    @property
    def default_model(self) -> str:
        return self.models[0]

    def model_for(self, name: str | None) -> str | None:
        """The configured model a request names (None: the default).

        Raises:
            ApiError: 404 for a model this server does not serve (unless ``accept_any_model``).
        """
        if name is None or name == self.default_model:
            return None
        if name in self.models:
            return name
        if self.config.accept_any_model:
            return None
        raise ApiError(
            404,
            "not_found",
            f"model {name!r} not found: this server serves {list(self.models)}",
            param="model",
            code="model_not_found",
        )

    def agent(self, agent_id: str, *, param: str = "agent_id", share_prefix: bool = True,
              tenant: Tenant | None = None) -> AgentHandle:
        """The runtime's handle on ``agent_id`` (where ids are checked, once).

        With a ``tenant`` (:func:`tenant_of_request`) the handle is on the agent of that
        id in the tenant's namespace. The id is checked as the client gave it first, so
        that it cannot carry a namespace of its own.

        Raises:
            ApiError: 400 naming ``param`` (the header or field the id came from)
                when the id cannot name a cache.
        """
        try:
            safe_agent_dirname(agent_id)
            return self.rt.agent(namespaced(tenant.name if tenant else None, agent_id), share_prefix=share_prefix)
        except InvalidAgentIdError as exc:
            raise ApiError(400, "invalid_request", f"invalid agent id in {param}: {exc}", param=param,
                           code="invalid_agent_id") from None

    async def admit(self, handle: AgentHandle, tenant: Tenant | None) -> None:
        """Before a turn: refuse it (429) when it would take ``tenant`` over its agents or disk limit."""
        if tenant is not None:
            await tenant.admit(self.rt, handle.agent_id)

    def check_max_tokens(self, value: int, *, param: str) -> int:
        limit = self.config.max_tokens_limit
        if value > limit:
            raise ApiError(400, "invalid_request", f"{param}: {value} is above this server's limit of {limit}",
                           param=param, code="max_tokens_too_large")
        return value

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 once it passes ``max_body_bytes`` (nothing past it is kept).

        The rest of an oversize body is read and dropped (up to :data:`DRAIN_BYTES`) before
        answering: a server that answers and closes while the client is still sending makes
        the client's TCP stack reset the connection, and the client never sees the 413.

        A body still arriving ``body_timeout_s`` after the route started reading it is a 408:
        Hypercorn bounds how long headers may take (its keep-alive timer) but not a body, so
        without this a client trickling bytes (a slow-loris upload) holds its connection and
        buffers forever. The body is then unread, so the app's middleware closes the connection.
        """
        limit = self.config.max_body_bytes
        too_large = ApiError(413, "request_too_large", f"request body is larger than {limit} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
            raise too_large
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.config.body_timeout_s) as deadline:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    chunks.clear()
                    if size > DRAIN_BYTES:
                        break
                    continue
                chunks.append(chunk)
        if deadline.cancelled_caught:
            log.info("request %s: the body took longer than %s s; answering 408", request_id(request),
                     self.config.body_timeout_s)
            raise ApiError(408, "invalid_request",
                           f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                           code="request_timeout")
        if size > limit:
            raise too_large
        return b"".join(chunks)

    async def decode(self, request: Request, decoder: msgspec.json.Decoder[T]) -> T:
        """Read and decode a JSON body; malformed JSON, nesting past :data:`MAX_JSON_DEPTH` or a schema
        violation is a 400. A body over :data:`DECODE_ON_LOOP_BYTES` is measured and decoded on a worker
        thread: tens of milliseconds for a few megabytes, which would otherwise stall every other request."""
        body = await self.read_body(request)
        if not body.strip():
            raise ApiError(400, "invalid_request", "the request body is empty; a JSON object is required")
        if len(body) > DECODE_ON_LOOP_BYTES:
            return await trio.to_thread.run_sync(decode_body, body, decoder)
        return decode_body(body, decoder)

    async def accepted_stream(self, request: Request, handle: AgentHandle, turn: ChatTurn) -> TurnStream | None:
        """Start ``turn`` streaming and wait until it is accepted, so a refused turn is a real 4xx.

        The turn's own checks (its template and tools, the model's context, the KV budget) then
        answer in the API's error shape before any byte of the response, as the non-streaming
        answer does. A turn still not accepted after :data:`ACCEPT_WAIT_S` (it waits behind the
        agent's earlier turns) is streamed anyway: a later refusal is an error event, and the
        stream's keep-alives start. None when the client left meanwhile (the turn is dropped).

        Raises:
            ApiError: the turn was refused (from :func:`gateway.errors.from_exception`).
        """
        stream = handle.open_stream(turn)
        try:
            with runtime_errors():
                with trio.move_on_after(ACCEPT_WAIT_S):
                    if await self.unless_client_leaves(request, _accepted(stream)) is None:
                        await stream.aclose()
                        return None
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def unless_client_leaves(self, request: Request, call: Callable[[], Awaitable[T]]) -> T | None:
        """``await call()``, cancelled (None) if the client disconnects first.

        For non-streaming turns: cancelling ``handle.send`` closes its reply
        channel, which stops the generation just as a streaming client leaving does.
        """
        result: T | None = None
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:

            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                log.info("request %s: the client left; cancelling", request_id(request))
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_disconnect)
            try:
                result = await call()
            except Exception as exc:  # noqa: BLE001 - raised below, outside the nursery's exception group
                failure = exc
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return result

    def json(self, obj: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(self.encoder.encode(obj), status_code=status, headers=headers,
                        media_type="application/json")
