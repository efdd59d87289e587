"""One cache per agent and model: talking to an agent with model B never replaces its model-A cache.

The same agent switches back and forth between two models, through the actor
runtime (the fake engine, then real MLX tiny models), across a restart; each
model resumes its own cache (``usage.tier`` / ``usage.tokens_reused``) and
never the other's. The hot tier (the GPU actor's :class:`actors.gpu_caches.AgentCaches`) is
checked on its own too, with the store behind it: the GPU actor drops a model's hot caches when
it swaps, so only this shows an A→B→A agent coming back hot.
"""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import models_dir

from actors import open_runtime
from actors.cache_store import CacheStoreActor
from actors.gpu_caches import AgentCaches
from fake_engine import FAKE_TOKEN_BYTES, FakeEngine, FakeParked
from actors.mailbox import ask
from actors.messages_agent import TurnResult
from actors.messages_store import (
    AgentsListed,
    Forget,
    Forgotten,
    ListAgents,
    Load,
    StoreInbox,
)
from runtime.plan.hot_tier import HotTier
from runtime.persist import CacheDirectory
from runtime.spec import BLOCK_TOKENS

TAG_A = "fake-a@0000/fake"
TAG_B = "fake-b@0000/fake"


def _fake_runtime(home: Path, engine: FakeEngine | None = None):
    return open_runtime(
        model="fake-a", home=home, engine=engine or FakeEngine(), fsync=False, handle_signals=False, models=["fake-b"]
    )


def _cached(records: list, agent_id: str) -> dict[str, int]:
    """Tokens of each model's cache of ``agent_id``."""
    return {r.model_tag: r.num_tokens for r in records if r.agent_id == agent_id}


def _assert_resumed(result: TurnResult, tier: str, cached_tokens: int) -> None:
    """The turn started from the whole of its own model's cache of ``cached_tokens`` tokens."""
    usage = result.usage
    assert (usage.tier, usage.match) == (tier, "extend"), usage
    assert usage.tokens_reused == cached_tokens, (usage, cached_tokens)


async def test_an_agent_switching_models_resumes_each_models_own_cache(tmp_path: Path) -> None:
    engine = FakeEngine()
    # One conversation for both models: the other model's cache would be reusable text.
    prompt = "The harbour at dawn:"
    async with _fake_runtime(tmp_path, engine) as rt:
        x = rt.agent("x")
        a1 = await x.send_prompt(prompt, max_tokens=4)
        assert a1.usage.tier == "cold"
        prompt += a1.reply + " then"
        b1 = await x.send_prompt(prompt, max_tokens=4, model="fake-b")
        assert (b1.model, b1.usage.tier, b1.usage.tokens_reused) == ("fake-b", "cold", 0)  # never A's cache
        cached = _cached(await rt.list_agents("x"), "x")
        # Each holds its prompt and reply but the last reply token (not yet run through the model).
        assert cached == {TAG_A: len(prompt) - len(" then") - 1, TAG_B: len(prompt) + 3}

        prompt += b1.reply + " and"
        a2 = await x.send_prompt(prompt, max_tokens=4)  # the swap dropped A's hot cache: from disk
        assert a2.model == "fake-a"
        _assert_resumed(a2, "warm", cached[TAG_A])
        prompt += a2.reply + " so"
        b2 = await x.send_prompt(prompt, max_tokens=4, model="fake-b")
        _assert_resumed(b2, "warm", cached[TAG_B])
        b3 = await x.send_prompt(prompt + b2.reply + " again", max_tokens=4, model="fake-b")
        _assert_resumed(b3, "hot", len(prompt) + 3)
        cached = _cached(await rt.list_agents("x"), "x")
        records = await rt.list_agents("x")
        assert [r.model_tag for r in records] == [TAG_B, TAG_A]  # the cache used last first
    assert engine.loads == ["fake-a", "fake-b", "fake-a", "fake-b"]

    async with _fake_runtime(tmp_path) as rt:  # after a restart, each from its own file
        x = rt.agent("x")
        a3 = await x.send_prompt(prompt + a2.reply, max_tokens=2)
        _assert_resumed(a3, "warm", cached[TAG_A])
        b4 = await x.send_prompt(prompt + b2.reply + " again" + b3.reply + ".", max_tokens=2, model="fake-b")
        _assert_resumed(b4, "warm", cached[TAG_B])
        assert await x.forget() is True  # every model's cache
        assert await rt.list_agents("x") == []
    directory = CacheDirectory(tmp_path / "caches", fsync=False)
    assert not directory.exists("x") and directory.list_agents() == []


def _parked(tag: str, text: str) -> FakeParked:
    return FakeParked(tag, text, tuple(ord(c) for c in text), tuple(range(1, len(text) + 1)))


