"""A model's KV cache as plain data (no MLX): its geometry and at-rest format, and its host-side snapshot.

**Geometry.** :class:`KVFormat` says how full-attention KV is stored at rest
(Q4, Q8 or float), :class:`LayerSpec` one attention layer's geometry and
:class:`ModelCacheSpec` the whole model's, plus the tag every saved cache
carries. kvmem never guesses a model's cache layout from its name:
:func:`runtime.model.loaded.read_cache_spec` asks the loaded model (MLX). Each layer
is held as one :class:`LayerKind`; memory is accounted, and full-attention KV
persisted, in blocks of :data:`BLOCK_TOKENS` tokens.

**Snapshots.** A :class:`CacheSnapshot` is what crosses from the MLX thread to
storage: plain numpy arrays, never MLX arrays. Persistence
(:mod:`runtime.persist`) splits the *full-attention* layers into 256-token
blocks along the token axis; sliding layers are stored whole (they are bounded
by their window).

Array layouts (batch axis of size 1 dropped; token axis is axis 1):

* ``LayerKind.Q4`` (quantized full attention), keys ``k_w, k_s, k_b, v_w, v_s, v_b``:
  ``k_w`` uint32 ``(H, T, Dk * bits / 32)``, ``k_s``/``k_b`` float16 ``(H, T, Dk / group)``;
  the same for values with ``Dv`` (keys and values each at their own bits: :class:`KVFormat`).
* ``LayerKind.FLOAT`` (full attention kept in float: head dims no group size divides,
  or float KV mode), keys ``k, v``: ``(H, T, Dk)`` / ``(H, T, Dv)`` in the model's dtype.
* ``LayerKind.SLIDING`` (rotating window, always float), keys ``k, v``:
  ``(H, W, D)`` holding the last ``W = min(T, window)`` tokens in temporal order.

Settings, the home folder, persistence and the actors use these types without
importing MLX.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["BLOCK_TOKENS", "LayerKind", "KVFormat", "LayerSpec", "ModelCacheSpec", "LayerSnapshot", "CacheSnapshot"]

BLOCK_TOKENS = 256
"""Tokens per block: the unit of memory accounting and of persistence."""


class LayerKind(str, enum.Enum):
    """How one layer's KV is held."""

    Q4 = "q4"
    FLOAT = "float"
    SLIDING = "sliding"


# -- geometry ------------------------------------------------------------------


