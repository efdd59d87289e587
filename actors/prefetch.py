"""Reading the most recently used agents' caches at start, so their first turn after a restart waits for no disk.

After a restart the hot tier is empty, so every agent's first turn reads its
cache from disk before it can start: about 30 ms for 4K tokens of
kvmem-default and 60 ms for 8K, on the store's one disk thread, and more when
the machine is busy. Loading the model takes seconds, and the disk thread is
idle meanwhile, so the store spends that time on the caches most likely to be
asked for: :class:`Prefetcher` lists the cache directory and reads the newest
saved caches first, until ``budget_bytes`` (``prefetch_mb``) of them are in
memory, verified exactly as a turn's own load verifies them.

Once the model is loaded, :meth:`Prefetcher.prepare` has the MLX thread restore
the newest of them ahead of their turns (``Engine.prepare``: the Q4 arrays, and
their float where ``keep_float_mb`` has room), before ``open_runtime`` yields, so
before a server listens: the first turn after a restart then costs what a hot
turn does. A turn whose agent was prefetched takes the snapshot (and what was
restored of it) instead of reading the disk; one that arrives while its agent's
read is under way waits for that read rather than starting a second. A snapshot serves one turn (the turn's cache
then lives in the hot tier), forgetting the agent drops it, and snapshots no
turn asked for within ``keep_s`` are dropped to give the memory back.

Only for a node's own disk: with a shared tier (Redis) another node may publish
a newer cache after the read, so the store does not prefetch there.

Whoever waits for the start can watch both steps: :data:`prefetch_progress`
(``kvmem serve`` draws its start-up progress from it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Literal

import trio

from actors.mailbox import ask
from actors.messages_gpu import GpuInbox, Prepare, Prepared
from runtime.identity import AgentKey, is_checked_agent_id
from runtime.errors import CacheMiss
from runtime.persist.agents import AgentEntry
from runtime.spec import CacheSnapshot

__all__ = ["Prefetcher", "PREFETCH_KEEP_S", "PREPARE_WITHIN_S", "restorer", "prefetch_progress", "PrefetchReport"]

log = logging.getLogger("kvmem.store")

PREFETCH_KEEP_S = 600.0
"""How long a prefetched snapshot no turn asked for is kept."""

PREPARE_WITHIN_S = 10.0
"""The most time a start spends restoring prefetched caches ahead of their turns."""

PrefetchReport = Callable[[Literal["read", "restore"], int, int], None]
"""``report(step, done, total)``: ``done`` of the ``total`` caches chosen are read from disk
(``"read"``, while the model loads) or restored on the MLX thread (``"restore"``, once it has loaded)."""

prefetch_progress: ContextVar[PrefetchReport | None] = ContextVar("kvmem_prefetch_progress", default=None)
"""Who watches the read-ahead at start: set it around ``open_runtime`` (``kvmem serve`` does), and
the :class:`Prefetcher` built inside reports each cache to it. A context variable, because the
watcher is a command line's concern that no layer between it and the store has to carry (trio's
child tasks inherit it). A report that raises is logged and ignored."""


class Prefetcher:
    """The caches read ahead at start, by (agent id, model tag); see the module docstring.

    Args:
        list_agents: every stored cache, with its size and time (``TenantDirectories.list_all_agents``).
        load: reads and verifies one (``load(agent_id, model_tag=...)``).
        disk: runs a function on the store's disk thread (``CacheStoreActor._disk``).
        budget_bytes: most bytes of caches held (their size on disk, about their size in RAM).
        keep_s: unused snapshots are dropped this long after the prefetch finished.
    """

    def __init__(
        self,
        list_agents: Callable[[], list[AgentEntry]],
        load: Callable[..., CacheSnapshot],
        disk: Callable[..., Awaitable[Any]],
        *,
        budget_bytes: int,
        keep_s: float = PREFETCH_KEEP_S,
    ) -> None:
        self._list_agents = list_agents
        self._load = load
        self._disk = disk
        self._budget = budget_bytes
        self._keep_s = keep_s
        self._ready: dict[AgentKey, CacheSnapshot] = {}  # newest first
        self._prepared: dict[AgentKey, Any] = {}  # what Engine.prepare made of them
        self._reading: dict[AgentKey, trio.Event] = {}
        self._dropped: set[str] = set()  # agents forgotten while their read was under way
        self.done = trio.Event()
        self.read = self.taken = self.prepared = 0
        self.read_bytes = 0
        self.seconds = 0.0
        self._report = prefetch_progress.get()

    async def run(self) -> None:
        """Read the newest caches up to the budget, then drop what no turn took after ``keep_s``."""
        started = time.perf_counter()
        try:
            await self._read_newest()
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()
        if self.read:
            log.info("prefetched %d caches (%.1f MiB) in %.0f ms", self.read, self.read_bytes / 2**20,
                     self.seconds * 1000)
        await trio.sleep(self._keep_s)
        if self._ready:
            log.info("dropping %d prefetched caches no turn asked for", len(self._ready))
        self._ready.clear()
        self._prepared.clear()

    async def prepare(self, restore: Callable[[CacheSnapshot], Awaitable[Any]],
                      within_s: float = PREPARE_WITHIN_S) -> None:
        """Have ``restore`` (the MLX thread) restore the read caches, newest first, within ``within_s``."""
        with trio.move_on_after(within_s):
            await self.done.wait()
            started = time.perf_counter()
            keys = list(self._ready)
            for i, key in enumerate(keys):
                self._tell("restore", i, len(keys))
                snapshot = self._ready.get(key)
                if snapshot is None:  # taken or dropped meanwhile
                    continue
                restored = await restore(snapshot)
                if restored is not None and key in self._ready:
                    self._prepared[key] = restored
                    # The plan needs its text and tokens only; the arrays now live in ``restored``.
                    self._ready[key] = dataclasses.replace(snapshot, layers=[])
                    self.prepared += 1
            if keys:
                self._tell("restore", len(keys), len(keys))
            if self.prepared:
                log.info("restored %d prefetched caches ahead of their turns in %.0f ms", self.prepared,
                         (time.perf_counter() - started) * 1000)

    async def _read_newest(self) -> None:
        if self._budget <= 0:
            return
        try:
            entries = await self._disk(self._list_agents)
        except OSError as exc:
            log.warning("listing the cache directory for the prefetch failed: %s", exc)
            return
        left = self._budget
        chosen = []
        for entry in sorted(entries, key=lambda e: -(e.updated_at or 0.0)):
            if not is_checked_agent_id(entry.agent_id):
                log.warning("not reading ahead the cache of %r: not an agent id kvmem would take now", entry.agent_id)
                continue
            if entry.disk_bytes > left:
                continue
            left -= entry.disk_bytes
            chosen.append(entry)
        for entry in chosen:
            self._reading[AgentKey(entry.agent_id, entry.model_tag)] = trio.Event()
        for i, entry in enumerate(chosen):
            self._tell("read", i, len(chosen))
            key = AgentKey(entry.agent_id, entry.model_tag)
            if entry.agent_id in self._dropped:
                self._reading.pop(key).set()
                continue
            try:
                snapshot = await self._disk(self._load, entry.agent_id, model_tag=entry.model_tag)
            except (CacheMiss, OSError, ValueError) as exc:
                # The turn's own load meets the same problem and logs it as a miss.
                log.debug("prefetching %r skipped: %s", entry.agent_id, exc)
            else:
                if entry.agent_id not in self._dropped:
                    self._ready[key] = snapshot
                    self.read += 1
                    self.read_bytes += entry.disk_bytes
            finally:
                self._reading.pop(key).set()
        if chosen:
            self._tell("read", len(chosen), len(chosen))

    def _tell(self, step: Literal["read", "restore"], done: int, total: int) -> None:
        if self._report is None:
            return
        try:
            self._report(step, done, total)
        except Exception:  # a watcher's bug must not stop the start it watches
            log.exception("the prefetch progress report failed")
            self._report = None

    async def take(self, agent_id: str, model_tag: str) -> tuple[CacheSnapshot, Any] | None:
        """The agent's prefetched cache and what was restored of it (or None), once; None if there is none.

        Waits for the agent's read if it is under way.
        """
        key = AgentKey(agent_id, model_tag)
        reading = self._reading.get(key)
        if reading is not None:
            await reading.wait()
        snapshot = self._ready.pop(key, None)
        if snapshot is None:
            return None
        self.taken += 1
        return snapshot, self._prepared.pop(key, None)

    def drop(self, agent_id: str) -> None:
        """Forget the agent's prefetched caches (and any still being read)."""
        self._dropped.add(agent_id)
        for key in [k for k in self._ready if k.agent_id == agent_id]:
            del self._ready[key]
            self._prepared.pop(key, None)

    def drop_model(self, model_tag: str) -> None:
        """Forget the prefetched caches of one model (its caches were evicted)."""
        for key in [k for k in self._ready if k.model_tag == model_tag]:
            del self._ready[key]
            self._prepared.pop(key, None)

    @property
    def held_bytes(self) -> int:
        """Bytes of prefetched caches still waiting for their turn."""
        return sum(snapshot.nbytes for snapshot in self._ready.values()) + \
            sum(restored.nbytes for restored in self._prepared.values())


def restorer(gpu: trio.MemorySendChannel[GpuInbox]) -> Callable[[CacheSnapshot], Awaitable[Any]]:
    """:meth:`Prefetcher.prepare`'s ``restore``: the GPU actor's :class:`Prepare` (None where it fails)."""

    async def restore(snapshot: CacheSnapshot) -> Any:
        answer = await ask(gpu, lambda reply: Prepare(snapshot=snapshot, reply=reply))
        return answer.parked if isinstance(answer, Prepared) else None

    return restore
