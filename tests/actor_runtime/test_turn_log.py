"""The runtime's turn log (``actors/turn_log.py``): each agent's last turn and the live figures of recent turns.

What the operator page shows per agent and as live figures: a turn is attributed to the
agent whose actor ran it (the supervisor's task-local id), the log is bounded, a forgotten
agent's last turn goes, and the figures (rates, exact TTFT percentiles, hit rates, the
chart's steps) are what the turns say. The runtime part runs on the fake engine (no MLX).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import runtime  # noqa: F401
from actors import open_runtime
from actors.messages_common import TurnUsage
from actors.metrics import HotCacheBytes, RuntimeMetrics
from actors.messages_common import TurnUsage
from actors.turn_log import Percentiles, TurnLog, TurnRecord, live_figures
from fake_engine import FakeEngine


def _turn(at: float, *, agent: str | None = "a", tier: str = "hot", generated: int = 10, ttft: float = 50.0,
          reused: int = 100, prefilled: int = 20) -> TurnRecord:
    usage = TurnUsage(tokens_reused=reused, tokens_prefilled=prefilled, tokens_generated=generated, tier=tier,
                      match="extend", queue_wait_ms=1.0, ttft_ms=ttft, decode_tps=0.0)
    return TurnRecord(agent_id=agent, at=at, finish_reason="stop", usage=usage)


def test_the_log_keeps_each_agents_last_turn_within_its_bounds() -> None:
    log = TurnLog(max_agents=2, max_recent=3, clock=lambda: 0.0)
    for i, agent in enumerate(["a", "b", "a", "c", None]):
        log.record(_turn(float(i), agent=agent))
    last_a = log.last("a")
    assert last_a is not None and last_a.at == 2.0  # a's latest, and a was active after b
    assert log.last("b") is None  # the least recently active agent went first
    assert log.last("c") is not None
    assert [t.at for t in log.recent(0.0)] == [2.0, 3.0, 4.0]  # only the last three turns
    assert [t.at for t in log.recent(3.0)] == [3.0, 4.0]
    log.forget("a")
    assert log.last("a") is None


def test_percentiles_are_nearest_rank_over_the_samples() -> None:
    assert Percentiles.of([]) is None
    p = Percentiles.of(float(v) for v in range(1, 101))
    assert p == Percentiles(p50=50.0, p90=90.0, p99=99.0)
    one = Percentiles.of([7.5])
    assert one == Percentiles(p50=7.5, p90=7.5, p99=7.5)


def test_live_figures_count_the_window_and_step_the_last_minutes() -> None:
    now = 1002.0
    turns = [
        _turn(800.0, tier="cold", ttft=900.0),  # outside the 60 s window, inside the 5 minute series
        _turn(950.0, tier="hot", ttft=10.0, generated=30),
        _turn(951.0, tier="warm", ttft=20.0, generated=30, reused=0, prefilled=100),
        _turn(1001.0, tier="cold", ttft=40.0, generated=0),  # no token: no TTFT sample; in the step under way
    ]
    figures = live_figures(turns, now=now, window_s=60.0, history_s=300.0, step_s=5.0)
    assert figures.turns == 3 and figures.window_s == 60.0
    assert figures.turns_per_s == pytest.approx(3 / 60, abs=1e-4)
    assert figures.tokens_per_s == pytest.approx(60 / 60, abs=1e-3)
    assert figures.ttft_ms == Percentiles(p50=10.0, p90=20.0, p99=20.0)
    assert figures.hit_rate["hot"] == pytest.approx(1 / 3, abs=1e-4) and figures.hit_rate["remote"] == 0.0
    assert figures.reused_fraction == pytest.approx(200 / 340, abs=1e-4)
    assert len(figures.series) == 60 and figures.series[-1].at == 995.0  # the step 1000-1005 is not over
    assert figures.series[-1].turns_per_s == 0.0
    by_start = {p.at: p for p in figures.series}
    assert by_start[800.0].turns_per_s == pytest.approx(0.2) and by_start[800.0].ttft_p50_ms == 900.0
    assert by_start[950.0].turns_per_s == pytest.approx(0.4) and by_start[950.0].tokens_per_s == pytest.approx(12.0)
    assert by_start[955.0].turns_per_s == 0.0 and by_start[955.0].ttft_p50_ms is None


def test_live_figures_divide_by_the_uptime_while_it_is_shorter_than_the_window() -> None:
    figures = live_figures([_turn(95.0), _turn(99.0)], now=100.0, started_at=90.0, window_s=60.0)
    assert figures.window_s == 10.0 and figures.turns_per_s == pytest.approx(0.2)
    empty = live_figures([], now=100.0)
    assert empty.turns == 0 and empty.ttft_ms is None and empty.reused_fraction is None


def test_a_turn_is_kept_as_the_agent_named_s_last() -> None:
    metrics = RuntimeMetrics()
    for agent_id in ("a", "b", "a"):
        metrics.turn_done(agent_id=agent_id, finish_reason="stop", usage=TurnUsage(
            tokens_reused=0, tokens_prefilled=5, tokens_generated=2, tier="cold", match="empty", ttft_ms=3.0,
            queue_wait_ms=1.0, decode_tps=0.0))
    assert metrics.turns.last("a") is not None and metrics.turns.last("b") is not None
    assert len(metrics.turns.recent(0.0)) == 3 and metrics.completed == 3


def _parked(*, held: bool) -> Any:
    """A parked cache as the store holds it: plain attributes (the MLX engine's keep a float ``resident``)."""
    return SimpleNamespace(model_tag="m", nbytes=1000, resident=SimpleNamespace(held=held, nbytes=8000))


def test_hot_cache_bytes_count_the_float_kept_beside_a_cache_only_while_it_is_held() -> None:
    assert HotCacheBytes.of("a", _parked(held=True)) == HotCacheBytes(agent_id="a", model_tag="m", q4_bytes=1000,
                                                                       float_bytes=8000)
    assert HotCacheBytes.of("a", _parked(held=False)).float_bytes == 0  # its turn took the buffers
    assert HotCacheBytes.of("a", SimpleNamespace(model_tag="m", nbytes=10)).float_bytes == 0  # the fake engine's


async def test_the_runtime_reports_each_agents_last_turn_and_hot_bytes_and_forgets_them(tmp_path: Path) -> None:
    async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(), fsync=False,
                            handle_signals=False) as rt:
        first = await rt.agent("ada").send([{"role": "user", "content": "hello there"}], max_tokens=4)
        second = await rt.agent("bob").send([{"role": "user", "content": "hi"}], max_tokens=3)
        last = rt.last_turn("ada")
        assert last is not None and last.agent_id == "ada"
        assert last.usage == first.usage and last.usage.tokens_generated == 4  # the record the turn reported
        assert [t.agent_id for t in rt.recent_turns(0.0)] == ["ada", "bob"]
        assert rt.last_turn("bob") is not None and second.usage.tokens_generated == 3
        hot = {h.agent_id: h for h in rt.hot_caches()}
        assert set(hot) == {"ada", "bob"} and hot["ada"].q4_bytes > 0 and hot["ada"].float_bytes == 0
        assert await rt.agent("ada").forget()
        assert rt.last_turn("ada") is None and rt.last_turn("bob") is not None
        assert {h.agent_id for h in rt.hot_caches()} == {"bob"}
