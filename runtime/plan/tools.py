"""What a turn lets the model do with its tools, the shape its reply must have, and the calls that come out.

Pure (msgspec, llguidance's schema check through :mod:`runtime.reply.reply_format`, the standard
library): the gateway builds these from each API's schema, and the engine enforces them
(:mod:`runtime.reply.tool_calls`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from runtime.reply.reply_format import check_grammar, schema_error

__all__ = ["ToolChoice", "ToolUse", "ResponseFormat", "ToolCall"]


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """What a turn with tools lets the model do (OpenAI's and Anthropic's ``tool_choice``, one shape).

    Attributes:
        mode: ``auto`` (call or answer), ``none`` (answer, never call) or
            ``required`` (call a tool).
        name: with ``required``, the one function to call (None: any).

    Raises:
        ValueError: an unknown mode, or a name with a mode other than ``required``.
    """

    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice must be 'auto', 'none' or 'required', not {self.mode!r}")
        if self.name is not None and (self.mode != "required" or not self.name):
            raise ValueError("tool_choice: a function name goes with mode 'required'")

    @classmethod
    def of(cls, value: str | Mapping[str, Any] | ToolChoice | None) -> ToolChoice:
        """``"auto"`` / ``"none"`` / ``"required"``, ``{"name": "f"}`` (call ``f``) or a ``ToolChoice``."""
        if value is None:
            return cls()
        if isinstance(value, ToolChoice):
            return value
        if isinstance(value, str):
            return cls(mode=value)  # type: ignore[arg-type]  # checked in __post_init__
        name = value.get("name")
        if not isinstance(name, str) or set(value) != {"name"}:
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'name': <function name>}")
        return cls(mode="required", name=name)


class ToolUse(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's tool definitions (OpenAI ``{"type": "function", "function": ...}``) and its :class:`ToolChoice`.

    The engine renders the definitions and parses the reply's tool calls with the
    model's mlx-lm tool parser (``runtime.reply.tool_calls``), or in kvmem's generic format
    (``runtime.reply.generic_tools``) for a model whose template has no tool syntax.
    ``parallel`` False: one call at most (OpenAI's ``parallel_tool_calls``; enforced in the
    generic format, whose grammar decides the calls).
    """

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """The reply is JSON (OpenAI's ``response_format``): valid against ``schema``, or any JSON object.

    The engine decodes the reply under the schema's grammar (:mod:`runtime.reply.grammar`), so
    it parses, on every model; ``max_tokens`` can still cut it short (``finish_reason``
    ``length``).

    Attributes:
        schema: a JSON Schema (None: any JSON object, OpenAI's ``json_object``).
        name: the schema's name, as OpenAI's ``json_schema.name`` gives it.
        grammar: instead of JSON, a grammar the reply follows (llguidance's Lark dialect; llama.cpp's
            ``grammar`` field, GBNF, converted to it): not with tools.

    Raises:
        ValueError: a schema or grammar that cannot constrain a reply (the message says why).
    """

    schema: dict[str, Any] | None = None
    name: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.schema is not None and (error := schema_error(self.schema)):
            raise ValueError(f"response_format's schema: {error}")
        if self.grammar is not None:
            check_grammar(self.grammar)  # raises ValueError with llguidance's message

    @classmethod
    def of(cls, value: Mapping[str, Any] | ResponseFormat | None) -> ResponseFormat | None:
        """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), or one of these (None: text).

        Raises:
            ValueError: another type, or a ``json_schema`` without a schema object.
        """
        if value is None or isinstance(value, ResponseFormat):
            return value
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls()
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema: a JSON Schema object is required")
            name = spec.get("name") if isinstance(spec, Mapping) else None
            return cls(schema=schema, name=name if isinstance(name, str) else None)
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}")


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call parsed out of a reply by the model's mlx-lm tool parser.

    Attributes:
        id: the model's own id when its format writes one, else ``call_`` + 24 hex digits.
        name: the function to call.
        arguments: its arguments, a JSON object as text (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        return "call_" + secrets.token_hex(12)

    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's ``tool_use.input``)."""
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}

    def for_template(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` item for the chat template.

        OpenAI's shape with the arguments as an object, as mlx-lm's server hands them to templates.
        """
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.input()}}
