"""CacheDirectory: bit-exact save/load, corruption as a miss, crash safety, dedup, GC, ids."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.errors import (
    CacheMiss,
    CorruptCacheError,
    ForeignModelError,
    FormatVersionError,
    InvalidAgentIdError,
)
from runtime.persist import (
    FORMAT_VERSION,
    AgentEntry,
    CacheDirectory,
    SaveReport,
    safe_agent_dirname,
)
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

TAG = "tiny-llama@0123abcd/q4g64"
HEADS = 2
WINDOW = 32


# -- synthetic snapshots -------------------------------------------------------


def make_ids(num_tokens: int, *, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729 + 17) % 50000 for i in range(num_tokens)]


def _mix(ids: np.ndarray, layer: int, salt: int) -> np.ndarray:
    """Per-token uint64 values that depend on (token id, position, layer, salt) only."""
    positions = np.arange(len(ids), dtype=np.uint64)
    x = ids.astype(np.uint64) * np.uint64(2654435761) + positions * np.uint64(40503)
    return x + np.uint64(layer * 1000003 + salt * 7777777)


def _q4_layer(ids: np.ndarray, layer: int, salt: int) -> LayerSnapshot:
    base = _mix(ids, layer, salt)  # (T,)
    heads = np.arange(HEADS, dtype=np.uint64)[:, None, None] * np.uint64(131)

    def packed(width: int) -> np.ndarray:
        cols = np.arange(width, dtype=np.uint64)[None, None, :] * np.uint64(977)
        mixed: np.ndarray = (base[None, :, None] + heads + cols) & np.uint64(0xFFFFFFFF)
        return mixed.astype(np.uint32)

    def scale(shift: int) -> np.ndarray:
        values = ((base + np.uint64(shift)) % np.uint64(1000)).astype(
            np.float32
        ) / 997.0
        return np.broadcast_to(values[None, :, None], (HEADS, len(ids), 1)).astype(
            np.float16
        )

    arrays = {
        "k_w": packed(8),
        "k_s": scale(1),
        "k_b": scale(2),
        "v_w": packed(4),
        "v_s": scale(3),
        "v_b": scale(4),
    }
    return LayerSnapshot(kind=LayerKind.Q4, arrays=arrays)


def _float_layer(
    ids: np.ndarray, layer: int, salt: int, kind: LayerKind, dim: int
) -> LayerSnapshot:
    base = (_mix(ids, layer, salt) % np.uint64(65521)).astype(np.float32)
    grid = base[None, :, None] + np.arange(HEADS * dim, dtype=np.float32).reshape(
        HEADS, 1, dim
    )
    k = np.sin(grid)
    v = np.cos(grid)
    if kind is LayerKind.SLIDING:
        window = min(len(ids), WINDOW)
        k, v = k[:, len(ids) - window :], v[:, len(ids) - window :]
        dtype: type[np.floating] = np.float32
    else:
        dtype = np.float16
    return LayerSnapshot(kind=kind, arrays={"k": k.astype(dtype), "v": v.astype(dtype)})


def make_snapshot(
    num_tokens: int,
    *,
    ids: list[int] | None = None,
    salt: int = 0,
    model_tag: str = TAG,
    meta: dict[str, int | str] | None = None,
) -> CacheSnapshot:
    """3 Q4 layers, a float full-attention layer and a sliding layer (window 32)."""
    token_ids = make_ids(num_tokens) if ids is None else ids[:num_tokens]
    assert len(token_ids) == num_tokens
    pieces = [f" w{t % 997}" if t % 5 else f"\nété{t % 13}" for t in token_ids]
    offsets = np.cumsum([len(p) for p in pieces]).tolist() if pieces else []
    array_ids = np.asarray(token_ids, dtype=np.int64)
    layers = [_q4_layer(array_ids, layer, salt) for layer in range(3)]
    layers.append(_float_layer(array_ids, 3, salt, LayerKind.FLOAT, 16))
    layers.append(_float_layer(array_ids, 4, salt, LayerKind.SLIDING, 64))
    return CacheSnapshot(
        model_tag=model_tag,
        text="".join(pieces),
        token_ids=list(token_ids),
        offsets=[int(o) for o in offsets],
        layers=layers,
        meta={"window_offset": num_tokens, "note": "synthetic"}
        if meta is None
        else meta,
    )


def assert_same(a: CacheSnapshot, b: CacheSnapshot) -> None:
    """Bit-for-bit equality of two snapshots."""
    assert a.model_tag == b.model_tag
    assert a.text == b.text
    assert a.token_ids == b.token_ids
    assert a.offsets == b.offsets
    assert a.meta == b.meta
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.kind is lb.kind
        assert list(la.arrays) == list(lb.arrays)
        for key, x in la.arrays.items():
            y = lb.arrays[key]
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert x.tobytes() == y.tobytes(), key


# -- helpers over the directory --------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> CacheDirectory:
    return CacheDirectory(tmp_path / "cache", fsync=False)


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").glob("*/*.safetensors"))


def agent_dir(cache: CacheDirectory, agent_id: str) -> Path:
    return cache.root / "agents" / safe_agent_dirname(agent_id)


def manifest_path(cache: CacheDirectory, agent_id: str) -> Path:
    return agent_dir(cache, agent_id) / "manifest.json"


Json = dict[str, Any]


def read_manifest(cache: CacheDirectory, agent_id: str) -> Json:
    data: Json = json.loads(manifest_path(cache, agent_id).read_bytes())
    return data


def edit_manifest(
    cache: CacheDirectory, agent_id: str, change: Callable[[Json], object]
) -> None:
    data = read_manifest(cache, agent_id)
    change(data)
    manifest_path(cache, agent_id).write_text(json.dumps(data))


def block_path(cache: CacheDirectory, agent_id: str, index: int) -> Path:
    block_hash: str = read_manifest(cache, agent_id)["blocks"][index]["hash"]
    return cache.root / "blocks" / block_hash[:2] / f"{block_hash}.safetensors"


def tail_path(cache: CacheDirectory, agent_id: str) -> Path:
    name: str = read_manifest(cache, agent_id)["tail"]["name"]
    return agent_dir(cache, agent_id) / name


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def truncate_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# -- save / load -----------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [0, 1, 255, 256, 257, 1000])
def test_save_then_load_is_bit_exact(tmp_path: Path, num_tokens: int) -> None:
    cache = CacheDirectory(tmp_path / "cache")  # fsync on: the real path
    snapshot = make_snapshot(num_tokens)
    report = cache.save("alice", snapshot)
    assert report.blocks_written == num_tokens // BLOCK_TOKENS
    assert report.blocks_reused == 0
    assert_same(cache.load("alice", model_tag=TAG), snapshot)
    assert len(block_files(cache.root)) == num_tokens // BLOCK_TOKENS
    assert cache.exists("alice")


def test_load_of_an_absent_agent_is_a_plain_miss(cache: CacheDirectory) -> None:
    with pytest.raises(CacheMiss) as info:
        cache.load("nobody", model_tag=TAG)
    assert type(info.value) is CacheMiss
    assert not cache.exists("nobody")


def test_resaving_an_unchanged_snapshot_writes_only_the_manifest(
    cache: CacheDirectory,
) -> None:
    snapshot = make_snapshot(700)
    cache.save("a", snapshot)
    report = cache.save("a", snapshot)
    assert (report.blocks_written, report.blocks_reused, report.tail_bytes) == (0, 2, 0)
    assert report.bytes_written == report.manifest_bytes
    assert_same(cache.load("a", model_tag=TAG), snapshot)


def test_a_shorter_snapshot_replaces_a_longer_one(cache: CacheDirectory) -> None:
    cache.save("a", make_snapshot(1000))
    short = make_snapshot(300)
    cache.save("a", short)
    assert_same(cache.load("a", model_tag=TAG), short)
    assert len(list(agent_dir(cache, "a").glob("tail-*"))) == 1
    assert cache.collect_garbage() == 2  # blocks 2 and 3 of the long cache
    assert_same(cache.load("a", model_tag=TAG), short)


def test_snapshot_without_layers_round_trips(cache: CacheDirectory) -> None:
    snapshot = CacheSnapshot(
        model_tag=TAG, text="hi", token_ids=[5, 6], offsets=[1, 2], layers=[]
    )
    cache.save("a", snapshot)
    assert_same(cache.load("a", model_tag=TAG), snapshot)


@pytest.mark.parametrize(
    "broken",
    [
        lambda s: CacheSnapshot(
            s.model_tag, s.text, s.token_ids, s.offsets[:-1], s.layers
        ),
        lambda s: CacheSnapshot(
            s.model_tag, s.text, s.token_ids, [*s.offsets[:-1], 10**6], s.layers
        ),
        lambda s: CacheSnapshot(
            s.model_tag, s.text, [-1, *s.token_ids[1:]], s.offsets, s.layers
        ),
        lambda s: CacheSnapshot(
            s.model_tag, s.text, s.token_ids, s.offsets, s.layers, {"x": True}
        ),
        lambda s: CacheSnapshot("", s.text, s.token_ids, s.offsets, s.layers),
        lambda s: CacheSnapshot(
            s.model_tag,
            s.text,
            s.token_ids,
            s.offsets,
            [
                LayerSnapshot(
                    LayerKind.Q4,
                    {**s.layers[0].arrays, "k_w": s.layers[0].arrays["k_w"][:, :-1]},
                )
            ],
        ),
        lambda s: CacheSnapshot(
            s.model_tag,
            s.text,
            s.token_ids,
            s.offsets,
            [LayerSnapshot(LayerKind.FLOAT, {"k": s.layers[3].arrays["k"]})],
        ),
    ],
    ids=[
        "offsets-short",
        "offset-past-text",
        "negative-id",
        "bool-meta",
        "no-tag",
        "q4-short",
        "missing-v",
    ],
)
def test_inconsistent_snapshots_are_refused(
    cache: CacheDirectory, broken: Callable[[CacheSnapshot], CacheSnapshot]
) -> None:
    with pytest.raises(ValueError):
        cache.save("a", broken(make_snapshot(300)))
    assert not cache.exists("a")


# -- corruption is a miss --------------------------------------------------------


@pytest.fixture
def saved(cache: CacheDirectory) -> CacheDirectory:
    cache.save("a", make_snapshot(1000))
    return cache


def _other_agent_blocks(cache: CacheDirectory) -> None:
    cache.save("b", make_snapshot(1000, ids=make_ids(1000, seed=5)))
    blocks = read_manifest(cache, "b")["blocks"]
    edit_manifest(cache, "a", lambda m: m.update(blocks=blocks))


def _other_token_ids(cache: CacheDirectory) -> None:
    other = read_manifest(cache, "a")
    cache.save("b", make_snapshot(1000, ids=make_ids(1000, seed=5)))
    other_ids = read_manifest(cache, "b")["token_ids"]
    assert other_ids != other["token_ids"]
    edit_manifest(cache, "a", lambda m: m.update(token_ids=other_ids))


def _drop_last_token(cache: CacheDirectory) -> None:
    import base64

    def change(m: Json) -> None:
        m["num_tokens"] -= 1
        for key in ("token_ids", "offsets"):
            m[key] = base64.b64encode(base64.b64decode(m[key])[:-4]).decode()

    edit_manifest(cache, "a", change)


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "junk").write_text("x")


CORRUPTIONS: dict[str, tuple[Callable[[CacheDirectory], object], type[CacheMiss]]] = {
    "truncated-block": (
        lambda c: truncate_half(block_path(c, "a", 1)),
        CorruptCacheError,
    ),
    "flipped-byte-in-block": (
        lambda c: flip_last_byte(block_path(c, "a", 2)),
        CorruptCacheError,
    ),
    "flipped-byte-in-tail": (
        lambda c: flip_last_byte(tail_path(c, "a")),
        CorruptCacheError,
    ),
    "missing-block": (lambda c: block_path(c, "a", 0).unlink(), CorruptCacheError),
    "missing-tail": (lambda c: tail_path(c, "a").unlink(), CorruptCacheError),
    "directory-for-block": (
        lambda c: _replace_with_dir(block_path(c, "a", 1)),
        CorruptCacheError,
    ),
    "directory-for-manifest": (
        lambda c: _replace_with_dir(manifest_path(c, "a")),
        CacheMiss,
    ),
    "truncated-manifest": (
        lambda c: truncate_half(manifest_path(c, "a")),
        CorruptCacheError,
    ),
    "manifest-not-json": (
        lambda c: manifest_path(c, "a").write_bytes(b"\x00not json{"),
        CorruptCacheError,
    ),
    "manifest-empty": (
        lambda c: manifest_path(c, "a").write_bytes(b""),
        CorruptCacheError,
    ),
    "manifest-json-array": (
        lambda c: manifest_path(c, "a").write_bytes(b"[1, 2]"),
        CorruptCacheError,
    ),
    "old-format-version": (
        lambda c: edit_manifest(
            c, "a", lambda m: m.update(format_version=FORMAT_VERSION - 1)
        ),
        FormatVersionError,
    ),
    "newer-format-version": (
        lambda c: manifest_path(c, "a").write_text(
            json.dumps({"format_version": 99, "x": []})
        ),
        FormatVersionError,
    ),
    "manifest-lies-about-token-count": (_drop_last_token, CorruptCacheError),
    "manifest-num-tokens-only": (
        lambda c: edit_manifest(
            c, "a", lambda m: m.update(num_tokens=m["num_tokens"] + 1)
        ),
        CorruptCacheError,
    ),
    "manifest-points-at-other-blocks": (_other_agent_blocks, CorruptCacheError),
    "manifest-with-other-token-ids": (_other_token_ids, CorruptCacheError),
    "manifest-drops-a-block": (
        lambda c: edit_manifest(c, "a", lambda m: m.update(blocks=m["blocks"][:-1])),
        CorruptCacheError,
    ),
    "manifest-wrong-size": (
        lambda c: edit_manifest(
            c, "a", lambda m: m["blocks"][0].update(size=m["blocks"][0]["size"] + 1)
        ),
        CorruptCacheError,
    ),
    "manifest-unknown-field": (
        lambda c: edit_manifest(c, "a", lambda m: m.update(extra=1)),
        CorruptCacheError,
    ),
    "manifest-wrong-kind": (
        lambda c: edit_manifest(c, "a", lambda m: m["layers"][4].update(kind="float")),
        CorruptCacheError,
    ),
    "manifest-of-another-agent": (
        lambda c: edit_manifest(c, "a", lambda m: m.update(agent_id="b")),
        CorruptCacheError,
    ),
    "offsets-past-text": (
        lambda c: edit_manifest(c, "a", lambda m: m.update(text="short")),
        CorruptCacheError,
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_damage_is_a_miss_of_the_right_kind(saved: CacheDirectory, name: str) -> None:
    damage, error = CORRUPTIONS[name]
    damage(saved)
    with pytest.raises(error) as info:
        saved.load("a", model_tag=TAG)
    assert type(info.value) is error
    # The next save repairs the cache (damaged blocks are not trusted again).
    snapshot = make_snapshot(1000)
    saved.save("a", snapshot)
    assert_same(saved.load("a", model_tag=TAG), snapshot)


def test_wrong_model_tag_is_a_foreign_model_miss(saved: CacheDirectory) -> None:
    with pytest.raises(ForeignModelError):
        saved.load("a", model_tag="other-model@ffff")


def test_a_model_swap_stores_separate_blocks(saved: CacheDirectory) -> None:
    other = make_snapshot(1000, model_tag="other-model@ffff", salt=3)
    report = saved.save("a", other)
    assert report.blocks_written == 3
    assert_same(saved.load("a", model_tag="other-model@ffff"), other)
    with pytest.raises(ForeignModelError):
        saved.load("a", model_tag=TAG)


def test_a_symlinked_manifest_is_not_followed(
    saved: CacheDirectory, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.json"
    outside.write_bytes(manifest_path(saved, "a").read_bytes())
    manifest_path(saved, "a").unlink()
    manifest_path(saved, "a").symlink_to(outside)
    with pytest.raises(CacheMiss):
        saved.load("a", model_tag=TAG)


def test_damage_is_logged_as_a_warning(
    saved: CacheDirectory, caplog: pytest.LogCaptureFixture
) -> None:
    flip_last_byte(tail_path(saved, "a"))
    with pytest.raises(CorruptCacheError):
        saved.load("a", model_tag=TAG)
    assert any(
        r.levelname == "WARNING" and "'a'" in r.getMessage() for r in caplog.records
    )


# -- crash safety ------------------------------------------------------------------


class SimulatedKill(BaseException):
    """Raised inside a save like a kill: no cleanup handler runs."""


OLD_TOKENS, NEW_TOKENS = (
    300,
    1000,
)  # new save: 2 new blocks, a tail, the manifest = 4 renames


@pytest.mark.parametrize("after", [False, True], ids=["before-rename", "after-rename"])
@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_a_kill_during_save_leaves_the_old_or_the_new_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: int, after: bool
) -> None:
    root = tmp_path / "cache"
    old, new = make_snapshot(OLD_TOKENS), make_snapshot(NEW_TOKENS)
    CacheDirectory(root).save("a", old)
    real_replace = os.replace
    calls = 0

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        nonlocal calls
        calls += 1
        if calls == step:
            if after:
                real_replace(src, dst)
            raise SimulatedKill
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with pytest.raises(SimulatedKill):
            CacheDirectory(root).save("a", new)

    reopened = CacheDirectory(root)
    assert not list(root.rglob("*.tmp"))
    loaded = reopened.load("a", model_tag=TAG)
    manifest_replaced = step == 4 and after
    assert_same(loaded, new if manifest_replaced else old)
    reopened.collect_garbage()
    assert_same(reopened.load("a", model_tag=TAG), new if manifest_replaced else old)
    reopened.save("a", new)
    assert_same(reopened.load("a", model_tag=TAG), new)
    reopened.collect_garbage()
    assert len(list(agent_dir(reopened, "a").iterdir())) == 2  # manifest + one tail
    assert len(block_files(root)) == NEW_TOKENS // BLOCK_TOKENS


def test_a_kill_before_the_old_tail_is_removed_leaves_an_orphan_for_gc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    new = make_snapshot(NEW_TOKENS)
    CacheDirectory(root).save("a", make_snapshot(OLD_TOKENS))

    def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        raise SimulatedKill

    with monkeypatch.context() as patch:
        patch.setattr(os, "unlink", unlink)
        with pytest.raises(SimulatedKill):
            CacheDirectory(root).save("a", new)
    reopened = CacheDirectory(root)
    assert_same(reopened.load("a", model_tag=TAG), new)
    assert len(list(agent_dir(reopened, "a").glob("tail-*"))) == 2
    assert reopened.collect_garbage() == 1
    assert_same(reopened.load("a", model_tag=TAG), new)


def test_a_failed_write_cleans_up_and_keeps_the_old_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CacheDirectory(tmp_path / "cache", fsync=False)
    old = make_snapshot(OLD_TOKENS)
    cache.save("a", old)
    real_replace = os.replace
    calls = 0

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        cache.save("a", make_snapshot(NEW_TOKENS))
    monkeypatch.undo()
    assert not list(cache.root.rglob("*.tmp"))
    assert_same(cache.load("a", model_tag=TAG), old)


_KILL_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import test_persist as t
from runtime.persist import CacheDirectory
snapshots = [t.make_snapshot(n) for n in (300, 1000, 1200, 500)]
cache = CacheDirectory(Path(sys.argv[1]), fsync=False)
cache.save("a", snapshots[0])
print("ready", flush=True)
i = 0
while True:
    i += 1
    cache.save("a", snapshots[i % len(snapshots)])
"""


