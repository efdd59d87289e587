"""AgentCaches: the agents' caches as the GPU actor holds them, and what it tells the cache store of them.

The GPU actor runs the model, and a parked cache is the model's memory: the actor that owns
device memory holds every agent's latest parked cache (the hot tier,
:class:`runtime.plan.hot_tier.HotTier`, and its accounting). So a hot turn never asks the store
for anything; the store (:mod:`actors.cache_store`) holds what is not in device memory: the host
copies queued for their write, the disk, the shared tier.

* **A turn begins** (:meth:`AgentCaches.check_out`): the agent's hot cache, and a sharing turn's
  donors, from here; only an agent not held here whose cache the store holds (after a restart, a
  demotion, a model swap) asks the store (:class:`Load`): its copy queued for the write, read
  ahead, or on disk. What the store holds, the actor knows without asking: what the disk held at
  start (the runtime lists it once), and every copy it has sent since, less what it forgot; so a
  new agent's first turn asks nothing. With a shared tier every turn asks, for the agent's
  cluster lease (and another node may have saved it).
* **A turn ends** (:meth:`AgentCaches.keep`): its new cache is hot at once; its host copy goes to
  the store in a :class:`Save`, now when the engine made it with the turn (the CPU policy), else
  once the GPU actor makes it (``BackendProfile.copy_after_turn``: after the turn, never between
  two decode steps of a busy batch; these are the copies *owed*). A durable turn's copy is wanted
  at once, and its reply travels with the Save: the store answers the agent once the copy is on
  disk. A newer cache of the same agent supersedes a copy still owed: it is never made.
* **Demotion**: a hot cache may leave RAM once the store holds its copy (written or queued):
  the store then serves the agent's next turn from it.
* What the runtime asks of every cache (forget, flush, list, measure) comes here first and is
  forwarded to the store with what only this side knows (its hot caches), so every piece of
  state has one owner and no object is shared between the two actors.

Saves go to the store in the order they were made, never waiting in the GPU actor's loop: when
the store's mailbox is full, they queue here behind each other (:meth:`AgentCaches.send`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import trio

from actors.mailbox import send_reply
from actors.messages_common import Failed
from actors.messages_store import (
    Flush,
    Forget,
    HotCache,
    ListAgents,
    Load,
    LoadReply,
    MeasureUsage,
    NewCache,
    Save,
    StoreInbox,
)
from runtime.identity import AgentKey
from runtime.persist.format import block_chain_hashes
from runtime.plan.hot_tier import HotDonor, HotEntry, HotTier, HotTierStats
from runtime.plan.turn_plan import OwnCache, ParkedView
from runtime.spec import CacheSnapshot

__all__ = ["AgentCaches", "CheckedOut", "OwedCopy"]

log = logging.getLogger("kvmem.gpu")

R = TypeVar("R")


@dataclass(frozen=True)
class CheckedOut:
    """What a turn starts from: the agent's own cache (hot, or the store's), others' hot caches (a sharing turn),
    and whether the store counts the turn (a shared tier's lease: its last :class:`Save` ends it)."""

    own: OwnCache | None
    donors: tuple[HotDonor, ...]
    leased: bool


@dataclass(eq=False)  # one owed copy is one object (removed by identity)
class OwedCopy:
    """A finished turn's cache whose host copy the GPU actor still owes the store, and what its Save carries."""

    request_id: int
    agent_id: str
    parked: ParkedView
    block_hashes: tuple[str, ...]
    since: float
    wanted: bool = False  # someone waits for it: a durable turn, a flush, a model swap, stopping
    ends_turn: bool = False
    saved: trio.MemorySendChannel[Any] | None = None  # a durable turn's reply channel
    answer: msgspec.Struct | None = None  # and its reply
    done: list[Any] = field(default_factory=list)  # the parts copied so far (a copy stopped between two)

    @property
    def key(self) -> AgentKey:
        return AgentKey(self.agent_id, self.parked.model_tag)


class AgentCaches:
    """The GPU actor's hot tier, its owed copies and its sends to the store (see the module docstring).

    Args:
        store: the cache store's mailbox (None: RAM only, nothing is kept between turns).
        hot: the hot tier (this object's own).
        leases: the store has a shared tier: every turn loads, for the agent's lease.
        stored: the caches the disk held at start (None: not listed; a turn the hot tier cannot serve loads).
        wake: called when a copy becomes wanted (the GPU actor's idle wait ends).
    """

    def __init__(self, store: trio.MemorySendChannel[StoreInbox] | None, hot: HotTier, *, leases: bool = False,
                 stored: frozenset[AgentKey] | None = None, wake: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self._hot = hot
        self._leases = leases
        # What the store holds (on disk or queued), as far as this actor knows: None, unknown.
        self._stored: set[AgentKey] | None = None if stored is None else set(stored)
        self._wake = wake
        self.owed: deque[OwedCopy] = deque()
        self._backlog: deque[StoreInbox] = deque()  # sends waiting for room in the store's mailbox, in order
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery | None) -> None:
        """Where a full store mailbox's sends wait (None: the actor is stopping, a send waits in place)."""
        self._nursery = nursery

    # -- a turn begins -----------------------------------------------------------

    async def check_out(self, agent_id: str, model_tag: str, *, share_prefix: bool) -> CheckedOut | Failed:
        """The caches a turn of ``agent_id`` may start from: its hot one, else the store's (one round trip)."""
        assert self.store is not None
        leased = False
        key = AgentKey(agent_id, model_tag)
        if self._leases or self._in_store(key):
            loaded: LoadReply = await self.ask(lambda r: Load(
                agent_id=agent_id, model_tag=model_tag, reply=r, hot=self._hot.holds(agent_id, model_tag),
                unsaved=any(o.key == key for o in self.owed)))
            if isinstance(loaded, Failed):
                return loaded
            leased = self._leases
            if loaded.forgotten:
                self.forget_here(agent_id)
            elif loaded.stale:
                self._hot.drop(agent_id, model_tag)
            own = self._hot.checkout(agent_id, model_tag) or loaded.own
            if own is None and self._stored is not None:
                self._stored.discard(key)  # the store had nothing after all (an unreadable cache: a logged miss)
        else:
            own = self._hot.checkout(agent_id, model_tag)
        donors = self._hot.donors(agent_id, model_tag) if share_prefix else ()
        return CheckedOut(own=own, donors=donors, leased=leased)

    def _in_store(self, key: AgentKey) -> bool:
        """Whether a turn must ask the store for the agent's cache: the hot tier holds none, and the store may."""
        if self._hot.holds(*key):
            return False
        return self._stored is None or key in self._stored

    # -- a turn ends -------------------------------------------------------------

    def keep(self, request_id: int, agent_id: str, parked: ParkedView, snapshot: CacheSnapshot | None, *,
             block_bytes: int, share_prefix: bool, leased: bool, now: float,
             reply: trio.MemorySendChannel[Any] | None = None, answer: msgspec.Struct | None = None) -> None:
        """A turn's new cache: hot now; its copy goes to the store (``snapshot``), or is owed. ``reply``, ``answer``:
        a durable turn's, sent by the store once the copy is on disk."""
        hashes = tuple(block_chain_hashes(parked.model_tag, parked.token_ids))
        demoted = self._hot.put(agent_id, parked, share_prefix=share_prefix, block_bytes=block_bytes,
                                block_hashes=hashes)
        if demoted:
            log.debug("demoted %d hot caches to the store's", len(demoted))
        key = AgentKey(agent_id, parked.model_tag)
        for old in [o for o in self.owed if o.key == key]:  # superseded: never made
            self._give_up(old, "a newer cache of the agent superseded it")
        owed = OwedCopy(request_id, agent_id, parked, hashes, now, wanted=reply is not None, ends_turn=leased,
                        saved=reply, answer=answer)
        if snapshot is not None:
            self._hand_over(owed, snapshot)
            return
        self.owed.append(owed)
        if owed.wanted:
            self._wake()

    def ended(self, agent_id: str, *, leased: bool) -> None:
        """A turn ended with nothing new to keep: a lease it took goes."""
        if leased:
            self.send(Save(agent_id=agent_id, ends_turn=True))

    def copies_owed(self) -> list[tuple[bool, float]]:
        """The copies owed, as the write-behind policy reads them (:func:`runtime.plan.save_queue.next_copy`)."""
        return [(o.wanted, o.since) for o in self.owed]

    def want_every(self, which: Callable[[AgentKey], bool] = lambda key: True) -> None:
        """Every copy owed (of the keys ``which`` accepts) is wanted now."""
        for owed in self.owed:
            if which(owed.key):
                owed.wanted = True
        self._wake()

    def copy_made(self, owed: OwedCopy, snapshot: CacheSnapshot) -> bool:
        """``owed``'s copy is made: to the store, unless a newer cache or a forget settled it meanwhile (False)."""
        if owed not in self.owed:
            return False
        self.owed.remove(owed)
        self._hand_over(owed, snapshot)
        return True

    def copy_failed(self, owed: OwedCopy, error: str) -> None:
        """``owed``'s copy could not be made: its cache stays hot, unsaved (saved with the agent's next turn)."""
        if owed in self.owed:  # else settled already (superseded or forgotten while it was being made)
            self._give_up(owed, error)

    def _hand_over(self, owed: OwedCopy, snapshot: CacheSnapshot) -> None:
        """The copy to the store in the turn's Save; its cache may leave RAM from now on."""
        self.send(Save(agent_id=owed.agent_id, ends_turn=owed.ends_turn, saved=owed.saved, answer=owed.answer,
                       cache=NewCache(snapshot=snapshot, block_hashes=owed.block_hashes)))
        if self._stored is not None:
            self._stored.add(owed.key)
        self._hot.stored(owed.agent_id, owed.parked)

    def _give_up(self, owed: OwedCopy, error: str) -> None:
        """An owed copy that will not be made: off the list; the lease alone goes to the store, and a durable turn
        hears that its cache is not on disk."""
        self.owed.remove(owed)
        if owed.saved is not None:
            send_reply(owed.saved, Failed(kind="NotSaved", error=f"the cache was not saved: {error}"))
        if owed.ends_turn:
            self.send(Save(agent_id=owed.agent_id, ends_turn=True))

    # -- what the runtime asks of every cache ----------------------------------------

    def forget_here(self, agent_id: str) -> bool:
        """Drop the agent's hot caches and the copies owed for them; whether it had a hot cache."""
        for owed in [o for o in self.owed if o.agent_id == agent_id]:
            self._give_up(owed, f"agent {agent_id!r} was forgotten first")
        if self._stored is not None:
            self._stored = {key for key in self._stored if key.agent_id != agent_id}
        return self._hot.forget(agent_id) > 0

    def forward(self, message: Flush | Forget | ListAgents | MeasureUsage) -> None:
        """Send the store a question about every cache, with what the hot tier knows (the store answers; a flush
        comes once the copies owed were sent)."""
        match message:
            case Forget(agent_id=agent_id):
                message = msgspec.structs.replace(message, had_hot=self.forget_here(agent_id))
            case ListAgents():
                message = msgspec.structs.replace(message, hot=self.listing())
            case MeasureUsage():
                message = msgspec.structs.replace(message, in_ram=frozenset(e.agent_id for e in self._hot.entries()))
        self.send(message)

    def listing(self) -> tuple[HotCache, ...]:
        """The hot caches, most recently used first."""
        return tuple(HotCache(agent_id=e.agent_id, model_tag=e.model_tag, num_tokens=e.parked.num_tokens,
                              unsaved=not e.stored) for e in reversed(self._hot.entries()))

    def drop_model(self, model_tag: str) -> None:
        """The model goes (its copies were made and sent first): its hot caches go with it."""
        self._hot.drop_model(model_tag)

    def entries(self) -> list[HotEntry]:
        """Every hot cache, least recently used first (a read for the runtime's reports)."""
        return self._hot.entries()

    def hot_stats(self) -> HotTierStats:
        return self._hot.stats()

    # -- the store's mailbox ---------------------------------------------------------

    async def ask(self, build: Callable[[trio.MemorySendChannel[R]], StoreInbox]) -> R:
        """Send ``build(reply_channel)`` to the store, after every send before it, and wait for the one reply
        (a Load after the Save of the cache it loads; a Failed when the store stopped)."""
        assert self.store is not None
        send, receive = trio.open_memory_channel[R](1)
        async with receive:
            self.send(build(send))
            return await receive.receive()

    def send(self, message: StoreInbox) -> None:
        """To the store, after every send before it, never waiting in the caller (a full mailbox: a task waits)."""
        if self.store is None:
            return
        if not self._backlog:
            try:
                self.store.send_nowait(message)
                return
            except trio.WouldBlock:
                pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._unsent(message)
                return
        self._backlog.append(message)
        if len(self._backlog) == 1 and self._nursery is not None:
            self._nursery.start_soon(self.drain)

    async def drain(self) -> None:
        """Send what waits for room in the store's mailbox, in order (shielded: a turn's copy is not lost)."""
        assert self.store is not None
        with trio.CancelScope(shield=True):
            while self._backlog:
                message = self._backlog[0]
                try:
                    with trio.fail_after(60):
                        await self.store.send(message)
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
                    self._unsent(message)
                self._backlog.popleft()

    @staticmethod
    def _unsent(message: StoreInbox) -> None:
        """The store stopped: whoever waits for an answer through it gets one here."""
        if isinstance(message, Save):
            if message.saved is not None:
                send_reply(message.saved, Failed(kind="NotSaved", error="the cache store stopped first"))
        else:
            send_reply(message.reply, Failed(kind="Cancelled", error="the cache store is shutting down"))
