"""Products of 2 to 16 rows in one CUDA kernel of kvmem's, not cuBLASLt: a batch's decode step, a hot turn's message.

Why. On MLX 0.32's CUDA backend a product of one row is MLX's own gemv kernel, and a product of two
or more rows is a cuBLASLt call whose ``CublasGemm`` MLX builds afresh each time, asking cuBLASLt
for an algorithm again and capturing the call into the CUDA graph: host time a product, whatever
its size. H200 run 6 (``benches/results/gpu_runs/2026-11-28-run6-probe.md``, products section): a
1B layer's seven products went to the device in 0.077 ms of submit at one row and 0.26-0.27 ms at
2 to 13 rows, about 37 µs a product against 11. A 1B decode step has 112 products (64 fused), so a
batch of 8 rows paid about 3 ms of host time a step more than one row, and a hot turn's 13-token
message as much, while the device sat idle: on a GPU these passes are the host's work.

What. MLX's gemv (one warp an output, its lanes across the inputs, a warp reduction), each warp
reading its weight row once for all of the input's rows (up to :data:`MAX_ROWS` accumulators a
lane): one kernel launch a product, like a one-row product's. The weights are read once, as a gemv reads
them; the input rows (at most 16 x the input width: 64 KB at 2,048 wide in bfloat16) are read by each of
a block's 16 warps, from L1 after the first, and from L2 once a block.

It runs where MLX runs CUDA kernels (:func:`available`), for float16, bfloat16 and float32. A model's
``nn.Linear`` layers go through it with the backend profile's ``small_products_kernel`` (on under the GPU
policy), via :func:`take_small_products`, once the load's :func:`check` held it to MLX's product on the
device (else MLX's products, with one warning line). ``python -m benches gpu_probe``'s products section
times it beside cuBLASLt's, and the suite's device tests compare it with MLX's product.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from runtime.backend import cuda_kernel_tolerance
from runtime.backend import cuda_kernels_run as available  # where the kernel runs: the device's one answer
import mlx.nn as nn

__all__ = ["MAX_ROWS", "SmallRowsLinear", "available", "check", "small_product", "take_small_products"]

MAX_ROWS = 16
"""Most input rows the kernel takes (its accumulators a lane); more rows keep cuBLASLt, which is faster there."""

_WARPS = 16  # warps a block, one output column each (MLX's gemv has 8): the block's warps share the input rows in L1

_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

_HEADER = "#include <cooperative_groups/reduce.h>\n"

# x: (M, K) row-contiguous, w: (N, K) row-contiguous (an nn.Linear's weight), out: (M, N) = x @ w.T. Each lane reads
# 16 bytes of a row at a time (8 bfloat16 or float16, 4 float32) where the rows allow it, one element otherwise.
_SOURCE = """
  constexpr int MMAX = 16;
  constexpr int WARPS = 16;
  constexpr int VEC = 16 / sizeof(T);
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int n = blockIdx.x * WARPS + warp.meta_group_rank();
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  if (n >= N) {
    return;  // a whole warp: its column is past the end
  }
  float acc[MMAX];