def test_sigkill_during_repeated_saves_never_leaves_a_bad_cache(tmp_path: Path) -> None:
    snapshots = {n: make_snapshot(n) for n in (300, 1000, 1200, 500)}
    tests_dir = str(Path(__file__).parent)
    repo = Path(__file__).resolve().parents[1]
    for attempt in range(3):
        root = tmp_path / f"cache{attempt}"
        child = subprocess.Popen(
            [sys.executable, "-c", _KILL_CHILD, str(root), tests_dir],
            cwd=repo,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.05 + 0.07 * attempt)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            if child.stdout is not None:
                child.stdout.close()
        cache = CacheDirectory(root, fsync=False)
        assert not list(root.rglob("*.tmp"))
        loaded = cache.load("a", model_tag=TAG)
        assert_same(loaded, snapshots[loaded.num_tokens])


# -- dedup, write volume, garbage collection -------------------------------------


def test_agents_with_a_common_prefix_store_its_blocks_once(
    cache: CacheDirectory,
) -> None:
    prefix = make_ids(1024)
    a = make_snapshot(1100, ids=prefix + make_ids(76, seed=1))
    b = make_snapshot(1024 + 60, ids=prefix + make_ids(60, seed=2))
    first = cache.save("a", a)
    second = cache.save("b", b)
    assert (first.blocks_written, first.blocks_reused) == (4, 0)
    assert (second.blocks_written, second.blocks_reused) == (0, 4)
    assert len(block_files(cache.root)) == 4
    assert_same(cache.load("a", model_tag=TAG), a)
    assert_same(cache.load("b", model_tag=TAG), b)
    assert cache.block_hashes(TAG, b.token_ids) == [
        ref["hash"] for ref in read_manifest(cache, "b")["blocks"]
    ]
    assert cache.block_hashes(TAG, prefix[:1023]) == cache.block_hashes(TAG, prefix)[:3]
    assert cache.block_hashes("other", prefix) != cache.block_hashes(TAG, prefix)


