"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the app serves.

Request bodies are described by the same msgspec types that decode them
(``msgspec.json.schema_components``), so the document cannot drift from the
validation. Routes added through ``create_app(extra_routes=...)`` appear too,
described by their endpoint's docstring.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.routing import BaseRoute, Route

from gateway.schemas_agents import AgentTurnRequest
from gateway.schemas_anthropic import CountTokensRequest, MessagesRequest
from gateway.schemas_openai import ChatCompletionRequest

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{name}"

# route name -> (tag, summary, request body type)
_KNOWN: dict[str, tuple[str, str, type | None]] = {
    "anthropic_messages": ("anthropic", "Create a message (Anthropic Messages API; SSE with stream=true)",
                           MessagesRequest),
    "anthropic_count_tokens": ("anthropic", "Count the prompt tokens of a message request", CountTokensRequest),
    "openai_chat_completions": ("openai", "Create a chat completion (OpenAI; SSE with stream=true)",
                                ChatCompletionRequest),
    "models": ("openai", "List the models this server serves", None),
    "model": ("openai", "One model", None),
    "agents": ("agents", "List agents with a cache or a running actor", None),
    "agent": ("agents", "One agent: its cache (hot, on disk) and whether it runs", None),
    "agent_delete": ("agents", "Forget an agent's cache (RAM and disk)", None),
    "agent_messages": ("agents", "Run one turn of an agent (SSE with stream=true)", AgentTurnRequest),
    "healthz": ("ops", "Liveness and the loaded model", None),
    "metrics": ("ops", "Prometheus metrics", None),
    "openapi": ("ops", "This document", None),
}

_ERROR = {"description": "Error in the API's own error shape",
          "content": {"application/json": {"schema": {"type": "object"}}}}


def _operation(route: Route, method: str, components: dict[str, Any]) -> dict[str, Any]:
    tag, summary, body = _KNOWN.get(route.name, ("extra", "", None))
    if not summary:
        summary = (inspect.getdoc(route.endpoint) or route.name or route.path).splitlines()[0]
    op: dict[str, Any] = {
        "operationId": f"{route.name}_{method.lower()}",
        "summary": summary,
        "tags": [tag],
        "responses": {"200": {"description": "OK"}, "4XX": _ERROR, "5XX": _ERROR},
    }
    params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in route.param_convertors]
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": {"$ref": _REF.format(name=body.__name__)}}}}
    return op


def openapi_document(routes: Sequence[BaseRoute], *, version: str) -> dict[str, Any]:
    """The OpenAPI document for ``routes``."""
    bodies = [t for _, _, t in _KNOWN.values() if t is not None]
    _, components = msgspec.json.schema_components(bodies, ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(route.path, {})[method.lower()] = _operation(route, method, components)
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvmem", "version": version,
                 "description": "Persistent per-agent Q4 KV caches behind Anthropic, OpenAI and agent APIs."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                                "bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
