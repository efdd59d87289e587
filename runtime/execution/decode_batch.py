"""The decode batch: sequences that finished prefill, stepping together one token at a time.

Sequences join a :class:`DecodeBatch` (mlx-lm's ``merge``/``extend``), step
together, and leave by ``extract``. It holds one batch cache per layer
(mlx-lm's ``BatchKVCache``/``BatchRotatingKVCache`` for float and sliding
layers, :class:`runtime.kv.q4_cache.BatchQuantizedKVCache` for Q4 layers
under the native attention). Each :meth:`DecodeBatch.step_once` feeds every
member its next input token and samples one token per member;
:meth:`DecodeBatch.remove` extracts a member's cache back into its own
:class:`runtime.kv.kvstate.ActiveKV` so it can be parked. A group prefilled
together (:mod:`runtime.execution.batch_prefill`) joins as the batch cache it already is.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from runtime.cpu import attention as cpu_attention
from runtime.kv.decode_kv import DecodeKVCache
from runtime.kv.float_resident import extract_with_room, row_view
from runtime.reply.grammar import mask_rows
from runtime.cpu.kv_copy import place_buffers
from runtime.execution.pass_clock import PassClock
from runtime.plan.engine import StepTiming
from runtime.kv.q4_cache import (
    BatchDequantizingQuantizedKVCache,
    BatchQuantizedKVCache,
    DequantizingQuantizedKVCache,
    QuantizedKVCache,
)
from runtime.execution.sequence import Sequence
from runtime.execution.shared_prefix import shared_prefix_length

__all__ = ["DecodeBatch", "batch_cache_class", "merge_with_room", "place_cache_rows", "sample_rows"]

_BATCH_CLASSES: dict[type, Any] = {
    KVCache: DecodeKVCache,
    RotatingKVCache: BatchRotatingKVCache,
    QuantizedKVCache: BatchQuantizedKVCache,
    DequantizingQuantizedKVCache: BatchDequantizingQuantizedKVCache,
}


def batch_cache_class(cache: Any) -> Any:
    """The batch cache class that merges caches of ``cache``'s type."""
    try:
        return _BATCH_CLASSES[type(cache)]
    except KeyError:
        raise TypeError(f"no batch cache for {type(cache).__name__}") from None


def merge_with_room(caches: list[Any], extra: int = 1) -> DecodeKVCache:
    """``BatchKVCache.merge`` of float ``KVCache`` rows, into buffers with room for ``extra``
    more tokens, rounded up to the cache's growth step.

    mlx-lm's ``merge`` makes buffers exactly as long as the longest row, so the
    batch's first forward pass grows (copies) every layer again.
    """
    lengths = [int(c.offset) if c.keys is not None else 0 for c in caches]
    longest = max(lengths)
    if longest == 0:
        return DecodeKVCache([0] * len(caches))
    batch = DecodeKVCache([longest - n for n in lengths])
    place_cache_rows(batch, caches, [longest] * len(caches), write_at=longest, room=extra)
    return batch