def test_a_prefix_block_with_other_bits_is_reused_not_overwritten(
    cache: CacheDirectory,
) -> None:
    a = make_snapshot(600)
    b = make_snapshot(
        600, salt=9
    )  # same tokens, different floats (e.g. batched prefill)
    cache.save("a", a)
    report = cache.save("b", b)
    assert (report.blocks_written, report.blocks_reused) == (0, 2)
    assert_same(cache.load("a", model_tag=TAG), a)
    loaded = cache.load("b", model_tag=TAG)
    for la, lb, lo in zip(loaded.layers, a.layers, b.layers, strict=True):
        for key, array in la.arrays.items():
            if la.kind is LayerKind.SLIDING:
                assert array.tobytes() == lo.arrays[key].tobytes()
            else:
                assert array[:, :512].tobytes() == lb.arrays[key][:, :512].tobytes()
                assert array[:, 512:].tobytes() == lo.arrays[key][:, 512:].tobytes()


def test_a_ten_turn_conversation_writes_each_block_once(cache: CacheDirectory) -> None:
    final = make_snapshot(1500)
    reports: list[SaveReport] = []
    for turn in range(1, 11):
        reports.append(cache.save("a", make_snapshot(150 * turn, ids=final.token_ids)))
    assert_same(cache.load("a", model_tag=TAG), final)
    written = sum(r.bytes_written for r in reports)
    on_disk = disk_bytes(cache.root)
    block_bytes = sum(p.stat().st_size for p in block_files(cache.root))
    manifests = sum(r.manifest_bytes for r in reports)
    tails = sum(r.tail_bytes for r in reports)
    ratio = written / on_disk
    print(
        f"\n10 turns x 150 tokens: written {written} B, on disk {on_disk} B, ratio {ratio:.2f} "
        f"(blocks {block_bytes} B, tails {tails} B, manifests {manifests} B)"
    )
    # Every full block is written exactly once; each turn otherwise writes its tail and manifest.
    assert sum(r.blocks_written for r in reports) == 1500 // BLOCK_TOKENS
    assert written == block_bytes + tails + manifests
    assert manifests < 0.1 * written
    # Tails (< 256 tokens + sliding window) are rewritten every turn; full blocks never are.
    assert ratio < 2.5