#pragma unroll
  for (int m = 0; m < MMAX; m++) {
    acc[m] = 0.f;
  }
  const T* w_row = w + (int64_t)n * K;
  // 16-byte loads need every row to start on 16 bytes: a width that is a multiple of VEC, operands aligned.
  const bool vectors = K % VEC == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0
      && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  const int vector_end = vectors ? K : 0;
  for (int k = lane * VEC; k < vector_end; k += 32 * VEC) {
    const uint4 w_raw = *reinterpret_cast<const uint4*>(w_row + k);
    const T* wv = reinterpret_cast<const T*>(&w_raw);
#pragma unroll
    for (int m = 0; m < MMAX; m++) {
      if (m < M) {
        const uint4 x_raw = *reinterpret_cast<const uint4*>(x + (int64_t)m * K + k);
        const T* xv = reinterpret_cast<const T*>(&x_raw);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
          sum += static_cast<float>(wv[j]) * static_cast<float>(xv[j]);
        }
        acc[m] += sum;
      }
    }
  }
  for (int k = vector_end + lane; k < K; k += 32) {
    const float wk = static_cast<float>(w_row[k]);
#pragma unroll
    for (int m = 0; m < MMAX; m++) {
      if (m < M) {
        acc[m] += wk * static_cast<float>(x[(int64_t)m * K + k]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MMAX; m++) {
    if (m < M) {
      const float total = cg::reduce(warp, acc[m], cg::plus<float>());
      if (lane == 0) {
        out[(int64_t)m * N + n] = static_cast<T>(total);
      }
    }
  }
"""


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="kvmem_small_product", input_names=["x", "w"], output_names=["out"],
                               source=_SOURCE, header=_HEADER, ensure_row_contiguous=True)


def small_product(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for ``x`` of 1 to :data:`MAX_ROWS` rows ``(M, K)`` and ``w`` ``(N, K)``, one kernel launch.

    Raises:
        ValueError: more rows than the kernel takes, shapes that do not match, or dtypes other than one
            float type shared by both.
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or not 1 <= x.shape[0] <= MAX_ROWS \
            or x.dtype != w.dtype or x.dtype not in _DTYPES:
        raise ValueError(f"1 to {MAX_ROWS} rows (M, K) against (N, K) of one float dtype, not "
                         f"{x.shape} {x.dtype} against {w.shape} {w.dtype}")
    rows, columns = x.shape[0], w.shape[0]
    blocks = -(-columns // _WARPS)
    (out,) = _kernel()(inputs=[x, w], template=[("T", x.dtype)], grid=(blocks * _WARPS * 32, 1, 1),
                       threadgroup=(_WARPS * 32, 1, 1), output_shapes=[(rows, columns)], output_dtypes=[x.dtype])
    return out


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` whose products of 2 to :data:`MAX_ROWS` rows go through :func:`small_product`.

    One row keeps MLX's gemv (as fast a launch already); more rows keep cuBLASLt. The layer's
    parameters are its own: :func:`take_small_products` changes only its class.
    """

    def __call__(self, x: mx.array) -> mx.array:
        width = x.shape[-1]
        rows = x.size // width if width else 0
        if not 2 <= rows <= MAX_ROWS or x.dtype != self.weight.dtype or x.dtype not in _DTYPES:
            return super().__call__(x)
        out = small_product(x.reshape(rows, width), self.weight).reshape(*x.shape[:-1], self.weight.shape[0])
        return out + self["bias"] if "bias" in self else out


def take_small_products(model: nn.Module) -> int:
    """Send every float ``nn.Linear`` of ``model`` (a fused projection group's included) through the kernel;
    returns how many. Quantized layers keep MLX's quantized kernels."""
    layers = [m for _, m in model.named_modules() if type(m) is nn.Linear]
    for layer in layers:
        layer.__class__ = SmallRowsLinear
    return len(layers)


_CHECKS = ((2, 1000, 2048), (9, 2048, 70), (16, 100, 4096))
"""The products a load holds the kernel to: (rows, columns, width); widths that are and are not a multiple
of a 16-byte load's elements, columns off the block's 16."""


def check(dtype: mx.Dtype) -> str | None:
    """Build the kernel for ``dtype`` and hold it to MLX's product: None when it gives it, else what went wrong.

    MLX compiles a custom kernel on the machine at its first call (about 2 s for kvmem's attention kernel
    on H200 run 6), which a model's load can wait for, not a turn. The operands are random, in ``dtype``,
    each product once on aligned operands and once on ``x`` read from one element into a buffer (the
    kernel's one-element road); the reference is the same product in float32 on MLX's CPU, and the
    kernel must be within ``dtype``'s rounding of it. A load whose check fails keeps MLX's products.
    """
    if dtype not in _DTYPES:
        return f"{dtype} is not a dtype the kernel takes"
    try:
        for i, (rows, columns, width) in enumerate(_CHECKS):
            w = (mx.random.normal((columns, width), key=mx.random.key(2 * i)) * width**-0.5).astype(dtype)
            flat = mx.random.normal((rows * width + 1,), key=mx.random.key(2 * i + 1)).astype(dtype)
            for x in (flat[: rows * width].reshape(rows, width), flat[1:].reshape(rows, width)):
                with mx.stream(mx.cpu):  # exact float32 products (a GPU's may round their inputs to TF32)
                    reference = x.astype(mx.float32) @ w.astype(mx.float32).T
                worst = mx.abs(small_product(x, w).astype(mx.float32) - reference).max().item()
                allowed = cuda_kernel_tolerance(dtype) * max(1.0, mx.abs(reference).max().item())
                if not worst <= allowed:
                    return (f"{rows} rows of {width} by {columns} in {dtype}: off MLX's product by {worst:.3g} "
                            f"(allowed {allowed:.3g})")
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build or launch here is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None
