"""Runtime-wide counters, fixed-bucket histograms and the GPU actor's statistics, ready for a Prometheus endpoint.

:class:`RuntimeMetrics` is updated by the agent actors as turns complete and
read through ``Runtime.stats()``. Histograms use fixed buckets (upper bounds in
milliseconds, cumulative counts, like Prometheus ``_bucket{le=...}``). Each turn is
also kept in a bounded :class:`actors.turn_log.TurnLog` (its agent's last turn, the
last minutes' turns), which the operator page reads. Everything runs on the trio
thread; nothing here blocks or awaits.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable

import msgspec

from actors.messages_common import TurnUsage
from actors.turn_log import TurnLog, TurnRecord
from runtime.plan.block_pool import PoolStats
from runtime.plan.engine import StepTiming
from runtime.plan.turn_plan import ParkedView

__all__ = [
    "TTFT_BUCKETS_MS",
    "QUEUE_WAIT_BUCKETS_MS",
    "Histogram",
    "HistogramSnapshot",
    "MetricsSnapshot",
    "RuntimeMetrics",
    "MemorySnapshot",
    "GpuStats",
    "GpuEvent",
    "BESIDE_THE_WORK",
    "units_of_work",
    "RunningTurn",
    "HotCacheBytes",
]

TTFT_BUCKETS_MS: tuple[float, ...] = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, math.inf)
QUEUE_WAIT_BUCKETS_MS: tuple[float, ...] = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000, 30000, math.inf)


class _Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    pass


class HistogramSnapshot(_Snapshot, frozen=True, kw_only=True):
    """``counts[i]`` observations were ``<= buckets[i]`` (cumulative)."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


class Histogram:
    """A fixed-bucket histogram (upper bounds ascending, the last one ``inf``)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        if list(buckets) != sorted(buckets) or buckets[-1] != math.inf:
            raise ValueError("buckets must ascend and end with inf")
        self.buckets = buckets
        self._counts = [0] * len(buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.buckets, value)] += 1
        self._sum += value
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for c in self._counts:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(buckets=self.buckets, counts=tuple(cumulative), count=self._count, sum=self._sum)


class MetricsSnapshot(_Snapshot, frozen=True, kw_only=True):
    """Counters since the runtime opened."""

    requests: int
    completed: int
    cancelled: int
    failed: int
    tokens_reused: int
    tokens_prefilled: int
    tokens_generated: int
    hits: dict[str, int]
    ttft_ms: HistogramSnapshot
    queue_wait_ms: HistogramSnapshot


class RuntimeMetrics:
    """Request counters, token counters, cache hits by tier, TTFT and queue-wait histograms.

    ``turns`` keeps each agent's last turn and the recent turns (:mod:`actors.turn_log`).
    """

    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.tokens_reused = 0
        self.tokens_prefilled = 0
        self.tokens_generated = 0
        self.hits: dict[str, int] = {"hot": 0, "warm": 0, "remote": 0, "shared": 0, "cold": 0}
        self.ttft = Histogram(TTFT_BUCKETS_MS)
        self.queue_wait = Histogram(QUEUE_WAIT_BUCKETS_MS)
        self.turns = TurnLog()

    def request_started(self) -> None:
        self.requests += 1

    def request_failed(self) -> None:
        self.failed += 1

    def turn_done(self, *, agent_id: str, finish_reason: str, usage: TurnUsage) -> None:
        """Count a turn of ``agent_id`` that ended (completed or cancelled) and keep it in :attr:`turns`."""
        self.turns.record(TurnRecord.of(agent_id, self.turns.clock(), finish_reason, usage))
        if finish_reason == "cancelled":
            self.cancelled += 1
        else:
            self.completed += 1
        self.tokens_reused += usage.tokens_reused
        self.tokens_prefilled += usage.tokens_prefilled
        self.tokens_generated += usage.tokens_generated
        self.hits[usage.tier] = self.hits.get(usage.tier, 0) + 1
        if usage.tokens_generated:
            self.ttft.observe(usage.ttft_ms)
        self.queue_wait.observe(usage.queue_wait_ms)

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            requests=self.requests,
            completed=self.completed,
            cancelled=self.cancelled,
            failed=self.failed,
            tokens_reused=self.tokens_reused,
            tokens_prefilled=self.tokens_prefilled,
            tokens_generated=self.tokens_generated,
            hits=dict(self.hits),
            ttft_ms=self.ttft.snapshot(),
            queue_wait_ms=self.queue_wait.snapshot(),
        )


class MemorySnapshot(_Snapshot, frozen=True, kw_only=True):
    """Accelerator memory (``mx.get_active_memory`` / ``mx.get_peak_memory``), bytes.

    ``baseline`` is the active memory before the current model was loaded;
    ``peak`` the peak since then; ``model`` the weights.
    """

    active: int
    peak: int
    baseline: int
    model: int


class RunningTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn on the GPU right now, and how far it got.

    ``phase``: ``queued`` (waiting for admission: memory, batch size),
    ``prefill`` (``tokens_prefilled`` of ``tokens_to_prefill`` done) or
    ``decode`` (``tokens_generated`` of at most ``max_tokens``).
    ``elapsed_ms``: since the client submitted it.
    """

    agent_id: str
    request_id: int
    phase: str
    tokens_reused: int
    tokens_prefilled: int
    tokens_to_prefill: int
    tokens_generated: int
    max_tokens: int
    elapsed_ms: float


