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

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

__all__ = ["place_rows", "use_host_views"]

_NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16}
_host_views = True


def use_host_views(enabled: bool) -> None:
    """Whether rows are written through NumPy views (the profile's ``numpy_kv_copy``; the engine sets it)."""
    global _host_views
    _host_views = enabled


def place_rows(rows: Sequence[tuple[mx.array | None, int]], size: int, like: mx.array) -> mx.array:
    """A ``(len(rows), H, size, D)`` array of zeros with row ``i``'s tokens placed from position ``start``.

    Args:
        rows: per output row, ``(tokens, start)``: ``tokens`` shaped ``(1, H, T, D)``
            (or None: the row stays zeros), written at positions ``start .. start + T``.
        size: the token axis of the result.
        like: an array with the result's heads, head size and dtype (shape ``(.., H, .., D)``).
    """
    _, heads, _, dim = like.shape
    out = mx.zeros((len(rows), heads, size, dim), like.dtype)
    host = _writable_view(out)
    for i, (tokens, start) in enumerate(rows):
        if tokens is None or not tokens.shape[2]:
            continue
        if host is None:
            out[i : i + 1, :, start : start + tokens.shape[2]] = tokens
        else:
            host[i, :, start : start + tokens.shape[2]] = np.asarray(tokens)[0]
    return out


def _writable_view(out: mx.array) -> np.ndarray | None:
    """``out`` evaluated and seen by NumPy as its own contiguous, writable memory; None where it is not."""
    if out.dtype not in _NUMPY_DTYPES or not _host_views:
        return None
    mx.eval(out)
    host = np.asarray(out)
    ok = host.flags.c_contiguous and host.flags.writeable and host.dtype == _NUMPY_DTYPES[out.dtype]
    return host if ok else None
