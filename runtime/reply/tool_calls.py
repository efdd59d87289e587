"""Tool calls out of a reply, with mlx-lm's tool-call parser for the model's chat template.

mlx-lm chooses a parser when it loads a tokenizer (``mlx_lm.tokenizer_utils.load``: the
tokenizer config's ``tool_parser_type``, else one inferred from the chat template or the
vocabulary) together with the markers that open and close a call (``tool_call_start``,
``tool_call_end``). kvmem uses them as mlx-lm's own server does, and never parses a call
itself:

* :class:`ToolCallSplitter` runs mlx-lm's ``TextStateMachine`` over the reply as it
  streams: text outside the markers is content; text between them is held back until the
  closing marker (or the end of the reply) and handed to the parser, which yields
  :class:`runtime.plan.tools.ToolCall` s. A call the parser cannot read (cut off by
  ``max_tokens``, malformed) comes back as content, as generated.
* Whitespace between content and a call, and after the last call, is not content: a chat
  template that re-renders the assistant's message (content, then its calls) then writes
  the text the model generated, and the next turn extends the cache.
* :func:`reply_rules` turns a turn's ``tool_choice`` (and ``response_format``) into what
  sampling enforces. A model whose template has no tool syntax gets
  :mod:`runtime.reply.generic_tools`' format and its grammar. On the others ``required`` makes the reply start with the call marker, a named function with the
  call's opening as the chat template renders it (up to the arguments); ``none`` bans the
  marker token (the prompt keeps the definitions, so the cache is unaffected) or, when the
  marker is not one token, leaves the definitions out of the prompt.

Everything here runs on the MLX thread; what leaves it is plain data (``ToolCall``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_lm.generate import TextStateMachine

from runtime.reply import generic_tools
from runtime.plan.tools import ResponseFormat, ToolCall, ToolUse
from runtime.reply.reply_format import answer_grammar

if TYPE_CHECKING:
    from runtime.model.loaded import LoadedModel

__all__ = ["ToolCallFormat", "tool_call_format", "parse_tool_calls", "ToolCallSplitter", "ReplyRules", "reply_rules",
           "GENERIC_CALLS"]

log = logging.getLogger("kvmem.tools")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: mlx-lm's parser for its template and the markers around a call.

    Attributes:
        parser: the ``mlx_lm.tool_parsers`` module's name (``json_tools``, ``pythonic``, ...).
        start, end: the markers around a call (``end`` may be empty: a call runs to the end).
        parse: the module's ``parse_tool_call(text, tools)``.
    """

    parser: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]


