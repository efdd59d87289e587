"""CacheStoreActor: sole owner of the cache directory and of the host copies waiting for their write.

* **Hot tier**: not here. The GPU actor holds every agent's latest parked cache
  (:mod:`actors.gpu_caches`: device memory's owner keeps what lives there) and hands the store
  each one's host copy for its save (:class:`Save`); it asks the store (:class:`Load`) only for
  an agent it holds nothing of. The store answers from a copy still queued for its write (a
  cache the GPU actor dropped from RAM before it was on disk), else one read ahead at start,
  else the disk.
* **Warm tier**: ``runtime.persist.CacheDirectory``; one disk operation at a
  time, on a worker thread (``trio.to_thread`` under ``CapacityLimiter(1)``:
  numpy and files only, never MLX).
* **Write-behind**: a :class:`Save` queues the copy and returns at once; a
  writer task saves queued copies oldest first (a newer cache of the same agent
  and model supersedes an unwritten one). Loads are awaited by the turn that asked.
* **Durable turns**: a :class:`Save` with a ``saved`` channel goes to the front of
  the queue and is answered once it (or a newer cache of the same agent and model) is
  on disk, with the turn's own reply, which the GPU actor handed over with it, so the
  agent hears of its turn only then, or ``Failed(kind="NotSaved")`` when its save
  fails or the agent is forgotten first.
* **Shutdown**: on normal exit or cancellation (SIGINT/SIGTERM cancel the
  runtime), the store takes every Save still coming (the GPU actor's last copies, until it
  closes its end of the mailbox) and writes them all, shielded from the cancellation, before it
  returns.
* **Shared tier** (``store = "redis://..."``): a :class:`runtime.persist.remote.RemoteTier`
  on the same disk thread. A load first pulls the agent's cache from Redis onto
  the disk when Redis holds another one than the disk (the turn's tier is then
  ``remote``); each save is then published to Redis. Redis down: loads and
  saves use the disk alone, and caches saved meanwhile are published when it
  answers again (tried every :data:`actors.shared_tier.REPUBLISH_S`).
* **Leases**: with a shared tier, every turn loads (:class:`Load`), and the store first takes the
  agent's cluster lease (:meth:`runtime.persist.remote.RemoteTier.lease`), waiting up
  to :data:`actors.shared_tier.LEASE_WAIT_S` while another node holds it, then answers
  ``Failed(kind="AgentBusy")``. The lease is given back after the turn's last
  :class:`Save` (``ends_turn``) once its cache is published, under the lease's fence.
* **Tenants**: an agent id that names a tenant (:mod:`runtime.identity`) keeps its caches in
  that tenant's subtree of the cache directory (:class:`runtime.persist.tenants.TenantDirectories`);
  a listing is one tenant's, and :class:`MeasureUsage` is what one tenant holds (for its limits).
* Caches carry their model tag; a plan only ever uses caches made by the model asked for. An agent has one cache per
  model, on disk too (:class:`runtime.persist.CacheDirectory`); :class:`Forget`
  removes them all, and the blocks no other agent's cache references. With a
  shared tier, forgetting is cluster-wide: Redis keeps a tombstone, and a node
  whose lease check (:meth:`runtime.persist.remote.RemoteTier.check`) finds one
  newer than its copies drops them (its :class:`Loaded` tells the GPU actor to drop its own).

The store holds no MLX object: numpy copies, files and Redis only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

import msgspec
import trio

from actors.mailbox import send_reply
from actors.messages_common import Failed, failed_from
from actors.metrics import GpuEvent
from actors.messages_store import (
    AgentRecord,
    AgentsListed,
    BlocksRead,
    Evict,
    Evicted,
    Flush,
    Flushed,
    Forget,
    Forgotten,
    ListAgents,
    Load,
    Loaded,
    ReadBlocks,
    Save,
    Saved,
    StoreInbox,
    MeasureUsage,
    Used,
)
from actors.prefetch import Prefetcher
from actors.shared_tier import RemoteStats, SharedTier
from runtime.plan.turn_plan import FromWarm, OwnCache, Tier
from runtime.errors import CacheMiss, InvalidAgentIdError
from runtime.identity import AgentKey, is_checked_agent_id, local_id, safe_agent_dirname, tenant_of
from runtime.plan.block_pool import PoolStats
from runtime.plan.hot_tier import HotTierStats
from runtime.persist import CacheDirectory
from runtime.plan.save_queue import SaveQueue, WaitForLoads, WaitUntil, Write
from runtime.persist.agents import AgentEntry
from runtime.persist.tenants import TenantDirectories
from runtime.spec import CacheSnapshot, LayerSnapshot

if TYPE_CHECKING:
    from runtime.persist.remote import RemoteTier

__all__ = ["CacheStoreActor", "StoreStats"]

log = logging.getLogger("kvmem.store")

DRAIN_S = 90.0
"""At shutdown, the longest the store waits for the GPU actor's last copies (it makes them for up to a minute)."""


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """Hot and warm tier counters (the hot tier's are the GPU actor's, :mod:`actors.gpu_caches`).

    ``hot_agents`` counts hot caches (one per agent and model); ``hot_bytes``
    is their physical size (shared prefixes counted per agent); ``pools`` is
    the block accounting per model tag (shared blocks counted once); ``dirty``:
    copies queued for their write.
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
    demotions: int
    pools: dict[str, PoolStats]
    remote: RemoteStats | None = None
    prefetched: int = 0  # caches read ahead at start (actors/prefetch.py)
    prefetch_hits: int = 0  # turns that took a prefetched cache instead of reading the disk
    prefetch_held_bytes: int = 0  # prefetched caches still waiting for their turn
    prefetch_restored: int = 0  # of those read ahead, restored on the MLX thread before serving
    block_reads: int = 0  # turns that started from whole blocks read by their hash chain (ReadBlocks)



@dataclass(frozen=True)
class _Pending:
    """A cache not yet on disk: its numpy copy, its full blocks' hashes (the GPU actor's)."""

    agent_id: str
    snapshot: CacheSnapshot
    block_hashes: tuple[str, ...]


@dataclass(frozen=True)
class _Waiter:
    """A durable turn waiting for its cache's save: where to answer, and with what once it is on disk."""

    channel: trio.MemorySendChannel[Any]
    answer: msgspec.Struct | None  # the turn's own reply (None: Saved)

    def saved(self) -> None:
        send_reply(self.channel, self.answer if self.answer is not None else Saved())

    def failed(self, error: str) -> None:
        send_reply(self.channel, Failed(kind="NotSaved", error=error))


