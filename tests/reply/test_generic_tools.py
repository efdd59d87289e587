"""kvmem's generic tool-call format and constrained decoding (issue 29, items 1-3).

kvmem-default (SmolLM2-135M-Instruct) has no tool syntax in its template: its prompts carry
tools in :mod:`runtime.reply.generic_tools`' format and its replies are decoded under the format's
grammar (:mod:`runtime.reply.grammar`, llguidance). The references are independent of kvmem's
decoding: llguidance's own matcher for what the grammar accepts, mlx-lm's ``generate_step``
with the same grammar as its logits processor, and each row decoded alone for the batch.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import mlx.core as mx
import pytest
from conftest import models_dir, tiny
from mlx_lm.generate import generate_step

from runtime.reply import generic_tools
from runtime.execution.decode_batch import DecodeBatch
from runtime.plan.tools import ResponseFormat, ToolChoice, ToolUse
from runtime.execution.generate import decode_alone
from runtime.reply.grammar import ReplyGrammar, mask_rows
from runtime.model.loaded import LoadedModel, load_model
from runtime.reply.reply_format import answer_grammar, schema_error
from runtime.execution.sequence import SequenceSampling, Sequence
from runtime.model.tiny_models import ensure_tiny_model
from runtime.reply.tool_calls import GENERIC_CALLS, reply_rules

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query", "limit"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
ASK = [{"role": "user", "content": "What is the weather in Paris? Use a tool."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """tiny-llama (random weights, quick) with a chat template that has no tool syntax."""
    target = tmp_path_factory.mktemp("plain") / "tiny-llama-plain"
    shutil.copytree(ensure_tiny_model("tiny-llama", models_dir()), target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHATML
    config_path.write_text(json.dumps(config))
    lm = load_model(str(target))
    assert lm.tool_format == generic_tools.FORMAT
    return lm


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# -- rendering -----------------------------------------------------------------------


def test_a_conversation_with_tools_calls_and_results_renders_on_a_template_without_tool_syntax(smollm2):
    assert smollm2.tool_format == generic_tools.FORMAT
    messages = [
        {"role": "system", "content": "You are terse."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", {"city": "Paris"}),
                                                              _call("search", {"query": "Paris", "limit": 2})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two pages"},
    ]
    text = smollm2.render(messages, tools=TOOLS)
    assert text.count("<|im_start|>system") == 1  # the client's system message, with the tools after it
    assert "You are terse.\n\n# Tools" in text
    assert '<tools>\n{"name": "get_weather", "description": "The weather in a city now", "parameters": ' in text
    # the calls exactly as the grammar makes the model write them, and both results in one user message
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "search", "arguments": {"query": "Paris", "limit": 2}}]</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>18 C</tool_response>\n<tool_response>two pages</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_format_is_part_of_the_model_tag(smollm2):
    assert smollm2.spec.tag.endswith("+" + generic_tools.FORMAT)
    assert "+" not in tiny("tiny-qwen2").spec.tag  # a template with tool syntax renders its own way


def test_a_template_with_tool_syntax_keeps_its_own_format():
    qwen = tiny("tiny-qwen2")
    rules = reply_rules(qwen, ToolUse(tools=tuple(TOOLS)))
    assert rules.fmt is not None and rules.fmt.parser != generic_tools.FORMAT and rules.grammar is None
    assert "reply with nothing but the calls" not in qwen.render(ASK, tools=TOOLS)


# -- what the grammar accepts ----------------------------------------------------------

CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
TWO_CALLS = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
             '{"name": "search", "arguments": {"query": "rain", "limit": 3}}]</tool_call>')
CASES = [  # (tool_choice, parallel, answer schema, reply, accepted)
    ("auto", True, None, CALL, True),
    ("auto", True, None, TWO_CALLS, True),
    ("auto", True, None, "It is sunny.", True),
    ("auto", True, None, "I will call <tool_call>[]</tool_call>", False),  # the marker only opens a call
    ("auto", True, None, CALL.replace('"Paris"', "3"), False),  # city is a string
    ("auto", True, None, CALL.replace('{"city": "Paris"}', "{}"), False),  # city is required
    ("auto", True, None, CALL.replace("get_weather", "get_time"), False),  # no such function
    ("auto", True, None, TWO_CALLS.replace('"limit": 3', '"limit": 3, "x": 1'), False),  # no extra keys
    # get_weather leaves additionalProperties unsaid: its listed keys only, as llama.cpp and xgrammar read it
    ("auto", True, None, CALL.replace('{"city": "Paris"}', '{"city": "Paris", "temperature": 25}'), False),
    ("auto", True, None, CALL.replace('": "', '":"'), False),  # json.dumps's separators, no others
    ("auto", False, None, TWO_CALLS, False),  # parallel_tool_calls false: one call at most
    ("required", True, None, "It is sunny.", False),
    ("required", True, None, CALL, True),
    ("search", True, None, CALL, False),  # a named choice calls that function only
    ("search", True, None, '<tool_call>[{"name": "search", "arguments": {"query": "rain", "limit": 3}}]</tool_call>',
     True),
    ("none", True, None, CALL, False),
    ("none", True, None, "<b>Sunny</b>, 18 C.", True),
    ("auto", True, PERSON, '{"name": "Ada", "age": 36}', True),
    ("auto", True, PERSON, "Ada, 36", False),
    ("auto", True, PERSON, CALL, True),
]


def _accepts(lm: LoadedModel, grammar: str, text: str) -> bool:
    """llguidance's own verdict on ``text`` followed by the end of the reply."""
    reply = ReplyGrammar(lm.grammar_vocabulary, grammar)
    tokens = lm.tokenize(text)[0]
    if reply.matcher.try_consume_tokens(tokens) != len(tokens) or not reply.complete:
        return False
    return reply.matcher.consume_token(min(lm.eos_token_ids))


