"""The GPU actor's policy: admission by block budget, prefill order, and each loop iteration as a value.

Plain Python: imports neither trio nor mlx (a test enforces it). The GPU actor
asks :meth:`Scheduler.admit` which requests start now, then :meth:`Scheduler.step`
for the rest of the iteration (:class:`Step`: who joins the batch first and in one
pass, which donors' blocks a prefill starts from, whether the batch steps, which
sequence gets the next prefill chunk and of what size) and carries it out; this
module never runs the model.

Memory model. A running sequence needs ``need_tokens`` = its context after
prefill plus ``max_tokens`` (reserved up front, so a sequence admitted never
runs out of memory and nothing is ever preempted or swapped). Sequences decode
in one left-padded batch (mlx-lm's ``BatchKVCache``), where every row is as
long as the longest, so the footprint of ``n`` running sequences is
``n × max(blocks of each)`` blocks, not the sum. The scheduler keeps that
footprint in a :class:`runtime.plan.block_pool.BlockPool`: each sequence reserves its
own blocks and a padding owner holds the difference. Admission is strict FIFO:
the oldest waiting request is admitted as soon as the footprint with it fits
and the batch is below ``max_batch``; later requests wait behind it (no
starvation). A request that could not fit even alone is rejected.

Prefill runs one chunk per loop iteration, and the running batch decodes one
token between any two chunks. Short prefills (a new turn on a cached conversation:
at most :data:`JOIN_AHEAD_TOKENS`) instead all run before the step, so they join
it now; those that start from nobody's blocks and give none run in one pass. The chunk goes to the admitted sequence with the
least prefill left, less an aging credit: the prefill tokens run for other
sequences since it was admitted. Shortest-first minimizes the mean time to first
token, so a 200-token prompt does not wait behind a 16K-token one; the credit
bounds how long any prompt waits (no starvation: once others have had as many
tokens as it has left, it goes first); and arrivals of equal length finish in
arrival order instead of all finishing late together (round-robin), so the
first of several agents that arrive at once with a shared system prompt is done
before the others start and they can share its prefix
(:meth:`runtime.execution.mlx_engine.MlxEngine.prefill`). Where their questions differ in
length, the credit alone would hand the next chunk to a prompt a few tokens shorter than the
one started; so a turn that would start from a prompt being prefilled waits for it
(:meth:`Donors.awaits_donor`), and starts from its blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from runtime.plan.block_pool import BlockPool, PoolStats
from runtime.plan.turn_plan import FromShared
from runtime.errors import BudgetExceededError
from runtime.spec import BLOCK_TOKENS

__all__ = ["Scheduler", "Step", "Donors", "SchedulerStats", "JOIN_AHEAD_TOKENS"]

_PADDING = "(batch padding)"

JOIN_AHEAD_TOKENS = 64
"""Requests with at most this many prompt tokens to prefill (a new turn on a cached
conversation) prefill before the next decode step instead of one chunk per step.
A step reads the weights once for all rows, so an agent that joins now rides along
in every following step instead of waiting through several of them; the stall this
causes is a few short chunks. Longer prompts keep one chunk per step."""


class Donors(Protocol):
    """Who may start from another turn's blocks (:class:`runtime.plan.kv_manager.KVCacheManager`)."""

    def donor_for(self, request_id: int) -> FromShared | None:
        """Before a turn's first prefill chunk: the donor blocks it would start from (a question: nothing changes)."""
        ...

    def wants_donor(self, request_id: int, starting: Collection[int] = ()) -> bool:
        """Whether turns waiting to prefill would start from this turn's prompt once it is prefilled
        (``starting``: turns whose first chunk runs in this step, counted as started)."""
        ...

    def awaits_donor(self, request_id: int, prefilling: Iterable[int], starting: Collection[int] = ()) -> bool:
        """Whether this turn, not yet started, would start from more of one of ``prefilling``'s started prompts
        (or ``starting``'s) than it reuses: it waits for that prompt instead of taking the next chunk."""
        ...

    def late_donor(self, request_id: int, decoding: Iterable[int]) -> int | None:
        """The decoding turn whose prompt this new turn would start from, parked for nobody yet (None: none)."""
        ...

    def held_back(self, request_id: int) -> bool:
        """Whether this turn is a sample of a request whose first sample has not parked its prompt yet: it
        neither joins nor prefills until then."""
        ...


