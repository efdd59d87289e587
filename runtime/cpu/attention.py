"""Attention for MLX's CPU backend, computed in NumPy: the one mlx-lm symbol kvmem replaces.

Why. On MLX's CPU backend the softmax is most of a long prefill: ``mx.exp``
runs at about 13 ns per element on this machine, NumPy's at about 0.9 ns, and a
4K-token prefill of the default model takes about 2.5 billion exponentials
(``benches/results/cpu_attention.md`` has the measurements). MLX's own
attention on CPU also repeats each KV head for its query heads. Here the query
heads that share a KV head are folded into one matrix product per KV head, and
the softmax runs in NumPy, in place.

What it replaces, and only these:

* ``mlx_lm.models.llama.scaled_dot_product_attention``
* ``mlx_lm.models.qwen2.scaled_dot_product_attention``

Both are names each model module imported from ``mlx_lm.models.base``.
:func:`install` rebinds them to :func:`_attention`, which runs
:func:`numpy_attention` only inside :func:`active` — opened by
:meth:`runtime.model.loaded.LoadedModel.forward` around kvmem's own forward passes —
and calls mlx-lm's untouched function everywhere else. Plain mlx-lm in the same
process (the tests' references, the benchmarks' baselines) is unaffected.

When it is on: for calls with at least :data:`MIN_QUERIES` query positions
(prefill chunks, :func:`numpy_attention`), and for decode steps (one query
per row) attending at least :data:`MIN_DECODE_KEYS` keys over the batch
(:func:`decode_attention`: a batch of agents, or one agent's long context;
below that MLX's lower fixed cost per call wins), where the mlx-lm version is
one this module was tested with (:data:`TESTED_MLX_LM`) and the replaced name
is still mlx-lm's own function with the expected parameters; the backend profile's
``numpy_attention`` is on (the CPU policy: on GPUs MLX's fused kernels win, and a NumPy
view of device memory is a host round trip; :mod:`runtime.backend`); and per call, the cache is a float cache (quantized caches
keep MLX's quantized attention), there are no attention sinks and the inputs
are float32. Otherwise the call goes to mlx-lm's function.

NumPy needs evaluated inputs, so each layer's queries, keys and values are
evaluated where attention runs; kvmem evaluates every forward pass right after
it anyway, and the measurements include that.

**Plain attention for short passes (GPU policy, off unless set).** With the
``plain_attention_queries`` setting, a forward pass of 2 to that many query
positions per row (a hot turn's new message, a batch's join) attends with plain
MLX operations (:func:`plain_attention`) instead of the fused kernel. Why: on
CUDA, MLX's fused attention builds a cuDNN graph for every new set of shapes and
strides, and every turn of a growing conversation has a new one (issue 33's H200
trace: a batch of 8's join took 600-760 ms a round, 77 ms once the shapes
repeated). Decode steps (one query) and long prefill chunks keep the fused kernels.
A lone row's causal pass attends over its cache's buffer up to the next 256-token
step, the keys past the cache masked (:func:`plain_attention_over_the_buffer`):
the products' shapes repeat across turns, their widths multiples of 256.

**Short passes in one kernel (CUDA, the GPU policy's).** With the ``short_attention_kernel``
setting, a one-query step of a float batch whose rows differ in length
(:class:`runtime.kv.decode_kv.DecodeKVCache` with padding), and a pass of 2 to
``plain_attention_queries`` queries over a float cache (a lone row's ``KVCache``, or a batch's) of
at most :data:`runtime.kv.short_attention.SHORT_PASS_KEYS` keys attend through
:func:`runtime.kv.short_attention.short_attention`: one kernel, causal, each row
from its own first key, where MLX's CUDA backend has no fused kernel that takes a padding mask and
builds a cuDNN graph for each new shape of a short pass. Where the model's load also held the kernel's
long-keys road to MLX's results (:func:`runtime.kv.short_attention.check_long_keys`), a short pass over more
keys takes it (:func:`runtime.kv.short_attention.long_attention`: two passes, the keys split over blocks)
instead of plain operations.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, KVCache

from runtime.kv import short_attention
from runtime.kv.decode_kv import DecodeKVCache

__all__ = [
    "REPLACED", "TESTED_MLX_LM", "install", "active", "sharing", "numpy_attention", "decode_attention",
    "shared_prefix_attention", "plain_attention", "plain_attention_over_the_buffer", "BUFFER_STEP", "is_installed",
]

log = logging.getLogger("kvmem.cpu_attention")

REPLACED = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
"""Model modules whose ``scaled_dot_product_attention`` name :func:`install` rebinds."""

TESTED_MLX_LM = ((0, 32),)
"""mlx-lm ``(major, minor)`` releases the replacement was tested against."""

MIN_QUERIES = 4
"""Fewest query positions per call that go to NumPy: measured faster from 4 at every
context from 256 to 8192 tokens, slower at 1 (``benches/results/cpu_attention.md``)."""

MIN_DECODE_KEYS = 2048
"""Fewest keys a decode step attends over its whole batch (rows x keys) for :func:`decode_attention`:
measured about even with MLX at one row of 1K keys, faster from there (``benches/results/decode_attention.md``)."""

MIN_SHARED_ROWS = 6
"""Fewest rows of a decode step for :func:`shared_prefix_attention`: measured even with
:func:`decode_attention` at 4 rows sharing 1K tokens, faster from 6 (``benches/results/decode_attention.md``)."""

_ORIGINAL = base.scaled_dot_product_attention
_EXPECTED_PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")
_scope = threading.local()


def _mlx_lm_release() -> tuple[int, int] | None:
    try:
        major, minor = version("mlx-lm").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None


def _why_not() -> str | None:
    """Why the replacement cannot be installed in this environment, or None."""
    release = _mlx_lm_release()
    if release not in TESTED_MLX_LM:
        return f"mlx-lm {release} is not a tested release {TESTED_MLX_LM}"
    if tuple(inspect.signature(_ORIGINAL).parameters) != _EXPECTED_PARAMS:
        return "mlx_lm.models.base.scaled_dot_product_attention has other parameters"
    return None


def install(model_module: str) -> bool:
    """Rebind ``model_module``'s attention to kvmem's dispatcher; True when it is in place.

    Idempotent. Returns False (and logs why once) for modules outside
    :data:`REPLACED` and untested mlx-lm releases. Whether to install it at all is the
    backend profile's decision (``numpy_attention``), made by the caller.
    """
    if model_module not in REPLACED:
        return False
    reason = _why_not()
    if reason is not None:
        log.info("kvmem CPU attention off: %s", reason)
        return False
    module = importlib.import_module(model_module)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is _attention:
        return True
    if current is not _ORIGINAL:
        log.warning("kvmem CPU attention off: %s.scaled_dot_product_attention is not mlx-lm's", model_module)
        return False
    module.scaled_dot_product_attention = _attention  # type: ignore[attr-defined]
    return True


def is_installed(model_module: str) -> bool:
    """Whether ``model_module``'s attention is kvmem's dispatcher."""
    module = importlib.import_module(model_module)
    return getattr(module, "scaled_dot_product_attention", None) is _attention


@contextmanager
def active(on: bool = True, *, plain_queries: int = 0, attention_kernel: bool = False,
           long_keys_kernel: bool = False) -> Iterator[None]:
    """Within this block, on this thread, installed models attend through :func:`numpy_attention`
    (``on``), passes of 2 to ``plain_queries`` query positions through :func:`plain_attention`, and
    (``attention_kernel``) a padded float decode batch's steps and those short passes through
    :mod:`runtime.kv.short_attention`, over long keys in its two passes where ``long_keys_kernel``."""
    before = (getattr(_scope, "on", False), getattr(_scope, "plain", 0), getattr(_scope, "kernel", False),
              getattr(_scope, "long", False))
    _scope.on, _scope.plain, _scope.kernel, _scope.long = on, plain_queries, attention_kernel, long_keys_kernel
    try:
        yield
    finally:
        _scope.on, _scope.plain, _scope.kernel, _scope.long = before


@contextmanager
def sharing(tokens: int) -> Iterator[None]:
    """Within this block, on this thread, a decode batch's rows all begin with the same
    ``tokens`` keys and values in every layer (:mod:`runtime.execution.shared_prefix` checked it):
    its decode steps go through :func:`shared_prefix_attention`. 0 says nothing is shared."""
    before = getattr(_scope, "shared", 0)
    _scope.shared = tokens
    try:
        yield
    finally:
        _scope.shared = before


def _attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, through NumPy (or plain MLX operations) inside :func:`active`."""
    plain = getattr(_scope, "plain", 0)
    if getattr(_scope, "kernel", False) and sinks is None:
        kernel = _kernel_for(queries, keys, values, cache, plain)
        if kernel is not None:
            return kernel(queries, keys, values, scale=scale, starts=_starts(_first_keys(cache, queries.shape[0])))
    if plain and 1 < queries.shape[2] <= plain and sinks is None and not hasattr(cache, "bits"):
        if type(cache) is KVCache and isinstance(mask, str) and keys.shape[2] == cache.offset:
            return plain_attention_over_the_buffer(queries, cache, scale=scale, mask=mask)
        return plain_attention(queries, keys, values, scale=scale, mask=mask)
    if (
        getattr(_scope, "on", False)
        and sinks is None
        and not hasattr(cache, "bits")
        and queries.dtype == keys.dtype == values.dtype == mx.float32
    ):
        if queries.shape[2] >= MIN_QUERIES:
            return numpy_attention(queries, keys, values, scale=scale, mask=mask)
        if queries.shape[2] == 1:
            shared = getattr(_scope, "shared", 0)
            if shared and queries.shape[0] >= MIN_SHARED_ROWS and isinstance(cache, BatchKVCache):
                out = shared_prefix_attention(queries, keys, values, scale=scale, mask=mask,
                                              left_padding=np.asarray(cache.left_padding), shared=shared)
                if out is not None:
                    return out
            if queries.shape[0] * keys.shape[2] >= MIN_DECODE_KEYS:
                return decode_attention(queries, keys, values, scale=scale, mask=mask)
    return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _kernel_for(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, plain: int) -> Any:
    """Which of :mod:`runtime.kv.short_attention`'s kernels computes this call's attention, mask and all, or None:
    a float cache whose mask is causal from each row's first key (a lone row's ``KVCache``; a float batch's, whose
    padding the host knows), a head size and dtypes it takes, and either a padded batch's decode step (an
    unpadded one has MLX's vector kernel) or a short pass (2 to ``plain`` queries) over at most
    :data:`~runtime.kv.short_attention.SHORT_PASS_KEYS` keys; a longer short pass takes the long-keys road where it
    is on and takes the call (else plain operations, faster there than the one pass)."""
    n = queries.shape[2]
    if queries.shape[-1] not in short_attention.HEAD_DIMS or not queries.dtype == keys.dtype == values.dtype:
        return None
    if isinstance(cache, DecodeKVCache):
        step = n == 1 and any(cache.pads)
    elif type(cache) is KVCache:
        step = False
    else:
        return None
    if not (step or 1 < n <= min(plain, short_attention.MAX_QUERIES)):
        return None
    if step or keys.shape[2] <= short_attention.SHORT_PASS_KEYS:
        return short_attention.short_attention
    if getattr(_scope, "long", False) and short_attention.takes_long_keys(queries, keys):
        return short_attention.long_attention
    return None


