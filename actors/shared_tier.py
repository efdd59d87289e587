"""The cache store's side of the shared tier (Redis): cluster leases held, caches waiting to be published.

Not an actor: :class:`SharedTier` is a part of
:class:`actors.cache_store.CacheStoreActor`, which owns it and calls it from
its own tasks; every Redis call goes through the store's one disk thread
(``disk``), as :class:`runtime.persist.remote.RemoteTier` requires.

* **Leases**: a turn's plan first takes the agent's cluster lease
  (:meth:`take_lease`), waiting up to :data:`LEASE_WAIT_S` while another node
  holds it. The store gives it back (:meth:`release`) once the turn has ended
  and its cache is saved and published, under the lease's fence, so a node
  whose lease expired cannot publish over its successor's manifest;
  :meth:`renewer` keeps held leases alive meanwhile (a long prefill).
* **Forgetting** (:meth:`forget`) is cluster-wide: Redis records a tombstone;
  a node that next takes the agent's lease finds it newer than its copies and
  drops them (the cache store does, before it plans the turn).
* **Publishing** (:meth:`publish`, after each disk save): when Redis is down,
  the cache is remembered and :meth:`republisher` tries again every
  :data:`REPUBLISH_S` until Redis answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from runtime.identity import AgentKey

if TYPE_CHECKING:
    from runtime.persist.remote import Lease, RemoteTier

__all__ = ["SharedTier", "RemoteStats", "LEASE_WAIT_S", "REPUBLISH_S"]

log = logging.getLogger("kvmem.store")

LEASE_WAIT_S = 2.0
"""How long a turn waits for an agent's lease that another node holds before it fails as ``AgentBusy``."""

REPUBLISH_S = 5.0
"""While Redis is down, how often the store tries again to publish the caches it saved meanwhile."""



class RemoteStats(msgspec.Struct, frozen=True, kw_only=True):
    """The shared tier (Redis): whether it answered last time, and what moved.

    ``unpublished``: caches saved to disk while Redis was down, published when it
    returns; ``leases``: agents whose cluster lease this node holds now.
    """

    url: str
    up: bool
    pulls: int
    publishes: int
    stale_publishes: int
    unpublished: int
    leases: int
    corrupt: int
    errors: int
    bytes_sent: int
    bytes_received: int


@dataclass
class _Held:
    """A cluster lease this node holds for an agent, and its turns planned but not ended."""

    lease: Lease
    turns: int
    lost: bool = False  # a renewal found it expired (logged once)


class SharedTier:
    """Leases and publishing for one cache store (see the module docstring).

    Args:
        remote: the Redis mirror of the store's cache directory.
        disk: runs a function on the store's disk thread.
        dirty: whether an agent has a cache not yet saved (its lease stays until it is).
    """

    def __init__(
        self, remote: RemoteTier, *, disk: Callable[..., Awaitable[Any]], dirty: Callable[[str], bool]
    ) -> None:
        self.remote = remote
        self._disk = disk
        self._dirty = dirty
        self._leases: dict[str, _Held] = {}
        self._unpublished: dict[AgentKey, None] = {}  # saved while Redis was down
        self.lease_wait_s = LEASE_WAIT_S
        self.republish_s = REPUBLISH_S

    # -- leases ----------------------------------------------------------------

    async def take_lease(self, agent_id: str) -> bool:
        """Hold the agent's lease for one more turn; False after :attr:`lease_wait_s` if another node holds it."""
        held = self._leases.get(agent_id)
        if held is not None:
            if await self._disk(self.remote.renew, held.lease):
                held.turns += 1
                return True
            del self._leases[agent_id]  # expired meanwhile: take it anew, with a newer fence
        deadline = trio.current_time() + self.lease_wait_s
        while True:
            lease = await self._disk(self.remote.lease, agent_id)
            if lease is not None:
                self._leases[agent_id] = _Held(lease, 1)
                return True
            if trio.current_time() >= deadline:
                return False
            await trio.sleep(0.1)

    def end_turn(self, agent_id: str, nursery: trio.Nursery | None) -> None:
        """A turn of the agent ended: its lease goes now if nothing of it waits for a save."""
        held = self._leases.get(agent_id)
        if held is None:
            return
        held.turns -= 1
        if nursery is not None:
            nursery.start_soon(self.release, agent_id)

    async def release(self, agent_id: str) -> None:
        """Give the agent's lease back if its turns are over and its caches saved."""
        held = self._leases.get(agent_id)
        if held is None or held.turns > 0 or self._dirty(agent_id):
            return
        del self._leases[agent_id]
        with trio.CancelScope(shield=True):  # off the books: given back even if the store is stopping now
            await self._disk(self.remote.release, held.lease)

    async def renewer(self) -> None:
        """Keep the leases held renewed (every third of their length), so a long turn keeps its agent."""
        while True:
            await trio.sleep(self.remote.lease_ms / 3000)
            for agent_id, held in list(self._leases.items()):
                if not await self._disk(self.remote.renew, held.lease) and not held.lost:
                    held.lost = True
                    log.warning("the lease of agent %r expired during its turn; its save will not be published "
                                "over a newer one", agent_id)

    async def release_all(self) -> None:
        """On shutdown, after the last saves: give back every lease still held."""
        for agent_id in list(self._leases):
            held = self._leases.pop(agent_id)
            await self._disk(self.remote.release, held.lease)

    # -- publishing --------------------------------------------------------------

    async def publish(self, key: AgentKey) -> None:
        """Send the cache just saved under ``key`` to Redis, under the agent's lease (remembered if Redis is down)."""
        self._unpublished.pop(key, None)
        held = self._leases.get(key.agent_id)
        published = await self._disk(self.remote.publish, *key, fence=held.lease.fence if held else None)
        if published is None and not self.remote.up:
            self._unpublished[key] = None

    async def republisher(self) -> None:
        """Publish what was saved while Redis was down, trying every :attr:`republish_s`."""
        await self._disk(self.remote.ping)  # for /healthz: whether Redis answers before the first turn
        while True:
            await trio.sleep(self.republish_s)
            if self._unpublished and (self.remote.up or await self._disk(self.remote.ping)):
                for key in list(self._unpublished):
                    await self.publish(key)
                    if not self.remote.up:
                        break

    def drop_unpublished(self, agent_id: str) -> None:
        """The agent's local copies are gone (forgotten): nothing of it waits to be published."""
        self._unpublished = {k: None for k in self._unpublished if k.agent_id != agent_id}

    async def forget(self, agent_id: str) -> bool:
        """Forget the agent cluster-wide (a tombstone other nodes heed: ``RemoteTier.forget``); whether Redis had it."""
        self.drop_unpublished(agent_id)
        return bool(await self._disk(self.remote.forget, agent_id))

    def statistics(self) -> RemoteStats:
        r = self.remote
        return RemoteStats(url=r.url, up=r.up, pulls=r.pulls, publishes=r.publishes,
                           stale_publishes=r.stale_publishes, unpublished=len(self._unpublished),
                           leases=len(self._leases), corrupt=r.corrupt, errors=r.errors, bytes_sent=r.bytes_sent,
                           bytes_received=r.bytes_received)