class CacheStoreActor:
    """Owns the cache directory and the copies queued for it (see the module docstring).

    Args:
        inbox: the store mailbox (:data:`actors.messages_store.StoreInbox`).
        directory: the warm tier (the tenants' subtrees are inside it).
        remote: the shared tier (None: this node's disk only).
        prefetch_bytes: how much of the newest caches to read ahead at start (:mod:`actors.prefetch`).
        listing: the caches on disk at start, when the runtime listed them already (None: the read-ahead lists).
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[StoreInbox],
        *,
        directory: CacheDirectory,
        remote: RemoteTier | None = None,
        prefetch_bytes: int = 0,
        listing: list[AgentEntry] | None = None,
        events: deque[GpuEvent] | None = None,
    ) -> None:
        self._inbox = inbox
        self._events = events  # the runtime's trace (the GPU actor's log), when it is on: saves and reads join it
        self._directory = TenantDirectories(directory)
        self._limiter = trio.CapacityLimiter(1)
        # A turn's read has its own thread: it never waits behind a write in progress (a long
        # context's save takes a while). Reads and writes never touch one file: a cache queued for
        # its write is served from the queue, never read from the disk.
        self._read_limiter = trio.CapacityLimiter(1)
        # Unsaved caches and the durable turns waiting for them: the write-behind policy.
        self._saves: SaveQueue[AgentKey, _Pending, _Waiter] = SaveQueue()
        self._wake = trio.Event()
        self._loads_waiting = 0
        self._no_loads = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._writes = self._write_errors = self._bytes_written = 0
        self._warm_loads = self._misses = self._block_reads = 0
        self._remote = remote
        self.shared = None if remote is None else SharedTier(
            remote, disk=self._disk, dirty=lambda agent_id: any(key.agent_id == agent_id for key in self._saves.keys()))
        # Not with a shared tier: another node may publish a newer cache after the read.
        listed = self._directory.list_all_agents if listing is None else lambda: listing
        self.prefetch = Prefetcher(listed, self._directory.load, self._disk,
                                   budget_bytes=prefetch_bytes) if prefetch_bytes > 0 and remote is None else None

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until the mailbox closes or the task is cancelled; then flush every dirty cache."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                if self.prefetch is not None:
                    nursery.start_soon(self.prefetch.run)
                if self.shared is not None:
                    nursery.start_soon(self.shared.republisher)
                    nursery.start_soon(self.shared.renewer)
                task_status.started()
                async for message in self._inbox:
                    await self._handle(message)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._drain()
                written = await self._flush_all()
                if written:
                    log.info("flushed %d dirty caches on shutdown", written)
                for waiter in self._saves.drop(lambda key: True):
                    waiter.failed("the cache store stopped first")
                if self.shared is not None:
                    await self.shared.release_all()

    async def _drain(self) -> None:
        """Take the Saves still coming (a turn that completed just before shutdown; the GPU actor's last copies,
        made as it stops) until every sender has closed its end, or :data:`DRAIN_S` went by."""
        with trio.move_on_after(DRAIN_S):
            while True:
                try:
                    message = await self._inbox.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    break
                if isinstance(message, Save):
                    self._save(message, None)  # its lease goes with the others after the last saves
                else:
                    send_reply(message.reply, Failed(kind="Cancelled", error="the cache store is shutting down"))
        self._inbox.close()

    async def _disk(self, fn: Any, *args: Any, limiter: trio.CapacityLimiter | None = None, **kwargs: Any) -> Any:
        """``fn`` on a disk thread: the writes' one (default), or ``limiter``'s."""
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=limiter or self._limiter)

    # -- mailbox ---------------------------------------------------------------

    async def _handle(self, message: StoreInbox) -> None:
        match message:
            case Load(agent_id=agent_id, model_tag=tag):
                try:
                    key = AgentKey(agent_id, tag)  # every door checks the id: a caller that did not is refused
                except InvalidAgentIdError as exc:
                    send_reply(message.reply, failed_from(exc))
                    return
                if self.shared is None and (message.hot or key in self._saves):
                    send_reply(message.reply, self._loaded(message, keeps_hot=message.hot))  # no disk to read
                else:
                    assert self._nursery is not None
                    self._nursery.start_soon(self._load_for, message)
            case Save():
                self._save(message, self._nursery)
            case Forget():
                await self._forget(message)
            case Evict(model_tag=tag, reply=reply):
                written = await self._flush_all(tag)
                for waiter in self._saves.drop(lambda key: key.model_tag == tag):
                    waiter.failed(f"model {tag!r} was unloaded first")
                if self.prefetch is not None:
                    self.prefetch.drop_model(tag)
                send_reply(reply, Evicted(written=written))
            case Flush(reply=reply):
                send_reply(reply, Flushed(written=await self._flush_all()))
            case ListAgents():
                assert self._nursery is not None
                self._nursery.start_soon(self._list, message)
            case MeasureUsage():
                assert self._nursery is not None
                self._nursery.start_soon(self._usage, message)
            case ReadBlocks():
                assert self._nursery is not None
                self._nursery.start_soon(self._read_blocks, message)
            case _:
                assert_never(message)

    async def _load_for(self, message: Load) -> None:
        """Take the agent's lease (shared tier), read its disk cache unless the GPU actor's hot one stands, then
        answer (an unreadable cache: a logged miss)."""
        warm: CacheSnapshot | None = None
        prepared: Any = None  # the prefetched cache restored at start (actors/prefetch.py)
        tier: Tier = "warm"
        stale = forgotten = False
        self._loads_waiting += 1
        try:
            if self.shared is not None and not await self.shared.take_lease(message.agent_id):
                send_reply(message.reply, Failed(
                    kind="AgentBusy", error=f"agent {message.agent_id!r} is in a turn on another node; retry shortly"))
                return
            key = AgentKey(message.agent_id, message.model_tag)
            if self.shared is not None:
                match await self._disk(self.shared.remote.check, *key, limiter=self._read_limiter):  # a Redis read
                    case "forgotten":  # on another node, since this node last held the agent: drop every copy
                        await self._forget_here(message.agent_id)
                        forgotten = True
                    case "newer" if message.hot and not message.unsaved and key not in self._saves:
                        stale = True  # another node served the agent since: Redis has more of it
                    case _:
                        pass
            keeps_hot = message.hot and not stale and not forgotten
            if keeps_hot or key in self._saves:
                send_reply(message.reply, self._loaded(message, keeps_hot=keeps_hot, stale=stale, forgotten=forgotten))
                return
            taken = None if self.prefetch is None else await self.prefetch.take(*key)
            if taken is None:
                started = time.perf_counter()
                warm, tier = await self._disk(self._load, message.agent_id, message.model_tag,
                                              limiter=self._read_limiter)  # beside the writes, not after them
                self._traced("read", started, f"{warm.num_tokens} tokens")
            else:
                warm, prepared = taken
            self._warm_loads += 1
        except InvalidAgentIdError as exc:
            send_reply(message.reply, failed_from(exc))
            return
        except CacheMiss:
            self._misses += 1
        except OSError as exc:
            self._misses += 1
            log.warning("loading the cache of %r failed: %s", message.agent_id, exc)
        finally:
            self._loads_waiting -= 1
            if not self._loads_waiting:
                self._no_loads.set()
        own = None
        if warm is not None and warm.model_tag == message.model_tag:
            own = OwnCache(source=FromWarm(snapshot=warm, prepared=prepared), tier=tier)
        send_reply(message.reply, Loaded(own=own, stale=stale, forgotten=forgotten))

    def _loaded(self, message: Load, *, keeps_hot: bool, stale: bool = False, forgotten: bool = False) -> Loaded:
        """The answer that reads no disk: the GPU actor's hot cache stands (``keeps_hot``: None), or the copy queued
        for its write (a cache the GPU actor dropped from RAM before it was on disk: it is newer than the disk's)."""
        if keeps_hot:
            return Loaded(own=None)
        queued = self._saves.get(AgentKey(message.agent_id, message.model_tag))
        own = None if queued is None else OwnCache(source=FromWarm(snapshot=queued.item.snapshot), tier="warm")
        return Loaded(own=own, stale=stale, forgotten=forgotten)

    async def _read_blocks(self, message: ReadBlocks) -> None:
        """A prompt's first whole blocks from its tenant's disk, on the read thread (an unreadable one: a logged miss)."""
        started = time.perf_counter()
        layers: list[LayerSnapshot] = []
        try:
            layers = await self._disk(self._directory.read_prefix_blocks, message.agent_id, message.model_tag,
                                      message.token_ids, layer_kinds=message.layer_kinds, limiter=self._read_limiter)
        except (OSError, ValueError, CacheMiss) as exc:
            log.warning("reading blocks for %r failed: %s", message.agent_id, exc)
        tokens = next(iter(layers[0].arrays.values())).shape[1] if layers else 0
        if tokens:
            self._block_reads += 1
            self._traced("read", started, f"{tokens} tokens of blocks")
        send_reply(message.reply, BlocksRead(tokens=tokens, layers=tuple(layers)))

    def _traced(self, kind: str, started: float, detail: str) -> None:
        """A disk job that ended now joins the runtime's trace, when it is on (``save``: a cache written, on the
        disk thread, whose Python parts hold the GIL the model's thread builds its graphs under; ``read``: a
        cache read for a turn)."""
        if self._events is not None:
            now = time.perf_counter()
            self._events.append(GpuEvent(kind=kind, request_ids=(), at=now, took_ms=(now - started) * 1e3,
                                         detail=detail))

    def _load(self, agent_id: str, model_tag: str) -> tuple[CacheSnapshot, Tier]:
        """On the disk thread: pull the agent's cache from the shared tier if it has another one, then load it."""
        pulled = self._remote is not None and self._remote.pull(agent_id, model_tag)
        return self._directory.load(agent_id, model_tag=model_tag), "remote" if pulled else "warm"

    async def _list(self, message: ListAgents) -> None:
        wanted = message.agent_id
        tenant = message.tenant if wanted is None else tenant_of(wanted)
        try:
            stored = await self._disk(self._directory.list_agents, tenant)
        except (OSError, ValueError) as exc:
            send_reply(message.reply, failed_from(exc))
            return
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
        hot: list[AgentRecord] = []  # most recently used first (the GPU actor's order)
        for entry in message.hot:
            if (wanted is not None and entry.agent_id != wanted) or tenant_of(entry.agent_id) != tenant:
                continue
            key = AgentKey(entry.agent_id, entry.model_tag)
            disk = on_disk.pop(key, None)
            hot.append(
                AgentRecord(
                    agent_id=entry.agent_id,
                    model_tag=entry.model_tag,
                    num_tokens=entry.num_tokens,
                    hot=True,
                    on_disk=disk is not None,
                    dirty=entry.unsaved or key in self._saves,
                    disk_bytes=disk.disk_bytes if disk else 0,
                    updated_at=disk.updated_at if disk else None,
                )
            )
        cold = sorted(on_disk.values(), key=lambda r: -(r.updated_at or 0.0))
        # Stable: by agent id; an agent's hot caches first, most recently used first, then the newest on disk.
        local = [*hot, *cold]
        published = await self._remote_records(wanted, tenant, local)  # marks the local records Redis has newer
        records = sorted([*local, *published], key=lambda r: r.agent_id)
        send_reply(message.reply, AgentsListed(agents=tuple(records)))

    async def _remote_records(self, wanted: str | None, tenant: str | None,
                              local: list[AgentRecord]) -> list[AgentRecord]:
        """The shared tier's caches this node has no copy of, and marks ``local`` records Redis has a newer copy of.

        Newer is by the manifests' save time (each node's clock): a cache another node saved
        after this node's copy, which the agent's next turn here pulls from Redis.
        """
        if self.shared is None:
            return []
        published = await self._disk(self.shared.remote.list_agents)
        mine = {(r.agent_id, r.model_tag): i for i, r in enumerate(local)}
        only_remote = []
        for entry in published:
            if (wanted is not None and entry.agent_id != wanted) or tenant_of(entry.agent_id) != tenant \
                    or not is_checked_agent_id(entry.agent_id):
                continue
            key = AgentKey(entry.agent_id, entry.model_tag)
            if key in mine:
                record = local[mine[key]]
                if not record.dirty and entry.updated_at > (record.updated_at or 0.0):
                    local[mine[key]] = msgspec.structs.replace(record, remote=True)
                continue
            only_remote.append(AgentRecord(agent_id=entry.agent_id, model_tag=entry.model_tag,
                                           num_tokens=entry.num_tokens, hot=False, on_disk=False, dirty=False,
                                           disk_bytes=0, updated_at=entry.updated_at, remote=True))
        return only_remote

    async def _usage(self, message: MeasureUsage) -> None:
        try:
            disk = await self._disk(self._directory.usage, message.tenant)
        except (OSError, ValueError) as exc:
            send_reply(message.reply, failed_from(exc))
            return
        in_ram = message.in_ram | {key.agent_id for key in self._saves.keys()}
        dirs = {safe_agent_dirname(local_id(a)) for a in in_ram if tenant_of(a) == message.tenant}
        send_reply(message.reply, Used(agent_dirs=disk.agent_dirs | dirs, disk_bytes=disk.disk_bytes))

    async def _forget(self, message: Forget) -> None:
        try:
            existed = await self._forget_here(message.agent_id) or message.had_hot
            if self.shared is not None:
                existed = await self.shared.forget(message.agent_id) or existed
        except (InvalidAgentIdError, OSError) as exc:
            send_reply(message.reply, failed_from(exc))
            return
        send_reply(message.reply, Forgotten(existed=existed))

    async def _forget_here(self, agent_id: str) -> bool:
        """Drop the store's copies of the agent: queued and on disk; whether there were any (the GPU actor drops
        its hot ones).

        Raises:
            InvalidAgentIdError, OSError: from the cache directory.
        """
        if self.prefetch is not None:
            self.prefetch.drop(agent_id)
        existed = any(key.agent_id == agent_id for key in self._saves.keys())
        for waiter in self._saves.drop(lambda key: key.agent_id == agent_id):
            waiter.failed(f"agent {agent_id!r} was forgotten first")
        if self.shared is not None:
            self.shared.drop_unpublished(agent_id)
        on_disk = await self._disk(self._directory.exists, agent_id)
        # The blocks only this agent referenced go too (one scan of its directory; forgetting is rare).
        await self._disk(self._directory.delete, agent_id)
        return on_disk or existed

    # -- saves ----------------------------------------------------------------

    def _save(self, message: Save, nursery: trio.Nursery | None) -> None:
        """A copy to write behind (if any); then, with a shared tier, the turn's lease may go."""
        if message.cache is not None:
            key = AgentKey(message.agent_id, message.cache.snapshot.model_tag)
            waiter = None if message.saved is None else _Waiter(message.saved, message.answer)
            self._saves.put(key, _Pending(message.agent_id, message.cache.snapshot, message.cache.block_hashes),
                            waiter)
            self._wake.set()
        elif message.saved is not None:  # nothing to write: answered at once
            _Waiter(message.saved, message.answer).saved()
        if self.shared is not None and message.ends_turn:
            self.shared.end_turn(message.agent_id, nursery)

    # -- writes ----------------------------------------------------------------

    async def _writer(self) -> None:
        """Carry out the write-behind policy (:class:`runtime.plan.save_queue.SaveQueue`): write, or wait for why not."""
        while True:
            match self._saves.next(trio.current_time(), loads_waiting=self._loads_waiting > 0):
                case None:  # nothing dirty
                    await self._wake.wait()
                    self._wake = trio.Event()
                case WaitForLoads():  # an agent waits for a load; a save can wait
                    await self._no_loads.wait()
                    self._no_loads = trio.Event()
                case WaitUntil(at=retry_at):  # the last save failed: wait, or for the next turn
                    with trio.move_on_at(retry_at):
                        await self._wake.wait()
                        self._wake = trio.Event()
                case Write(key=key):
                    await self._write(key)

    async def _write(self, key: AgentKey) -> bool:
        """Save the cache pending under ``key``, if any; True when this call wrote it."""
        dirty = self._saves.get(key)
        if dirty is None:
            return False
        pending = dirty.item
        retry = False
        try:
            started = time.perf_counter()
            report = await self._disk(self._directory.save, pending.agent_id, pending.snapshot,
                                      block_hashes=list(pending.block_hashes))
            self._traced("save", started, f"{report.bytes_written} bytes written")
        except (OSError, ValueError, InvalidAgentIdError) as exc:
            retry = isinstance(exc, OSError)  # a full or read-only disk may recover; a bad cache will not
            self._write_errors += 1
            later = f"retried in {self._saves.retry_delay_s:.0f} s or on the next turn" if retry else \
                "saved with the agent's next turn"
            log.error("saving the cache of %r failed: %s; its copy stays in RAM, %s", pending.agent_id, exc, later)
            report = None
            error: str | None = f"the cache was not saved: {exc}"
        else:
            error = None
        for waiter in self._saves.answered(key, dirty):
            waiter.saved() if error is None else waiter.failed(error)
        if report is not None:
            self._writes += 1
            self._bytes_written += report.bytes_written
            if self.shared is not None and self._saves.get(key) is dirty:
                # Not a superseded cache (the newer one is published soon) nor a forgotten one (never again).
                await self.shared.publish(key)
        if not self._saves.settle(key, dirty, saved=report is not None, retry=retry, now=trio.current_time()):
            return report is not None  # superseded or forgotten meanwhile, or kept for a retry
        if self.shared is not None:
            await self.shared.release(pending.agent_id)  # if its turns are over
        return report is not None

    async def _flush_all(self, model_tag: str | None = None) -> int:
        """Write every dirty cache (of ``model_tag``, if given); returns how many were written."""
        written = 0
        for key in self._saves.keys():
            if model_tag is None or key.model_tag == model_tag:
                written += await self._write(key)
        return written

    # -- statistics --------------------------------------------------------------

    def statistics(self, hot: HotTierStats, owed: frozenset[AgentKey] = frozenset()) -> StoreStats:
        """The store's counters, with the GPU actor's: ``hot``, its hot tier's; ``owed``, the caches whose copy it
        still owes (not on disk either: ``dirty`` counts them with the store's queue)."""
        return StoreStats(
            hot_agents=hot.hot_agents,
            hot_bytes=hot.hot_bytes,
            dirty=len(set(self._saves.keys()) | owed),
            over_budget=hot.over_budget,
            writes=self._writes,
            write_errors=self._write_errors,
            bytes_written=self._bytes_written,
            warm_loads=self._warm_loads,
            misses=self._misses,
            block_reads=self._block_reads,
            demotions=hot.demotions,
            pools=dict(hot.pools),
            remote=None if self.shared is None else self.shared.statistics(),
            prefetched=0 if self.prefetch is None else self.prefetch.read,
            prefetch_hits=0 if self.prefetch is None else self.prefetch.taken,
            prefetch_held_bytes=0 if self.prefetch is None else self.prefetch.held_bytes,
            prefetch_restored=0 if self.prefetch is None else self.prefetch.prepared,
        )
