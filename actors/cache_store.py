"""CacheStoreActor: sole owner of the cache directory; hot tier in RAM, warm tier on disk.

* **Hot tier**: every agent's latest parked cache per model (keyed by agent id
  and model tag, so a turn with another model never replaces the first
  model's cache), most recently used last,
  accounted in a :class:`runtime.block_pool.BlockPool` per model under
  ``hot_budget_bytes``. Full 256-token blocks are accounted by content (the
  persistence layer's block hashes), so agents whose caches begin with the
  same tokens — e.g. one started from another's system prompt — are charged
  for those blocks once; the partial last block is private. When a new cache
  does not fit, least recently used caches that are already on disk are
  dropped (demoted to the warm tier). A cache that still does not fit stays
  until its save completes and is then demoted.
* **Warm tier**: ``runtime.persist.CacheDirectory``; one disk operation at a
  time, on a worker thread (``trio.to_thread`` under ``CapacityLimiter(1)``:
  numpy and files only, never MLX).
* **Write-behind**: :class:`Put` marks the cache dirty and returns at once; a
  writer task saves dirty caches oldest first (a newer Put of the same agent
  and model supersedes an unwritten one). Loads are awaited by the agent that asked.
* **Shutdown**: on normal exit or cancellation (SIGINT/SIGTERM cancel the
  runtime), the store picks up any Put still in its mailbox and writes every
  dirty cache, shielded from the cancellation, before it returns.
* Caches carry their model tag; :class:`Fetch` and :class:`FindPrefix` only
  ever return caches made by the model asked for. An agent has one cache per
  model, on disk too (:class:`runtime.persist.CacheDirectory`); :class:`Forget`
  removes them all.

Parked caches hold MLX arrays; the store only holds references and reads
their plain attributes (text, token ids, offsets, size).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, assert_never

import msgspec
import trio

from actors.mailbox import send_reply
from actors.messages_common import Failed, HotCache, failed_from
from actors.messages_store import (
    AgentRecord,
    AgentsListed,
    Evict,
    Evicted,
    Fetch,
    FindPrefix,
    Flush,
    Flushed,
    Forget,
    Forgotten,
    HotHit,
    ListAgents,
    Miss,
    NoPrefix,
    PrefixFound,
    Put,
    StoreInbox,
    WarmHit,
)
from actors.metrics import PoolSnapshot
from runtime.block_pool import BlockPool
from runtime.errors import BudgetExceededError, CacheMiss, InvalidAgentIdError
from runtime.persist import CacheDirectory
from runtime.prefix import common_prefix_length
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot

__all__ = ["CacheStoreActor", "StoreStats"]

log = logging.getLogger("kvmem.store")


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """Hot and warm tier counters.

    ``hot_agents`` counts hot caches (one per agent and model); ``hot_bytes``
    is their physical size (shared prefixes counted per agent); ``pools`` is
    the block accounting per model tag (shared blocks counted once).
    """

    hot_agents: int
    hot_bytes: int
    dirty: int
    over_budget: int
    writes: int
    write_errors: int
    bytes_written: int
    warm_loads: int
    misses: int
    prefix_hits: int
    demotions: int
    pools: dict[str, PoolSnapshot]


_Key = tuple[str, str]
"""A hot cache's key: (agent id, model tag)."""


@dataclass
class _Entry:
    agent_id: str
    model_tag: str
    parked: HotCache
    snapshot: CacheSnapshot | None  # not None: not yet on disk
    share: bool
    version: int = 0
    accounted: bool = False

    @property
    def key(self) -> _Key:
        return (self.agent_id, self.model_tag)


SAVE_RETRY_S = 5.0
"""After a save fails with an OSError (disk full, read-only), dirty caches wait this long or for the next turn."""


