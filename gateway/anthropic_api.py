"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Usage as Anthropic, llama.cpp and vLLM report it, every prompt token counted
once (the prompt is ``input_tokens + cache_creation_input_tokens +
cache_read_input_tokens``):

* ``input_tokens`` — prompt tokens prefilled this turn (not read from the cache);
* ``cache_read_input_tokens`` — tokens reused from the agent's KV cache;
* ``cache_creation_input_tokens`` — 0: Anthropic counts here the tokens a
  ``cache_control`` breakpoint writes (billed at a premium); kvmem caches every
  turn without breakpoints and at no extra cost, so nothing is counted as a
  cache write (``cache_control`` is accepted and has no effect);
* ``output_tokens`` — tokens generated.

Streaming sends ``message_start`` (once the turn's prefill begins, with its
input, cache-read and creation counts), ``content_block_start``, ``ping``, the
``content_block_delta`` events, ``content_block_stop``, ``message_delta``
(stop reason and the final usage, plus kvmem's own accounting under
``kvmem``) and ``message_stop``. An error after the stream started is an
``error`` event. Tool definitions, ``tool_use`` and ``tool_result`` blocks are
rendered by the model's chat template; a template without tool support is a 400.

Tool calls the model makes come back as ``tool_use`` blocks after the text, with
``stop_reason: "tool_use"``. Streamed, content blocks open as the reply needs them
(in a turn without tools the text block opens at once, as before): each call is a
``content_block_start`` (``tool_use``, empty ``input``), an ``input_json_delta``
with its arguments, and a ``content_block_stop``. ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``) is honoured or refused with a 400 (see ``runtime.reply.tool_calls``).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.client import TurnStream
from actors.messages_agent import ChatMessage, ResponseFormat, ToolCall, ToolChoice
from gateway.context import (
    CLIENT_GONE,
    Gateway,
    durable_of,
    header_safe,
    kvmem_extras,
    kvmem_headers,
    request_id,
    resolve_agent_id,
    tenant_of_request,
)
from gateway.errors import ApiError, error_dict, from_exception, runtime_errors
from gateway.schemas_anthropic import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    ResponseText,
    ResponseToolUse,
    TextBlock,
    Tool,
    ToolChoiceParam,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
    count_tokens_decoder,
    messages_decoder,
)
from gateway.sse import Emit, EventStreamResponse, sse
from runtime.identity import local_id
from runtime.plan.sampling import SamplingOptions
from runtime.reply.reply_format import schema_error

__all__ = ["routes", "to_chat", "tool_choice_of", "usage_of", "stop_reason_of"]