def test_collect_garbage_removes_only_unreferenced_blocks(
    cache: CacheDirectory,
) -> None:
    prefix = make_ids(1024)
    a = make_snapshot(
        1300, ids=prefix + make_ids(276, seed=1)
    )  # 4 shared blocks + 1 own
    b = make_snapshot(1100, ids=prefix + make_ids(76, seed=2))  # the 4 shared blocks
    c = make_snapshot(600, ids=make_ids(600, seed=3))  # 2 own blocks
    for agent, snapshot in (("a", a), ("b", b), ("c", c)):
        cache.save(agent, snapshot)
    assert len(block_files(cache.root)) == 7
    assert cache.collect_garbage() == 0

    cache.delete("c")
    assert not cache.exists("c")
    with pytest.raises(CacheMiss):
        cache.load("c", model_tag=TAG)
    assert cache.collect_garbage() == 2
    assert len(block_files(cache.root)) == 5

    cache.delete("a")
    assert cache.collect_garbage() == 1  # a's own block; the prefix stays for b
    assert len(block_files(cache.root)) == 4
    assert_same(cache.load("b", model_tag=TAG), b)
    cache.delete("a")  # deleting twice is fine


def test_collect_garbage_removes_orphan_tails_temp_files_and_half_saved_agents(
    cache: CacheDirectory,
) -> None:
    snapshot = make_snapshot(400)
    cache.save("a", snapshot)
    directory = agent_dir(cache, "a")
    (directory / ("tail-" + "0" * 64 + ".safetensors")).write_bytes(b"orphan")
    (directory / "manifest.json.abc.tmp").write_bytes(b"partial")
    half = cache.root / "agents" / "never-finished"
    half.mkdir()
    (half / ("tail-" + "1" * 64 + ".safetensors")).write_bytes(b"orphan")
    (cache.root / "blocks" / "ab").mkdir(exist_ok=True)
    (cache.root / "blocks" / "ab" / ("ab" + "2" * 62 + ".safetensors")).write_bytes(
        b"orphan"
    )
    assert cache.collect_garbage() == 4
    assert not half.exists()
    assert_same(cache.load("a", model_tag=TAG), snapshot)
    assert cache.collect_garbage() == 0


