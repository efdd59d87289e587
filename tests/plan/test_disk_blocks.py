"""A prompt's first whole blocks read from the tenant's disk by their hash chain: a sibling agent after a
restart, a return to an earlier branch, within a tenant only.

The store reads them (runtime.persist.prefix_blocks), the GPU actor asks for them once a turn's prompt is
tokenized (runtime.plan.disk_blocks). References: the arrays a save wrote (read back through the
agent's own manifest, the format's ordinary load), and the fake engine's counts, one token per character.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actors import open_runtime
from fake_engine import FakeEngine, FakeParked, fake_reply
from runtime.identity import namespaced
from runtime.persist import CacheDirectory
from runtime.plan.turn_plan import COLD, FromHot, FromWarm, Tokenized, TurnPlan
from runtime.plan.disk_blocks import blocks_to_look_up, start_from_blocks
from runtime.spec import BLOCK_TOKENS, LayerKind

TAG = "fake-a"
SYSTEM = "".join(chr(97 + (i * 7) % 26) for i in range(2 * BLOCK_TOKENS + 100))  # 612 tokens, one a character


def _parked(text: str) -> FakeParked:
    return FakeParked(TAG, text, tuple(ord(c) for c in text), tuple(range(1, len(text) + 1)))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def layers_tokens(layers) -> int:
    return layers[0].arrays["k"].shape[1] if layers else 0


# -- reading blocks ----------------------------------------------------------------------------------


def test_the_longest_run_of_stored_blocks_is_read_and_equals_what_was_saved(tmp_path: Path) -> None:
    disk = CacheDirectory(tmp_path, fsync=False)
    saved = _parked(SYSTEM + " first question").to_snapshot()
    disk.save("donor", saved)
    layers = disk.read_prefix_blocks(TAG, _ids(SYSTEM + " second"), layer_kinds=[LayerKind.FLOAT])
    assert len(layers) == 1 and layers[0].kind is LayerKind.FLOAT
    for key in ("k", "v"):
        np.testing.assert_array_equal(layers[0].arrays[key], saved.layers[0].arrays[key][:, : 2 * BLOCK_TOKENS])
    # A prompt that parts inside the second block: the first only.
    cut = _ids(SYSTEM[:300] + "X" * 400)
    assert layers_tokens(disk.read_prefix_blocks(TAG, cut, layer_kinds=[LayerKind.FLOAT])) == BLOCK_TOKENS
    # Nothing in common, fewer than a block, another model, a sliding layer: nothing.
    assert disk.read_prefix_blocks(TAG, _ids("Z" + SYSTEM), layer_kinds=[LayerKind.FLOAT]) == []
    assert disk.read_prefix_blocks(TAG, _ids(SYSTEM[:200]), layer_kinds=[LayerKind.FLOAT]) == []
    assert disk.read_prefix_blocks("fake-b", _ids(SYSTEM), layer_kinds=[LayerKind.FLOAT]) == []
    assert disk.read_prefix_blocks(TAG, _ids(SYSTEM), layer_kinds=[LayerKind.SLIDING]) == []
    # The model's layers must be the block's.
    assert disk.read_prefix_blocks(TAG, _ids(SYSTEM), layer_kinds=[LayerKind.FLOAT, LayerKind.FLOAT]) == []


def test_a_damaged_block_ends_the_run_is_removed_and_logged(tmp_path: Path, caplog) -> None:
    disk = CacheDirectory(tmp_path, fsync=False)
    disk.save("donor", _parked(SYSTEM + " first").to_snapshot())
    second = disk.paths.block_path(disk.block_hashes(TAG, _ids(SYSTEM))[1])
    raw = bytearray(second.read_bytes())
    raw[-3] ^= 0xFF
    second.write_bytes(bytes(raw))
    layers = disk.read_prefix_blocks(TAG, _ids(SYSTEM + " second"), layer_kinds=[LayerKind.FLOAT])
    assert layers_tokens(layers) == BLOCK_TOKENS
    assert not second.exists() and "damaged" in caplog.text


# -- the plan ----------------------------------------------------------------------------------------


def test_a_turn_looks_for_blocks_only_where_they_could_give_it_more() -> None:
    prompt = SYSTEM + " second"
    cold = Tokenized(ids=tuple(_ids(prompt)), ends=tuple(range(1, len(prompt) + 1)))
    floats = [LayerKind.FLOAT]
    assert blocks_to_look_up(COLD, cold, share_prefix=True, layer_kinds=floats) == tuple(_ids(prompt))[:-1]
    assert blocks_to_look_up(COLD, cold, share_prefix=False, layer_kinds=floats) is None  # opted out
    assert blocks_to_look_up(COLD, cold, share_prefix=True, layer_kinds=[LayerKind.SLIDING]) is None
    assert blocks_to_look_up(COLD, cold, share_prefix=True, layer_kinds=()) is None  # an engine that cannot
    short = Tokenized(ids=tuple(_ids(prompt[:BLOCK_TOKENS])), ends=tuple(range(1, BLOCK_TOKENS + 1)))
    assert blocks_to_look_up(COLD, short, share_prefix=True, layer_kinds=floats) is None  # no whole block + 1

    # A plan that reuses its own cache's first tokens: a lookup only for a block or more beyond them.
    long = SYSTEM + "y" * 500  # 1,112 tokens: four whole blocks before the last token
    own = _parked(long[:300] + " an older branch")
    for reused, asked in ((300, True), (3 * BLOCK_TOKENS + 10, False)):
        plan = TurnPlan(tier="hot", source=FromHot(parked=own if reused == 300 else _parked(long)), match="partial",
                        reuse_tokens=reused, reuse_chars=reused)
        rest = Tokenized(ids=tuple(_ids(long[reused:])), ends=tuple(range(1, len(long) - reused + 1)))
        wanted = blocks_to_look_up(plan, rest, share_prefix=True, layer_kinds=floats)
        assert (wanted == tuple(_ids(long))[:-1]) if asked else wanted is None, reused

    layers = _parked(prompt[: 2 * BLOCK_TOKENS]).to_snapshot().layers
    started = start_from_blocks(COLD, cold, prompt, model_tag=TAG, reused=2 * BLOCK_TOKENS, layers=layers)
    assert started is not None
    plan, tokens = started
    assert (plan.tier, plan.match, plan.reuse_tokens, plan.reuse_chars) == ("warm", "extend", 512, 512)
    assert isinstance(plan.source, FromWarm) and plan.source.snapshot.text == prompt[:512]
    assert plan.suffix(prompt) == prompt[512:] and list(tokens.ids) == _ids(prompt[512:])
    assert tokens.ends == tuple(range(1, len(prompt) - 512 + 1))
    assert start_from_blocks(COLD, cold, prompt, model_tag=TAG, reused=0, layers=[]) is None


# -- through the runtime -----------------------------------------------------------------------------


def _open(home: Path, **kw):
    return open_runtime(model=TAG, home=home, engine=FakeEngine(), fsync=False, handle_signals=False, **kw)


async def test_a_sibling_after_a_restart_starts_from_the_first_agents_blocks_within_its_tenant(tmp_path: Path) -> None:
    async with _open(tmp_path) as rt:
        await rt.agent("donor").send_prompt(SYSTEM + " first", max_tokens=2)
        await rt.agent(namespaced("acme", "donor")).send_prompt(SYSTEM + " first", max_tokens=2)
    async with _open(tmp_path) as rt:  # a restart: nothing in RAM
        prompt = SYSTEM + " second"
        sibling = await rt.agent("sibling").send_prompt(prompt, max_tokens=3)
        assert sibling.reply == fake_reply(prompt, 3)
        assert (sibling.usage.tier, sibling.usage.tokens_reused) == ("warm", 2 * BLOCK_TOKENS)
        assert sibling.usage.tokens_prefilled == len(prompt) - 2 * BLOCK_TOKENS
        private = await rt.agent("private", share_prefix=False).send_prompt(prompt, max_tokens=3)
        assert private.usage.tier == "cold"  # opted out: it starts from nobody's prefix
        other = await rt.agent(namespaced("globex", "sibling")).send_prompt(prompt, max_tokens=3)
        assert other.usage.tier == "cold"  # another tenant's blocks are never read
        own_tenant = await rt.agent(namespaced("acme", "sibling")).send_prompt(prompt, max_tokens=3)
        assert (own_tenant.usage.tier, own_tenant.usage.tokens_reused) == ("warm", 2 * BLOCK_TOKENS)
        assert rt.stats().store.block_reads == 2


async def test_an_agent_returning_to_an_earlier_branch_reuses_it_from_disk(tmp_path: Path) -> None:
    """Branch A, then branch B from the middle of A (its hot cache is now B), then back to A: the hot cache
    gives what A and B share, the disk A's whole blocks beyond (still stored: blocks go only at garbage
    collection, after a forget)."""
    branch_a = SYSTEM + "".join(chr(65 + i % 26) for i in range(600))
    async with _open(tmp_path) as rt:
        agent = rt.agent("writer")
        first = await agent.send_prompt(branch_a, max_tokens=2)
        assert first.usage.tier == "cold"
        branch_b = SYSTEM + " rewind: another way"
        second = await agent.send_prompt(branch_b, max_tokens=2)
        assert second.usage.tier == "hot" and second.usage.tokens_reused == len(SYSTEM)
        await rt.flush()
        back = branch_a + " and on"
        third = await agent.send_prompt(back, max_tokens=2)
        assert third.reply == fake_reply(back, 2)
        assert third.usage.tier == "warm" and third.usage.tokens_reused == len(branch_a) // BLOCK_TOKENS * BLOCK_TOKENS
        assert third.usage.tokens_reused > len(SYSTEM)
