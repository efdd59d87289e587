"""HotTier: every agent's latest parked cache in RAM, per model: the GPU actor's.

Plain Python like :mod:`runtime.plan.block_pool` (no trio, no mlx): the policy, while the
GPU actor (:mod:`actors.gpu_caches`), its one owner, executes it: parked caches are the
model's memory, and the actor that runs the model holds them. It holds the latest parked
cache of every (agent, model), least recently used first, charged to a
:class:`runtime.plan.block_pool.BlockPool` per model. Full 256-token blocks are charged by
content (their hash-chain ids), so agents whose caches begin with the same tokens pay for
those blocks once. When a cache does not fit, least recently used caches whose host copy the
cache store already holds (written, or queued for its write) are dropped (demoted: the next
turn loads them from the store); one that still does not fit stays until its copy is handed to
the store, and is then dropped.

A turn starts from the agent's own cache (:meth:`HotTier.checkout`) and, for an agent that
shares prefixes, may start from the other sharing agents' hot caches of its tenant and model
(:meth:`HotTier.donors`): the GPU actor's planner (:class:`runtime.plan.kv_manager.KVCacheManager`)
plans against them. They are references to parked caches, which never change once parked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from runtime.errors import BudgetExceededError
from runtime.identity import AgentKey, may_share, pool_key
from runtime.plan.block_pool import BlockPool, PoolStats
from runtime.plan.turn_plan import FromHot, OwnCache, ParkedView

__all__ = ["HotTier", "HotEntry", "HotDonor", "HotTierStats"]


@dataclass
class HotEntry:
    """One agent's parked cache for one model, in RAM.

    ``stored``: the cache store holds this very cache's host copy, written or queued for its
    write (it may be dropped from RAM). ``accounted``: it is charged to its model's block
    pool (False: over budget, dropped once stored).
    """

    agent_id: str
    model_tag: str
    parked: ParkedView
    share_prefix: bool
    stored: bool = False
    accounted: bool = False

    @property
    def key(self) -> AgentKey:
        return AgentKey(self.agent_id, self.model_tag)


class HotDonor(NamedTuple):
    """Another agent's hot cache a sharing turn may start from (:meth:`HotTier.donors`)."""

    agent_id: str
    parked: ParkedView


@dataclass(frozen=True)
class HotTierStats:
    """The hot tier right now (``pools``: block accounting per model tag, shared blocks once)."""

    hot_agents: int
    hot_bytes: int
    over_budget: int
    demotions: int
    pools: dict[str, PoolStats]


