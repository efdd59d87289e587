"""Disk trouble through a running server: a full or read-only disk, an unusable cache directory.

A turn is durable by default: it is answered once its cache is on disk. With a failing disk it
cannot be, so it is refused in so many words: 507 ``cache_not_saved`` for a full disk, 503 for
one that cannot be written. A write-behind turn (``--no-durable``, ``X-Kvmem-Durable: false``)
never fails for the disk: it is served, and the failure is logged and counted
(``kvmem_cache_write_errors_total``). Either way the cache stays in RAM (dirty) and the save is
retried on a timer (``runtime.plan.save_queue.SAVE_RETRY_S``) or on the next turn; once the disk
recovers the cache reaches it without another turn, and a restarted server loads it warm.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import models_dir

import runtime.plan.save_queue
from gateway.testing import ServerThread
from runtime.config import Config
from runtime.persist import CacheDirectory

MODEL = "tiny-llama"


def _config(cache_dir: Path, *, durable: bool = False) -> Config:
    return Config(model=MODEL, port=0, home=str(models_dir().parent), cache_dir=str(cache_dir),
                  budget_mb=128, hot_budget_mb=32, graceful_timeout_s=2, durable=durable)


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def failing_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int | None]]:
    """``state["errno"]``: when set, every CacheDirectory.save raises that OSError."""
    state: dict[str, int | None] = {"errno": None}
    real_save = CacheDirectory.save

    def save(self: CacheDirectory, agent_id: str, snapshot: object, **kw: object) -> object:
        code = state["errno"]
        if code is not None:
            raise OSError(code, os.strerror(code), str(self.root))
        return real_save(self, agent_id, snapshot, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(CacheDirectory, "save", save)
    monkeypatch.setattr(runtime.plan.save_queue, "SAVE_RETRY_S", 0.3)
    yield state


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failing_disk_never_fails_a_turn_and_the_save_is_retried(
    tmp_path: Path, failing_disk: dict[str, int | None], caplog: pytest.LogCaptureFixture, code: int
) -> None:
    caplog.set_level(logging.ERROR, logger="kvmem.store")
    prompt = {"prompt": "A diary of the disk that filled up.", "max_tokens": 4, "share_prefix": False}
    with ServerThread(_config(tmp_path)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        reference = http.post("/v1/agents/reference/messages", json=prompt).json()["reply"]
        _wait(lambda: not http.get("/v1/agents/reference").json()["dirty"], 30, "the reference was not saved")
        failing_disk["errno"] = code
        first = http.post("/v1/agents/diary/messages", json=prompt)
        assert first.status_code == 200 and first.json()["reply"] == reference
        _wait(lambda: _metric(http, "kvmem_cache_write_errors_total") >= 2, 30, "no retry was attempted")
        info = http.get("/v1/agents/diary").json()
        assert info["dirty"] and info["hot"] and not info["on_disk"], info
        # the next turn is served from RAM, hot, while the disk is still failing
        follow = {**prompt, "prompt": prompt["prompt"] + first.json()["reply"] + " Then"}
        second = http.post("/v1/agents/diary/messages", json=follow)
        assert second.status_code == 200 and second.headers["x-kvmem-tier"] == "hot"
        assert http.get("/healthz").status_code == 200
        failing_disk["errno"] = None  # the disk recovers: the retry timer saves it, no new turn needed
        _wait(lambda: not http.get("/v1/agents/diary").json()["dirty"], 30, "the save was never retried")
        assert http.get("/v1/agents/diary").json()["on_disk"]
        errors = _metric(http, "kvmem_cache_write_errors_total")
    assert errors >= 2
    assert "saving the cache of 'diary' failed" in caplog.text and os.strerror(code) in caplog.text
    with ServerThread(_config(tmp_path)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        third = http.post("/v1/agents/diary/messages",
                          json={**follow, "prompt": follow["prompt"] + second.json()["reply"] + " And"})
        assert third.status_code == 200 and third.headers["x-kvmem-tier"] == "warm", third.headers


@pytest.mark.parametrize(("code", "status"), [(errno.ENOSPC, 507), (errno.EROFS, 503)])
def test_a_durable_turn_on_a_failing_disk_is_refused_in_words_and_saved_once_the_disk_recovers(
    tmp_path: Path, failing_disk: dict[str, int | None], code: int, status: int
) -> None:
    prompt = {"prompt": "A diary of the disk that filled up.", "max_tokens": 4, "share_prefix": False}
    with ServerThread(_config(tmp_path, durable=True)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        failing_disk["errno"] = code
        refused = http.post("/v1/agents/diary/messages", json=prompt)
        assert refused.status_code == status, refused.text
        error = refused.json()["error"]
        assert error["code"] == "cache_not_saved" and os.strerror(code) in error["message"], error
        assert "X-Kvmem-Durable: false" in error["message"] and str(tmp_path) not in refused.text, error
        info = http.get("/v1/agents/diary").json()  # generated, kept in RAM, not on disk
        assert info["dirty"] and info["hot"] and not info["on_disk"], info
        opted_out = http.post("/v1/agents/other/messages", json=prompt, headers={"X-Kvmem-Durable": "false"})
        assert opted_out.status_code == 200, opted_out.text  # the request's own opt-out: answered at once
        failing_disk["errno"] = None  # the disk recovers: the retry timer saves it
        _wait(lambda: not http.get("/v1/agents/diary").json()["dirty"], 30, "the save was never retried")
        again = http.post("/v1/agents/diary/messages", json=prompt)
        assert again.status_code == 200, again.text


def test_shutdown_with_a_failing_disk_still_exits(tmp_path: Path, failing_disk: dict[str, int | None]) -> None:
    with ServerThread(_config(tmp_path)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        failing_disk["errno"] = errno.ENOSPC
        assert http.post("/v1/agents/doomed/messages", json={"prompt": "x y z", "max_tokens": 2}).status_code == 200
        started = time.monotonic()
    assert time.monotonic() - started < 30  # the final flush tries once, logs, and returns


def test_an_unusable_cache_directory_is_a_clear_startup_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import main

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("I am a file")
    monkeypatch.setenv("KVMEM_HOME", str(models_dir().parent))
    status = main(["serve", "--model", MODEL, "--cache-dir", str(not_a_dir), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 1, err
    last = err.strip().splitlines()[-1]  # after the model load's progress line, if the load took a while
    assert last.startswith("kvmem serve:") and "Not a directory" in last and str(not_a_dir) in last, err
    assert "Traceback" not in err
