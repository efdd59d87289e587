"""kvmem's own agent API: the in-process runtime API over HTTP.

::

    GET    /v1/agents                 agents with a cache (hot tier or disk) or a running actor
    GET    /v1/agents/{id}            one agent, 404 when kvmem knows nothing of it
    DELETE /v1/agents/{id}            forget its caches (RAM and disk), 404 when there was none
    POST   /v1/agents/{id}/messages   one turn; the body is :class:`AgentTurnRequest`

The id in the path is percent-encoded UTF-8; a path that is not (``%FF``, an
encoded surrogate, a ``%`` that begins no escape) is a 400 ``invalid_agent_id``.

An agent keeps one cache per model; it is listed once, with the cache it used last.

A turn answers with the runtime's ``TurnResult`` as JSON: the reply, the
finish reason, and ``usage`` with ``tokens_reused`` / ``tokens_prefilled`` /
``tokens_generated``, the cache ``tier`` (hot, warm, remote, shared, cold), the prefix
``match``, ``queue_wait_ms``, ``ttft_ms`` and ``decode_tps``. Streaming
(``"stream": true``) sends ``event: delta`` (``{"text": ...}``) events, an
``event: tool_call`` (``{"id", "name", "arguments"}``) for each tool call once the
model has written it, and one ``event: done`` with the ``TurnResult`` (or
``event: error``). A result's ``reply`` is the text as generated; ``content`` is
that without its tool calls, which are in ``tool_calls``.

With tenants (:mod:`gateway.tenants`) every route sees the request's tenant's
agents only: ids are the tenant's own, a listing holds its agents alone, and an
agent of another tenant of the same id is another agent (404 when it has no cache here).
"""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.client import AgentHandle
from actors.messages_agent import ChatMessage, ChatTurn
from actors.messages_store import AgentRecord
from actors.metrics import RunningTurn
from gateway.context import (
    AGENT_SEGMENT_KEY,
    CLIENT_GONE,
    Gateway,
    decode_agent_id,
    durable_of,
    header_safe,
    kvmem_headers,
    public_result,
    request_id,
    tenant_of_request,
)
from gateway.errors import DISK_CODES, ApiError, error_dict, from_exception, runtime_errors
from gateway.openai_api import response_format_of
from gateway.schemas_agents import (
    AgentInfo,
    AgentList,
    AgentTurnRequest,
    Deleted,
    TurnDelta,
    turn_decoder,
)
from gateway.sse import Emit, EventStreamResponse, sse
from runtime.identity import local_id, tenant_of
from runtime.plan.sampling import SamplingOptions

__all__ = ["routes"]

log = logging.getLogger("kvmem.gateway")


def _info(agent_id: str, record: AgentRecord | None, live: bool, turn: RunningTurn | None = None) -> AgentInfo:
    agent_id = local_id(agent_id)  # as its tenant knows it
    if turn is not None:
        turn = msgspec.structs.replace(turn, agent_id=agent_id)
    if record is None:
        return AgentInfo(id=agent_id, object="agent", model_tag=None, cached_tokens=0, hot=False, on_disk=False,
                         dirty=False, disk_bytes=0, updated_at=None, live=live, turn=turn)
    return AgentInfo(id=agent_id, object="agent", model_tag=record.model_tag, cached_tokens=record.num_tokens,
                     hot=record.hot, on_disk=record.on_disk, dirty=record.dirty, disk_bytes=record.disk_bytes,
                     updated_at=record.updated_at, live=live, turn=turn, remote=record.remote)


def _max_tokens(gw: Gateway, req: AgentTurnRequest) -> int:
    if req.max_tokens is None:
        return min(gw.config.default_max_tokens, gw.config.max_tokens_limit)
    return gw.check_max_tokens(req.max_tokens, param="max_tokens")


