"""OpenAI Chat Completions wire types (requests decoded, responses encoded with msgspec).

Messages are a tagged union on ``role``; content parts a tagged union on ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from actors.messages_agent import MAX_SAMPLES
from runtime.plan.sampling import SEED_RANGE
from runtime.reply.logprobs import MAX_TOP_LOGPROBS

__all__ = [
    "TextPart",
    "JsonSchemaSpec",
    "TextFormat",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "ResponseFormatSpec",
    "ImageUrlPart",
    "SystemMessage",
    "DeveloperMessage",
    "UserMessage",
    "AssistantMessage",
    "ToolMessage",
    "ChatMessage",
    "FunctionDef",
    "ToolDef",
    "ToolCallParam",
    "StreamOptions",
    "ChatCompletionRequest",
    "chat_decoder",
]

NonEmpty = Annotated[str, Meta(min_length=1)]

# Sampling controls OpenAI's API and kvmem's agents API both take, with OpenAI's ranges.
Seed = Annotated[int, Meta(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
AdditivePenalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # presence_penalty, frequency_penalty
RepetitionPenalty = Annotated[float, Meta(gt=0.0)]
LogitBias = dict[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=-100.0, le=100.0)]]  # token id: bias


class TextPart(Struct, tag="text", tag_field="type", kw_only=True):
    """OpenAI's ``text`` content part; a message's parts are joined with newlines."""

    text: str


class ImageUrlPart(Struct, tag="image_url", tag_field="type", kw_only=True):
    """OpenAI's ``image_url`` content part: decoded only so that the 400 can say images are not supported."""

    image_url: dict[str, Any]


Part = TextPart | ImageUrlPart
Content = str | list[Part]


class FunctionCall(Struct, kw_only=True):
    """OpenAI's ``function`` of an assistant's tool call: the name and the arguments as a JSON string."""

    name: NonEmpty
    arguments: str


class ToolCallParam(Struct, kw_only=True):
    """OpenAI's assistant ``tool_calls`` item (a function call), passed to the chat template."""

    id: NonEmpty
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(Struct, tag="system", tag_field="role", kw_only=True):
    """OpenAI's ``system`` message (``name`` is accepted and ignored)."""

    content: Content
    name: str | None = None


class DeveloperMessage(Struct, tag="developer", tag_field="role", kw_only=True):
    """OpenAI's ``developer`` message: rendered as a system message (``name`` is ignored)."""

    content: Content
    name: str | None = None


class UserMessage(Struct, tag="user", tag_field="role", kw_only=True):
    """OpenAI's ``user`` message (``name`` is accepted and ignored)."""

    content: Content
    name: str | None = None


class AssistantMessage(Struct, tag="assistant", tag_field="role", kw_only=True):
    """OpenAI's ``assistant`` message: text and/or tool calls (``name`` and ``refusal`` are ignored)."""

    content: Content | None = None
    tool_calls: list[ToolCallParam] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(Struct, tag="tool", tag_field="role", kw_only=True):
    """OpenAI's ``tool`` message: a tool call's result, answering ``tool_call_id``."""

    content: Content
    tool_call_id: NonEmpty


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDef(Struct, kw_only=True):
    """OpenAI's function definition (``ToolDef.function``); ``strict`` is accepted: calls are always
    decoded under the parameters' grammar where the model writes kvmem's generic format."""

    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Struct, kw_only=True):
    """OpenAI's ``tools`` item: a function the model may call, rendered by the chat template."""

    function: FunctionDef
    type: Literal["function"] = "function"


class JsonSchemaSpec(Struct, kw_only=True):
    """OpenAI's ``response_format.json_schema``: the schema the reply must be valid against.

    ``strict`` is accepted; kvmem always decodes under the schema's grammar (no schema: any object).
    """

    name: NonEmpty
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Struct, tag="text", tag_field="type", kw_only=True):
    """``response_format: {"type": "text"}``: a plain reply (the default)."""


class JsonObjectFormat(Struct, tag="json_object", tag_field="type", kw_only=True):
    """``response_format: {"type": "json_object"}``: the reply is a JSON object; with ``schema`` (llama.cpp's and
    vLLM's extension), one valid against it."""

    schema: dict[str, Any] | None = None


class JsonSchemaFormat(Struct, tag="json_schema", tag_field="type", kw_only=True):
    """``response_format: {"type": "json_schema", "json_schema": {...}}``: the reply is valid against the schema."""

    json_schema: JsonSchemaSpec


ResponseFormatSpec = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StreamOptions(Struct, kw_only=True):
    """OpenAI's ``stream_options``: ``include_usage`` adds a final chunk with the usage before ``[DONE]``."""

    include_usage: bool = False


class ChatCompletionRequest(Struct, kw_only=True):
    """``POST /v1/chat/completions``. Token limits are also checked against the server's limit.

    ``top_k`` and ``repetition_penalty`` are extensions (vLLM, llama.cpp and mlx-lm accept them too).
    ``seed`` gives the turn its own random stream (the same seed, prompt and parameters give the
    same reply); the penalties are mlx-lm's, over the last 20 tokens; ``logit_bias`` maps the model's token
    ids (object keys) to biases added to their logits. ``response_format`` is honoured on
    every model (the reply is decoded under the schema's grammar), and so are llama.cpp's
    ``json_schema`` (the same as a ``json_schema`` response format) and ``grammar`` (GBNF, converted to
    llguidance's Lark by llguidance's own converter); so is
    ``parallel_tool_calls: false`` (one call at most) where the model writes kvmem's
    generic tool-call format. ``logprobs`` / ``top_logprobs`` (``top_logprobs`` needs ``logprobs``, as
    OpenAI's): the model's own log-probabilities, before temperature and penalties (:mod:`runtime.reply.logprobs`).
    ``n``: that many choices, sampled from one prefill of the prompt in one batch (the first is the agent's own).
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
    n: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = None
    frequency_penalty: AdditivePenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormatSpec | None = None
    parallel_tool_calls: bool | None = None
    json_schema: dict[str, Any] | None = None
    grammar: NonEmpty | None = None


chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
