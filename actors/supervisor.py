"""The supervisor and the in-process API: ``open_runtime``, ``Runtime``, ``AgentHandle``.

Orchestration code (and the HTTP gateway, a thin client of the same API)::

    from actors import open_runtime

    async with open_runtime(model="kvmem-default") as rt:
        result = await rt.agent("alice").send([{"role": "user", "content": "Hi"}])
        print(result.reply, result.usage.tier, result.usage.tokens_reused)

        async with rt.agent("bob").stream(messages, max_tokens=64) as stream:
            async for delta in stream:
                print(delta, end="")
        print(stream.result.finish_reason)

Beside a server: when another process (``kvmem serve``) holds the home, ``open_runtime``
yields an :class:`actors.owner_client.OwnerClient` instead, whose handles are the same and
whose turns run in the server; the code above runs unchanged.

Streaming: ``handle.stream(...)`` returns a :class:`TurnStream`. Use it as an
async context manager and iterate it; after the loop ``stream.result`` holds
the :class:`TurnResult` (the concatenated deltas equal ``result.reply``).
Plain ``async for delta in handle.stream(...)`` works too, but only the
``async with`` form stops the generation when the loop is left early with
``break``.

Cancellation: cancelling the consumer (or leaving the ``async with``)
closes the turn's reply channel; the GPU actor notices before its next unit
of work, takes the sequence out of the batch and parks it. The agent's cache
then keeps **the partial turn**: every token whose KV was computed — the
prompt (or the part of it prefilled so far) and the reply tokens generated
before the cancel. Text, token ids, offsets and KV always agree, so the next
turn matches it like any other cache: a client that sends the partial reply
back extends it; one that drops it reuses the cache up to where the texts
differ (PARTIAL match), or starts cold when too little is common. A turn
still queued behind the agent's earlier turns is dropped without running.

Lifecycle: :func:`open_runtime` starts, in order, the cache store and the GPU
actor (which loads the model) with ``nursery.start``; agent actors start on
first use and stop after ``idle_timeout_s``. Leaving the ``async with``
normally closes the mailboxes in reverse order (agents, GPU, store); the store writes every dirty cache before it stops. On
SIGINT or SIGTERM (handled when running in the main thread) the runtime is
cancelled, the store still flushes (shielded), and then ``KeyboardInterrupt``
(SIGINT) or ``SystemExit(128 + signum)`` (SIGTERM) is raised from the
``async with``.
"""

from __future__ import annotations

import itertools
import signal
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, overload

import msgspec
import trio

from actors.agent import AgentActor
from actors.cache_store import CacheStoreActor, StoreStats
from actors.prefetch import restorer
from actors.client import AgentHandle, TurnFailedError, TurnStream, raise_failed
from actors.control import serve_control
from actors.gpu import GPUActor
from actors.mailbox import ask
from actors.messages_agent import AgentInbox, ForgetAgent, chat_messages
from actors.messages_common import Failed
from actors.messages_gpu import Chat, CountReply, CountTokens, GpuInbox
from actors.messages_store import (
    AgentRecord,
    Flush,
    FlushReply,
    ListAgents,
    ListReply,
    StoreInbox,
    MeasureUsage,
    UsageReply,
    Used,
)
from actors.metrics import (
    GpuEvent,
    GpuStats,
    HotCacheBytes,
    MetricsSnapshot,
    RunningTurn,
    RuntimeMetrics,
)
from actors.model_slot import RegistryStats
from actors.signals import watch_signals
from actors.turn_log import TurnRecord
from runtime.backend import profile_setting
from runtime.config import Config
from runtime.plan.engine import Engine
from runtime.plan.tools import ToolChoice
from runtime.identity import AgentKey, check_agent_id, local_id, safe_agent_dirname, tenant_of
from runtime.plan.hot_tier import HotTier
from runtime.plan.kv_manager import KVCacheManager
from runtime.persist import CacheDirectory
from runtime.errors import DirectoryInUseError
from runtime.persist.owner import OwnerLock
from runtime.persist.tenants import TenantDirectories

if TYPE_CHECKING:
    from actors.owner_client import OwnerClient

_MAILBOX_SIZE = 16

__all__ = ["open_runtime", "Runtime", "AgentHandle", "TurnStream", "RuntimeStats", "TurnFailedError"]


