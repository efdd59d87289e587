"""OpenAI Chat Completions wire types (requests decoded, responses encoded with msgspec).

Messages are a tagged union on ``role``; content parts a tagged union on ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "TextPart",
    "ImageUrlPart",
    "SystemMessage",
    "DeveloperMessage",
    "UserMessage",
    "AssistantMessage",
    "ToolMessage",
    "ChatMessage",
    "FunctionDef",
    "ToolDef",
    "ToolCall",
    "StreamOptions",
    "ChatCompletionRequest",
    "chat_decoder",
]

NonEmpty = Annotated[str, Meta(min_length=1)]


class TextPart(Struct, tag="text", tag_field="type", kw_only=True):
    text: str


class ImageUrlPart(Struct, tag="image_url", tag_field="type", kw_only=True):
    image_url: dict[str, Any]


Part = TextPart | ImageUrlPart
Content = str | list[Part]


class FunctionCall(Struct, kw_only=True):
    name: NonEmpty
    arguments: str


class ToolCall(Struct, kw_only=True):
    id: NonEmpty
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(Struct, tag="system", tag_field="role", kw_only=True):
    content: Content
    name: str | None = None


class DeveloperMessage(Struct, tag="developer", tag_field="role", kw_only=True):
    content: Content
    name: str | None = None


class UserMessage(Struct, tag="user", tag_field="role", kw_only=True):
    content: Content
    name: str | None = None


class AssistantMessage(Struct, tag="assistant", tag_field="role", kw_only=True):
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(Struct, tag="tool", tag_field="role", kw_only=True):
    content: Content
    tool_call_id: NonEmpty


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDef(Struct, kw_only=True):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Struct, kw_only=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(Struct, kw_only=True):
    """``POST /v1/chat/completions``. Token limits are also checked against the server's limit.

    ``top_k`` is an extension (vLLM, llama.cpp and mlx-lm accept it too).
    Penalties, ``seed``, ``logprobs`` and ``response_format`` are accepted and ignored.
    """

    model: NonEmpty
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Meta(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    n: Annotated[int, Meta(ge=1, le=1)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None


chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
