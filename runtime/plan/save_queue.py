"""SaveQueue: the write-behind policy — which unsaved cache is written next, and what a save's outcome does.

Plain Python (no trio, no MLX), like :mod:`runtime.plan.kv_manager`: the cache store actor
(:mod:`actors.cache_store`) asks it and carries the answer out on its disk thread.

* **Order**: unsaved ("dirty") caches are written oldest first. A newer cache of the same
  key supersedes an unwritten one (one write instead of two). A cache a client waits for
  (a *durable* turn) goes to the front.
* **Loads first**: while an agent waits for its cache to be read, nothing is written
  (:meth:`SaveQueue.next`): a turn waiting beats a write no one waits for.
* **Retry**: a save that failed in a way that may recover (a full or read-only disk) keeps its
  cache dirty, behind the others, and writing pauses for ``retry_delay_s`` or until the next
  cache arrives, whichever comes first. A save that cannot succeed (a bad cache) is dropped.
* **Waiters**: each durable turn waits for its own cache or a newer one of the same key; a
  save answers the waiters of every cache it covers (:meth:`SaveQueue.answered`).
* **The copy a save needs** (the GPU policy, ``BackendProfile.copy_after_turn``): the GPU actor
  owes each finished turn's host copy and makes it when :func:`next_copy` says: the ones the
  store wants (a durable turn, a flush) or that are :data:`COPY_OVERDUE_S` old, one per loop pass
  while turns run (an overdue one a :data:`COPY_SLICE_S` slice of its parts a pass, ended after the part
  under way when a message comes, and not while a prompt's prefill is under way unless it is
  :data:`COPY_STARVED_S` old); when it has no
  turn to run, every one owed :data:`COPY_IDLE_GRACE_S` or more
  (:func:`copy_wait`: how long it may wait for the next message first); never between two steps
  otherwise. An agent's next turn often comes right behind its reply (a tool loop): it goes first,
  and a copy its new cache supersedes is never made.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["SaveQueue", "Dirty", "Write", "WaitForLoads", "WaitUntil", "SAVE_RETRY_S", "COPY_OVERDUE_S",
           "COPY_IDLE_GRACE_S", "COPY_SLICE_S", "COPY_STARVED_S", "next_copy", "copy_wait"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
W = TypeVar("W")

SAVE_RETRY_S = 5.0
"""After a save fails with a disk error (disk full, read-only), dirty caches wait this long or for the next turn."""

COPY_OVERDUE_S = 1.0
"""A host copy owed this long is made between two loop passes even while turns run: it bounds how
long a write-behind save waits behind a busy batch."""


COPY_IDLE_GRACE_S = 0.1
"""How long a copy waits on an idle GPU actor: long enough for a reply's next turn to arrive first."""

COPY_SLICE_S = 0.005
"""While turns run, an overdue copy no one waits for is made a slice a loop pass: parts (a few MB of
one array each, ``runtime.kv.host_copy``) until this long went by (at least one), then the batch goes on and the next pass resumes the copy. Every running
turn waits for what a pass copies: H200 run 3 saw an overdue 4K cache's copy stall a decode 56 ms, and
a 32K cache of a 1B model took 258 ms whole. A copy the store wants (a durable turn, a flush) is
still made whole: someone waits for it."""

COPY_STARVED_S = 5.0
"""An overdue copy waits for a prompt's prefill to end (its chunks run ahead of the host on a GPU, and
a host copy waits for every chunk launched before it: H200 run 4's cold 32K turn took 658 ms against
mlx-lm's 481, its chunks 15 ms slower each while an overdue copy went a slice between them), but not
longer than this: a stream of long prompts cannot hold a save back for ever."""


def next_copy(owed: Sequence[tuple[bool, float]], *, now: float, idle: bool, prefilling: bool = False) -> int | None:
    """Which owed copy the GPU actor makes now (its index), if any.

    Args:
        owed: each copy owed, oldest first: whether the store wants it, and since when it is owed.
        now: the clock ``since`` was read from.
        idle: the actor has no turn to run (a copy then costs no turn anything).
        prefilling: a prompt's prefill is under way (more chunks to come): an overdue copy waits
            for its end, up to :data:`COPY_STARVED_S`.
    """
    overdue = COPY_STARVED_S if prefilling else COPY_OVERDUE_S
    for i, (wanted, since) in enumerate(owed):
        age = now - since
        if wanted or age >= overdue or (idle and age >= COPY_IDLE_GRACE_S):
            return i
    return None


def copy_wait(owed: Sequence[tuple[bool, float]], *, now: float) -> float:
    """How long an idle GPU actor may wait for its next message before a copy is due (inf: none owed)."""
    return min((0.0 if wanted else max(0.0, since + COPY_IDLE_GRACE_S - now) for wanted, since in owed),
               default=math.inf)