def routes(gw: Gateway) -> list[Route]:
    """The agent routes, bound to ``gw``."""

    def agent_of(request: Request) -> AgentHandle:
        # checks the id, and names it in the request's tenant
        agent_id = request.path_params["agent_id"]
        if request.scope.get(AGENT_SEGMENT_KEY):
            # Routed on the segment as sent (gateway.app.keep_agent_id_encoded): decoded here, strictly, so
            # %FF%FE and %FE%FF (both U+FFFD U+FFFD to a lenient decoder) are refused, not one agent.
            agent_id = decode_agent_id(agent_id.encode("latin-1"), param="agent_id")
        return gw.agent(agent_id, tenant=tenant_of_request(request))

    async def list_agents(request: Request) -> Response:
        tenant = tenant_of_request(request)
        name = tenant.name if tenant else None
        with runtime_errors():
            records: dict[str, AgentRecord] = {}
            for record in await gw.rt.list_agents(tenant=name):  # one per model; an agent's first is its latest
                records.setdefault(record.agent_id, record)
        live = {a for a in gw.rt.live_agents() if tenant_of(a) == name}
        data = [_info(a, records.get(a), a in live) for a in sorted(records.keys() | live)]
        return gw.json(AgentList(object="list", data=data))

    async def get_agent(request: Request) -> Response:
        agent_id = agent_of(request).agent_id
        with runtime_errors():
            records = await gw.rt.list_agents(agent_id)
        live = agent_id in gw.rt.live_agents()
        if not records and not live:
            raise ApiError(404, "not_found", f"agent {local_id(agent_id)!r} not found", param="agent_id")
        turn = next((t for t in gw.rt.running_turns() if t.agent_id == agent_id), None)
        return gw.json(_info(agent_id, records[0] if records else None, live, turn))

    async def delete_agent(request: Request) -> Response:
        handle = agent_of(request)
        agent_id = handle.agent_id
        try:
            with runtime_errors():
                existed = await handle.forget()
        except ApiError as exc:
            if exc.code in DISK_CODES:  # its RAM copy is gone, its files are not: say so, they come back
                raise ApiError(exc.status, exc.kind, f"agent {local_id(agent_id)!r} was not forgotten: its cache on "
                               f"disk could not be deleted and is read again after a restart; {exc.message}",
                               code=exc.code, param="agent_id") from None
            raise
        if not existed:
            raise ApiError(404, "not_found", f"agent {local_id(agent_id)!r} has no cache", param="agent_id")
        return gw.json(Deleted(id=local_id(agent_id), object="agent", deleted=True))

    async def post_message(request: Request) -> Response | EventStreamResponse:
        handle = agent_of(request)
        req = await gw.decode(request, turn_decoder)
        if (req.messages is None) == (req.prompt is None):
            raise ApiError(400, "invalid_request", "give exactly one of 'messages' and 'prompt'", param="messages")
        if req.messages is not None and not req.messages:
            raise ApiError(400, "invalid_request", "'messages' is empty", param="messages")
        if req.prompt is not None and (req.tools or req.system is not None):
            raise ApiError(400, "invalid_request", "'system' and 'tools' need 'messages', not 'prompt'",
                           param="prompt")
        max_tokens = _max_tokens(gw, req)
        with runtime_errors():
            turn = ChatTurn.of(
                handle.agent_id,
                share_prefix=req.share_prefix,
                # the one form a conversation keeps until the template renders it
                messages=[msgspec.convert(m, ChatMessage, from_attributes=True) for m in req.messages]
                if req.messages is not None else None,
                prompt=req.prompt,
                system=req.system,
                tools=req.tools,
                tool_choice=msgspec.to_builtins(req.tool_choice),
                response_format=response_format_of(req.response_format),
                model=gw.model_for(req.model),
                sampling=SamplingOptions.of_request(req, max_tokens=max_tokens, fit_context=req.max_tokens is None),
                durable=durable_of(request.headers),
            )
            await gw.admit(handle, tenant_of_request(request))  # the tenant's limits: agents, disk
        if not req.stream:
            with runtime_errors():
                result = await gw.unless_client_leaves(request, lambda: handle.run(turn))
            if result is None:
                return Response(status_code=CLIENT_GONE)
            return gw.json(public_result(result), headers=kvmem_headers(result))
        # A turn its template, the model's context or the KV budget refuses: a 4xx now, not an error event.
        stream = await gw.accepted_stream(request, handle, turn)
        if stream is None:
            return Response(status_code=CLIENT_GONE)
        rid = request_id(request)

        async def produce(emit: Emit) -> None:
            try:
                async with stream:
                    async for item in stream.events():
                        event = sse("delta", TurnDelta(text=item)) if isinstance(item, str) else sse("tool_call", item)
                        await emit(event)
            except Exception as exc:  # noqa: BLE001 - the stream has started: report it in the stream
                error = from_exception(exc)
                log.warning("stream %s failed: %s", rid, error.message)
                await emit(sse("error", error_dict(error, "kvmem", request_id=rid)))
                return
            await emit(sse("done", stream.result and public_result(stream.result)))

        return EventStreamResponse(produce, headers={"x-kvmem-agent-id": header_safe(local_id(handle.agent_id))})

    return [
        Route("/v1/agents", list_agents, methods=["GET"], name="agents"),
        Route("/v1/agents/{agent_id}", get_agent, methods=["GET"], name="agent"),
        Route("/v1/agents/{agent_id}", delete_agent, methods=["DELETE"], name="agent_delete"),
        Route("/v1/agents/{agent_id}/messages", post_message, methods=["POST"], name="agent_messages"),
    ]
