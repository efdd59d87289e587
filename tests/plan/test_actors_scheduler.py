"""The GPU actor's policy (runtime.plan.scheduler) and the message contracts, without trio or MLX work."""

from __future__ import annotations

import typing

import msgspec
import pytest

import runtime  # noqa: F401  (OpenBLAS before mlx)
from runtime.plan.scheduler import JOIN_AHEAD_TOKENS, Scheduler, Step
from runtime.plan.turn_plan import FromShared
from runtime.errors import BudgetExceededError
from runtime.spec import BLOCK_TOKENS

TOKEN_BYTES = 1024  # one 256-token block = 256 KiB
BLOCK = TOKEN_BYTES * BLOCK_TOKENS


def _sched(blocks: int, **kw) -> Scheduler:
    return Scheduler(budget_bytes=blocks * BLOCK, token_bytes=TOKEN_BYTES, **kw)


def test_admission_is_fifo_and_waits_for_memory_instead_of_failing():
    s = _sched(4)
    for rid in (1, 2, 3):
        s.submit(rid, 2 * BLOCK_TOKENS)  # two blocks each
    assert s.admit() == (1, 2)
    stats = s.stats()
    assert stats.waiting == 1 and stats.waiting_for_memory == 1 and stats.memory_waits_total == 1
    assert stats.pool.used_blocks == 4
    s.finished(1)
    assert s.admit() == (3,)
    assert s.stats().waiting_for_memory == 0


def test_batch_footprint_counts_left_padding_to_the_longest_sequence():
    s = _sched(8)
    s.submit(1, 4 * BLOCK_TOKENS)  # 4 blocks
    s.submit(2, 10)  # 1 block, but padded to 4 in the batch
    s.submit(3, 10)
    assert s.admit() == (1, 2)  # 2 x 4 = 8 blocks; a third row would need 12
    assert s.stats().pool.used_blocks == 8
    s.finished(1)  # the long one leaves: rows shrink to 1 block
    assert s.admit() == (3,)
    assert s.stats().pool.used_blocks == 2


def test_request_larger_than_the_whole_budget_is_rejected():
    s = _sched(2)
    with pytest.raises(BudgetExceededError):
        s.submit(1, 3 * BLOCK_TOKENS)


def test_max_batch_caps_admission():
    s = _sched(100, max_batch=2)
    for rid in range(5):
        s.submit(rid, 10)
    assert len(s.admit()) == 2
    assert s.stats().waiting_for_memory == 0  # held back by the batch cap, not memory


def _prefill_order(s: Scheduler, chunk: int, rounds: int) -> list[int]:
    """Run ``rounds`` chunks of ``chunk`` tokens as the GPU actor would, recording who got each."""
    order = []
    for _ in range(rounds):
        rid = s.next_prefill()
        assert rid is not None
        order.append(rid)
        left = s._running[rid].to_prefill - chunk
        s.to_prefill(rid, max(0, left))
        if left <= 0:
            s.prefilled(rid)
    return order


def test_shortest_prefill_goes_first_so_a_long_prompt_cannot_block_a_short_one():
    s = _sched(1000)
    s.submit(1, 16_000)
    s.submit(2, 200)
    s.admit()  # admits both
    s.to_prefill(1, 16_000)
    s.to_prefill(2, 200)
    assert _prefill_order(s, 256, 2) == [2, 1]
    s.admit()
    step = s.step(NO_DONORS)
    assert step.prefill == 1 and step.decode == (2,)


def test_equal_prefills_finish_in_arrival_order_not_all_late_together():
    s = _sched(1000)
    for rid in (1, 2, 3):
        s.submit(rid, 1000)
    s.admit()
    for rid in (1, 2, 3):
        s.to_prefill(rid, 768)
    assert _prefill_order(s, 256, 9) == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_aging_bounds_the_wait_of_a_long_prefill_behind_a_stream_of_short_ones():
    s = _sched(1000)
    s.submit(1, 1024)
    s.admit()
    s.to_prefill(1, 1024)
    order = []
    for rid in range(2, 12):  # a new 256-token prompt arrives before every chunk
        s.submit(rid, 256)
        s.admit()
        s.to_prefill(rid, 256)
        order += _prefill_order(s, 256, 1)
    # Shortest-first alone would serve only the short ones; the long one has waited
    # once the others have run as many tokens as it has left.
    assert order.count(1) == 4 and order.index(1) <= 5


