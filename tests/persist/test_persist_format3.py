"""An upgrade keeps every agent's memory: caches an earlier kvmem wrote in format 3 still load.

The cache in ``tests/data/format3/caches`` was saved by kvmem at 305672a, whose files
recorded the CRC-32 of their data (format 3); this kvmem writes their XXH3-64 (format 4).
It is compared with the snapshot it was made from, rebuilt here by ``make_snapshot``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
from test_persist import TAG, assert_same, make_snapshot, read_manifest

from runtime.errors import CorruptCacheError
from runtime.persist import FORMAT_VERSION, CacheDirectory
from runtime.persist.codec import parse_file
from runtime.spec import CacheSnapshot

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "format3" / "caches"
HOME_FIXTURE = Path(__file__).resolve().parents[1] / "data" / "format3" / "home"
"""A home whose agent ``keeper`` ran one turn on tiny-llama under kvmem 305672a (``turn1.json``: what it was)."""


def format3_snapshot(num_tokens: int) -> CacheSnapshot:
    """The kind of snapshot the fixture holds: ``make_snapshot``'s first Q4 layer and its sliding layer."""
    full = make_snapshot(num_tokens, sliding="like-float")
    return dataclasses.replace(full, layers=[full.layers[0], full.layers[4]])


def _copy(source: Path, root: Path) -> Path:
    shutil.copytree(source, root)
    for path in root.rglob("*"):  # as a save leaves them (git checks files out 0644)
        path.chmod(0o700 if path.is_dir() else 0o600)
    return root


@pytest.fixture
def upgraded(tmp_path: Path) -> CacheDirectory:
    """A copy of the format-3 cache directory, opened by this kvmem."""
    return CacheDirectory(_copy(FIXTURE, tmp_path / "caches"), fsync=False)


def _files(cache: CacheDirectory) -> list[Path]:
    return sorted(p for p in cache.root.rglob("*.safetensors"))


def test_the_fixture_is_format_3_and_this_kvmem_writes_another() -> None:
    (manifest,) = FIXTURE.glob("agents/alice/manifest-*.json")
    assert json.loads(manifest.read_text())["format_version"] == 3
    assert FORMAT_VERSION != 3


def test_a_format_3_cache_loads_bit_for_bit(upgraded: CacheDirectory) -> None:
    assert_same(upgraded.load("alice", model_tag=TAG), format3_snapshot(300))


def test_the_next_save_writes_this_format_and_the_old_files_go(upgraded: CacheDirectory) -> None:
    old = _files(upgraded)
    upgraded.save("alice", format3_snapshot(600))
    assert read_manifest(upgraded, "alice")["format_version"] == FORMAT_VERSION
    upgraded.collect_garbage()
    new = _files(upgraded)
    assert not set(old) & set(new)  # the old block is named by format 3's chain: written again, the old one collected
    for path in new:
        info = parse_file(path.read_bytes()).info
        assert info["format_version"] == str(FORMAT_VERSION) and "data_xxh3" in info and "data_crc32" not in info
    assert_same(upgraded.load("alice", model_tag=TAG), format3_snapshot(600))


@pytest.mark.parametrize("damaged", ["blocks", "agents/alice/seg-", "agents/alice/state-"])
def test_a_damaged_format_3_file_is_a_logged_miss_and_is_removed(
    upgraded: CacheDirectory, damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = _files(upgraded)
    (path,) = [p for p in before if str(p.relative_to(upgraded.root)).startswith(damaged)]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the data: the header, and so the manifest's checksum, still match
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="kvmem")
    with pytest.raises(CorruptCacheError):
        upgraded.load("alice", model_tag=TAG)
    assert not path.exists()
    assert "removing damaged cache file" in caplog.text
    assert _files(upgraded) == [p for p in before if p != path]  # the intact files stay


def test_an_intact_format_3_block_the_manifest_does_not_match_stays(upgraded: CacheDirectory) -> None:
    (manifest_file,) = upgraded.root.glob("agents/alice/manifest-*.json")
    manifest = json.loads(manifest_file.read_text())
    (block,) = [piece for piece in manifest["pieces"] if piece["kind"] == "block"]
    block["sha256"] = "0" * 64
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCacheError):
        upgraded.load("alice", model_tag=TAG)
    assert upgraded.paths.block_path(block["name"]).exists()  # judged by format 3's rules: intact, kept



async def test_an_agent_of_a_format_3_home_resumes_warm_after_an_upgrade(tmp_path: Path) -> None:
    """The runtime's path, not only the directory's: read ahead at start, checked out warm, saved again
    in this format. Compared with the same two turns where this kvmem saved turn 1 itself."""
    from conftest import models_dir

    from actors import open_runtime

    turn1 = json.loads((HOME_FIXTURE / "turn1.json").read_text())
    second_prompt = turn1["prompt"] + turn1["reply"] + " The next morning"
    old_home = tmp_path / "old"
    _copy(HOME_FIXTURE / "caches", old_home / "caches")
    new_home = tmp_path / "new"

    def runtime(home: Path):  # noqa: ANN202
        return open_runtime(model="tiny-llama", home=home, models_dir=models_dir(), fsync=False,
                            handle_signals=False, prewarm_mb=0)

    async with runtime(new_home) as rt:
        first = await rt.agent("keeper").send_prompt(turn1["prompt"], max_tokens=8)
    second = {}
    for name, home in (("old", old_home), ("new", new_home)):
        async with runtime(home) as rt:
            second[name] = await rt.agent("keeper").send_prompt(second_prompt, max_tokens=8)
    old, new = second["old"], second["new"]
    assert old.usage.tier == new.usage.tier == "warm"
    assert old.usage.tokens_reused == new.usage.tokens_reused > 0.9 * turn1["tokens"]
    if first.reply == turn1["reply"]:  # this kvmem computed turn 1 as 305672a did: the same KV, so the same turn 2
        assert old.reply == new.reply
    (manifest,) = (old_home / "caches" / "agents" / "keeper").glob("manifest-*.json")
    assert json.loads(manifest.read_text())["format_version"] == FORMAT_VERSION  # saved again, in this format
