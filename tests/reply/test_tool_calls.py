"""Tool calls out of a reply: mlx-lm's parsers as the reply streams, tool_choice, and the template round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import models_dir, tiny
from mlx_lm.tool_parsers import mistral, pythonic

from runtime.plan.tools import ToolCall, ToolChoice, ToolUse
from runtime.execution.generate import generate
from runtime.model.loaded import LoadedModel, load_model
from runtime.execution.sequence import SequenceSampling
from runtime.reply.tool_calls import (
    GENERIC_CALLS,
    ToolCallFormat,
    ToolCallSplitter,
    parse_tool_calls,
    reply_rules,
    tool_call_format,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _split(fmt: ToolCallFormat, text: str, step: int) -> tuple[list[str | ToolCall], ToolCallSplitter]:
    """Feed ``text`` ``step`` characters at a time; the streamed items in order."""
    splitter = ToolCallSplitter(fmt, TOOLS)
    out: list[str | ToolCall] = []
    for i in range(0, len(text), step):
        piece, calls = splitter.feed(text[i : i + step])
        out += [piece] if piece else []
        out += calls
    piece, calls = splitter.finish()
    return out + ([piece] if piece else []) + list(calls), splitter


def _shape(items: list[str | ToolCall]) -> list[str | tuple[str, str]]:
    """Streamed items with text joined and calls as (name, arguments): comparable across chunkings."""
    shape: list[str | tuple[str, str]] = []
    for item in items:
        if isinstance(item, ToolCall):
            shape.append((item.name, item.arguments))
        elif shape and isinstance(shape[-1], str):
            shape[-1] += item
        else:
            shape.append(item)
    return shape


@pytest.fixture(scope="module")
def qwen() -> LoadedModel:
    return tiny("tiny-qwen2")


@pytest.fixture(scope="module")
def json_tools(qwen: LoadedModel) -> ToolCallFormat:
    fmt = tool_call_format(qwen.tokenizer)
    assert fmt is not None and (fmt.parser, fmt.start, fmt.end) == ("json_tools", "<tool_call>", "</tool_call>")
    return fmt


@pytest.mark.parametrize(("reply", "content", "calls"), [
    ("Just text.\n", "Just text.\n", []),  # no call: the content is the reply, trailing whitespace too
    ("Let me look.\n" + CALL, "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n", "",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]),
    ("x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),  # unreadable: text
    ("a\n" + CALL.removesuffix("</tool_call>"), "a", [("get_weather", '{"city": "Paris"}')]),  # open at the end
    ("half a marker <tool_ca", "half a marker <tool_ca", []),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"k\\": [1, 2]}"}\n</tool_call>', "", [("f", '{"k": [1, 2]}')]),
])
def test_the_splitter_gives_the_same_content_and_calls_however_the_reply_is_chunked(
    json_tools: ToolCallFormat, reply: str, content: str, calls: list[tuple[str, str]]
) -> None:
    shapes = set()
    for step in (1, 2, 5, len(reply)):
        items, splitter = _split(json_tools, reply, step)
        assert splitter.content == content and [(c.name, c.arguments) for c in splitter.calls] == calls
        assert "".join(i for i in items if isinstance(i, str)) == content  # streamed text is the content
        shapes.add(json.dumps(_shape(items)))
    assert len(shapes) == 1, shapes  # the same order of text and calls for every chunking


def test_content_after_a_call_is_streamed_after_it(json_tools: ToolCallFormat) -> None:
    items, splitter = _split(json_tools, "Checking." + CALL + " Done.", 1000)
    assert _shape(items) == ["Checking.", ("get_weather", '{"city": "Paris"}'), " Done."]
    assert splitter.content == "Checking. Done."


def test_formats_without_an_end_marker_and_pythonic_calls_use_their_mlx_lm_parsers() -> None:
    fmt = ToolCallFormat(parser="mistral", start=mistral.tool_call_start, end=mistral.tool_call_end,
                         parse=mistral.parse_tool_call)
    items, _ = _split(fmt, 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', 3)
    assert _shape(items) == ["Sure.", ("get_weather", '{"city": "Paris"}')]
    with_id = parse_tool_calls(fmt, '[{"name": "f", "arguments": {}, "id": "abc123XYZ"}]', None)
    assert [(c.id, c.name, c.arguments) for c in with_id] == [("abc123XYZ", "f", "{}")]  # the model's id is kept
    fmt = ToolCallFormat(parser="pythonic", start=pythonic.tool_call_start, end=pythonic.tool_call_end,
                         parse=pythonic.parse_tool_call)
    items, _ = _split(fmt, '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>', 4)
    assert _shape(items) == [("get_weather", '{"city": "Paris"}')]


def test_parsed_calls_need_a_name_and_object_arguments(json_tools: ToolCallFormat) -> None:
    for bad in ('{"arguments": {}}', '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "no"}', "[]"):
        with pytest.raises(ValueError):
            parse_tool_calls(json_tools, bad, None)
    call = parse_tool_calls(json_tools, '{"name": "f"}', None)[0]
    assert call.arguments == "{}" and call.id.startswith("call_") and len(call.id) == 29


def test_the_template_renders_a_parsed_call_back_to_the_text_the_model_generated(
    qwen: LoadedModel, json_tools: ToolCallFormat
) -> None:
    """What makes the tool-result turn an EXTEND: the cache holds prompt + reply, and the
    next prompt renders the assistant's content and calls to exactly that text."""
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
    prompt = qwen.render(messages, tools=TOOLS)
    for reply in ("Let me look.\n" + CALL, CALL, CALL + "\n" + CALL.replace("Paris", "Oslo")):
        _, splitter = _split(json_tools, reply, 3)
        assistant = {"role": "assistant", "content": splitter.content,
                     "tool_calls": [call.for_template() for call in splitter.calls]}
        results = [{"role": "tool", "tool_call_id": c.id, "content": "Sunny"} for c in splitter.calls]
        assert qwen.render([*messages, assistant, *results], tools=TOOLS).startswith(prompt + reply)


