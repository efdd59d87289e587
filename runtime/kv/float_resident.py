"""An agent's float KV kept after its turn, so its next hot turn skips dequantizing the Q4 cache.

Under ``at-rest`` attention a turn starts by dequantizing the agent's whole
parked Q4 cache into float (about 120 ms for 4K tokens of kvmem-default on a
2-core CPU, 250 ms for 8K), although the turn before had exactly that float
cache in memory a moment ago. :class:`FloatResident` keeps it: when a turn
parks, the float buffers of its Q4 layers stay with the parked cache, with the
tokens this turn added overwritten by ``dequantize(quantize(new))``. That is
what dequantizing the parked Q4 cache gives, element for element (the same
functions on the same values), so a turn that starts from the resident floats
computes bit for bit what a turn that dequantizes would: the resident is a
cache of the activation, never a second version of the agent's memory.

Under the GPU policy a turn's park is launched without a wait, so the overwrite of its new tokens is
left pending (:class:`PendingKV`): the save's host copy after the turn makes it
(:meth:`FloatResident.settle`), else the turn that takes the buffers does.

A resident serves one turn: :meth:`FloatResident.take` hands its buffers over
(the turn writes its new tokens into them) and leaves it empty, so a turn that
fails or a second reader simply dequantizes. Memory is bounded by
:class:`ResidentPool` (``keep_float_mb``): the least recently parked residents
are dropped first; a resident also goes when its parked cache does.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from runtime.cpu.kv_copy import tokens_with_room
from runtime.kv.decode_kv import host_padding

__all__ = ["FloatResident", "PendingKV", "ResidentPool", "HEADROOM_TOKENS", "extract_with_room", "room_for",
           "row_view", "with_room"]

HEADROOM_TOKENS = 256
"""Room kept past a resident's tokens, so the next turn's first tokens do not grow (copy) the buffers."""

LayerKV = tuple[mx.array, mx.array]


class PendingKV(Protocol):
    """Float buffers whose last writes wait for the turn that takes them (``runtime.kv.kvstate``'s
    park without a wait): calling it makes the writes and returns the buffers."""

    nbytes: int

    def __call__(self) -> LayerKV: ...


class FloatResident:
    """The float keys and values ``(1, H, capacity, D)`` of a parked cache's Q4 layers (None elsewhere).

    Args:
        layers: per layer, the float buffers, buffers still to be finished (:class:`PendingKV`: done
            by :meth:`take`), or None (layers kept some other way).
        tokens: how many leading tokens of the buffers are the parked cache's.
    """

    def __init__(self, layers: list[LayerKV | PendingKV | None], tokens: int) -> None:
        self._layers: list[LayerKV | PendingKV | None] | None = layers
        self.tokens = tokens
        self.nbytes = sum(kv[0].nbytes + kv[1].nbytes if isinstance(kv, tuple) else kv.nbytes
                          for kv in layers if kv is not None)
        self._on_empty: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._layers is not None

    def take(self, tokens: int) -> list[LayerKV | None] | None:
        """The buffers, once, for a turn that starts from the first ``tokens`` tokens (None: already taken)."""
        layers = self._layers
        if layers is None or tokens > self.tokens:
            return None
        self.drop()
        return _written(layers)

    @property
    def pending(self) -> bool:
        """Whether writes wait for the turn that takes the buffers (:class:`PendingKV`)."""
        return self._layers is not None and any(kv is not None and not isinstance(kv, tuple) for kv in self._layers)

    def settle(self) -> None:
        """Make the pending writes now, launched without a wait, so the turn that takes the buffers builds none
        of them (a row's four operations a layer: a batch of 8 hot rows' joint pass held about 500 of them).

        Called once the parked Q4 they read is evaluated (its save's host copy read it): MLX then writes
        the buffers in place, as :meth:`take` would."""
        if self._layers is None or not self.pending:
            return
        self._layers = _written(self._layers)
        mx.async_eval([a for kv in self._layers if kv is not None for a in kv])

    def drop(self) -> None:
        """Free the buffers (the next turn dequantizes)."""
        self._layers = None
        if self._on_empty is not None:
            self._on_empty()


def _written(layers: list[LayerKV | PendingKV | None]) -> list[LayerKV | None]:
    """``layers`` with every pending one's writes made (lazily: nothing is evaluated here)."""
    return [kv if kv is None or isinstance(kv, tuple) else kv() for kv in layers]


class ResidentPool:
    """At most ``max_bytes`` of residents, the least recently parked dropped first.

    Residents are added on the MLX thread, but a resident is forgotten on whichever thread drops
    its parked cache's last reference (the hot tier lives with the actors), hence the lock.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # Weak: a resident whose parked cache is gone (evicted, forgotten) frees itself.
        self._held: OrderedDict[int, tuple[weakref.ref[FloatResident], int]] = OrderedDict()
        self.bytes = 0
        self.dropped = 0
        self._lock = threading.RLock()  # re-entered: dropping a resident forgets it

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit without dropping a resident."""
        return self.bytes + nbytes <= self.max_bytes

    def add(self, resident: FloatResident) -> bool:
        """Keep ``resident`` (dropping older ones to make room); False (and dropped) if it cannot fit."""
        if not resident.held:
            return False
        if resident.nbytes > self.max_bytes:
            resident.drop()
            return False
        with self._lock:
            return self._add(resident)

    def _add(self, resident: FloatResident) -> bool:
        key = id(resident)
        self._held[key] = (weakref.ref(resident), resident.nbytes)
        self.bytes += resident.nbytes
        resident._on_empty = weakref.finalize(resident, self._forget, key)
        while self.bytes > self.max_bytes and self._held:
            ref, _ = next(iter(self._held.values()))
            oldest = ref()
            if oldest is None:  # gone, its finalizer not yet run: forget it here (the finalizer then finds nothing)
                self._forget(next(iter(self._held)))
                continue
            oldest.drop()
            self.dropped += 1
        return True

    def _forget(self, key: int) -> None:
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self.bytes -= held[1]


def room_for(tokens: int) -> int:
    """The length of a buffer kept for ``tokens`` tokens: :data:`HEADROOM_TOKENS` more, rounded up
    to ``KVCache``'s growth step."""
    return -(-(tokens + HEADROOM_TOKENS) // KVCache.step) * KVCache.step


def with_room(tokens: mx.array) -> mx.array:
    """``tokens`` ``(B, H, T, D)`` copied into a buffer of :func:`room_for` ``T`` tokens, so a turn's
    first tokens do not grow (copy) it again."""
    return tokens_with_room(tokens, room_for(tokens.shape[2]))


def row_view(cache: Any, idx: int) -> Any:
    """Row ``idx`` of a batch cache as a single-sequence cache: a float batch's as a ``KVCache`` over
    views of its buffers (nothing copied), any other as ``cache.extract(idx)``."""
    if not isinstance(cache, BatchKVCache) or cache.keys is None:
        return cache.extract(idx)
    padding = host_padding(cache)[idx]  # a DecodeKVCache's from the host: no wait for the queued steps
    row = KVCache()
    row.keys = cache.keys[idx : idx + 1, :, padding : cache._idx]
    row.values = cache.values[idx : idx + 1, :, padding : cache._idx]
    row.offset = cache._idx - padding
    return row


def extract_with_room(cache: Any, idx: int) -> Any:
    """``cache.extract(idx)``, with room past the row's tokens for a float batch cache (:func:`with_room`).

    mlx-lm's ``BatchKVCache.extract`` copies the row to an array exactly as long as
    its tokens, so the next turn's first token would grow (copy) every layer again;
    this copies it once into a buffer with room, as ``KVCache`` itself grows.
    """
    row = row_view(cache, idx)
    if isinstance(cache, BatchKVCache) and cache.keys is not None:
        row.keys, row.values = with_room(row.keys), with_room(row.values)
    return row
