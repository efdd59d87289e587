"""Rank 0's side: the connections to the followers, the handles that name caches, the wrapped engine.

:class:`Leader` holds one TCP connection per follower. Engine calls are sent
from the MLX thread and never wait for an answer (the collectives in each
forward pass keep the ranks in step); cache directory work is sent from the
store's disk thread and does wait for every follower's answer
(:meth:`Leader.ask`). One lock orders what goes out, so each follower sees one
sequence of commands, in the order rank 0 made the calls.

:class:`Handles` names caches across ranks. Rank 0's parked caches and
snapshots are ordinary objects that its actors pass around and drop; each one
a rank computed (a finished turn, a parked prompt, a disk load) gets a handle,
under which every follower keeps its own part. When rank 0's object is
garbage collected, a ``weakref.finalize`` callback queues the handle, and the
next command goes after a :class:`~runtime.distributed.wire.Release`: the
followers' memory follows rank 0's hot tier without any other bookkeeping.

:class:`LeaderEngine` is :class:`runtime.execution.mlx_engine.MlxEngine` with every call
that changes state sent to the followers first (render, tokenize and counting
tokens run on rank 0 alone).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import threading
import weakref
from dataclasses import replace
from typing import Any

import mlx.core as mx
import msgspec

from runtime.backend import BackendProfile
from runtime.distributed.wire import (
    CloseEngine,
    ColdWire,
    Command,
    Discard,
    Finish,
    HotWire,
    Join,
    LoadModel,
    ParkPrompt,
    Prefill,
    Release,
    Reply,
    SharedWire,
    Shutdown,
    Start,
    StepDecode,
    UnloadModel,
    WarmWire,
    WirePlan,
    WireSource,
    recv_reply,
    send_frame,
)
from runtime.plan.engine import (
    Finished,
    MemoryReading,
    ModelInfo,
    PrefillResult,
    SequenceStarted,
    StepTiming,
    StepToken,
)
from runtime.plan.sampling import SamplingOptions
from runtime.plan.tools import ToolChoice
from runtime.plan.turn_plan import ColdStart, FromHot, FromShared, FromWarm, Tokenized, TurnPlan
from runtime.kv.kvstate import ParkedCache
from runtime.execution.mlx_engine import MlxEngine

__all__ = ["Handles", "Leader", "LeaderEngine"]

log = logging.getLogger("kvmem.distributed")


class Handles:
    """Numbers that name one cache on every rank; a handle is released when rank 0's objects for it are gone.

    Thread-safe: handles are made on the MLX thread and the disk thread, and
    finalizers run on whichever thread drops an object (under a re-entrant
    lock, since a collection can run them while that thread holds it).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._numbers = itertools.count(1)
        self._by_object: dict[int, int] = {}  # id(object) -> handle, while the object lives
        self._live: dict[int, int] = {}  # handle -> how many of rank 0's objects it names
        self._released: list[int] = []

    def new(self) -> int:
        """A fresh handle (released unless :meth:`bind` gives it an object)."""
        with self._lock:
            handle = next(self._numbers)
            self._live[handle] = 0
            return handle

    def bind(self, obj: object, handle: int) -> None:
        """``obj`` is rank 0's part of the cache every follower keeps under ``handle``."""
        with self._lock:
            if id(obj) in self._by_object:
                return  # already named (an object handed back unchanged): the first handle stays
            self._by_object[id(obj)] = handle
            self._live[handle] = self._live.get(handle, 0) + 1
        weakref.finalize(obj, self._dead, id(obj), handle)

    def settle(self, handle: int) -> None:
        """Release ``handle`` if no object was bound to it (a call that parked nothing, or failed)."""
        with self._lock:
            if self._live.get(handle) == 0:
                del self._live[handle]
                self._released.append(handle)

    def of(self, obj: object) -> int:
        """The handle naming ``obj``.

        Raises:
            ValueError: ``obj`` is not a cache these ranks computed.
        """
        with self._lock:
            handle = self._by_object.get(id(obj))
        if handle is None:
            raise ValueError(f"a {type(obj).__name__} that no kvmem rank holds a part of")
        return handle

    def take_released(self) -> tuple[int, ...]:
        with self._lock:
            released, self._released = tuple(self._released), []
            return released

    def _dead(self, key: int, handle: int) -> None:
        with self._lock:
            if self._by_object.get(key) == handle:
                del self._by_object[key]
            left = self._live.get(handle, 1) - 1
            if left > 0:
                self._live[handle] = left
            else:
                self._live.pop(handle, None)
                self._released.append(handle)


