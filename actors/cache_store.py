"""CacheStoreActor: sole owner of the cache directory; plans turns over the hot and warm tiers.

* **Hot tier** and **plans**: a :class:`runtime.kv_manager.KVCacheManager` (shared
  with the GPU actor) holds every agent's latest parked cache per model, its block
  accounting and the shared-prefix index, and decides each turn's
  :class:`runtime.engine.TurnPlan`. The store feeds it: a :class:`PlanTurn`
  for an agent without a hot cache first reads the agent's disk cache, then asks
  the manager; a :class:`Put` makes a cache hot; a completed save tells the
  manager the cache may now be dropped from RAM.
* **Warm tier**: ``runtime.persist.CacheDirectory``; one disk operation at a
  time, on a worker thread (``trio.to_thread`` under ``CapacityLimiter(1)``:
  numpy and files only, never MLX).
* **Write-behind**: :class:`Put` marks the cache dirty and returns at once; a
  writer task saves dirty caches oldest first (a newer Put of the same agent
  and model supersedes an unwritten one). Loads are awaited by the agent that asked.
* **Durable turns**: a :class:`Put` with a ``saved`` channel goes to the front of
  the queue and is answered :class:`Saved` once it (or a newer cache of the same
  agent and model) is on disk, or ``Failed(kind="NotSaved")`` when its save fails
  or the agent is forgotten first; the agent answers its client only then.
* **Shutdown**: on normal exit or cancellation (SIGINT/SIGTERM cancel the
  runtime), the store picks up any Put still in its mailbox and writes every
  dirty cache, shielded from the cancellation, before it returns.
* **Shared tier** (``store = "redis://..."``): a :class:`runtime.persist.remote.RemoteTier`
  on the same disk thread. A load first pulls the agent's cache from Redis onto
  the disk when Redis holds another one than the disk (the turn's tier is then
  ``remote``); each save is then published to Redis. Redis down: loads and
  saves use the disk alone, and caches saved meanwhile are published when it
  answers again (tried every :data:`actors.shared_tier.REPUBLISH_S`).
* **Leases**: with a shared tier, every :class:`PlanTurn` first takes the
  agent's cluster lease (:meth:`runtime.persist.remote.RemoteTier.lease`), waiting up
  to :data:`actors.shared_tier.LEASE_WAIT_S` while another node holds it, then answers
  ``Failed(kind="AgentBusy")``. The lease is given back after the turn's
  :class:`EndTurn` once its cache is published, under the lease's fence.
* **Tenants**: an agent id that names a tenant (:mod:`runtime.identity`) keeps its caches in
  that tenant's subtree of the cache directory (:class:`runtime.persist.tenants.TenantDirectories`);
  a listing is one tenant's, and :class:`Usage` is what one tenant holds (for its limits).
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

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

import msgspec
import trio

from actors.mailbox import send_reply
from actors.messages_common import Failed, HotCache, failed_from
from actors.messages_store import (
    AgentRecord,
    AgentsListed,
    EndTurn,
    Evict,
    Evicted,
    Flush,
    Flushed,
    Forget,
    Forgotten,
    ListAgents,
    Planned,
    PlanTurn,
    Put,
    Saved,
    SaveReply,
    StoreInbox,
    Usage,
    Used,
)
from actors.metrics import PoolSnapshot
from actors.prefetch import Prefetcher
from actors.shared_tier import RemoteStats, SharedTier
from runtime.engine import FromWarm, Tier, TurnPlan
from runtime.errors import CacheMiss, InvalidAgentIdError
from runtime.identity import AgentKey, local_id, safe_agent_dirname, tenant_of
from runtime.kv_manager import KVCacheManager
from runtime.persist import CacheDirectory
from runtime.persist.tenants import TenantDirectories
from runtime.spec import CacheSnapshot

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
    prefix_hits: int
    demotions: int
    pools: dict[str, PoolSnapshot]
    remote: RemoteStats | None = None
    prefetched: int = 0  # caches read ahead at start (actors/prefetch.py)
    prefetch_hits: int = 0  # turns that took a prefetched cache instead of reading the disk
    prefetch_held_bytes: int = 0  # prefetched caches still waiting for their turn
    prefetch_restored: int = 0  # of those read ahead, restored on the MLX thread before serving




@dataclass(frozen=True)
class _Pending:
    """A hot cache not yet on disk: the cache, its numpy copy for the save, its full blocks' hashes."""

    agent_id: str
    parked: HotCache
    snapshot: CacheSnapshot
    block_hashes: list[str]  # computed once, for the hot tier's accounting and the save
    seq: int  # the order of Puts: a save answers the durable turns whose cache it covers