def place_cache_rows(batch: BatchKVCache, rows: list[Any], ends: list[int], *, write_at: int, room: int) -> None:
    """Fill a new ``batch`` (its left padding already set) with float ``KVCache`` ``rows``.

    Row ``i``'s tokens end at position ``ends[i]``; the batch writes its next tokens at
    ``write_at``, with buffers long enough for ``room`` of them (rounded up to the growth step).
    """
    lengths = [int(c.offset) if c.keys is not None else 0 for c in rows]
    first = next(c for c in rows if c.keys is not None)
    size = -(-(write_at + room) // batch.step) * batch.step
    for name in ("keys", "values"):  # whole buffers: slicing each row would be a graph node more a row
        placed = [(getattr(c, name) if n else None, n, end - n) for c, n, end in zip(rows, lengths, ends, strict=True)]
        setattr(batch, name, place_buffers(placed, size, getattr(first, name)))
    batch.offset += write_at
    batch._idx = write_at


class DecodeBatch:
    """The running batch of sequences that have finished prefill.

    Sequences that :meth:`add` joins wait in ``pending`` until the next
    :meth:`step_once`, which merges all of them in one go: growing the batch
    copies every member's cache, so several joins between two steps cost one
    copy instead of one per join. :meth:`remove` of the last row is a view. With
    ``alone_on_own_caches`` (the GPU policy's) a row alone decodes on its own float
    ``KVCache`` layers, as mlx-lm's ``generate_step`` does, and becomes a batch of
    one when another row joins.

    ``shared`` counts the first tokens every member holds the same keys and
    values for (:mod:`runtime.execution.shared_prefix`), checked whenever members join
    and there are enough of them for the step to use it
    (:data:`runtime.cpu.attention.MIN_SHARED_ROWS`; 0 otherwise); members
    leaving keep it true. Steps attend to those tokens once for all rows.

    **Running one step ahead** (``run_ahead``, the GPU policy's): as mlx-lm's
    ``generate_step`` does, each :meth:`step_once` launches the *next* step from
    the tokens the device has not handed back yet (``mx.async_eval``) before it
    reads them, so the device computes step k+1 while the host detokenizes and
    streams step k. A row that finishes on a token has then been fed it once
    more than it needed: that position's KV lies past the tokens the row parks
    (:meth:`runtime.execution.sequence.Sequence.park` keeps only tokens that went through
    the model), so nothing of it is kept. While a row's next token is forced
    (a tool call's opening) or under a grammar, the batch steps without running ahead.
    """

    def __init__(self, *, shared_prefix_check: bool = True, run_ahead: bool = False,
                 alone_on_own_caches: bool = False) -> None:
        self.shared_prefix_check = shared_prefix_check  # the backend profile's (a host compare of KV)
        self.run_ahead = run_ahead  # the backend profile's: launch step k+1 before reading step k
        self.alone_on_own_caches = alone_on_own_caches  # the backend profile's: a lone row skips the batch cache
        self.members: list[Sequence] = []
        self.caches: list[Any] = []
        self.pending: list[Sequence] = []
        self.shared = 0
        # The step launched ahead: one token per leading member, not yet read back (run_ahead only).
        self._ahead: mx.array | None = None
        self._ahead_rows = 0
        self.last_timing: StepTiming | None = None
        self._clock = PassClock()  # the step under way's

    def __len__(self) -> int:
        return len(self.members) + len(self.pending)

    def __contains__(self, seq: object) -> bool:
        return any(s is seq for s in (*self.members, *self.pending))

    def add(self, seq: Sequence) -> None:
        """Join a prefilled sequence; its caches move in at the next step."""
        if seq.next_input is None:
            raise ValueError("only sequences with a pending input token can join a batch")
        self.pending.append(seq)

    def add_group(self, seqs: list[Sequence], caches: list[Any]) -> None:
        """Join sequences prefilled together (:mod:`runtime.execution.batch_prefill`): ``caches`` are
        their batch caches, row ``i`` is ``seqs[i]``; with no batch running they become it as they are."""
        self._merge_pending()
        if not self.members:
            self.members, self.caches = list(seqs), caches
        else:
            self._as_batch()
            for mine, theirs in zip(self.caches, caches, strict=True):
                mine.extend(theirs)
            self.members.extend(seqs)
        self._find_shared()

    def _merge_pending(self) -> None:
        if not self.pending:
            return
        joining, self.pending = self.pending, []
        lone = not self.members and len(joining) == 1
        if lone and self.alone_on_own_caches and _own_caches_decode(joining[0].kv.caches):
            # A lone row decodes on its own caches, as mlx-lm's generate_step does: no merge copy,
            # no mask, and plain integer offsets (a batch cache's per-row arrays cost every layer
            # of every step a little: 0.85x mlx-lm's decode rate at 1K on an H200's 1B geometry).
            self.members, self.caches = joining, joining[0].kv.caches
            joining[0].kv.caches = []
            return
        self._as_batch()
        merged = [
            merge_with_room(list(layer)) if type(layer[0]) is KVCache
            else batch_cache_class(layer[0]).merge(list(layer))
            for layer in zip(*(s.kv.caches for s in joining), strict=True)
        ]
        if not self.members:
            self.caches = merged
        else:
            for mine, theirs in zip(self.caches, merged, strict=True):
                mine.extend(theirs)
        self.members.extend(joining)
        for seq in joining:
            seq.kv.caches = []
        self._find_shared()

    def _as_batch(self) -> None:
        """A lone row on its own caches becomes a batch of one, for rows to join it."""
        if self.members and _own_caches_decode(self.caches):
            self.caches = [merge_with_room([c]) for c in self.caches]

    def _find_shared(self) -> None:
        # Fewer rows than the step would attend shared keys for: comparing their KV is wasted reading.
        enough = self.shared_prefix_check and len(self.members) >= cpu_attention.MIN_SHARED_ROWS
        self.shared = shared_prefix_length(self.caches, [s.token_ids for s in self.members]) if enough else 0

    def remove(self, seq: Sequence) -> None:
        """Extract ``seq``'s caches back into it and drop it from the batch."""
        if any(p is seq for p in self.pending):
            self.pending = [p for p in self.pending if p is not seq]
            return
        idx = self.members.index(seq)
        own = _own_caches_decode(self.caches)  # a lone row on its own caches takes them back as they are
        seq.kv.caches = self.caches if own else [extract_with_room(c, idx) for c in self.caches]
        keep = [i for i in range(len(self.members)) if i != idx]
        self.members.pop(idx)
        if self._ahead is not None and idx < self._ahead_rows:
            ahead = [i for i in range(self._ahead_rows) if i != idx]
            self._ahead = self._ahead[mx.array(ahead)] if ahead else None
            self._ahead_rows -= 1
        if self.members:
            for c in self.caches:
                _keep_rows(c, keep)
        else:
            self.caches = []
            self.shared = 0
            self._ahead, self._ahead_rows = None, 0

    def row_caches(self, seq: Sequence) -> list[Any]:
        """``seq``'s caches as they are now, a layer each, to park its prompt from while it decodes
        (:meth:`runtime.kv.kvstate.ActiveKV.park`): its own while it waits to join or decodes alone on
        them, else its row of the batch's (:func:`runtime.kv.float_resident.row_view`: a float batch's
        without a copy). They hold its prompt and what it generated so far, a step run ahead included."""
        if any(p is seq for p in self.pending):
            return seq.kv.caches
        idx = self.members.index(seq)
        if _own_caches_decode(self.caches):
            return self.caches
        return [row_view(c, idx) for c in self.caches]

    def step_once(self) -> list[tuple[Sequence, str]]:
        """One decode step for every member: returns (sequence, new text) pairs.

        Finished sequences stay in the batch until :meth:`remove`; callers remove
        them after reading the step's results.
        """
        self._merge_pending()
        if not self.members:
            return []
        self._clock = PassClock()
        if self.run_ahead and not any(_forcing(s) for s in self.members):
            return self._step_ahead()
        if self._ahead is not None:  # a forced token next: read the step in flight, then step in lockstep
            return self._read_ahead(None)
        tokens = self._launch(self._own_inputs())
        mx.async_eval(tokens)
        self._clock.launched()
        return self._accept(self.members, tokens.tolist())

    def _own_inputs(self) -> mx.array:
        """Every member's next input token, as the ``(B, 1)`` input of a step."""
        return mx.array([[s.next_input] for s in self.members])

    def _launch(self, inputs: mx.array) -> mx.array:
        """One forward pass and sampling for every member (lazy: nothing is evaluated here)."""
        with self._clock.building():
            with cpu_attention.sharing(self.shared):
                logits = self.members[0].lm.forward(inputs, self.caches)[:, -1, :]
            for i, s in enumerate(self.members):
                if s.logits_trace is not None:
                    s.observe(logits[i : i + 1])
            return sample_rows(self.members, logits)

    def _step_ahead(self) -> list[tuple[Sequence, str]]:
        """Launch the next step from the tokens in flight, then read those (see the class docstring)."""
        if self._ahead is None:  # nothing in flight: this step's tokens come from the rows' inputs
            self._ahead = self._launch(self._own_inputs())
            self._ahead_rows = len(self.members)
            # Submitted on its own, as generate_step does its first step: the device starts it while the host
            # builds the next, and reading it waits for it alone, not for the next step too.
            mx.async_eval(self._ahead)
        # Rows that joined since the launch have not stepped yet: they go in with their own input.
        joined = [s.next_input or 0 for s in self.members[self._ahead_rows :]]
        inputs = self._ahead if not joined else mx.concatenate([self._ahead, mx.array(joined)])
        following = self._launch(inputs[:, None])
        mx.async_eval(following)
        return self._read_ahead(following)

    def _read_ahead(self, following: mx.array | None) -> list[tuple[Sequence, str]]:
        """Accept the tokens in flight; ``following`` (launched for every member) becomes the step in flight."""
        assert self._ahead is not None
        self._clock.launched()
        rows = self.members[: self._ahead_rows]
        tokens = self._ahead.tolist()
        self._ahead, self._ahead_rows = following, len(self.members) if following is not None else 0
        return self._accept(rows, tokens)

    def _accept(self, rows: list[Sequence], tokens: list[int]) -> list[tuple[Sequence, str]]:
        """Each row takes its token; the step's timing is recorded (``tokens`` are read: the wait is over)."""
        self._clock.read()
        out = [(s, s.accept(t)) for s, t in zip(rows, tokens, strict=True)]
        self.last_timing = self._clock.timing()
        return out


def _own_caches_decode(caches: list[Any]) -> bool:
    """Whether ``caches`` are one sequence's float ``KVCache`` layers, which a lone row decodes on as they are."""
    return bool(caches) and all(type(c) is KVCache for c in caches)


def _keep_rows(cache: Any, keep: list[int]) -> None:
    """``cache.filter(keep)``, but a view instead of a gather when ``keep`` is a prefix (a float batch's,
    :class:`~runtime.kv.decode_kv.DecodeKVCache`, knows its padding on the host: nothing is read back)."""
    if isinstance(cache, DecodeKVCache) and keep == list(range(len(keep))) and cache.keys is not None:
        cache.keep_first(len(keep))
        return
    cache.filter(keep)


def _forcing(seq: Sequence) -> bool:
    """Whether ``seq``'s next token depends on the last one on the host: forced tokens still to
    produce (a tool call's opening; its sampler picks them by how many tokens it accepted, a count
    that lags one behind while a step runs ahead), a grammar (its mask follows each token), or
    repeat penalties (they read the latest tokens), or logprobs (a step's scores are read with its token, so
    the next step cannot be built first)."""
    return (seq.grammar is not None or seq.penalizes_repeats or seq.params.logprobs is not None
            or len(seq.generated) < len(seq.params.forced))


def sample_rows(members: list[Sequence], logits: mx.array) -> mx.array:
    """One token per row; greedy rows share one argmax, the others sample alone.

    Rows with a grammar have their forbidden tokens masked first, all in one go
    (:func:`runtime.reply.grammar.mask_rows`): constrained and free rows share the argmax.
    """
    if any(s.grammar is not None for s in members):
        logits = mask_rows([s.grammar for s in members], logits)
    greedy = [not s.samples_alone for s in members]
    if all(greedy):
        return members[0].sample(logits)
    rows = [
        None if g else s.sample(logits[i : i + 1]) for i, (s, g) in enumerate(zip(members, greedy, strict=True))
    ]
    if any(greedy):
        best = members[greedy.index(True)].sample(logits)
        rows = [best[i : i + 1] if r is None else r for i, r in enumerate(rows)]
    return mx.concatenate([r for r in rows if r is not None])
