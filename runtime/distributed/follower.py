"""The loop every rank but rank 0 runs: rank 0's engine calls and cache directory work, on this rank's part.

A follower has no gateway, no actors and no trio: one thread (the process's
main thread, so the one that makes every MLX call) reads rank 0's commands in
order and makes the same calls on its own :class:`runtime.execution.mlx_engine.MlxEngine`
(this rank's part of the model) and its own
:class:`runtime.persist.CacheDirectory` (this rank's part of every cache). It
keeps each cache rank 0 names by handle (a finished turn, a parked prompt, a
snapshot it read) until rank 0 releases it.

An engine call that fails here is logged and the loop goes on: the call
failed on rank 0 too (the same code on the same tokens), and rank 0's GPU
actor discards the turn, which reaches this rank as a ``Discard``. A command
naming a handle this rank does not hold is a broken protocol: the follower
exits with status 2 rather than run a different turn than rank 0.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, assert_never

import mlx.core as mx

from runtime.distributed.directory import fingerprint
from runtime.distributed.shard import rank_tag
from runtime.distributed.wire import (
    CloseEngine,
    ColdWire,
    CollectGarbage,
    Command,
    ConnectionLost,
    DeletePart,
    Discard,
    Finish,
    HotWire,
    Join,
    LoadModel,
    LoadPart,
    ParkPrompt,
    PartDone,
    PartLoaded,
    Prefill,
    Release,
    SavePart,
    SharedWire,
    Shutdown,
    Start,
    StepDecode,
    UnloadModel,
    WarmWire,
    WirePlan,
    recv_command,
    send_frame,
)
from runtime.plan.turn_plan import CacheSource, ColdStart, FromHot, FromShared, FromWarm, TurnPlan
from runtime.errors import KvmemError
from runtime.execution.mlx_engine import MlxEngine
from runtime.persist import CacheDirectory
from runtime.spec import CacheSnapshot

__all__ = ["Follower", "ProtocolError"]

log = logging.getLogger("kvmem.distributed")


class ProtocolError(RuntimeError):
    """Rank 0 named a cache this rank does not hold: the ranks no longer agree."""


class Follower:
    """One rank other than 0, following rank 0's commands on ``sock`` (see the module docstring).

    Args:
        sock: the connection to rank 0.
        engine: this rank's engine (its part of the model).
        directory: this rank's cache folder.
        rank: this rank.
        size: the number of ranks.
    """

    def __init__(self, sock: socket.socket, *, engine: MlxEngine, directory: CacheDirectory, rank: int,
                 size: int) -> None:
        self._sock = sock
        self._engine = engine
        self._directory = directory
        self.rank = rank
        self.size = size
        self._parked: dict[int, Any] = {}
        self._snapshots: dict[int, CacheSnapshot] = {}
        self.commands = 0

    def run(self) -> int:
        """Follow rank 0 until it says stop (0), its connection drops (1) or the ranks disagree (2)."""
        try:
            while True:
                command = recv_command(self._sock)
                self.commands += 1
                if isinstance(command, Shutdown):
                    log.info("rank %d: rank 0 stopped; exiting", self.rank)
                    return 0
                self._handle(command)
        except (ConnectionLost, OSError) as exc:
            log.error("rank %d: lost rank 0 (%s); exiting", self.rank, exc)
            return 1
        except ProtocolError as exc:
            log.error("rank %d: %s; exiting", self.rank, exc)
            return 2
        finally:
            self._sock.close()
            self._engine.close()

    def _handle(self, command: Command) -> None:
        engine = self._engine
        match command:
            case LoadModel(name=name, seed=seed):
                mx.random.seed(seed)
                self._call(engine.load, name)
            case UnloadModel():
                self._call(engine.unload)
            case CloseEngine():
                self._call(engine.close)
            case Start():
                plan = self._plan(command.plan)
                self._call(engine.start, command.request_id, command.prompt, plan, command.tokens, command.sampling)
            case Prefill(request_id=request_id, chunk=chunk, adopt=adopt):
                shared = self._shared(adopt) if adopt is not None else None
                self._call(lambda: engine.prefill(request_id, chunk, adopt=shared))
            case ParkPrompt(request_id=request_id, handle=handle):
                parked = self._call(engine.park_prompt, request_id)
                if parked is not None:
                    self._parked[handle] = parked
            case Join(request_id=request_id):
                self._call(engine.join, request_id)
            case StepDecode():
                self._call(engine.step)
            case Finish(request_id=request_id, handle=handle):
                finished = self._call(engine.finish, request_id)
                if finished is not None and finished.parked is not None:
                    self._parked[handle] = finished.parked
                if finished is not None and finished.snapshot is not None:
                    self._snapshots[handle] = finished.snapshot
            case Discard(request_id=request_id):
                self._call(engine.discard, request_id)
            case Release(handles=handles):
                for handle in handles:
                    self._parked.pop(handle, None)
                    self._snapshots.pop(handle, None)
            case LoadPart() | SavePart() | DeletePart():
                send_frame(self._sock, self._disk(command))
            case CollectGarbage():
                self._disk_call(self._directory.collect_garbage)
            case Shutdown():
                pass  # handled by run
            case _:
                assert_never(command)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - rank 0 met the same error and discards the turn
            log.warning("rank %d: %s failed: %s: %s", self.rank, getattr(fn, "__name__", "a call"),
                        type(exc).__name__, exc)
            return None

    # -- caches named by handle --------------------------------------------------

    def _plan(self, wire: WirePlan) -> TurnPlan:
        source: CacheSource
        match wire.source:
            case ColdWire():
                source = ColdStart()
            case HotWire(handle=handle):
                source = FromHot(parked=self._held(self._parked, handle))
            case WarmWire(handle=handle):
                source = FromWarm(snapshot=self._held(self._snapshots, handle))
            case SharedWire():
                source = self._shared(wire.source)
        return TurnPlan(tier=wire.tier, source=source, match=wire.match, reuse_tokens=wire.reuse_tokens,
                        reuse_chars=wire.reuse_chars)

    def _shared(self, wire: SharedWire) -> FromShared:
        return FromShared(parked=self._held(self._parked, wire.handle), reuse_tokens=wire.reuse_tokens,
                          donor=wire.donor)

    @staticmethod
    def _held(table: dict[int, Any], handle: int) -> Any:
        try:
            return table[handle]
        except KeyError:
            raise ProtocolError(f"rank 0 named cache {handle}, which this rank does not hold") from None

    # -- this rank's part of the cache directory -----------------------------------

    def _disk(self, command: LoadPart | SavePart | DeletePart) -> PartLoaded | PartDone:
        match command:
            case LoadPart(agent_id=agent_id, model_tag=tag, handle=handle):
                try:
                    mine = rank_tag(tag, rank=self.rank, size=self.size)
                    snapshot = self._directory.load(agent_id, model_tag=mine)
                except (KvmemError, OSError, ValueError) as exc:
                    return PartLoaded(error=f"{type(exc).__name__}: {exc}")
                self._snapshots[handle] = snapshot
                return PartLoaded(fingerprint=fingerprint(snapshot))
            case SavePart(agent_id=agent_id, handle=handle):
                held = self._snapshots.get(handle)
                if held is None:
                    return PartDone(error=f"rank {self.rank} holds no part of cache {handle}", missing=True)
                return PartDone(error=self._disk_call(self._directory.save, agent_id, held))
            case DeletePart(agent_id=agent_id):
                return PartDone(error=self._disk_call(self._directory.delete, agent_id))

    def _disk_call(self, fn: Any, *args: Any) -> str | None:
        try:
            fn(*args)
        except (KvmemError, OSError, ValueError) as exc:
            log.warning("rank %d: %s failed: %s", self.rank, fn.__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        return None
