"""One record of a turn's sampling options, decoded once (issue 60, item 3).

A client names its options one way or another (keyword arguments of the Python API, each HTTP API's request);
each becomes one :class:`runtime.plan.sampling.SamplingOptions`, by name, and the engine's sequence takes
every option of the same name from it. These tests fail when an option is dropped on one of those ways, so a
new option needs its field, its use in the sampler, and the API fields that name it — no mapping line beside.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from actors.messages_agent import ChatTurn, TurnOptions
from gateway.schemas_agents import AgentTurnRequest
from gateway.schemas_openai import ChatCompletionRequest
from runtime.execution.sampling import SequenceSampling
from runtime.plan.sampling import _REQUEST_NAMES, Penalties, SamplingOptions

SOME = dict(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, stop=["END"], seed=11, presence_penalty=0.5,
            frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={3: 2.0}, logprobs=2, fit_context=True)
"""A value other than the default for every option a client names."""


def test_every_option_a_client_names_is_a_keyword_of_the_python_api() -> None:
    assert set(SOME) == set(_REQUEST_NAMES)
    assert set(_REQUEST_NAMES) <= set(TurnOptions.__annotations__)


def test_single_options_and_a_whole_sampling_make_one_turn() -> None:
    single = ChatTurn.of("a", prompt="x", **SOME)
    whole = ChatTurn.of("a", prompt="x", sampling=SamplingOptions.of(**SOME))
    assert single == whole
    assert single.sampling == SamplingOptions(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, stop=("END",), seed=11,
        penalties=Penalties(presence=0.5, frequency=-0.5, repetition=1.1), logit_bias=((3, 2.0),), logprobs=2,
        fit_context=True)


def test_an_unknown_option_or_both_ways_at_once_is_refused() -> None:
    with pytest.raises(TypeError, match="top_q"):
        ChatTurn.of("a", prompt="x", top_q=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="not both"):
        ChatTurn.of("a", prompt="x", sampling=SamplingOptions(), temperature=0.5)


def test_a_request_gives_each_option_it_spells_as_kvmem_does_and_what_it_leaves_unset_stays_default() -> None:
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **SOME})
    request = msgspec.json.decode(body, type=AgentTurnRequest)
    # every option but logprobs, which kvmem's own API does not take (a field it lacks is left unset)
    assert SamplingOptions.of_request(request, fit_context=True) == SamplingOptions.of(**{**SOME, "logprobs": None})
    bare = msgspec.json.decode(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
                               type=ChatCompletionRequest)
    assert SamplingOptions.of_request(bare, logprobs=None) == SamplingOptions()  # None: unset, not a value
    asked = msgspec.json.decode(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5, "seed": 3, "temperature": 1.5}',
        type=ChatCompletionRequest)
    got = SamplingOptions.of_request(asked, temperature=0.0, logprobs=None)  # what the API maps itself wins
    assert (got.top_p, got.seed, got.temperature) == (0.5, 3, 0.0)


def test_the_sequence_takes_every_option_it_shares_a_name_with() -> None:
    options = SamplingOptions.of(**SOME)
    sequence = SequenceSampling.of(options, top_k=2)
    shared = {f.name for f in dataclasses.fields(SequenceSampling)} & set(SamplingOptions.__struct_fields__)
    assert shared >= {"max_tokens", "temperature", "top_p", "stop", "seed", "penalties", "logprobs"}
    for name in shared - {"logit_bias", "top_k"}:
        assert getattr(sequence, name) == getattr(options, name), name
    assert sequence.logit_bias == {3: 2.0} and sequence.top_k == 2  # a mapping; the engine's own top-k wins
