"""Corrupt cache files, end to end through a running server.

Phase 1: a server gives each agent one turn and flushes on shutdown. Between runs each agent's
files are damaged in a different way (truncation, flipped bytes, a foreign model tag, an old
format version, a manifest whose token count or piece bounds lie, a directory where a file
should be, an empty or non-JSON manifest). Phase 2: a restarted server gets each agent's next
turn. Every damaged agent is logged (a damaged manifest when the runtime lists the disk at start,
the rest as a miss of its load) and served cold with the reply a fresh agent gets for the same prompt; the untouched control agent is served warm; the server stays healthy throughout.
(``tests/persist/test_persist.py`` covers the same damage at the ``CacheDirectory`` level.)
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import models_dir

from gateway.testing import ServerThread
from runtime.config import Config
from runtime.persist import CacheDirectory

MODEL = "tiny-llama"


def _config(cache_dir: Path) -> Config:
    return Config(model=MODEL, port=0, home=str(models_dir().parent), cache_dir=str(cache_dir),
                       budget_mb=128, hot_budget_mb=32, graceful_timeout_s=2)


def _files(agent_dir: Path, prefix: str) -> list[Path]:
    found = sorted(agent_dir.glob(prefix + "*"))
    assert found, (agent_dir, prefix)
    return found


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x5A
    path.write_bytes(bytes(data))


def _manifest(agent_dir: Path) -> Path:
    """The agent's one manifest (one per model it talked to: here only MODEL)."""
    (found,) = agent_dir.glob("manifest-*.json")
    return found


def _edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(agent_dir: Path) -> None:
        manifest = _manifest(agent_dir)
        data = json.loads(manifest.read_bytes())
        edit(data)
        manifest.write_text(json.dumps(data))
    return apply


def _dir_instead(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inner").write_bytes(b"x")


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda m: m.__setitem__(key, value)


def _lie_piece_end(m: dict) -> None:
    m["pieces"][-1]["end"] += 7


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated-segment": lambda d: _truncate(_files(d, "seg-")[0]),
    "flipped-segment": lambda d: _flip(_files(d, "seg-")[0]),
    "truncated-state": lambda d: _truncate(_files(d, "state-")[0]),
    "flipped-state": lambda d: _flip(_files(d, "state-")[0]),
    "truncated-manifest": lambda d: _truncate(_manifest(d)),
    "empty-manifest": lambda d: _manifest(d).write_bytes(b""),
    "garbage-manifest": lambda d: _manifest(d).write_bytes(b"\x00\xffnot json{" * 40),
    "foreign-model": _edit_manifest(_set("model_tag", "other-model@0123456789abcdef/q4g64")),
    "old-format": _edit_manifest(_set("format_version", 1)),
    "future-format": _edit_manifest(_set("format_version", 99)),
    "token-count-lie": _edit_manifest(lambda m: m.__setitem__("num_tokens", m["num_tokens"] + 5)),
    "piece-bounds-lie": _edit_manifest(_lie_piece_end),
    "checksum-lie": _edit_manifest(lambda m: m["pieces"][0].__setitem__("sha256", "0" * 64)),
    "agent-id-lie": _edit_manifest(_set("agent_id", "somebody-else")),
    "dir-for-segment": lambda d: _dir_instead(_files(d, "seg-")[0]),
    "dir-for-manifest": lambda d: _dir_instead(_manifest(d)),
    "missing-segment": lambda d: _files(d, "seg-")[0].unlink(),
}


def _turn(http: httpx.Client, agent: str, prompt: str) -> httpx.Response:
    response = http.post(f"/v1/agents/{agent}/messages", json={"prompt": prompt, "max_tokens": 4,
                                                              "share_prefix": False})
    assert response.status_code == 200, (agent, response.text)
    return response


def test_damaged_cache_files_are_logged_misses_served_cold(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    agents = ["control", *DAMAGE]
    prompt = "The lighthouse keeper wrote in the log every night about ships and storms."
    replies = {}
    with ServerThread(_config(tmp_path)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for agent in agents:
            replies[agent] = _turn(http, agent, prompt).json()["reply"]
    agents_dir = tmp_path / "caches" / "agents"
    for name, damage in DAMAGE.items():
        damage(agents_dir / name)
    # A damaged manifest is logged and skipped when the runtime lists the disk at start: its agent's turn
    # asks the store nothing (its cache is nowhere). The rest are listed, and their load is a logged miss.
    listed = {e.agent_id for e in CacheDirectory(tmp_path / "caches", fsync=False).list_agents()} & set(DAMAGE)
    assert listed and listed != set(DAMAGE)

    caplog.clear()
    follow_up = {a: prompt + replies[a] + " Next night:" for a in agents}
    with ServerThread(_config(tmp_path)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        control = _turn(http, "control", follow_up["control"])
        assert control.headers["x-kvmem-tier"] == "warm", control.headers
        for name in DAMAGE:
            response = _turn(http, name, follow_up[name])
            assert response.headers["x-kvmem-tier"] == "cold", (name, dict(response.headers))
            assert response.headers["x-kvmem-tokens-reused"] == "0", name
            fresh = _turn(http, f"fresh-{name}", follow_up[name])
            assert response.json()["reply"] == fresh.json()["reply"], name
            assert http.get("/healthz").status_code == 200
        metrics = http.get("/metrics").text
        misses = next(float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("kvmem_cache_misses_total "))
        assert misses >= len(listed - {"foreign-model"}), metrics
    logged = caplog.text
    unlogged = [n for n in DAMAGE if n not in logged]
    # a cache of another model is an ordinary miss after a model swap, not damage
    assert unlogged in ([], ["foreign-model"]), unlogged
    assert "saving the cache" not in logged, logged  # every damaged agent was rewritten
    # the damaged agents were rewritten by their cold turn and now load warm
    with ServerThread(_config(tmp_path)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for name in list(DAMAGE)[:4]:
            response = http.post(f"/v1/agents/{name}/messages", json={"prompt": follow_up[name] + " and more",
                                                                     "max_tokens": 2, "share_prefix": False})
            assert response.status_code == 200 and response.headers["x-kvmem-tier"] == "warm", name
    shutil.rmtree(tmp_path / "caches")