@dataclass(frozen=True)
class _Waiter:
    """A durable turn waiting for its cache (Put number ``seq``) to reach the disk."""

    seq: int
    reply: trio.MemorySendChannel[SaveReply]


SAVE_RETRY_S = 5.0
"""After a save fails with an OSError (disk full, read-only), dirty caches wait this long or for the next turn."""

class CacheStoreActor:
    """Owns the cache directory and feeds the cache manager (see the module docstring).

    Args:
        inbox: the store mailbox (:data:`actors.messages_store.StoreInbox`).
        directory: the warm tier (the tenants' subtrees are inside it).
        manager: the hot tier and the planner (shared with the GPU actor).
        remote: the shared tier (None: this node's disk only).
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[StoreInbox],
        *,
        directory: CacheDirectory,
        manager: KVCacheManager,
        remote: RemoteTier | None = None,
        prefetch_bytes: int = 0,
    ) -> None:
        self._inbox = inbox
        self._directory = TenantDirectories(directory)
        self._manager = manager
        self._limiter = trio.CapacityLimiter(1)
        self._dirty: dict[AgentKey, _Pending] = {}  # oldest first
        self._waiters: dict[AgentKey, list[_Waiter]] = {}  # durable turns, per cache, in Put order
        self._puts = itertools.count()
        self._wake = trio.Event()
        self._loads_waiting = 0
        self._no_loads = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._writes = self._write_errors = self._bytes_written = 0
        self.retry_delay_s = SAVE_RETRY_S
        self._retry_at = float("-inf")
        self._warm_loads = self._misses = 0
        self._remote = remote
        self.shared = None if remote is None else SharedTier(
            remote, disk=self._disk, dirty=lambda agent_id: any(key[0] == agent_id for key in self._dirty))
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
                for key in list(self._waiters):
                    self._answer_waiters(key, None, Failed(kind="NotSaved", error="the cache store stopped first"))
                if self.shared is not None:
                    await self.shared.release_all()

    def _drain(self) -> None:
        """Take the Puts still queued (a turn that completed just before shutdown)."""
        while True:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, Put):
                self._put(message)
            elif isinstance(message, EndTurn):
                pass  # its lease goes with the others after the last saves
            else:
                send_reply(message.reply, Failed(kind="Cancelled", error="the cache store is shutting down"))
        self._inbox.close()

    async def _disk(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=self._limiter)

    # -- mailbox ---------------------------------------------------------------

    async def _handle(self, message: StoreInbox) -> None:
        match message:
            case PlanTurn(agent_id=agent_id, model_tag=tag):
                if self.shared is not None or self._manager.needs_disk(agent_id, tag):
                    assert self._nursery is not None
                    self._nursery.start_soon(self._plan_after_load, message)
                else:
                    send_reply(message.reply, Planned(plan=self._plan(message, None)))
            case Put():
                self._put(message)
            case EndTurn(agent_id=agent_id):
                if self.shared is not None:
                    self.shared.end_turn(agent_id, self._nursery)
            case Forget():
                await self._forget(message)
            case Evict(model_tag=tag, reply=reply):
                written = await self._flush_all(tag)
                for key in [k for k in self._dirty if k[1] == tag]:
                    del self._dirty[key]
                    self._answer_waiters(key, None, Failed(kind="NotSaved", error=f"model {tag!r} was unloaded first"))
                self._manager.drop_model(tag)
                if self.prefetch is not None:
                    self.prefetch.drop_model(tag)
                send_reply(reply, Evicted(written=written))
            case Flush(reply=reply):
                send_reply(reply, Flushed(written=await self._flush_all()))
            case ListAgents():
                assert self._nursery is not None
                self._nursery.start_soon(self._list, message)
            case Usage():
                assert self._nursery is not None
                self._nursery.start_soon(self._usage, message)
            case _:
                assert_never(message)

    def _plan(self, message: PlanTurn, warm: CacheSnapshot | None, tier: Tier = "warm") -> TurnPlan:
        return self._manager.plan(message.agent_id, message.model_tag, message.prompt, share=message.share,
                                  warm=warm, warm_tier=tier)

    async def _plan_after_load(self, message: PlanTurn) -> None:
        """Take the agent's lease (shared tier), read its disk cache, then plan (an unreadable cache: a logged miss)."""
        warm: CacheSnapshot | None = None
        prepared: Any = None  # the prefetched cache restored at start (actors/prefetch.py)
        tier: Tier = "warm"
        self._loads_waiting += 1
        try:
            if self.shared is not None and not await self.shared.take_lease(message.agent_id):
                send_reply(message.reply, Failed(
                    kind="AgentBusy", error=f"agent {message.agent_id!r} is in a turn on another node; retry shortly"))
                return
            key = (message.agent_id, message.model_tag)
            if self.shared is not None:
                match await self._disk(self.shared.remote.check, *key):
                    case "forgotten":  # on another node, since this node last held the agent: drop every copy
                        await self._forget_here(message.agent_id)
                    case "newer" if not self._manager.needs_disk(*key) and key not in self._dirty:
                        self._manager.drop(*key)  # another node served the agent since: Redis has more of it
                    case _:
                        pass
            if not self._manager.needs_disk(*key):
                send_reply(message.reply, Planned(plan=self._plan(message, None)))
                return
            taken = None if self.prefetch is None else await self.prefetch.take(*key)
            if taken is None:
                warm, tier = await self._disk(self._load, message.agent_id, message.model_tag)
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
        plan = self._plan(message, warm, tier)
        if prepared is not None and isinstance(plan.source, FromWarm):
            plan = msgspec.structs.replace(plan, source=FromWarm(snapshot=plan.source.snapshot, prepared=prepared))
        send_reply(message.reply, Planned(plan=plan))

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
        for entry in reversed(self._manager.entries()):
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
                    dirty=entry.key in self._dirty,
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
            if (wanted is not None and entry.agent_id != wanted) or tenant_of(entry.agent_id) != tenant:
                continue
            key = (entry.agent_id, entry.model_tag)
            if key in mine:
                record = local[mine[key]]
                if not record.dirty and entry.updated_at > (record.updated_at or 0.0):
                    local[mine[key]] = msgspec.structs.replace(record, remote=True)
                continue
            only_remote.append(AgentRecord(agent_id=entry.agent_id, model_tag=entry.model_tag,
                                           num_tokens=entry.num_tokens, hot=False, on_disk=False, dirty=False,
                                           disk_bytes=0, updated_at=entry.updated_at, remote=True))
        return only_remote

    async def _usage(self, message: Usage) -> None:
        try:
            disk = await self._disk(self._directory.usage, message.tenant)
        except (OSError, ValueError) as exc:
            send_reply(message.reply, failed_from(exc))
            return
        in_ram = {e.agent_id for e in self._manager.entries()} | {key[0] for key in self._dirty}
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
        existed = self._manager.forget(agent_id) > 0
        for key in [k for k in self._dirty if k[0] == agent_id]:
            del self._dirty[key]
        for key in [k for k in self._waiters if k[0] == agent_id]:
            self._answer_waiters(key, None, Failed(kind="NotSaved", error=f"agent {agent_id!r} was forgotten first"))
        if self.shared is not None:
            self.shared.drop_unpublished(agent_id)
        on_disk = await self._disk(self._directory.exists, agent_id)
        # The blocks only this agent referenced go too (one scan of its directory; forgetting is rare).
        await self._disk(self._directory.delete, agent_id)
        return on_disk or existed

    # -- hot tier --------------------------------------------------------------

    def _put(self, message: Put) -> None:
        parked = message.parked
        key = (message.agent_id, parked.model_tag)
        hashes = self._directory.block_hashes(parked.model_tag, parked.token_ids)
        self._manager.put(message.agent_id, parked, share=message.share_prefix, block_bytes=message.block_bytes,
                          block_hashes=hashes)
        self._dirty.pop(key, None)  # a newer Put supersedes an unwritten one
        pending = _Pending(message.agent_id, parked, message.snapshot, hashes, next(self._puts))
        if message.saved is None:
            self._dirty[key] = pending
        else:  # a client waits for this save: it goes first
            self._waiters.setdefault(key, []).append(_Waiter(pending.seq, message.saved))
            self._dirty = {key: pending, **self._dirty}
        self._wake.set()

    def _answer_waiters(self, key: AgentKey, upto: int | None, answer: SaveReply) -> None:
        """Answer the durable turns of ``key`` whose cache is Put number ``upto`` or older (None: all)."""
        waiting = self._waiters.pop(key, [])
        rest = [w for w in waiting if upto is not None and w.seq > upto]
        for waiter in waiting:
            if upto is None or waiter.seq <= upto:
                send_reply(waiter.reply, answer)
        if rest:
            self._waiters[key] = rest

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
            await self._write(next(iter(self._dirty)))

    async def _write(self, key: AgentKey) -> bool:
        """Save the cache pending under ``key``, if any; True when this call wrote it."""
        pending = self._dirty.get(key)
        if pending is None:
            return False
        retry = False
        try:
            report = await self._disk(self._directory.save, pending.agent_id, pending.snapshot,
                                      block_hashes=pending.block_hashes)
        except (OSError, ValueError, InvalidAgentIdError) as exc:
            retry = isinstance(exc, OSError)  # a full or read-only disk may recover; a bad cache will not
            self._write_errors += 1
            log.error("saving the cache of %r failed: %s; it stays in RAM, retried in %.0f s or on the next turn",
                      pending.agent_id, exc, self.retry_delay_s)
            report = None
            self._answer_waiters(key, pending.seq, Failed(kind="NotSaved", error=f"the cache was not saved: {exc}"))
        else:
            self._answer_waiters(key, pending.seq, Saved())
        if report is not None:
            self._writes += 1
            self._bytes_written += report.bytes_written
            if self.shared is not None and self._dirty.get(key) is pending:
                # Not a superseded cache (the newer one is published soon) nor a forgotten one (never again).
                await self.shared.publish(key)
        if self._dirty.get(key) is not pending:
            return report is not None  # superseded or forgotten meanwhile
        if report is None and retry:
            self._dirty.pop(key)  # keep it dirty, behind the others
            self._dirty[key] = pending
            self._retry_at = trio.current_time() + self.retry_delay_s
            return False
        del self._dirty[key]
        if report is not None:
            self._manager.saved(pending.agent_id, pending.parked)
        if self.shared is not None:
            await self.shared.release(pending.agent_id)  # if its turns are over
        return report is not None

    async def _flush_all(self, model_tag: str | None = None) -> int:
        """Write every dirty cache (of ``model_tag``, if given); returns how many were written."""
        written = 0
        for key in list(self._dirty):
            if model_tag is None or key[1] == model_tag:
                written += await self._write(key)
        return written

    # -- statistics --------------------------------------------------------------

    def statistics(self) -> StoreStats:
        hot = self._manager.stats()
        return StoreStats(
            hot_agents=hot.hot_agents,
            hot_bytes=hot.hot_bytes,
            dirty=len(self._dirty),
            over_budget=hot.over_budget,
            writes=self._writes,
            write_errors=self._write_errors,
            bytes_written=self._bytes_written,
            warm_loads=self._warm_loads,
            misses=self._misses,
            prefix_hits=hot.prefix_hits,
            demotions=hot.demotions,
            pools={tag: PoolSnapshot.of(pool) for tag, pool in hot.pools.items()},
            remote=None if self.shared is None else self.shared.statistics(),
            prefetched=0 if self.prefetch is None else self.prefetch.read,
            prefetch_hits=0 if self.prefetch is None else self.prefetch.taken,
            prefetch_held_bytes=0 if self.prefetch is None else self.prefetch.held_bytes,
            prefetch_restored=0 if self.prefetch is None else self.prefetch.prepared,
        )