@dataclass(frozen=True)
class Write(Generic[K]):
    """:meth:`SaveQueue.next`: write the cache of ``key`` now."""

    key: K


@dataclass(frozen=True)
class WaitForLoads:
    """:meth:`SaveQueue.next`: a load is waiting; write once none is."""


@dataclass(frozen=True)
class WaitUntil:
    """:meth:`SaveQueue.next`: the retry pause; write at ``at`` (``now``'s clock) or when a new cache arrives."""

    at: float


@dataclass(frozen=True)
class Dirty(Generic[T]):
    """One unsaved cache: the item to write and its arrival number (which waiters its save answers)."""

    item: T
    seq: int


class SaveQueue(Generic[K, T, W]):
    """Unsaved caches by key, the durable turns waiting for them, and the retry pause (see the module docstring).

    Args:
        retry_delay_s: how long writing pauses after a save that may recover failed
            (default :data:`SAVE_RETRY_S`).
    """

    def __init__(self, retry_delay_s: float | None = None) -> None:
        self.retry_delay_s = SAVE_RETRY_S if retry_delay_s is None else retry_delay_s
        self._dirty: dict[K, Dirty[T]] = {}  # oldest first (a durable cache at the front)
        self._waiters: dict[K, list[tuple[int, W]]] = {}  # per key, in arrival order
        self._arrivals = itertools.count()
        self._retry_at = float("-inf")

    # -- what arrives ---------------------------------------------------------------

    def put(self, key: K, item: T, waiter: W | None = None) -> Dirty[T]:
        """A new cache for ``key``: it supersedes an unwritten one; with a ``waiter`` it is written first.

        A new cache also ends a retry pause: the disk may have recovered since.
        """
        self._dirty.pop(key, None)
        dirty = Dirty(item, next(self._arrivals))
        if waiter is None:
            self._dirty[key] = dirty
        else:
            self._waiters.setdefault(key, []).append((dirty.seq, waiter))
            self._dirty = {key: dirty, **self._dirty}
        self._retry_at = float("-inf")
        return dirty

    # -- what to do next --------------------------------------------------------------

    def next(self, now: float, *, loads_waiting: bool) -> Write[K] | WaitForLoads | WaitUntil | None:
        """What the writer does now: write a key, or wait (for the loads, until the retry pause
        ends); None: nothing is dirty."""
        if not self._dirty:
            return None
        if loads_waiting:
            return WaitForLoads()
        if now < self._retry_at:
            return WaitUntil(self._retry_at)
        return Write(next(iter(self._dirty)))

    # -- what a save's outcome does ---------------------------------------------------

    def get(self, key: K) -> Dirty[T] | None:
        """The unsaved cache of ``key``, if any."""
        return self._dirty.get(key)

    def answered(self, key: K, dirty: Dirty[T]) -> list[W]:
        """A save of ``dirty`` ended (either way): the waiters it answers (its own and older caches')."""
        waiting = self._waiters.pop(key, [])
        rest = [(seq, w) for seq, w in waiting if seq > dirty.seq]
        if rest:
            self._waiters[key] = rest
        return [w for seq, w in waiting if seq <= dirty.seq]

    def settle(self, key: K, dirty: Dirty[T], *, saved: bool, retry: bool, now: float) -> bool:
        """After a save of ``dirty``: True when ``key`` is now clean.

        A cache superseded or dropped meanwhile is left as it is (False). A failed save
        that may recover (``retry``) keeps it dirty, behind the others, and pauses writing.
        """
        if self._dirty.get(key) is not dirty:
            return False
        if not saved and retry:
            del self._dirty[key]
            self._dirty[key] = dirty
            self._retry_at = now + self.retry_delay_s
            return False
        del self._dirty[key]
        return True

    def drop(self, which: Callable[[K], bool]) -> list[W]:
        """Forget the unsaved caches whose key ``which`` accepts (forgotten agent, unloaded model);
        returns their waiters, which will never be answered by a save."""
        for key in [k for k in self._dirty if which(k)]:
            del self._dirty[key]
        waiters: list[W] = []
        for key in [k for k in self._waiters if which(k)]:
            waiters += [w for _, w in self._waiters.pop(key)]
        return waiters

    # -- what it holds ----------------------------------------------------------------

    def keys(self) -> list[K]:
        """The keys with an unsaved cache, in the order they would be written."""
        return list(self._dirty)

    def __contains__(self, key: object) -> bool:
        return key in self._dirty

    def __len__(self) -> int:
        return len(self._dirty)
