"""ModelRegistry: one model loaded at a time; leases, swaps and optional idle unload.

An agent holds a *lease* on the model for the whole of a turn
(:class:`Acquire` → :class:`Granted`, then :class:`Release`). A request naming
another configured model is queued; once every lease on the current model is
released, the registry swaps:

1. the cache store flushes the current model's dirty caches to disk and drops
   its hot caches (:class:`actors.messages_store.Evict`),
2. the GPU actor unloads the model and loads the new one
   (:class:`actors.messages_gpu.LoadModel`).

Caches are tagged with their model, so when the first model returns its
agents' caches load from disk again (warm). Acquires are served strictly in
arrival order, so a swap is never starved by a stream of requests for the
current model, and requests for the current model queued behind a swap wait
for it. With ``idle_unload_s`` set, a model with no lease for that long is
unloaded the same way (the next request loads it again).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import assert_never

import msgspec
import trio

from actors.mailbox import ask, receiver_left, send_reply
from actors.messages_common import Failed, Message
from actors.messages_gpu import (
    GpuInbox,
    LoadModel,
    LoadReply,
    ModelInfo,
    UnloadModel,
    UnloadReply,
)
from actors.messages_store import Evict, EvictReply, StoreInbox
from runtime.backend import BackendProfile
from runtime.errors import ModelError

__all__ = ["ModelRegistry", "Acquire", "Release", "Granted", "AcquireReply", "RegistryInbox", "RegistryStats"]

log = logging.getLogger("kvmem.registry")


class Granted(Message, frozen=True, kw_only=True):
    """A lease on the loaded model; give it back with :class:`Release`."""

    lease_id: int
    info: ModelInfo


AcquireReply = Granted | Failed


class Acquire(Message, frozen=True, kw_only=True):
    """Lease ``model`` (None: the runtime's default model), loading or swapping to it first."""

    model: str | None
    reply: trio.MemorySendChannel[AcquireReply]


class Release(Message, frozen=True, kw_only=True):
    """Give back the lease ``lease_id`` (no reply); with none left, a queued request for another model swaps."""

    lease_id: int


RegistryInbox = Acquire | Release


class RegistryStats(msgspec.Struct, frozen=True, kw_only=True):
    """The registry's state and counters (``Runtime.stats().registry``).

    Attributes:
        model: the loaded model's name (None: none loaded).
        model_tag: its tag (model + KV format; None: none loaded).
        default_model: the model of requests that name none.
        configured: every model requests may ask for, the default first.
        leases: leases held now (turns running on the loaded model).
        queued: lease requests waiting (behind a swap or for the current leases).
        loads: models loaded since start.
        swaps: loads that replaced another loaded model.
        idle_unloads: unloads after ``idle_unload_s`` without a lease.
        profile: the backend profile the loaded model runs under (:mod:`runtime.backend`; None: none loaded
            or an engine without one).
    """

    model: str | None
    model_tag: str | None
    default_model: str
    configured: tuple[str, ...]
    leases: int
    queued: int
    loads: int
    swaps: int
    idle_unloads: int
    profile: BackendProfile | None = None


class ModelRegistry:
    """Decides which model is loaded (see the module docstring).

    Args:
        inbox: the registry mailbox.
        gpu: a clone of the GPU mailbox.
        store: a clone of the cache store mailbox.
        default_model: used by requests that name no model (and loaded at start with ``preload``).
        models: other model names requests may ask for.
        idle_unload_s: unload the model after this long without a lease (None: never).
        preload: load the default model before reporting started (False: at the first lease).
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[RegistryInbox],
        *,
        gpu: trio.MemorySendChannel[GpuInbox],
        store: trio.MemorySendChannel[StoreInbox],
        default_model: str,
        models: Sequence[str] = (),
        idle_unload_s: float | None = None,
        preload: bool = True,
    ) -> None:
        self._inbox = inbox
        self._gpu = gpu
        self._store = store
        self._default = default_model
        self._configured = tuple(dict.fromkeys([default_model, *models]))
        self._idle_unload_s = idle_unload_s
        self._preload = preload
        self._current: ModelInfo | None = None
        self._leases: set[int] = set()
        self._queue: deque[Acquire] = deque()
        self._next_lease = 0
        self._loads = self._swaps = self._idle_unloads = 0

    @property
    def current(self) -> ModelInfo | None:
        return self._current

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the default model (with ``preload``), then serve leases until the mailbox closes.

        Raises:
            runtime.errors.ModelError: the default model does not load (with ``preload``).
        """
        async with self._inbox, self._gpu, self._store:
            if self._preload:
                failure = await self._switch_to(self._default)
                if failure is not None:
                    raise ModelError(failure.error)
            task_status.started()
            while True:
                idle = self._idle_unload_s is not None and self._current is not None and not self._leases
                message: RegistryInbox | None = None
                with trio.move_on_after(self._idle_unload_s if idle and self._idle_unload_s else math.inf):
                    try:
                        message = await self._inbox.receive()
                    except trio.EndOfChannel:
                        return
                if message is None:
                    await self._unload()
                    continue
                match message:
                    case Acquire():
                        self._queue.append(message)
                    case Release(lease_id=lease_id):
                        self._leases.discard(lease_id)
                    case _:
                        assert_never(message)
                await self._serve()

    async def _serve(self) -> None:
        while self._queue:
            head = self._queue[0]
            if receiver_left(head.reply):
                self._queue.popleft()
                continue
            name = head.model or self._default
            if name not in self._configured:
                self._queue.popleft()
                error = f"model {name!r} is not configured; known: {list(self._configured)}"
                send_reply(head.reply, Failed(kind="ValueError", error=error))
                continue
            if self._current is None or self._current.name != name:
                if self._leases:
                    return  # wait for the current model's turns to finish
                failure = await self._switch_to(name)
                if failure is not None:
                    self._queue.popleft()
                    send_reply(head.reply, failure)
                    continue
            assert self._current is not None
            self._queue.popleft()
            self._next_lease += 1
            self._leases.add(self._next_lease)
            send_reply(head.reply, Granted(lease_id=self._next_lease, info=self._current))

    async def _evict_current(self) -> None:
        if self._current is None:
            return
        tag = self._current.tag
        self._current = None
        reply: EvictReply = await ask(self._store, lambda r: Evict(model_tag=tag, reply=r))
        if isinstance(reply, Failed):
            log.warning("evicting caches of %s failed: %s", tag, reply.error)

    async def _switch_to(self, name: str) -> Failed | None:
        if self._current is not None:
            log.info("swapping model %s -> %s", self._current.name, name)
            self._swaps += 1
        await self._evict_current()
        reply: LoadReply = await ask(self._gpu, lambda r: LoadModel(name=name, reply=r))
        if isinstance(reply, Failed):
            return reply
        self._loads += 1
        self._current = reply.info
        return None

    async def _unload(self) -> None:
        log.info("unloading idle model %s", self._current.name if self._current else None)
        self._idle_unloads += 1
        await self._evict_current()
        reply: UnloadReply = await ask(self._gpu, lambda r: UnloadModel(reply=r))
        if isinstance(reply, Failed):
            log.warning("unloading failed: %s", reply.error)

    def statistics(self) -> RegistryStats:
        return RegistryStats(
            model=self._current.name if self._current else None,
            model_tag=self._current.tag if self._current else None,
            default_model=self._default,
            configured=self._configured,
            leases=len(self._leases),
            queued=len(self._queue),
            loads=self._loads,
            swaps=self._swaps,
            idle_unloads=self._idle_unloads,
            profile=self._current.profile if self._current else None,
        )
