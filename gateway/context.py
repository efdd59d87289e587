"""What every route handler shares: the :class:`Gateway` (runtime, settings, models) and its request helpers.

Routes are thin: read the body (bounded), decode it with a prebuilt msgspec
decoder, check limits, the model name and the agent id, call the in-process
runtime API (giving up when the client leaves), and encode the answer.
Response headers live in :mod:`gateway.headers`, error mapping in
:mod:`gateway.errors`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import ApiError, from_decode_error
from runtime.config import Config
from runtime.errors import InvalidAgentIdError

if TYPE_CHECKING:
    from actors.client import AgentHandle
    from actors.supervisor import Runtime

__all__ = ["Gateway", "CLIENT_GONE"]

DRAIN_BYTES = 64 * 2**20
"""How much of an oversize body is read (and dropped) so that the client sees the 413."""

T = TypeVar("T")

log = logging.getLogger("kvmem.gateway")

CLIENT_GONE = 499
"""Status logged for a request whose client left before the answer (nginx's convention; never seen by anyone)."""


@dataclass
class Gateway:
    """Shared state of the HTTP app.

    Attributes:
        rt: the running kvmem runtime.
        config: the server's settings.
        models: the model names requests may use (the default first).
        http_requests: responses by (route, method, status), for ``/metrics``.
    """

    rt: Runtime
    config: Config
    models: tuple[str, ...]
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

    def agent(self, agent_id: str, *, param: str = "agent_id", share_prefix: bool = True) -> AgentHandle:
        """The runtime's handle on ``agent_id`` (where ids are checked, once).

        Raises:
            ApiError: 400 naming ``param`` (the header or field the id came from)
                when the id cannot name a cache.
        """
        try:
            return self.rt.agent(agent_id, share_prefix=share_prefix)
        except InvalidAgentIdError as exc:
            raise ApiError(400, "invalid_request", f"invalid agent id in {param}: {exc}", param=param,
                           code="invalid_agent_id") from None

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
        """
        limit = self.config.max_body_bytes
        too_large = ApiError(413, "request_too_large", f"request body is larger than {limit} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                chunks.clear()
                if size > DRAIN_BYTES:
                    break
                continue
            chunks.append(chunk)
        if size > limit:
            raise too_large
        return b"".join(chunks)

    async def decode(self, request: Request, decoder: msgspec.json.Decoder[T]) -> T:
        """Read and decode a JSON body; malformed JSON or a schema violation is a 400."""
        body = await self.read_body(request)
        if not body.strip():
            raise ApiError(400, "invalid_request", "the request body is empty; a JSON object is required")
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc) from None
        except UnicodeDecodeError as exc:  # msgspec raises it for bytes that are not UTF-8 inside a string
            raise ApiError(400, "invalid_request", f"the request body is not valid UTF-8 ({exc.reason} at byte "
                           f"{exc.start})", code="invalid_json") from None

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
