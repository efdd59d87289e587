"""A layer's products of one input made one product: queries, keys and values; the MLP's gate and up.

mlx-lm's llama and qwen2 layers call ``q_proj(x), k_proj(x), v_proj(x)`` in their attention and
``gate_proj(x), up_proj(x)`` in their MLP: five products of the same input a layer, seven with the
attention's output and the MLP's down projection. :func:`fuse_projections` makes them two: each
group's weights are concatenated into one module of the same kind (``qkv_proj``, ``gate_up_proj``,
a child of the attention or MLP module, so the model's parameters hold each weight once), and each
projection it replaces becomes a :class:`FusedPart` that returns its columns of the group's product.
The first part called with an input computes the product for all of them; the others take their
slices of it. mlx-lm's code is not touched: its layers call the same names with the same input.

Why (the ``fused_projections`` setting, off until a GPU run measures it): on MLX's CUDA backend every
product of more than one row (a prefill chunk, a hot turn's message, a batch's step or joint pass)
is a cuBLASLt call, and MLX 0.32.1 builds its ``CublasGemm`` afresh for each one, so each call asks
cuBLASLt for an algorithm again (``cublasLtMatmulAlgoGetHeuristic`` in
``CublasMatmulBase::execute_matmul``) and is captured into the CUDA graph as a child graph: host time
a product, whatever its size. Seven products a layer become four. On the CPU it changes nothing
measurable (``benches/results/fused_projections.md``: bitwise the same logits; first token and decode
rate within the machine's noise).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["FUSABLE_MODULES", "GROUPS", "FusedPart", "fuse_projections"]

FUSABLE_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
"""Model modules whose layers call each group's projections on one input, in one layer call
(read against mlx-lm 0.32; ``tests/model/test_fused_projections.py`` compares the logits with mlx-lm's own)."""

GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))
"""(the layer's child, the fused module's name there, the projections it replaces)."""

_PARAMETERS = ("weight", "scales", "biases", "bias")
"""A projection's arrays that the fused module holds side by side (``scales``, ``biases``: a quantized one's)."""


class _GroupProduct:
    """One group's product of the input its parts were last called with, handed out a slice per part.

    A plain object (not an ``nn.Module``), so the parts that share it add no parameters to the model.
    The slices are dropped as they are taken: nothing outlives the layer call that used it.
    """

    def __init__(self, fused: nn.Module, widths: list[int]) -> None:
        self.fused = fused
        self._cuts = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
        self._input: mx.array | None = None
        self._slices: list[mx.array | None] = [None] * len(widths)

    def slice(self, part: int, x: mx.array) -> mx.array:
        if self._input is not x or self._slices[part] is None:
            product = self.fused(x)
            self._input = x
            # One graph node with an output a part, where a slice a part would be one node each (each node costs
            # a GPU's host at every step: three a layer fewer)
            self._slices = list(mx.split(product, self._cuts, axis=-1))
        out, self._slices[part] = self._slices[part], None
        if all(s is None for s in self._slices):
            self._input = None
        return out  # type: ignore[return-value]


class FusedPart(nn.Module):
    """A projection replaced by its columns of its group's one product (see the module docstring)."""

    def __init__(self, group: _GroupProduct, part: int) -> None:
        super().__init__()
        self._group = group  # not a Module, array or container: no parameters here
        self._part = part

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.slice(self._part, x)


def _fused_module(parts: list[Any]) -> nn.Module | None:
    """One module of the parts' kind whose output is theirs side by side; None where they differ or are
    of a kind this does not join (only ``nn.Linear`` and ``nn.QuantizedLinear``, bias on all or none)."""
    kind, first = type(parts[0]), parts[0]
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in parts):
        return None
    names = [name for name in _PARAMETERS if name in first]
    if any([name for name in _PARAMETERS if name in p] != names for p in parts):
        return None  # one has a bias (or quantization biases) the others lack
    if len({p.weight.dtype for p in parts}) != 1 or (
            kind is nn.QuantizedLinear and len({(p.group_size, p.bits, p.mode) for p in parts}) != 1):
        return None
    join = {name: mx.concatenate([p[name] for p in parts], axis=0) for name in names}
    if kind is nn.QuantizedLinear:
        fused: nn.Module = nn.QuantizedLinear(first.scales.shape[-1] * first.group_size, join["weight"].shape[0],
                                              bias="bias" in names, group_size=first.group_size, bits=first.bits,
                                              mode=first.mode)
        if "biases" not in names:
            fused.pop("biases", None)
    else:
        fused = nn.Linear(join["weight"].shape[1], join["weight"].shape[0], bias="bias" in names)
    fused.update(join)  # the constructor's random weights were never evaluated: replaced, lazily
    return fused


def fuse_projections(model: Any) -> int:
    """Fuse each layer's projection groups (:data:`GROUPS`) of a :data:`FUSABLE_MODULES` model, in place.

    Each fused weight is evaluated before the projections it replaces are let go, a layer at a time, so
    the model's memory grows by one group's weights at most meanwhile. Returns the groups fused (0: the
    model's kind is not one this reads, or its projections are not of one joinable kind).
    """
    if type(model).__module__ not in FUSABLE_MODULES:
        return 0
    fused_groups = 0
    for layer in model.model.layers:
        for child_name, fused_name, names in GROUPS:
            owner = getattr(layer, child_name, None)
            parts = [getattr(owner, name, None) for name in names]
            fused = _fused_module(parts) if all(p is not None for p in parts) else None
            if fused is None:
                continue
            mx.eval(fused.parameters())
            group = _GroupProduct(fused, [p.weight.shape[0] for p in parts])
            setattr(owner, fused_name, fused)
            for i, name in enumerate(names):
                setattr(owner, name, FusedPart(group, i))
            fused_groups += 1
    return fused_groups