class HotTier:
    """The agents' parked caches in RAM and their accounting (see the module docstring).

    Args:
        hot_budget_bytes: RAM for parked caches, per model.
    """

    def __init__(self, *, hot_budget_bytes: int) -> None:
        self._budget = hot_budget_bytes
        self._entries: dict[AgentKey, HotEntry] = {}  # least recently used first
        self._pools: dict[str, BlockPool] = {}
        self._demotions = 0

    def holds(self, agent_id: str, model_tag: str) -> bool:
        """Whether the agent has a hot cache of that model (else its turn asks the store for one)."""
        return AgentKey(agent_id, model_tag) in self._entries

    def checkout(self, agent_id: str, model_tag: str) -> OwnCache | None:
        """The agent's hot cache a turn starts from (now the most recently used); None: it has none.

        The turn holds the returned cache, so dropping it from the hot tier meanwhile loses nothing.
        """
        entry = self._entries.get(AgentKey(agent_id, model_tag))
        if entry is None:
            return None
        self._touch(entry)
        return OwnCache(source=FromHot(parked=entry.parked), tier="hot")

    def donors(self, agent_id: str, model_tag: str) -> tuple[HotDonor, ...]:
        """The hot caches of ``model_tag`` that other agents of ``agent_id``'s tenant share (opted in)."""
        return tuple(HotDonor(e.agent_id, e.parked) for e in self._entries.values()
                     if e.share_prefix and e.model_tag == model_tag and may_share(agent_id, e.agent_id))

    def get(self, agent_id: str, model_tag: str) -> HotEntry | None:
        """The agent's hot cache for that model (without touching the LRU order)."""
        return self._entries.get(AgentKey(agent_id, model_tag))

    def entries(self) -> list[HotEntry]:
        """Every hot cache, least recently used first."""
        return list(self._entries.values())

    def put(self, agent_id: str, parked: ParkedView, *, share_prefix: bool, block_bytes: int,
            block_hashes: Sequence[str]) -> list[HotEntry]:
        """Make ``parked`` the agent's hot cache for its model (the store holds no copy of it yet).

        ``block_hashes`` are its full blocks' hash-chain ids. Returns the caches
        dropped from RAM to make room (all held by the store).
        """
        key = AgentKey(agent_id, parked.model_tag)
        entry = self._entries.get(key)
        if entry is None:
            entry = HotEntry(agent_id, parked.model_tag, parked, share_prefix)
        else:
            self._unaccount(entry)
            entry.parked, entry.share_prefix, entry.stored = parked, share_prefix, False
        self._touch(entry)
        return self._account(entry, block_bytes, block_hashes)

    def stored(self, agent_id: str, parked: ParkedView) -> bool:
        """The store holds ``parked``'s host copy now. Returns True when it was dropped from RAM (it never fit
        the budget)."""
        entry = self._entries.get(AgentKey(agent_id, parked.model_tag))
        if entry is None or entry.parked is not parked:
            return False  # replaced or forgotten meanwhile
        entry.stored = True
        if not entry.accounted:
            self._demote(entry)
            return True
        return False

    def forget(self, agent_id: str) -> int:
        """Drop every hot cache of the agent; returns how many there were."""
        entries = [e for e in self._entries.values() if e.agent_id == agent_id]
        for entry in entries:
            self._drop(entry)
        return len(entries)

    def drop(self, agent_id: str, model_tag: str) -> bool:
        """Drop the agent's hot cache for that model (another node has served the agent since); whether it had one."""
        entry = self._entries.get(AgentKey(agent_id, model_tag))
        if entry is not None:
            self._drop(entry)
        return entry is not None

    def drop_model(self, model_tag: str) -> None:
        """Drop every hot cache of a model and its pool (the model was unloaded)."""
        for entry in [e for e in self._entries.values() if e.model_tag == model_tag]:
            self._drop(entry)
        self._pools.pop(model_tag, None)

    def stats(self) -> HotTierStats:
        entries = self._entries.values()
        return HotTierStats(
            hot_agents=len(self._entries),
            hot_bytes=sum(e.parked.nbytes for e in entries),
            over_budget=sum(not e.accounted for e in entries),
            demotions=self._demotions,
            pools={tag: pool.stats() for tag, pool in self._pools.items()},
        )

    def _touch(self, entry: HotEntry) -> None:
        self._entries.pop(entry.key, None)
        self._entries[entry.key] = entry

    def _pool(self, tag: str, block_bytes: int) -> BlockPool:
        pool = self._pools.get(tag)
        if pool is None:
            pool = self._pools[tag] = BlockPool(budget_bytes=self._budget, bytes_per_block=max(1, block_bytes))
        return pool

    def _account(self, entry: HotEntry, block_bytes: int, block_hashes: Sequence[str]) -> list[HotEntry]:
        """Charge ``entry`` to its model's pool, dropping clean least recently used caches to make room."""
        pool = self._pool(entry.model_tag, block_bytes)
        demoted: list[HotEntry] = []
        while True:
            try:
                # Named within the tenant: the pool's dedup must not tell one tenant what another holds.
                pool.share(entry.agent_id, [pool_key(entry.agent_id, h) for h in block_hashes])
                pool.reserve(entry.agent_id, entry.parked.num_tokens)
                entry.accounted = True
                return demoted
            except BudgetExceededError:
                pool.release(entry.agent_id)
            victim = next((e for e in self._entries.values()
                           if e is not entry and e.stored and e.model_tag == entry.model_tag), None)
            if victim is None:
                entry.accounted = False  # dropped as soon as the store holds it
                return demoted
            self._demote(victim)
            demoted.append(victim)

    def _unaccount(self, entry: HotEntry) -> None:
        pool = self._pools.get(entry.model_tag)
        if pool is not None:
            pool.release(entry.agent_id)
        entry.accounted = False

    def _drop(self, entry: HotEntry) -> None:
        self._unaccount(entry)
        self._entries.pop(entry.key, None)

    def _demote(self, entry: HotEntry) -> None:
        self._demotions += 1
        self._drop(entry)