class CacheStoreActor:
    """Owns the hot tier and the cache directory (see the module docstring).

    Args:
        inbox: the store mailbox (:data:`actors.messages_store.StoreInbox`).
        directory: the warm tier.
        hot_budget_bytes: budget of the hot tier.
    """

    def __init__(
        self, inbox: trio.MemoryReceiveChannel[StoreInbox], *, directory: CacheDirectory, hot_budget_bytes: int
    ) -> None:
        self._inbox = inbox
        self._directory = directory
        self._hot_budget = hot_budget_bytes
        self._limiter = trio.CapacityLimiter(1)
        self._entries: dict[_Key, _Entry] = {}  # least recently used first
        self._dirty: dict[_Key, None] = {}  # oldest first
        self._pools: dict[str, BlockPool] = {}
        self._wake = trio.Event()
        self._loads_waiting = 0
        self._no_loads = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._writes = self._write_errors = self._bytes_written = 0
        self.retry_delay_s = SAVE_RETRY_S
        self._retry_at = float("-inf")
        self._warm_loads = self._misses = self._prefix_hits = self._demotions = 0

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until the mailbox closes or the task is cancelled; then flush every dirty cache."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                task_status.started()
                async for message in self._inbox:
                    await self._handle(message)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                self._drain()
                written = await self._flush_all()
                if written:
                    log.info("flushed %d dirty caches on shutdown", written)

    def _drain(self) -> None:
        """Take the Puts still queued (a turn that completed just before shutdown)."""
        while True:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, Put):
                self._put(message)
            else:
                send_reply(message.reply, Failed(kind="Cancelled", error="the cache store is shutting down"))
        self._inbox.close()

    async def _disk(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=self._limiter)

    # -- mailbox ---------------------------------------------------------------

    async def _handle(self, message: StoreInbox) -> None:
        match message:
            case Fetch():
                entry = self._entries.get((message.agent_id, message.model_tag))
                if entry is not None:
                    self._touch(entry)
                    send_reply(message.reply, HotHit(parked=entry.parked))
                else:
                    assert self._nursery is not None
                    self._nursery.start_soon(self._load, message)
            case FindPrefix():
                send_reply(message.reply, self._find_prefix(message))
            case Put():
                self._put(message)
            case Forget():
                await self._forget(message)
            case Evict(model_tag=tag, reply=reply):
                written = await self._flush_all(tag)
                for entry in [e for e in self._entries.values() if e.model_tag == tag]:
                    self._drop(entry)
                self._pools.pop(tag, None)
                send_reply(reply, Evicted(written=written))
            case Flush(reply=reply):
                send_reply(reply, Flushed(written=await self._flush_all()))
            case ListAgents():
                assert self._nursery is not None
                self._nursery.start_soon(self._list, message)
            case _:
                assert_never(message)

    async def _load(self, message: Fetch) -> None:
        self._loads_waiting += 1
        try:
            snapshot = await self._disk(self._directory.load, message.agent_id, model_tag=message.model_tag)
        except InvalidAgentIdError as exc:
            send_reply(message.reply, failed_from(exc))
            return
        except CacheMiss as exc:
            self._misses += 1
            send_reply(message.reply, Miss(reason=str(exc)))
            return
        except OSError as exc:
            self._misses += 1
            log.warning("loading the cache of %r failed: %s", message.agent_id, exc)
            send_reply(message.reply, Miss(reason=str(exc)))
            return
        finally:
            self._loads_waiting -= 1
            if not self._loads_waiting:
                self._no_loads.set()
        self._warm_loads += 1
        send_reply(message.reply, WarmHit(snapshot=snapshot))

    async def _list(self, message: ListAgents) -> None:
        try:
            stored = await self._disk(self._directory.list_agents)
        except OSError as exc:
            send_reply(message.reply, failed_from(exc))
            return
        wanted = message.agent_id
        on_disk = {
            (e.agent_id, e.model_tag): AgentRecord(
                agent_id=e.agent_id,
                model_tag=e.model_tag,
                num_tokens=e.num_tokens,
                hot=False,
                on_disk=True,
                dirty=False,
                disk_bytes=e.disk_bytes,
                updated_at=e.updated_at,
            )
            for e in stored
            if wanted is None or e.agent_id == wanted
        }
        hot: list[AgentRecord] = []  # most recently used first
        for entry in reversed(list(self._entries.values())):
            if wanted is not None and entry.agent_id != wanted:
                continue
            disk = on_disk.pop(entry.key, None)
            hot.append(
                AgentRecord(
                    agent_id=entry.agent_id,
                    model_tag=entry.model_tag,
                    num_tokens=entry.parked.num_tokens,
                    hot=True,
                    on_disk=disk is not None,
                    dirty=entry.snapshot is not None,
                    disk_bytes=disk.disk_bytes if disk else 0,
                    updated_at=disk.updated_at if disk else None,
                )
            )
        cold = sorted(on_disk.values(), key=lambda r: -(r.updated_at or 0.0))
        # Stable: by agent id; an agent's hot caches first, most recently used first, then the newest on disk.
        records = sorted([*hot, *cold], key=lambda r: r.agent_id)
        send_reply(message.reply, AgentsListed(agents=tuple(records)))

    def _find_prefix(self, message: FindPrefix) -> NoPrefix | PrefixFound:
        best: tuple[int, _Entry] | None = None
        for entry in self._entries.values():
            parked = entry.parked
            if not entry.share or entry.agent_id == message.agent_id or parked.model_tag != message.model_tag:
                continue
            if parked.num_tokens < BLOCK_TOKENS:
                continue
            common = common_prefix_length(parked.text, message.prompt)
            keep = (bisect_right(parked.offsets, common) // BLOCK_TOKENS) * BLOCK_TOKENS
            if keep and (best is None or keep > best[0]):
                best = (keep, entry)
        if best is None:
            return NoPrefix()
        keep, entry = best
        self._prefix_hits += 1
        self._touch(entry)
        return PrefixFound(parked=entry.parked, keep_tokens=keep, donor=entry.agent_id)

    async def _forget(self, message: Forget) -> None:
        entries = [e for e in self._entries.values() if e.agent_id == message.agent_id]
        existed = bool(entries)
        for entry in entries:
            self._drop(entry)
        try:
            existed = await self._disk(self._directory.exists, message.agent_id) or existed
            await self._disk(self._directory.delete, message.agent_id)
        except (InvalidAgentIdError, OSError) as exc:
            send_reply(message.reply, failed_from(exc))
            return
        send_reply(message.reply, Forgotten(existed=existed))

    # -- hot tier --------------------------------------------------------------

    def _touch(self, entry: _Entry) -> None:
        self._entries.pop(entry.key, None)
        self._entries[entry.key] = entry

    def _pool(self, tag: str, block_bytes: int) -> BlockPool:
        pool = self._pools.get(tag)
        if pool is None:
            pool = self._pools[tag] = BlockPool(budget_bytes=self._hot_budget, bytes_per_block=max(1, block_bytes))
        return pool

    def _put(self, message: Put) -> None:
        entry = self._entries.get((message.agent_id, message.parked.model_tag))
        if entry is None:
            entry = _Entry(
                message.agent_id, message.parked.model_tag, message.parked, message.snapshot, message.share_prefix
            )
        else:
            self._unaccount(entry)
            entry.parked, entry.snapshot, entry.share = message.parked, message.snapshot, message.share_prefix
            entry.version += 1
        self._touch(entry)
        self._dirty.pop(entry.key, None)
        self._dirty[entry.key] = None
        self._account(entry, message.block_bytes)
        self._wake.set()

    def _account(self, entry: _Entry, block_bytes: int) -> None:
        """Charge ``entry`` to its model's pool, demoting clean LRU caches to make room."""
        parked = entry.parked
        pool = self._pool(parked.model_tag, block_bytes)
        hashes = self._directory.block_hashes(parked.model_tag, parked.token_ids)
        while True:
            try:
                pool.share(entry.agent_id, hashes)
                pool.reserve(entry.agent_id, parked.num_tokens)
                entry.accounted = True
                return
            except BudgetExceededError:
                pool.release(entry.agent_id)
            victim = next(
                (
                    e
                    for e in self._entries.values()
                    if e is not entry and e.snapshot is None and e.model_tag == parked.model_tag
                ),
                None,
            )
            if victim is None:
                entry.accounted = False  # demoted as soon as its save completes
                return
            self._demote(victim)

    def _unaccount(self, entry: _Entry) -> None:
        pool = self._pools.get(entry.model_tag)
        if pool is not None:
            pool.release(entry.agent_id)
        entry.accounted = False

    def _drop(self, entry: _Entry) -> None:
        self._unaccount(entry)
        self._entries.pop(entry.key, None)
        self._dirty.pop(entry.key, None)

    def _demote(self, entry: _Entry) -> None:
        self._demotions += 1
        self._drop(entry)

    # -- writes ----------------------------------------------------------------

    async def _writer(self) -> None:
        while True:
            if not self._dirty:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            if self._loads_waiting:  # an agent waits for a load; a save can wait
                await self._no_loads.wait()
                self._no_loads = trio.Event()
                continue
            if trio.current_time() < self._retry_at:  # the last save failed: wait, or for the next turn
                with trio.move_on_at(self._retry_at):
                    await self._wake.wait()
                    self._wake = trio.Event()
                self._retry_at = float("-inf")
                continue
            key = next(iter(self._dirty))
            await self._write(self._entries[key])

    async def _write(self, entry: _Entry) -> bool:
        """Save ``entry`` if it is dirty; True when this call wrote it."""
        snapshot, version = entry.snapshot, entry.version
        if snapshot is None:
            return False
        retry = False
        try:
            report = await self._disk(self._directory.save, entry.agent_id, snapshot)
        except (OSError, ValueError, InvalidAgentIdError) as exc:
            retry = isinstance(exc, OSError)  # a full or read-only disk may recover; a bad cache will not
            self._write_errors += 1
            log.error("saving the cache of %r failed: %s; it stays in RAM, retried in %.0f s or on the next turn",
                      entry.agent_id, exc, self.retry_delay_s)
            report = None
        if report is not None:
            self._writes += 1
            self._bytes_written += report.bytes_written
        if report is None and retry and self._entries.get(entry.key) is entry:
            self._dirty.pop(entry.key, None)  # keep it dirty, behind the others
            self._dirty[entry.key] = None
            self._retry_at = trio.current_time() + self.retry_delay_s
            return False
        if self._entries.get(entry.key) is entry and entry.version == version:
            entry.snapshot = None
            self._dirty.pop(entry.key, None)
            if not entry.accounted and report is not None:
                self._demote(entry)
        return report is not None

    async def _flush_all(self, model_tag: str | None = None) -> int:
        """Write every dirty cache (of ``model_tag``, if given); returns how many were written."""
        written = 0
        for key in list(self._dirty):
            entry = self._entries.get(key)
            if entry is None or (model_tag is not None and entry.model_tag != model_tag):
                continue
            written += await self._write(entry)
        return written

    # -- statistics --------------------------------------------------------------

    def statistics(self) -> StoreStats:
        return StoreStats(
            hot_agents=len(self._entries),
            hot_bytes=sum(e.parked.nbytes for e in self._entries.values()),
            dirty=len(self._dirty),
            over_budget=sum(not e.accounted for e in self._entries.values()),
            writes=self._writes,
            write_errors=self._write_errors,
            bytes_written=self._bytes_written,
            warm_loads=self._warm_loads,
            misses=self._misses,
            prefix_hits=self._prefix_hits,
            demotions=self._demotions,
            pools={tag: PoolSnapshot.of(pool.stats()) for tag, pool in self._pools.items()},
        )
