"""Cache files as kvmem writes them: standard safetensors, canonical, every byte checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import xxhash
from test_persist import (
    TAG,
    agent_dir,
    assert_same,
    block_path,
    make_snapshot,
    manifest_path,
    read_manifest,
    segment_path,
    state_path,
)

import runtime.persist.load
from runtime.errors import CorruptCacheError
from runtime.persist import FORMAT_VERSION, CacheDirectory
from runtime.persist.codec import FileLayout, data_is_intact, encode_file, header_sha256, parse_file
from runtime.persist.files import AtomicBatch, open_regular_file, read_exactly_into


@pytest.fixture
def saved(tmp_path: Path) -> CacheDirectory:
    cache = CacheDirectory(tmp_path / "cache", fsync=False)
    cache.save("a", make_snapshot(600))
    cache.save("a", make_snapshot(1000))
    return cache


def test_block_files_are_standard_safetensors_holding_the_snapshot_slice(
    saved: CacheDirectory,
) -> None:
    snapshot = make_snapshot(1000)
    path = block_path(saved, "a", 1)
    tensors = safetensors.numpy.load(path.read_bytes())
    layer = snapshot.layers[0]
    for key, array in layer.arrays.items():
        assert np.array_equal(tensors[f"L0.{key}"], array[:, 256:512])
    with safetensors.safe_open(path, framework="numpy") as opened:
        info = json.loads(opened.metadata()["kvmem"])
    assert (info["kind"], info["format_version"]) == ("block", str(FORMAT_VERSION))
    data = path.read_bytes()
    assert info["data_xxh3"] == xxhash.xxh3_64_hexdigest(data[parse_file(data).data_start :])


def test_encoding_is_canonical(tmp_path: Path) -> None:
    first = CacheDirectory(tmp_path / "one", fsync=False)
    second = CacheDirectory(tmp_path / "two", fsync=False)
    first.save("a", make_snapshot(1000))
    second.save("a", make_snapshot(1000))
    for index in range(2):
        assert block_path(first, "a", index).read_bytes() == (
            block_path(second, "a", index).read_bytes()
        )
    assert read_manifest(first, "a")["pieces"] == read_manifest(second, "a")["pieces"]


def test_the_checksum_is_the_header_digest_and_the_header_records_the_data_checksum() -> None:
    tensors = {"b": np.arange(6, dtype=np.float16).reshape(2, 3), "a": np.ones(4, np.uint32)}
    data = encode_file(tensors, {"kind": "state"})
    parsed = parse_file(data)
    assert parsed.header_sha256 == header_sha256(data)
    assert parsed.info["data_xxh3"] == xxhash.xxh3_64_hexdigest(data[parsed.data_start :])
    assert data_is_intact(data, parsed)
    damaged = bytearray(data)
    damaged[-1] ^= 0x01
    assert not data_is_intact(bytes(damaged), parse_file(bytes(damaged)))
    assert parsed.matches(FileLayout.of({n: (a.dtype, a.shape) for n, a in tensors.items()}))
    assert parsed.data_start % 8 == 0
    loaded = safetensors.numpy.load(data)
    assert all(np.array_equal(loaded[name], tensors[name]) for name in tensors)


def _flip(path: Path, where: float) -> None:
    """Flip one bit of the data section at fraction ``where`` of it."""
    data = bytearray(path.read_bytes())
    start = parse_file(bytes(data)).data_start
    data[start + int((len(data) - start - 1) * where)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", [0.0, 0.3, 0.5, 0.99, 1.0])
@pytest.mark.parametrize("kind", ["block", "segment", "state"])
def test_a_flipped_bit_anywhere_in_the_data_is_a_miss_and_removes_the_file(
    saved: CacheDirectory, kind: str, where: float
) -> None:
    path = {
        "block": lambda: block_path(saved, "a", 0),
        "segment": lambda: segment_path(saved, "a", 1),
        "state": lambda: state_path(saved, "a"),
    }[kind]()
    _flip(path, where)
    with pytest.raises(CorruptCacheError):
        saved.load("a", model_tag=TAG)
    assert not path.exists()
    saved.save("a", make_snapshot(1000))
    assert_same(saved.load("a", model_tag=TAG), make_snapshot(1000))


@pytest.mark.parametrize("kind", ["block", "segment"])
def test_a_flipped_bit_in_a_header_is_a_miss(saved: CacheDirectory, kind: str) -> None:
    path = block_path(saved, "a", 1) if kind == "block" else segment_path(saved, "a", 0)
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01  # inside the metadata
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError):
        saved.load("a", model_tag=TAG)


@pytest.mark.parametrize("ahead_blocks", [0, 3, 100])
def test_many_pieces_load_exactly_whatever_the_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead_blocks: int
) -> None:
    cache = CacheDirectory(tmp_path / "cache", fsync=False)
    cache.save("a", make_snapshot(256 * 3 + 100))
    snapshot = make_snapshot(256 * 21 + 100)
    cache.save("a", snapshot)
    block_size = block_path(cache, "a", 0).stat().st_size
    monkeypatch.setattr(runtime.persist.load, "READ_AHEAD_BYTES", block_size * ahead_blocks)
    assert_same(cache.load("a", model_tag=TAG), snapshot)


def test_a_damaged_block_late_in_a_long_cache_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CacheDirectory(tmp_path / "cache", fsync=False)
    cache.save("a", make_snapshot(256 * 12))
    monkeypatch.setattr(
        runtime.persist.load, "READ_AHEAD_BYTES", block_path(cache, "a", 0).stat().st_size * 4
    )
    _flip(block_path(cache, "a", 10), 0.5)
    with pytest.raises(CorruptCacheError):
        cache.load("a", model_tag=TAG)


def test_a_file_with_a_header_of_another_length_is_a_miss(saved: CacheDirectory) -> None:
    """A manifest pointing at a real file whose header is longer than this piece's would be."""
    path = segment_path(saved, "a", 0)
    other = segment_path(saved, "a", 1)  # tokens 600:1000: "end" has as many digits, "start" too
    data = bytearray(path.read_bytes())
    data[:8] = (int.from_bytes(data[:8], "little") + 8).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError):
        saved.load("a", model_tag=TAG)
    assert other.exists()


