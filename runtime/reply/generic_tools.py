"""kvmem's generic tool-call format, for models whose chat template has no tool syntax.

A model whose template renders ``tools`` keeps its own format (mlx-lm's parsers,
:mod:`runtime.reply.tool_calls`). Any other model (kvmem-default, SmolLM2-135M-Instruct, among
them) gets this one, as llama.cpp's server falls back to its generic format:

* **Rendered into the conversation** (:func:`render_messages`): the tool definitions and
  the reply's shape are appended to the system message (one is added when there is none);
  an assistant's earlier calls are written back exactly as the model writes them; tool
  results become a user message of ``<tool_response>`` sections. The model's own template
  then renders the messages as usual.
* **Decoded under a grammar** (:func:`reply_grammar`, compiled by :mod:`runtime.reply.grammar`):
  the reply is either calls, ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``
  with each call's arguments valid against its function's JSON Schema, or an answer (plain
  text that never contains the call marker, or JSON valid against ``response_format``'s
  schema). ``tool_choice`` picks the branch: ``auto`` both, ``required`` calls, a named
  function calls of it only, ``none`` the answer (the definitions stay in the prompt, so
  the cache is the same whatever the choice).
* **Parsed** by :func:`parse_calls`, through :class:`runtime.reply.tool_calls.ToolCallSplitter`
  as every format is.

The JSON of a call is written as Python's ``json.dumps`` writes it (the grammar's
separators), so when the client sends the call back, :func:`render_messages` renders the
same text and the next turn extends the cache.

The format is versioned (:data:`FORMAT`): it is part of the model tag of every cache of a
model that uses it (``runtime.spec.ModelCacheSpec.prompt_format``), so a cache rendered
with one version is never reused under another.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from runtime.reply.reply_format import json_schema_rule

__all__ = ["FORMAT", "CALL_START", "CALL_END", "render_messages", "reply_grammar", "parse_calls", "function_of",
           "closed_objects"]

FORMAT = "kvmem-tools-1"
"""This format's name and version (bump it whenever what it renders changes)."""

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
RESPONSE_START = "<tool_response>"
RESPONSE_END = "</tool_response>"

_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more of these functions:\n"
    "<tools>\n@TOOLS@\n</tools>\n\n"
    f"To call functions, reply with nothing but the calls, a JSON list between {CALL_START} and {CALL_END}:\n"
    f'{CALL_START}[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]{CALL_END}\n'
    f"Their results come back between {RESPONSE_START} and {RESPONSE_END}. "
    "When no call is needed, answer in plain text."
)


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function of a tool definition, OpenAI-shaped (``{"type": "function", "function": {...}}``) or bare."""
    inner = tool.get("function")
    return inner if isinstance(inner, Mapping) else tool


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; none, or one without a type, takes an object."""
    params = function.get("parameters")
    params = dict(params) if isinstance(params, Mapping) else {}
    if "type" not in params and not any(k in params for k in ("anyOf", "oneOf", "allOf", "$ref")):
        params["type"] = "object"
    return params


def _definition(tool: Mapping[str, Any]) -> str:
    function = function_of(tool)
    shown = {"name": function.get("name"), "description": function.get("description") or "",
             "parameters": _parameters(function)}
    return json.dumps(shown, ensure_ascii=False)


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` with ``tools`` and calls and results written in this format, for any chat template."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            section = f"{RESPONSE_START}{_text(message.get('content'))}{RESPONSE_END}"
            if out and out[-1].get("kvmem_tool_results"):
                out[-1]["content"] += "\n" + section
            else:
                out.append({"role": "user", "content": section, "kvmem_tool_results": True})
            continue
        message = dict(message)
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if calls:
            text = _text(message.get("content"))
            message["content"] = (text + "\n" if text else "") + _calls_text(calls)
        out.append(message)
    for message in out:
        message.pop("kvmem_tool_results", None)
    if tools:
        block = _INSTRUCTIONS.replace("@TOOLS@", "\n".join(_definition(t) for t in tools))
        if out and out[0].get("role") == "system":
            system = _text(out[0].get("content"))
            out[0] = {**out[0], "content": (system + "\n\n" if system else "") + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "" if content is None else json.dumps(content, ensure_ascii=False)


def _calls_text(calls: Iterable[Mapping[str, Any]]) -> str:
    """An assistant's calls as the model writes them (OpenAI-shaped ``tool_calls`` items)."""
    items = []
    for call in calls:
        function = function_of(call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # written as the client sent it: the model reads it, the cache may diverge there
        items.append({"name": function.get("name"), "arguments": arguments})
    return CALL_START + json.dumps(items, ensure_ascii=False) + CALL_END


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "not", "if", "then", "else", "contains", "additionalItems")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` but leaves ``additionalProperties`` unsaid closed to them.

    A tool's arguments are passed as keyword arguments (``fn(**args)``): a key the schema never named is a
    ``TypeError`` in the client. JSON Schema allows extra keys unless told otherwise; llama.cpp's schema
    converter and xgrammar's default strict mode allow only the listed ones, and so does kvmem's grammar for
    a call. An object that says ``additionalProperties`` (or ``patternProperties``) keeps its word; one that
    lists no properties stays any object, as llama.cpp reads it.
    """
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS or key in _SUBSCHEMAS or key == "additionalProperties":
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _calls_schema(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> dict[str, Any]:
    variants = [
        {"type": "object", "properties": {"name": {"const": function_of(t).get("name")},
                                          "arguments": closed_objects(_parameters(function_of(t)))},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools if only is None or function_of(t).get("name") == only
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}, **({} if parallel else {"maxItems": 1})}


def reply_grammar(tools: list[dict[str, Any]], mode: str, name: str | None = None,
                  answer_schema: dict[str, Any] | None = None, *, json_answer: bool = False,
                  parallel: bool = True, markers: tuple[str, str] | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of a reply in this format.

    Args:
        tools: the turn's tool definitions.
        mode: ``tool_choice``'s mode: ``auto`` (calls or an answer), ``required`` (calls),
            ``none`` (an answer).
        name: with ``required``, the one function the calls may name.
        answer_schema, json_answer: the answer is JSON valid against ``answer_schema``
            (``response_format``; any object when ``json_answer`` and no schema) instead of
            plain text.
        parallel: False: one call at most (OpenAI's ``parallel_tool_calls``).
        markers: how the grammar writes the call markers (default: as text; a vocabulary
            that has either marker as one special token names it as llguidance's ``<[id]>``,
            since a special token never matches text).
    """
    start, end = markers or (json.dumps(CALL_START), json.dumps(CALL_END))
    calls = f"calls: {start} call_list {end}\ncall_list: {json_schema_rule(_calls_schema(tools, name, parallel))}\n"
    if answer_schema is not None or json_answer:
        answer = "answer: " + json_schema_rule(answer_schema if answer_schema is not None else {"type": "object"})
    else:
        # Plain text that never contains the call marker: a call is only ever the calls branch.
        answer = f"answer: TEXT\nTEXT: /(.|\\n)+/ & ~/(.|\\n)*{_regex_literal(CALL_START)}(.|\\n)*/"
    start = {"auto": "start: calls | answer", "required": "start: calls", "none": "start: answer"}[mode]
    return f"{start}\n{calls}{answer}\n"


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


def parse_calls(text: str, tools: Any = None) -> list[dict[str, Any]]:
    """The calls in one call section (the JSON list between the markers), as mlx-lm's parsers return them.

    Raises:
        ValueError: it is not a JSON list (or object) of calls.
    """
    value = json.loads(text)
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"not a list of calls: {text!r}")
    return items
