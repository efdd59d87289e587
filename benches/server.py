"""A real ``kvmem serve`` subprocess on 127.0.0.1 and a streaming client for it.

Benchmarks that measure the user's view drive kvmem through this: the server is
its own process (so a restart really drops every in-memory cache), and a turn
is one streamed ``POST /v1/agents/{id}/messages``. The client measures time to
the first streamed delta (TTFT as the user sees it) and to the ``done`` event
(E2E), and keeps the server's own ``usage`` (tokens reused / prefilled, tier).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
import trio

from benches.harness import BENCH_HOME, ROOT, log

_URL = re.compile(r"serving .* on (http://\S+)")


def stop_process(proc: subprocess.Popen[bytes] | None, name: str, timeout_s: float) -> None:
    """SIGTERM ``proc`` (a server flushes or persists what it keeps), SIGKILL it if it hangs."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log(f"{name} did not stop on SIGTERM; killing it")
        proc.kill()
        proc.wait()


class KvmemServer:
    """``python -m gateway.cli serve`` on a free loopback port, caches under ``cache_dir``.

    ``extra`` adds flags; ``env`` adds ``KVMEM_*`` settings that have no flag (``KVMEM_MAX_BATCH``).
    """

    def __init__(self, cache_dir: Path, *, model: str = "kvmem-default", extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.cache_dir = cache_dir
        self.model = model
        self.extra = extra or []
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start_s = 0.0
        self._log = cache_dir / "server.log"

    def start(self, timeout_s: float = 180.0) -> Self:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KVMEM_HOME": str(BENCH_HOME), **self.env}
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", self.model, "--home", str(BENCH_HOME),
               "--cache-dir", str(self.cache_dir), "--port", "0", *self.extra]
        t0 = time.perf_counter()
        with self._log.open("ab") as logf:
            offset = logf.tell()
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=logf)
        while time.perf_counter() - t0 < timeout_s:
            text = self._log.read_bytes()[offset:].decode(errors="replace")
            m = _URL.search(text)
            if m:
                self.url = m.group(1).rstrip("/")
                self.start_s = time.perf_counter() - t0
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvmem serve exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError("kvmem serve did not start")

    def wait_saved(self, agent_ids: list[str], timeout_s: float = 60.0) -> None:
        """Wait until each agent's cache is on disk (write-behind saves done)."""
        deadline = time.perf_counter() + timeout_s
        for agent in agent_ids:
            while time.perf_counter() < deadline:
                info = httpx.get(f"{self.url}/v1/agents/{agent}", timeout=30).json()
                if info.get("on_disk") and not info.get("dirty"):
                    break
                time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (graceful: caches flushed), SIGKILL if it hangs."""
        stop_process(self.proc, "kvmem serve", timeout_s)

    def restart(self) -> float:
        """Stop, start again over the same cache folder; returns the seconds until the port was open."""
        self.stop()
        self.start()
        return self.start_s

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class StreamedTurn:
    """One streamed turn as the client saw it, with the server's usage."""

    ttft_ms: float
    e2e_ms: float
    text: str
    usage: dict[str, Any]

    @property
    def reused(self) -> int:
        return int(self.usage.get("tokens_reused", 0))

    @property
    def prefilled(self) -> int:
        return int(self.usage.get("tokens_prefilled", 0))

    @property
    def tier(self) -> str:
        return str(self.usage.get("tier", "?"))


async def stream_turn(
    client: httpx.AsyncClient, url: str, agent: str, prompt: str, *, max_tokens: int
) -> StreamedTurn:
    """POST a raw-prompt turn with ``stream: true``; time the first delta and the done event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    result: dict[str, Any] = {}
    event = ""
    async with client.stream("POST", f"{url}/v1/agents/{agent}/messages", json=body, timeout=None) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:].strip())
                if event == "delta":
                    if first is None:
                        first = time.perf_counter()
                    parts.append(data.get("text", ""))
                elif event == "done":
                    result = data
                elif event == "error":
                    raise RuntimeError(f"turn failed: {data}")
    t1 = time.perf_counter()
    first = first if first is not None else t1
    return StreamedTurn(ttft_ms=(first - t0) * 1e3, e2e_ms=(t1 - t0) * 1e3, text="".join(parts),
                usage=dict(result.get("usage", {})))


def run_turn(url: str, agent: str, prompt: str, *, max_tokens: int) -> StreamedTurn:
    async def go() -> StreamedTurn:
        async with httpx.AsyncClient() as client:
            return await stream_turn(client, url, agent, prompt, max_tokens=max_tokens)

    return trio.run(go)
