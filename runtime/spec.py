"""ModelCacheSpec: the KV geometry of a loaded model, read from the model itself.

kvmem never guesses a model's cache layout from its name. It asks the model
for its caches (``model.make_cache()``), runs one token through them, and reads
the shapes the attention layers actually wrote: kv heads, key and value head
dims (which differ in DeepSeek-V2's MLA), and which layers are sliding windows.
:class:`~runtime.kvformat.KVFormat` and :class:`~runtime.kvformat.LayerSpec`,
plain data, live in :mod:`runtime.kvformat` (importable without MLX) and are
re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from runtime.errors import UnsupportedModelError
from runtime.kvformat import KVFormat, LayerSpec
from runtime.snapshot import BLOCK_TOKENS, LayerKind

__all__ = ["LayerSpec", "ModelCacheSpec", "KVFormat"]

log = logging.getLogger("kvmem.spec")

_DTYPE_BYTES = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}


@dataclass(frozen=True)
class ModelCacheSpec:
    """Per-layer KV geometry of a model plus the tag every saved cache carries.

    Attributes:
        model_id: the id or path the model was loaded from.
        config_hash: sha256 of the model's config (sorted JSON), first 16 hex digits.
        layers: one :class:`LayerSpec` per transformer layer.
        dtype_bytes: bytes per element of the model's float KV.
        kv_format: the at-rest KV format.
    """

    model_id: str
    config_hash: str
    layers: tuple[LayerSpec, ...]
    dtype_bytes: int
    kv_format: KVFormat

    @property
    def tag(self) -> str:
        """Model + KV format: caches with another tag are never served."""
        return f"{self.model_id}@{self.config_hash}/{self.kv_format.label}"

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
                bits, group = self.kv_format.bits or 16, self.kv_format.group_size
                total += layer.kv_heads * (dims * bits // 8 + (dims // group) * 2 * 2)
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

    @classmethod
    def from_model(
        cls, model: Any, *, model_id: str, config: dict[str, Any], kv_format: KVFormat | None = None
    ) -> ModelCacheSpec:
        """Read the spec by running one token through ``model.make_cache()``.

        Raises:
            UnsupportedModelError: a layer's cache is not a plain or rotating KV cache
                (SSM states, chunked or composite caches), or the model has no cache.
        """
        kv_format = kv_format or KVFormat()
        make_cache = getattr(model, "make_cache", None)
        caches = make_cache() if make_cache else [KVCache() for _ in model.layers]
        for i, cache in enumerate(caches):
            if type(cache) not in (KVCache, RotatingKVCache):
                raise UnsupportedModelError(
                    f"layer {i} uses {type(cache).__name__}; kvmem caches only full-attention "
                    "(KVCache) and sliding-window (RotatingKVCache) layers"
                )
        model(mx.array([[0]]), cache=caches)
        layers = []
        dtype = None
        for i, cache in enumerate(caches):
            keys, values = cache.state[0], cache.state[1]
            dtype = keys.dtype
            sliding = isinstance(cache, RotatingKVCache)
            layers.append(
                LayerSpec(
                    kind="sliding" if sliding else "full",
                    kv_heads=int(keys.shape[1]),
                    k_head_dim=int(keys.shape[3]),
                    v_head_dim=int(values.shape[3]),
                    window=int(cache.max_size) if sliding else None,
                    sinks=_layer_has_sinks(model, i),
                )
            )
        if not layers:
            raise UnsupportedModelError("model has no attention layers to cache")
        config_json = json.dumps(config, sort_keys=True, default=str).encode()
        spec = cls(
            model_id=model_id,
            config_hash=hashlib.sha256(config_json).hexdigest()[:16],
            layers=tuple(layers),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 4),
            kv_format=kv_format,
        )
        unpackable = [
            i
            for i, (layer, kind) in enumerate(zip(layers, spec.layer_kinds(), strict=True))
            if layer.kind == "full" and kind is LayerKind.FLOAT and kv_format.bits is not None
        ]
        if unpackable:
            log.warning(
                "kv head dims %s are not divisible by group size %d: %d layer(s) keep float KV",
                sorted({(layers[i].k_head_dim, layers[i].v_head_dim) for i in unpackable}),
                kv_format.group_size,
                len(unpackable),
            )
        return spec


def _layer_has_sinks(model: Any, index: int) -> bool:
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", [])
    if index >= len(layers):
        return False
    attn = getattr(layers[index], "self_attn", None)
    return getattr(attn, "sinks", None) is not None
