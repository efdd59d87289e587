"""Finding the tokens every row of a decode batch holds the same keys and values for.

Why. Agents that share a prompt (a system prompt, a scenario's briefing) share
its Q4 chunks on disk and in memory (:mod:`runtime.kv.kvstate`), and activating
them dequantizes each row's copy to the same float keys and values. A batched
decode step reads every row's whole cache in every layer, and on the CPU that
read is the step's attention cost (eight rows of 1.1K tokens: 13 MB a layer).
Where the rows are known to begin alike, the step reads the common part once,
from one row, for every row's queries
(:func:`runtime.cpu.attention.shared_prefix_attention`).

How. "Alike" is checked, not assumed: the rows' token ids give an upper bound,
and the rows' float keys and values are then compared bit for bit, in every
layer, against row 0's. Rows whose caches came from different Q4 files or
different prefills of the same text differ in their bits and share nothing, so
a row's attention always reads exactly its own keys and values. The check
reads the rows once when they join (8 rows sharing 1K tokens: 15-45 ms
here), against a saving in every step after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from runtime.plan.prefix import common_prefix_length

__all__ = ["MIN_SHARED_TOKENS", "shared_prefix_length"]

MIN_SHARED_TOKENS = 256
"""Fewest shared tokens worth attending separately. A guard, not a measured optimum: the
separate products cost a few fixed milliseconds a step, which a short shared part does
not pay back (1K shared tokens: ``benches/results/decode_attention.md``, section 3)."""


def shared_prefix_length(caches: Sequence[Any], token_ids: Sequence[Sequence[int]]) -> int:
    """How many first tokens every row of the batch caches holds the same keys and values for.

    Args:
        caches: one batch cache per layer; row ``i`` is the sequence with ``token_ids[i]``.
        token_ids: each row's prompt token ids (an upper bound: equal keys need equal tokens).

    Returns 0 for fewer than two rows, for caches other than float ``BatchKVCache``
    layers, and when the rows share fewer than :data:`MIN_SHARED_TOKENS`.
    """
    if len(token_ids) < 2 or not all(_comparable(c) for c in caches):
        return 0
    length = min(common_prefix_length(token_ids[0], ids) for ids in token_ids[1:])
    mx.eval([a for c in caches for a in (c.keys, c.values, c.left_padding)])
    for cache in caches:
        pads = [int(p) for p in np.asarray(cache.left_padding)]
        if any(p + length > cache._idx for p in pads):
            return 0
        for buffer in (np.asarray(cache.keys), np.asarray(cache.values)):
            length = _alike(buffer, pads, length)
            if length < MIN_SHARED_TOKENS:
                return 0
    return length


def _comparable(cache: Any) -> bool:
    return isinstance(cache, BatchKVCache) and cache.keys is not None and cache.keys.dtype == mx.float32


def _alike(buffer: np.ndarray, pads: list[int], length: int) -> int:
    """The longest ``n <= length`` with every row's first ``n`` tokens equal to row 0's."""
    ref = buffer[0, :, pads[0] : pads[0] + length]
    for row, pad in enumerate(pads[1:], start=1):
        mine = buffer[row, :, pad : pad + length]
        if not np.array_equal(mine, ref):
            differs = (mine != ref).any(axis=(0, 2))
            length = int(differs.argmax())
            ref = ref[:, :length]
    return length
