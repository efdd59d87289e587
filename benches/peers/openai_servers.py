"""Other OpenAI-compatible servers as subprocesses, for side-by-side runs against kvmem.

* ``mlx_lm.server`` from this environment, started through a one-line launcher
  that imports ``runtime`` first so it runs on the same OpenBLAS as kvmem (on
  Linux MLX's bundled BLAS is ~30x slower: comparing against that would flatter
  kvmem). Nothing else of kvmem's is loaded in its process. Its prompt cache is
  an in-memory LRU (``--prompt-cache-size``) that a restart empties.
* ``vllm-mlx serve`` from a separate virtual environment (not a kvmem
  dependency), with OpenBLAS through ``LD_PRELOAD``, continuous batching and
  its prefix cache on; it persists that cache under ``$HOME/.cache/vllm-mlx``
  on shutdown and reloads it on startup, so ``HOME`` points into the run's
  temp folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import httpx

from benches.harness import ROOT
from benches.server import stop_process
from runtime.blas import openblas_path

_MLX_LM_LAUNCHER = "import runtime, sys; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SubprocessServer:
    """An OpenAI-compatible server process on a free loopback port, ready when ``GET /v1/models`` answers."""

    def __init__(self, name: str, command: Callable[[int], list[str]], log_dir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.command = command
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start_s = 0.0
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = log_dir / f"{name}.log"

    def start(self, timeout_s: float = 300.0) -> Self:
        port = free_port()
        t0 = time.perf_counter()
        with self._log.open("ab") as logf:
            self.proc = subprocess.Popen(self.command(port), cwd=ROOT, env=self.env, stdout=logf, stderr=logf)
        self.url = f"http://127.0.0.1:{port}"
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self._log}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not start; see {self._log}")

    def stop(self, timeout_s: float = 120.0) -> None:
        """SIGTERM (lets a server persist what it persists on shutdown), SIGKILL if it hangs."""
        stop_process(self.proc, self.name, timeout_s)

    def restart(self) -> float:
        self.stop()
        self.start()
        return self.start_s


def mlx_lm_server(model_folder: Path, log_dir: Path, extra: list[str] | None = None) -> SubprocessServer:
    """``mlx_lm.server --model <folder>`` (prompt cache on by default) in this environment."""
    return SubprocessServer(
        "mlx_lm.server",
        lambda port: [sys.executable, "-c", _MLX_LM_LAUNCHER, "--model", str(model_folder), "--port", str(port),
                      "--log-level", "WARNING", *(extra or [])],
        log_dir,
    )


def vllm_mlx_server(model_folder: Path, log_dir: Path, venv: Path, extra: list[str] | None = None) -> SubprocessServer:
    """``vllm-mlx serve <folder>`` from ``venv`` with continuous batching and its persistent prefix cache."""
    home = log_dir / "vllm-home"
    home.mkdir(parents=True, exist_ok=True)
    blas = openblas_path()
    env = {"HOME": str(home), **({"LD_PRELOAD": str(blas)} if blas else {})}
    return SubprocessServer(
        "vllm-mlx",
        lambda port: [str(venv / "bin" / "vllm-mlx"), "serve", str(model_folder), "--port", str(port),
                      "--continuous-batching", "--enable-prefix-cache", "--ssd-cache-dir", str(home / "ssd"),
                      *(extra or [])],
        log_dir,
        env,
    )
