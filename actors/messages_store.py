"""The cache store's mailbox (:data:`StoreInbox`): every message comes from the GPU actor.

The store holds what is not in device memory: host copies queued for their write, the cache
directory, the shared tier. The GPU actor holds the hot caches (:mod:`actors.gpu_caches`) and
asks the store only for what it lacks. Requests and their replies::

    Load(agent_id, model_tag)         -> Loaded(own)          the GPU actor holds no hot cache of it: the store's
                                                              copy (queued for its write, read ahead, or on disk);
                                                              with a shared tier, every turn (the agent's lease)
    Save(agent_id, cache)             (no reply: the cache's host copy, written behind)
    Save(..., saved=channel)          -> answer | Failed      the same, answered once this cache is on disk
    ReadBlocks(agent_id, token_ids)   -> BlocksRead(layers)   a prompt's first whole blocks from the tenant's disk
    Evict(model_tag)                  -> Evicted(written)     write the model's queued copies now (a model swap)

and, forwarded by the GPU actor with what it holds in RAM (the runtime and the agents send them there):

    Forget(agent_id)                  -> Forgotten(existed)   every model's cache of the agent
    Flush()                           -> Flushed(written)     write every queued copy now
    ListAgents(agent_id | None, tenant) -> AgentsListed(agents) hot and on-disk caches (of one agent, or a tenant's)
    MeasureUsage(tenant)              -> Used(agent_dirs, disk_bytes)   what a tenant holds (its limits)

The GPU actor sends :class:`ReadBlocks` for a turn whose plan reuses less of its prompt than whole
blocks stored on disk might (a sibling after a restart, a return to an earlier branch): one more
round trip for that turn only.

An agent has one cache per model (keyed by agent id and model tag): a turn with
model B never replaces the agent's model-A cache.
"""

from __future__ import annotations

from typing import Any

import trio

import msgspec

from actors.messages_common import Failed, Message
from runtime.plan.turn_plan import OwnCache
from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "Load",
    "Loaded",
    "Save",
    "NewCache",
    "HotCache",
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
    "LoadReply",
    "ForgetReply",
    "EvictReply",
    "FlushReply",
]


class Loaded(Message, frozen=True, kw_only=True):
    """Reply to :class:`Load`: the agent's cache the store holds, for its turn to start from.

    ``own`` None: the store has none of that model (or its disk cache could not be read: a logged
    miss), or the GPU actor's hot cache stands (a lease asked for with ``hot``). ``stale``: another
    node served the agent since (the shared tier): the GPU actor's hot cache is older than ``own``.
    ``forgotten``: the agent was forgotten on another node: every hot cache of it goes.
    """

    own: OwnCache | None
    stale: bool = False
    forgotten: bool = False


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
    """Reply to a :class:`Save` that asked for it without an answer: the cache (or a newer one of the agent) is
    on disk."""


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


LoadReply = Loaded | Failed
ForgetReply = Forgotten | Failed
EvictReply = Evicted | Failed
FlushReply = Flushed | Failed
ListReply = AgentsListed | Failed
UsageReply = Used | Failed
SaveReply = Saved | Failed


class Load(Message, frozen=True, kw_only=True):
    """A turn of ``agent_id`` on ``model_tag`` begins, and the GPU actor needs the store for it.

    It holds no hot cache of it (``hot`` False): the store's copy, one queued for its write, else
    one read ahead at start, else the one on disk (with a shared tier: pulled from Redis first when
    another node published a newer one). A disk cache that cannot be read is a logged miss. With a
    shared tier every turn loads, hot or not (``hot``: the GPU actor holds one; ``unsaved``: newer
    than any the store has): the store takes the agent's cluster lease first and answers
    ``Failed(kind="AgentBusy")`` while another node holds it (after a short wait), and the turn's
    :class:`Save` (with ``ends_turn``) gives it back. Only a bad agent id fails otherwise.
    """

    agent_id: str
    model_tag: str
    reply: trio.MemorySendChannel[LoadReply]
    hot: bool = False
    unsaved: bool = False


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
    reply: trio.MemorySendChannel[BlocksRead | Failed]  # Failed: the store stopped


class NewCache(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's updated cache as the store keeps it: its host copy (numpy) and its full blocks' hash-chain ids
    (computed once, by the GPU actor, for its hot tier's accounting and for the save)."""

    snapshot: CacheSnapshot
    block_hashes: tuple[str, ...]


class Save(Message, frozen=True, kw_only=True):
    """A turn's new cache, written behind (a newer cache of the same agent and model supersedes an unwritten one).

    ``saved``: when set, answered once this cache is on disk (fsynced unless ``fsync`` is off) with
    ``answer`` (a durable turn's own reply, which the store sends its agent then; None:
    :class:`Saved`), or with ``Failed(kind="NotSaved")`` when its save failed. ``ends_turn``: the turn
    its :class:`Load` began at the store (a shared tier's lease) is over; ``cache`` None: a turn that
    ended with nothing new to save, or whose copy was superseded.
    """

    agent_id: str
    cache: NewCache | None = None
    ends_turn: bool = False
    saved: trio.MemorySendChannel[Any] | None = None
    answer: msgspec.Struct | None = None


class HotCache(msgspec.Struct, frozen=True, kw_only=True):
    """A cache the GPU actor holds in RAM, as a listing shows it (``unsaved``: the store has no copy of it yet)."""

    agent_id: str
    model_tag: str
    num_tokens: int
    unsaved: bool


class Forget(Message, frozen=True, kw_only=True):
    """Delete every cache of the agent (each model's), hot and on disk: sent to the GPU actor, which drops its
    hot ones and forwards it (``had_hot``: it had one)."""

    agent_id: str
    reply: trio.MemorySendChannel[ForgetReply]
    had_hot: bool = False


class Evict(Message, frozen=True, kw_only=True):
    """Before a model swap or unload: write ``model_tag``'s queued copies to disk (the GPU actor dropped its hot
    caches of it, having sent every copy it owed).

    The agents' caches of that model stay on disk and load again (warm) when it returns.
    """

    model_tag: str
    reply: trio.MemorySendChannel[EvictReply]


class Flush(Message, frozen=True, kw_only=True):
    """Write every cache not yet on disk now (``Runtime.flush``, e.g. at the end of each scenario phase): sent
    to the GPU actor, which hands over the copies it owes first, then forwards it."""

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
    hot: tuple[HotCache, ...] = ()  # the GPU actor's, most recently used first (it forwards the listing)


class MeasureUsage(Message, frozen=True, kw_only=True):
    """What ``tenant`` holds: its agents with a cache (hot, dirty or on disk) and its bytes on disk."""

    tenant: str
    reply: trio.MemorySendChannel[UsageReply]
    in_ram: frozenset[str] = frozenset()  # the agents with a hot cache (the GPU actor forwards the question)


StoreInbox = Load | Save | Forget | Evict | Flush | ListAgents | MeasureUsage | ReadBlocks
