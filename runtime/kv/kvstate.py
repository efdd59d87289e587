"""An agent's KV between turns (``ParkedCache``) and while it runs (``ActiveKV``).

Between turns an agent's cache is *parked*: full-attention layers as packed Q4
tuples (or float where a head dim cannot be packed), sliding-window layers as
the last ``window + SLIDING_SLACK`` tokens in temporal order. Parked caches live
in the hot tier and are what persistence writes and reads.

When a sequence runs, its cache is *activated* into mlx-lm cache objects:

* attention ``at-rest``: Q4 layers are dequantized once into float ``KVCache``;
  on parking only the tokens added this turn are quantized and appended to the
  parked Q4 prefix (quantization groups run along the head dim, so per-token
  quantization equals whole-cache quantization).
* attention ``native``: Q4 layers become :class:`runtime.kv.q4_cache.QuantizedKVCache`
  and the model attends with MLX's quantized SDPA on the packed data (layers with
  attention sinks attend on a transient dequantized copy).

The slack kept on sliding layers lets a turn be trimmed by a few tokens (stop
strings, EXACT re-prompts) without losing the window a cold run would see.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import logging

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from runtime.backend import device_profile
from runtime.kv.float_resident import FloatResident, LayerKV, with_room
from runtime.kv.host_copy import HostCopy
from runtime.kv.q4_cache import DequantizingQuantizedKVCache, QuantizedKVCache, check_packed
from runtime.kv.q4_packing import dequantize_kv, quantize_kv
from runtime.kv.upload import to_device
from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot, ModelCacheSpec

__all__ = [
    "ParkedCache",
    "ParkedLayer",
    "ActiveKV",
    "AttentionMode",
    "SLIDING_SLACK",
    "resolve_attention",
    "settle_attention",
    "with_kept_float",
]

AttentionMode = Literal["at-rest", "native"]

log = logging.getLogger("kvmem.kvstate")


def resolve_attention(name: str) -> AttentionMode:
    """Map ``auto`` to the backend profile's attention for this device (:mod:`runtime.backend`).

    ``auto`` is ``at-rest`` on every device: native Q4 quantizes each token as it
    arrives and loses needles float keeps (docs/models.md), and on MLX's CPU backend
    float attention is also 2-4x faster than quantized SDPA for prefill
    (benches/results/attention_strategy.md). ``native`` is there when asked (the
    engine checks its kernels at load: :func:`settle_attention`).
    """
    if name in ("at-rest", "native"):
        return name  # type: ignore[return-value]
    return device_profile(attention=name).attention  # raises ValueError for an unknown name


NATIVE_PROBE_TOKENS = 300
NATIVE_PROBE_PROMPT = "Check the attention kernels once. " * 50
"""The throwaway prompt that checks native Q4 attention at load: a few hundred tokens, so its
prefill (one chunk of up to :data:`NATIVE_PROBE_TOKENS`, then the rest) uses the matrix
kernels a real chunk does (a few tokens take the vector kernels); then one decode step in
a batch, as real turns take."""


def settle_attention(lm: Any, attention: AttentionMode) -> tuple[AttentionMode, str | None]:
    """The attention ``lm`` can run here: ``native`` only once a throwaway native turn ran.

    MLX's backends do not implement every quantized kernel for every shape and dtype
    (CUDA: ``[quantized_matmul] No implementation for problem shape ... activation:
    float32``), so asking for ``native`` by device is not enough: the model's own
    shapes and dtypes are tried once, at load. A failure gives ``at-rest`` and a note
    naming the missing kernel (logged once), never a failed start.
    """
    if attention != "native" or lm.spec.kv_format.bits is None:
        return attention, None
    if lm.spec.kv_format.mixed:
        note = f"native Q4 attention takes one bits for keys and values, not {lm.spec.kv_format.label}"
        log.warning("%s; attending at rest (float while active) instead", note)
        return "at-rest", note
    from runtime.execution.decode_batch import DecodeBatch  # noqa: PLC0415 - the batch builds on this module
    from runtime.execution.sequence import SequenceSampling, Sequence  # noqa: PLC0415

    try:
        probe = Sequence(lm, NATIVE_PROBE_PROMPT, None, SequenceSampling(max_tokens=2), attention="native")
        while probe.prefill_step(NATIVE_PROBE_TOKENS) is None:
            pass
        if probe.finish_reason is None:
            batch = DecodeBatch(shared_prefix_check=False)
            batch.add(probe)
            batch.step_once()
    except Exception as exc:  # noqa: BLE001 - any kernel error means: not here
        reason = str(exc).splitlines()[0][:300]
        note = f"native Q4 attention failed its load check: {reason}"
        log.warning("%s; attending at rest (float while active) instead", note)
        return "at-rest", note
    return "native", None

SLIDING_SLACK = 64
"""Extra tokens kept beyond a sliding window so a turn can be trimmed exactly."""

_Q4_KEYS = ("k_w", "k_s", "k_b", "v_w", "v_s", "v_b")


def _chunk_tokens(chunk: dict[str, mx.array]) -> int:
    return int(next(iter(chunk.values())).shape[2])


@dataclass(frozen=True)
class ParkedLayer:
    """One layer's parked KV: chunks of MLX arrays shaped ``(1, H, T, ...)``, token axis 2.

    A turn appends a chunk instead of copying the cache, and a truncated copy
    (a shared prefix, a PARTIAL match) slices chunks, which shares their
    buffers: agents that start from another agent's prefix hold the same
    memory (copy-on-write: nothing ever writes into a parked chunk).
    """

    kind: LayerKind
    chunks: tuple[dict[str, mx.array], ...] = ()

    @classmethod
    def of(cls, kind: LayerKind, arrays: dict[str, mx.array]) -> ParkedLayer:
        return cls(kind, (arrays,) if arrays else ())

    @property
    def arrays(self) -> dict[str, mx.array]:
        """The whole layer as one set of arrays (concatenated on demand)."""
        if len(self.chunks) <= 1:
            return self.chunks[0] if self.chunks else {}
        return {k: mx.concatenate([c[k] for c in self.chunks], axis=2) for k in self.chunks[0]}

    @property
    def num_tokens(self) -> int:
        return sum(_chunk_tokens(c) for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for c in self.chunks for a in c.values())

    def sliced(self, start: int, stop: int) -> ParkedLayer:
        out, pos = [], 0
        for chunk in self.chunks:
            n = _chunk_tokens(chunk)
            lo, hi = max(start, pos), min(stop, pos + n)
            if lo < hi:
                whole = lo == pos and hi == pos + n
                out.append(chunk if whole else {k: v[:, :, lo - pos : hi - pos] for k, v in chunk.items()})
            pos += n
        return ParkedLayer(self.kind, tuple(out))

    def appended(self, other: ParkedLayer) -> ParkedLayer:
        return ParkedLayer(self.kind, self.chunks + other.chunks)


@dataclass(frozen=True)
class ParkedCache:
    """An agent's cache between turns: covered text, tokens, offsets and parked layers.

    ``text == full_text[:offsets[-1]]`` always holds: the cache covers exactly the
    text its tokens spell, no more.
    """

    model_tag: str
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    layers: tuple[ParkedLayer, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    # The float buffers its last turn left (runtime.kv.float_resident): a cache of the activation only.
    resident: FloatResident | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @classmethod
    def empty(cls, spec: ModelCacheSpec) -> ParkedCache:
        return cls(spec.tag, "", (), (), tuple(ParkedLayer(k) for k in spec.layer_kinds()))

    def truncated(self, keep: int, spec: ModelCacheSpec) -> ParkedCache | None:
        """The first ``keep`` tokens of this cache, or None when a sliding layer has
        too little history left to reproduce the window a cold run would see."""
        if keep >= self.num_tokens:
            return self
        drop = self.num_tokens - keep
        layers = []
        for layer, lspec in zip(self.layers, spec.layers, strict=True):
            if layer.kind is LayerKind.SLIDING:
                stored = layer.num_tokens
                if stored - drop < min(keep, lspec.window or 0):
                    return None
                layers.append(layer.sliced(0, stored - drop))
            else:
                layers.append(layer.sliced(0, keep))
        text_end = self.offsets[keep - 1] if keep else 0
        return replace(
            self,
            text=self.text[:text_end],
            token_ids=self.token_ids[:keep],
            offsets=self.offsets[:keep],
            layers=tuple(layers),
        )

    def to_snapshot(self) -> CacheSnapshot:
        """Copy to host numpy arrays (batch axis dropped) for persistence, in one evaluation
        (:class:`runtime.kv.host_copy.HostCopy`, which also makes it a part at a time)."""
        copy = HostCopy(self, by_copy=False)
        copy.make_rest()
        return copy.snapshot()

    def snapshot_of(self, layers: list[LayerSnapshot]) -> CacheSnapshot:
        """The snapshot whose layers are ``layers`` (every layer's host copy, in order: :class:`runtime.kv.host_copy.HostCopy`)."""
        if len(layers) != len(self.layers):
            raise ValueError(f"a snapshot needs all {len(self.layers)} layers, got {len(layers)}")
        return CacheSnapshot(
            model_tag=self.model_tag,
            text=self.text,
            token_ids=list(self.token_ids),
            offsets=list(self.offsets),
            layers=layers,
            meta=dict(self.meta),
        )

    @classmethod
    def from_snapshot(cls, snap: CacheSnapshot, *, float_dtype: mx.Dtype, by_copy: bool = False) -> ParkedCache:
        """The parked cache of ``snap`` (host arrays) on the device; ``by_copy``: through ``mx.load``,
        one copy an array, not the page faults of managed memory on CUDA (:mod:`runtime.kv.upload`)."""
        flat = {f"{i}.{name}": arr for i, layer in enumerate(snap.layers) for name, arr in layer.arrays.items()}
        on_device = to_device(flat, by_copy=by_copy)
        layers = []
        for i, layer in enumerate(snap.layers):
            arrays = {}
            for name, arr in layer.arrays.items():
                value = on_device[f"{i}.{name}"][None]
                if arr.dtype == np.float32 and name in ("k", "v"):
                    value = value.astype(float_dtype)
                arrays[name] = value
            layers.append(ParkedLayer.of(layer.kind, arrays))
        return cls(
            model_tag=snap.model_tag,
            text=snap.text,
            token_ids=tuple(snap.token_ids),
            offsets=tuple(snap.offsets),
            layers=tuple(layers),
            meta=dict(snap.meta),
        )


class ActiveKV:
    """One sequence's live mlx-lm caches plus the parked cache they grew from.

    Args:
        parked: the (possibly truncated) parked cache this turn starts from.
        spec: the model's cache spec.
        attention: ``at-rest`` or ``native`` (see the module docstring).
    """

    def __init__(self, parked: ParkedCache, spec: ModelCacheSpec, attention: AttentionMode | str) -> None:
        self.base = parked
        self.spec = spec
        self.attention = resolve_attention(attention)
        kept: list[LayerKV | None] | None = None
        if parked.resident is not None and self.attention == "at-rest":
            kept = parked.resident.take(parked.num_tokens)
        self.resumed_float = kept is not None  # the activation was skipped (runtime.kv.float_resident)
        self.caches: list[Any] = [
            _activate_layer(layer, lspec, spec, self.attention, parked.num_tokens, kept[i] if kept else None)
            for i, (layer, lspec) in enumerate(zip(parked.layers, spec.layers, strict=True))
        ]

    @property
    def groupable(self) -> bool:
        """Whether a group prefill (:mod:`runtime.execution.batch_prefill`) can take these caches: float
        ``KVCache`` layers over the parked tokens (``at-rest`` or float KV; no sliding window)."""
        return self.attention == "at-rest" and all(
            type(c) is KVCache and c.offset == self.base.num_tokens for c in self.caches
        ) and all(layer.kind is not LayerKind.SLIDING for layer in self.base.layers)

    def park(self, *, text: str, token_ids: list[int], offsets: list[int],
             keep_float: bool = False, wait: bool = True, caches: list[Any] | None = None) -> ParkedCache | None:
        """Freeze the first ``len(token_ids)`` tokens back into a parked cache.

        ``caches``: where the tokens are now, when not in :attr:`caches` (a decoding sequence's
        row of the batch, :meth:`runtime.execution.decode_batch.DecodeBatch.row_caches`).

        With ``keep_float`` (``at-rest`` only) the parked cache also keeps these float
        buffers as its :class:`~runtime.kv.float_resident.FloatResident`, the tokens this
        turn added overwritten by their dequantized Q4: the sequence must not run again.
        ``wait=False`` (the GPU policy's turn end) launches the quantization without waiting
        for the device: the next job queues behind it on the same stream.
        Returns None if a sliding layer cannot be trimmed that far (the caller then
        drops the cache and the next turn starts cold).
        """
        keep = len(token_ids)
        n_base = self.base.num_tokens
        keep_float = keep_float and self.attention == "at-rest"
        layers, floats = [], []
        for cache, base, lspec in zip(self.caches if caches is None else caches, self.base.layers,
                                      self.spec.layers, strict=True):
            parked = _park_layer(cache, base, lspec, self.spec, self.attention, n_base=n_base, keep=keep,
                                 keep_float=keep_float)
            if parked is None:
                return None
            layer, kept = parked
            layers.append(layer)
            floats.append(kept)
        overwrites = [f for f in floats if isinstance(f, _KeptFloat)]
        if overwrites and wait:
            # Every layer quantized in one evaluation, before any buffer is overwritten in place.
            mx.eval([a for f in overwrites for a in (*f.kq, *f.vq)])
            floats = [f() if isinstance(f, _KeptFloat) else f for f in floats]
        # Not waiting, the overwrite waits for the resident's next turn (FloatResident.take): by then the
        # quantization has run and MLX writes the buffers in place (now it would copy every buffer whole).
        pending = [a for layer in layers for chunk in layer.chunks for a in chunk.values()]
        resident = None
        if keep_float and any(kv is not None for kv in floats):
            resident = FloatResident(floats, keep)
            pending += [a for kv in floats if isinstance(kv, tuple) for a in kv]
        if wait:
            mx.eval(pending)
        else:
            mx.async_eval(pending)
        return ParkedCache(
            model_tag=self.spec.tag,
            text=text,
            token_ids=tuple(token_ids),
            offsets=tuple(offsets),
            layers=tuple(layers),
            meta=dict(self.base.meta),
            resident=resident,
        )


def _activate_layer(layer: ParkedLayer, lspec: Any, spec: ModelCacheSpec, attention: AttentionMode, offset: int,
                    kept: LayerKV | None = None) -> Any:
    fmt = spec.kv_format
    if kept is not None and offset and layer.kind is LayerKind.Q4 and attention != "native":
        # The float buffers of this cache's last turn: the same values dequantizing its Q4 makes (its chunks are
        # not even joined: on a GPU's host every concatenation built is paid for, evaluated or not)
        cache = KVCache()
        cache.keys, cache.values = kept
        cache.offset = offset
        return cache
    a = layer.arrays
    if layer.kind is LayerKind.SLIDING:
        cache = RotatingKVCache(max_size=(lspec.window or 0) + SLIDING_SLACK)
        if a:
            cache.state = (a["k"], a["v"], offset, 0, cache.max_size, int(a["k"].shape[2]))
        return cache
    if layer.kind is LayerKind.FLOAT:
        cache = KVCache()
        if a:
            cache.state = (a["k"], a["v"], offset)
        return cache
    group = fmt.group_size
    packed = None
    if a:
        packed = ((a["k_w"], a["k_s"], a["k_b"]), (a["v_w"], a["v_s"], a["v_b"]))
    if attention == "native":
        if fmt.mixed:  # settle_attention gives such a format at-rest: native attention takes one bits
            raise ValueError(f"native attention needs one bits for keys and values, not {fmt.label}")
        cls = DequantizingQuantizedKVCache if lspec.sinks else QuantizedKVCache
        if packed is None:
            return cls(group_size=group, bits=fmt.values_bits)
        return cls.from_packed(*packed, group_size=group, bits=fmt.values_bits)
    cache = KVCache()
    if packed is not None:
        tokens = {check_packed(name, kv, group, bits)
                  for name, kv, bits in (("keys", packed[0], fmt.keys_bits), ("values", packed[1], fmt.values_bits))}
        if len(tokens) != 1:
            raise ValueError(f"keys and values disagree: {packed[0][0].shape} vs {packed[1][0].shape}")
        dtype, fused = _float_dtype(spec), spec.fused_dequantize
        keys = dequantize_kv(packed[0], group, fmt.keys_bits, dtype, fused=fused)
        values = dequantize_kv(packed[1], group, fmt.values_bits, dtype, fused=fused)
        cache.state = (keys, values, offset)
    return cache


def _float_dtype(spec: ModelCacheSpec) -> mx.Dtype:
    return getattr(mx, spec.float_dtype_name)  # a bfloat16 model's float KV stays bfloat16


def _kv_of(cache: Any) -> tuple[mx.array, mx.array]:
    """Float keys/values of a KVCache or a rotating cache, in temporal order."""
    if isinstance(cache, RotatingKVCache):
        keys, values, offset, _keep, _max, idx = cache.state
        n = keys.shape[2]
        if offset <= n:
            return keys[:, :, :offset], values[:, :, :offset]
        if idx == n:
            return keys, values
        return (
            mx.concatenate([keys[:, :, idx:], keys[:, :, :idx]], axis=2),
            mx.concatenate([values[:, :, idx:], values[:, :, :idx]], axis=2),
        )
    if cache.keys is None:
        raise ValueError("cache is empty")
    return cache.keys[:, :, : cache.offset], cache.values[:, :, : cache.offset]


def _park_layer(
    cache: Any,
    base: ParkedLayer,
    lspec: Any,
    spec: ModelCacheSpec,
    attention: AttentionMode,
    *,
    n_base: int,
    keep: int,
    keep_float: bool = False,
) -> tuple[ParkedLayer, LayerKV | _KeptFloat | None] | None:
    """The parked layer, and (``keep_float``, Q4 at-rest layers) the float buffers to keep beside it:
    a :class:`_KeptFloat` when this turn's tokens must first be overwritten by their dequantized Q4."""
    if keep == 0:
        return ParkedLayer(base.kind), None
    if base.kind is LayerKind.SLIDING:
        keys, values = _kv_of(cache)
        total = int(cache.offset)
        drop = total - keep
        stored = int(keys.shape[2]) - drop
        if stored < min(keep, lspec.window or 0):
            return None
        start = max(0, stored - ((lspec.window or 0) + SLIDING_SLACK))
        return ParkedLayer.of(base.kind, {"k": keys[:, :, start:stored], "v": values[:, :, start:stored]}), None
    if base.kind is LayerKind.FLOAT:
        keys, values = _kv_of(cache)
        return ParkedLayer.of(base.kind, {"k": keys[:, :, :keep], "v": values[:, :, :keep]}), None
    start = min(n_base, keep)
    if attention == "native" and keep > start:
        (kw, ks, kb), (vw, vs, vb) = cache.packed()
        arrays = dict(zip(_Q4_KEYS, (kw, ks, kb, vw, vs, vb), strict=True))
        # Only the new tokens become a chunk (compacted, so it keeps no view of the rest).
        new = ParkedLayer.of(base.kind, {k: mx.contiguous(v[:, :, start:keep]) for k, v in arrays.items()})
        return base.sliced(0, start).appended(new), None
    kept = base.sliced(0, start)
    kept_float = keep_float and type(cache) is KVCache and cache.keys is not None
    if keep == start:
        return kept, (cache.keys, cache.values) if kept_float else None
    if type(cache) is KVCache:  # the turn's tokens in one slice of the buffer (a node fewer an array on a GPU's host)
        keys, values = cache.keys[:, :, start:keep], cache.values[:, :, start:keep]
    else:
        keys, values = (x[:, :, start:keep] for x in _kv_of(cache))
    fmt = spec.kv_format
    kq = quantize_kv(keys, fmt.group_size, fmt.keys_bits)
    vq = quantize_kv(values, fmt.group_size, fmt.values_bits)
    layer = kept.appended(ParkedLayer.of(base.kind, dict(zip(_Q4_KEYS, (*kq, *vq), strict=True))))
    if not kept_float:
        return layer, None
    return layer, _KeptFloat(cache, start, keep, kq, vq, _float_dtype(spec), spec.kv_format, spec.fused_dequantize)


@dataclass
class _KeptFloat:
    """A layer's float buffers to keep, once this turn's tokens hold what activating its Q4 would give."""

    cache: KVCache
    start: int
    keep: int
    kq: tuple[mx.array, ...]
    vq: tuple[mx.array, ...]
    dtype: mx.Dtype
    fmt: Any
    fused: bool = False  # the spec's fused_dequantize: the same road as activating the Q4

    @property
    def nbytes(self) -> int:
        return self.cache.keys.nbytes + self.cache.values.nbytes

    def __call__(self) -> LayerKV:
        """Write this turn's tokens as their dequantized Q4 (the quantized ones already evaluated, so
        MLX overwrites the buffers in place), and return the buffers."""
        fmt = self.fmt
        self.cache.keys[..., self.start : self.keep, :] = dequantize_kv(self.kq, fmt.group_size, fmt.keys_bits,
                                                                        self.dtype, fused=self.fused)
        self.cache.values[..., self.start : self.keep, :] = dequantize_kv(self.vq, fmt.group_size, fmt.values_bits,
                                                                          self.dtype, fused=self.fused)
        return self.cache.keys, self.cache.values

def with_kept_float(parked: ParkedCache, spec: ModelCacheSpec) -> ParkedCache:
    """``parked`` with the float buffers a turn would leave it (:mod:`runtime.kv.float_resident`), made now.

    For a cache restored from disk ahead of its turn: its Q4 layers dequantized (as
    :class:`ActiveKV` would) into buffers with room for the turn's first tokens.
    """
    kv = ActiveKV(replace(parked, resident=None), spec, "at-rest")
    n = parked.num_tokens
    floats: list[LayerKV | None] = []
    for cache, layer in zip(kv.caches, parked.layers, strict=True):
        if layer.kind in (LayerKind.SLIDING, LayerKind.FLOAT) or type(cache) is not KVCache or cache.keys is None:
            floats.append(None)
            continue
        floats.append((with_room(cache.keys[..., :n, :]), with_room(cache.values[..., :n, :])))
    mx.eval([a for kv_pair in floats if kv_pair is not None for a in kv_pair])
    if all(f is None for f in floats):
        return parked
    return replace(parked, resident=FloatResident(floats, n))
