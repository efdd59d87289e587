"""Several replies to one prompt (``n`` > 1, issue 59 item 4): one prefill, one batch, the first sample the agent's.

The first sample prefills the prompt from the agent's own cache; the others wait for it, then start from
its prompt to its last token (each prefills one token: its own first token comes from its own sampler)
and decode beside it as rows of the batch. References: each sample's reply is the one a lone turn of the
same prompt gets with the seed + its index, started as it starts (batched vs alone: the first cold or
from the agent's cache, the others from the prompt cached, to its last token); the agent's cache
afterwards is the first sample's conversation (the next turn extends it).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import trio
from conftest import models_dir

from actors import open_runtime
from actors.messages_agent import MAX_SAMPLES, ChatTurn
from gateway.testing import ServerThread
from runtime.config import Config

SHORT = [{"role": "user", "content": "Tell me about the sea."}]
LONG = [{"role": "system", "content": "You keep a lighthouse on a rocky coast. " * 12},
        {"role": "user", "content": "What did you see tonight?"}]


@pytest.mark.parametrize("messages", [SHORT, LONG], ids=["short prompt", "long prompt"])
async def test_samples_start_from_one_prefill_and_are_each_the_reply_of_a_lone_turn(tmp_path, messages) -> None:
    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False) as rt:
        result = await rt.agent("many").send(messages, max_tokens=10, temperature=0.9, seed=40, n=3)
        assert [r.reply for r in (result, *result.samples)] == [await _alone(rt, f"alone-{i}", messages, seed=40 + i,
                                                                            warm=i > 0) for i in range(3)]
        prompt = result.usage.tokens_reused + result.usage.tokens_prefilled
        assert result.usage.tokens_prefilled == prompt, "the first sample prefills the prompt"
        for sample in result.samples:
            assert (sample.usage.tokens_reused, sample.usage.tokens_prefilled) == (prompt - 1, 1), \
                "the others start from its prompt: each prefills its last token"
            assert sample.usage.tier == "shared"
        # The agent's cache is the first sample's conversation: the next turn extends it.
        follow = [*messages, result.assistant_message(), {"role": "user", "content": "And then?"}]
        nxt = await rt.agent("many").send(follow, max_tokens=4)
        assert nxt.usage.match == "extend" and nxt.usage.tokens_reused > prompt
        assert sorted(a.agent_id for a in await rt.list_agents()) == ["alone-0", "alone-1", "alone-2", "many"]


async def _alone(rt, agent_id: str, messages, *, warm: bool, **options) -> str:
    """The reply a lone turn of ``messages`` gets: cold (the first sample's start), or ``warm``, from the prompt
    already in the agent's cache (Q4 at rest) to its last token, as the other samples start from the first's."""
    agent = rt.agent(agent_id)
    if warm:
        await agent.send(messages, max_tokens=2)
    result = await agent.send(messages, max_tokens=10, temperature=0.9, **options)
    assert (result.usage.tokens_prefilled == 1) == warm
    return result.reply


async def test_a_greedy_turn_s_samples_are_one_reply_and_a_hot_agent_s_samples_reuse_its_cache(tmp_path) -> None:
    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False) as rt:
        agent = rt.agent("greedy")
        first = await agent.send(LONG, max_tokens=6)
        follow = [*LONG, first.assistant_message(), {"role": "user", "content": "Go on."}]
        result = await agent.send(follow, max_tokens=8, n=4)
        assert result.usage.match == "extend" and result.usage.tier == "hot"
        prompt = result.usage.tokens_reused + result.usage.tokens_prefilled
        assert len(result.samples) == 3 and all(s.usage.tokens_reused == prompt - 1 for s in result.samples)
        # Greedy: the samples decode one reply, the one a lone turn decodes from the same cached prompt (its
        # conversation built as this agent's was, then the prompt parked, to its last token).
        alone = rt.agent("greedy-alone")
        assert (await alone.send(LONG, max_tokens=6)).reply == first.reply
        await alone.send(follow, max_tokens=2)
        assert {s.reply for s in result.samples} == {(await alone.send(follow, max_tokens=8)).reply}


async def test_streamed_samples_come_with_their_index_and_spell_their_replies(tmp_path) -> None:
    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False) as rt:
        texts: dict[int, str] = {}
        async with rt.agent("streamer").stream(LONG, max_tokens=8, temperature=1.0, seed=9, n=3) as stream:
            async for index, item in stream.choices():
                assert isinstance(item, str)
                texts[index] = texts.get(index, "") + item
        result = stream.result
        assert result is not None
        assert texts == {i: r.content for i, r in enumerate((result, *result.samples))}


async def test_a_cancelled_turn_cancels_its_samples(tmp_path) -> None:
    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False) as rt:
        with trio.move_on_after(0.5):
            await rt.agent("left").send(LONG, max_tokens=2000, temperature=1.0, n=3, fit_context=True)
        with trio.fail_after(60):
            await rt.wait_idle()  # nothing left running on the GPU actor
        assert rt.running_turns() == []


def test_n_is_bounded() -> None:
    assert ChatTurn.of("a", prompt="x", n=MAX_SAMPLES).n == MAX_SAMPLES
    for n in (0, MAX_SAMPLES + 1):
        with pytest.raises(ValueError, match="n must be"):
            ChatTurn.of("a", prompt="x", n=n)


# -- over HTTP, with the official OpenAI SDK ------------------------------------------------------------------

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    config = Config(model=MODEL, port=0, home=str(models_dir().parent),
                    cache_dir=str(tmp_path_factory.mktemp("caches")), budget_mb=256, hot_budget_mb=64)
    with ServerThread(config) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, user: str, **extra):
    options = {"max_tokens": 8, "temperature": 1.0, "seed": 5, **extra}
    return client.chat.completions.create(model=MODEL, user=user, messages=LONG, **options)


def _ask_alone(client: openai.OpenAI, user: str, *, warm: bool, **extra) -> str | None:
    """A lone request's reply, started as a sample starts (see ``_alone``)."""
    if warm:
        _ask(client, user, max_tokens=2)
    return _ask(client, user, **extra).choices[0].message.content


def test_openai_n_gives_n_choices_streamed_and_not(client: openai.OpenAI) -> None:
    whole = _ask(client, "http-n", n=3, logprobs=True)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    replies = [c.message.content for c in whole.choices]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) + (c.finish_reason == "stop")
                                                for c in whole.choices)
    assert [_ask_alone(client, f"http-alone-{i}", warm=i > 0, seed=5 + i) for i in range(3)] == replies

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in _ask(client, "http-n-streamed", n=3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts == dict(enumerate(replies)) and set(finished) == {0, 1, 2}


def test_openai_n_out_of_range_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n"):
        _ask(client, "http-bad", n=MAX_SAMPLES + 1)
