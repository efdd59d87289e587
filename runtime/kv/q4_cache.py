"""Q4 KV caches that speak mlx-lm's cache protocol: one sequence's, and a batch's.

**One sequence.** Both store keys and values in the packed format of
:mod:`runtime.kv.q4_packing` and differ only in what attention sees:

* :class:`QuantizedKVCache` has a ``bits`` attribute, so mlx-lm's
  ``scaled_dot_product_attention`` runs quantized SDPA on it.
* :class:`DequantizingQuantizedKVCache` has *no* ``bits`` attribute (it is
  ``q_bits``): ``update_and_fetch`` returns a transient dequantized copy in
  the model's dtype, so layers with attention sinks (GPT-OSS), which
  quantized SDPA refuses, attend in float.

**A batch.** Each merges into its batch counterpart, :class:`BatchQuantizedKVCache`
or :class:`BatchDequantizingQuantizedKVCache`, which implement ``merge``,
``extract``, ``filter``, ``extend``, ``prepare``/``finalize`` and a left-padded
``make_mask`` directly on the packed tuples: merging, filtering and extracting move
bits, they never round-trip through float, and extracting gives back a row's
single-sequence cache.
"""

from __future__ import annotations

from typing import Any, Self

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import create_attention_mask, dynamic_roll

from runtime.kv.q4_packing import (
    STORAGE_DTYPE,
    KVPair,
    PackedKV,
    PackedKVStorage,
    alloc_packed,
    concat_packed,
    map_packed,
    quantize_kv,
)

__all__ = ["check_packed", "PackedKVCache", "QuantizedKVCache", "DequantizingQuantizedKVCache",
           "BatchQuantizedKVCache", "BatchDequantizingQuantizedKVCache"]


def check_packed(name: str, packed: PackedKV, group_size: int, bits: int) -> int:
    """Validate one packed tuple for a single sequence; return its token count."""
    if len(packed) != 3:
        raise ValueError(f"{name}: expected (weights, scales, biases), got {len(packed)} arrays")
    w, s, b = packed
    if w.dtype != mx.uint32:
        raise ValueError(f"{name}: weights must be uint32, got {w.dtype}")
    if s.dtype != STORAGE_DTYPE or b.dtype != STORAGE_DTYPE:
        raise ValueError(f"{name}: scales and biases must be float16, got {s.dtype}/{b.dtype}")
    if w.ndim != 4 or w.shape[0] != 1:
        raise ValueError(f"{name}: expected shape (1, H, T, ...), got {w.shape}")
    if s.shape != b.shape or s.shape[:3] != w.shape[:3]:
        raise ValueError(f"{name}: inconsistent shapes {w.shape} {s.shape} {b.shape}")
    if w.shape[-1] * 32 // bits != s.shape[-1] * group_size:
        raise ValueError(
            f"{name}: {w.shape[-1]} packed words and {s.shape[-1]} groups do not match "
            f"group_size={group_size} bits={bits}"
        )
    return int(w.shape[2])


