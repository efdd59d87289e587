"""Short passes' attention in one CUDA kernel: 1 to 64 queries a row, each row from its own first key.

Why. On MLX 0.32's CUDA backend a pass of a few queries has no good fused attention. A decode step
of a batch whose rows differ in length needs a padding mask, and neither MLX's vector kernel nor
cuDNN's decoding path takes one, so every layer falls back to unfused operations (a product, the
mask, a softmax, another product: graph nodes the host pays for at each launch). A short pass of
2 to 64 queries (a hot turn's message, a batch's joint prefill) would build a cuDNN graph for every
new shape, about 65 ms each, so kvmem's GPU policy attends those with plain operations
(:func:`runtime.cpu.attention.plain_attention`), about 15 nodes a layer. H200 run 5: a step of 8
rows launched in 4.25 ms of CPU against one row's 2.23; a 1B's 13-token hot pass at 16K launched in
7 ms; the joint prefill of 8 joins in 32 ms.

What. MLX's own one-pass vector kernel (``kernel_sdpav_1pass`` in MLX 0.32's
``scaled_dot_product_attention.cu``: 32 warps a query, each warp a key at a time, an online softmax,
then the warps' partial sums joined in shared memory), given each row's first key (``starts``: its
left padding; 0 for a lone row) instead of a mask, a causal bound per query (the queries are the
last of the keys, as MLX's ``"causal"`` aligns them), and the keys' and values' strides, so a
cache's slice of its buffer is read where it lies. One graph node a layer.

It runs where MLX runs CUDA kernels (:func:`available`), for head sizes 64, 96 and 128, as MLX's
vector kernel does. Attention goes through it with the backend profile's
``short_attention_kernel`` (on under the GPU policy on CUDA since H200 run 6: a 1B's decode step of
8 rows launched in 3.5 ms against 6.6 through the masked fallback, and the suite's device tests
against MLX's masked attention passed; ``python -m benches gpu_probe``'s batch-attention rows
compare it with the others).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from runtime.backend import cuda_kernel_tolerance
from runtime.backend import cuda_kernels_run as available  # where the kernel runs: the device's one answer

__all__ = ["HEAD_DIMS", "MAX_QUERIES", "SHORT_PASS_KEYS", "available", "check", "reference", "short_attention"]

HEAD_DIMS = (64, 96, 128)
"""Head sizes the kernel takes: MLX's vector kernel's (32 lanes, ``D / 32`` elements a lane)."""

MAX_QUERIES = 64
"""Most queries a row the kernel is used for: a block a query, each reading its keys whole (a prefill
chunk's thousands of queries keep cuDNN's kernel)."""

SHORT_PASS_KEYS = 2048
"""Most keys a pass of two or more queries a row goes through the kernel with; one query (a padded
batch's decode step) goes at any length. Each block reads its query's keys alone, so a pass's
reads grow with queries times keys where plain operations' products share them: H200 run 6
(``benches/results/gpu_runs/2026-11-28-run6-probe.md``, a 1B layer, 16 queries) took 0.18 ms
against plain operations' 0.50 over 1,000 keys, 0.48 against 0.29-0.53 over 4,000, and 1.31
against 0.51-0.58 over 16,000 (a hot turn's message at 16K: 16 layers of that)."""

_WARPS = 32  # warps a block, one block a (row, query head, query): MLX's BN

_HEADER = "#include <cooperative_groups/reduce.h>\n"

# The body of MLX 0.32's kernel_sdpav_1pass, with starts[row] for the first key, a causal bound per query
# (blockIdx.y) and strided reads.
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
  const int query_idx = blockIdx.y;
  const int query_count = queries_shape[2];
  const int kv_head_idx = head_idx / (queries_shape[1] / keys_shape[1]);
  const int key_end = keys_shape[2] - query_count + query_idx + 1;  // causal: the queries are the last keys
  const int first = starts[batch_idx];

  const auto* Q = queries + batch_idx * queries_strides[0] + head_idx * queries_strides[1]
      + (int64_t)query_idx * queries_strides[2];
  const auto* K = keys + batch_idx * keys_strides[0] + kv_head_idx * keys_strides[1]
      + (int64_t)(first + warp_idx) * keys_strides[2];
  const auto* V = values + batch_idx * values_strides[0] + kv_head_idx * values_strides[1]
      + (int64_t)(first + warp_idx) * values_strides[2];
  auto* O = out + (((int64_t)batch_idx * queries_shape[1] + head_idx) * query_count + query_idx) * D;
  const int64_t k_step = (int64_t)BN * keys_strides[2];
  const int64_t v_step = (int64_t)BN * values_strides[2];

  const U scale_log2 = scale[0] * 1.4426950408889634f;
  for (int i = 0; i < v_per_thread; i++) {
    q[i] = scale_log2 * static_cast<U>(Q[(v_per_thread * lane_idx + i) * queries_strides[3]]);
    o[i] = 0.f;
  }

  U max_score = Limits<U>::finite_min();
  U sum_exp_score = 0.f;
  for (int i = first + warp_idx; i < key_end; i += BN) {
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



@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(name="kvmem_short_attention",
                               input_names=["queries", "keys", "values", "starts", "scale"],
                               output_names=["out"], source=_SOURCE, header=_HEADER, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=8)
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def short_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                    starts: mx.array) -> mx.array:
    """Attention of 1 to :data:`MAX_QUERIES` queries a row, causal, over the keys from ``starts[row]`` on.

    The queries are the last positions of the keys (as MLX's ``"causal"`` mask aligns them): query
    ``q`` of ``L`` sees keys ``starts[row]`` to ``S - L + q``; what comes before a row's first key is
    its padding.

    Args:
        queries: ``(B, H, L, D)``, D one of :data:`HEAD_DIMS`.
        keys, values: ``(B, H_kv, S, D)`` in the queries' dtype (a slice of a larger buffer is read in place).
        scale: the scores' scale.
        starts: ``(B,)`` int32, each row's first key.

    Returns:
        ``(B, H, L, D)`` in the queries' dtype.
    """
    rows, heads, length, dim = queries.shape
    if not 1 <= length <= MAX_QUERIES or dim not in HEAD_DIMS or keys.dtype != queries.dtype \
            or values.dtype != queries.dtype:
        raise ValueError(f"1 to {MAX_QUERIES} queries a row of head size {HEAD_DIMS} in the keys' dtype, "
                         f"not {queries.shape} {queries.dtype} over {keys.dtype}")
    (out,) = _kernel()(inputs=[queries, keys, values, starts, _scale(float(scale))],
                       template=[("T", queries.dtype), ("D", dim)],
                       grid=(heads * _WARPS * 32, length, rows), threadgroup=(_WARPS * 32, 1, 1),
                       output_shapes=[(rows, heads, length, dim)], output_dtypes=[queries.dtype])
    return out


def reference(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, starts: mx.array) -> mx.array:
    """What :func:`short_attention` computes, by MLX's attention with the mask it stands for: causal, each row
    from its first key (``starts``)."""
    n, s = queries.shape[2], keys.shape[2]
    positions = mx.arange(s)[None, None, None, :]
    causal = positions <= (mx.arange(n) + s - n)[None, None, :, None]
    mask = (positions >= starts[:, None, None, None]) & causal
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def check(dtype: mx.Dtype, head_dims: set[int] | frozenset[int]) -> str | None:
    """Build the kernel for ``dtype`` and each of ``head_dims`` it takes, and hold it to :func:`reference`:
    None when it gives it, else what went wrong.

    MLX compiles a custom kernel on the machine at its first call (NVRTC): H200 run 6's probe took 2,140 ms
    for the first call and 0.26 after. Made at a model's load, that wait is not a server's first batch's.
    Each head size: a padded batch's decode step and a short pass (one query and five a row; a row with
    no padding, one with some, one whose first query sees one key), keys and values a slice of a longer
    buffer as a cache hands them over; the reference runs on MLX's CPU. A load whose check fails attends
    as if the kernel were off.
    """
    try:
        for dim in sorted(d for d in head_dims if d in HEAD_DIMS):
            for length in (1, 5):
                keys, values = (mx.random.normal((3, 2, 340, dim), key=mx.random.key(seed)).astype(dtype)[:, :, :300]
                                for seed in (1, 2))
                queries = mx.random.normal((3, 4, length, dim), key=mx.random.key(3)).astype(dtype)
                starts = mx.array([0, 17, 300 - length], dtype=mx.int32)
                ours = short_attention(queries, keys, values, scale=dim**-0.5, starts=starts)
                with mx.stream(mx.cpu):  # an independent device's
                    theirs = reference(queries, keys, values, scale=dim**-0.5, starts=starts)
                worst = mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item()
                if not worst <= cuda_kernel_tolerance(dtype):
                    return f"{length} queries of head size {dim} in {dtype}: off MLX's attention by {worst:.3g}"
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build or launch here is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None
