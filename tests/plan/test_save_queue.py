"""The write-behind policy as pure code (runtime/plan/save_queue.py): order, supersession, loads first, retry, waiters,
and when the GPU actor makes the host copy a save needs."""

from __future__ import annotations

import pytest

from runtime.plan.save_queue import (
    COPY_IDLE_GRACE_S,
    COPY_OVERDUE_S,
    COPY_STARVED_S,
    SaveQueue,
    WaitForLoads,
    WaitUntil,
    Write,
    copy_wait,
    next_copy,
)


def _queue() -> SaveQueue[str, str, str]:
    return SaveQueue(retry_delay_s=5.0)


def test_caches_are_written_oldest_first_and_a_newer_one_supersedes_an_unwritten_one() -> None:
    q = _queue()
    q.put("a", "a1")
    q.put("b", "b1")
    q.put("a", "a2")  # supersedes a1, and moves behind b
    assert q.keys() == ["b", "a"]
    assert q.next(0.0, loads_waiting=False) == Write("b")
    assert q.get("a").item == "a2" and len(q) == 2


def test_a_durable_cache_goes_first_and_nothing_is_written_while_a_load_waits() -> None:
    q = _queue()
    q.put("a", "a1")
    q.put("b", "b1", waiter="client-b")
    assert q.next(0.0, loads_waiting=False) == Write("b")
    assert q.next(0.0, loads_waiting=True) == WaitForLoads()
    assert _queue().next(0.0, loads_waiting=True) is None  # nothing dirty: nothing to wait for


def test_a_save_answers_the_waiters_of_its_cache_and_older_ones_not_newer() -> None:
    q = _queue()
    first = q.put("a", "a1", waiter="w1")
    q.put("a", "a2", waiter="w2")  # arrives while a1's save runs
    assert q.answered("a", first) == ["w1"]
    assert q.settle("a", first, saved=True, retry=False, now=0.0) is False  # superseded: still dirty
    second = q.get("a")
    assert second is not None and second.item == "a2"
    assert q.answered("a", second) == ["w2"]
    assert q.settle("a", second, saved=True, retry=False, now=0.0) is True
    assert len(q) == 0 and q.next(0.0, loads_waiting=False) is None


def test_a_save_that_may_recover_keeps_its_cache_dirty_behind_the_others_and_pauses_writing() -> None:
    q = _queue()
    a = q.put("a", "a1")
    q.put("b", "b1")
    assert q.settle("a", a, saved=False, retry=True, now=100.0) is False
    assert q.keys() == ["b", "a"]
    assert q.next(101.0, loads_waiting=False) == WaitUntil(105.0)  # the pause ends at 105
    assert q.next(105.0, loads_waiting=False) == Write("b")
    q.settle("a", a, saved=False, retry=True, now=110.0)
    q.put("c", "c1")  # a new turn ends the pause: the disk may have recovered
    assert q.next(111.0, loads_waiting=False) == Write("b")


def test_a_save_that_cannot_succeed_drops_its_cache() -> None:
    q = _queue()
    a = q.put("a", "bad")
    assert q.settle("a", a, saved=False, retry=False, now=0.0) is True
    assert "a" not in q and q.next(0.0, loads_waiting=False) is None


def test_dropping_keys_returns_their_waiters_and_keeps_the_rest() -> None:
    q: SaveQueue[tuple[str, str], str, str] = SaveQueue()
    q.put(("x", "m1"), "x1", waiter="wx")
    q.put(("y", "m1"), "y1", waiter="wy")
    q.put(("x", "m2"), "x2")
    assert q.drop(lambda key: key[0] == "x") == ["wx"]
    assert q.keys() == [("y", "m1")]
    assert q.drop(lambda key: True) == ["wy"] and len(q) == 0


def test_an_idle_gpu_makes_the_copies_it_owes_after_a_grace_and_a_busy_one_only_those_wanted_or_overdue() -> None:
    now = 100.0
    fresh, graced, old = now - COPY_IDLE_GRACE_S / 2, now - 2 * COPY_IDLE_GRACE_S, now - 2 * COPY_OVERDUE_S
    assert next_copy([], now=now, idle=True) is None
    assert next_copy([(False, fresh)], now=now, idle=True) is None  # a reply's next turn may come first
    assert next_copy([(False, graced), (False, graced)], now=now, idle=True) == 0  # idle: oldest first
    assert next_copy([(False, graced), (False, graced)], now=now, idle=False) is None  # busy: never between steps
    assert next_copy([(False, fresh), (True, fresh)], now=now, idle=False) == 1  # a durable turn or a flush
    assert next_copy([(False, fresh), (False, old)], now=now, idle=False) == 1  # overdue
    # A prefill under way: an overdue copy waits for its end (its host read would wait for the chunks
    # launched before it), a wanted one does not, and a starved one stops waiting.
    starved = now - 2 * COPY_STARVED_S
    assert next_copy([(False, fresh), (False, old)], now=now, idle=False, prefilling=True) is None
    assert next_copy([(False, old), (True, fresh)], now=now, idle=False, prefilling=True) == 1
    assert next_copy([(False, old), (False, starved)], now=now, idle=False, prefilling=True) == 1
    # How long an idle actor waits for a message first: until the first copy's grace ends; none owed: forever.
    assert copy_wait([], now=now) == float("inf")
    assert copy_wait([(False, fresh), (False, now)], now=now) == pytest.approx(COPY_IDLE_GRACE_S / 2)
    assert copy_wait([(False, fresh), (True, now)], now=now) == 0.0