class HotCacheBytes(msgspec.Struct, frozen=True, kw_only=True):
    """One cache of the hot tier and the RAM it holds.

    Attributes:
        q4_bytes: the parked (quantized) cache.
        float_bytes: the float KV its last turn left beside it for the next hot turn
            (:mod:`runtime.kv.float_resident`, bounded by ``keep_float_mb``; 0: none kept).
    """

    agent_id: str
    model_tag: str
    q4_bytes: int
    float_bytes: int

    @classmethod
    def of(cls, agent_id: str, parked: ParkedView) -> HotCacheBytes:
        """The bytes of ``parked``, read from its plain attributes."""
        resident = getattr(parked, "resident", None)  # only the MLX engine's caches keep float beside them
        held = resident is not None and bool(getattr(resident, "held", False))
        return cls(agent_id=agent_id, model_tag=parked.model_tag, q4_bytes=int(parked.nbytes),
                   float_bytes=int(getattr(resident, "nbytes", 0)) if held else 0)


class GpuStats(msgspec.Struct, frozen=True, kw_only=True):
    """What the GPU actor is doing: batch size, queues, the admission pool, memory, and each running turn."""

    model: str | None
    model_tag: str | None
    batch_size: int
    prefilling: int
    waiting: int
    waiting_for_memory: int
    admitted_total: int
    memory_waits_total: int
    steps: int
    prefill_chunks: int
    pool: PoolStats
    memory: MemorySnapshot
    turns: tuple[RunningTurn, ...] = ()
    prefix_hits: int = 0  # turns that started from another agent's cache (its hot cache or prompt in flight)


class GpuEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One unit of the runtime's work, recorded when it completed (when tracing): mostly the GPU actor's.

    ``kind``: ``submit`` (the turn reached the GPU actor), ``rendered`` (its chat rendered with the model's
    template, on the text worker's thread), ``planned`` (its prompt matched against the agent's cache, on
    trio's), ``tokenized`` (the rest of its prompt tokenized, on the text worker's: it waits for admission), ``admit`` (sequence built: cache activation),
    ``chunk`` (one prefill chunk), ``step`` (one decode step of the batch; ``request_ids``
    are its members), ``finish`` (left the batch, parked), ``copy`` (a finished turn's host
    copy for its save, made after the turn under the GPU policy), ``run`` (a decode run ended:
    several steps in one job on the model's thread; ``took_ms`` from its start on trio, ``waited_ms``
    from there to the job's start on the model's thread, ``detail`` its steps and why it ended: its
    steps done, its time done, a row finished, or the doorbell and what rang it),
    ``checkout`` (the GPU actor checked the turn's cache out of the store: ``waited_ms`` from the client's
    send to the checkout's start, ``took_ms`` the checkout), ``gc`` (a run of Python's cyclic collector, on any thread: ``generation`` and ``took_ms``; it
    holds the GIL throughout), and the cache store's ``save`` (a cache written: ``took_ms``, ``detail``
    the bytes) and ``read`` (a cache read for a turn: ``took_ms``, ``detail`` its tokens), on its disk
    thread, whose Python parts hold the GIL the model's thread builds its graphs under.

    ``at`` is when it completed (``time.perf_counter``); a step's is taken on the model's thread
    as it ends, and ``timing`` says where a step's or a chunk's time went there
    (:class:`runtime.plan.engine.StepTiming`; None for other kinds, or an engine that does not measure).
    """

    kind: str
    request_ids: tuple[int, ...]
    at: float
    timing: StepTiming | None = None
    generation: int | None = None
    took_ms: float | None = None
    waited_ms: float | None = None
    detail: str = ""


BESIDE_THE_WORK = frozenset({"gc", "save", "read", "run", "checkout", "rendered", "planned"})
"""Trace kinds that are not one of the GPU actor's units of work: Python's collector and the cache store's
disk jobs ran beside it, on other threads, a ``run`` event marks the end of steps already logged, an
agent's ``checkout`` happens before its turn reaches the GPU actor, and a turn's ``rendered`` and ``planned``
split the way to its ``tokenized``, which runs beside the model's work."""


def units_of_work(events: Iterable[GpuEvent]) -> list[GpuEvent]:
    """The GPU actor's units of work in ``events``, in order: the time between two of them is the later one's."""
    return [e for e in events if e.kind not in BESIDE_THE_WORK]
