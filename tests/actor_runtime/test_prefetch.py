"""Caches read ahead at start (actors/prefetch.py): the first turn after a restart waits for no disk.

The tests that can fail: a prefetched agent's turn runs warm even once its files are gone from
the disk (so the turn did not read them), replies exactly as the same turn loaded from disk
does, forgetting an agent drops its prefetched cache, and the budget takes the newest caches.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

import runtime  # noqa: F401
from actors import open_runtime
from actors.prefetch import Prefetcher
from conftest import models_dir
from runtime.persist import CacheDirectory

MODEL = "tiny-llama"
STORY = ("The lighthouse keeper counted the ships every evening and wrote their names in a green book. "
         "One night a ship with no name came past the rocks, and he wrote a question mark instead.")


def _open(home: Path, cache_dir: Path, **kw):
    return open_runtime(model=MODEL, home=home, models_dir=models_dir(), cache_dir=str(cache_dir), fsync=False,
                        handle_signals=False, **kw)


async def _prefetched(rt, count: int) -> None:
    with trio.fail_after(30):
        while rt.stats().store.prefetched < count:
            await trio.sleep(0.02)


async def _first_turns(home: Path, cache_dir: Path, agents: list[str]) -> None:
    async with _open(home, cache_dir, prefetch_mb=0) as rt:
        for name in agents:
            await rt.agent(name).send_prompt(f"{name}: {STORY}", max_tokens=6)


def _directory(cache_dir: Path) -> CacheDirectory:
    return CacheDirectory(cache_dir / "caches", fsync=False)  # Config.caches_path under a cache_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


async def test_a_prefetched_agent_resumes_without_reading_the_disk_and_replies_as_a_disk_load_does(
        tmp_path: Path) -> None:
    await _first_turns(tmp_path, tmp_path / "caches", ["keeper"])
    plain = _copy(tmp_path / "caches", tmp_path / "plain")
    follow_up = f"keeper: {STORY} What did he write?"

    async with _open(tmp_path, plain, prefetch_mb=0) as rt:  # the reference: the ordinary load from disk
        from_disk = await rt.agent("keeper").send_prompt(follow_up, max_tokens=8)
        assert rt.stats().store.prefetched == 0
    assert from_disk.usage.tier == "warm" and from_disk.usage.tokens_reused > 0

    async with _open(tmp_path, tmp_path / "caches", prefetch_mb=64) as rt:
        await _prefetched(rt, 1)
        # The files go; a turn that still resumes warm cannot have read them.
        directory = _directory(tmp_path / "caches")
        assert directory.exists("keeper")
        directory.delete("keeper")
        assert not directory.exists("keeper")
        resumed = await rt.agent("keeper").send_prompt(follow_up, max_tokens=8)
        store = rt.stats().store
    assert resumed.usage.tier == "warm" and store.prefetch_hits == 1 and store.prefetch_held_bytes == 0
    assert store.prefetch_restored == 1  # restored on the MLX thread before the runtime was handed out
    assert (resumed.reply, resumed.usage.tokens_reused, resumed.usage.tokens_prefilled) == \
        (from_disk.reply, from_disk.usage.tokens_reused, from_disk.usage.tokens_prefilled)


async def test_forgetting_a_prefetched_agent_drops_its_cache(tmp_path: Path) -> None:
    await _first_turns(tmp_path, tmp_path / "caches", ["gone"])
    async with _open(tmp_path, tmp_path / "caches", prefetch_mb=64) as rt:
        await _prefetched(rt, 1)
        assert rt.stats().store.prefetch_held_bytes > 0
        assert await rt.agent("gone").forget()
        again = await rt.agent("gone").send_prompt(f"gone: {STORY} Again?", max_tokens=4)
        store = rt.stats().store
    assert again.usage.tier == "cold" and again.usage.tokens_reused == 0
    assert store.prefetch_hits == 0 and store.prefetch_held_bytes == 0


async def test_no_prefetch_when_switched_off(tmp_path: Path) -> None:
    await _first_turns(tmp_path, tmp_path / "caches", ["idle"])
    async with _open(tmp_path, tmp_path / "caches", prefetch_mb=0) as rt:
        await trio.sleep(0.3)
        resumed = await rt.agent("idle").send_prompt(f"idle: {STORY} More?", max_tokens=4)
        store = rt.stats().store
    assert resumed.usage.tier == "warm" and store.prefetched == 0 and store.prefetch_hits == 0


async def test_the_budget_takes_the_newest_caches_first(tmp_path: Path) -> None:
    await _first_turns(tmp_path, tmp_path / "caches", ["oldest", "middle", "newest"])
    directory = _directory(tmp_path / "caches")
    entries = {e.agent_id: e for e in directory.list_agents()}
    assert entries["oldest"].updated_at < entries["middle"].updated_at < entries["newest"].updated_at

    async def disk(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    budget = entries["newest"].disk_bytes + entries["middle"].disk_bytes + entries["oldest"].disk_bytes // 2
    prefetcher = Prefetcher(directory.list_agents, directory.load, disk, budget_bytes=budget, keep_s=0.0)
    await prefetcher.run()  # keep_s = 0: reads, then drops what no turn took
    assert prefetcher.read == 2

    prefetcher = Prefetcher(directory.list_agents, directory.load, disk, budget_bytes=budget, keep_s=60.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefetcher.run)
        await prefetcher.done.wait()
        tag = entries["newest"].model_tag
        assert await prefetcher.take("oldest", tag) is None
        newest = await prefetcher.take("newest", tag)
        assert newest is not None and newest[0].num_tokens == entries["newest"].num_tokens and newest[1] is None
        assert await prefetcher.take("newest", tag) is None  # one turn only
        assert (await prefetcher.take("middle", tag)) is not None
        assert prefetcher.held_bytes == 0
        nursery.cancel_scope.cancel()


async def test_a_watcher_set_around_the_start_sees_each_cache_read_then_restored(tmp_path: Path) -> None:
    from actors.prefetch import prefetch_progress

    await _first_turns(tmp_path, tmp_path / "caches", ["first", "second"])
    reports: list[tuple[str, int, int]] = []
    token = prefetch_progress.set(lambda step, done, total: reports.append((step, done, total)))
    try:
        async with _open(tmp_path, tmp_path / "caches", prefetch_mb=64):
            pass  # open_runtime returns once both are restored
    finally:
        prefetch_progress.reset(token)
    assert reports == [("read", 0, 2), ("read", 1, 2), ("read", 2, 2),
                       ("restore", 0, 2), ("restore", 1, 2), ("restore", 2, 2)]

    def broken(step: str, done: int, total: int) -> None:
        raise RuntimeError("a watcher's bug")

    token = prefetch_progress.set(broken)
    try:
        async with _open(tmp_path, tmp_path / "caches", prefetch_mb=64) as rt:
            resumed = await rt.agent("first").send_prompt(f"first: {STORY} And?", max_tokens=4)
    finally:
        prefetch_progress.reset(token)
    assert resumed.usage.tier == "warm" and rt.stats().store.prefetched == 2  # the start went on without it


@pytest.mark.parametrize("budget_mb", [0.001])
async def test_caches_larger_than_the_budget_are_not_read(tmp_path: Path, budget_mb: float) -> None:
    await _first_turns(tmp_path, tmp_path / "caches", ["big"])
    async with _open(tmp_path, tmp_path / "caches", prefetch_mb=budget_mb) as rt:
        await trio.sleep(0.3)
        resumed = await rt.agent("big").send_prompt(f"big: {STORY} And?", max_tokens=4)
        store = rt.stats().store
    assert resumed.usage.tier == "warm" and store.prefetched == 0


async def test_tenants_agents_are_prefetched_from_their_own_subtrees(tmp_path: Path) -> None:
    from runtime.identity import namespaced

    acme_bob = namespaced("acme", "bob")
    await _first_turns(tmp_path, tmp_path / "caches", [acme_bob, "plain"])
    assert (tmp_path / "caches" / "caches" / "tenants" / "acme").is_dir()
    async with _open(tmp_path, tmp_path / "caches", prefetch_mb=64) as rt:
        await _prefetched(rt, 2)
        resumed = await rt.agent(acme_bob).send_prompt(f"{acme_bob}: {STORY} Who?", max_tokens=4)
        store = rt.stats().store
    assert resumed.usage.tier == "warm" and resumed.usage.tokens_reused > 0 and store.prefetch_hits == 1