def tool_call_format(tokenizer: Any) -> ToolCallFormat | None:
    """The tool-call format mlx-lm chose for ``tokenizer`` (a ``TokenizerWrapper``); None: it has none."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    hf = getattr(tokenizer, "_tokenizer", None)
    parser = str(getattr(hf, "init_kwargs", {}).get("tool_parser_type", "unknown"))
    return ToolCallFormat(parser=parser, start=tokenizer.tool_call_start, end=tokenizer.tool_call_end or "",
                          parse=tokenizer.tool_parser)


def parse_tool_calls(fmt: ToolCallFormat, text: str, tools: list[dict[str, Any]] | None) -> list[ToolCall]:
    """The calls in one call section's ``text`` (between the markers), as mlx-lm's server formats them.

    Raises:
        ValueError: the parser cannot read it, or it reads no named call with object arguments.
    """
    try:
        parsed = fmt.parse(text, tools)
    except Exception as exc:  # noqa: BLE001 - parsers raise ValueError, KeyError, SyntaxError...
        raise ValueError(f"{fmt.parser} cannot parse {text!r}: {type(exc).__name__}: {exc}") from exc
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{fmt.parser} read no function name in {text!r}")
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):  # some formats carry the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ValueError(f"arguments of {name!r} are not JSON: {exc}") from exc
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments of {name!r} are not an object: {arguments!r}")
        call_id = item.get("id")
        calls.append(ToolCall(id=call_id if isinstance(call_id, str) and call_id else ToolCall.new_id(), name=name,
                              arguments=json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        raise ValueError(f"{fmt.parser} read no call in {text!r}")
    return calls


class ToolCallSplitter:
    """Splits a reply, as it streams, into content and tool calls (see the module docstring).

    :meth:`feed` takes each new piece of reply text and returns the content to stream
    now followed by the calls completed now; content that follows a call in the same
    piece waits for the next one, so the order holds. :meth:`finish` ends the reply.
    :attr:`content` and :attr:`calls` accumulate everything.
    """

    def __init__(self, fmt: ToolCallFormat, tools: list[dict[str, Any]] | None = None) -> None:
        self.fmt = fmt
        self._tools = tools
        edges = {"normal": [(fmt.start, "tool")], "tool": [(fmt.end, "normal")] if fmt.end else []}
        self._machine = TextStateMachine(edges)
        self._state = self._machine.make_state("normal")
        self._in_call = False
        self._call_text = ""
        self._space = ""  # trailing whitespace of the content, held until text or a call follows
        self._space_before_call = ""
        self._after_call = ""  # content that followed a call within one piece
        self.content = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content to stream now and the calls completed by ``text`` (in that order)."""
        self._state, segments = TextStateMachine.split(self._state, text)
        out: list[str | ToolCall] = [self._after_call]
        self._after_call = ""
        for state, piece in segments:
            self._move(state == "tool", out)
            if self._in_call:
                self._call_text += piece
            else:
                out.append(self._text(piece))
        return self._ordered(out)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the reply: what is left (a marker never completed is content; an open call is parsed)."""
        self._state, rest, _ = TextStateMachine.flush(self._state)
        out: list[str | ToolCall] = [self._after_call]
        self._after_call = ""
        if self._in_call:
            self._call_text += rest
            self._move(False, out, closed=False)
        else:
            out.append(self._text(rest))
        if self._space and not self.calls:  # no calls: the content is the reply's text, all of it
            out.append(self._space)
            self.content += self._space
        self._space = ""
        return self._ordered(out)  # a call can only come last here: nothing waits

    def _move(self, in_call: bool, out: list[str | ToolCall], *, closed: bool = True) -> None:
        """Open or close a call section (``closed``: its end marker was written)."""
        if in_call == self._in_call:
            return
        self._in_call = in_call
        if in_call:  # a call opens: the whitespace before it is not content
            self._space_before_call, self._space, self._call_text = self._space, "", ""
            return
        try:
            calls = parse_tool_calls(self.fmt, self._call_text, self._tools)
        except ValueError as exc:
            log.info("a tool call is returned as text: %s", exc)
            self._space = self._space_before_call
            out.append(self._text(self.fmt.start + self._call_text + (self.fmt.end if closed else "")))
            return
        self.calls.extend(calls)
        out.extend(calls)

    def _text(self, piece: str) -> str:
        """Content ``piece``, less trailing whitespace (held: it is content only if text follows)."""
        text = self._space + piece
        kept = text.rstrip()
        self._space = text[len(kept):]
        self.content += kept
        return kept

    def _ordered(self, out: list[str | ToolCall]) -> tuple[str, list[ToolCall]]:
        """Content before the first call, then the calls; content after a call waits (``_after_call``)."""
        text: list[str] = []
        calls: list[ToolCall] = []
        for item in out:
            if isinstance(item, ToolCall):
                calls.append(item)
            elif calls:
                self._after_call += item
            else:
                text.append(item)
        return "".join(text), calls


GENERIC_CALLS = ToolCallFormat(parser=generic_tools.FORMAT, start=generic_tools.CALL_START,
                               end=generic_tools.CALL_END, parse=generic_tools.parse_calls)
"""How models whose template has no tool syntax write calls (:mod:`runtime.reply.generic_tools`)."""


@dataclass(frozen=True)
class ReplyRules:
    """What a turn's tools, ``tool_choice`` and ``response_format`` ask of its reply, as the engine enforces it.

    Attributes:
        fmt: parse tool calls with it (None: the reply is plain text).
        forced: text the reply must start with (``required``: the call marker; a
            named function: the call's opening, up to its arguments).
        banned: token ids never sampled (``none``: the call marker).
        render_tools: the definitions go into the prompt (``none`` on a model whose
            call marker is not one token: they are left out).
        grammar: the Lark grammar the reply is decoded under (:mod:`runtime.reply.grammar`;
            None: unconstrained).
    """

    fmt: ToolCallFormat | None
    forced: str = ""
    banned: tuple[int, ...] = ()
    render_tools: bool = True
    grammar: str | None = None

    def splitter(self, use: ToolUse | None) -> ToolCallSplitter | None:
        if use is None or self.fmt is None:
            return None
        return ToolCallSplitter(self.fmt, [dict(t) for t in use.tools])


def reply_rules(lm: LoadedModel, use: ToolUse | None, answer: ResponseFormat | None = None) -> ReplyRules:
    """The rules that honour ``use.choice`` and ``answer`` on ``lm``.

    A model whose template has tool syntax writes calls its own way (mlx-lm's parser);
    any other gets :mod:`runtime.reply.generic_tools`' format, decoded under its grammar.

    Raises:
        ValueError: the choice needs a tool-call parser (``required``) or a template that
            renders a named call's opening, and the model has none; or ``answer`` is asked
            with tools the model's own template formats (not supported).
    """
    if answer is not None and answer.grammar is not None:  # llama.cpp's grammar: the reply is that, text only
        if use is not None and use.tools and use.choice.mode != "none":
            raise ValueError("a grammar with tools: the reply would have to be both a call and the grammar's "
                             "text; give tool_choice 'none' or no tools")
        return ReplyRules(fmt=None, render_tools=bool(use and use.tools), grammar=answer.grammar)
    answer_schema = answer.schema if answer is not None else None
    if use is None or not use.tools:
        return ReplyRules(fmt=None, grammar=answer_grammar(answer_schema) if answer is not None else None)
    choice = use.choice
    if not lm.supports_tools:
        grammar = generic_tools.reply_grammar([dict(t) for t in use.tools], choice.mode, choice.name,
                                              answer_schema, json_answer=answer is not None, parallel=use.parallel,
                                              markers=(_marker(lm, generic_tools.CALL_START),
                                                       _marker(lm, generic_tools.CALL_END)))
        return ReplyRules(fmt=GENERIC_CALLS if choice.mode != "none" else None, grammar=grammar)
    fmt = tool_call_format(lm.tokenizer)
    if answer is not None and choice.mode != "none":
        raise ValueError(f"response_format with tools: model {lm.model_id!r} writes tool calls in its own "
                         "template's format, which kvmem does not constrain; give tool_choice 'none' or no tools")
    grammar = answer_grammar(answer_schema) if answer is not None else None
    if choice.mode == "auto":
        return ReplyRules(fmt=fmt)
    if choice.mode == "none":
        marker = lm.tokenize(fmt.start)[0] if fmt is not None else []
        if len(marker) == 1:
            return ReplyRules(fmt=None, banned=tuple(marker), grammar=grammar)
        return ReplyRules(fmt=None, render_tools=False, grammar=grammar)
    wanted = f"tool_choice {'naming ' + repr(choice.name) if choice.name else 'required'}"
    if fmt is None:
        raise ValueError(f"{wanted}: mlx-lm has no tool-call parser for model {lm.model_id!r}'s chat template, "
                         "so kvmem can neither make nor read its tool calls")
    if choice.name is None:
        return ReplyRules(fmt=fmt, forced=fmt.start)
    return ReplyRules(fmt=fmt, forced=_named_call_opening(lm, use, choice.name, fmt, wanted))


def _marker(lm: LoadedModel, text: str) -> str:
    """A call marker in a Lark grammar: llguidance's ``<[id]>`` where the vocabulary has it as one
    special token (a tokenizer that adds ``<tool_call>``), else the text."""
    ids = lm.tokenize(text)[0]
    if len(ids) == 1 and lm.grammar_vocabulary.tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _named_call_opening(lm: LoadedModel, use: ToolUse, name: str, fmt: ToolCallFormat, wanted: str) -> str:
    """How the template writes a call of ``name`` up to its arguments (rendered twice, with different arguments)."""
    tools = [dict(t) for t in use.tools]
    ask = [{"role": "user", "content": "?"}]

    def with_call(arguments: dict[str, Any]) -> str:
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
        return lm.render([*ask, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools,
                         add_generation_prompt=False)

    try:
        head = lm.render(ask, tools=tools)
        empty, full = with_call({}), with_call({"kvmem": 1})
    except Exception as exc:  # noqa: BLE001 - a template error is the answer: it cannot
        raise ValueError(f"{wanted}: model {lm.model_id!r}'s chat template cannot render the call ({exc})") from exc
    if not (empty.startswith(head) and full.startswith(head)):
        raise ValueError(f"{wanted}: model {lm.model_id!r}'s chat template renders an assistant's tool call "
                         "differently from its generation prompt")
    opening = os.path.commonprefix([empty[len(head):], full[len(head):]])
    if fmt.start not in opening or name not in opening:
        raise ValueError(f"{wanted}: model {lm.model_id!r}'s chat template does not write a call's marker and "
                         "name before its arguments, so kvmem cannot make the model call that function")
    return opening
