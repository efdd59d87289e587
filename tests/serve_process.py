"""``kvmem serve`` as a real process, for tests that restart it or compare it with ``kvmem chat``."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ServeProcess:
    """A running ``kvmem serve``: its URL and the log lines it wrote so far (stderr)."""

    url: str
    log: list[str] = field(default_factory=list)
    process: subprocess.Popen[str] | None = None


@contextmanager
def kvmem_serve(*args: str, env: Mapping[str, str]) -> Iterator[ServeProcess]:
    """Start ``kvmem serve ARGS`` and yield once it listens; on exit SIGTERM must stop it with status 0
    (unless the test killed it with SIGKILL: ``server.process.kill()``).

    The rest of its log is collected into ``log`` after it stops (the flush on shutdown is logged).
    """
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], cwd=ROOT, env=dict(env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        server = None
        log: list[str] = []
        while server is None:
            line = lines.get(timeout=120)
            log.append(line)
            found = re.search(r"serving \S+ on (http://\S+)", line)
            server = ServeProcess(found.group(1), log, proc) if found else None
        yield server
        if proc.poll() is not None and proc.returncode == -signal.SIGKILL:
            return  # the test killed it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=10)
        while not lines.empty():
            server.log.append(lines.get())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
