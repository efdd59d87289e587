"""Placing float KV rows into a new, larger buffer: through NumPy on the CPU backend.

Why. Joining a batch, leaving it and keeping room for a turn's next tokens all
copy float KV into a fresh buffer with zeros around it, for every agent on
every turn. On MLX's CPU backend a ``zeros`` followed by slice assignments
moves this data at about a third of NumPy's speed (measured here: eight rows
of 1150 tokens x 30 layers of keys, 159 ms in MLX, 60 ms in NumPy), and
building the result in NumPy and handing it to MLX (``mx.array``) costs one
more copy into freshly mapped memory (2 ms a layer in a batch join here).

How. MLX allocates the zeroed result (its allocator reuses freed buffers) and
NumPy writes the rows into it through the buffer protocol: the array is new,
evaluated and referenced by nothing else yet, so no MLX operation can see it
half written. Under the GPU backend profile (:mod:`runtime.backend`: a NumPy view
of device memory is a host round trip), where MLX does not hand out a writable
contiguous view, and for dtypes NumPy lacks (bfloat16), MLX copies.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

__all__ = ["place_buffers", "place_rows", "tokens_with_room", "use_host_views"]

_NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16}
_host_views: bool | None = None


def use_host_views(enabled: bool | None) -> None:
    """Whether rows are written through NumPy views (the profile's ``numpy_kv_copy``; the engine sets it);
    None: the device's policy (:func:`_device_takes_host_views`)."""
    global _host_views
    _host_views = enabled


@functools.cache
def _device_takes_host_views() -> bool:
    """Until an engine says: host views on MLX's CPU device only. On a GPU a NumPy view of an MLX array is the
    host writing memory the device computes with (on CUDA, MLX moves a buffer the host reads or writes to
    managed memory for good, the source a view was sliced from included). Before, code that builds caches
    without an engine (the tests' sequences and batches) wrote them through the host on a GPU too; H200 run
    6's two failing tiny-gpt-oss batch tests are such code, so this is a suspect the next run checks."""
    from runtime.backend import detect_device

    return detect_device()[0] == "cpu"


def _host_views_on() -> bool:
    return _device_takes_host_views() if _host_views is None else _host_views


def place_rows(rows: Sequence[tuple[mx.array | None, int]], size: int, like: mx.array) -> mx.array:
    """A ``(len(rows), H, size, D)`` array of zeros with row ``i``'s tokens placed from position ``start``.

    Args:
        rows: per output row, ``(tokens, start)``: ``tokens`` shaped ``(1, H, T, D)``
            (or None: the row stays zeros), written at positions ``start .. start + T``.
        size: the token axis of the result.
        like: an array with the result's heads, head size and dtype (shape ``(.., H, .., D)``).
    """
    return place_buffers([(t, 0 if t is None else t.shape[2], start) for t, start in rows], size, like)


def tokens_with_room(tokens: mx.array, size: int) -> mx.array:
    """``tokens`` ``(B, H, T, D)`` copied into a ``(B, H, size, D)`` buffer, zeros past them.

    Through NumPy on the CPU (:func:`place_rows`); otherwise one ``mx.pad``: one graph node an array
    where :func:`place_rows`' gather takes five (a slice, the zero token appended, the gather, a
    transpose and a reshape). A batch row leaving with its turn's cache (a finished agent's park)
    makes two a layer, so a round of 8 agents finishing together launched some 2,500 nodes on a 1B
    model (H200 run 6: their finishes came about 4 ms apart, the last 40 ms after the final step)."""
    count = tokens.shape[2]
    if _host_views_on() and tokens.dtype in _NUMPY_DTYPES:
        return place_rows([(tokens[i : i + 1], 0) for i in range(tokens.shape[0])], size, tokens)
    return mx.pad(tokens, ((0, 0), (0, 0), (0, size - count), (0, 0)))


def place_buffers(rows: Sequence[tuple[mx.array | None, int, int]], size: int, like: mx.array) -> mx.array:
    """:func:`place_rows` from whole buffers: row ``i`` is ``(buffer, count, start)``, the first ``count``
    tokens of ``buffer`` (``(1, H, >= count, D)``; None or a count of 0: zeros) placed at ``start``.

    Without NumPy views (the GPU policy), the result is one gather from the buffers put end to end,
    whatever the number of rows: a zeroed result written a row at a time costs a slice and an update
    a row, and every graph node costs a GPU's host its part of the launch (H200 run 5: a batch of 8's
    joint prefill, about 900 such nodes for a 1B's 16 layers, launched in 32 ms, 29 of them MLX's
    submit). The gather's index is the same for every layer and for keys and values: it is made once.
    """
    _, heads, _, dim = like.shape
    if _host_views_on() and like.dtype in _NUMPY_DTYPES:
        out = mx.zeros((len(rows), heads, size, dim), like.dtype)
        host = _writable_view(out)
        if host is not None:
            for i, (buffer, count, start) in enumerate(rows):
                if buffer is not None and count:
                    host[i, :, start : start + count] = np.asarray(buffer[..., :count, :])[0]
            return out
    used = [(b, count, start) for b, count, start in rows if b is not None and count]
    layout = tuple((count, start, b.shape[2]) if b is not None and count else None for b, count, start in rows)
    index = _gather_index(layout, size)
    source = mx.concatenate([b for b, _, _ in used] + [_zeros_token(heads, dim, like.dtype)], axis=2)
    placed = mx.take(source, index, axis=2)  # (1, H, B, size, D)
    return placed.transpose(2, 1, 0, 3, 4).reshape(len(rows), heads, size, dim)


@functools.lru_cache(maxsize=16)
def _gather_index(rows: tuple[tuple[int, int, int] | None, ...], size: int) -> mx.array:
    """Where each output position reads from the buffers put end to end (their whole lengths), the zero
    token after them for the rest; ``rows`` is each row's ``(count, start, buffer length)`` or None."""
    total = sum(row[2] for row in rows if row is not None)
    index = np.full((len(rows), size), total, dtype=np.int32)
    at = 0
    for i, row in enumerate(rows):
        if row is None:
            continue
        count, start, length = row
        index[i, start : start + count] = np.arange(at, at + count, dtype=np.int32)
        at += length
    return mx.array(index)


@functools.lru_cache(maxsize=16)
def _zeros_token(heads: int, dim: int, dtype: mx.Dtype) -> mx.array:
    """One token of zeros, ``(1, heads, 1, dim)``: what padded positions read. Made from host data, not
    by an operation: kept for every later call, on whatever thread (MLX ties an operation's stream to the
    thread that made it), and a graph input, not a node."""
    return mx.array([[[[0.0] * dim] for _ in range(heads)]], dtype=dtype)


def _writable_view(out: mx.array) -> np.ndarray | None:
    """``out`` evaluated and seen by NumPy as its own contiguous, writable memory; None where it is not."""
    if out.dtype not in _NUMPY_DTYPES or not _host_views_on():
        return None
    mx.eval(out)
    host = np.asarray(out)
    ok = host.flags.c_contiguous and host.flags.writeable and host.dtype == _NUMPY_DTYPES[out.dtype]
    return host if ok else None