log = logging.getLogger("kvmem.gateway")


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic spells one (``toolu_...``): kvmem names the calls it reads ``call_...``, as OpenAI
    does; an id the model wrote itself is kept as it is."""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def _join_text(blocks: list[TextBlock | ImageBlock], where: str) -> str:
    parts = []
    for i, block in enumerate(blocks):
        if isinstance(block, ImageBlock):
            raise ApiError(400, "invalid_request", f"{where}[{i}]: image content is not supported by kvmem",
                           param=f"{where}[{i}]")
        parts.append(block.text)
    return "\n".join(parts)


def _message(i: int, m: MessageParam) -> list[ChatMessage]:
    """One Anthropic message as chat messages: tool results become ``tool`` messages."""
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    where = f"messages[{i}].content"
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    for j, block in enumerate(m.content):
        at = f"{where}[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            raise ApiError(400, "invalid_request", f"{at}: image content is not supported by kvmem", param=at)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise ApiError(400, "invalid_request", f"{at}: tool_use blocks belong in assistant messages", param=at)
            tool_calls.append({"id": block.id, "type": "function",
                               "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise ApiError(400, "invalid_request", f"{at}: tool_result blocks belong in user messages", param=at)
            content = block.content if isinstance(block.content, str) else _join_text(block.content, f"{at}.content")
            if block.is_error:
                content = f"Error: {content}"
            results.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=content))
    if m.role == "assistant":
        return [ChatMessage(role="assistant", content="\n".join(texts), tool_calls=tuple(tool_calls) or None)]
    if texts or not results:
        results.append(ChatMessage(role="user", content="\n".join(texts)))
    return results


def _tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise ApiError(400, "invalid_request", f"tools[{k}]: server tool {tool.type!r} is not supported by kvmem",
                           param=f"tools[{k}].type")
        if tool.input_schema is None:
            raise ApiError(400, "invalid_request", f"tools[{k}].input_schema: Field required",
                           param=f"tools[{k}].input_schema")
        if error := schema_error(tool.input_schema):
            raise ApiError(400, "invalid_request", f"tools[{k}].input_schema: {error}",
                           param=f"tools[{k}].input_schema")
        out.append({"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                     "parameters": tool.input_schema}})
    return out


def to_chat(req: MessagesRequest | CountTokensRequest) -> tuple[str | None, list[ChatMessage], list[dict[str, Any]] | None]:
    """The system prompt, the chat messages and the tool definitions of a request."""
    system = req.system if req.system is None or isinstance(req.system, str) else _join_text(
        list(req.system), "system")
    # A last assistant message is a prefill: the reply continues it (runtime.model.loaded.is_prefill).
    chat = [c for i, m in enumerate(req.messages) for c in _message(i, m)]
    return system, chat, _tools(req.tools)


def response_format_of(req: MessagesRequest) -> ResponseFormat | None:
    """The request's structured output format (``output_config.format``, or the beta's ``output_format``)."""
    spec = req.output_config.format if req.output_config is not None else None
    spec, param = (spec, "output_config.format.schema") if spec is not None else (req.output_format,
                                                                                 "output_format.schema")
    if spec is None:
        return None
    if error := schema_error(spec.schema):
        raise ApiError(400, "invalid_request", f"{param}: {error}", param=param)
    return ResponseFormat(schema=spec.schema)


def tool_choice_of(choice: ToolChoiceParam | None) -> ToolChoice:
    """Anthropic's ``tool_choice`` in kvmem's shape (``any`` is ``required``; ``tool`` names the function)."""
    if choice is None or choice.type == "auto":
        return ToolChoice()
    if choice.type == "tool":
        if choice.name is None:
            raise ApiError(400, "invalid_request", "tool_choice.name: Field required for type 'tool'",
                           param="tool_choice.name")
        return ToolChoice(mode="required", name=choice.name)
    return ToolChoice(mode="required" if choice.type == "any" else "none")


def _content(result: Any) -> list[ResponseText | ResponseToolUse]:
    """A result's content blocks: its text (none when it is empty and tools were called), then its tool calls."""
    blocks: list[ResponseText | ResponseToolUse] = []
    if result.content or not result.tool_calls:
        blocks.append(ResponseText(type="text", text=result.content))
    blocks += [ResponseToolUse(type="tool_use", id=tool_use_id(c.id), name=c.name, input=c.input())
               for c in result.tool_calls]
    return blocks