class Leader:
    """Rank 0's connections to the other ranks (``followers[i]`` is rank ``i + 1``).

    Args:
        followers: connected sockets, in rank order.
        size: the number of ranks (rank 0 included).
    """

    def __init__(self, followers: list[socket.socket], *, size: int) -> None:
        self.followers = followers
        self.size = size
        self.handles = Handles()
        self._send_lock = threading.Lock()
        self._ask_lock = threading.Lock()  # one question at a time, so answers come back in order

    def send(self, command: Command) -> None:
        """Send ``command`` to every follower (after releasing the handles rank 0 dropped)."""
        with self._send_lock:
            released = self.handles.take_released()
            for sock in self.followers:
                if released:
                    send_frame(sock, Release(released))
                send_frame(sock, command)

    def ask(self, command: Command) -> list[Reply]:
        """Send ``command`` and read one reply from each follower, in rank order.

        The caller may do rank 0's own part between :meth:`send` and this
        method's reading by using :meth:`ask_start` / :meth:`ask_finish` instead.
        """
        self.ask_start(command)
        return self.ask_finish()

    def ask_start(self, command: Command) -> None:
        """Send a question; :meth:`ask_finish` reads the answers. Holds the question lock until then."""
        self._ask_lock.acquire()
        try:
            self.send(command)
        except BaseException:
            self._ask_lock.release()
            raise

    def ask_finish(self) -> list[Reply]:
        """Every follower's answer to the question :meth:`ask_start` sent."""
        try:
            return [recv_reply(sock) for sock in self.followers]
        finally:
            self._ask_lock.release()

    def wire_plan(self, plan: TurnPlan) -> WirePlan:
        """``plan`` with its cache named by handle (ValueError: a cache the ranks do not hold)."""
        source: WireSource
        match plan.source:
            case ColdStart():
                source = ColdWire()
            case FromHot(parked=parked):
                source = HotWire(self.handles.of(parked))
            case FromWarm(snapshot=snapshot):
                source = WarmWire(self.handles.of(snapshot))
            case FromShared():
                source = self.wire_shared(plan.source)
        return WirePlan(tier=plan.tier, source=source, match=plan.match, reuse_tokens=plan.reuse_tokens,
                        reuse_chars=plan.reuse_chars)

    def wire_shared(self, shared: FromShared) -> SharedWire:
        return SharedWire(self.handles.of(shared.parked), shared.reuse_tokens, shared.donor)

    def close(self) -> None:
        """Tell every follower to exit (rank 0's caches are flushed) and close the connections."""
        try:
            self.send(Shutdown())
        except OSError as exc:
            log.warning("telling the other ranks to stop failed: %s", exc)
        for sock in self.followers:
            sock.close()


