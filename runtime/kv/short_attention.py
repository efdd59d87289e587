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

A short pass over more than :data:`SHORT_PASS_KEYS` keys (a hot turn's message over a long
conversation) takes MLX's two-pass vector kernel adapted the same way instead (:func:`long_attention`:
the keys split over 32 blocks, a warp attending for a key head's whole query head group), where the
model's load held it to MLX's attention (:func:`check_long_keys`); without it plain operations.

It runs where MLX runs CUDA kernels (:func:`available`), for head sizes 64, 96 and 128, as MLX's
vector kernel does. Attention goes through it with the backend profile's
``short_attention_kernel`` (on under the GPU policy on CUDA since H200 run 6: a 1B's decode step of
8 rows launched in 3.5 ms against 6.6 through the masked fallback, and the suite's device tests
against MLX's masked attention passed; ``python -m benches gpu_probe``'s batch-attention rows
compare it with the others).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import mlx.core as mx

from runtime.backend import cuda_kernel_tolerance
from runtime.backend import cuda_kernels_run as available  # where the kernel runs: the device's one answer

__all__ = ["HEAD_DIMS", "MAX_QUERIES", "SHORT_PASS_KEYS", "MAX_GROUP", "SPLITS", "available", "check",
           "check_long_keys", "long_attention", "reference", "short_attention", "takes_long_keys"]

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
against 0.51-0.58 over 16,000 (a hot turn's message at 16K: 16 layers of that). Past it such a pass takes
:func:`long_attention`'s two passes where the model's load held them to MLX's results (:func:`check_long_keys`)."""

MAX_GROUP = 8
"""Most query heads a key head serves (grouped-query attention) that :func:`long_attention` takes: a warp keeps
each of its group's queries and sums in registers."""

SPLITS = 32
"""Blocks a (row, key head, query)'s keys are split over in :func:`long_attention`'s first pass; the second pass
joins them, a warp's lane each (MLX's two-pass kernel's ``blocks``)."""

MAX_PARTIALS_BYTES = 64 * 2**20
"""Most float32 scratch :func:`long_attention` allocates for its partial sums (rows x heads x queries x
:data:`SPLITS` x head size): a batch's joint pass of many long rows keeps the other roads."""

_WARPS = 32  # warps a block, one block a (row, query head, query): MLX's BN

_HEADER = "#include <cooperative_groups/reduce.h>\n"

_THREAD_INDICES = """
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();
"""
"""The block, its warps, and this thread's lane and warp: how every kernel here begins."""

_JOIN_WARPS = """
  // The 32 parts joined (a block's warps, or a pass's splits): lane l holds part l's max (max_score) and sum
  // (lane_sum), warp w part w's output (o); through shared memory warp w then sums its elements over the parts,
  // each rescaled to their common max, and its first lane writes them to O.
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  U total = cg::reduce(warp, lane_sum * factor, cg::plus<U>());
  total = total == 0 ? 0 : __frcp_rn(total);
  for (int i = 0; i < v_per_thread; i++) {
    outputs[lane_idx][warp_idx] = o[i];
    block.sync();
    U ot = outputs[warp_idx][lane_idx] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<U>()) * total;
    block.sync();
  }
  if (lane_idx == 0) {
    for (int i = 0; i < v_per_thread; i++) {
      O[v_per_thread * warp_idx + i] = static_cast<T>(o[i]);
    }
  }
"""
"""How a kernel here ends: its 32 parts' partial attention joined and written out."""

# The body of MLX 0.32's kernel_sdpav_1pass, with starts[row] for the first key, a causal bound per query
# (blockIdx.y) and strided reads.
_SOURCE = _THREAD_INDICES + """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;

  U q[v_per_thread];
  U o[v_per_thread];
  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN];
  __shared__ U sum_exp_scores[BN];

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
  const U lane_sum = sum_exp_scores[lane_idx];
""" + _JOIN_WARPS



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
    def cases() -> Iterator[tuple[str, Callable[..., mx.array], tuple[mx.array, ...]]]:
        for dim in sorted(d for d in head_dims if d in HEAD_DIMS):
            for length in (1, 5):
                keys, values = (mx.random.normal((3, 2, 340, dim), key=mx.random.key(seed)).astype(dtype)[:, :, :300]
                                for seed in (1, 2))
                queries = mx.random.normal((3, 4, length, dim), key=mx.random.key(3)).astype(dtype)
                starts = mx.array([0, 17, 300 - length], dtype=mx.int32)
                yield (f"{length} queries of head size {dim} in {dtype}", short_attention,
                       (queries, keys, values, starts))

    return _first_problem(cases(), dtype, none=f"no head size of {sorted(head_dims)} is one it takes, {HEAD_DIMS}")


# The long-keys road: MLX 0.32's kernel_sdpav_2pass_1 and _2 (``scaled_dot_product_attention.cu``), with
# starts[row] for the first key, a causal bound per query (blockIdx.y), strided keys and values, and a warp
# attending for every query head of its key head (G of them, grouped-query attention): each key and value is
# read once for the group instead of once a query head.
_LONG_FIRST_SOURCE = _THREAD_INDICES + """
  constexpr int BN = 8;  // warps a block, each a key at a time
  constexpr int BD = 32;
  constexpr int splits = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;

  U q[G][v_per_thread];
  U o[G][v_per_thread];
  U max_score[G];
  U sum_exp_score[G];
  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN][G];
  __shared__ U sum_exp_scores[BN][G];

  const int kv_head_idx = blockIdx.x;
  const int query_idx = blockIdx.y;
  const int batch_idx = blockIdx.z / splits;
  const int split_idx = blockIdx.z % splits;
  const int heads = queries_shape[1];
  const int query_count = queries_shape[2];
  const int key_end = keys_shape[2] - query_count + query_idx + 1;  // causal: the queries are the last keys
  const int first = starts[batch_idx];

  const U scale_log2 = scale[0] * 1.4426950408889634f;
  for (int g = 0; g < G; g++) {
    const auto* Q = queries + batch_idx * queries_strides[0] + (int64_t)(kv_head_idx * G + g) * queries_strides[1]
        + (int64_t)query_idx * queries_strides[2];
    for (int i = 0; i < v_per_thread; i++) {
      q[g][i] = scale_log2 * static_cast<U>(Q[(v_per_thread * lane_idx + i) * queries_strides[3]]);
      o[g][i] = 0.f;
    }
    max_score[g] = Limits<U>::finite_min();
    sum_exp_score[g] = 0.f;
  }

  // This warp's keys: every (splits * BN)-th from the row's first on, the block's split of them.
  int key = first + split_idx * BN + warp_idx;
  const auto* K = keys + batch_idx * keys_strides[0] + kv_head_idx * keys_strides[1]
      + (int64_t)key * keys_strides[2];
  const auto* V = values + batch_idx * values_strides[0] + kv_head_idx * values_strides[1]
      + (int64_t)key * values_strides[2];
  const int64_t k_step = (int64_t)(splits * BN) * keys_strides[2];
  const int64_t v_step = (int64_t)(splits * BN) * values_strides[2];
  for (; key < key_end; key += splits * BN) {
    U k[v_per_thread];
    U v[v_per_thread];
    for (int j = 0; j < v_per_thread; j++) {
      k[j] = static_cast<U>(K[(v_per_thread * lane_idx + j) * keys_strides[3]]);
      v[j] = static_cast<U>(V[(v_per_thread * lane_idx + j) * values_strides[3]]);
    }
    for (int g = 0; g < G; g++) {
      U score = 0.f;
      for (int j = 0; j < v_per_thread; j++) {
        score += q[g][j] * k[j];
      }
      score = cg::reduce(warp, score, cg::plus<U>());
      U new_max = max(max_score[g], score);
      U factor = exp2f(max_score[g] - new_max);
      U exp_score = exp2f(score - new_max);
      max_score[g] = new_max;
      sum_exp_score[g] = sum_exp_score[g] * factor + exp_score;
      for (int j = 0; j < v_per_thread; j++) {
        o[g][j] = o[g][j] * factor + exp_score * v[j];
      }
    }
    K += k_step;
    V += v_step;
  }

  if (lane_idx == 0) {
    for (int g = 0; g < G; g++) {
      max_scores[warp_idx][g] = max_score[g];
      sum_exp_scores[warp_idx][g] = sum_exp_score[g];
    }
  }
  block.sync();

  // The block's warps joined, a query head at a time: its split's output, sum and max.
  for (int g = 0; g < G; g++) {
    U warp_max = lane_idx < BN ? max_scores[lane_idx][g] : Limits<U>::finite_min();
    U block_max = cg::reduce(warp, warp_max, cg::greater<U>());
    U warp_sum = lane_idx < BN ? sum_exp_scores[lane_idx][g] * exp2f(warp_max - block_max) : 0.f;
    U block_sum = cg::reduce(warp, warp_sum, cg::plus<U>());
    const int64_t p = (((int64_t)batch_idx * heads + kv_head_idx * G + g) * query_count + query_idx) * splits
        + split_idx;
    if (warp_idx == 0 && lane_idx == 0) {
      sums[p] = block_sum;
      maxs[p] = block_max;
    }
    const U own = exp2f(max_scores[warp_idx][g] - block_max);
    for (int i = 0; i < v_per_thread; i++) {
      outputs[warp_idx][lane_idx] = o[g][i] * own;
      block.sync();
      if (warp_idx == 0) {
        U total = 0.f;
        for (int w = 0; w < BN; w++) {
          total += outputs[w][lane_idx];
        }
        partials[p * D + v_per_thread * lane_idx + i] = total;
      }
      block.sync();
    }
  }
"""

_LONG_SECOND_SOURCE = _THREAD_INDICES + """
  constexpr int BN = 32;  // warps a block: a split each
  constexpr int BD = 32;
  constexpr int splits = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;

  U o[v_per_thread];
  __shared__ U outputs[BN][BD + 1];

  const int head_idx = blockIdx.x;
  const int query_idx = blockIdx.y;
  const int batch_idx = blockIdx.z;
  const int heads = sums_shape[1];
  const int query_count = sums_shape[2];
  const int64_t p = (((int64_t)batch_idx * heads + head_idx) * query_count + query_idx) * splits;

  // Lane s holds split s's max and sum; warp w reads split w's partial output.
  U max_score = maxs[p + lane_idx];
  const U lane_sum = sums[p + lane_idx];
  const float* P = partials + (p + warp_idx) * D;
  for (int i = 0; i < v_per_thread; i++) {
    o[i] = P[v_per_thread * lane_idx + i];
  }
  auto* O = out + (((int64_t)batch_idx * heads + head_idx) * query_count + query_idx) * D;
""" + _JOIN_WARPS


@functools.cache
def _long_kernels() -> tuple[object, object]:
    first = mx.fast.cuda_kernel(name="kvmem_long_attention_splits",
                                input_names=["queries", "keys", "values", "starts", "scale"],
                                output_names=["partials", "sums", "maxs"], source=_LONG_FIRST_SOURCE,
                                header=_HEADER, ensure_row_contiguous=False)
    second = mx.fast.cuda_kernel(name="kvmem_long_attention_join", input_names=["partials", "sums", "maxs"],
                                 output_names=["out"], source=_LONG_SECOND_SOURCE, header=_HEADER)
    return first, second


def _group(heads: int, kv_heads: int) -> int | None:
    """Query heads a key head serves, where they are whole groups of at most :data:`MAX_GROUP` (a warp keeps its
    group's queries and sums in registers); else None."""
    return heads // kv_heads if heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP else None


def takes_long_keys(queries: mx.array, keys: mx.array) -> bool:
    """Whether :func:`long_attention` takes this call: whole query head groups of at most :data:`MAX_GROUP` a key
    head, and partial sums within :data:`MAX_PARTIALS_BYTES`."""
    rows, heads, length, dim = queries.shape
    return (_group(heads, keys.shape[1]) is not None
            and rows * heads * length * SPLITS * dim * 4 <= MAX_PARTIALS_BYTES)


def long_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                   starts: mx.array) -> mx.array:
    """What :func:`short_attention` computes, for long keys: in two passes, as MLX's own vector attention does
    past 1,024 keys (``sdpa_vector_fallback`` in MLX 0.32's ``scaled_dot_product_attention.cu``). The first splits
    each (row, key head, query)'s keys over :data:`SPLITS` blocks of 8 warps, a warp attending for all the key
    head's query heads at once (each key and value read once for the group); the second joins the splits'
    partial sums. Two graph nodes a layer, where plain operations make about ten.

    Why: a hot turn's message over a long conversation (2 to 64 queries over more than :data:`SHORT_PASS_KEYS`
    keys). H200 run 6, a 1B layer, 16 queries over 16,000 keys: :func:`short_attention`'s one pass (a block a
    (row, query head, query), each reading all its keys) took 1.31 ms, plain operations 0.51-0.58, MLX's fused
    attention 0.42 once it had built that shape's cuDNN graph (67 ms). Not yet run on a GPU: the load's
    :func:`check_long_keys` decides whether it is used.

    Args, returns: as :func:`short_attention`'s; the query heads a multiple of the key heads, at most
    :data:`MAX_GROUP` to one (:func:`takes_long_keys`).
    """
    rows, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    group = _group(heads, kv_heads)
    if not (1 <= length <= MAX_QUERIES and dim in HEAD_DIMS and keys.dtype == queries.dtype == values.dtype
            and group is not None):
        raise ValueError(f"1 to {MAX_QUERIES} queries a row of head size {HEAD_DIMS}, at most {MAX_GROUP} query heads "
                         f"a key head, in the keys' dtype, not {queries.shape} {queries.dtype} over {keys.shape} "
                         f"{keys.dtype}")
    first, second = _long_kernels()
    partials, sums, maxs = first(
        inputs=[queries, keys, values, starts, _scale(float(scale))],
        template=[("T", queries.dtype), ("D", dim), ("G", group)],
        grid=(kv_heads * 8 * 32, length, rows * SPLITS), threadgroup=(8 * 32, 1, 1),
        output_shapes=[(rows, heads, length, SPLITS, dim), (rows, heads, length, SPLITS),
                       (rows, heads, length, SPLITS)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    (out,) = second(inputs=[partials, sums, maxs], template=[("T", queries.dtype), ("D", dim)],
                    grid=(heads * 32 * 32, length, rows), threadgroup=(32 * 32, 1, 1),
                    output_shapes=[(rows, heads, length, dim)], output_dtypes=[queries.dtype])
    return out


def check_long_keys(dtype: mx.Dtype, head_dims: set[int] | frozenset[int],
                    groups: set[int] | frozenset[int]) -> str | None:
    """Build :func:`long_attention` for ``dtype``, each of ``head_dims`` and query head ``groups`` it takes, and hold
    it to :func:`reference` on MLX's CPU: None when it gives it, else what went wrong (the long-keys road is then
    left off and the calls keep their other roads).

    Each: one query and five a row over 1,300 keys (several for each of a row's 256 warps), a slice of a longer
    buffer; a row with no padding, one with a split's worth, one padded past most of the keys, and one whose first
    query sees a single key."""
    def cases() -> Iterator[tuple[str, Callable[..., mx.array], tuple[mx.array, ...]]]:
        size = 1300
        for dim in sorted(d for d in head_dims if d in HEAD_DIMS):
            for group in sorted(g for g in groups if 1 <= g <= MAX_GROUP):
                for length in (1, 5):
                    keys, values = (mx.random.normal((4, 2, size + 40, dim), key=mx.random.key(seed)).astype(dtype)
                                    [:, :, :size] for seed in (1, 2))
                    queries = mx.random.normal((4, 2 * group, length, dim), key=mx.random.key(3)).astype(dtype)
                    starts = mx.array([0, 8 * SPLITS + 3, size - 200, size - length], dtype=mx.int32)
                    yield (f"{length} queries of head size {dim}, {group} query heads a key head, in {dtype}",
                           long_attention, (queries, keys, values, starts))

    return _first_problem(cases(), dtype, none=f"no head size of {sorted(head_dims)} with a query head group of "
                                                f"{sorted(groups)} is one it takes ({HEAD_DIMS}; 1 to {MAX_GROUP})")


def _first_problem(cases: Iterator[tuple[str, Callable[..., mx.array], tuple[mx.array, ...]]],
                   dtype: mx.Dtype, *, none: str) -> str | None:
    """Each case's kernel call (``what``, the kernel, its queries, keys, values and first keys) against
    :func:`reference` on MLX's CPU stream (an independent device's): the first that is off by more than the
    dtype's tolerance, or that does not build or launch, as a line; ``none`` where there is no case (a model the
    kernel would take no call of keeps it off, and the profile does not name it); None when every one gives it."""
    ran = 0
    try:
        for what, kernel, (queries, keys, values, starts) in cases:
            ran += 1
            scale = queries.shape[-1] ** -0.5
            ours = kernel(queries, keys, values, scale=scale, starts=starts)
            with mx.stream(mx.cpu):
                theirs = reference(queries, keys, values, scale=scale, starts=starts)
            worst = mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item()
            if not worst <= cuda_kernel_tolerance(dtype):
                return f"{what}: off MLX's attention by {worst:.3g}"
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build or launch here is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None if ran else none