def test_tool_choice_becomes_sampling_rules(qwen: LoadedModel) -> None:
    def rules(choice: ToolChoice):  # type: ignore[no-untyped-def]
        return reply_rules(qwen, ToolUse(tools=tuple(TOOLS), choice=choice))

    assert rules(ToolChoice()).fmt is not None and not rules(ToolChoice()).forced
    none = rules(ToolChoice(mode="none"))
    assert none.fmt is None and none.banned == tuple(qwen.tokenize("<tool_call>")[0]) and none.render_tools
    assert rules(ToolChoice(mode="required")).forced == "<tool_call>"
    named = rules(ToolChoice(mode="required", name="get_weather"))
    assert named.forced == '<tool_call>\n{"name": "get_weather", "arguments": {'  # the template's own opening


def test_forced_tokens_and_banned_tokens_steer_a_real_model(qwen: LoadedModel) -> None:
    prompt = qwen.render([{"role": "user", "content": "Weather?"}], tools=TOOLS)
    opening = '<tool_call>\n{"name": "get_weather", "arguments": {'
    forced = generate(qwen, prompt, None, SequenceSampling(max_tokens=24, forced=tuple(qwen.tokenize(opening)[0])))
    assert forced.reply.startswith(opening)
    marker = qwen.tokenize("<tool_call>")[0][0]
    wants = generate(qwen, prompt, None, SequenceSampling(max_tokens=6, logit_bias={marker: 50.0}))
    assert wants.reply.startswith("<tool_call>")
    banned = generate(qwen, prompt, None, SequenceSampling(max_tokens=6, logit_bias={marker: float("-inf")}))
    assert "<tool_call>" not in banned.reply


def _without_parser(root: Path) -> LoadedModel:
    """tiny-qwen2 with a template that renders tools in its own words: mlx-lm infers no parser for it."""
    from runtime.model.tiny_models import ensure_tiny_model

    target = root / "no-parser"
    shutil.copytree(ensure_tiny_model("tiny-qwen2", models_dir()), target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace("<tool_call>", "<call>").replace("tool_call.name", "c")
    config_path.write_text(json.dumps(config))
    return load_model(str(target))


def test_a_choice_the_model_cannot_honour_is_a_value_error(tmp_path: Path, smollm2: LoadedModel) -> None:
    lm = _without_parser(tmp_path)
    assert lm.supports_tools and tool_call_format(lm.tokenizer) is None
    assert reply_rules(lm, ToolUse(tools=tuple(TOOLS))).fmt is None  # auto: tools in, replies stay text
    assert not reply_rules(lm, ToolUse(tools=tuple(TOOLS), choice=ToolChoice(mode="none"))).render_tools
    for choice in (ToolChoice(mode="required"), ToolChoice(mode="required", name="get_weather")):
        with pytest.raises(ValueError, match="no tool-call parser"):
            reply_rules(lm, ToolUse(tools=tuple(TOOLS), choice=choice))
    # The real default's template renders no tools: no parser of its own, so kvmem's generic format
    # (tests/reply/test_generic_tools.py), decoded under a grammar, for every choice.
    assert not smollm2.supports_tools and tool_call_format(smollm2.tokenizer) is None
    for choice in (ToolChoice(), ToolChoice(mode="required"), ToolChoice(mode="required", name="get_weather")):
        rules = reply_rules(smollm2, ToolUse(tools=tuple(TOOLS), choice=choice))
        assert rules.fmt is GENERIC_CALLS and rules.grammar and not rules.forced
