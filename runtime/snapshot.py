"""Host-side (numpy) snapshots of an agent's KV cache.

A :class:`CacheSnapshot` is what crosses from the MLX thread to storage: plain
numpy arrays, never MLX arrays. Persistence (:mod:`runtime.persist`) splits the
*full-attention* layers into 256-token blocks along the token axis; sliding
layers are stored whole (they are bounded by their window).

Array layouts (batch axis of size 1 dropped; token axis is axis 1):

* ``LayerKind.Q4`` (quantized full attention), keys ``k_w, k_s, k_b, v_w, v_s, v_b``:
  ``k_w`` uint32 ``(H, T, Dk * bits / 32)``, ``k_s``/``k_b`` float16 ``(H, T, Dk / group)``;
  the same for values with ``Dv``.
* ``LayerKind.FLOAT`` (full attention kept in float: head dims no group size divides,
  or float KV mode), keys ``k, v``: ``(H, T, Dk)`` / ``(H, T, Dv)`` in the model's dtype.
* ``LayerKind.SLIDING`` (rotating window, always float), keys ``k, v``:
  ``(H, W, D)`` holding the last ``W = min(T, window)`` tokens in temporal order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LayerKind", "LayerSnapshot", "CacheSnapshot", "BLOCK_TOKENS"]

BLOCK_TOKENS = 256
"""Tokens per block: the unit of memory accounting and of persistence."""


class LayerKind(str, enum.Enum):
    """How one layer's KV is held."""

    Q4 = "q4"
    FLOAT = "float"
    SLIDING = "sliding"


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