class _Blocks:
    """A streamed message's content blocks, opened in order as the reply needs them."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._index = -1
        self._open: str | None = None  # the type of the block that is open

    async def text(self, delta: str) -> None:
        if self._open != "text":
            await self._start({"type": "text", "text": ""})
        if delta:
            await self._emit(sse("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                         "delta": {"type": "text_delta", "text": delta}}))

    async def tool_use(self, call: ToolCall) -> None:
        await self._start({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}})
        await self._emit(sse("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                     "delta": {"type": "input_json_delta",
                                                               "partial_json": call.arguments}}))
        await self._stop()

    async def finish(self) -> None:
        """Close the open block; a message that had none gets an empty text block."""
        if self._index < 0:
            await self.text("")
        await self._stop()

    async def _start(self, block: dict[str, Any]) -> None:
        await self._stop()
        self._index += 1
        self._open = block["type"]
        await self._emit(sse("content_block_start", {"type": "content_block_start", "index": self._index,
                                                     "content_block": block}))

    async def _stop(self) -> None:
        if self._open is not None:
            self._open = None
            await self._emit(sse("content_block_stop", {"type": "content_block_stop", "index": self._index}))


def _usage(*, prefilled: int, reused: int, generated: int) -> Usage:
    """Anthropic usage (see the module docstring): nothing is ever counted as a cache write."""
    return Usage(input_tokens=prefilled, output_tokens=generated, cache_creation_input_tokens=0,
                 cache_read_input_tokens=reused)


def usage_of(result: Any) -> Usage:
    """Anthropic usage of a :class:`TurnResult`."""
    u = result.usage
    return _usage(prefilled=u.tokens_prefilled, reused=u.tokens_reused, generated=u.tokens_generated)


def stop_reason_of(result: Any) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def routes(gw: Gateway) -> list[Route]:
    """The Anthropic routes, bound to ``gw``."""

    async def create_message(request: Request) -> Response | EventStreamResponse:
        req = await gw.decode(request, messages_decoder)
        gw.check_max_tokens(req.max_tokens, param="max_tokens")
        model = gw.model_for(req.model)
        system, chat, tools = to_chat(req)
        tool_choice = tool_choice_of(req.tool_choice)
        ref = resolve_agent_id(
            request.headers,
            user_field=req.metadata.user_id if req.metadata else None,
            user_param="metadata.user_id",
            system=system,
            messages=chat,
        )
        tenant = tenant_of_request(request)
        handle = gw.agent(ref.agent_id, param=ref.param, tenant=tenant)
        with runtime_errors():
            turn = handle.turn(
                messages=chat,
                system=system,
                tools=tools,
                tool_choice=tool_choice,
                response_format=response_format_of(req),
                parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
                model=model,
                sampling=SamplingOptions.of_request(  # by name, but Anthropic's default temperature and stops
                    req, temperature=1.0 if req.temperature is None else req.temperature,
                    stop=req.stop_sequences or ()),
                durable=durable_of(request.headers),
            )
            await gw.admit(handle, tenant)  # the tenant's limits: agents, disk
        if not req.stream:
            with runtime_errors():
                result = await gw.unless_client_leaves(request, lambda: handle.run(turn))
            if result is None:
                return Response(status_code=CLIENT_GONE)
            body = MessageResponse(
                id=_message_id(), type="message", role="assistant", model=result.model,
                content=_content(result),
                stop_reason=stop_reason_of(result), stop_sequence=result.stop_sequence, usage=usage_of(result),
            )
            return gw.json(body, headers=kvmem_headers(result))
        # A turn its template, the model's context or the KV budget refuses: a 4xx now, not an error event.
        stream = await gw.accepted_stream(request, handle, turn)
        if stream is None:
            return Response(status_code=CLIENT_GONE)
        rid = request_id(request)
        message_id = _message_id()
        model_name = model or gw.default_model

        async def start(stream: TurnStream, emit: Emit, blocks: _Blocks) -> None:
            started = await stream.start_info()  # the queue wait: nothing to say before it
            usage = _usage(prefilled=started.tokens_prefilled if started else 0,
                           reused=started.tokens_reused if started else 0, generated=0)
            message = {"id": message_id, "type": "message", "role": "assistant", "model": model_name, "content": [],
                       "stop_reason": None, "stop_sequence": None, "usage": usage}
            await emit(sse("message_start", {"type": "message_start", "message": message}))
            if not tools:  # no tool calls can come: the text block opens now
                await blocks.text("")
            await emit(sse("ping", {"type": "ping"}))

        async def produce(emit: Emit) -> None:
            blocks = _Blocks(emit)
            try:
                async with stream:
                    await start(stream, emit, blocks)
                    async for item in stream.events():
                        await (blocks.text(item) if isinstance(item, str) else blocks.tool_use(item))
            except Exception as exc:  # noqa: BLE001 - the stream has started: report it in the stream
                error = from_exception(exc)
                log.warning("stream %s failed: %s", rid, error.message)
                await emit(sse("error", error_dict(error, "anthropic", request_id=rid)))
                return
            result = stream.result
            assert result is not None
            await blocks.finish()
            await emit(sse("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason_of(result), "stop_sequence": result.stop_sequence},
                "usage": usage_of(result),
                "kvmem": kvmem_extras(result),
            }))
            await emit(sse("message_stop", {"type": "message_stop"}))

        headers = {"x-kvmem-agent-id": header_safe(local_id(handle.agent_id))}
        return EventStreamResponse(produce, headers=headers)

    async def count_tokens(request: Request) -> Response:
        req = await gw.decode(request, count_tokens_decoder)
        model = gw.model_for(req.model)
        system, chat, tools = to_chat(req)
        with runtime_errors():
            n = await gw.rt.count_tokens(chat, system=system, tools=tools, tool_choice=tool_choice_of(req.tool_choice),
                                         model=model)
        return gw.json({"input_tokens": n})

    return [
        Route("/v1/messages", create_message, methods=["POST"], name="anthropic_messages"),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"], name="anthropic_count_tokens"),
    ]