@dataclass(frozen=True)
class Step:
    """One loop iteration after admission, decided before any of it runs.

    Attributes:
        join: prefills short enough to join the batch before this step (one chunk each, in this order).
        together: those of ``join`` prefilled in one pass (at least two; none starts from or gives blocks).
        adopt: the donor blocks a prefill's first chunk starts from, per request.
        park: decoding turns whose prompt is parked now, for turns just admitted that would start from it
            (:meth:`runtime.plan.kv_manager.KVCacheManager.late_donor`); a step that parks does nothing else,
            so the next one's first chunks may start from what it parked.
        starts: the prefills whose first chunk may run in this step (``join``, then ``prefill``): the GPU actor
            records each one's start, with its ``adopt`` (:meth:`runtime.plan.kv_manager.KVCacheManager.start_prefill`).
        donate: the prefills (of ``join`` and ``prefill``) that park their prompt for turns
            waiting to start from it, if their prefill completes in this step.
        decode: the rows the batch steps: those decoding, and those that join first.
        prefill: the sequence that gets one chunk after the step (None: none left).
        chunk: that chunk's tokens (None: the engine's adaptive size).
        decode_steps: how many decode steps may run back to back in one job on the model's thread
            (the scheduler's ``decode_run_steps`` when no prefill is left to interleave, else one: a
            long prompt gets a chunk between any two steps). Each step's tokens still stream at
            once; the run ends early when a row finishes or a message reaches the GPU actor, so a
            new turn joins one step later at most. Without runs every token pays a round trip
            between the model's thread and trio, during which the thread idles.
    """

    join: tuple[int, ...] = ()
    together: tuple[int, ...] = ()
    adopt: Mapping[int, FromShared] = field(default_factory=dict)
    starts: tuple[int, ...] = ()
    park: tuple[int, ...] = ()
    donate: frozenset[int] = frozenset()
    decode: tuple[int, ...] = ()
    prefill: int | None = None
    chunk: int | None = None
    decode_steps: int = 1


@dataclass(frozen=True)
class SchedulerStats:
    """Queue lengths and the pool; ``waiting_for_memory`` counts waiting requests that
    the budget (not the arrival order) holds back right now."""

    waiting: int
    waiting_for_memory: int
    prefilling: int
    decoding: int
    admitted_total: int
    memory_waits_total: int
    pool: PoolStats


@dataclass
class _Entry:
    request_id: int
    blocks: int
    waited_for_memory: bool = False
    to_prefill: int | None = None  # unknown until the engine has built the sequence
    prompt_to_prefill: int | None = None  # the whole prefill, as first reported (what decides joining ahead)
    credit: int = 0  # prefill tokens run for other sequences since admission (aging)


