"""One decode step's attention over a left-padded batch, in one CUDA kernel: each row from its own start.

Why. kvmem's float decode batch (:class:`runtime.kv.decode_kv.DecodeKVCache`) holds rows of
different lengths left-padded in one buffer, so a step's attention needs a padding mask. MLX
0.32's CUDA backend has no fused one-query kernel that takes an array mask (its vector kernel and
cuDNN's decoding path both refuse one), so every layer of every step of a batch goes to the unfused
fallback: a product, the mask, a softmax and another product, each a graph node the host pays for
at the launch. H200 run 5: a step of 8 rows launched in 4.25 ms of CPU against 2.23 ms for one row,
and the probe's masked attention took 0.208 ms a layer against 0.104 ms unmasked.

What. MLX's own one-pass vector kernel (``kernel_sdpav_1pass`` in MLX 0.32's
``scaled_dot_product_attention.cu``: 32 warps a query head, each warp a key at a time, an online
softmax, then the warps' partial sums joined in shared memory), given each row's first key
(``starts``: its padding) instead of a mask, and the keys' and values' strides, so the cache's
slice of its buffer is read where it lies. One graph node a layer, like an unpadded batch's.

It runs where MLX runs CUDA kernels (:func:`available`), for head sizes 64, 96 and 128, as MLX's
vector kernel does. The batch's attention goes through it only with the backend profile's
``padded_decode_kernel`` (off until a GPU run measures it: ``python -m benches gpu_probe``'s
batch-attention rows, which compare it with the masked fallback).
"""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["HEAD_DIMS", "available", "padded_decode_attention"]

HEAD_DIMS = (64, 96, 128)
"""Head sizes the kernel takes: MLX's vector kernel's (32 lanes, ``D / 32`` elements a lane)."""

_WARPS = 32  # warps a block, one block a (row, query head): MLX's BN

_HEADER = "#include <cooperative_groups/reduce.h>\n"

# The body of MLX 0.32's kernel_sdpav_1pass, with starts[row] for the first key and strided reads.
_SOURCE = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;

  U q[v_per_thread];
  U o[v_per_thread];
  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN];
  __shared__ U sum_exp_scores[BN];

  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int batch_idx = blockIdx.z;
  const int head_idx = blockIdx.x;
  const int kv_head_idx = head_idx / (queries_shape[1] / keys_shape[1]);
  const int key_count = keys_shape[2];
  const int first = starts[batch_idx];

  const auto* Q = queries + batch_idx * queries_strides[0] + head_idx * queries_strides[1];
  const auto* K = keys + batch_idx * keys_strides[0] + kv_head_idx * keys_strides[1]
      + (int64_t)(first + warp_idx) * keys_strides[2];
  const auto* V = values + batch_idx * values_strides[0] + kv_head_idx * values_strides[1]
      + (int64_t)(first + warp_idx) * values_strides[2];
  auto* O = out + ((int64_t)batch_idx * queries_shape[1] + head_idx) * D;
  const int64_t k_step = (int64_t)BN * keys_strides[2];
  const int64_t v_step = (int64_t)BN * values_strides[2];

  const U scale_log2 = scale[0] * 1.4426950408889634f;
  for (int i = 0; i < v_per_thread; i++) {
    q[i] = scale_log2 * static_cast<U>(Q[(v_per_thread * lane_idx + i) * queries_strides[3]]);
    o[i] = 0.f;
  }

  U max_score = Limits<U>::finite_min();
  U sum_exp_score = 0.f;
  for (int i = first + warp_idx; i < key_count; i += BN) {
    U score = 0.f;
    for (int j = 0; j < v_per_thread; j++) {
      score += q[j] * static_cast<U>(K[(v_per_thread * lane_idx + j) * keys_strides[3]]);
    }
    score = cg::reduce(warp, score, cg::plus<U>());
    U new_max = max(max_score, score);
    U factor = exp2f(max_score - new_max);
    U exp_score = exp2f(score - new_max);
    max_score = new_max;
    sum_exp_score = sum_exp_score * factor + exp_score;
    for (int j = 0; j < v_per_thread; j++) {
      o[j] = o[j] * factor + exp_score * static_cast<U>(V[(v_per_thread * lane_idx + j) * values_strides[3]]);
    }
    K += k_step;
    V += v_step;
  }

  if (lane_idx == 0) {
    max_scores[warp_idx] = max_score;
    sum_exp_scores[warp_idx] = sum_exp_score;
  }
  block.sync();

  max_score = max_scores[lane_idx];
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane_idx] * factor, cg::plus<U>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

  for (int i = 0; i < v_per_thread; i++) {
    outputs[lane_idx][warp_idx] = o[i];
    block.sync();
    U ot = outputs[warp_idx][lane_idx] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
    block.sync();
  }

  if (lane_idx == 0) {
    for (int i = 0; i < v_per_thread; i++) {
      O[v_per_thread * warp_idx + i] = static_cast<T>(o[i]);
    }
  }
"""


def available() -> bool:
    """Whether this process runs MLX's CUDA backend, where the kernel is built (at its first call)."""
    return hasattr(mx.fast, "cuda_kernel") and mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(name="kvmem_padded_decode_attention",
                               input_names=["queries", "keys", "values", "starts", "scale"],
                               output_names=["out"], source=_SOURCE, header=_HEADER, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=8)
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def padded_decode_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                            starts: mx.array) -> mx.array:
    """Attention of one query a row over the keys from ``starts[row]`` on (what comes before is padding).

    Args:
        queries: ``(B, H, 1, D)``, D one of :data:`HEAD_DIMS`.
        keys, values: ``(B, H_kv, S, D)`` in the queries' dtype (a slice of a larger buffer is read in place).
        scale: the scores' scale.
        starts: ``(B,)`` int32, each row's first key.

    Returns:
        ``(B, H, 1, D)`` in the queries' dtype.
    """
    rows, heads, length, dim = queries.shape
    if length != 1 or dim not in HEAD_DIMS or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        raise ValueError(f"one query a row of head size {HEAD_DIMS} in the keys' dtype, not {queries.shape}")
    (out,) = _kernel()(inputs=[queries, keys, values, starts, _scale(float(scale))],
                       template=[("T", queries.dtype), ("D", dim)],
                       grid=(heads * _WARPS * 32, 1, rows), threadgroup=(_WARPS * 32, 1, 1),
                       output_shapes=[(rows, heads, 1, dim)], output_dtypes=[queries.dtype])
    return out