def _first_keys(cache: Any, rows: int) -> tuple[int, ...]:
    """Each row's first key: its left padding in a float batch, 0 for a lone row."""
    return tuple(cache.pads) if isinstance(cache, DecodeKVCache) else (0,) * rows


@functools.lru_cache(maxsize=16)
def _starts(pads: tuple[int, ...]) -> mx.array:
    """Each row's first key on the device, made once (from host data) for every layer and step while the rows stay."""
    return mx.array(pads, dtype=mx.int32)


def plain_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any) -> mx.array:
    """Attention from plain MLX operations: no fused kernel, so nothing is built per shape.

    ``queries`` ``(B, H, L, D)``, ``keys`` / ``values`` ``(B, H_kv, S, D)``; the query heads that
    share a KV head are folded into one product. ``mask``: None, ``"causal"`` (aligned to the
    last key, as MLX's), a boolean array (True attends) or an additive one, broadcast to
    ``(B, H, L, S)``. The softmax runs in float32; the result has the queries' dtype.
    """
    b, h, n, d = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(b, kv_heads, h // kv_heads, n, d)
    scores = (q @ mx.swapaxes(keys, -1, -2)[:, :, None]).astype(mx.float32)  # (B, H_kv, G, L, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = _causal_mask(n, s, s)
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, H or 1, L, S): split the heads as the scores are
            mask = mask.reshape(mask.shape[0], -1 if mask.shape[1] == 1 else kv_heads,
                                1 if mask.shape[1] == 1 else h // kv_heads, n, s)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
        else:
            scores = scores + mask.astype(mx.float32)
    weights = mx.softmax(scores, axis=-1).astype(values.dtype)
    return (weights @ values[:, :, None]).reshape(b, h, n, -1)


BUFFER_STEP = 256
"""The keys a lone row's short pass attends over are its buffer's, up to a multiple of this (``KVCache``'s own step)."""


def plain_attention_over_the_buffer(queries: mx.array, cache: KVCache, *, scale: float, mask: str) -> mx.array:
    """:func:`plain_attention` of a lone row's causal pass over its ``KVCache``'s buffer up to the next multiple of
    :data:`BUFFER_STEP` keys, the keys past the cache masked, instead of over its keys alone.

    The buffer grows by 256 tokens at a time, so the products' shapes repeat across a conversation's turns and
    their widths are multiples of 256. H200 run 6's probe (16 queries, a new shape each, first call and again,
    ms): over 4,000 keys 0.69 and 0.29 against 5.09 and 0.53 over the keys alone; over 16,000, 1.09 and 0.51
    against 1.89 and 0.58. The keys past the cache are zeros or an earlier turn's (finite): their weights are 0.
    """
    if mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}")
    n, s = queries.shape[2], cache.offset
    width = min(cache.keys.shape[2], -(-s // BUFFER_STEP) * BUFFER_STEP)
    return plain_attention(queries, cache.keys[..., :width, :], cache.values[..., :width, :], scale=scale,
                           mask=_causal_mask(n, s, width))


def _causal_mask(queries: int, keys: int, width: int) -> mx.array:
    """``(queries, width)``: which of the first ``width`` keys (a buffer's, or exactly ``keys``) each of a pass's
    last ``queries`` of ``keys`` tokens sees (causal: none past the cache). Built once a pass and shared by every
    layer, where each built its own: nine graph nodes a layer, each paid on a GPU's host. Kept per thread, the
    last one only (MLX ties an operation's stream to the thread that built it), and built by operations, on the
    device: from host data, on CUDA, it would be managed memory the device pages in."""
    shape = (queries, keys, width)
    last = getattr(_scope, "mask", None)
    if last is not None and last[0] == shape:
        return last[1]
    mask = mx.arange(width)[None] <= (mx.arange(queries)[:, None] + (keys - queries))
    _scope.mask = (shape, mask)
    return mask


_CACHED_TRIANGLE_MAX = 4096
_triangle = np.zeros((0, 0), np.float32)  # the largest causal block needed so far, up to the max


def _causal_block(n: int) -> np.ndarray:
    """``n x n`` additive mask: 0 on and below the diagonal, -inf above.

    One triangle is kept and sliced: the top-left ``n x n`` of a larger one is
    the smaller one, so every chunk length shares it (one per length would keep
    a matrix for each prompt's last, odd-sized chunk).
    """
    global _triangle
    if n > _triangle.shape[0]:
        block = np.triu(np.full((n, n), -np.inf, np.float32), 1)
        if n > _CACHED_TRIANGLE_MAX:
            return block
        _triangle = block
    return _triangle[:n, :n]


def numpy_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any) -> mx.array:
    """Softmax attention with grouped KV heads, as ``mx.fast.scaled_dot_product_attention`` computes it.

    The two matrix products run in MLX (on the BLAS kvmem loads for it); the
    masked softmax runs in NumPy, in place on the evaluated scores. NumPy does
    no matrix products here: its own OpenBLAS would start a second thread pool
    that competes with MLX's for the same cores.

    Args:
        queries: ``(B, heads, L, D)``; keys, values: ``(B, kv_heads, S, D)``
            with ``heads`` a multiple of ``kv_heads`` (query head ``h`` attends
            with KV head ``h // (heads // kv_heads)``).
        mask: None, ``"causal"`` (the last ``L`` keys are the queries' own
            positions), a boolean array (True attends) or an additive array,
            broadcastable to ``(B, heads, L, S)``.

    A batch is attended row by row, each row over its own keys only (where a
    boolean mask pads rows on the left, as a decode batch does): the same
    products, of the same shapes, as that row alone, so a row's result does not
    depend on the other rows (MLX's own attention does not promise that:
    ``tests/cpu/test_cpu_attention.py``). kvmem's own batches are decode steps,
    which go to :func:`decode_attention`; the row-by-row path serves callers
    that batch several query positions.
    """
    if queries.shape[0] > 1:
        return _row_by_row(queries, keys, values, scale=scale, mask=mask)
    return _attend(queries, keys, values, scale=scale, mask=mask)


def _row_by_row(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any) -> mx.array:
    per_row = isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[0] > 1
    padded = per_row and mask.dtype == mx.bool_
    attends = np.asarray(mask).any(axis=(1, 2)) if padded else None  # (B, S): keys the row's queries see
    outs = []
    for b in range(queries.shape[0]):
        start, row_mask = 0, mask
        if per_row:
            row_mask = mask[b : b + 1]
        if attends is not None:
            row = attends[b]
            start = int(row.argmax()) if row.any() else 0  # the row's left padding ends here
            row_mask = None if queries.shape[2] == 1 and row[start:].all() else mask[b : b + 1, :, :, start:]
        outs.append(_attend(queries[b : b + 1], keys[b : b + 1, :, start:], values[b : b + 1, :, start:],
                            scale=scale, mask=row_mask))
    return mx.concatenate(outs, axis=0)


def _attend(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any) -> mx.array:
    batch, heads, length, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    rows = (heads // kv_heads) * length
    # Query heads sharing a KV head become one (rows x D) matrix: one product per KV head.
    q = (queries * scale).reshape(batch, kv_heads, rows, dim)
    scores = q @ keys.swapaxes(-1, -2)
    mx.eval(scores)
    # ``scores`` is this call's own fresh, evaluated array: nothing else holds it,
    # so the softmax may overwrite it through NumPy's view of its memory.
    weights = np.asarray(scores)
    by_head = weights.reshape(batch, heads, length, span)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        if length > 1:
            by_head[..., span - length :] += _causal_block(length)
    elif mask is not None:
        _apply_mask(by_head, mask)
    _exp_from_peak(weights)
    # The weights' row sums come out of the same product as the output (a column of
    # ones beside the values): summed in the product's order, which keys a batch
    # pads with (weight 0) do not change, where NumPy's pairwise sum would.
    # Normalizing the (rows x D) output instead of the (rows x S) weights: one pass fewer.
    dim_v = values.shape[-1]
    ones = mx.ones((*values.shape[:-1], 1), dtype=values.dtype)
    both = scores @ mx.concatenate([values, ones], axis=-1)
    total = both[..., dim_v:]
    out = both[..., :dim_v] / mx.where(total > 0, total, 1)  # fully masked rows stay 0
    return out.reshape(batch, heads, length, dim_v)


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any) -> mx.array:
    """One query per row (a decode step), as ``mx.fast.scaled_dot_product_attention`` computes it.

    Where MLX's CPU attention spends a batched decode step (measured at 8 rows of
    1K keys): its ``q @ k.T`` with the keys transposed, and its softmax (``mx.exp``
    at ~20 ns an element). Here the scores come out of ``keys @ q.T`` (the keys
    as stored, the query heads sharing a KV head as one matrix), the masked
    softmax runs in NumPy in place, and ``weights @ values`` goes back to MLX.

    The whole batch goes through each product at once, so unlike
    :func:`numpy_attention` a row's result may differ from the row alone in
    the last bits (as MLX's own attention's does): the keys a row is padded
    with get weight 0, but they change how BLAS groups the sums.

    Args:
        queries: ``(B, heads, 1, D)``; keys, values: ``(B, kv_heads, S, D)``.
        mask: None, ``"causal"`` (nothing to mask for the one, last position),
            a boolean array (True attends) or an additive array, broadcastable
            to ``(B, heads, 1, S)``.
    """
    batch, heads, length, dim = queries.shape
    if length != 1:
        raise ValueError(f"decode_attention takes one query per row, not {length}")
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}")
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = (queries * scale).reshape(batch, kv_heads, group, dim)
    scores = keys @ q.swapaxes(-1, -2)  # (B, kv_heads, S, group)
    mx.eval(scores)
    weights = np.ascontiguousarray(np.asarray(scores).swapaxes(-1, -2))  # (B, kv_heads, group, S): S contiguous
    by_head = weights.reshape(batch, heads, 1, span)
    if isinstance(mask, mx.array):
        _apply_mask(by_head, mask)
    _exp_from_peak(weights)
    total = weights.sum(axis=-1, keepdims=True)
    np.divide(weights, np.where(total > 0, total, 1), out=weights)
    out = mx.array(weights) @ values
    return out.reshape(batch, heads, 1, values.shape[-1])


