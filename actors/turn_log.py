"""The runtime's recent turns: each agent's last one, and the last minutes' for live figures.

:meth:`actors.metrics.RuntimeMetrics.turn_done` records every finished turn here as a
:class:`TurnRecord`, with the agent the agent actor names.

Both stores are bounded: the last turn of at most ``max_agents`` agents (the least recently
active dropped first) and the last ``max_recent`` turns. :func:`live_figures` reads a window of
them as rates, exact TTFT percentiles, the share of turns per cache tier, and a series of
fixed steps for a chart of the last minutes. Plain Python on the trio thread: nothing here
awaits, blocks or locks.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

import msgspec

from actors.messages_common import TurnUsage

__all__ = [
    "TIERS",
    "TurnRecord",
    "TurnLog",
    "Percentiles",
    "LivePoint",
    "LiveFigures",
    "live_figures",
]

TIERS = ("hot", "warm", "remote", "shared", "cold")
"""Where a turn's starting cache came from (cold: nowhere), in the order figures list them."""


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished (or cancelled) turn, as the runtime's counters saw it: who, when, why it ended, and its
    usage, the one record every API reports (:class:`actors.messages_common.TurnUsage`: tier, tokens, TTFT).

    Attributes:
        agent_id: the agent (None: a turn run outside an agent actor's task).
        at: when it ended (Unix time).
    """

    agent_id: str | None
    at: float
    finish_reason: str
    usage: TurnUsage

    @classmethod
    def of(cls, agent_id: str | None, at: float, finish_reason: str, usage: TurnUsage) -> TurnRecord:
        """The record of a turn that ended with ``usage``."""
        return cls(agent_id=agent_id, at=at, finish_reason=finish_reason, usage=usage)


class TurnLog:
    """The last turn of each agent and the most recent turns (see the module docstring).

    Args:
        max_agents: agents whose last turn is kept.
        max_recent: turns kept for :func:`live_figures`.
        clock: Unix time (tests pass their own).
    """

    def __init__(self, *, max_agents: int = 10_000, max_recent: int = 8192,
                 clock: Callable[[], float] = time.time) -> None:
        self._last: OrderedDict[str, TurnRecord] = OrderedDict()  # least recently active first
        self._recent: deque[TurnRecord] = deque(maxlen=max_recent)
        self._max_agents = max_agents
        self.clock = clock
        self.started_at = clock()

    def record(self, turn: TurnRecord) -> None:
        """Keep ``turn`` as its agent's last and among the recent ones."""
        self._recent.append(turn)
        if turn.agent_id is None:
            return
        self._last.pop(turn.agent_id, None)
        self._last[turn.agent_id] = turn
        while len(self._last) > self._max_agents:
            self._last.popitem(last=False)

    def last(self, agent_id: str) -> TurnRecord | None:
        """The agent's last turn since the runtime opened (None: none, or dropped by the bound)."""
        return self._last.get(agent_id)

    def forget(self, agent_id: str) -> None:
        """Drop the agent's last turn (it was forgotten: nothing of it is shown again)."""
        self._last.pop(agent_id, None)

    def recent(self, since: float) -> list[TurnRecord]:
        """The kept turns that ended at ``since`` or later, oldest first."""
        out: list[TurnRecord] = []
        for turn in reversed(self._recent):
            if turn.at < since:
                break
            out.append(turn)
        out.reverse()
        return out


class Percentiles(msgspec.Struct, frozen=True, kw_only=True):
    """Nearest-rank percentiles of a set of samples (milliseconds)."""

    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, samples: Iterable[float]) -> Percentiles | None:
        """The percentiles of ``samples`` (None: there are none)."""
        ordered = sorted(samples)
        if not ordered:
            return None

        def rank(q: float) -> float:
            return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)

        return cls(p50=rank(0.50), p90=rank(0.90), p99=rank(0.99))


class LivePoint(msgspec.Struct, frozen=True, kw_only=True):
    """One step of the chart: the turns that ended in ``[at, at + step_s)``.

    ``ttft_p50_ms`` is None for a step without a turn that generated a token.
    """

    at: float
    turns_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float | None


class LiveFigures(msgspec.Struct, frozen=True, kw_only=True):
    """The runtime's recent activity.

    Attributes:
        window_s: the span the rates cover (the window, or the uptime when shorter).
        turns: turns that ended within it.
        turns_per_s / tokens_per_s: those turns, and the tokens they generated, per second.
        prompt_tokens_per_s: the prompt tokens they reused or prefilled, per second.
        ttft_ms: percentiles of their time to first token (None: no turn generated a token).
        hit_rate: the share of those turns by tier (:data:`TIERS`); every tier but ``cold`` is a hit.
        reused_fraction: the share of their prompt tokens served from a cache.
        step_s / series: the last minutes in steps of ``step_s``, oldest first (the step under
            way is left out until it ends).
    """

    window_s: float
    turns: int
    turns_per_s: float
    tokens_per_s: float
    prompt_tokens_per_s: float
    ttft_ms: Percentiles | None
    hit_rate: dict[str, float]
    reused_fraction: float | None
    step_s: float
    series: tuple[LivePoint, ...]


def _ttfts(turns: Iterable[TurnRecord]) -> list[float]:
    return [t.usage.ttft_ms for t in turns if t.usage.tokens_generated]


def live_figures(turns: Sequence[TurnRecord], *, now: float, started_at: float | None = None,
                 window_s: float = 60.0, history_s: float = 300.0, step_s: float = 5.0) -> LiveFigures:
    """Figures of the ``turns`` (oldest first, e.g. :meth:`TurnLog.recent`) as of ``now``.

    Args:
        started_at: when counting began (the rates divide by the uptime while it is shorter than the window).
        window_s: the span of the rates, percentiles and hit rates.
        history_s / step_s: the span and the step of the series.
    """
    span = window_s if started_at is None else max(1.0, min(window_s, now - started_at))
    window = [t for t in turns if now - span <= t.at <= now]
    prompt = sum(t.usage.tokens_reused + t.usage.tokens_prefilled for t in window)
    counts = dict.fromkeys(TIERS, 0)
    for t in window:
        counts[t.usage.tier] = counts.get(t.usage.tier, 0) + 1
    end = math.floor(now / step_s) * step_s  # the last whole step ends here
    steps = max(1, round(history_s / step_s))
    first = end - steps * step_s
    buckets: list[list[TurnRecord]] = [[] for _ in range(steps)]
    for t in turns:
        if first <= t.at < end:
            buckets[min(steps - 1, int((t.at - first) // step_s))].append(t)
    series = tuple(
        LivePoint(
            at=first + i * step_s,
            turns_per_s=round(len(b) / step_s, 4),
            tokens_per_s=round(sum(t.usage.tokens_generated for t in b) / step_s, 3),
            ttft_p50_ms=p.p50 if (p := Percentiles.of(_ttfts(b))) is not None else None,
        )
        for i, b in enumerate(buckets)
    )
    return LiveFigures(
        window_s=round(span, 3),
        turns=len(window),
        turns_per_s=round(len(window) / span, 4),
        tokens_per_s=round(sum(t.usage.tokens_generated for t in window) / span, 3),
        prompt_tokens_per_s=round(prompt / span, 3),
        ttft_ms=Percentiles.of(_ttfts(window)),
        hit_rate={tier: round(n / len(window), 4) if window else 0.0 for tier, n in counts.items()},
        reused_fraction=round(sum(t.usage.tokens_reused for t in window) / prompt, 4) if prompt else None,
        step_s=step_s,
        series=series,
    )
