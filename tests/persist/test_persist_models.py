"""CacheDirectory keeps one cache per agent and model: saves of one model never touch another's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_persist import (
    kill_at_rename,
    TAG,
    agent_dir,
    assert_same,
    block_files,
    legacy_manifest_path,
    make_ids,
    make_snapshot,
    manifest_path,
    own_files,
)

from runtime.errors import CacheMiss, CorruptCacheError, ForeignModelError
from runtime.persist import CacheDirectory

OTHER = "tiny-qwen2@89abcdef/q4g64"


@pytest.fixture
def cache(tmp_path: Path) -> CacheDirectory:
    return CacheDirectory(tmp_path / "cache", fsync=False)


def test_an_agent_keeps_one_cache_per_model_and_each_loads_bit_exactly(cache: CacheDirectory) -> None:
    a = make_snapshot(600)
    b = make_snapshot(700, model_tag=OTHER, salt=5)
    cache.save("x", a)
    cache.save("x", b)
    assert_same(cache.load("x", model_tag=TAG), a)
    assert_same(cache.load("x", model_tag=OTHER), b)
    assert manifest_path(cache, "x", TAG) != manifest_path(cache, "x", OTHER)
    assert cache.exists("x", model_tag=TAG) and cache.exists("x", model_tag=OTHER)
    assert not cache.exists("x", model_tag="third@0/q4g64")
    assert [(e.agent_id, e.model_tag, e.num_tokens) for e in cache.list_agents()] == sorted(
        [("x", TAG, 600), ("x", OTHER, 700)]
    )
    # Back to model A: its save extends its own cache, written once per token.
    longer = make_snapshot(900)
    report = cache.save("x", longer)
    assert report.tokens_written == 900 - 600 and report.blocks_reused == 2
    assert_same(cache.load("x", model_tag=TAG), longer)
    assert_same(cache.load("x", model_tag=OTHER), b)


def test_delete_removes_every_models_cache(cache: CacheDirectory) -> None:
    cache.save("x", make_snapshot(600))
    cache.save("x", make_snapshot(300, model_tag=OTHER))
    cache.save("y", make_snapshot(300, ids=make_ids(300, seed=1), model_tag=OTHER))
    cache.delete("x")
    assert not cache.exists("x") and not agent_dir(cache, "x").exists()
    for tag in (TAG, OTHER):
        with pytest.raises(CacheMiss):
            cache.load("x", model_tag=tag)
    assert [(e.agent_id, e.model_tag) for e in cache.list_agents()] == [("y", OTHER)]
    assert cache.collect_garbage() == 3  # x's 2 blocks of model A and 1 of model B
    assert len(block_files(cache.root)) == 1


def test_garbage_collection_keeps_the_blocks_of_every_models_cache(cache: CacheDirectory) -> None:
    ids = make_ids(800)
    cache.save("x", make_snapshot(800, ids=ids))
    cache.save("x", make_snapshot(600, ids=ids, model_tag=OTHER))  # same tokens, other model: other blocks
    assert len(block_files(cache.root)) == 3 + 2
    assert cache.collect_garbage() == 0
    short = make_snapshot(300, ids=ids)
    cache.save("x", short)
    assert cache.collect_garbage() == 2  # model A's blocks 1 and 2; model B's stay
    assert_same(cache.load("x", model_tag=TAG), short)
    assert_same(cache.load("x", model_tag=OTHER), make_snapshot(600, ids=ids, model_tag=OTHER))


def test_a_save_removes_only_files_no_manifest_of_the_agent_lists(cache: CacheDirectory) -> None:
    cache.save("x", make_snapshot(300))
    cache.save("x", make_snapshot(300, model_tag=OTHER))
    assert len(own_files(cache, "x", "state")) == 2 and len(own_files(cache, "x", "seg")) == 2
    cache.save("x", make_snapshot(400))  # replaces model A's state file, adds a segment
    assert len(own_files(cache, "x", "state")) == 2 and len(own_files(cache, "x", "seg")) == 3
    assert_same(cache.load("x", model_tag=OTHER), make_snapshot(300, model_tag=OTHER))
    # A manifest of another format version may list files this version cannot tell: keep all.
    manifest = manifest_path(cache, "x", OTHER)
    data = json.loads(manifest.read_bytes())
    manifest.write_text(json.dumps({**data, "format_version": 99}))
    cache.save("x", make_snapshot(500))
    assert len(own_files(cache, "x", "state")) == 3
    # A manifest of this version that does not decode lists nothing.
    manifest.write_bytes(b"{")
    cache.save("x", make_snapshot(550))
    assert len(own_files(cache, "x", "state")) == 1
    assert_same(cache.load("x", model_tag=TAG), make_snapshot(550))
    with pytest.raises(CorruptCacheError):
        cache.load("x", model_tag=OTHER)


@pytest.mark.parametrize("after", [False, True], ids=["before-rename", "after-rename"])
@pytest.mark.parametrize("step", range(1, 4))
def test_a_kill_during_another_models_save_leaves_the_first_models_cache_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: int, after: bool
) -> None:
    root = tmp_path / "cache"
    a = make_snapshot(600)
    b = make_snapshot(300, model_tag=OTHER)  # block, segment, state, manifest: 4 renames
    CacheDirectory(root).save("x", a)
    kill_at_rename(monkeypatch, CacheDirectory(root), "x", b, step=step, after=after)
    reopened = CacheDirectory(root)
    reopened.collect_garbage()
    assert_same(reopened.load("x", model_tag=TAG), a)
    with pytest.raises(CacheMiss):
        reopened.load("x", model_tag=OTHER)
    reopened.save("x", b)
    assert_same(reopened.load("x", model_tag=OTHER), b)
    assert_same(reopened.load("x", model_tag=TAG), a)


def _to_legacy(cache: CacheDirectory, agent_id: str, tag: str) -> None:
    """Make ``agent_id``'s cache of ``tag`` look as kvmem kept it before per-model caches."""
    manifest_path(cache, agent_id, tag).rename(legacy_manifest_path(cache, agent_id))