def test_collect_garbage_keeps_blocks_listed_by_other_format_versions(
    cache: CacheDirectory,
) -> None:
    cache.save("a", make_snapshot(600))
    edit_manifest(cache, "a", lambda m: m.update(format_version=FORMAT_VERSION + 1))
    assert cache.collect_garbage() == 0
    manifest_path(cache, "a").write_text(
        json.dumps({"format_version": 99, "chunks": ["?"]})
    )
    assert cache.collect_garbage() == 0  # unknown layout: keep every block
    assert len(block_files(cache.root)) == 2
    manifest_path(cache, "a").write_bytes(
        b"garbage"
    )  # this version, unreadable: a dead cache
    assert cache.collect_garbage() == 2


def test_list_agents_reports_each_readable_agent(cache: CacheDirectory) -> None:
    before = time.time()
    cache.save("b", make_snapshot(300))
    cache.save("Agent One/../x", make_snapshot(10))
    cache.save("broken", make_snapshot(10))
    manifest_path(cache, "broken").write_bytes(b"{")
    entries = cache.list_agents()
    assert [e.agent_id for e in entries] == ["Agent One/../x", "b"]
    entry = entries[1]
    assert isinstance(entry, AgentEntry)
    assert (entry.model_tag, entry.num_tokens) == (TAG, 300)
    assert entry.updated_at >= before
    assert entry.disk_bytes == sum(
        p.stat().st_size for p in agent_dir(cache, "b").iterdir()
    ) + sum(p.stat().st_size for p in block_files(cache.root))