class Scheduler:
    """Admission and prefill order for the GPU actor.

    Args:
        budget_bytes: memory for running sequences' KV.
        token_bytes: bytes of one token's KV while running.
        sequence_bytes: fixed bytes per running sequence (sliding windows).
        max_batch: most sequences admitted at once.
        prefill_chunk: tokens per prefill chunk (None: the engine's adaptive size).
        decode_run_steps: decode steps that may run back to back when no prefill is waiting
            (the setting of that name; 1: one step per loop iteration).
    """

    def __init__(
        self,
        *,
        budget_bytes: int,
        token_bytes: int,
        sequence_bytes: int = 0,
        max_batch: int = 32,
        prefill_chunk: int | None = None,
        decode_run_steps: int = 1,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {max_batch}")
        if decode_run_steps < 1:
            raise ValueError(f"decode_run_steps must be >= 1, not {decode_run_steps}")
        self._block_bytes = max(1, token_bytes) * BLOCK_TOKENS
        self.pool = BlockPool(budget_bytes=budget_bytes, bytes_per_block=self._block_bytes)
        self._extra_blocks = -(-sequence_bytes // self._block_bytes)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.decode_run_steps = decode_run_steps
        self._waiting: deque[_Entry] = deque()
        self._running: dict[int, _Entry] = {}
        self._prefilling: list[int] = []  # admission order
        self._decoding: set[int] = set()
        self._admitted_total = 0
        self._memory_waits_total = 0
        self._blocked_by_memory = False

    # -- bookkeeping ----------------------------------------------------------

    def blocks_for(self, need_tokens: int) -> int:
        """Blocks one sequence of ``need_tokens`` tokens occupies in the batch."""
        return self.pool.blocks_for(max(1, need_tokens)) + self._extra_blocks

    def submit(self, request_id: int, need_tokens: int) -> None:
        """Queue a request that will hold ``need_tokens`` tokens at most.

        Raises:
            BudgetExceededError: it could not run even alone in the whole budget.
        """
        blocks = self.blocks_for(need_tokens)
        if blocks > self.pool.total_blocks:
            raise BudgetExceededError(
                f"a request of {need_tokens} tokens needs {blocks} blocks of "
                f"{self._block_bytes} bytes; the budget holds {self.pool.total_blocks}"
            )
        self._waiting.append(_Entry(request_id, blocks))

    def _footprint(self, blocks: list[int]) -> int:
        return len(blocks) * max(blocks, default=0)

    def _reserve_padding(self) -> None:
        own = [entry.blocks for entry in self._running.values()]
        self.pool.release(_PADDING)
        padding = self._footprint(own) - sum(own)
        if padding:
            self.pool.reserve(_PADDING, padding * BLOCK_TOKENS)

    def _admit(self) -> list[int]:
        admitted = []
        self._blocked_by_memory = False
        while self._waiting:
            head = self._waiting[0]
            own = [entry.blocks for entry in self._running.values()] + [head.blocks]
            if len(own) > self.max_batch:
                break
            if self._footprint(own) > self.pool.total_blocks:
                self._blocked_by_memory = True
                if not head.waited_for_memory:
                    head.waited_for_memory = True
                    self._memory_waits_total += 1
                break
            self._waiting.popleft()
            self.pool.release(_PADDING)
            self.pool.reserve(str(head.request_id), head.blocks * BLOCK_TOKENS)
            self._running[head.request_id] = head
            self._reserve_padding()
            self._prefilling.append(head.request_id)
            self._admitted_total += 1
            admitted.append(head.request_id)
        return admitted

    def admit(self) -> tuple[int, ...]:
        """The waiting requests that start now (FIFO, as the budget and ``max_batch`` allow)."""
        return tuple(self._admit())

    def step(self, donors: Donors, admitted: Iterable[int] = ()) -> Step:
        """The rest of this loop iteration (see :class:`Step`), once the ``admitted`` requests have started: a
        value; neither the scheduler nor ``donors`` changes (the GPU actor carries it out)."""
        decoding = self.decoding()
        park = tuple(dict.fromkeys(d for r in admitted if (d := donors.late_donor(r, decoding)) is not None))
        if park:
            return Step(park=park)
        limit = JOIN_AHEAD_TOKENS if self.prefill_chunk is None else min(JOIN_AHEAD_TOKENS, self.prefill_chunk)
        # A short prompt joins; the last chunk of a long one does not (one chunk between two steps).
        join = tuple(r for r in self._prefilling
                     if (n := self._running[r].prompt_to_prefill) is not None and n <= limit and not donors.held_back(r))
        adopt = {r: shared for r in join if (shared := donors.donor_for(r)) is not None}
        together = tuple(r for r in join if r not in adopt and not donors.wants_donor(r, join))
        # A turn that would start from a prompt being prefilled waits for it (the first of several agents that
        # arrive together with one system prompt prefills it; the others start from its blocks).
        awaiting = tuple(r for r in self._prefilling
                         if r not in join and donors.awaits_donor(r, self._prefilling, join))
        prefill = self.next_prefill(exclude=join + awaiting)
        if prefill is not None and (shared := donors.donor_for(prefill)) is not None:
            adopt[prefill] = shared
        starts = (*join, *([prefill] if prefill is not None else []))
        # Asked again, now that the next prefill starts too: a prompt only it wanted is not parked.
        donate = frozenset(r for r in starts if r not in together and donors.wants_donor(r, starts))
        return Step(join=join, together=together if len(together) >= 2 else (), adopt=adopt, starts=starts,
                    donate=donate,
                    decode=tuple(sorted({*self._decoding, *join})), prefill=prefill, chunk=self.prefill_chunk,
                    decode_steps=self.decode_run_steps if prefill is None else 1)

    def next_prefill(self, exclude: tuple[int, ...] = ()) -> int | None:
        """The prefilling sequence that gets the next chunk: least prefill left less
        its aging credit, then the earliest admitted (see the module docstring)."""
        best: tuple[float, int] | None = None
        for rank, request_id in enumerate(self._prefilling):
            if request_id in exclude:
                continue
            entry = self._running[request_id]
            left = float("inf") if entry.to_prefill is None else entry.to_prefill - entry.credit
            if best is None or left < best[0]:
                best = (left, rank)
        return None if best is None else self._prefilling[best[1]]

    def to_prefill(self, request_id: int, tokens: int) -> None:
        """``request_id`` has ``tokens`` prompt tokens left to prefill (after its start
        or a chunk); the tokens it ran since the last report age every other prefill."""
        entry = self._running.get(request_id)
        if entry is None:
            return
        ran = max(0, entry.to_prefill - tokens) if entry.to_prefill is not None else 0
        entry.to_prefill = tokens
        if entry.prompt_to_prefill is None:
            entry.prompt_to_prefill = tokens
        for other in self._prefilling:
            if other != request_id:
                self._running[other].credit += ran

    def prefilled(self, request_id: int) -> None:
        """``request_id`` finished prefill and joined the batch."""
        self._prefilling.remove(request_id)
        self._decoding.add(request_id)

    def finished(self, request_id: int) -> None:
        """``request_id`` left (finished, cancelled or failed) from wherever it was."""
        self._waiting = deque(e for e in self._waiting if e.request_id != request_id)
        if request_id in self._prefilling:
            self._prefilling.remove(request_id)
        self._decoding.discard(request_id)
        if self._running.pop(request_id, None) is not None:
            self.pool.release(str(request_id))
            self._reserve_padding()

    def is_waiting(self, request_id: int) -> bool:
        return any(e.request_id == request_id for e in self._waiting)

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._running)

    def running(self) -> list[int]:
        return list(self._running)

    def decoding(self) -> list[int]:
        return sorted(self._decoding)

    def prefilling(self) -> list[int]:
        return list(self._prefilling)

    def waiting(self) -> list[int]:
        return [e.request_id for e in self._waiting]

    def stats(self) -> SchedulerStats:
        held_by_memory = len(self._waiting) if self._blocked_by_memory else 0
        return SchedulerStats(
            waiting=len(self._waiting),
            waiting_for_memory=held_by_memory,
            prefilling=len(self._prefilling),
            decoding=len(self._decoding),
            admitted_total=self._admitted_total,
            memory_waits_total=self._memory_waits_total,
            pool=self.pool.stats(),
        )