@dataclass(frozen=True)
class KVFormat:
    """How full-attention KV is stored at rest: ``bits=None`` keeps it in float.

    ``key_bits``: the keys' bits when they differ from the values' (``bits``), as llama.cpp's
    ``--cache-type-k q8_0 --cache-type-v q4_0``: a query's attention over thousands of keys is what
    quantization noise flips (a needle's key losing to a near-tie), where a value's error is averaged
    away by the weights. None (or equal to ``bits``): the keys take ``bits`` too.
    """

    bits: int | None = 4
    group_size: int = 64
    key_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in (None, 4, 8):
            raise ValueError(f"kv bits must be 4, 8 or None (float), got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"kv group size must be 32, 64 or 128, got {self.group_size}")
        if self.key_bits not in (None, 4, 8):
            raise ValueError(f"kv key bits must be 4, 8 or None (the values' bits), got {self.key_bits}")
        if self.key_bits is not None and self.bits is None:
            raise ValueError("kv key bits need quantized KV (kv bits 4 or 8), not float KV")
        if self.key_bits == self.bits:
            object.__setattr__(self, "key_bits", None)  # one format, one label and one tag

    @property
    def keys_bits(self) -> int:
        """The keys' bits of a quantized layer (4 where the format is float: never asked)."""
        return self.key_bits or self.bits or 4

    @property
    def values_bits(self) -> int:
        """The values' bits of a quantized layer (4 where the format is float: never asked)."""
        return self.bits or 4

    @property
    def mixed(self) -> bool:
        """Whether keys and values take different bits (``native`` attention takes one for both)."""
        return self.key_bits is not None

    @property
    def label(self) -> str:
        """``float``, ``q<bits>g<group>``, or ``k<key bits>v<bits>g<group>`` (part of every model tag)."""
        if self.bits is None:
            return "float"
        if self.mixed:
            return f"k{self.key_bits}v{self.bits}g{self.group_size}"
        return f"q{self.bits}g{self.group_size}"

    def quantized_bytes(self, kv_heads: int, k_head_dim: int, v_head_dim: int) -> int:
        """One token's packed keys and values of one layer: each dimension at its bits, and a float16 scale
        and bias per group."""
        dims = k_head_dim + v_head_dim
        return kv_heads * ((k_head_dim * self.keys_bits + v_head_dim * self.values_bits) // 8
                           + (dims // self.group_size) * 2 * 2)

    def bytes_vs_q4(self, head_dim: int = 64) -> float:
        """A token's packed bytes against the default format's (Q4 in groups of 64), at ``head_dim``."""
        return self.quantized_bytes(1, head_dim, head_dim) / KVFormat().quantized_bytes(1, head_dim, head_dim)


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache geometry."""

    kind: Literal["full", "sliding"]
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int | None = None
    sinks: bool = False

    def storage_kind(self, fmt: KVFormat) -> LayerKind:
        """How this layer is held at rest under ``fmt``."""
        if self.kind == "sliding":
            return LayerKind.SLIDING
        if fmt.bits is None:
            return LayerKind.FLOAT
        if self.k_head_dim % fmt.group_size or self.v_head_dim % fmt.group_size:
            return LayerKind.FLOAT
        return LayerKind.Q4


@dataclass(frozen=True)
class ModelCacheSpec:
    """Per-layer KV geometry of a model plus the tag every saved cache carries.

    Attributes:
        model_id: the id or path the model was loaded from.
        config_hash: sha256 of the model's config (sorted JSON), first 16 hex digits.
        layers: one :class:`LayerSpec` per transformer layer.
        dtype_bytes: bytes per element of the model's float KV.
        kv_format: the at-rest KV format.
        float_dtype: the name of the model's float KV dtype (``float32``, ``float16``,
            ``bfloat16``): what a dequantized cache is made of. Not part of the tag (the
            model's config, which the tag hashes, already decides it).
        prompt_format: how prompts of this model carry what its chat template cannot
            render (:data:`runtime.reply.generic_tools.FORMAT` for models without tool syntax; ""
            for none). Part of the tag: a cache rendered one way is never reused for another.
        fused_dequantize: a Q4 cache is dequantized by MLX's one kernel (``mx.dequantize``, the
            backend profile's choice on a GPU) instead of unpacked in float32 by plain operations
            (:func:`runtime.kv.q4_packing.dequantize_kv`). Not part of the tag (the same data either way).
    """

    model_id: str
    config_hash: str
    layers: tuple[LayerSpec, ...]
    dtype_bytes: int
    kv_format: KVFormat
    float_dtype: str = ""
    prompt_format: str = ""
    fused_dequantize: bool = False

    @property
    def float_dtype_name(self) -> str:
        """:attr:`float_dtype`, or the one ``dtype_bytes`` implies for a spec made without it."""
        return self.float_dtype or ("float32" if self.dtype_bytes == 4 else "float16")

    @property
    def tag(self) -> str:
        """Model + KV format: caches with another tag are never served."""
        tag = f"{self.model_id}@{self.config_hash}/{self.kv_format.label}"
        return f"{tag}+{self.prompt_format}" if self.prompt_format else tag

    def layer_kinds(self) -> list[LayerKind]:
        return [layer.storage_kind(self.kv_format) for layer in self.layers]

    def bytes_per_token(self) -> int:
        """At-rest bytes of one token's KV over all full-attention layers."""
        total = 0
        for layer, kind in zip(self.layers, self.layer_kinds(), strict=True):
            if kind is LayerKind.SLIDING:
                continue
            dims = layer.k_head_dim + layer.v_head_dim
            if kind is LayerKind.FLOAT:
                total += layer.kv_heads * dims * self.dtype_bytes
            else:
                total += self.kv_format.quantized_bytes(layer.kv_heads, layer.k_head_dim, layer.v_head_dim)
        return total

    def sliding_bytes(self) -> int:
        """Float bytes of all sliding-window layers when their windows are full."""
        return sum(
            layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * self.dtype_bytes * (layer.window or 0)
            for layer in self.layers
            if layer.kind == "sliding"
        )

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * BLOCK_TOKENS

    def to_json(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "config_hash": self.config_hash,
            "kv_format": self.kv_format.label,
            "layers": [layer.__dict__ for layer in self.layers],
        }


# -- snapshots -----------------------------------------------------------------


@dataclass(frozen=True)
class LayerSnapshot:
    """One layer's KV as numpy arrays (see the module docstring for layouts)."""

    kind: LayerKind
    arrays: dict[str, np.ndarray]

    @property
    def is_blocked(self) -> bool:
        """Whether this layer is split into token blocks on disk (full attention)."""
        return self.kind is not LayerKind.SLIDING

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass(frozen=True)
class CacheSnapshot:
    """An agent's whole cache: covered text, tokens, offsets and per-layer KV.

    Attributes:
        model_tag: identifies the model *and* KV format (see ``ModelCacheSpec.tag``).
        text: the text the cache covers (prompt and generated reply).
        token_ids: the tokens whose KV is stored, ``len == num_tokens``.
        offsets: end offset in ``text`` of each token (non-decreasing).
        layers: one entry per model layer.
        meta: small JSON-able extras (e.g. sliding window offsets).
    """

    model_tag: str
    text: str
    token_ids: list[int]
    offsets: list[int]
    layers: list[LayerSnapshot]
    meta: dict[str, int | str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
