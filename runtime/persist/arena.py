"""Where a load's data goes: one allocation for every blocked array, and the rows each piece's file fills.

A load reads each piece's file straight into the final arrays (no copy after
the kernel's): :func:`allocate` carves every blocked tensor's ``num_tokens``
array from one buffer, and a :class:`Scatter` lists, for a piece of a given
length, the byte range of the buffer each row of its file (one tensor, one
head) lands in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runtime.persist.codec import FileLayout

__all__ = ["Arena", "Scatter", "allocate"]


@dataclass(frozen=True)
class Arena:
    """The blocked arrays of a load, carved from one buffer, and where each lies in it."""

    buffer: np.ndarray
    arrays: dict[str, np.ndarray]
    offsets: dict[str, int]


@dataclass(frozen=True)
class Scatter:
    """Where a piece's data goes: per row of (tensor, head) in file order, its place in the arena.

    A ``tokens``-token piece at ``start`` fills, for each row, arena bytes
    ``base + start * row : base + (start + tokens) * row``.
    """

    layout: FileLayout
    bases: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, layout: FileLayout, arena: Arena) -> Scatter:
        """The rows of a piece laid out as ``layout``, placed in ``arena``."""
        bases, rows = [], []
        for name in layout.offsets:
            array = arena.arrays[name]
            row = array.strides[1]
            for head in range(array.shape[0]):
                bases.append(arena.offsets[name] + head * array.strides[0])
                rows.append(row)
        return cls(layout, np.array(bases, dtype=np.int64), np.array(rows, dtype=np.int64))

    def regions(self, whole: memoryview, start: int, tokens: int) -> list[memoryview]:
        """The views of ``whole`` (the arena's buffer) a ``tokens``-token piece at ``start`` fills, in file order."""
        starts = (self.bases + start * self.rows).tolist()
        sizes = (self.rows * tokens).tolist()
        return [whole[at : at + size] for at, size in zip(starts, sizes, strict=True)]


def allocate(
    blocked: dict[str, tuple[np.dtype, tuple[int, ...]]], num_tokens: int
) -> Arena:
    """Empty ``num_tokens``-token arrays for the blocked tensors, carved from one allocation.

    One large allocation is backed by huge pages where the kernel offers them
    (numpy asks for it), so filling it costs a few page faults instead of one
    per 4 KiB: for a large cache, faulting in fresh memory page by page costs
    as much as reading it.
    """
    shapes = {
        name: (dtype, (shape[0], num_tokens, *shape[2:]))
        for name, (dtype, shape) in blocked.items()
    }
    sizes = {
        name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in shapes.items()
    }
    # Each array starts on a 64-byte boundary, as numpy's own allocations do.
    buffer = np.empty(sum(-(-size // 64) * 64 for size in sizes.values()), dtype=np.uint8)
    arrays, offsets = {}, {}
    position = 0
    for name, (dtype, shape) in shapes.items():
        arrays[name] = buffer[position : position + sizes[name]].view(dtype).reshape(shape)
        offsets[name] = position
        position += -(-sizes[name] // 64) * 64
    return Arena(buffer, arrays, offsets)
