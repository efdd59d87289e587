"""The packed Q4 KV format and the primitives both cache families build on.

Keys and values are kept as MLX affine-quantized tuples ``(weights uint32,
scales, biases)``, group 64 and 4 bits by default (8 allowed). Everything is
quantized from **float16**, so scales and biases are float16: for head dim 64
a Q4 token-head costs 32 + 2 + 2 = 36 bytes against 128 in float16 (ratio
0.281; float32 scales would make it 0.312).

This module holds the format and the operations on it: :func:`quantize_kv` /
:func:`dequantize_kv`, the buffer helpers (:func:`alloc_packed`,
:func:`append_packed`, :func:`map_packed`, :func:`concat_packed`) and
:class:`PackedKVStorage`, the base the caches store through. The caches live in
:mod:`runtime.kv.q4_cache` (one sequence, and a
left-padded batch).

A layer whose head dim no supported group size divides cannot be packed;
:func:`q4_supported` says so and the caller keeps float KV for that layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from runtime.errors import UnsupportedModelError

__all__ = [
    "PackedKV", "KVPair", "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "STORAGE_DTYPE",
    "q4_supported", "quantize_kv", "dequantize_kv",
    "map_packed", "concat_packed", "alloc_packed", "append_packed", "PackedKVStorage",
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
    packed: PackedKV, group_size: int = 64, bits: int = 4, dtype: mx.Dtype = mx.float16, *, fused: bool = False
) -> mx.array:
    """Dequantize a packed tuple back to a float array in ``dtype``.

    Unpacks with shifts and one float32 multiply-add instead of ``mx.dequantize``:
    on MLX's CPU backend that kernel costs ~23 ns per element (a 4K-token cache of
    the default model takes ~0.9 s to activate), the unpacked form ~3 ns. It is
    also exact to float32 before the one cast to ``dtype``, where ``mx.dequantize``
    rounds through the scales' float16.

    ``fused`` (the GPU policy's, :attr:`runtime.spec.ModelCacheSpec.fused_dequantize`) takes
    ``mx.dequantize`` instead: on a GPU the unpacked form is nine kernels an array and float32
    intermediates eight times the packed size, where the fused one is one kernel (and a cast);
    a 16-layer cache's activation or park launches some 250 kernels fewer. Its float16
    arithmetic differs from the float32 road by about float16's rounding, far under Q4's own error.
    """
    w, scales, biases = packed
    if fused:
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(dtype)
    lead, words = w.shape[:-1], w.shape[-1]
    dim = words * (32 // bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.float32)
    q = q.reshape(*lead, dim // group_size, group_size)
    out = q * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return out.reshape(*lead, dim).astype(dtype)


def map_packed(fn: Callable[[mx.array], mx.array], kv: KVPair) -> KVPair:
    """Apply ``fn`` to all six arrays of a (keys, values) pair of packed tuples."""
    return cast(KVPair, tuple(tuple(fn(x) for x in packed) for packed in kv))


def concat_packed(a: KVPair, b: KVPair, *, axis: int) -> KVPair:
    """Concatenate two (keys, values) pairs array by array."""
    k, v = (
        tuple(mx.concatenate([x, y], axis=axis) for x, y in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True)
    )
    return cast(KVPair, (k, v))


def alloc_packed(
    batch: int, heads: int, tokens: int, dim: int, *, group_size: int, bits: int
) -> PackedKV:
    """Zeroed packed buffers for ``(batch, heads, tokens)`` float vectors of size ``dim``."""
    shape = (batch, heads, tokens)
    return (
        mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=STORAGE_DTYPE),
        mx.zeros((*shape, dim // group_size), dtype=STORAGE_DTYPE),
    )


def append_packed(
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
            alloc_packed(batch, heads, n_new, dk, group_size=group_size, bits=bits),
            alloc_packed(batch, heads, n_new, dv, group_size=group_size, bits=bits),
        )
        if buffers is None:
            buffers = new
        else:
            if used % step != 0:
                buffers = map_packed(lambda x: x[..., :used, :], buffers)
            buffers = concat_packed(buffers, new, axis=2)
    for buf, x in zip(buffers, (keys, values), strict=True):
        for dst, src in zip(buf, quantize_kv(x, group_size, bits), strict=True):
            dst[..., used : used + n, :] = src
    return buffers


class PackedKVStorage(_BaseCache):
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

    def _append(self, keys: mx.array, values: mx.array, *, used: int) -> None:
        """Quantize ``keys``/``values`` into the buffers after ``used`` tokens; keep their dtype."""
        self.dtype = keys.dtype
        self.keys, self.values = append_packed(
            self._buffers(), used, keys, values,
            group_size=self.group_size, bits=self.q_bits, step=self.step,
        )

    def _filled(self, n: int) -> KVPair:
        buffers = self._buffers()
        if buffers is None:
            raise ValueError("the cache is empty")
        if n == buffers[0][0].shape[2]:
            return buffers
        return map_packed(lambda x: x[..., :n, :], buffers)

    def _for_attention(self, kv: KVPair) -> KVPair:
        """``kv`` with scales and biases in the model's dtype, as quantized SDPA takes them.

        They are stored as float16 (:data:`STORAGE_DTYPE`: the format on disk); a query of
        another dtype would meet them in their promoted common type, float32 for a bfloat16
        model: a float32 computation nobody asked for, for which some backends have no
        kernel (CUDA's ``quantized_matmul``, ``activation: float32``). Exact for float32
        models (float16 widens exactly), rounded to bfloat16's precision for bfloat16 ones.
        """
        if self.dtype == STORAGE_DTYPE or not mx.issubdtype(self.dtype, mx.floating):
            return kv
        dtype = self.dtype
        return tuple((w, s.astype(dtype), b.astype(dtype)) for w, s, b in kv)  # type: ignore[return-value]

    def _dequantize(self, kv: KVPair, dtype: mx.Dtype, *, fused: bool = False) -> tuple[mx.array, mx.array]:
        return (
            dequantize_kv(kv[0], self.group_size, self.q_bits, dtype, fused=fused),
            dequantize_kv(kv[1], self.group_size, self.q_bits, dtype, fused=fused),
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
