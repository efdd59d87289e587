"""Prefilling several turns' new messages in one forward pass, as one batch.

Why. When agents answer together, each turn's new message (a few to a few
dozen tokens on a cached conversation) must be prefilled before it can join the
decode batch. On the CPU a forward pass over a handful of tokens costs about as
much as reading the weights once, however few tokens it carries: one pass with
eight rows of ten tokens took 450 ms here where eight passes of one row took
1000 ms (kvmem-default at 1K context). The group's batch caches then become
the decode batch as they are, with no merge.

How. The rows of one forward pass are equally long, ``width`` tokens: the
longest new message. A row with a shorter message (``pad`` = width minus its
length) is fed its last ``pad`` cached tokens again in front of it, and
:class:`LinedUpCache` does not store what the pass computes for them: the
row's cache is placed so that its own tail already sits where they would be
written, and its new tokens land right after it. So every row's queries attend
to exactly the keys and values its turn alone would (its cache as it was, then
its new tokens, at the same positions), without a copy to close a gap. The
padding costs compute only (bounded by :data:`MAX_PAD`). Each row's attention
runs over its own keys (:func:`runtime.cpu.attention.numpy_attention`), and its
first token is sampled with its own parameters.

Only float caches over the turn's parked cache are grouped (``at-rest`` Q4 or
float KV, no sliding-window layers, prefill not started); everything else
prefills one row at a time.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import mlx.core as mx
import numpy as np

from runtime.execution.decode_batch import place_cache_rows, sample_rows
from runtime.execution.pass_clock import PassClock
from runtime.execution.sequence import Sequence
from runtime.kv.decode_kv import DecodeKVCache

__all__ = ["MAX_PAD", "LinedUpCache", "choose_group", "prefill_together"]

MAX_PAD = 16
"""Most tokens a row of a group is padded by (computed and thrown away) to line up with the longest."""


def choose_group(seqs: dict[int, Sequence]) -> dict[int, int]:
    """Which of these sequences prefill together, and each one's padding.

    The longest new message that at least one other row can line up with (padding
    of at most :data:`MAX_PAD` tokens, no more than it has cached) sets the width.
    Returns ``{request id: pad}`` for two or more rows, else ``{}``.
    """
    ready = {r: s for r, s in seqs.items()
             if s.to_prefill > 0 and s.context > 0 and not s.prefill_started and s.kv.groupable}
    for width in sorted({s.to_prefill for s in ready.values()}, reverse=True):
        group = {
            r: width - s.to_prefill
            for r, s in ready.items()
            if 0 <= width - s.to_prefill <= min(MAX_PAD, s.context)
        }
        if len(group) >= 2:
            return group
    return {}


class LinedUpCache(DecodeKVCache):
    """One layer's batch cache for a group prefill (see the module docstring).

    Row ``i`` holds its ``length`` cached tokens ending ``pads[i]`` past the common
    write position, and its first ``pads[i]`` inputs of the group's pass are not
    stored. After that pass it is an ordinary left-padded ``BatchKVCache``.
    """

    def __init__(self, rows: list[Any], pads: list[int], width: int) -> None:
        lengths = [int(c.offset) for c in rows]
        start = max(n - p for n, p in zip(lengths, pads, strict=True))  # where the pass writes, for every row
        super().__init__([start + p - n for n, p in zip(lengths, pads, strict=True)])
        # room for the pass and the first decode step
        place_cache_rows(self, rows, [start + p for p in pads], write_at=start, room=width + 1)
        self._lining_up: tuple[int, ...] | None = tuple(pads)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if self._lining_up is not None:
            # The lining-up inputs' keys and values are dropped: the row's own cache tail stays there.
            here = slice(self._idx, self._idx + keys.shape[2])
            keys = mx.where(_computed(self._lining_up, keys.shape), keys, self.keys[..., here, :])
            values = mx.where(_computed(self._lining_up, values.shape), values, self.values[..., here, :])
            self._lining_up = None
        return super().update_and_fetch(keys, values)


@functools.lru_cache(maxsize=8)
def _computed(pads: tuple[int, ...], shape: tuple[int, ...]) -> mx.array:
    """Which of a group pass's keys (or values) of ``shape`` ``(B, H, width, D)`` are the rows' own new
    tokens, not their lining-up inputs: made on the host once for every layer (each would otherwise
    add its own few graph nodes to the pass, and a GPU's host pays for each at the launch)."""
    rows, heads, width, dim = shape
    new = np.arange(width)[None, :] >= np.array(pads)[:, None]
    return mx.array(np.broadcast_to(new[:, None, :, None], (rows, heads, width, dim)))


def prefill_together(rows: list[Sequence], pads: list[int]) -> tuple[list[str], list[Any]]:
    """Prefill every row's remaining prompt in one pass and sample each row's first token.

    Returns each row's first streamable text and the group's batch caches (one
    per layer, row ``i`` is ``rows[i]``); the rows' own caches are emptied.
    """
    started = time.perf_counter()
    clock = PassClock()
    widths = {seq.to_prefill + pad for seq, pad in zip(rows, pads, strict=True)}
    if len(widths) != 1:
        raise ValueError(f"a group's rows must line up to one width, not {sorted(widths)}")
    width = widths.pop()
    with clock.building():  # the rows' caches lined up in one batch cache, the pass, sampling
        caches = [LinedUpCache(list(layer), pads, width) for layer in zip(*(s.kv.caches for s in rows), strict=True)]
        inputs = mx.array([seq.token_ids[seq.context - pad : seq.context] + seq.remaining_ids
                           for seq, pad in zip(rows, pads, strict=True)])
        logits = rows[0].lm.forward_last(inputs, caches)
        for i, seq in enumerate(rows):
            seq.observe(logits[i : i + 1])
        tokens = sample_rows(rows, logits)
    mx.async_eval(tokens)
    clock.launched()
    firsts = tokens.tolist()
    clock.read()
    texts = []
    for seq, token in zip(rows, firsts, strict=True):
        seq.kv.caches = []
        texts.append(seq.first_token(int(token), prefill_started_at=started))
    timing = clock.timing()
    for seq in rows:
        seq.last_chunk_timing = timing
    return texts, caches
