"""Group-quantized (Q4) KV caches that speak mlx-lm's cache protocol.

Full-attention layers keep their keys and values as MLX affine-quantized
tuples ``(weights uint32, scales, biases)``, group 64 and 4 bits by default
(8 allowed). Everything is quantized from **float16**, so scales and biases
are float16: for head dim 64 a Q4 token-head costs 32 + 2 + 2 = 36 bytes
against 128 in float16 (ratio 0.281; float32 scales would make it 0.312).

Four caches, all built on the same packed storage:

* :class:`QuantizedKVCache` — one sequence. It has a ``bits`` attribute, so
  mlx-lm's ``scaled_dot_product_attention`` runs quantized SDPA on it.
* :class:`DequantizingQuantizedKVCache` — one sequence, stored the same way,
  but with *no* ``bits`` attribute (it is ``q_bits``):
  ``update_and_fetch`` returns a transient dequantized copy in the model's
  dtype, so layers with attention sinks (GPT-OSS), which quantized SDPA
  refuses, attend in float.
* :class:`BatchQuantizedKVCache` / :class:`BatchDequantizingQuantizedKVCache`
  — mlx-lm's batch-cache protocol (``merge``, ``extract``, ``filter``,
  ``extend``, ``prepare``/``finalize``, left-padded ``make_mask``) working
  directly on packed data: merging, filtering and extracting move bits, they
  never round-trip through float.

A layer whose head dim no supported group size divides cannot be packed;
:func:`q4_supported` says so and the caller keeps float KV for that layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask, dynamic_roll

from runtime.errors import UnsupportedModelError

__all__ = [
    "PackedKV", "KVPair", "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "STORAGE_DTYPE",
    "q4_supported", "quantize_kv", "dequantize_kv",
    "QuantizedKVCache", "DequantizingQuantizedKVCache",
    "BatchQuantizedKVCache", "BatchDequantizingQuantizedKVCache",
]  # fmt: skip

PackedKV = tuple[mx.array, mx.array, mx.array]
"""``(weights, scales, biases)`` as returned by ``mx.quantize``: token axis -2."""
KVPair = tuple[PackedKV, PackedKV]
"""Packed keys and packed values."""

SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_BITS = (4, 8)
STORAGE_DTYPE = mx.float16
"""Dtype quantized from, hence the dtype of scales and biases."""


def q4_supported(head_dim: int, group_size: int = 64, bits: int = 4) -> bool:
    """Whether a head dim can be packed with this group size and bit width.

    ``mx.quantize`` needs the last axis divisible by the group size (so head
    dim 8, 48, 80 or 96 cannot use group 64). No fallback group is tried: the
    caller keeps float KV for a layer this rejects.
    """
    supported = group_size in SUPPORTED_GROUP_SIZES and bits in SUPPORTED_BITS
    return supported and head_dim > 0 and head_dim % group_size == 0


def _check_config(group_size: int, bits: int) -> None:
    if group_size not in SUPPORTED_GROUP_SIZES or bits not in SUPPORTED_BITS:
        raise ValueError(
            f"unsupported KV quantization group_size={group_size} bits={bits} "
            f"(group sizes {SUPPORTED_GROUP_SIZES}, bits {SUPPORTED_BITS})"
        )


def _check_head_dim(head_dim: int, group_size: int, bits: int) -> None:
    if not q4_supported(head_dim, group_size, bits):
        raise UnsupportedModelError(
            f"head dim {head_dim} cannot be quantized with group size {group_size}; "
            "keep this layer's KV in float"
        )


def quantize_kv(x: mx.array, group_size: int = 64, bits: int = 4) -> PackedKV:
    """Quantize float KV ``(..., T, D)`` from float16 (float16 scales and biases)."""
    _check_config(group_size, bits)
    _check_head_dim(x.shape[-1], group_size, bits)
    w, scales, biases = mx.quantize(x.astype(STORAGE_DTYPE), group_size=group_size, bits=bits)
    return w, scales, biases


def dequantize_kv(
    packed: PackedKV, group_size: int = 64, bits: int = 4, dtype: mx.Dtype = mx.float16
) -> mx.array:
    """Dequantize a packed tuple back to a float array in ``dtype``.

    Unpacks with shifts and one float32 multiply-add instead of ``mx.dequantize``:
    on MLX's CPU backend that kernel costs ~23 ns per element (a 4K-token cache of
    the default model takes ~0.9 s to activate), the unpacked form ~3 ns. It is
    also exact to float32 before the one cast to ``dtype``, where ``mx.dequantize``
    rounds through the scales' float16.
    """
    w, scales, biases = packed
    lead, words = w.shape[:-1], w.shape[-1]
    dim = words * (32 // bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.float32)
    q = q.reshape(*lead, dim // group_size, group_size)
    out = q * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return out.reshape(*lead, dim).astype(dtype)


def _each(fn: Callable[[mx.array], mx.array], kv: KVPair) -> KVPair:
    """Apply ``fn`` to all six arrays of a (keys, values) pair of packed tuples."""
    return cast(KVPair, tuple(tuple(fn(x) for x in packed) for packed in kv))


def _join(a: KVPair, b: KVPair, *, axis: int) -> KVPair:
    """Concatenate two (keys, values) pairs array by array."""
    k, v = (
        tuple(mx.concatenate([x, y], axis=axis) for x, y in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True)
    )
    return cast(KVPair, (k, v))


def _alloc(batch: int, heads: int, tokens: int, dim: int, group_size: int, bits: int) -> PackedKV:
    shape = (batch, heads, tokens)
    return (
        mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=STORAGE_DTYPE),
        mx.zeros((*shape, dim // group_size), dtype=STORAGE_DTYPE),
    )


def _append(
    buffers: KVPair | None,
    used: int,
    keys: mx.array,
    values: mx.array,
    *,
    group_size: int,
    bits: int,
    step: int,
) -> KVPair:
    """Quantize ``keys``/``values`` into the buffers after ``used`` tokens.

    Buffers grow by whole ``step``s when full, as mlx-lm's ``KVCache`` does.
    """
    batch, heads, n, dk = keys.shape
    dv = values.shape[-1]
    if buffers is None or used + n > buffers[0][0].shape[2]:
        n_new = (step + n - 1) // step * step
        new = (
            _alloc(batch, heads, n_new, dk, group_size, bits),
            _alloc(batch, heads, n_new, dv, group_size, bits),
        )
        if buffers is None:
            buffers = new
        else:
            if used % step != 0:
                buffers = _each(lambda x: x[..., :used, :], buffers)
            buffers = _join(buffers, new, axis=2)
    for buf, x in zip(buffers, (keys, values), strict=True):
        for dst, src in zip(buf, quantize_kv(x, group_size, bits), strict=True):
            dst[..., used : used + n, :] = src
    return buffers


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


class _PackedStorage(_BaseCache):
    """Packed key/value buffers shared by the single and batch caches."""

    step = 256
    keys: PackedKV | None
    values: PackedKV | None
    group_size: int
    q_bits: int
    dtype: mx.Dtype  # the model's K/V dtype (seen on update): what dequantizing returns

    def _init_storage(self, group_size: int, bits: int) -> None:
        _check_config(group_size, bits)
        self.keys = None
        self.values = None
        self.group_size = group_size
        self.q_bits = bits
        self.dtype = STORAGE_DTYPE

    def _buffers(self) -> KVPair | None:
        if self.keys is None or self.values is None:
            return None
        return self.keys, self.values

    def _filled(self, n: int) -> KVPair:
        buffers = self._buffers()
        if buffers is None:
            raise ValueError("the cache is empty")
        if n == buffers[0][0].shape[2]:
            return buffers
        return _each(lambda x: x[..., :n, :], buffers)

    def _dequantize(self, kv: KVPair, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        return (
            dequantize_kv(kv[0], self.group_size, self.q_bits, dtype),
            dequantize_kv(kv[1], self.group_size, self.q_bits, dtype),
        )

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated buffers (capacity, not just the filled part)."""
        buffers = self._buffers()
        return 0 if buffers is None else sum(x.nbytes for x in (*buffers[0], *buffers[1]))


