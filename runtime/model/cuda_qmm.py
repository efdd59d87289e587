"""Quantized projections on CUDA: a small model's made float at load, a larger one's kernels compiled at load.

MLX 0.32's CUDA ``quantized_matmul`` (``mlx/backend/cuda/quantized/quantized.cpp`` and ``qmm/``,
read at v0.32.1) multiplies a pass of fewer than 8 rows (a decode step) with ``qmv``, built with
MLX. A pass of 8 or more rows (a prefill chunk, a hot turn's message, a batch's joint pass or its
tied head) takes a CUTLASS kernel:

* ``qmm_sm80`` when the output width is a multiple of 128, the input width a multiple of
  ``max(64, group_size)``, the bits 4 or 8 and the activations float16 or bfloat16;
* else ``qmm_naive``, slower to run as well.

Both are compiled on the machine (NVRTC) the first time they are used: one module per activation
dtype, row tile (16, 32 or 64: passes of up to 16 rows, up to 32, more), bits, group size and mode
(``qmm_naive`` also: transposed or not, and whether the input width leaves a residue). MLX keeps
the PTX in its cache (``MLX_PTX_CACHE_DIR``, by default under the temp folder), so a machine pays
each module once; a turn that meets one first waits for the compile. kvmem's default model
(SmolLM2-135M, Q4_1, 576 wide) met them on an H200: its first 1,000-token forward did not end
within a minute (run 4), and with its narrow projections made float its gate and up projections
still went to ``qmm_sm80``: 6 needle trials at 8K took 152 s (run 5), each a few 8K prefills of a
135M model.

So on CUDA, at load (:func:`float_for_cuda`, then :func:`warm_quantized_kernels`):

* a model whose quantized projections (a quantized embedding, a tied head, included), made float,
  take at most :data:`SMALL_MODEL_FLOAT_BYTES` has all of them made float in its float dtype:
  cuBLAS, nothing compiled, exactly the values the quantized kernels would have dequantized; at
  this size a decode step's pace is its launches', not its weight reads (the default model: about
  270 MB in float16);
* a larger model keeps its projections packed (a decode step reads a quarter of the bytes), but
  those ``qmm_sm80`` does not take go float, and the modules its packed ones use are compiled at
  load: one small product per row tile for each kind of packed projection, so no turn waits for one.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

__all__ = ["SMALL_MODEL_FLOAT_BYTES", "WARM_ROWS", "has_fast_prefill_kernel", "float_for_cuda",
           "warm_quantized_kernels"]

FAST_BITS = (4, 8)
FAST_ACTIVATIONS = (mx.float16, mx.bfloat16)
SMALL_MODEL_FLOAT_BYTES = 2**30
"""A model whose quantized projections take at most this much made float has all of them made float on CUDA."""
WARM_ROWS = (16, 32, 64)
"""A pass's rows for each of MLX's CUDA row tiles (16, 32, 64): one warm-up product each compiles them all."""

Quantized = nn.QuantizedLinear | nn.QuantizedEmbedding


def has_fast_prefill_kernel(out_features: int, in_features: int, *, bits: int, group_size: int, mode: str,
                            activations: mx.Dtype) -> bool:
    """Whether MLX's CUDA backend multiplies a prefill chunk by this quantized projection with its
    CUTLASS kernel (``qmm_sm80``), not the naive one (see the module docstring)."""
    return (mode == "affine" and bits in FAST_BITS and activations in FAST_ACTIVATIONS
            and out_features % 128 == 0 and in_features % max(64, group_size) == 0)


def _shape(module: Quantized) -> tuple[int, int]:
    """``(out_features, in_features)`` of a quantized projection (an embedding's: its rows, its dims)."""
    return module.weight.shape[0], module.weight.shape[1] * 32 // module.bits


def _fast(module: Quantized, activations: mx.Dtype) -> bool:
    out_features, in_features = _shape(module)
    return has_fast_prefill_kernel(out_features, in_features, bits=module.bits, group_size=module.group_size,
                                   mode=getattr(module, "mode", "affine"), activations=activations)


def _quantized(model: nn.Module) -> list[tuple[str, Quantized]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def _as_float(module: Quantized, dtype: mx.Dtype) -> nn.Module:
    """``module`` as the float layer of the same values in ``dtype``."""
    weight = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
                           mode=getattr(module, "mode", "affine")).astype(dtype)
    out_features, in_features = _shape(module)
    if isinstance(module, nn.QuantizedEmbedding):
        layer: nn.Module = nn.Embedding(out_features, in_features)
    else:
        layer = nn.Linear(in_features, out_features, bias="bias" in module)
        if "bias" in module:
            layer.bias = module.bias.astype(dtype)
    layer.weight = weight
    return layer


def float_for_cuda(model: nn.Module, dtype: mx.Dtype, *, activations: mx.Dtype | None = None,
                   small_bytes: int = SMALL_MODEL_FLOAT_BYTES) -> tuple[list[str], int]:
    """Make float (``dtype``) every quantized projection of ``model`` when all of them, so made, take at most
    ``small_bytes``; else those :func:`has_fast_prefill_kernel` rejects for ``activations`` (the dtype the model
    computes in; default ``dtype``). Returns the names replaced and how many quantized projections there were."""
    activations = activations or dtype
    quantized = _quantized(model)
    small = sum(o * i for o, i in map(_shape, (m for _, m in quantized))) * dtype.size <= small_bytes
    replaced = [(name, _as_float(m, dtype)) for name, m in quantized if small or not _fast(m, activations)]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())
    return [name for name, _ in replaced], len(quantized)


def warm_quantized_kernels(model: nn.Module, activations: mx.Dtype, rows: tuple[int, ...] = WARM_ROWS) -> int:
    """Run one product of each row count in ``rows`` through one projection of each kind ``model`` still
    has packed (what MLX's CUDA modules are compiled per: bits, group size, mode, whether the kernel is the
    fast one, an input width's residue; a quantized embedding as a tied head), so a turn finds them
    compiled. Returns how many products ran."""
    kinds: dict[tuple[Any, ...], Quantized] = {}
    for _, m in _quantized(model):
        _, in_features = _shape(m)
        key = (m.bits, m.group_size, getattr(m, "mode", "affine"), _fast(m, activations),
               in_features % max(64, m.group_size) != 0, isinstance(m, nn.QuantizedEmbedding))
        kinds.setdefault(key, m)
    for m in kinds.values():
        _, in_features = _shape(m)
        project = m.as_linear if isinstance(m, nn.QuantizedEmbedding) else m
        mx.eval([project(mx.zeros((1, n, in_features), activations)) for n in rows])
    return len(kinds) * len(rows)