# -- agent ids --------------------------------------------------------------------

HOSTILE_IDS = [
    "../x",
    "/etc/passwd",
    "a/../../b",
    "..",
    ".",
    "...",
    ".hidden",
    "-rf",
    "a\\..\\b",
    "C:\\Windows",
    "\uff46\uff55\uff4c\uff4c\uff0e\uff0e\uff0f\uff58"  # fullwidth "full../x",
    "\uff0e\uff0e",
    "\u2024\u2024",
    "x\u202ey",
    "x\u200by",
    "Alice",
    "alice",
    "ALICE",
    "é",
    "e\u0301",
    "a" * 64,
    "a" * 65,
    "a" * 256,
    "~",
    "a~b",
    "agent",
    " padded ",
    "naïve agent 🤖",
]
INVALID_IDS = [
    "",
    "   ",
    "a\x00b",
    "\x00",
    "line\nbreak",
    "tab\there",
    "bell\x07",
    "del\x7f",
    "\ud800",
    "a" * 257,
]


@pytest.mark.parametrize("agent_id", HOSTILE_IDS)
def test_agent_ids_map_to_a_safe_name_inside_agents(
    tmp_path: Path, agent_id: str
) -> None:
    name = safe_agent_dirname(agent_id)
    assert name not in ("", ".", "..") and not name.startswith(".")
    assert (
        "/" not in name and "\\" not in name and "\x00" not in name and name.isascii()
    )
    assert len(name) <= 100
    agents = tmp_path / "agents"
    assert (agents / name).resolve().parent == agents.resolve()
    assert safe_agent_dirname(agent_id) == name  # stable


