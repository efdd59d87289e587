"""The Starlette app: Anthropic, OpenAI and agent routes over one kvmem runtime.

``create_app(rt, settings)`` builds it; :mod:`gateway.server` serves it with
hypercorn on trio. Other features add their routes with ``extra_routes``
(they share the middleware: request ids, the API key, error bodies, metrics).

Routes::

    POST   /v1/messages                 Anthropic Messages (SSE with stream=true)
    POST   /v1/messages/count_tokens    Anthropic token counting
    POST   /v1/chat/completions         OpenAI Chat Completions (SSE with stream=true)
    GET    /v1/models, /v1/models/{id}  the served models (OpenAI and Anthropic fields)
    GET    /v1/agents                   agents with a cache or a running actor
    GET    /v1/agents/{id}              one agent
    DELETE /v1/agents/{id}              forget an agent's cache
    POST   /v1/agents/{id}/messages     one turn of an agent (SSE with stream=true)
    GET    /v1/status                   live figures, memory picture, batch now (gateway.status_api)
    GET    /v1/status/agents            every agent: tier, bytes in RAM and on disk, last turn
    GET    /healthz                     liveness (never needs the API key)
    GET    /metrics                     Prometheus text
    GET    /openapi.json                OpenAPI 3.1 of all of the above
    GET    /ui/                         the operator page (gateway.ui_routes; its files need no key)

With ``api_keys`` (tenants, :mod:`gateway.tenants`) the key names a tenant: the
middleware keeps it in the scope (:func:`gateway.context.tenant_of_request`), counts
the request against the tenant's rate, and keeps ``/metrics`` and scenarios to
operator tenants; routes name agents in the tenant's namespace.

Every response carries a ``request-id`` header. Errors use the shape of the API
the path belongs to (:mod:`gateway.errors`), also for unknown routes, a
missing API key and bodies over the size limit.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import agents_api, anthropic_api, openai_api, status_api
from gateway.cli_common import kvmem_version
from gateway.context import AGENT_SEGMENT_KEY, REQUEST_ID_KEY, TENANT_KEY, Gateway, request_id
from gateway.errors import ApiError, error_body, flavor_of, from_exception
from gateway.metrics import CONTENT_TYPE, render_metrics
from gateway.openapi import openapi_document
from gateway.tenants import OPERATOR_PATHS, TenantKeys, load_tenant_keys, retry_after
from gateway.ui_routes import is_public_ui_path, ui_routes
from runtime.config import Config

if TYPE_CHECKING:
    from actors.supervisor import Runtime

__all__ = ["create_app", "GATEWAY_KEY"]

log = logging.getLogger("kvmem.gateway")

GATEWAY_KEY = "kvmem_gateway"
"""``app.state`` attribute holding the :class:`gateway.context.Gateway` (for extra routes)."""


def _error_response(error: ApiError, scope: Scope) -> Response:
    rid = str(scope.get(REQUEST_ID_KEY, ""))
    headers = {"x-should-retry": "false"} if error.status < 500 else None
    if error.retry_after_s is not None:
        headers = {"retry-after": str(error.retry_after_s), "x-should-retry": "true"}
    return Response(error_body(error, flavor_of(scope["path"]), request_id=rid), status_code=error.status,
                    headers=headers, media_type="application/json")


def _given_key(scope: Scope) -> str | None:
    given = None
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            given = value.decode("latin-1")
        elif name == b"authorization" and given is None:
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                given = token.strip()
    return given


def _authorized(scope: Scope, api_key: str) -> bool:
    given = _given_key(scope)
    return given is not None and secrets.compare_digest(given.encode(), api_key.encode())


_UNAUTHORIZED = ApiError(401, "authentication", "invalid or missing API key (x-api-key or Authorization: Bearer)",
                         code="invalid_api_key")


def _tenant_refusal(scope: Scope, keys: TenantKeys) -> ApiError | None:
    """Who the key names (kept in the scope), or why the request stops here: 401, 403, 429."""
    tenant = keys.resolve(_given_key(scope))
    if tenant is None:
        return _UNAUTHORIZED
    scope[TENANT_KEY] = tenant
    if scope["path"].startswith(OPERATOR_PATHS) and not tenant.operator:
        return ApiError(403, "permission", f"{scope['path']} is for operators: tenant {tenant.name!r} is not one",
                        code="operator_only")
    wait = tenant.take_request()
    if wait is not None:
        return ApiError(429, "rate_limit", f"tenant {tenant.name!r} is over its limit of "
                        f"{tenant.limits.requests_per_minute} requests per minute", code="tenant_rate_limit",
                        retry_after_s=retry_after(wait))
    return None


AGENT_PATH = "/v1/agents/"


def keep_agent_id_encoded(scope: Scope) -> None:
    """Route an agent path with its id segment as the client percent-encoded it.

    The server decodes the path before routing, so an id holding ``/`` (``team%2Falice``,
    which ``user`` and ``X-Agent-ID`` accept) would read as two segments and match no route,
    and an id of ``/`` would be redirected. Routing on the raw segment (ASGI's ``raw_path``)
    lets every id a client can create be read, continued and forgotten by URL; the route
    decodes it (:func:`gateway.context.decode_agent_id`, strict UTF-8). Marks the scope
    (:data:`gateway.context.AGENT_SEGMENT_KEY`) so the route knows its segment is still encoded.
    """
    raw = scope.get("raw_path")
    if not raw or not scope["path"].startswith(AGENT_PATH):
        return
    raw = raw.partition(b"?")[0]
    prefix = AGENT_PATH.encode()
    if not raw.startswith(prefix):
        return
    segment, slash, rest = raw[len(prefix):].partition(b"/")
    # Latin-1 keeps every byte as one character: a segment that is not UTF-8 reaches the route, which refuses it.
    scope["path"] = AGENT_PATH + segment.decode("latin-1") + slash.decode() + unquote(rest.decode("latin-1"))
    scope[AGENT_SEGMENT_KEY] = True


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Starlette's CORS middleware for ``origins`` (none when unset), outside the API key's check: a
    browser's preflight carries no key. Every response header is exposed (request ids, kvmem's
    ``x-kvmem-*`` accounting): requests carry keys in headers, not cookies, so no credentials mode."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"],
                       expose_headers=["*"])]


class GatewayMiddleware:
    """Request ids, the API key check, keep-alive safety and the per-route response counters.

    A response sent before the request body was read to its end (a 401, a 413 that
    stopped reading, a 400 or 404 decided before the body) says ``Connection: close``:
    the server cannot read the next request on that connection, and a keep-alive
    client that reused it would see it dropped.
    """

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = "req_" + secrets.token_hex(12)
        scope[REQUEST_ID_KEY] = rid
        keep_agent_id_encoded(scope)
        status = 500
        body_read = not _has_body(scope)

        async def receive_tracked() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read = True
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"request-id", rid.encode())]
                if not body_read and not any(name.lower() == b"connection" for name, _ in headers):
                    headers.append((b"connection", b"close"))
                message["headers"] = headers
            await send(message)

        api_key, keys = self.gateway.config.api_key, self.gateway.tenants
        try:
            error = None
            if scope["path"] == "/healthz" or is_public_ui_path(scope["path"]):
                pass  # liveness, and the operator page's static files (no data: its data needs the key)
            elif keys is not None:
                error = _tenant_refusal(scope, keys)
            elif api_key and not _authorized(scope, api_key):
                error = _UNAUTHORIZED
            if error is not None:
                await _error_response(error, scope)(scope, receive_tracked, send_with_id)  # body unread: closes
                return
            await self.app(scope, receive_tracked, send_with_id)
        finally:
            route = scope.get("route")
            label = route.path if isinstance(route, Route) else "unmatched"
            self.gateway.http_requests[(label, scope["method"], status)] += 1


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc, request.scope)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = ApiError(404, "not_found", f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = ApiError(405, "invalid_request", f"method {request.method} is not allowed on {request.url.path}")
    else:
        error = ApiError(exc.status_code, "invalid_request" if exc.status_code < 500 else "api_error", exc.detail)
    response = _error_response(error, request.scope)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _on_disconnect(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(400, "invalid_request", "the client left while sending the body"), request.scope)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    if isinstance(exc, RecursionError):  # the request's own nesting (gateway.json_depth bounds the body's)
        log.info("request %s: nested too deeply to be read", request_id(request))
        return _error_response(from_exception(exc), request.scope)
    log.error("request %s failed", request_id(request), exc_info=exc)
    error = ApiError(500, "api_error", f"internal error: {type(exc).__name__}")
    return _error_response(error, request.scope)


def create_app(
    rt: Runtime, settings: Config, *, extra_routes: Sequence[BaseRoute] = (), tenants: TenantKeys | None = None
) -> Starlette:
    """The HTTP app over ``rt``.

    Args:
        rt: an open runtime (``actors.open_runtime``); the app only calls its public API.
        settings: limits, the API key or key file, and the model names (``settings.model`` first).
        extra_routes: more routes (e.g. scenarios); ``request.app.state.kvmem_gateway`` is the
            shared :class:`gateway.context.Gateway`.
        tenants: the key file, loaded (default: read from ``settings.api_keys`` when set).

    Raises:
        runtime.config.ConfigError: the key file cannot be used.
    """
    models = tuple(dict.fromkeys([settings.model, *settings.models]))
    if tenants is None and settings.api_keys is not None:
        tenants = load_tenant_keys(settings.api_keys)
    gw = Gateway(rt=rt, config=settings, models=models, tenants=tenants)
    version = kvmem_version()

    async def healthz(request: Request) -> Response:
        stats = rt.stats()
        reg, remote = stats.registry, stats.store.remote
        body: dict[str, Any] = {
            "status": "ok", "model": reg.model, "default_model": reg.default_model, "models": list(gw.models),
            "uptime_s": round(time.time() - gw.started_at, 3), "version": version,
        }
        if reg.profile is not None:  # every CPU-versus-GPU decision the loaded model runs under
            body["profile"] = msgspec.to_builtins(reg.profile)
        if remote is not None:  # Redis down is a degraded mode, not an outage: still 200
            body["store"] = {"url": remote.url, "up": remote.up, "unpublished": remote.unpublished}
            if not remote.up:
                body["status"] = "degraded"
        return gw.json(body)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(rt.stats(), gw.http_requests), media_type=CONTENT_TYPE)

    async def openapi(request: Request) -> Response:
        return gw.json(openapi_document(request.app.routes, version=version))

    routes: list[BaseRoute] = [
        *anthropic_api.routes(gw),
        *openai_api.routes(gw),
        *agents_api.routes(gw),
        *status_api.routes(gw, version=version),
        Route("/healthz", healthz, methods=["GET"], name="healthz"),
        Route("/metrics", metrics, methods=["GET"], name="metrics"),
        Route("/openapi.json", openapi, methods=["GET"], name="openapi"),
        *extra_routes,
        *ui_routes(),
    ]
    app = Starlette(
        routes=routes,
        middleware=[*_cors(settings.cors_origins), Middleware(GatewayMiddleware, gateway=gw)],
        exception_handlers={
            ApiError: _on_api_error,
            HTTPException: _on_http_exception,
            ClientDisconnect: _on_disconnect,
            Exception: _on_unexpected,
        },
    )
    setattr(app.state, GATEWAY_KEY, gw)
    return app