@pytest.mark.parametrize(("choice", "parallel", "schema", "reply", "accepted"), CASES)
def test_the_grammar_admits_exactly_the_replies_the_choice_allows(smollm2, choice, parallel, schema, reply, accepted):
    mode, name = (choice, None) if choice in ("auto", "required", "none") else ("required", choice)
    use = ToolUse(tools=tuple(TOOLS), choice=ToolChoice(mode=mode, name=name), parallel=parallel)
    rules = reply_rules(smollm2, use, ResponseFormat(schema=schema) if schema else None)
    assert rules.grammar is not None
    assert _accepts(smollm2, rules.grammar, reply) is accepted


def test_closed_objects_closes_what_lists_properties_and_keeps_what_says_otherwise():
    nested = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "pattern": {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        "free": {"type": "object"},
        "either": {"anyOf": [{"type": "object", "properties": {"b": {}}}, {"type": "string"}]}}}
    closed = generic_tools.closed_objects(nested)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] is True and "additionalProperties" not in props["pattern"]
    assert "additionalProperties" not in props["free"]  # lists no properties: any object
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the client's schema is not changed in place


@pytest.mark.parametrize(("reply", "accepted"), [('{"a": [1, 2.5, null], "b": {"c": "d"}}', True), ("{}", True),
                                                ("[1, 2]", False), ('"text"', False), ("Sure: {}", False),
                                                ('{"a":1}', False)])
def test_json_object_admits_any_object_and_nothing_else(smollm2, reply, accepted):
    # OpenAI's json_object: no schema, any object (written with json.dumps's separators)
    rules = reply_rules(smollm2, None, ResponseFormat())
    assert rules.grammar is not None and rules.fmt is None
    assert _accepts(smollm2, rules.grammar, reply) is accepted


@pytest.mark.parametrize("bad", [{"type": "banana"}, {"type": "object", "required": "city"}, [1],
                                 {"type": "string", "pattern": "("}])
def test_a_schema_that_cannot_constrain_a_reply_is_refused_with_the_reason(bad):
    assert schema_error(bad)
    with pytest.raises(ValueError, match="schema"):
        ResponseFormat(schema=bad) if isinstance(bad, dict) else ResponseFormat.of(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})


def test_keywords_the_engine_does_not_enforce_are_accepted():
    # what agent clients send: draft-07 markers, formats, propertyNames
    assert schema_error({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                         "properties": {"url": {"type": "string", "format": "uri"}},
                         "propertyNames": {"pattern": "^[a-z]+$"}}) == ""


# -- decoding under the grammar ----------------------------------------------------------


def _decode(lm: LoadedModel, messages: list[dict[str, Any]], use: ToolUse | None,
            answer: ResponseFormat | None = None, max_tokens: int = 60) -> Sequence:
    rules = reply_rules(lm, use, answer)
    seq = Sequence(lm, lm.render(messages, tools=[dict(t) for t in use.tools] if use else None), None,
                   SequenceSampling(max_tokens=max_tokens, grammar=rules.grammar), tool_calls=rules.splitter(use))
    seq.logits_trace = []
    for _ in decode_alone(seq):
        pass
    return seq


