"""Quantized projections MLX's CUDA backend has no fast prefill kernel for, made float at load.

MLX 0.32's CUDA ``quantized_matmul`` (``mlx/backend/cuda/quantized/quantized.cpp`` and
``qmm/qmm.cu``, read at v0.32.1) picks, for a pass of 8 or more rows (a prefill chunk):

* ``qmm_sm80``, a CUTLASS kernel, when the output width is a multiple of 128, the input width a
  multiple of ``max(64, group_size)``, the bits 4 or 8 and the activations float16 or bfloat16;
* else ``qmm_naive``, a kernel JIT-compiled (NVRTC) per shape class, whose first call on a fresh
  machine is very slow.

Under 8 rows (a decode step) ``qmv`` serves every shape. Llama-3's widths are multiples of 128.
SmolLM2-135M's are not: 576 wide, 192 for its keys and values. That is kvmem's default model,
and on an H200 (run 4) its first 1,000-token forward did not end within a minute. Ten needle
prefills at 8K took 221 s, about 30 times what the 1B geometry's took.

So on CUDA each quantized projection the fast kernel does not take becomes a float ``nn.Linear``
in the model's float dtype: cuBLAS, no JIT, and exactly the values the quantized kernel would
have dequantized. The rest stay packed. The memory cost is small: SmolLM2-135M's attention
projections and down projections, about 150 MB in float16.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

__all__ = ["has_fast_prefill_kernel", "float_where_no_fast_kernel"]

FAST_BITS = (4, 8)
FAST_ACTIVATIONS = (mx.float16, mx.bfloat16)


def has_fast_prefill_kernel(out_features: int, in_features: int, *, bits: int, group_size: int, mode: str,
                            activations: mx.Dtype) -> bool:
    """Whether MLX's CUDA backend multiplies a prefill chunk by this quantized projection with its
    CUTLASS kernel (``qmm_sm80``), not the JIT-compiled naive one (see the module docstring)."""
    return (mode == "affine" and bits in FAST_BITS and activations in FAST_ACTIVATIONS
            and out_features % 128 == 0 and in_features % max(64, group_size) == 0)


def float_where_no_fast_kernel(model: nn.Module, dtype: mx.Dtype, *, activations: mx.Dtype | None = None
                               ) -> tuple[list[str], int]:
    """Replace each ``nn.QuantizedLinear`` of ``model`` that :func:`has_fast_prefill_kernel` rejects
    for ``activations`` (the dtype the model computes in; default ``dtype``) with a float ``nn.Linear``
    of the same values in ``dtype``; returns (the names replaced, how many quantized projections there were)."""
    replaced: list[tuple[str, nn.Module]] = []
    quantized = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear):
            continue
        quantized += 1
        mode = getattr(module, "mode", "affine")
        out_features = module.weight.shape[0]
        in_features = module.weight.shape[1] * 32 // module.bits
        if has_fast_prefill_kernel(out_features, in_features, bits=module.bits, group_size=module.group_size,
                                   mode=mode, activations=activations or dtype):
            continue
        weight = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
                               mode=mode).astype(dtype)
        linear = nn.Linear(in_features, out_features, bias="bias" in module)
        linear.weight = weight
        if "bias" in module:
            linear.bias = module.bias.astype(dtype)
        replaced.append((name, linear))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())
    return [name for name, _ in replaced], quantized