def test_distinct_ids_never_share_a_directory_even_case_insensitively() -> None:
    names = [safe_agent_dirname(agent_id) for agent_id in HOSTILE_IDS]
    assert len({name.casefold() for name in names}) == len(HOSTILE_IDS)


def test_plain_ids_stay_readable() -> None:
    for agent_id in ("alice", "agent-7", "team.a_b", "a" * 64):
        assert safe_agent_dirname(agent_id) == agent_id
    assert safe_agent_dirname("Alice").startswith("Alice~")
    assert safe_agent_dirname("\uff46\uff55\uff4c\uff4c").startswith("full~")


@pytest.mark.parametrize("agent_id", INVALID_IDS)
def test_unusable_ids_are_refused(cache: CacheDirectory, agent_id: str) -> None:
    with pytest.raises(InvalidAgentIdError):
        safe_agent_dirname(agent_id)
    with pytest.raises(InvalidAgentIdError):
        cache.save(agent_id, make_snapshot(1))
    with pytest.raises(InvalidAgentIdError):
        cache.load(agent_id, model_tag=TAG)
    assert isinstance(InvalidAgentIdError(), ValueError)


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=80), st.text(max_size=80))
def test_any_text_is_refused_or_safe_and_injective(first: str, second: str) -> None:
    names: list[str | None] = []
    for agent_id in (first, second):
        try:
            name = safe_agent_dirname(agent_id)
        except InvalidAgentIdError:
            names.append(None)
            continue
        assert name not in (".", "..") and not name.startswith(".")
        assert "/" not in name and "\x00" not in name and name.isascii()
        names.append(name.casefold())
    if first != second and None not in names:
        assert names[0] != names[1]