@pytest.mark.parametrize("choice", [ToolChoice(mode="required"), ToolChoice(mode="required", name="search")])
def test_a_required_call_decodes_to_arguments_valid_against_the_schema(smollm2, choice):
    seq = _decode(smollm2, ASK, ToolUse(tools=tuple(TOOLS), choice=choice))
    assert seq.finish_reason == "tool_calls" and seq.content == ""
    assert seq.tool_calls, seq.reply
    for call in seq.tool_calls:
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            assert isinstance(arguments["city"], str) and arguments.get("unit", "c") in ("c", "f")
        else:
            assert set(arguments) == {"query", "limit"} and isinstance(arguments["limit"], int)
    if choice.name:
        assert {c.name for c in seq.tool_calls} == {"search"}
    # the reply is the call as the client will send it back, rendered: the next turn extends it
    back = [{"role": "assistant", "content": None,
             "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                            for c in seq.tool_calls]}]
    assert generic_tools.render_messages(back, None)[0]["content"] == seq.reply


def test_a_json_schema_answer_decodes_to_a_valid_object(smollm2):
    seq = _decode(smollm2, [{"role": "user", "content": "Invent a person."}], None, ResponseFormat(schema=PERSON))
    value = json.loads(seq.reply)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_kvmem_decodes_what_mlx_lm_decodes_with_the_same_grammar_as_its_logits_processor(plain, mode):
    use = ToolUse(tools=tuple(TOOLS), choice=ToolChoice(mode=mode))
    seq = _decode(plain, ASK, use, max_tokens=40)
    grammar = reply_rules(plain, use).grammar
    assert grammar is not None
    prompt = mx.array(plain.tokenize(plain.render(ASK, tools=TOOLS))[0])
    reference = []
    for token, _ in generate_step(prompt, plain.model, max_tokens=len(seq.generated),
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                                  logits_processors=[ReplyGrammar(plain.grammar_vocabulary, grammar)]):
        reference.append(int(token))
    assert seq.generated == reference
    assert _accepts_prefix(plain, grammar, seq.generated)


def _accepts_prefix(lm: LoadedModel, grammar: str, tokens: list[int]) -> bool:
    reply = ReplyGrammar(lm.grammar_vocabulary, grammar)
    body = [t for t in tokens if t not in lm.eos_token_ids]
    return reply.matcher.try_consume_tokens(body) == len(body)


@pytest.mark.parametrize("run_ahead", [False, True])  # the GPU policy's decoding one step ahead
def test_constrained_and_free_rows_decode_in_one_batch_as_each_alone(plain, run_ahead):
    required = ToolUse(tools=tuple(TOOLS), choice=ToolChoice(mode="required"))
    rows = [  # (messages, tools, answer format)
        (ASK, required, None),
        ([{"role": "user", "content": "Tell me about Paris."}], None, None),
        ([{"role": "user", "content": "Invent a person."}], None, ResponseFormat(schema=PERSON)),
        (ASK, ToolUse(tools=tuple(TOOLS), choice=ToolChoice(mode="none")), None),
    ]
    alone = [_decode(plain, m, u, a, max_tokens=32) for m, u, a in rows]
    batched = []
    for messages, use, answer in rows:
        rules = reply_rules(plain, use, answer)
        seq = Sequence(plain, plain.render(messages, tools=[dict(t) for t in use.tools] if use else None), None,
                       SequenceSampling(max_tokens=32, grammar=rules.grammar), tool_calls=rules.splitter(use))
        seq.logits_trace = []
        while seq.prefill_step() is None:
            pass
        batched.append(seq)
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=run_ahead)
    for seq in batched:
        if seq.finish_reason is None:
            batch.add(seq)
    while len(batch):
        for seq, _ in batch.step_once():
            if seq.finish_reason is not None:
                batch.remove(seq)
    for a, b in zip(alone, batched, strict=True):
        assert b.generated == a.generated and b.reply == a.reply
    assert batched[1].grammar is None
    for seq in (batched[0], batched[2], batched[3]):  # what the grammar admits, as far as it went
        assert seq.grammar is not None and _accepts_prefix(plain, seq.params.grammar, seq.generated)


def test_the_mask_leaves_free_rows_untouched_and_forbids_the_rest(smollm2):
    grammar = ReplyGrammar(smollm2.grammar_vocabulary, answer_grammar(PERSON))
    logits = mx.random.normal((2, smollm2.grammar_vocabulary.n_vocab))
    masked = mask_rows([None, grammar], logits)
    assert mx.array_equal(masked[0], logits[0])
    allowed = [i for i in range(logits.shape[1]) if masked[1, i].item() != -float("inf")]
    assert allowed and all(smollm2.tokenizer.decode([i]).startswith("{") or smollm2.tokenizer.decode([i]) == "{"
                           for i in allowed)


def test_generic_calls_parse_through_the_splitter():
    assert GENERIC_CALLS.parser == generic_tools.FORMAT
    assert generic_tools.parse_calls('[{"name": "f", "arguments": {}}]') == [{"name": "f", "arguments": {}}]
    with pytest.raises(ValueError):
        generic_tools.parse_calls("[1]")
