"""``kvmem serve`` and the other commands as real processes, on a home of the test's own, for tests that
restart a server or compare a command beside it with the same command alone."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conftest import models_dir

ROOT = Path(__file__).resolve().parents[1]

SMALL_SCENARIO = """
name: small
agents:
  alice: {name: Alice, system: You are Alice.}
  bob: {name: Bob, system: You are Bob.}
  judge: {name: Judge, system: You judge., lifecycle: ephemeral}
phases:
  - {name: talk, agents: [alice, bob], rounds: 2, opening: Alice and Bob talk., visible_to: [judge]}
  - {name: verdict, agents: [judge], public: true, prompts: {judge: "${talk.messages[judge]}"}}
"""
"""A scenario of two phases and three agents (one ephemeral), small enough for a test to run on tiny-llama."""


def home_env(home: Path) -> dict[str, str]:
    """This process's environment with ``home`` as the kvmem home (the suite's built models, no pre-warm)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    return {**env, "KVMEM_HOME": str(home), "KVMEM_MODELS_DIR": str(models_dir()), "KVMEM_PREWARM_MB": "0"}


def kvmem_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvmem ARGS`` on ``home``, run to its end: its status, stdout and stderr."""
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True,
                          env=home_env(home), cwd=ROOT, timeout=300)


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
