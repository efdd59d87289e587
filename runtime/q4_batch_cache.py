"""Batched Q4 KV caches: mlx-lm's batch-cache protocol on packed data.

:class:`BatchQuantizedKVCache` and :class:`BatchDequantizingQuantizedKVCache`
implement ``merge``, ``extract``, ``filter``, ``extend``,
``prepare``/``finalize`` and a left-padded ``make_mask`` directly on the packed
tuples of :mod:`runtime.q4_packing`: merging, filtering and extracting move
bits, they never round-trip through float. They merge the single-sequence
caches of :mod:`runtime.q4_cache` and extract rows back into them.
"""

from __future__ import annotations

from typing import Any, Self

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import dynamic_roll

from runtime.q4_cache import DequantizingQuantizedKVCache, PackedKVCache, QuantizedKVCache
from runtime.q4_packing import (
    STORAGE_DTYPE,
    KVPair,
    PackedKVStorage,
    alloc_packed,
    concat_packed,
    map_packed,
)

__all__ = ["BatchQuantizedKVCache", "BatchDequantizingQuantizedKVCache"]


class _BatchPackedKVCache(PackedKVStorage):
    """Left-padded batch of packed KV: mlx-lm's ``BatchKVCache`` on packed tuples.

    ``offset`` is an ``mx.array`` (one position per row, for RoPE),
    ``left_padding`` how many leading slots of each row are padding, and
    ``_idx`` the filled length shared by all rows.
    """

    single_cls: type[PackedKVCache] = PackedKVCache

    def __init__(self, left_padding: list[int], *, group_size: int = 64, bits: int = 4) -> None:
        self._init_storage(group_size, bits)
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self._append(keys, values, used=self._idx)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self._fetch()

    def _fetch(self) -> Any:
        raise NotImplementedError

    def keys_and_values(self) -> KVPair:
        return self._filled(self._idx)

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        """Add left padding to an empty cache, or note a right-padded prompt chunk."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty cache")
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """Roll the right padding noted by :meth:`prepare` round to the left (bits unchanged)."""
        if self._right_padding is None:
            return
        pad = self._right_padding
        buffers = self._buffers()
        if buffers is not None:
            self.keys, self.values = map_packed(
                lambda x: dynamic_roll(x, pad[:, None], axis=2), buffers
            )
        self.offset = self.offset - pad
        self.left_padding = self.left_padding + pad
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.offset, self.left_padding, self._idx,
                self.group_size, self.q_bits)  # fmt: skip

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.offset, self.left_padding, self._idx,
         self.group_size, self.q_bits) = v  # fmt: skip
        self._right_padding = None
        self.dtype = STORAGE_DTYPE

    def size(self) -> int:
        return self._idx

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row (mlx-lm's batch semantics)."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: list[int] | mx.array) -> None:
        """Keep only ``batch_indices``, then drop the left padding all rows share."""
        idx = mx.array(batch_indices)
        buffers = self._buffers()
        if buffers is not None:
            self.keys, self.values = map_packed(lambda x: x[idx], buffers)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        shared = min(self.left_padding.tolist(), default=0)
        if shared > 0:
            buffers = self._buffers()
            if buffers is not None:
                self.keys, self.values = map_packed(lambda x: x[..., shared:, :], buffers)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: _BatchPackedKVCache) -> None:
        """Append ``other``'s rows, right-aligning both batches at the larger index."""
        if (other.group_size, other.q_bits) != (self.group_size, self.q_bits):
            raise ValueError("cannot extend with a cache of another quantization")
        like = self._buffers() or other._buffers()
        if like is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def aligned(c: _BatchPackedKVCache) -> KVPair:
            rows = int(c.offset.shape[0])
            kv = c._buffers() or map_packed(
                lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), like
            )
            left = max_idx - c._idx
            right = max_size - kv[0][0].shape[2] - left
            if right < 0:
                kv = map_packed(lambda x: x[..., :right, :], kv)
                right = 0
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            return map_packed(lambda x: mx.pad(x, widths), kv) if left or right else kv

        self.keys, self.values = concat_packed(aligned(self), aligned(other), axis=0)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(
            [self.left_padding + (max_idx - self._idx), other.left_padding + (max_idx - other._idx)]
        )
        self._idx = max_idx

    def extract(self, idx: int) -> PackedKVCache:
        """Row ``idx`` as a single-sequence cache (packed bits copied, not requantized)."""
        cache = self.single_cls(group_size=self.group_size, bits=self.q_bits)
        cache.dtype = self.dtype
        buffers = self._buffers()
        if buffers is None:
            return cache
        pad = int(self.left_padding.tolist()[idx])
        cache.keys, cache.values = map_packed(
            lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), buffers
        )
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches: list[PackedKVCache]) -> Self:
        """Left-pad single caches into one batch by copying their packed bits."""
        if not caches:
            raise ValueError("merge needs at least one cache")
        group_size, bits = caches[0].group_size, caches[0].q_bits
        if any((c.group_size, c.q_bits) != (group_size, bits) for c in caches):
            raise ValueError("cannot merge caches of different quantizations")
        lengths = [c.size() for c in caches]
        max_length = max(lengths)
        batch = cls([max_length - n for n in lengths], group_size=group_size, bits=bits)
        batch.dtype = caches[0].dtype
        filled = [(i, c.keys_and_values()) for i, c in enumerate(caches) if c.size() > 0]
        if not filled:
            return batch
        heads = max(kv[0][0].shape[1] for _, kv in filled)
        dk = max(kv[0][0].shape[-1] * 32 // bits for _, kv in filled)
        dv = max(kv[1][0].shape[-1] * 32 // bits for _, kv in filled)
        keys = alloc_packed(len(caches), heads, max_length, dk, group_size=group_size, bits=bits)
        values = alloc_packed(len(caches), heads, max_length, dv, group_size=group_size, bits=bits)
        for i, (k, v) in filled:
            pad = max_length - lengths[i]
            for dst, src in zip((*keys, *values), (*k, *v), strict=True):
                dst[i : i + 1, :, pad:] = src
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + max_length
        batch._idx = max_length
        return batch


class BatchQuantizedKVCache(_BatchPackedKVCache):
    """Batch of Q4 sequences attended with quantized SDPA.

    Extracts :class:`runtime.q4_cache.QuantizedKVCache`.
    """

    single_cls = QuantizedKVCache

    @property
    def bits(self) -> int:
        """Seen by mlx-lm's ``scaled_dot_product_attention``: selects quantized SDPA."""
        return self.q_bits

    def _fetch(self) -> KVPair:
        return self._for_attention(self.keys_and_values())


class BatchDequantizingQuantizedKVCache(_BatchPackedKVCache):
    """Batch of Q4 sequences for sink layers: attention sees a dequantized copy.

    Extracts :class:`runtime.q4_cache.DequantizingQuantizedKVCache`; no ``bits`` attribute.
    """

    single_cls = DequantizingQuantizedKVCache

    def _fetch(self) -> tuple[mx.array, mx.array]:
        return self._dequantize(self.keys_and_values(), self.dtype)