def shared_prefix_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any,
                            left_padding: np.ndarray, shared: int) -> mx.array | None:
    """:func:`decode_attention` for a batch whose rows all begin with the same ``shared`` keys and values.

    Why. A decode step's attention reads every row's keys and values once; on this
    machine that is memory-bound (8 rows of 1.1K tokens: 13 MB a layer). Agents
    that share a system prompt hold the same dequantized KV for it in every row
    (:mod:`runtime.execution.shared_prefix`), so here row 0's copy of those keys and values
    is read once, for every row's queries together (one product per KV head), each
    row's own keys after them row by row, and one softmax spans both parts.
    Measured on the default model, rows sharing 1K tokens and 60-200 of their own:
    a whole decode step 1.11x faster at 6 rows, 1.13x at 8, even at 4 and slower
    at 2 (:data:`MIN_SHARED_ROWS`; ``benches/results/decode_attention.md``).

    Row ``i``'s shared keys sit at ``left_padding[i] .. left_padding[i] + shared``
    (a left-padded ``BatchKVCache``). Returns None, for the caller to attend the
    ordinary way, where the mask is not a boolean mask per row that attends to every
    shared key (an additive mask, a mask per head).
    """
    batch, heads, length, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    pads = left_padding.astype(np.int64)
    if length != 1 or pads.shape != (batch,) or int(pads.max()) + shared >= span:
        return None
    attends = None
    if isinstance(mask, mx.array):
        if mask.dtype != mx.bool_ or mask.ndim != 4 or mask.shape[1] != 1:
            return None
        attends = np.broadcast_to(np.asarray(mask), (batch, 1, 1, span)).reshape(batch, span)
        if not all(attends[i, p : p + shared].all() for i, p in enumerate(pads.tolist())):
            return None
    elif mask is not None and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}")
    group = heads // kv_heads
    first = int(pads[0])
    own_from = int(pads.min()) + shared  # every key before this is some row's padding or shared key
    q = (queries * scale).reshape(batch, kv_heads, group, dim)
    every_query = q.transpose(1, 0, 2, 3).reshape(kv_heads, batch * group, dim)
    # Both products give fresh arrays with each query's keys contiguous: the softmax runs on them in place.
    shared_scores = every_query @ keys[0, :, first : first + shared].swapaxes(-1, -2)  # (kv_heads, B*group, shared)
    own_scores = q @ keys[:, :, own_from:].swapaxes(-1, -2)  # (B, kv_heads, group, span - own_from)
    mx.eval(shared_scores, own_scores)
    common, own = np.asarray(shared_scores), np.asarray(own_scores)
    # In the own part, a row's keys before its own start are its padding or its shared keys (counted above).
    hidden = np.arange(span - own_from)[None, :] < (pads + shared - own_from)[:, None]
    if attends is not None:
        hidden |= ~attends[:, own_from:]
    np.copyto(own, np.float32(-np.inf), where=hidden[:, None, None, :])
    by_row = (kv_heads, batch, group)
    peak = np.maximum(common.max(axis=-1).reshape(by_row).transpose(1, 0, 2), own.max(axis=-1))  # (B, kv_heads, group)
    peak[~np.isfinite(peak)] = 0.0  # a row with every key masked: its weights become 0, not NaN
    np.subtract(common, peak.transpose(1, 0, 2).reshape(kv_heads, batch * group, 1), out=common)
    np.exp(common, out=common)
    np.subtract(own, peak[..., None], out=own)
    np.exp(own, out=own)
    total = common.sum(axis=-1).reshape(by_row).transpose(1, 0, 2) + own.sum(axis=-1)
    dim_v = values.shape[-1]
    from_shared = (shared_scores @ values[0, :, first : first + shared]).reshape(*by_row, dim_v).transpose(1, 0, 2, 3)
    from_own = own_scores @ values[:, :, own_from:]
    out = (from_shared + from_own) / mx.array(np.where(total > 0, total, 1))[..., None]
    return out.reshape(batch, heads, 1, dim_v)


def _apply_mask(scores: np.ndarray, mask: mx.array) -> None:
    """A boolean (True attends) or additive mask, broadcast onto ``scores`` in place."""
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        np.copyto(scores, np.float32(-np.inf), where=~m)
    else:
        scores += m.astype(np.float32, copy=False)


def _exp_from_peak(weights: np.ndarray) -> None:
    """``exp(weights - max)`` along the last axis, in place: a softmax before its normalization."""
    peak = weights.max(axis=-1, keepdims=True)
    peak[~np.isfinite(peak)] = 0.0  # a row with every key masked: its weights become 0, not NaN
    np.subtract(weights, peak, out=weights)
    np.exp(weights, out=weights)
