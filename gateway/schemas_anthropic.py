"""Anthropic Messages API wire types (requests decoded, responses encoded with msgspec).

Content blocks are a tagged union on ``type``; an unsupported block type
(``document``, ``thinking``, ...) is a 400 naming its JSON path. Image blocks
decode, so that the error can say that images are not supported.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "TextBlock",
    "ImageBlock",
    "ToolUseBlock",
    "ToolResultBlock",
    "ContentBlock",
    "MessageParam",
    "Tool",
    "ToolChoiceParam",
    "Metadata",
    "MessagesRequest",
    "CountTokensRequest",
    "Usage",
    "ResponseText",
    "ResponseToolUse",
    "MessageResponse",
    "messages_decoder",
    "count_tokens_decoder",
]

NonEmpty = Annotated[str, Meta(min_length=1)]


class TextBlock(Struct, tag="text", tag_field="type", kw_only=True):
    """Anthropic's ``text`` content block (``cache_control`` is accepted and has no effect)."""

    text: str
    cache_control: dict[str, Any] | None = None


class ImageBlock(Struct, tag="image", tag_field="type", kw_only=True):
    """Anthropic's ``image`` content block: decoded only so that the 400 can say images are not supported."""

    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", kw_only=True):
    """Anthropic's ``tool_use`` content block (assistant messages): a call, rendered as an OpenAI-shaped tool call."""

    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", kw_only=True):
    """Anthropic's ``tool_result`` content block (user messages): rendered as a ``tool`` message.

    Its text is prefixed ``Error:`` when ``is_error``; image content is refused.
    """

    tool_use_id: NonEmpty
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock


class MessageParam(Struct, kw_only=True):
    """Anthropic's input message (``MessageParam``): a user or assistant turn, as text or content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Struct, kw_only=True):
    """A client tool (``input_schema``); server tools (a ``type`` such as ``web_search_20250305``) are refused."""

    name: NonEmpty
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(Struct, kw_only=True):
    """Anthropic's ``tool_choice``: ``auto``, ``any`` (call some tool), ``tool`` (call ``name``) or ``none``.

    ``disable_parallel_tool_use``: one call at most, enforced where the model writes kvmem's
    generic tool-call format (a model's own format may still write several).
    """

    type: Literal["auto", "any", "tool", "none"]
    name: NonEmpty | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(Struct, tag="json_schema", tag_field="type", kw_only=True):
    """Anthropic's structured output format: the reply's text is JSON valid against ``schema``."""

    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    """Anthropic's ``output_config``: ``format`` makes the reply JSON (other fields are accepted and ignored)."""

    format: JsonOutputFormat | None = None


class Metadata(Struct, kw_only=True):
    """Anthropic's request ``metadata``: ``user_id`` names the agent (and so the cache) when no header does."""

    user_id: Annotated[str, Meta(max_length=256)] | None = None


class MessagesRequest(Struct, kw_only=True):
    """``POST /v1/messages``. ``max_tokens`` is also checked against the server's limit.

    ``thinking`` (extended thinking) is accepted and declined: the reply is an ordinary
    answer without ``thinking`` blocks, as a model without that feature gives.
    Structured output, ``output_config.format`` (or the beta's ``output_format``), is
    honoured on every model: the reply is decoded under the schema's grammar.
    """

    model: NonEmpty
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)]
    system: str | list[TextBlock] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: Annotated[list[NonEmpty], Meta(max_length=16)] | None = None
    metadata: Metadata | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None


class CountTokensRequest(Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``."""

    model: NonEmpty
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None


# -- responses -------------------------------------------------------------------


class Usage(Struct, kw_only=True):
    """Every prompt token is counted once: read from the cache, written to it, or neither."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class ResponseText(Struct, kw_only=True):
    """Anthropic's ``text`` content block in a response: the reply's text (without its tool calls)."""

    type: Literal["text"]
    text: str


class ResponseToolUse(Struct, kw_only=True):
    """Anthropic's ``tool_use`` content block in a response: one tool call the model made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageResponse(Struct, kw_only=True):
    """Anthropic's ``Message`` object: the answer to a non-streaming ``POST /v1/messages``."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ResponseText | ResponseToolUse]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_tokens_decoder = msgspec.json.Decoder(CountTokensRequest)
