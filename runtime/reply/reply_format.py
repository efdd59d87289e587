"""Reply shapes as grammars: JSON Schemas and Lark rules in llguidance's dialect (no MLX, no tokenizer).

What a turn asks of its reply's shape is written here as grammar text:
:func:`answer_grammar` for OpenAI's ``response_format`` (any JSON object, or one valid
against a JSON Schema), and the pieces :mod:`runtime.reply.generic_tools` builds its tool-call
grammar from. :mod:`runtime.reply.grammar` compiles the text against a model's vocabulary and
masks the logits with it. Schemas are checked here too (:func:`schema_error`), so a bad
one is a client's 400 before any turn starts.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

__all__ = ["JSON_OPTIONS", "answer_grammar", "check_grammar", "json_schema_rule", "schema_error", "lark_from_gbnf"]

JSON_OPTIONS: dict[str, Any] = {
    # JSON written as Python's json.dumps writes it: when a client sends a call back, kvmem
    # renders its arguments with json.dumps, and the text matches what the model wrote, so
    # the next turn extends the cache instead of diverging at the first space.
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # Escapes as json.dumps(ensure_ascii=False) writes them: never \/ or \uXXXX.
    "json_allowed_escapes": '"\\bfnrt',
    # Keywords llguidance does not enforce (``propertyNames``, ``format`` ...) are ignored
    # rather than refused: agent clients send schemas written for other validators.
    "lenient": True,
}
"""llguidance's JSON compile options for every schema kvmem constrains to."""


def json_schema_rule(schema: dict[str, Any]) -> str:
    """A ``%json`` rule body for ``schema`` with kvmem's :data:`JSON_OPTIONS` (for a Lark grammar)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}},
                                 ensure_ascii=False)


def schema_error(schema: Any) -> str:
    """Why ``schema`` cannot constrain a reply ("" when it can): not an object, or llguidance refuses it.

    Agent clients send the same tool definitions with every request, and a request's
    schemas are checked where it arrives and again when its turn is built, so the verdict
    is kept per schema (its canonical JSON text): a dozen tools cost ~4 ms to check once.
    """
    if not isinstance(schema, dict):
        return f"a JSON Schema is an object, not {type(schema).__name__}"
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return _schema_error(text)


@functools.lru_cache(maxsize=1024)
def _schema_error(schema_text: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_OPTIONS)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid JSON Schema") if is_error else ""


def answer_grammar(schema: dict[str, Any] | None) -> str:
    """The Lark grammar of a JSON answer: valid against ``schema``, or any JSON object (None)."""
    return "start: answer\nanswer: " + json_schema_rule(schema if schema is not None else {"type": "object"}) + "\n"


def check_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect) as llguidance's grammar text.

    Raises:
        ValueError: it does not compile (llguidance's message).
    """
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(messages[0] if messages else "the grammar does not compile")
    return grammar


def lark_from_gbnf(gbnf: str) -> str:
    """A GBNF grammar (llama.cpp's ``grammar`` field, ``root ::= ...``) in llguidance's Lark dialect, by
    llguidance's own converter.

    Raises:
        ValueError: it does not parse as GBNF, or its conversion does not compile (the message says where).
    """
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        lark = gbnf_to_lark(gbnf)
    except GbnfToLarkError as exc:
        raise ValueError(str(exc)) from None
    check_grammar(lark)
    return lark
