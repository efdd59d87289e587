"""The at-rest KV format and one layer's cache geometry, as plain data (no MLX).

:class:`KVFormat` says how full-attention KV is stored at rest (Q4, Q8 or
float) and :class:`LayerSpec` one attention layer's geometry. They live apart
from :mod:`runtime.spec`, which reads them off a loaded model with MLX, so
that settings, the home folder and persistence can use them without importing
MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runtime.snapshot import LayerKind

__all__ = ["KVFormat", "LayerSpec"]


@dataclass(frozen=True)
class KVFormat:
    """How full-attention KV is stored at rest: ``bits=None`` keeps it in float."""

    bits: int | None = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (None, 4, 8):
            raise ValueError(f"kv bits must be 4, 8 or None (float), got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"kv group size must be 32, 64 or 128, got {self.group_size}")

    @property
    def label(self) -> str:
        """``float``, or ``q<bits>g<group>`` (part of every model tag)."""
        return "float" if self.bits is None else f"q{self.bits}g{self.group_size}"


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
