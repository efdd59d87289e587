"""Batched decoding: sequences join by ``merge``/``extend``, step together, leave by ``extract``.

A :class:`DecodeBatch` holds one batch cache per layer (mlx-lm's
``BatchKVCache``/``BatchRotatingKVCache`` for float and sliding layers,
:class:`runtime.q4_cache.BatchQuantizedKVCache` for Q4 layers under the native
strategy). Each :meth:`step_once` feeds every member its next input token and
samples one token per member; :meth:`remove` extracts a member's cache back
into its own :class:`runtime.kvstate.ActiveKV` so it can be parked.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from runtime.q4_cache import (
    BatchDequantizingQuantizedKVCache,
    BatchQuantizedKVCache,
    DequantizingQuantizedKVCache,
    QuantizedKVCache,
)
from runtime.sequence import Sequence

__all__ = ["DecodeBatch", "batch_cache_class"]

_BATCH_CLASSES: dict[type, Any] = {
    KVCache: BatchKVCache,
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


class DecodeBatch:
    """The running batch of sequences that have finished prefill."""

    def __init__(self) -> None:
        self.members: list[Sequence] = []
        self.caches: list[Any] = []

    def __len__(self) -> int:
        return len(self.members)

    def add(self, seq: Sequence) -> None:
        """Merge a prefilled sequence into the batch (its caches move in)."""
        if seq.next_input is None:
            raise ValueError("only sequences with a pending input token can join a batch")
        merged = [batch_cache_class(c).merge([c]) for c in seq.kv.caches]
        if not self.members:
            self.caches = merged
        else:
            for mine, theirs in zip(self.caches, merged, strict=True):
                mine.extend(theirs)
        self.members.append(seq)
        seq.kv.caches = []

    def remove(self, seq: Sequence) -> None:
        """Extract ``seq``'s caches back into it and drop it from the batch."""
        idx = self.members.index(seq)
        seq.kv.caches = [c.extract(idx) for c in self.caches]
        keep = [i for i in range(len(self.members)) if i != idx]
        self.members.pop(idx)
        if self.members:
            for c in self.caches:
                c.filter(keep)
        else:
            self.caches = []

    def step_once(self) -> list[tuple[Sequence, str]]:
        """One decode step for every member: returns (sequence, new text) pairs.

        Finished sequences stay in the batch until :meth:`remove`; callers remove
        them after reading the step's results.
        """
        if not self.members:
            return []
        inputs = mx.array([[s.next_input] for s in self.members])
        logits = self.members[0].lm.model(inputs, cache=self.caches)[:, -1, :]
        for i, s in enumerate(self.members):
            if s.logits_trace is not None:
                s.observe(logits[i : i + 1])
        tokens = _sample_rows(self.members, logits)
        mx.eval(tokens)
        return [(s, s.accept(t)) for s, t in zip(self.members, tokens.tolist(), strict=True)]


def _sample_rows(members: list[Sequence], logits: mx.array) -> mx.array:
    if all(s.params.greedy for s in members):
        return members[0].sample(logits)
    return mx.concatenate([s.sample(logits[i : i + 1]) for i, s in enumerate(members)])