def _keep(caches: AgentCaches, agent_id: str, parked: FakeParked) -> None:
    """A turn's end as the GPU actor carries it out: the new cache hot, its copy to the store."""
    caches.keep(1, agent_id, parked, parked.to_snapshot(), block_bytes=BLOCK_TOKENS * FAKE_TOKEN_BYTES,
                share_prefix=False, leased=False, now=0.0)


async def test_the_hot_tier_keeps_one_cache_per_agent_and_model(tmp_path: Path) -> None:
    directory = CacheDirectory(tmp_path / "caches", fsync=False)
    a, b = _parked(TAG_A, "on model a"), _parked(TAG_B, "on model b, longer")
    send, receive = trio.open_memory_channel[StoreInbox](0)
    store = CacheStoreActor(receive, directory=directory)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        async with send:
            caches = AgentCaches(send, HotTier(hot_budget_bytes=1 << 20))
            caches.start(nursery)
            _keep(caches, "x", a)
            _keep(caches, "x", b)  # A → B: A's hot cache stays
            for tag, parked in ((TAG_A, a), (TAG_B, b)):
                hit = await caches.check_out("x", tag, share_prefix=False)
                assert hit.own.tier == "hot" and hit.own.source.parked is parked and not hit.leased
            assert caches.hot_stats().hot_agents == 2
            listed = await ask(send, lambda r: ListAgents(agent_id="x", reply=r, hot=caches.listing()))
            assert isinstance(listed, AgentsListed)
            assert [(r.model_tag, r.num_tokens, r.hot) for r in listed.agents] == [
                (TAG_B, b.num_tokens, True),  # used last
                (TAG_A, a.num_tokens, True),
            ]
            forgotten = await ask(send, lambda r: Forget(agent_id="x", reply=r, had_hot=caches.forget_here("x")))
            assert isinstance(forgotten, Forgotten) and forgotten.existed
            for tag in (TAG_A, TAG_B):
                miss = await caches.check_out("x", tag, share_prefix=False)  # the store's Load: nothing
                assert miss.own is None
            assert caches.hot_stats().hot_agents == 0
    assert directory.list_agents() == []

    # On disk, a new store (a restart) loads each model's cache from its own file.
    directory.save("x", a.to_snapshot())
    directory.save("x", b.to_snapshot())
    send, receive = trio.open_memory_channel[StoreInbox](0)
    store = CacheStoreActor(receive, directory=directory)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        async with send:
            for tag, parked in ((TAG_A, a), (TAG_B, b)):
                warm = await ask(send, lambda r, tag=tag: Load(agent_id="x", model_tag=tag, reply=r))
                assert warm.own.tier == "warm" and warm.own.source.snapshot.text == parked.text


# -- real models ------------------------------------------------------------------------


def _mlx_runtime(home: Path):
    return open_runtime(
        model="tiny-llama", home=home, models_dir=models_dir(), fsync=False, handle_signals=False, models=["tiny-qwen2"]
    )


async def test_real_models_switching_back_and_forth_each_resume_their_own_cache(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Describe the harbour at dawn."}]

    def more(reply: str, question: str) -> None:
        messages.extend([{"role": "assistant", "content": reply}, {"role": "user", "content": question}])

    async with _mlx_runtime(tmp_path) as rt:
        x = rt.agent("x")
        a1 = await x.send(messages, max_tokens=6)
        assert (a1.model, a1.usage.tier) == ("tiny-llama", "cold")
        more(a1.reply, "And at noon?")
        b1 = await x.send(messages, max_tokens=6, model="tiny-qwen2")
        assert (b1.model, b1.usage.tier, b1.usage.tokens_reused) == ("tiny-qwen2", "cold", 0)
        records = await rt.list_agents("x")
        assert len(records) == 2 and records[0].model_tag != records[1].model_tag
        tag_b, tag_a = (r.model_tag for r in records)  # the cache used last first
        assert tag_a.startswith("tiny-llama") and tag_b.startswith("tiny-qwen2"), (tag_a, tag_b)
        cached = _cached(records, "x")

        more(b1.reply, "And at dusk?")
        assert cached[tag_a] < cached[tag_b]  # B's cache holds more of the conversation
        a2 = await x.send(messages, max_tokens=6)  # the swap dropped A's hot cache: from disk
        _assert_resumed(a2, "warm", cached[tag_a])
        more(a2.reply, "And at night?")
        b2 = await x.send(messages, max_tokens=6, model="tiny-qwen2")
        _assert_resumed(b2, "warm", cached[tag_b])
        cached = _cached(await rt.list_agents("x"), "x")

    more(b2.reply, "And the next morning?")
    async with _mlx_runtime(tmp_path) as rt:
        x = rt.agent("x")
        a3 = await x.send(messages, max_tokens=4)
        _assert_resumed(a3, "warm", cached[tag_a])
        b3 = await x.send(messages, max_tokens=4, model="tiny-qwen2")
        _assert_resumed(b3, "warm", cached[tag_b])
        assert {r.model_tag for r in await rt.list_agents("x")} == {tag_a, tag_b}