class _PackedKVCache(_PackedStorage):
    """One sequence's packed KV; subclasses decide what attention sees."""

    def __init__(self, group_size: int = 64, bits: int = 4) -> None:
        self._init_storage(group_size, bits)
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self.dtype = keys.dtype
        self.keys, self.values = _append(
            self._buffers(), self.offset, keys, values,
            group_size=self.group_size, bits=self.q_bits, step=self.step,
        )
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
        return _each(mx.contiguous, self.keys_and_values())

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
        cache.keys, cache.values = _each(mx.contiguous, (keys, values))
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


class QuantizedKVCache(_PackedKVCache):
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
        return self.keys_and_values()

    @classmethod
    def merge(cls, caches: list[_PackedKVCache]) -> BatchQuantizedKVCache:
        """mlx-lm's ``BatchGenerator`` merges through the first cache's class."""
        return BatchQuantizedKVCache.merge(caches)


class DequantizingQuantizedKVCache(_PackedKVCache):
    """Q4 storage, float attention: for layers with attention sinks (GPT-OSS).

    Deliberately has no ``bits`` attribute (see ``q_bits``): mlx-lm picks
    quantized SDPA by ``hasattr(cache, "bits")`` and that path rejects sinks.
    Each ``update_and_fetch`` returns a transient dequantized copy in the
    dtype of the incoming keys.
    """

    def _fetch(self) -> tuple[mx.array, mx.array]:
        return self.dequantized(self.dtype)

    @classmethod
    def merge(cls, caches: list[_PackedKVCache]) -> BatchDequantizingQuantizedKVCache:
        return BatchDequantizingQuantizedKVCache.merge(caches)


