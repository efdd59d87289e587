"""The cache store's mailbox (:data:`StoreInbox`).

Requests and their replies::

    CheckOut(agent_id, model_tag)     -> CheckedOut(own)      a turn begins: the agent's own cache (hot, or read from disk)
    CheckIn(agent_id, cache)          (no reply: the turn is over; its new cache, if any, is saved write-behind)
    CheckIn(..., saved=channel)       -> Saved | Failed       the same, answered once this cache is on disk

A turn visits the store twice: one :class:`CheckOut` when it begins and one
:class:`CheckIn` when it ends (with a shared tier, the agent's cluster lease is held in between).
    Forget(agent_id)                  -> Forgotten(existed)   every model's cache of the agent
    Evict(model_tag)                  -> Evicted(written)     flush dirty caches of a model, drop its hot caches
    Flush()                           -> Flushed(written)     write every dirty cache now
    ListAgents(agent_id | None, tenant) -> AgentsListed(agents) hot and on-disk caches (of one agent, or a tenant's)
    MeasureUsage(tenant)              -> Used(agent_dirs, disk_bytes)   what a tenant holds (its limits)
    ReadBlocks(agent_id, token_ids)   -> BlocksRead(layers)   a prompt's first whole blocks from the tenant's disk

The GPU actor sends :class:`ReadBlocks` for a turn whose plan reuses less of its prompt than whole
blocks stored on disk might (a sibling after a restart, a return to an earlier branch): one more
round trip for that turn only.

An agent has one cache per model (keyed by agent id and model tag): a turn with
model B never replaces the agent's model-A cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

import msgspec

from actors.messages_common import Failed, ParkedView, Message
from runtime.plan.turn_plan import OwnCache
from runtime.plan.hot_tier import HotDonor
from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "CheckOut",
    "CheckedOut",
    "CheckIn",
    "NewCache",
    "SnapshotDue",
    "SnapshotLost",
    "Forget",
    "Evict",
    "Flush",
    "ListAgents",
    "MeasureUsage",
    "Used",
    "UsageReply",
    "AgentRecord",
    "AgentsListed",
    "ListReply",
    "Forgotten",
    "Evicted",
    "Flushed",
    "Saved",
    "SaveReply",
    "ReadBlocks",
    "BlocksRead",
    "StoreInbox",
    "CheckOutReply",
    "ForgetReply",
    "EvictReply",
    "FlushReply",
]


class CheckedOut(Message, frozen=True, kw_only=True):
    """The agent's own cache its turn may start from (its disk cache read first when it had no hot one).

    ``own`` None: the agent has no cache of that model (or its disk cache could not be read: a logged
    miss). ``donors``: for a turn that shares prefixes, the other sharing agents' hot caches of its
    tenant and model, which it may start from instead (:meth:`runtime.plan.hot_tier.HotTier.donors`).
    """

    own: OwnCache | None
    donors: tuple[HotDonor, ...] = ()


class Forgotten(Message, frozen=True, kw_only=True):
    """Reply to :class:`Forget`: the agent's caches are deleted; ``existed``: whether it had any (hot or on disk)."""

    existed: bool


class Evicted(Message, frozen=True, kw_only=True):
    """Reply to :class:`Evict`: the model's hot caches are dropped; ``written``: dirty ones saved to disk first."""

    written: int


class Flushed(Message, frozen=True, kw_only=True):
    """Reply to :class:`Flush`: ``written`` dirty caches were saved to disk."""

    written: int


class Saved(Message, frozen=True, kw_only=True):
    """Reply to a :class:`CheckIn` that asked for it: the cache (or a newer one of the agent) is on disk."""


class AgentRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One cache the store knows (an agent's, for ``model_tag``): in the hot tier, on disk, or both.

    Attributes:
        num_tokens: tokens its cache covers (the hot copy when there is one).
        dirty: the hot copy is newer than the disk (its save is pending).
        disk_bytes: bytes of its files on disk, shared blocks counted in full (0: not on disk).
        updated_at: when the disk copy was written (Unix time; None: not on disk).
        remote: the shared tier (Redis) holds a newer copy than this node has, or the only
            one: the agent's next turn here loads it from there (tier ``remote``).
    """

    agent_id: str
    model_tag: str
    num_tokens: int
    hot: bool
    on_disk: bool
    dirty: bool
    disk_bytes: int
    updated_at: float | None
    remote: bool = False


class AgentsListed(Message, frozen=True, kw_only=True):
    """Reply to :class:`ListAgents`: the caches, in the order described there."""

    agents: tuple[AgentRecord, ...]


class Used(Message, frozen=True, kw_only=True):
    """Reply to :class:`MeasureUsage`.

    Attributes:
        agent_dirs: the folder name of each agent of the tenant with a cache, hot or on
            disk (:func:`runtime.identity.safe_agent_dirname` of the id it gave: one per agent).
        disk_bytes: every file of the tenant's cache subtree (not yet its dirty caches).
    """

    agent_dirs: frozenset[str]
    disk_bytes: int


class BlocksRead(Message, frozen=True, kw_only=True):
    """Reply to :class:`ReadBlocks`: every layer over the first ``tokens`` tokens (0: none stored; ``layers`` empty)."""

    tokens: int
    layers: tuple[LayerSnapshot, ...]


CheckOutReply = CheckedOut | Failed
ForgetReply = Forgotten | Failed
EvictReply = Evicted | Failed
FlushReply = Flushed | Failed
ListReply = AgentsListed | Failed
UsageReply = Used | Failed
SaveReply = Saved | Failed


class CheckOut(Message, frozen=True, kw_only=True):
    """A turn of ``agent_id`` on ``model_tag`` begins: find the agent's own cache.

    Its hot cache, else its disk cache (with a shared tier: pulled from Redis first when
    another node published a newer one). A disk cache that cannot be read is a logged
    miss; only a bad agent id fails, and, with a shared tier, an agent whose lease another
    node holds (``AgentBusy``, after a short wait). Every CheckOut is followed by one
    :class:`CheckIn`.
    """

    agent_id: str
    model_tag: str
    reply: trio.MemorySendChannel[CheckOutReply]
    share_prefix: bool = False


class ReadBlocks(Message, frozen=True, kw_only=True):
    """Read the longest run of ``token_ids``' whole blocks the agent's tenant stores, from the first
    (:meth:`runtime.persist.CacheDirectory.read_prefix_blocks`), for a model whose layers are ``layer_kinds``.

    Whoever saved them: the tokens are the requesting turn's own, so it learns only that its tenant
    once cached them. Never another tenant's blocks. A damaged block ends the run (a logged miss).
    """

    agent_id: str
    model_tag: str
    token_ids: tuple[int, ...]
    layer_kinds: tuple[LayerKind, ...]
    reply: trio.MemorySendChannel[BlocksRead]


class SnapshotLost(Exception):
    """A :class:`SnapshotDue` the GPU actor could not make (its job failed, or it stopped without it)."""


class SnapshotDue:
    """A finished turn's host copy for its save, owed by the GPU actor (``BackendProfile.copy_after_turn``).

    The GPU actor makes it after the turn, when it has nothing to run or once it is wanted
    or overdue, never between two decode steps of a busy batch (:mod:`actors.gpu`). The
    store waits for it when it writes: :meth:`want` asks for it now (a durable turn, a
    flush, shutdown), :meth:`drop` says no save needs it any more (a newer cache of the
    same agent superseded it), so it is never made.
    """

    def __init__(self, on_wanted: Callable[[], None] | None = None) -> None:
        self._settled = trio.Event()
        self._snapshot: CacheSnapshot | None = None
        self._error: str | None = None
        self._on_wanted = on_wanted  # wakes the GPU actor if it is waiting for work
        self.wanted = False
        self.dropped = False

    def want(self) -> None:
        if not self.wanted and not self._settled.is_set():
            self.wanted = True
            if self._on_wanted is not None:
                self._on_wanted()

    def drop(self) -> None:
        self.dropped = True
        self._settled.set()

    def made(self, snapshot: CacheSnapshot) -> None:
        if not self._settled.is_set():
            self._snapshot = snapshot
            self._settled.set()

    def failed(self, error: str) -> None:
        if not self._settled.is_set():
            self._error = error
            self._settled.set()

    async def wait(self) -> CacheSnapshot | None:
        """The copy, once made; None when it was dropped.

        Raises:
            SnapshotLost: the GPU actor could not make it.
        """
        await self._settled.wait()
        if self._error is not None:
            raise SnapshotLost(self._error)
        return self._snapshot


class NewCache(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's updated cache; ``snapshot`` is its numpy copy for the write-behind save (or the copy owed).

    Attributes:
        block_bytes: at-rest bytes of one 256-token block of this model (hot-tier accounting).
        share_prefix: whether other agents may start from this cache's prefix.
    """

    parked: ParkedView
    snapshot: CacheSnapshot | SnapshotDue
    block_bytes: int
    share_prefix: bool


class CheckIn(Message, frozen=True, kw_only=True):
    """The turn :class:`CheckOut` began is over (done or failed), with its new cache, if any.

    The cache becomes the agent's hot cache and is saved write-behind. ``saved``: when
    set, answered once this cache is on disk (fsynced unless ``fsync`` is off) with
    ``answer`` (a durable turn's own reply, which the store sends its agent then; None:
    :class:`Saved`), or with ``Failed(kind="NotSaved")`` when its save failed. With a
    shared tier the store then gives the agent's cluster lease back, once the turn's
    cache is published.
    """

    agent_id: str
    cache: NewCache | None = None
    saved: trio.MemorySendChannel[Any] | None = None
    answer: msgspec.Struct | None = None


class Forget(Message, frozen=True, kw_only=True):
    """Delete every cache of the agent (each model's), hot and on disk."""

    agent_id: str
    reply: trio.MemorySendChannel[ForgetReply]


class Evict(Message, frozen=True, kw_only=True):
    """Before a model swap or unload: write ``model_tag``'s dirty caches to disk, then drop its hot caches.

    The agents' caches of that model stay on disk and load again (warm) when it returns.
    """

    model_tag: str
    reply: trio.MemorySendChannel[EvictReply]


class Flush(Message, frozen=True, kw_only=True):
    """Write every dirty hot cache to disk now (``Runtime.flush``, e.g. at the end of each scenario phase)."""

    reply: trio.MemorySendChannel[FlushReply]


class ListAgents(Message, frozen=True, kw_only=True):
    """The caches, one per agent and model: ``tenant``'s (None: agents without a tenant), or only ``agent_id``'s.

    Sorted by agent id; an agent's hot caches come first, most recently used
    first, then its caches on disk, newest first: an agent's first record is
    the cache it used last.
    """

    agent_id: str | None
    reply: trio.MemorySendChannel[ListReply]
    tenant: str | None = None  # ignored when agent_id is given (its own tenant)


class MeasureUsage(Message, frozen=True, kw_only=True):
    """What ``tenant`` holds: its agents with a cache (hot, dirty or on disk) and its bytes on disk."""

    tenant: str
    reply: trio.MemorySendChannel[UsageReply]


StoreInbox = CheckOut | CheckIn | Forget | Evict | Flush | ListAgents | MeasureUsage | ReadBlocks