def test_a_legacy_manifest_loads_as_its_models_cache_until_that_model_saves(cache: CacheDirectory) -> None:
    a = make_snapshot(600)
    cache.save("x", a)
    _to_legacy(cache, "x", TAG)
    assert_same(cache.load("x", model_tag=TAG), a)
    with pytest.raises(ForeignModelError):  # the one cache an old kvmem kept was model A's
        cache.load("x", model_tag=OTHER)
    assert [(e.model_tag, e.num_tokens) for e in cache.list_agents()] == [(TAG, 600)]
    assert cache.exists("x", model_tag=OTHER)  # a legacy manifest counts for every model

    b = make_snapshot(300, model_tag=OTHER)
    cache.save("x", b)  # another model's save keeps it
    assert legacy_manifest_path(cache, "x").exists()
    assert_same(cache.load("x", model_tag=TAG), a)
    assert_same(cache.load("x", model_tag=OTHER), b)

    longer = make_snapshot(700)
    report = cache.save("x", longer)  # model A's save takes its pieces over and retires it
    assert report.tokens_written == 700 - 600  # the legacy cache's pieces are reused
    assert not legacy_manifest_path(cache, "x").exists()
    assert_same(cache.load("x", model_tag=TAG), longer)
    assert_same(cache.load("x", model_tag=OTHER), b)
    assert sorted(e.model_tag for e in cache.list_agents()) == sorted([TAG, OTHER])
    assert cache.collect_garbage() == 0


def test_a_legacy_manifest_superseded_by_a_cut_short_save_is_not_listed_twice(cache: CacheDirectory) -> None:
    cache.save("x", make_snapshot(300))
    legacy_manifest_path(cache, "x").write_bytes(manifest_path(cache, "x").read_bytes())
    assert [(e.agent_id, e.model_tag) for e in cache.list_agents()] == [("x", TAG)]
    assert_same(cache.load("x", model_tag=TAG), make_snapshot(300))
    cache.save("x", make_snapshot(310))
    assert not legacy_manifest_path(cache, "x").exists()


@pytest.mark.parametrize("content", [b"garbage", b'{"format_version": 1, "blocks": []}'])
def test_an_unusable_legacy_manifest_is_a_miss_then_replaced_by_the_next_save(
    cache: CacheDirectory, content: bytes
) -> None:
    agent_dir(cache, "x").mkdir(parents=True)
    legacy_manifest_path(cache, "x").write_bytes(content)
    with pytest.raises(CacheMiss):
        cache.load("x", model_tag=TAG)
    assert cache.list_agents() == []
    cache.save("x", make_snapshot(10, model_tag=OTHER))
    assert not legacy_manifest_path(cache, "x").exists()
    assert_same(cache.load("x", model_tag=OTHER), make_snapshot(10, model_tag=OTHER))