class LeaderEngine:
    """Rank 0's engine: ``inner`` (this rank's part of the model), each state change sent to the followers first.

    Sending first matters: a call that runs a forward pass waits in its
    collectives until every rank runs the same pass.
    """

    def __init__(self, inner: MlxEngine, leader: Leader) -> None:
        self._inner = inner
        self._leader = leader

    @property
    def memory(self) -> MemoryReading:
        return self._inner.memory

    @property
    def profile(self) -> BackendProfile | None:
        return self._inner.profile

    def load(self, name: str) -> ModelInfo:
        # MLX's generator is per thread: seed this one (the MLX thread) as the followers seed theirs,
        # so sampling with a temperature draws the same tokens on every rank.
        seed = secrets.randbelow(2**31)
        self._leader.send(LoadModel(name, seed))
        mx.random.seed(seed)
        # No turn starts from blocks read by their hash chain (ModelInfo.layer_kinds empty): rank 0 would read
        # only its own part of them, and every other rank reads its part of a cache under a handle rank 0 names.
        return msgspec.structs.replace(self._inner.load(name), layer_kinds=())

    def unload(self) -> None:
        self._leader.send(UnloadModel())
        self._inner.unload()

    def close(self) -> None:
        try:
            self._leader.send(CloseEngine())
        finally:
            self._inner.close()

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
    ) -> str:
        return self._inner.render(messages, tools, tool_choice)

    def count_tokens(self, text: str) -> int:
        return self._inner.count_tokens(text)

    def tokenize(self, prompt: str, plan: TurnPlan) -> Tokenized:
        return self._inner.tokenize(prompt, plan)

    def start(
        self, request_id: int, prompt: str, plan: TurnPlan, tokens: Tokenized, sampling: SamplingOptions
    ) -> SequenceStarted:
        wire = self._leader.wire_plan(plan)  # before anything is sent: a plan no rank can run fails here alone
        self._leader.send(Start(request_id=request_id, prompt=prompt, plan=wire, tokens=tokens, sampling=sampling))
        return self._inner.start(request_id, prompt, plan, tokens, sampling)

    def prefill(self, request_id: int, chunk: int | None, *, adopt: FromShared | None = None) -> PrefillResult:
        wire = self._leader.wire_shared(adopt) if adopt is not None else None
        self._leader.send(Prefill(request_id=request_id, chunk=chunk, adopt=wire))
        return self._inner.prefill(request_id, chunk, adopt=adopt)

    def prefill_together(self, request_ids: list[int]) -> dict[int, PrefillResult]:
        return {}  # not grouped: the followers replay prefills one turn at a time

    def prepare(self, snapshot: Any) -> None:
        return None  # not restored ahead: the followers' parts would have to be too (a turn restores them)

    def park_prompt(self, request_id: int) -> ParkedCache | None:
        handle = self._leader.handles.new()
        self._leader.send(ParkPrompt(request_id=request_id, handle=handle))
        try:
            parked = self._inner.park_prompt(request_id)
            if parked is not None:
                self._leader.handles.bind(parked, handle)
            return parked
        finally:
            self._leader.handles.settle(handle)

    def join(self, request_id: int) -> None:
        self._leader.send(Join(request_id))
        self._inner.join(request_id)

    def step(self) -> list[StepToken]:
        self._leader.send(StepDecode())
        return self._inner.step()

    @property
    def last_step_timing(self) -> StepTiming | None:
        return self._inner.last_step_timing

    def finish(self, request_id: int) -> Finished:
        handle = self._leader.handles.new()
        self._leader.send(Finish(request_id=request_id, handle=handle))
        try:
            finished = self._inner.finish(request_id)
            if finished.parked is not None and finished.snapshot is None:
                # The copy is made now: the followers' parts of it are bound to this finish's handle.
                finished = replace(finished, snapshot=self._inner.snapshot(finished.parked))
            for part in (finished.parked, finished.snapshot):
                if part is not None:
                    self._leader.handles.bind(part, handle)
            return finished
        finally:
            self._leader.handles.settle(handle)

    def snapshot(self, parked: Any, *, stop: Any = None, done: Any = None) -> Any:
        return self._inner.snapshot(parked)  # not called: finish makes the copy itself (whole)

    def discard(self, request_id: int) -> None:
        self._leader.send(Discard(request_id))
        self._inner.discard(request_id)
