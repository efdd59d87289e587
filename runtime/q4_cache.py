"""Single-sequence Q4 KV caches that speak mlx-lm's cache protocol.

Both store keys and values in the packed format of :mod:`runtime.q4_packing`
and differ only in what attention sees:

* :class:`QuantizedKVCache` has a ``bits`` attribute, so mlx-lm's
  ``scaled_dot_product_attention`` runs quantized SDPA on it.
* :class:`DequantizingQuantizedKVCache` has *no* ``bits`` attribute (it is
  ``q_bits``): ``update_and_fetch`` returns a transient dequantized copy in
  the model's dtype, so layers with attention sinks (GPT-OSS), which
  quantized SDPA refuses, attend in float.

Each merges into its batch counterpart in :mod:`runtime.q4_batch_cache`,
which extracts rows back into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from runtime.q4_packing import (
    STORAGE_DTYPE,
    KVPair,
    PackedKV,
    PackedKVStorage,
    map_packed,
    quantize_kv,
)

if TYPE_CHECKING:
    from runtime.q4_batch_cache import BatchDequantizingQuantizedKVCache, BatchQuantizedKVCache

__all__ = ["PackedKVCache", "QuantizedKVCache", "DequantizingQuantizedKVCache"]


def _check_packed(name: str, packed: PackedKV, group_size: int, bits: int) -> int:
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

    def dequantized(self, dtype: mx.Dtype = mx.float16) -> tuple[mx.array, mx.array]:
        """Float keys and values ``(1, H, T, D)`` up to the offset."""
        return self._dequantize(self.keys_and_values(), dtype)

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
        tk = _check_packed("keys", keys, group_size, bits)
        tv = _check_packed("values", values, group_size, bits)
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
    ``merge`` into :class:`runtime.q4_batch_cache.BatchQuantizedKVCache`.
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
        # Imported here: runtime.q4_batch_cache imports this module.
        from runtime.q4_batch_cache import BatchQuantizedKVCache

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
        # Imported here: runtime.q4_batch_cache imports this module.
        from runtime.q4_batch_cache import BatchDequantizingQuantizedKVCache

        return BatchDequantizingQuantizedKVCache.merge(caches)
