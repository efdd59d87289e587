"""OpenAI Chat Completions: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /v1/models/{id}``.

Tool calls the model makes come back as ``message.tool_calls`` (``content`` then null
when there is no other text) with ``finish_reason: "tool_calls"``; streamed, each call
is a ``delta.tool_calls`` chunk with its ``index``, ``id``, ``type``, ``name`` and empty
``arguments``, then a chunk with the ``arguments``. ``tool_choice`` (``none``,
``auto``, ``required``, a named function) is honoured or refused with a 400 (see
``runtime.reply.tool_calls``); on a model whose template has no tool syntax the calls are
decoded in kvmem's generic format, valid against the function's parameters
(``runtime.reply.generic_tools``). ``response_format`` (``json_object``, ``json_schema``)
makes the reply JSON under the schema's grammar, on every model.

Usage: ``prompt_tokens`` = tokens reused from the agent's cache + tokens
prefilled; ``prompt_tokens_details.cached_tokens`` = the reused ones;
``completion_tokens`` = tokens generated. Streaming sends
``chat.completion.chunk`` objects (the first carries the role, the last the
``finish_reason``), with ``stream_options.include_usage`` one more chunk with
empty ``choices`` and the usage (plus kvmem's own accounting under ``kvmem``),
then ``data: [DONE]``. The model list also carries Anthropic's fields
(``type``, ``display_name``, ``created_at``), so both SDKs can list models.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.messages_agent import ChatMessage, ResponseFormat, ToolCall, ToolChoice, TurnResult
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
from gateway.schemas_openai import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage as RequestMessage,
    Content,
    DeveloperMessage,
    ImageUrlPart,
    JsonObjectFormat,
    JsonSchemaFormat,
    ResponseFormatSpec,
    SystemMessage,
    TextFormat,
    ToolDef,
    ToolMessage,
    UserMessage,
    chat_decoder,
)
from gateway.sse import Emit, EventStreamResponse, sse_data
from runtime.identity import local_id
from runtime.plan.sampling import SamplingOptions
from runtime.reply.logprobs import TokenLogprob
from runtime.reply.reply_format import lark_from_gbnf, schema_error

__all__ = ["routes", "to_chat", "tool_choice_of", "response_format_of", "usage_of", "finish_reason_of"]

log = logging.getLogger("kvmem.gateway")
FINGERPRINT = "kvmem"


def _text(content: Content | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if isinstance(part, ImageUrlPart):
            raise ApiError(400, "invalid_request", f"{where}[{i}]: image content is not supported by kvmem",
                           param=f"{where}[{i}]", code="unsupported_content")
        parts.append(part.text)
    return "\n".join(parts)


def _message(i: int, m: RequestMessage) -> ChatMessage:
    where = f"messages[{i}].content"
    match m:
        case SystemMessage() | DeveloperMessage():
            return ChatMessage(role="system", content=_text(m.content, where))
        case UserMessage():
            return ChatMessage(role="user", content=_text(m.content, where))
        case AssistantMessage():
            calls = tuple(
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls or ())
            return ChatMessage(role="assistant", content=_text(m.content, where), tool_calls=calls or None)
        case ToolMessage():
            return ChatMessage(role="tool", tool_call_id=m.tool_call_id, content=_text(m.content, where))
    raise AssertionError(m)  # pragma: no cover - the union is closed


def _arguments(text: str) -> dict[str, Any] | str:
    """A call's arguments as an object for the chat template (as mlx-lm's server passes them); text if not one."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def tool_choice_of(req: ChatCompletionRequest) -> ToolChoice:
    """The request's ``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function", ...}``."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice.of(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name:
            return ToolChoice(mode="required", name=name)
        raise ApiError(400, "invalid_request", "tool_choice.function.name: a function name is required",
                       param="tool_choice.function.name")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise ApiError(400, "invalid_request", f"tool_choice {kind!r} is not supported by kvmem: give 'none', 'auto', "
                   "'required' or {'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tools(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for i, t in enumerate(tools):
        if t.function.parameters is not None and (error := schema_error(t.function.parameters)):
            raise ApiError(400, "invalid_request", f"tools[{i}].function.parameters: {error}",
                           param=f"tools[{i}].function.parameters")
    return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                               "parameters": t.function.parameters or {}}} for t in tools]


def response_format_of(spec: ResponseFormatSpec | None) -> ResponseFormat | None:
    """A request's ``response_format`` as the engine takes it (None: plain text).

    Raises:
        ApiError: a schema that cannot constrain a reply (400 naming it).
    """
    match spec:
        case JsonObjectFormat(schema=schema):
            if schema is not None and (error := schema_error(schema)):
                raise ApiError(400, "invalid_request", f"response_format.schema: {error}",
                               param="response_format.schema")
            return ResponseFormat(schema=schema)
        case JsonSchemaFormat(json_schema=spec):
            if spec.schema is not None and (error := schema_error(spec.schema)):
                raise ApiError(400, "invalid_request", f"response_format.json_schema.schema: {error}",
                               param="response_format.json_schema.schema")
            return ResponseFormat(schema=spec.schema, name=spec.name)
    return None


def answer_format_of(req: ChatCompletionRequest) -> ResponseFormat | None:
    """What the reply must be: ``response_format``, or llama.cpp's ``json_schema`` or ``grammar`` (GBNF); one of them.

    Raises:
        ApiError: two of them, a schema that cannot constrain a reply, or a grammar that does not convert or
            compile (400 naming the field).
    """
    given = [name for name, value in (("response_format", req.response_format), ("json_schema", req.json_schema),
                                      ("grammar", req.grammar))
             if value is not None and not isinstance(value, TextFormat)]
    if len(given) > 1:
        raise ApiError(400, "invalid_request", f"give one of {' and '.join(given)}: each says what the reply is",
                       param=given[1])
    if req.json_schema is not None:
        if error := schema_error(req.json_schema):
            raise ApiError(400, "invalid_request", f"json_schema: {error}", param="json_schema")
        return ResponseFormat(schema=req.json_schema)
    if req.grammar is not None:
        try:
            return ResponseFormat(grammar=lark_from_gbnf(req.grammar))
        except ValueError as exc:
            raise ApiError(400, "invalid_request", f"grammar (GBNF): {exc}", param="grammar") from None
    return response_format_of(req.response_format)


def to_chat(req: ChatCompletionRequest) -> tuple[list[ChatMessage], list[dict[str, Any]] | None]:
    """The chat messages and tool definitions of a request."""
    return [_message(i, m) for i, m in enumerate(req.messages)], _tools(req.tools)


def usage_of(result: TurnResult) -> dict[str, Any]:
    """OpenAI's usage: the prompt once, the completion tokens of every choice (``n`` > 1: all samples')."""
    u = result.usage
    prompt = u.tokens_reused + u.tokens_prefilled
    generated = u.tokens_generated + sum(s.usage.tokens_generated for s in result.samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": u.tokens_reused},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _choice(index: int, result: TurnResult, *, logprobs: bool) -> dict[str, Any]:
    """One choice of a non-streamed completion: the message, its tool calls, logprobs and finish reason."""
    message: dict[str, Any] = {"role": "assistant", "content": result.content, "refusal": None}
    if result.tool_calls:
        message["tool_calls"] = [_tool_call(call) for call in result.tool_calls]
        message["content"] = result.content or None
    return {"index": index, "message": message, "logprobs": logprobs_of(result.logprobs) if logprobs else None,
            "finish_reason": finish_reason_of(result)}


def logprobs_of(tokens: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """A choice's ``logprobs``: OpenAI's ``content`` list, each token with its ``top_logprobs``."""
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
                         "top_logprobs": [{"token": o.token, "logprob": o.logprob, "bytes": list(o.bytes)}
                                          for o in t.top]}
                        for t in tokens],
            "refusal": None}


def finish_reason_of(result: Any) -> str:
    return result.finish_reason if result.finish_reason in ("length", "tool_calls") else "stop"


def _max_tokens(gw: Gateway, req: ChatCompletionRequest) -> int:
    if req.max_completion_tokens is not None:
        return gw.check_max_tokens(req.max_completion_tokens, param="max_completion_tokens")
    if req.max_tokens is not None:
        return gw.check_max_tokens(req.max_tokens, param="max_tokens")
    return min(gw.config.default_max_tokens, gw.config.max_tokens_limit)


def _model_entry(gw: Gateway, name: str) -> dict[str, Any]:
    created = int(gw.started_at)
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "kvmem",
        "type": "model",
        "display_name": name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
    }


def routes(gw: Gateway) -> list[Route]:
    """The OpenAI routes, bound to ``gw``."""

    async def chat_completions(request: Request) -> Response | EventStreamResponse:
        req = await gw.decode(request, chat_decoder)
        max_tokens = _max_tokens(gw, req)
        model = gw.model_for(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")
        chat, tools = to_chat(req)
        tool_choice = tool_choice_of(req)
        system = chat[0].content if chat[0].role == "system" else None
        ref = resolve_agent_id(request.headers, user_field=req.user, user_param="user", system=system,
                               messages=chat)
        tenant = tenant_of_request(request)
        handle = gw.agent(ref.agent_id, param=ref.param, tenant=tenant)
        with runtime_errors():
            turn = handle.turn(
                messages=chat,
                tools=tools,
                tool_choice=tool_choice,
                response_format=answer_format_of(req),
                parallel_tool_calls=req.parallel_tool_calls is not False,
                model=model,
                # The options OpenAI spells as kvmem does come by name; these are OpenAI's own.
                sampling=SamplingOptions.of_request(
                    req, max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                    logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                    fit_context=req.max_tokens is None and req.max_completion_tokens is None),
                n=req.n or 1,
                durable=durable_of(request.headers),
            )
            await gw.admit(handle, tenant)  # the tenant's limits: agents, disk
        completion_id = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        if not req.stream:
            with runtime_errors():
                result = await gw.unless_client_leaves(request, lambda: handle.run(turn))
            if result is None:
                return Response(status_code=CLIENT_GONE)
            body = {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": result.model,
                "system_fingerprint": FINGERPRINT,
                "choices": [_choice(index, sample, logprobs=bool(req.logprobs))
                            for index, sample in enumerate((result, *result.samples))],
                "usage": usage_of(result),
            }
            return gw.json(body, headers=kvmem_headers(result))
        # A turn its template, the model's context or the KV budget refuses: a 4xx now, not an error chunk.
        stream = await gw.accepted_stream(request, handle, turn)
        if stream is None:
            return Response(status_code=CLIENT_GONE)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        rid = request_id(request)
        model_name = model or gw.default_model

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model_name, "system_fingerprint": FINGERPRINT, "choices": choices}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return sse_data(body)

        def choice(index: int, delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
            scores = stream.take_logprobs(index)
            return [{"index": index, "delta": delta, "logprobs": logprobs_of(scores) if scores else None,
                     "finish_reason": finish}]

        choices = req.n or 1

        async def produce(emit: Emit) -> None:
            for index in range(choices):
                await emit(chunk(choice(index, {"role": "assistant", "content": ""})))
            calls = [0] * choices  # each choice's tool calls so far
            try:
                async with stream:
                    async for index, item in stream.choices():
                        if isinstance(item, str):
                            await emit(chunk(choice(index, {"content": item})))
                            continue
                        start = {"index": calls[index], "id": item.id, "type": "function",
                                 "function": {"name": item.name, "arguments": ""}}
                        await emit(chunk(choice(index, {"tool_calls": [start]})))
                        await emit(chunk(choice(index, {"tool_calls": [{"index": calls[index],
                                                                        "function": {"arguments": item.arguments}}]})))
                        calls[index] += 1
            except Exception as exc:  # noqa: BLE001 - the stream has started: report it in the stream
                error = from_exception(exc)
                log.warning("stream %s failed: %s", rid, error.message)
                await emit(sse_data(error_dict(error, "openai", request_id=rid)))
                return
            result = stream.result
            assert result is not None
            for index, sample in enumerate((result, *result.samples)):
                await emit(chunk(choice(index, {}, finish_reason_of(sample))))
            if include_usage:
                await emit(chunk([], usage=usage_of(result), kvmem=kvmem_extras(result)))
            await emit(sse_data(b"[DONE]"))

        headers = {"x-kvmem-agent-id": header_safe(local_id(handle.agent_id))}
        return EventStreamResponse(produce, headers=headers)

    async def list_models(request: Request) -> Response:
        data = [_model_entry(gw, name) for name in gw.models]
        return gw.json({"object": "list", "data": data, "has_more": False,
                        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in gw.models:
            raise ApiError(404, "not_found", f"model {name!r} not found: this server serves {list(gw.models)}",
                           param="model", code="model_not_found")
        return gw.json(_model_entry(gw, name))

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"], name="openai_chat_completions"),
        Route("/v1/models", list_models, methods=["GET"], name="models"),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"], name="model"),
    ]
