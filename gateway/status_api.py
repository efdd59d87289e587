"""The runtime as an operator sees it, as JSON: what the operator page (``/ui``) shows.

::

    GET /v1/status          live figures, and for operators the memory picture, the batch now, the totals
    GET /v1/status/agents   every agent of the caller: tier, tokens, RAM and disk bytes, model, last turn

Both need the API key like every other route. ``/v1/status`` reads memory only (cheap
enough to poll every few seconds); ``/v1/status/agents`` lists the caches (the store
reads the cache directory's manifests), so pages poll it less often.

**Who sees what.** Without tenants (one key or none) the caller is the operator. With
tenants (:mod:`gateway.tenants`) a tenant's agents listing holds its agents alone, as
``GET /v1/agents`` does, with its usage against its limits; its live figures count its
own turns only. The memory picture, the batch and the totals concern every tenant, so
only operator tenants get them (``null`` for the others), as only they read ``/metrics``.

**Tiers of the listing**: ``hot`` (a cache in RAM, the hot tier), ``warm`` (on this
disk only), ``remote`` (with a shared tier: Redis holds the only copy, or one newer than
this node's, saved by another node; the agent's next turn here pulls it), ``none`` (a
running actor without a cache yet). A turn's own tier (``last_turn.usage.tier``) also says
``shared`` (started from another agent's prefix) or ``cold``.
"""

from __future__ import annotations

import shutil
import time
from typing import Literal

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.messages_store import AgentRecord
from actors.metrics import MetricsSnapshot, RunningTurn
from actors.turn_log import LiveFigures, TurnRecord, live_figures
from gateway.context import Gateway, tenant_of_request
from gateway.errors import runtime_errors
from gateway.tenants import Tenant
from runtime.backend import profile_setting
from runtime.identity import local_id, tenant_of

__all__ = ["routes", "Status", "AgentStatus", "AgentStatusList", "Gauge", "MemoryPicture", "BatchNow"]

MIB = 2**20

HISTORY_S = 300.0
"""How far back the live figures' series goes (seconds)."""