def test_an_uncommitted_batch_leaves_nothing_and_a_committed_one_everything(
    tmp_path: Path,
) -> None:
    with pytest.raises(OSError), AtomicBatch(fsync=True) as batch:
        batch.write(tmp_path / "one", b"1")
        batch.ensure_dir(tmp_path / "sub")
        batch.write(tmp_path / "sub" / "two", b"2")
        raise OSError(28, "No space left on device")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub"]
    with AtomicBatch(fsync=True, max_pending=2) as batch:
        for index in range(5):
            batch.write(tmp_path / "sub" / f"f{index}", bytes([index]) * 3)
        batch.commit()
    assert sorted(os.listdir(tmp_path / "sub")) == [f"f{index}" for index in range(5)]
    assert (tmp_path / "sub" / "f4").read_bytes() == b"\x04" * 3
    assert oct((tmp_path / "sub" / "f0").stat().st_mode & 0o777) == "0o600"


def test_a_format_2_cache_is_a_version_miss(saved: CacheDirectory) -> None:
    manifest = manifest_path(saved, "a")
    data = json.loads(manifest.read_bytes())
    data["format_version"] = 2
    manifest.unlink()  # format 2 kept one manifest.json per agent
    (agent_dir(saved, "a") / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(runtime.errors.FormatVersionError):
        saved.load("a", model_tag=TAG)


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_scattered_reads_fill_every_buffer_or_report_the_wrong_length(
    tmp_path: Path, extra: int
) -> None:
    sizes = [3, 0, 5, 1] * 700  # more buffers than one preadv takes
    data = os.urandom(sum(sizes) + extra)
    path = tmp_path / "f"
    path.write_bytes(data)
    buffers = [memoryview(bytearray(size)) for size in sizes]
    fd = open_regular_file(path, size=len(data))
    assert fd is not None
    try:
        complete = read_exactly_into(fd, buffers)
    finally:
        os.close(fd)
    assert complete is (extra == 0)
    if complete:
        assert b"".join(bytes(buffer) for buffer in buffers) == data