class RuntimeStats(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``Runtime.stats()`` reports: counters, GPU, store, the model loaded (``registry``)."""

    agents: int
    metrics: MetricsSnapshot
    gpu: GpuStats
    store: StoreStats
    registry: RegistryStats


class Runtime:
    """A running kvmem: hands out :class:`AgentHandle` objects and reports statistics.

    Created by :func:`open_runtime`; not meant to be constructed directly.
    """

    def __init__(
        self,
        *,
        gpu: GPUActor,
        store: CacheStoreActor,
        gpu_mailbox: trio.MemorySendChannel[GpuInbox],
        agents_nursery: trio.Nursery,
        metrics: RuntimeMetrics,
        idle_timeout_s: float,
        durable: bool = True,
    ) -> None:
        self._gpu = gpu
        self._store = store
        self._gpu_mailbox = gpu_mailbox
        self._agents_nursery = agents_nursery
        self._metrics = metrics
        self._idle_timeout_s = idle_timeout_s
        self._durable = durable
        self._agents: dict[str, tuple[trio.MemorySendChannel[AgentInbox], AgentActor]] = {}
        self._request_ids = itertools.count(1)
        self._closed = False
        self._busy = 0  # messages delivered to agents and not yet handled
        self._idle = trio.Event()
        self._idle.set()

    def agent(self, agent_id: str, *, share_prefix: bool = True) -> AgentHandle:
        """A handle on agent ``agent_id`` (its actor starts on the first request).

        ``agent_id`` may name a tenant (:func:`runtime.identity.namespaced`): its
        caches, its prefix sharing and its listing then stay within that tenant.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
        """
        agent_id = check_agent_id(agent_id)
        return AgentHandle(self, agent_id, share_prefix=share_prefix)

    def start(self, agent_id: str) -> None:
        """Start the actor of a checked ``agent_id`` now, before its first turn arrives.

        A gateway that counts a tenant's agents against a limit counts this one from
        here on (:meth:`live_agents`), so requests racing to create agents cannot all pass.
        """
        self._mailbox(agent_id)

    def stats(self) -> RuntimeStats:
        """Counters, histograms, batch size, queues, pools and memory, right now."""
        return RuntimeStats(
            agents=len(self._agents),
            metrics=self._metrics.snapshot(),
            gpu=self._gpu.statistics(),
            store=self._store.statistics(self._gpu.hot_stats(), owed=self._gpu.owed_copies()),
            registry=self._gpu.model_statistics(),
        )

    def running_turns(self) -> list[RunningTurn]:
        """The turns on the GPU right now (queued, prefilling or decoding), each with its progress."""
        return self._gpu.running_turns()

    def live_agents(self) -> list[str]:
        """Ids of the agents whose actor is running."""
        return sorted(self._agents)

    def hot_caches(self) -> list[HotCacheBytes]:
        """Each cache in the hot tier (one per agent and model) and the RAM it holds, least recently used first."""
        return [HotCacheBytes.of(entry.agent_id, entry.parked) for entry in self._gpu.hot_entries()]

    def last_turn(self, agent_id: str) -> TurnRecord | None:
        """The agent's last turn since the runtime opened (None: none yet, or forgotten since)."""
        return self._metrics.turns.last(agent_id)

    def recent_turns(self, since: float) -> list[TurnRecord]:
        """The turns that ended at ``since`` (Unix time) or later, oldest first (the last few thousand at most)."""
        return self._metrics.turns.recent(since)

    def gpu_events(self) -> list[GpuEvent]:
        """The runtime's work log, in order: the GPU actor's work, Python's collector runs and the cache store's
        saves and reads (empty unless the runtime was opened with ``trace=True``)."""
        return list(self._gpu.events or ())

    async def flush(self) -> int:
        """Write every dirty hot cache to disk now; returns how many were written."""
        reply: FlushReply = await ask(self._gpu_mailbox, lambda r: Flush(reply=r))
        if isinstance(reply, Failed):
            raise_failed(reply)
        return reply.written

    async def list_agents(self, agent_id: str | None = None, *, tenant: str | None = None) -> list[AgentRecord]:
        """Caches in the hot tier, on disk or (with a shared tier) in Redis, one per agent and model, sorted by agent id.

        Only ``agent_id``'s when given, else every agent of ``tenant`` (None: the
        agents without a tenant). An agent's first record is the cache it used last
        (see :class:`actors.messages_store.ListAgents`).
        """
        if self._closed:
            raise TurnFailedError("Closed", "the runtime is closed")
        reply: ListReply = await ask(self._gpu_mailbox,
                                     lambda r: ListAgents(agent_id=agent_id, tenant=tenant, reply=r))
        if isinstance(reply, Failed):
            raise_failed(reply)
        return list(reply.agents)

    async def tenant_usage(self, tenant: str) -> Used:
        """What ``tenant`` holds: its agents (with a cache or a running actor) as folder names, its disk bytes."""
        if self._closed:
            raise TurnFailedError("Closed", "the runtime is closed")
        reply: UsageReply = await ask(self._gpu_mailbox, lambda r: MeasureUsage(tenant=tenant, reply=r))
        if isinstance(reply, Failed):
            raise_failed(reply)
        live = {safe_agent_dirname(local_id(a)) for a in self._agents if tenant_of(a) == tenant}
        return Used(agent_dirs=reply.agent_dirs | live, disk_bytes=reply.disk_bytes)

    async def count_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | ToolChoice | None = None,
        model: str | None = None,
    ) -> int:
        """Tokens of the prompt ``messages`` render to with ``model``'s template (what a cold turn prefills).

        Raises:
            ValueError: bad messages, an unconfigured model, tools the template cannot
                render, or a ``tool_choice`` the model cannot honour.
            ModelError: the model cannot be loaded.
        """
        chat = chat_messages(messages, system)
        if not chat:
            raise ValueError("no messages")
        if self._closed:
            raise TurnFailedError("Closed", "the runtime is closed")
        counted: CountReply = await ask(
            self._gpu_mailbox,
            lambda r: CountTokens(model=model, chat=Chat(
                messages=chat, tools=[dict(t) for t in tools or ()] or None,
                tool_choice=ToolChoice.of(tool_choice) if tools else None), reply=r),
        )
        if isinstance(counted, Failed):
            raise_failed(counted)
        return counted.num_tokens

    # -- what handles call ----------------------------------------------------------

    def new_request_id(self) -> int:
        """A fresh request id (handles number their turns with it)."""
        return next(self._request_ids)

    async def wait_idle(self) -> None:
        """Wait until every request handed to an agent has been handled.

        Includes turns whose client left (their cancellation has been processed
        and their partial cache handed to the store). Saves are write-behind:
        use :meth:`flush` to wait for the disk.
        """
        while self._busy:
            await self._idle.wait()

    async def deliver(self, agent_id: str, message: AgentInbox) -> None:
        """Hand ``message`` to the agent's actor, starting it if needed (what handles send through)."""
        # No checkpoint between looking the mailbox up and sending (see _retire).
        mailbox = self._mailbox(agent_id)
        if isinstance(message, ForgetAgent):
            self._metrics.turns.forget(agent_id)
        self._busy += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        try:
            await mailbox.send(message)
        except BaseException as exc:
            self._handled()
            if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError)):
                raise TurnFailedError("Closed", "the runtime is closed") from None
            raise

    def _handled(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    def _mailbox(self, agent_id: str) -> trio.MemorySendChannel[AgentInbox]:
        if self._closed:
            raise TurnFailedError("Closed", "the runtime is closed")
        entry = self._agents.get(agent_id)
        if entry is None:
            send, receive = trio.open_memory_channel[AgentInbox](0)
            actor = AgentActor(
                agent_id,
                receive,
                gpu=self._gpu_mailbox.clone(),
                metrics=self._metrics,
                idle_timeout_s=self._idle_timeout_s,
                retire=self._retire,
                handled=self._handled,
                durable=self._durable,
            )
            entry = self._agents[agent_id] = (send, actor)
            self._agents_nursery.start_soon(actor.run, name=f"agent {agent_id}")
        return entry[0]

    def _retire(self, actor: AgentActor) -> bool:
        entry = self._agents.get(actor.agent_id)
        if entry is None or entry[1] is not actor:
            return True
        stats = actor.inbox.statistics()
        if stats.current_buffer_used or stats.tasks_waiting_send:
            return False
        del self._agents[actor.agent_id]
        entry[0].close()
        return True

    def _close(self) -> None:
        self._closed = True
        for send, _actor in self._agents.values():
            send.close()
        self._agents.clear()


def single_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception ``group`` holds, however deeply nested (None: more than one)."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None


class _SignalState:
    signum: int | None = None


_Opened = AbstractAsyncContextManager["Runtime | OwnerClient"]


@overload
def open_runtime(config: Config | None = None, *, through_owner: Literal[False], engine: Engine | None = None,
                 directory: CacheDirectory | None = None, trace: bool = False, handle_signals: bool = True,
                 preload: bool = True, **overrides: Any) -> AbstractAsyncContextManager[Runtime]: ...


@overload
def open_runtime(config: Config | None = None, *, through_owner: bool = True, engine: Engine | None = None,
                 directory: CacheDirectory | None = None, trace: bool = False, handle_signals: bool = True,
                 preload: bool = True, **overrides: Any) -> _Opened: ...


def open_runtime(
    config: Config | None = None,
    *,
    through_owner: bool = True,
    engine: Engine | None = None,
    directory: CacheDirectory | None = None,
    trace: bool = False,
    handle_signals: bool = True,
    preload: bool = True,
    **overrides: Any,
) -> _Opened:
    """Start kvmem's actors, load the default model, and yield a :class:`Runtime`; or, when another
    process's runtime holds the home (``kvmem serve``), yield an :class:`actors.owner_client.OwnerClient`
    that runs every turn there.

    ``open_runtime(load_config(...))`` at an edge that reads flags and the
    environment; ``open_runtime(model="tiny-llama", home=tmp, kv_bits=4)`` in
    Python (the defaults of :class:`runtime.config.Config` plus the overrides).

    Beside a server the same program runs unchanged: ``rt.agent(id)`` gives the same handles, whose
    turns run in the server's runtime, on its caches, and come back streamed as they would here
    (why this, and what differs: :mod:`actors.owner_client`).

    Args:
        config: the settings (default ``Config()``: defaults only; nothing is
            read from the environment here but the home folder's default).
        through_owner: when another process holds the home, act through it (False: refuse,
            as ``kvmem serve`` does). A runtime given its own ``engine`` or ``directory`` is
            always this process's own, so it is refused too.
        engine: the engine to run (default: MLX, configured from ``config``); tests pass ``FakeEngine``.
        directory: the warm tier (default: ``config``'s cache folder; a distributed rank 0 passes its own).
        trace: record the GPU actor's work log (``Runtime.gpu_events``).
        handle_signals: on SIGINT/SIGTERM flush and exit (main thread only).
        preload: load the default model before yielding (False: at the first
            request that needs it; listing or forgetting agents needs none).
        **overrides: :class:`runtime.config.Config` fields applied on top of ``config``.

    Raises:
        TypeError: an override that is not a setting, or a ``config`` that is not a ``Config``.
        runtime.config.ConfigError: a bad setting (the message names it).
        ModelError: the default model does not load (with ``preload``).
        runtime.errors.DirectoryInUseError: another live runtime (this process's or
            another's) holds the cache directory and cannot be acted through (it has no
            control socket, or does not answer, or ``through_owner`` is off); its message
            names the holder's pid.
    """
    return _open_runtime(config, through_owner=through_owner, engine=engine, directory=directory, trace=trace,
                         handle_signals=handle_signals, preload=preload, **overrides)


@asynccontextmanager
async def _open_runtime(
    config: Config | None,
    *,
    through_owner: bool,
    engine: Engine | None,
    directory: CacheDirectory | None,
    trace: bool,
    handle_signals: bool,
    preload: bool,
    **overrides: Any,
) -> AsyncIterator[Runtime | OwnerClient]:
    if config is not None and not isinstance(config, Config):
        raise TypeError(
            f"open_runtime() takes a Config, not {type(config).__name__}; pass settings by name, e.g. model=..."
        )
    config = (config or Config()).replace(**overrides)  # validates the whole configuration
    caches = config.caches_path
    # One owner per cache directory, taken before anything in it is read, cleaned or written
    # (runtime.persist.owner); released by the kernel if this process dies.
    try:
        lock = OwnerLock(caches if directory is None else directory.root)
    except DirectoryInUseError as held:
        if not through_owner or engine is not None or directory is not None or held.holder is None \
                or held.holder.control is None:
            raise
        from actors.owner_client import open_owner_client

        async with open_owner_client(held, model=config.model) as client:
            yield client
        return
    try:
        async with _owned_runtime(config, lock, engine=engine, directory=directory, trace=trace,
                                  handle_signals=handle_signals, preload=preload) as rt:
            yield rt
    finally:
        lock.release()


@asynccontextmanager
async def _owned_runtime(
    config: Config,
    lock: OwnerLock,
    *,
    engine: Engine | None,
    directory: CacheDirectory | None,
    trace: bool,
    handle_signals: bool,
    preload: bool,
) -> AsyncIterator[Runtime]:
    """:func:`open_runtime` once ``lock`` is held."""
    caches, fsync = config.caches_path, config.fsync

    def open_directory() -> CacheDirectory:
        return CacheDirectory(caches, fsync=fsync, owner=lock)  # the owner cleans a killed save's temp files

    if directory is None:
        directory = await trio.to_thread.run_sync(open_directory)
    remote = None
    if config.store is not None:
        from runtime.persist.remote import (
            RemoteTier,  # the redis client: only when a shared tier is set
        )

        remote = RemoteTier(config.store, directory.paths, lease_ms=int(config.lease_s * 1000))
    if engine is None:
        from runtime.execution.mlx_engine import (
            MlxEngine,  # imports mlx: only when the real engine runs
        )

        engine = MlxEngine.from_config(config)
    metrics = RuntimeMetrics()
    store_send, store_receive = trio.open_memory_channel[StoreInbox](_MAILBOX_SIZE)
    gpu_send, gpu_receive = trio.open_memory_channel[GpuInbox](_MAILBOX_SIZE)
    hot_mb = profile_setting("hot_budget_mb", config.hot_budget_mb, engine.profile)
    hot = HotTier(hot_budget_bytes=int(hot_mb * 2**20))
    events: deque[GpuEvent] | None = deque(maxlen=100_000) if trace else None  # one log, the actors' work in order
    # What the disk holds, listed once: the read-ahead picks from it, and the GPU actor knows which agents it
    # need not ask the store about (a new agent's first turn). Not with a shared tier: every turn asks there.
    listing = None if remote is not None else await trio.to_thread.run_sync(
        TenantDirectories(directory).list_all_agents)
    store = CacheStoreActor(store_receive, directory=directory, remote=remote,
                            prefetch_bytes=int(config.prefetch_mb * 2**20), listing=listing, events=events)
    gpu = GPUActor(
        gpu_receive,
        engine=engine,
        manager=KVCacheManager(),
        budget_bytes=int(profile_setting("budget_mb", config.budget_mb, engine.profile) * 2**20),
        max_batch=config.max_batch,
        prefill_chunk=config.prefill_chunk,
        decode_run_steps=int(profile_setting("decode_run_steps", config.decode_run_steps, engine.profile)),
        events=events,
        store=store_send.clone(),  # the store's one sender (with this function's, closed first)
        hot=hot,
        leases=remote is not None,
        stored=None if listing is None else frozenset(AgentKey(e.agent_id, e.model_tag) for e in listing),
        default_model=config.model,
        models=config.models,
        idle_unload_s=config.model_idle_s,
        preload=preload,
    )
    signals = _SignalState()
    watcher_scope = trio.CancelScope()
    try:
        async with trio.open_nursery() as nursery:
            try:
                if handle_signals and threading.current_thread() is threading.main_thread():
                    cancel_runtime = nursery.cancel_scope

                    def on_signal(signum: int) -> None:
                        signals.signum = signum
                        cancel_runtime.cancel()

                    await nursery.start(partial(watch_signals, on_signal, stop=watcher_scope))
                await nursery.start(store.run)
                await nursery.start(gpu.run)
                if preload and store.prefetch is not None:  # the newest caches ready before anyone is served
                    await store.prefetch.prepare(restorer(gpu_send))
                async with trio.open_nursery() as agents_nursery:
                    rt = Runtime(
                        gpu=gpu,
                        store=store,
                        gpu_mailbox=gpu_send,
                        agents_nursery=agents_nursery,
                        metrics=metrics,
                        idle_timeout_s=config.idle_timeout_s,
                        durable=config.durable,
                    )
                    control_scope = trio.CancelScope()

                    async def control(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                        with control_scope:
                            await serve_control(rt, lock, task_status=task_status)

                    await nursery.start(control)  # other processes on this home forget and list through it
                    try:
                        yield rt
                    finally:
                        control_scope.cancel()
                        rt._close()
                watcher_scope.cancel()
            finally:
                # Agents are gone (or the runtime was cancelled): stop the rest in reverse start order. The store
                # takes the GPU actor's last saves until it closes its end too.
                gpu_send.close()
                store_send.close()
    except BaseExceptionGroup as group:
        # The caller's body runs inside our nurseries: give its error back unwrapped.
        only = single_exception(group)
        if only is None:
            raise
        raise only from None
    finally:
        if remote is not None:
            remote.close()
    if signals.signum == signal.SIGINT:
        raise KeyboardInterrupt
    if signals.signum is not None:
        raise SystemExit(128 + signals.signum)