class Gauge(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes in use against their limit (None: no limit)."""

    used_bytes: int
    limit_bytes: int | None


class MemoryPicture(msgspec.Struct, frozen=True, kw_only=True):
    """Where kvmem's memory goes, each part against its setting.

    Attributes:
        kv_budget: the KV blocks of running sequences (``budget_mb``).
        hot_tier: idle caches kept in RAM (``hot_budget_mb``, per model).
        float_pool: float KV kept beside hot caches for their next turn (``keep_float_mb``).
        prefetch: caches read ahead at start, not yet taken by a turn (``prefetch_mb``).
        disk: the volume holding the cache directory (used of its size).
        accelerator_active / accelerator_peak / model: the accelerator's memory, its peak, the weights.
    """

    kv_budget: Gauge
    hot_tier: Gauge
    float_pool: Gauge
    prefetch: Gauge
    disk: Gauge | None
    accelerator_active: int
    accelerator_peak: int
    model: int


class BatchRow(msgspec.Struct, frozen=True, kw_only=True):
    """A turn on the GPU now; ``turn.agent_id`` as its tenant knows it, ``tenant`` its tenant (None: none)."""

    tenant: str | None
    turn: RunningTurn


class BatchNow(msgspec.Struct, frozen=True, kw_only=True):
    """The GPU actor's work right now.

    Attributes:
        decoding: rows of the decode batch (at most ``max_batch``).
        prefilling: sequences whose prompt is being prefilled.
        queued: turns waiting for admission (the prefill queue).
        waiting_for_memory: of those, the turns waiting for KV memory.
    """

    decoding: int
    max_batch: int
    prefilling: int
    queued: int
    waiting_for_memory: int
    turns: list[BatchRow]


class Caller(msgspec.Struct, frozen=True, kw_only=True):
    """Whom the key names: a tenant (None: no tenants) and whether it may see every tenant's load."""

    tenant: str | None
    operator: bool


class Status(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/status``; ``totals``, ``memory`` and ``batch`` are None for a tenant that is not an operator."""

    object: Literal["status"]
    version: str
    model: str | None
    models: list[str]
    uptime_s: float
    caller: Caller
    live: LiveFigures
    totals: MetricsSnapshot | None
    memory: MemoryPicture | None
    batch: BatchNow | None


class AgentStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One agent as the operator page lists it (see the module docstring for ``tier``).

    Attributes:
        model_tag: the model (and KV format) of the cache it used last.
        ram_bytes: its hot caches (every model's): the Q4 cache and the float kept beside it.
        float_bytes: of ``ram_bytes``, the float KV kept for its next hot turn.
        last_turn: its last turn since the server started (None: none since).
        last_used: when it was last used: its last turn, else its newest save (Unix time).
        running: its turn on the GPU now, with its progress.
    """

    id: str
    tier: Literal["hot", "warm", "remote", "none"]
    model_tag: str | None
    cached_tokens: int
    ram_bytes: int
    float_bytes: int
    disk_bytes: int
    dirty: bool
    live: bool
    last_turn: TurnRecord | None
    last_used: float | None
    running: RunningTurn | None


class TenantUsageReport(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's agents and disk bytes against its limits (None: no limit)."""

    tenant: str
    agents: int
    max_agents: int | None
    disk_bytes: int
    max_disk_bytes: int | None


class AgentStatusList(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/status/agents``: the caller's agents by id, and a tenant's usage (None: no tenants)."""

    object: Literal["list"]
    data: list[AgentStatus]
    usage: TenantUsageReport | None


def _caller(tenant: Tenant | None) -> Caller:
    return Caller(tenant=None if tenant is None else tenant.name, operator=tenant is None or tenant.operator)


def _disk(path: str) -> Gauge | None:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return Gauge(used_bytes=usage.used, limit_bytes=usage.total)


async def _memory(gw: Gateway) -> MemoryPicture:
    stats, config = gw.rt.stats(), gw.config
    pool, profile = stats.gpu.pool, stats.registry.profile
    float_bytes = sum(h.float_bytes for h in gw.rt.hot_caches())
    caches = config.caches_path
    budget_mb = profile_setting("budget_mb", config.budget_mb, profile)
    return MemoryPicture(
        kv_budget=Gauge(used_bytes=pool.used_blocks * pool.bytes_per_block,
                        limit_bytes=pool.budget_bytes or int(budget_mb * MIB)),
        hot_tier=Gauge(used_bytes=stats.store.hot_bytes,
                       limit_bytes=int(profile_setting("hot_budget_mb", config.hot_budget_mb, profile) * MIB)),
        float_pool=Gauge(used_bytes=float_bytes,
                         limit_bytes=int(profile_setting("keep_float_mb", config.keep_float_mb, profile) * MIB)),
        prefetch=Gauge(used_bytes=stats.store.prefetch_held_bytes, limit_bytes=int(config.prefetch_mb * MIB)),
        disk=await trio.to_thread.run_sync(_disk, str(caches)),
        accelerator_active=stats.gpu.memory.active,
        accelerator_peak=stats.gpu.memory.peak,
        model=stats.gpu.memory.model,
    )


def _batch(gw: Gateway) -> BatchNow:
    gpu = gw.rt.stats().gpu
    rows = [BatchRow(tenant=tenant_of(t.agent_id), turn=msgspec.structs.replace(t, agent_id=local_id(t.agent_id)))
            for t in gw.rt.running_turns()]
    return BatchNow(decoding=gpu.batch_size, max_batch=gw.config.max_batch, prefilling=gpu.prefilling,
                    queued=gpu.waiting, waiting_for_memory=gpu.waiting_for_memory, turns=rows)


def _agent(agent_id: str, record: AgentRecord | None, *, live: bool, ram: tuple[int, int],
           last: TurnRecord | None, running: RunningTurn | None) -> AgentStatus:
    public = local_id(agent_id)
    if last is not None:
        last = msgspec.structs.replace(last, agent_id=public)
    if running is not None:
        running = msgspec.structs.replace(running, agent_id=public)
    tier: Literal["hot", "warm", "remote", "none"] = "none"
    if record is not None:
        tier = "remote" if record.remote else "hot" if record.hot else "warm" if record.on_disk else "none"
    times = [t for t in (last.at if last else None, record.updated_at if record else None) if t is not None]
    return AgentStatus(
        id=public, tier=tier, model_tag=record.model_tag if record else None,
        cached_tokens=record.num_tokens if record else 0, ram_bytes=ram[0] + ram[1], float_bytes=ram[1],
        disk_bytes=record.disk_bytes if record else 0, dirty=record.dirty if record else False, live=live,
        last_turn=last, last_used=max(times) if times else None, running=running,
    )


def routes(gw: Gateway, *, version: str) -> list[Route]:
    """The status routes, bound to ``gw``; ``version`` is kvmem's, reported by ``/v1/status``."""

    async def status(request: Request) -> Response:
        """The runtime now: live figures, and for operators the memory picture, the batch and the totals."""
        tenant = tenant_of_request(request)
        caller = _caller(tenant)
        stats = gw.rt.stats()
        now = time.time()
        turns = gw.rt.recent_turns(now - HISTORY_S)
        if not caller.operator:  # a tenant's own turns only
            turns = [t for t in turns if t.agent_id is not None and tenant_of(t.agent_id) == caller.tenant]
        body = Status(
            object="status", version=version, model=stats.registry.model, models=list(gw.models),
            uptime_s=round(now - gw.started_at, 3), caller=caller,
            live=live_figures(turns, now=now, started_at=gw.started_at, history_s=HISTORY_S),
            totals=stats.metrics if caller.operator else None,
            memory=await _memory(gw) if caller.operator else None,
            batch=_batch(gw) if caller.operator else None,
        )
        return gw.json(body, headers={"cache-control": "no-store"})

    async def agents(request: Request) -> Response:
        """Every agent of the caller with its tier, bytes in RAM and on disk, model and last turn."""
        tenant = tenant_of_request(request)
        name = tenant.name if tenant else None
        with runtime_errors():
            records: dict[str, AgentRecord] = {}
            for record in await gw.rt.list_agents(tenant=name):  # an agent's first record is its latest
                records.setdefault(record.agent_id, record)
            used = await gw.rt.tenant_usage(name) if name is not None else None
        live = {a for a in gw.rt.live_agents() if tenant_of(a) == name}
        ram: dict[str, tuple[int, int]] = {}  # (Q4, float) bytes of every model's hot cache
        for cache in gw.rt.hot_caches():
            if tenant_of(cache.agent_id) == name:
                q4, floats = ram.get(cache.agent_id, (0, 0))
                ram[cache.agent_id] = (q4 + cache.q4_bytes, floats + cache.float_bytes)
        running = {t.agent_id: t for t in gw.rt.running_turns()}
        data = [
            _agent(a, records.get(a), live=a in live, ram=ram.get(a, (0, 0)), last=gw.rt.last_turn(a),
                   running=running.get(a))
            for a in sorted(records.keys() | live)
        ]
        usage = None
        if tenant is not None and used is not None:
            max_mb = tenant.limits.max_disk_mb
            usage = TenantUsageReport(tenant=tenant.name, agents=len(used.agent_dirs), max_agents=tenant.limits.max_agents,
                                disk_bytes=used.disk_bytes, max_disk_bytes=int(max_mb * MIB) if max_mb else None)
        return gw.json(AgentStatusList(object="list", data=data, usage=usage), headers={"cache-control": "no-store"})

    return [
        Route("/v1/status", status, methods=["GET"], name="status"),
        Route("/v1/status/agents", agents, methods=["GET"], name="status_agents"),
    ]