def test_hostile_ids_round_trip_and_stay_isolated(cache: CacheDirectory) -> None:
    snapshots = {}
    for index, agent_id in enumerate(HOSTILE_IDS):
        snapshots[agent_id] = make_snapshot(
            20 + index, ids=make_ids(20 + index, seed=index)
        )
        cache.save(agent_id, snapshots[agent_id])
    for agent_id, snapshot in snapshots.items():
        assert_same(cache.load(agent_id, model_tag=TAG), snapshot)
    assert {e.agent_id for e in cache.list_agents()} == set(HOSTILE_IDS)
    assert {p.name for p in cache.root.iterdir()} == {"agents", "blocks"}
    assert len(list((cache.root / "agents").iterdir())) == len(HOSTILE_IDS)


def test_directories_are_private_and_files_owner_only(tmp_path: Path) -> None:
    old_umask = os.umask(0o002)
    try:
        cache = CacheDirectory(tmp_path / "nested" / "cache")
        cache.save("a", make_snapshot(600))
        cache.save("b/../c", make_snapshot(10))
    finally:
        os.umask(old_umask)
    paths = [cache.root, *cache.root.rglob("*")]
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert any(p.is_file() for p in paths)


def test_importing_persist_imports_neither_trio_nor_mlx() -> None:
    code = (
        "import sys, runtime.persist\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'mlx', 'mlx_lm'))\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_a_shared_block_rewritten_with_other_bits_is_adopted_by_the_next_save(
    cache: CacheDirectory, tmp_path: Path
) -> None:
    a = make_snapshot(600)
    cache.save("a", a)
    # Another agent's save replaced block 0 (e.g. after it found it damaged) with
    # its own, slightly different bits for the same tokens.
    elsewhere = CacheDirectory(tmp_path / "elsewhere", fsync=False)
    elsewhere.save("b", make_snapshot(600, salt=9))
    block_path(cache, "a", 0).write_bytes(block_path(elsewhere, "b", 0).read_bytes())
    with pytest.raises(CorruptCacheError):
        cache.load("a", model_tag=TAG)
    assert block_path(cache, "a", 0).exists()  # intact, so not removed
    report = cache.save("a", a)
    assert (report.blocks_written, report.blocks_reused) == (0, 2)
    loaded = cache.load("a", model_tag=TAG)
    assert loaded.layers[0].arrays["k_w"][:, 256:].tobytes() == (
        a.layers[0].arrays["k_w"][:, 256:].tobytes()
    )