def test_a_sequence_not_yet_started_waits_for_one_that_has_reported_its_prefill():
    s = _sched(1000)
    s.submit(1, 500)
    s.submit(2, 500)
    s.admit()
    s.to_prefill(2, 500)
    assert s.next_prefill() == 2


def test_sequence_bytes_are_charged_per_sequence():
    s = Scheduler(budget_bytes=4 * BLOCK, token_bytes=TOKEN_BYTES, sequence_bytes=BLOCK)
    assert s.blocks_for(10) == 2


def _inboxes():
    from actors.messages_agent import AgentInbox
    from actors.messages_gpu import GpuInbox
    from actors.messages_store import StoreInbox
    from runtime.plan.turn_plan import CacheSource

    return [AgentInbox, GpuInbox, StoreInbox, CacheSource]


@pytest.mark.parametrize("inbox", _inboxes(), ids=lambda u: "|".join(t.__name__ for t in typing.get_args(u)))
def test_mailbox_messages_are_frozen_tagged_keyword_only_structs(inbox):
    for cls in typing.get_args(inbox):
        assert issubclass(cls, msgspec.Struct)
        config = cls.__struct_config__
        assert config.frozen and config.tag == cls.__name__
        fields = msgspec.structs.fields(cls)
        if fields:
            with pytest.raises(TypeError):
                cls(*[None] * len(fields))  # keyword-only


class _Donors:
    """A cache manager's answers, scripted: who starts from a donor's blocks, who would give them."""

    def __init__(self, adopt: dict[int, FromShared] | None = None, wanted: set[int] | None = None,
                 awaiting: set[int] | None = None) -> None:
        self._adopt = dict(adopt or {})
        self._wanted = wanted or set()
        self._awaiting = awaiting or set()
        self.asked: list[int] = []

    def donor_for(self, request_id: int) -> FromShared | None:
        self.asked.append(request_id)
        return self._adopt.get(request_id)

    def wants_donor(self, request_id: int, starting: object = ()) -> bool:
        return request_id in self._wanted

    def awaits_donor(self, request_id: int, prefilling: object, starting: object = ()) -> bool:
        return request_id in self._awaiting

    def late_donor(self, request_id: int, decoding: object) -> int | None:
        return None

    def held_back(self, request_id: int) -> bool:
        return False


NO_DONORS = _Donors()


def _prefilling(s: Scheduler, sizes: dict[int, int]) -> None:
    for rid, n in sizes.items():
        s.submit(rid, n + 16)
    s.admit()
    for rid, n in sizes.items():
        s.to_prefill(rid, n)


def test_a_step_joins_every_short_prefill_before_decoding_and_gives_the_long_one_the_next_chunk() -> None:
    s = _sched(1000)
    _prefilling(s, {1: 2000, 2: 30, 3: JOIN_AHEAD_TOKENS, 4: JOIN_AHEAD_TOKENS + 1})
    step = s.step(_Donors())
    assert step.join == (2, 3) and step.together == (2, 3)
    assert step.decode == (2, 3)  # they join the batch before it steps
    assert step.prefill == 4 and step.chunk is None  # the least left of the others


def test_a_step_with_one_short_prefill_runs_it_alone_and_a_configured_chunk_caps_joining() -> None:
    s = _sched(1000, prefill_chunk=16)
    _prefilling(s, {1: 10, 2: 40})
    step = s.step(_Donors())
    assert step.join == (1,) and step.together == ()  # one pass needs two rows
    assert step.prefill == 2 and step.chunk == 16  # 40 > one chunk: it does not join ahead


def test_donors_keep_a_prefill_out_of_the_shared_pass() -> None:
    s = _sched(1000)
    _prefilling(s, {1: 20, 2: 20, 3: 20, 4: 900})
    blocks = FromShared(parked=object(), reuse_tokens=256, donor="d")  # type: ignore[arg-type]
    donors = _Donors(adopt={1: blocks, 4: blocks}, wanted={2})
    step = s.step(donors)
    assert step.join == (1, 2, 3)
    assert step.together == ()  # 1 starts from a donor, 2 gives one: 3 alone is not a pass
    assert step.adopt == {1: blocks, 4: blocks} and step.prefill == 4
    assert step.donate == {2}  # parks its prompt for the others once prefilled
    assert donors.asked == [1, 2, 3, 4]  # each turn's first chunk is asked about once


