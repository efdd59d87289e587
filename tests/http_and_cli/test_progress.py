"""Progress where a person waits (``gateway.progress``): a bar redrawn in place on a terminal, plain lines when piped.

The module is driven with a fake clock and a string stream in both modes; then
``kvmem serve``'s start-up steps (:class:`gateway.cli_serve.StartProgress`), and
``kvmem build-model`` end to end, piped: plain lines on stderr, the folder alone on stdout.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway.cli_serve import StartProgress
from gateway.progress import Progress, format_duration, ticking

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(*, tty: bool, **options: object) -> tuple[Progress, io.StringIO, Clock]:
    stream, clock = io.StringIO(), Clock()
    return Progress("kvmem: prefill", stream=stream, tty=tty, clock=clock, **options), stream, clock  # type: ignore[arg-type]


def test_on_a_terminal_a_bar_with_counts_rate_and_eta_is_redrawn_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    progress, stream, clock = _progress(tty=True, total=4096, unit="tokens")
    progress.update(0)
    clock.now += 1.0
    progress.update(1024)  # the first tokens: the rate counts from here
    clock.now += 2.0
    progress.update(2048)
    frames = stream.getvalue().split("\r")[1:]
    assert len(frames) == 3 and all(f.endswith("\033[K") for f in frames)
    assert frames[0] == "kvmem: prefill [------------------------] 0/4,096 tokens\033[K"
    assert frames[2] == ("kvmem: prefill [############------------] 2,048/4,096 tokens  512 tokens/s  ETA 4.0 s"
                         "\033[K")
    assert "\n" not in stream.getvalue()
    progress.close("kvmem: done")
    assert stream.getvalue().endswith("\r\033[Kkvmem: done\n")  # erased, then the closing line


def test_on_a_terminal_redraws_are_spaced_and_a_spinner_turns_without_a_total() -> None:
    progress, stream, clock = _progress(tty=True)
    progress.tick()
    progress.tick()  # too soon: nothing
    clock.now += 0.5
    progress.tick()
    clock.now += 12.0
    progress.note = "3/8 recent caches read"
    progress.tick()
    frames = stream.getvalue().split("\r")[1:]
    assert frames == ["kvmem: prefill / 0.0 s\033[K", "kvmem: prefill - 0.5 s\033[K",
                      "kvmem: prefill \\ 12 s  3/8 recent caches read\033[K"]


def test_a_terminal_line_fits_the_terminals_width(monkeypatch: pytest.MonkeyPatch) -> None:
    progress, stream, clock = _progress(tty=True, total=4096, unit="tokens")
    monkeypatch.setenv("COLUMNS", "50")
    progress.update(1024)  # the bar narrows first
    monkeypatch.setenv("COLUMNS", "20")
    clock.now += 0.2
    progress.update(2048)  # then the line is cut: a line that wrapped could not be redrawn with \r
    assert stream.getvalue().split("\r")[1:] == ["kvmem: prefill [###----------] 1,024/4,096 tokens\033[K",
                                                 "kvmem: prefill [###\033[K"]


def test_piped_progress_is_plain_lines_now_and_then() -> None:
    progress, stream, clock = _progress(tty=False, total=4096, unit="tokens")
    progress.update(0)
    for _ in range(20):  # every second for 20 s: a line every LINE_EVERY_S
        clock.now += 1.0
        progress.update(progress.done + 200)
    progress.close("kvmem: prefilled 4,000 tokens in 20 s")
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "\033" not in stream.getvalue()
    assert lines[0] == "kvmem: prefill ..."
    assert lines[1] == "kvmem: prefill: 1,000/4,096 tokens, 24%, 200 tokens/s, ETA 15 s"
    assert len(lines) == 6 and lines[-1] == "kvmem: prefilled 4,000 tokens in 20 s"


def test_a_step_shorter_than_the_delay_shows_nothing_at_all() -> None:
    for tty in (True, False):
        progress, stream, clock = _progress(tty=tty, total=10, delay_s=1.0)
        progress.update(5)
        clock.now += 0.9
        progress.update(9)
        progress.close("kvmem: done")
        assert stream.getvalue() == "" and not progress.shown
    progress, stream, clock = _progress(tty=False, total=10, delay_s=1.0)
    clock.now += 1.5
    progress.update(5)
    assert stream.getvalue() == "kvmem: prefill: 5/10, 50%\n"


def test_ticking_draws_from_a_thread_and_closes_with_the_final_line() -> None:
    stream = io.StringIO()
    progress = Progress("kvmem: loading m", stream=stream, tty=False)
    with progress.ticking(lambda p: "kvmem: loaded m"):
        pass
    assert stream.getvalue() == "kvmem: loading m ...\nkvmem: loaded m\n"

    erased = io.StringIO()
    failed = Progress("kvmem: loading m", stream=erased, tty=True)
    with pytest.raises(RuntimeError), failed.ticking(lambda p: "kvmem: loaded m"):
        raise RuntimeError("no such model")
    assert erased.getvalue().endswith("\r\033[K") and "loaded" not in erased.getvalue()

    ticks = threading.Semaphore(0)
    with ticking(ticks.release, every_s=0.01):
        assert ticks.acquire(timeout=5) and ticks.acquire(timeout=5)  # at once, then from the thread


def test_durations_read_as_a_person_would() -> None:
    assert [format_duration(s) for s in (0.42, 12.4, 185, 7384)] == ["0.4 s", "12 s", "3 min 05 s", "2 h 03 min"]


def test_a_serve_start_shows_the_load_then_each_cache_restored_ahead() -> None:
    stream = io.StringIO()
    start = StartProgress("tiny-llama", stream=stream, tty=False)
    start.tick()
    for done in range(3):
        start.report("read", done, 2)
    for done in range(3):
        start.report("restore", done, 2)
    start.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "kvmem: loading tiny-llama ..."
    assert lines[1].startswith("kvmem: loaded tiny-llama in ")
    assert lines[2] == "kvmem: restoring caches ahead ..."
    assert lines[3].startswith("kvmem: restored 2 of 2 caches ahead in ")
    assert len(lines) == 4

    failed = io.StringIO()
    start = StartProgress("tiny-llama", stream=failed, tty=True)
    start.tick()
    start.close(listening=False)
    assert failed.getvalue().endswith("\r\033[K") and "loaded" not in failed.getvalue()


def test_kvmem_build_model_piped_shows_plain_progress_and_prints_the_folder(tmp_path: Path) -> None:
    env = {**os.environ, "KVMEM_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "gateway.cli", "build-model", "tiny-llama"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip())
    assert folder.parent == tmp_path / "models" and (folder / "model.safetensors").is_file()
    lines = proc.stderr.splitlines()
    assert "\r" not in proc.stderr and "\033" not in proc.stderr
    assert lines[0].startswith("kvmem: building tiny-llama: 1/") and " tensors, " in lines[0]
    assert lines[-1].startswith("kvmem: built tiny-llama in ")

    again = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert again.returncode == 0 and again.stdout == proc.stdout
    assert again.stderr == ""  # built already: nothing to wait for, nothing shown