class _BatchPackedKVCache(_PackedStorage):
    """Left-padded batch of packed KV: mlx-lm's ``BatchKVCache`` on packed tuples.

    ``offset`` is an ``mx.array`` (one position per row, for RoPE),
    ``left_padding`` how many leading slots of each row are padding, and
    ``_idx`` the filled length shared by all rows.
    """

    single_cls: type[_PackedKVCache] = _PackedKVCache

    def __init__(self, left_padding: list[int], *, group_size: int = 64, bits: int = 4) -> None:
        self._init_storage(group_size, bits)
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self.dtype = keys.dtype
        self.keys, self.values = _append(
            self._buffers(), self._idx, keys, values,
            group_size=self.group_size, bits=self.q_bits, step=self.step,
        )
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
            self.keys, self.values = _each(lambda x: dynamic_roll(x, pad[:, None], axis=2), buffers)
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
            self.keys, self.values = _each(lambda x: x[idx], buffers)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        shared = min(self.left_padding.tolist(), default=0)
        if shared > 0:
            buffers = self._buffers()
            if buffers is not None:
                self.keys, self.values = _each(lambda x: x[..., shared:, :], buffers)
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
            kv = c._buffers() or _each(
                lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype), like
            )
            left = max_idx - c._idx
            right = max_size - kv[0][0].shape[2] - left
            if right < 0:
                kv = _each(lambda x: x[..., :right, :], kv)
                right = 0
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            return _each(lambda x: mx.pad(x, widths), kv) if left or right else kv

        self.keys, self.values = _join(aligned(self), aligned(other), axis=0)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(
            [self.left_padding + (max_idx - self._idx), other.left_padding + (max_idx - other._idx)]
        )
        self._idx = max_idx

    def extract(self, idx: int) -> _PackedKVCache:
        """Row ``idx`` as a single-sequence cache (packed bits copied, not requantized)."""
        cache = self.single_cls(group_size=self.group_size, bits=self.q_bits)
        cache.dtype = self.dtype
        buffers = self._buffers()
        if buffers is None:
            return cache
        pad = int(self.left_padding.tolist()[idx])
        cache.keys, cache.values = _each(
            lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), buffers
        )
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches: list[_PackedKVCache]) -> Self:
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
        keys = _alloc(len(caches), heads, max_length, dk, group_size, bits)
        values = _alloc(len(caches), heads, max_length, dv, group_size, bits)
        for i, (k, v) in filled:
            pad = max_length - lengths[i]
            for dst, src in zip((*keys, *values), (*k, *v), strict=True):
                dst[i : i + 1, :, pad:] = src
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + max_length
        batch._idx = max_length
        return batch


class BatchQuantizedKVCache(_BatchPackedKVCache):
    """Batch of Q4 sequences attended with quantized SDPA; extracts :class:`QuantizedKVCache`."""

    single_cls = QuantizedKVCache

    @property
    def bits(self) -> int:
        """Seen by mlx-lm's ``scaled_dot_product_attention``: selects quantized SDPA."""
        return self.q_bits

    def _fetch(self) -> KVPair:
        return self.keys_and_values()


class BatchDequantizingQuantizedKVCache(_BatchPackedKVCache):
    """Batch of Q4 sequences for sink layers: attention sees a dequantized copy.

    Extracts :class:`DequantizingQuantizedKVCache`; no ``bits`` attribute.
    """

    single_cls = DequantizingQuantizedKVCache

    def _fetch(self) -> tuple[mx.array, mx.array]:
        return self._dequantize(self.keys_and_values(), self.dtype)