def test_a_prefill_that_awaits_a_donor_does_not_take_the_next_chunk() -> None:
    s = _sched(1000)
    _prefilling(s, {1: 600, 2: 598})
    s.to_prefill(1, 88)  # 1 ran its first chunk of 512: 2's aging credit now puts it first
    assert s.step(_Donors()).prefill == 2
    assert s.step(_Donors(awaiting={2})).prefill == 1  # 2 waits for 1's prompt instead


def test_the_tail_of_a_long_prefill_does_not_join_ahead() -> None:
    s = _sched(1000)
    _prefilling(s, {1: 300})
    s.to_prefill(1, 44)  # after one chunk of 256
    assert s.step(_Donors()) == Step(prefill=1, starts=(1,))  # one chunk, then the batch steps again


def test_a_step_with_nothing_to_prefill_only_decodes() -> None:
    s = _sched(1000)
    _prefilling(s, {1: 20})
    s.prefilled(1)
    assert s.step(_Donors()) == Step(decode=(1,))


def test_with_nothing_to_prefill_the_batch_may_run_several_steps_back_to_back() -> None:
    s = _sched(1000, decode_run_steps=16)
    _prefilling(s, {1: 20})
    s.prefilled(1)
    assert s.step(_Donors()) == Step(decode=(1,), decode_steps=16)
    with pytest.raises(ValueError, match="decode_run_steps"):
        _sched(1000, decode_run_steps=0)


def test_the_batch_steps_once_between_two_chunks_of_a_long_prefill() -> None:
    s = _sched(1000, decode_run_steps=16)
    _prefilling(s, {1: 20, 2: 300})
    s.prefilled(1)
    s.to_prefill(2, 300)
    step = s.step(_Donors())
    assert step.decode == (1,) and step.prefill == 2 and step.decode_steps == 1


def test_a_step_is_a_value_asking_changes_nothing_and_the_gpu_actor_records_its_starts() -> None:
    """Issue 60: the scheduler returns the whole step and changes nothing, not even the planner it asks
    (a turn's adoption used to be recorded as it was asked); the GPU actor records each start it carries out."""
    from runtime.plan.kv_manager import KVCacheManager
    from runtime.spec import BLOCK_TOKENS as TOKENS

    system = [7] * (2 * TOKENS + 10)
    planner = KVCacheManager()
    planner.begin(1, agent_id="a", model_tag="m", token_ids=[*system, 1], tokens_reused=0, share_prefix=True)
    planner.begin(2, agent_id="b", model_tag="m", token_ids=[*system, 2], tokens_reused=0, share_prefix=True)
    s = _sched(64)
    _prefilling(s, {1: len(system) + 1, 2: len(system) + 1})
    first = s.step(planner)
    assert s.step(planner) == first  # asked again, the same answer
    assert not planner.awaits_donor(2, s.prefilling())  # nothing recorded: 1 has not started for the planner
    assert first.starts == (first.prefill,) and first.prefill == 1 and not first.adopt
    assert first.donate == frozenset({1})  # 2 would start from 1's prompt: 1 parks it once prefilled
    for request_id in first.starts:
        planner.start_prefill(request_id, first.adopt.get(request_id))
    # Recorded: 1 started, so 2 now waits for its prompt instead of prefilling the same blocks.
    assert planner.awaits_donor(2, s.prefilling())
    assert s.step(planner).prefill == 1


def test_a_step_that_parks_a_decoding_turns_prompt_for_a_new_turn_does_only_that() -> None:
    """A turn admitted while another with its system prompt decodes starts from that prompt, parked from the
    batch row first: the step says which (``park``, asked for the admitted turns only) and does nothing else,
    so the new turn's first chunk, in the next step, may start from it."""

    class Late(_Donors):
        def late_donor(self, request_id: int, decoding: object) -> int | None:
            return 1 if request_id == 2 else None

    s = _sched(64)
    _prefilling(s, {1: 10})
    s.prefilled(1)
    _prefilling(s, {2: 40})
    assert s.step(Late(), admitted=(2,)) == Step(park=(1,))
    step = s.step(Late())  # the next pass: nothing newly admitted
    assert step.park == () and step.join == (2,) and step.decode == (1, 2)
