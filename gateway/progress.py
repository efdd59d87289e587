"""Progress on stderr where a person waits: a bar redrawn in place on a terminal, plain lines otherwise.

::

    progress = Progress("kvmem: building tiny-llama", unit="tensors")
    for i, tensor in enumerate(tensors, 1):
        ...
        progress.update(i, total=len(tensors))
    progress.close(f"kvmem: built tiny-llama in {progress.elapsed_s:.1f} s")

On a terminal (the stream's ``isatty()``) one line is redrawn in place with
``\\r``, at most every :attr:`Progress.REDRAW_S`: the label, a bar, done/total,
the rate and the time left; without a total, a spinner and the time so far.
Piped or written to a log, the same facts come as plain lines: one when the work
starts, one every :attr:`Progress.LINE_EVERY_S`, and the closing message; never
a ``\\r`` or an escape sequence. ``delay_s`` keeps a quick step silent: nothing
is written until the work has lasted that long (nor the closing message).

Work that reports nothing while it runs (a model load) is drawn by a thread:
``with progress.ticking(): load()`` (:func:`ticking` for any redraw function).
Calls are thread-safe. This module imports neither trio nor MLX.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Self, TextIO

__all__ = ["Progress", "format_duration", "ticking"]


class Progress:
    """One line of progress for one piece of work (see the module docstring).

    Args:
        label: what is happening (``"kvmem: loading tiny-llama"``).
        total: how much there is to do (None: unknown, shown as a spinner and the time so far).
        unit: what is counted (``"tokens"``).
        stream: where to write (default ``sys.stderr``).
        tty: redraw in place (default: the stream is a terminal).
        delay_s: write nothing until the work has lasted this long.
        clock: seconds, monotonic (tests pass their own).
    """

    REDRAW_S = 0.1
    """Shortest time between two redraws on a terminal."""
    LINE_EVERY_S = 5.0
    """Shortest time between two plain lines."""
    BAR_WIDTH = 24
    SPINNER = "|/-\\"

    def __init__(self, label: str, *, total: int | None = None, unit: str = "", stream: TextIO | None = None,
                 tty: bool | None = None, delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.note = ""
        self._stream = stream if stream is not None else sys.stderr
        self._tty = _isatty(self._stream) if tty is None else tty
        self._delay_s = delay_s
        self._clock = clock
        self._started = clock()
        self._last: float | None = None  # when a line was last written
        self._first: tuple[float, int] | None = None  # when the first unit was done, and how many: the rate's base
        self._frame = 0
        self._on_screen = False  # a \r line is drawn and not yet erased
        self._closed = False
        self._lock = threading.Lock()
        self.shown = False
        """Whether anything was written (a step shorter than ``delay_s`` writes nothing)."""

    @property
    def elapsed_s(self) -> float:
        """Seconds since the work started."""
        return self._clock() - self._started

    def update(self, done: int, *, total: int | None = None, note: str | None = None) -> None:
        """``done`` of ``total`` (None: unchanged) are done; redraw if it is time."""
        if self._first is None and done > 0:
            self._first = (self._clock(), done)
        self.done = done
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        self.tick()

    def tick(self) -> None:
        """Redraw if it is time (a spinner turns; a plain line is due)."""
        with self._lock:
            now = self._clock()
            if self._closed or now - self._started < self._delay_s:
                return
            every = self.REDRAW_S if self._tty else self.LINE_EVERY_S
            if self._last is not None and now - self._last < every:
                return
            self._last = now
            self._frame += 1
            if self._tty:
                width = shutil.get_terminal_size((80, 24)).columns - 1  # no wrap: \r redraws one line only
                self._write("\r" + self.render(now - self._started, width=width)[:width] + "\033[K")
                self._on_screen = True
            else:
                self._write(self.render(now - self._started) + "\n")
            self.shown = True

    def close(self, final: str | None = None) -> None:
        """Erase the line (on a terminal), then write ``final`` as a line of its own if anything was shown."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._on_screen:
                self._write("\r\033[K")
                self._on_screen = False
            if final is not None and self.shown:
                self._write(final + "\n")

    def render(self, elapsed_s: float, *, width: int | None = None) -> str:
        """The line for ``elapsed_s`` into the work: a bar and counts on a terminal, plain text otherwise.

        ``width``: a terminal's; the bar narrows (to a third) before the counts would not fit.
        """
        parts: list[str] = []
        total = self.total
        if total:
            fraction = min(self.done / total, 1.0)
            parts.append(f"{self.done:,}/{total:,} {self.unit}".rstrip())
            if not self._tty:
                parts.append(f"{fraction:.0%}")
            rate = self._rate(elapsed_s)
            if rate:
                parts.append(f"{rate:,.0f} {self.unit}/s" if self.unit else f"{rate:,.0f}/s")
                if self.done < total:
                    parts.append("ETA " + format_duration((total - self.done) / rate))
        else:
            if self.done:
                parts.append(f"{self.done:,} {self.unit}".rstrip())
            parts.append(format_duration(elapsed_s))
        if self.note:
            parts.append(self.note)
        if not self._tty:
            news = self.done or self.note or elapsed_s >= 1.0
            return f"{self.label}: {', '.join(parts)}" if news else f"{self.label} ..."
        text = "  ".join(parts)
        if not total:
            return f"{self.label} {self.SPINNER[self._frame % len(self.SPINNER)]} {text}"
        room = self.BAR_WIDTH if width is None else width - len(self.label) - len(text) - 4
        bar_width = max(self.BAR_WIDTH // 3, min(self.BAR_WIDTH, room))
        filled = round(min(self.done / total, 1.0) * bar_width)
        return f"{self.label} [{'#' * filled}{'-' * (bar_width - filled)}] {text}"

    def _rate(self, elapsed_s: float) -> float | None:
        """Units per second since the first one was done (what came before, a start-up, does not count)."""
        if self._first is None:
            return None
        since_s = elapsed_s - (self._first[0] - self._started)
        counted = self.done - self._first[1]
        return counted / since_s if since_s >= 0.5 and counted > 0 else None

    @contextmanager
    def ticking(self, final: Callable[[Progress], str] | None = None) -> Iterator[Progress]:
        """Redraw from a thread while the body, the whole work, runs; then :meth:`close`.

        For work that reports nothing until it ends (a model load). ``final`` makes the closing
        line (``lambda p: f"loaded in {p.elapsed_s:.1f} s"``); a body that raises closes silently.
        """
        with ticking(self.tick):
            try:
                yield self
            except BaseException:
                self.close()
                raise
        self.close(final(self) if final is not None else None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not fail the work it reports on
            pass


@contextmanager
def ticking(tick: Callable[[], None], every_s: float = Progress.REDRAW_S) -> Iterator[None]:
    """Call ``tick`` now and then every ``every_s`` on a thread of its own until the body ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            tick()

    tick()
    thread = threading.Thread(target=run, name="kvmem-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def format_duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``3 min 05 s``, ``2 h 03 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
