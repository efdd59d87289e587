"""CacheStoreActor: sole owner of the cache directory; plans turns over the hot and warm tiers.

* **Hot tier**: a :class:`runtime.plan.hot_tier.HotTier`, the store's own, holds every
  agent's latest parked cache per model and its block accounting. A :class:`CheckOut` (a
  turn begins, from the GPU actor) answers with the agent's own cache, its hot one or,
  without one, the one it reads from disk, and, for an agent that shares prefixes, the
  other sharing agents' hot caches (the GPU actor then plans the turn against the rendered
  prompt); a :class:`CheckIn` (the turn ends) makes its new cache hot; a completed save
  lets the hot tier drop the cache from RAM.
* **Warm tier**: ``runtime.persist.CacheDirectory``; one disk operation at a
  time, on a worker thread (``trio.to_thread`` under ``CapacityLimiter(1)``:
  numpy and files only, never MLX).
* **Write-behind**: :class:`CheckIn` marks the cache dirty and returns at once; a
  writer task saves dirty caches oldest first (a newer cache of the same agent
  and model supersedes an unwritten one). Loads are awaited by the agent that asked.
* **Durable turns**: a :class:`CheckIn` with a ``saved`` channel goes to the front of
  the queue and is answered once it (or a newer cache of the same agent and model) is
  on disk — with the turn's own reply, which the GPU actor handed over with it, so the
  agent hears of its turn only then — or ``Failed(kind="NotSaved")`` when its save
  fails or the agent is forgotten first.
* **Shutdown**: on normal exit or cancellation (SIGINT/SIGTERM cancel the
  runtime), the store picks up any CheckIn still in its mailbox and writes every
  dirty cache, shielded from the cancellation, before it returns.
* **Shared tier** (``store = "redis://..."``): a :class:`runtime.persist.remote.RemoteTier`
  on the same disk thread. A load first pulls the agent's cache from Redis onto
  the disk when Redis holds another one than the disk (the turn's tier is then
  ``remote``); each save is then published to Redis. Redis down: loads and
  saves use the disk alone, and caches saved meanwhile are published when it
  answers again (tried every :data:`actors.shared_tier.REPUBLISH_S`).
* **Leases**: with a shared tier, every :class:`CheckOut` first takes the
  agent's cluster lease (:meth:`runtime.persist.remote.RemoteTier.lease`), waiting up
  to :data:`actors.shared_tier.LEASE_WAIT_S` while another node holds it, then answers
  ``Failed(kind="AgentBusy")``. The lease is given back after the turn's
  :class:`CheckIn` once its cache is published, under the lease's fence.
* **Tenants**: an agent id that names a tenant (:mod:`runtime.identity`) keeps its caches in
  that tenant's subtree of the cache directory (:class:`runtime.persist.tenants.TenantDirectories`);
  a listing is one tenant's, and :class:`MeasureUsage` is what one tenant holds (for its limits).
* Caches carry their model tag; a plan only ever uses caches made by the model asked for. An agent has one cache per
  model, on disk too (:class:`runtime.persist.CacheDirectory`); :class:`Forget`
  removes them all, and the blocks no other agent's cache references. With a
  shared tier, forgetting is cluster-wide: Redis keeps a tombstone, and a node
  whose lease check (:meth:`runtime.persist.remote.RemoteTier.check`) finds one
  newer than its copies drops them before planning the turn.

Parked caches hold MLX arrays; the store and the manager only hold references
and read their plain attributes (text, token ids, offsets, size).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

import msgspec
import trio

from actors.mailbox import send_reply
from actors.messages_common import Failed, ParkedView, failed_from
from actors.metrics import GpuEvent
from actors.messages_store import (
    AgentRecord,
    AgentsListed,
    BlocksRead,
    CheckedOut,
    CheckIn,
    CheckOut,
    Evict,
    Evicted,
    Flush,
    Flushed,
    Forget,
    Forgotten,
    ListAgents,
    ReadBlocks,
    Saved,
    SnapshotDue,
    SnapshotLost,
    StoreInbox,
    MeasureUsage,
    Used,
)
from actors.prefetch import Prefetcher
from actors.shared_tier import RemoteStats, SharedTier
from runtime.plan.turn_plan import Tier
from runtime.errors import CacheMiss, InvalidAgentIdError
from runtime.identity import AgentKey, is_checked_agent_id, local_id, safe_agent_dirname, tenant_of
from runtime.plan.block_pool import PoolStats
from runtime.plan.hot_tier import HotEntry, HotTier
from runtime.persist import CacheDirectory
from runtime.plan.save_queue import SaveQueue, WaitForLoads, WaitUntil, Write
from runtime.persist.tenants import TenantDirectories
from runtime.spec import CacheSnapshot, LayerSnapshot

if TYPE_CHECKING:
    from runtime.persist.remote import RemoteTier

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
    """A hot cache not yet on disk: the cache, its numpy copy for the save (or the copy the GPU
    actor owes), its full blocks' hashes."""

    agent_id: str
    parked: ParkedView
    snapshot: CacheSnapshot | SnapshotDue
    block_hashes: list[str]  # computed once, for the hot tier's accounting and the save


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
    """Owns the cache directory and feeds the cache manager (see the module docstring).

    Args:
        inbox: the store mailbox (:data:`actors.messages_store.StoreInbox`).
        directory: the warm tier (the tenants' subtrees are inside it).
        hot: the hot tier (the store's own).
        remote: the shared tier (None: this node's disk only).
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[StoreInbox],
        *,
        directory: CacheDirectory,
        hot: HotTier,
        remote: RemoteTier | None = None,
        prefetch_bytes: int = 0,
        events: deque[GpuEvent] | None = None,
    ) -> None:
        self._inbox = inbox
        self._events = events  # the runtime's trace (the GPU actor's log), when it is on: saves and reads join it
        self._directory = TenantDirectories(directory)
        self._hot = hot
        self._limiter = trio.CapacityLimiter(1)
        # A turn's read has its own thread: it never waits behind a write in progress (a long
        # context's save takes a while). Reads and writes never touch one file: an agent is read
        # only when it has no hot cache, and a cache leaves RAM only once it is on disk.
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
        self.prefetch = Prefetcher(self._directory.list_all_agents, self._directory.load, self._disk,
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
                self._drain()
                written = await self._flush_all()
                if written:
                    log.info("flushed %d dirty caches on shutdown", written)
                for waiter in self._saves.drop(lambda key: True):
                    waiter.failed("the cache store stopped first")
                if self.shared is not None:
                    await self.shared.release_all()

    def _drain(self) -> None:
        """Take the Puts still queued (a turn that completed just before shutdown)."""
        while True:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, CheckIn):
                self._check_in(message, None)  # its lease goes with the others after the last saves
            else:
                send_reply(message.reply, Failed(kind="Cancelled", error="the cache store is shutting down"))
        self._inbox.close()

    async def _disk(self, fn: Any, *args: Any, limiter: trio.CapacityLimiter | None = None, **kwargs: Any) -> Any:
        """``fn`` on a disk thread: the writes' one (default), or ``limiter``'s."""
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=limiter or self._limiter)

    # -- mailbox ---------------------------------------------------------------

    async def _handle(self, message: StoreInbox) -> None:
        match message:
            case CheckOut(agent_id=agent_id, model_tag=tag):
                try:
                    key = AgentKey(agent_id, tag)  # every door checks the id: a caller that did not is refused
                except InvalidAgentIdError as exc:
                    send_reply(message.reply, failed_from(exc))
                    return
                if self.shared is not None or self._hot.needs_disk(*key):
                    assert self._nursery is not None
                    self._nursery.start_soon(self._check_out_after_load, message)
                else:
                    send_reply(message.reply, self._checked_out(message))
            case CheckIn():
                self._check_in(message, self._nursery)
            case Forget():
                await self._forget(message)
            case Evict(model_tag=tag, reply=reply):
                written = await self._flush_all(tag)
                for waiter in self._saves.drop(lambda key: key.model_tag == tag):
                    waiter.failed(f"model {tag!r} was unloaded first")
                self._hot.drop_model(tag)
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

    async def _check_out_after_load(self, message: CheckOut) -> None:
        """Take the agent's lease (shared tier), read its disk cache, then answer (an unreadable cache: a logged miss)."""
        warm: CacheSnapshot | None = None
        prepared: Any = None  # the prefetched cache restored at start (actors/prefetch.py)
        tier: Tier = "warm"
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
                    case "newer" if not self._hot.needs_disk(*key) and key not in self._saves:
                        self._hot.drop(*key)  # another node served the agent since: Redis has more of it
                    case _:
                        pass
            if not self._hot.needs_disk(*key):
                send_reply(message.reply, self._checked_out(message))
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
        send_reply(message.reply, self._checked_out(message, warm=warm, warm_tier=tier, prepared=prepared))

    def _checked_out(self, message: CheckOut, **warm: Any) -> CheckedOut:
        """The agent's own cache (its hot one, else ``warm``'s) and, when it shares, the others' hot caches."""
        own = self._hot.checkout(message.agent_id, message.model_tag, **warm)
        donors = self._hot.donors(message.agent_id, message.model_tag) if message.share_prefix else ()
        return CheckedOut(own=own, donors=donors)

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
        hot: list[AgentRecord] = []  # most recently used first
        for entry in reversed(self._hot.entries()):
            if (wanted is not None and entry.agent_id != wanted) or tenant_of(entry.agent_id) != tenant:
                continue
            disk = on_disk.pop(entry.key, None)
            hot.append(
                AgentRecord(
                    agent_id=entry.agent_id,
                    model_tag=entry.model_tag,
                    num_tokens=entry.parked.num_tokens,
                    hot=True,
                    on_disk=disk is not None,
                    dirty=entry.key in self._saves,
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
        in_ram = {e.agent_id for e in self._hot.entries()} | {key.agent_id for key in self._saves.keys()}
        dirs = {safe_agent_dirname(local_id(a)) for a in in_ram if tenant_of(a) == message.tenant}
        send_reply(message.reply, Used(agent_dirs=disk.agent_dirs | dirs, disk_bytes=disk.disk_bytes))

    async def _forget(self, message: Forget) -> None:
        try:
            existed = await self._forget_here(message.agent_id)
            if self.shared is not None:
                existed = await self.shared.forget(message.agent_id) or existed
        except (InvalidAgentIdError, OSError) as exc:
            send_reply(message.reply, failed_from(exc))
            return
        send_reply(message.reply, Forgotten(existed=existed))

    async def _forget_here(self, agent_id: str) -> bool:
        """Drop this node's copies of the agent: hot, unsaved and on disk; whether there were any.

        Raises:
            InvalidAgentIdError, OSError: from the cache directory.
        """
        if self.prefetch is not None:
            self.prefetch.drop(agent_id)
        existed = self._hot.forget(agent_id) > 0
        for due in self._copies_owed(lambda key: key.agent_id == agent_id):
            due.drop()
        for waiter in self._saves.drop(lambda key: key.agent_id == agent_id):
            waiter.failed(f"agent {agent_id!r} was forgotten first")
        if self.shared is not None:
            self.shared.drop_unpublished(agent_id)
        on_disk = await self._disk(self._directory.exists, agent_id)
        # The blocks only this agent referenced go too (one scan of its directory; forgetting is rare).
        await self._disk(self._directory.delete, agent_id)
        return on_disk or existed

    # -- hot tier --------------------------------------------------------------

    def _check_in(self, message: CheckIn, nursery: trio.Nursery | None) -> None:
        """The turn is over: its new cache becomes hot and dirty; then, with a shared tier, its lease may go."""
        if message.cache is not None:
            self._put(message)
        if self.shared is not None:
            self.shared.end_turn(message.agent_id, nursery)

    def _put(self, message: CheckIn) -> None:
        assert message.cache is not None
        parked = message.cache.parked
        key = AgentKey(message.agent_id, parked.model_tag)
        hashes = self._directory.block_hashes(parked.model_tag, parked.token_ids)
        self._hot.put(message.agent_id, parked, share_prefix=message.cache.share_prefix,
                          block_bytes=message.cache.block_bytes, block_hashes=hashes)
        for due in self._copies_owed(lambda k: k == key):
            due.drop()  # superseded: its copy is never made (nor waited for)
        waiter = None if message.saved is None else _Waiter(message.saved, message.answer)
        self._saves.put(key, _Pending(message.agent_id, parked, message.cache.snapshot, hashes), waiter)
        if message.saved is not None:
            # A turn waits for this save, written first: the copy it needs is wanted now, and so are
            # those of a save the writer may be waiting on.
            for due in self._copies_owed(lambda k: True):
                due.want()
        self._wake.set()

    def _copies_owed(self, which: Callable[[AgentKey], bool]) -> list[SnapshotDue]:
        """The host copies the GPU actor still owes for the unsaved caches whose key ``which`` accepts."""
        dues = []
        for key in self._saves.keys():
            dirty = self._saves.get(key)
            if which(key) and dirty is not None and isinstance(dirty.item.snapshot, SnapshotDue):
                dues.append(dirty.item.snapshot)
        return dues

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
            snapshot = pending.snapshot
            if isinstance(snapshot, SnapshotDue):
                snapshot = await snapshot.wait()
                if snapshot is None or self._saves.get(key) is not dirty:
                    # Superseded (the newer cache is written instead) or forgotten while it waited.
                    return False
            started = time.perf_counter()
            report = await self._disk(self._directory.save, pending.agent_id, snapshot,
                                      block_hashes=pending.block_hashes)
            self._traced("save", started, f"{report.bytes_written} bytes written")
        except (OSError, ValueError, InvalidAgentIdError, SnapshotLost) as exc:
            retry = isinstance(exc, OSError)  # a full or read-only disk may recover; a bad cache will not
            self._write_errors += 1
            later = f"retried in {self._saves.retry_delay_s:.0f} s or on the next turn" if retry else \
                "saved with the agent's next turn"
            log.error("saving the cache of %r failed: %s; it stays in RAM, %s", pending.agent_id, exc, later)
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
        if report is not None:
            self._hot.saved(pending.agent_id, pending.parked)
        if self.shared is not None:
            await self.shared.release(pending.agent_id)  # if its turns are over
        return report is not None

    async def _flush_all(self, model_tag: str | None = None) -> int:
        """Write every dirty cache (of ``model_tag``, if given); returns how many were written."""
        written = 0
        for due in self._copies_owed(lambda key: model_tag is None or key.model_tag == model_tag):
            due.want()  # all at once: the GPU actor makes them while the first is written
        for key in self._saves.keys():
            if model_tag is None or key.model_tag == model_tag:
                written += await self._write(key)
        return written

    # -- statistics --------------------------------------------------------------

    def hot_entries(self) -> list[HotEntry]:
        """Every cache in the hot tier, least recently used first (a read for the runtime's reports)."""
        return self._hot.entries()

    def statistics(self) -> StoreStats:
        hot = self._hot.stats()
        return StoreStats(
            hot_agents=hot.hot_agents,
            hot_bytes=hot.hot_bytes,
            dirty=len(self._saves),
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