class PackedKVCache(PackedKVStorage):
    """One sequence's packed KV; subclasses decide what attention sees."""

    def __init__(self, group_size: int = 64, bits: int = 4) -> None:
        self._init_storage(group_size, bits)
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self._append(keys, values, used=self.offset)
        self.offset += keys.shape[2]
        return self._fetch()

    def _fetch(self) -> Any:
        raise NotImplementedError

    def keys_and_values(self) -> KVPair:
        """The packed keys and values up to the offset (views, not copies)."""
        return self._filled(self.offset)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self.q_bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self.q_bits = v
        self.dtype = STORAGE_DTYPE

    def size(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def packed(self) -> KVPair:
        """Contiguous copies of keys and values trimmed to the offset, ``(1, H, T, ...)``."""
        return map_packed(mx.contiguous, self.keys_and_values())

    def dequantized(self, dtype: mx.Dtype = mx.float16, *, fused: bool = False) -> tuple[mx.array, mx.array]:
        """Float keys and values ``(1, H, T, D)`` up to the offset (``fused``: by ``mx.dequantize``,
        :func:`runtime.kv.q4_packing.dequantize_kv`)."""
        return self._dequantize(self.keys_and_values(), dtype, fused=fused)

    @classmethod
    def from_packed(
        cls, keys: PackedKV, values: PackedKV, *, group_size: int = 64, bits: int = 4
    ) -> Self:
        """Adopt packed tuples (as :meth:`packed` returns them) as a cache.

        The cache takes new array handles on the same data, so its in-place
        writes never show through the caller's arrays.

        Raises:
            ValueError: the tuples are not one sequence's consistent packed KV.
        """
        cache = cls(group_size=group_size, bits=bits)
        tk = check_packed("keys", keys, group_size, bits)
        tv = check_packed("values", values, group_size, bits)
        if tk != tv or keys[0].shape[1] != values[0].shape[1]:
            raise ValueError(f"keys and values disagree: {keys[0].shape} vs {values[0].shape}")
        cache.keys, cache.values = map_packed(mx.contiguous, (keys, values))
        cache.offset = tk
        return cache

    @classmethod
    def from_float(
        cls, keys: mx.array, values: mx.array, *, group_size: int = 64, bits: int = 4
    ) -> Self:
        """Quantize an existing float KV ``(1, H, T, D)`` (e.g. to park a float cache)."""
        cache = cls.from_packed(
            quantize_kv(keys, group_size, bits),
            quantize_kv(values, group_size, bits),
            group_size=group_size,
            bits=bits,
        )
        cache.dtype = keys.dtype
        return cache


class QuantizedKVCache(PackedKVCache):
    """Single-sequence Q4 cache attended with mlx-lm's quantized SDPA.

    Same contract as mlx-lm's ``QuantizedKVCache`` (which quantizes in the
    model dtype, so float32 scales on CPU), plus ``size``,
    :meth:`packed`/:meth:`from_packed` for persistence,
    :meth:`from_float`/:meth:`dequantized` for parking a float cache, and
    ``merge`` into :class:`BatchQuantizedKVCache`.
    """

    @property
    def bits(self) -> int:
        """Seen by mlx-lm's ``scaled_dot_product_attention``: selects quantized SDPA."""
        return self.q_bits

    def _fetch(self) -> KVPair:
        return self._for_attention(self.keys_and_values())

    @classmethod
    def merge(cls, caches: list[PackedKVCache]) -> BatchQuantizedKVCache:
        """mlx-lm's ``BatchGenerator`` merges through the first cache's class."""
        return BatchQuantizedKVCache.merge(caches)


class DequantizingQuantizedKVCache(PackedKVCache):
    """Q4 storage, float attention: for layers with attention sinks (GPT-OSS).

    Deliberately has no ``bits`` attribute (see ``q_bits``): mlx-lm picks
    quantized SDPA by ``hasattr(cache, "bits")`` and that path rejects sinks.
    Each ``update_and_fetch`` returns a transient dequantized copy in the
    dtype of the incoming keys.
    """

    def _fetch(self) -> tuple[mx.array, mx.array]:
        return self.dequantized(self.dtype)

    @classmethod
    def merge(cls, caches: list[PackedKVCache]) -> BatchDequantizingQuantizedKVCache:
        return BatchDequantizingQuantizedKVCache.merge(caches)


# -- batches ---------------------------------------------------------------------



class _BatchPackedKVCache(PackedKVStorage):
    """Left-padded batch of packed KV: mlx-lm's ``BatchKVCache`` on packed tuples.

    ``offset`` is an ``mx.array`` (one position per row, for RoPE),
    ``left_padding`` how many leading slots of each row are padding (and ``pads``
    the same on the host, kept with it: a row that leaves reads nothing back from
    the device, whose queued steps a read would wait for), and
    ``_idx`` the filled length shared by all rows.
    """

    single_cls: type[PackedKVCache] = PackedKVCache

    def __init__(self, left_padding: list[int], *, group_size: int = 64, bits: int = 4) -> None:
        self._init_storage(group_size, bits)
        self.left_padding = mx.array(left_padding)
        self.pads = [int(p) for p in left_padding]
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: list[int] | None = None

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
            self.pads = [p + int(q) for p, q in zip(self.pads, left_padding, strict=True)]
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = [int(q) for q in right_padding]

    def finalize(self) -> None:
        """Roll the right padding noted by :meth:`prepare` round to the left (bits unchanged)."""
        if self._right_padding is None:
            return
        pad = mx.array(self._right_padding)
        buffers = self._buffers()
        if buffers is not None:
            self.keys, self.values = map_packed(
                lambda x: dynamic_roll(x, pad[:, None], axis=2), buffers
            )
        self.offset = self.offset - pad
        self.left_padding = self.left_padding + pad
        self.pads = [p + q for p, q in zip(self.pads, self._right_padding, strict=True)]
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.offset, self.left_padding, self._idx,
                self.group_size, self.q_bits)  # fmt: skip

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.offset, self.left_padding, self._idx,
         self.group_size, self.q_bits) = v  # fmt: skip
        self.pads = [int(p) for p in self.left_padding.tolist()]  # set whole from elsewhere: read back once
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
        self.pads = [self.pads[int(i)] for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array)
                                                 else batch_indices)]
        shared = min(self.pads, default=0)
        if shared > 0:
            buffers = self._buffers()
            if buffers is not None:
                self.keys, self.values = map_packed(lambda x: x[..., shared:, :], buffers)
            self._idx -= shared
            self.left_padding = self.left_padding - shared
            self.pads = [p - shared for p in self.pads]

    def extend(self, other: _BatchPackedKVCache) -> None:
        """Append ``other``'s rows, right-aligning both batches at the larger index."""
        if (other.group_size, other.q_bits) != (self.group_size, self.q_bits):
            raise ValueError("cannot extend with a cache of another quantization")
        like = self._buffers() or other._buffers()
        if like is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.pads = self.pads + other.pads
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
        self.pads = [p + max_idx - self._idx for p in self.pads] + [p + max_idx - other._idx for p in other.pads]
        self._idx = max_idx

    def extract(self, idx: int) -> PackedKVCache:
        """Row ``idx`` as a single-sequence cache (packed bits copied, not requantized)."""
        cache = self.single_cls(group_size=self.group_size, bits=self.q_bits)
        cache.dtype = self.dtype
        buffers = self._buffers()
        if buffers is None:
            return cache
        pad = self.pads[idx]
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

    Extracts :class:`QuantizedKVCache`.
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

    Extracts :class:`DequantizingQuantizedKVCache`; no ``bits`` attribute.
    """

    single_cls = DequantizingQuantizedKVCache

    def _fetch(self) -> tuple[mx.array, mx.array]:
        return self._dequantize(self.keys_and_values(), self.dtype)
