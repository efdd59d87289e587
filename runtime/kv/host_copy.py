"""A parked cache's host copy for its save, made a part at a time (the GPU policy's copy after the turn).

On a GPU the host copy of a cache is slow (about 0.6 GB/s on an H200 in run 3), and the GPU
actor makes it between turns: while idle it stops between two parts for a message, and while
turns run an overdue copy goes a few parts a loop pass (:mod:`actors.gpu`). So a part bounds what
a new turn or a running batch waits for (a copy nothing waits on between parts, as the CPU policy's
at a turn's end, makes every part in one evaluation: :meth:`HostCopy.make_rest`). A part used to be a layer: a 32K-token cache of a 1B
model has 19 MB layers (about 30 ms each); H200 run 4's cold 1K turns, right behind a 32K one,
waited 9-21 ms before admission. A part is now at most :data:`COPY_PART_BYTES` of one array of
one layer (a range of its tokens), copied into the host array it belongs to, so the snapshot is
assembled as it goes, with no copy at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from runtime.spec import CacheSnapshot, LayerSnapshot

if TYPE_CHECKING:
    from runtime.kv.kvstate import ParkedCache

__all__ = ["COPY_PART_BYTES", "HostCopy", "host_readable"]

COPY_PART_BYTES = 4 * 2**20
"""The most host bytes one part of a copy makes (about 7 ms at an H200's 0.6 GB/s)."""


class HostCopy:
    """``parked``'s host copy in the making: its parts in order, how many are made, and the host
    arrays they fill. ``by_copy``: each part is read from a copy made on the device
    (:func:`host_readable`, the GPU policy's)."""

    def __init__(self, parked: ParkedCache, *, by_copy: bool, part_bytes: int = COPY_PART_BYTES) -> None:
        self.parked = parked
        self.by_copy = by_copy
        # Each layer's arrays (chunks joined, lazily) while its parts are made; None once they are.
        self._arrays: list[dict[str, mx.array] | None] = [dict(layer.arrays) for layer in parked.layers]
        self._host: list[dict[str, np.ndarray]] = [{} for _ in parked.layers]
        self.parts = [part for i, arrays in enumerate(self._arrays) if arrays is not None
                      for part in _parts(i, arrays, part_bytes)]
        self.made = 0

    @property
    def complete(self) -> bool:
        return self.made == len(self.parts)

    def make_next(self) -> None:
        """Copy the next part into its host array (one evaluation, one read)."""
        part = self.parts[self.made]
        piece = self._piece(part)
        mx.eval(piece)
        self._store(part, piece)

    def make_rest(self) -> None:
        """Copy every part still to make, their pieces made in one evaluation (one wait for the device)."""
        todo = self.parts[self.made :]
        pieces = [self._piece(part) for part in todo]
        mx.eval(pieces)
        for part, piece in zip(todo, pieces, strict=True):
            self._store(part, piece)

    def _piece(self, part: tuple[int, str, int, int]) -> mx.array:
        """The part's tokens of its array, batch axis dropped, as the host reads them (lazily)."""
        layer, name, start, stop = part
        arrays = self._arrays[layer]
        assert arrays is not None
        return host_readable(arrays[name][0, :, start:stop], by_copy=self.by_copy)  # token axis 2, then 1

    def _store(self, part: tuple[int, str, int, int], piece: mx.array) -> None:
        """Copy an evaluated piece into the host array it belongs to; count the part made."""
        layer, name, start, stop = part
        arrays = self._arrays[layer]
        assert arrays is not None
        read = np.asarray(piece)
        host = self._host[layer].get(name)
        if host is None:
            shape = arrays[name].shape
            host = self._host[layer][name] = np.empty((shape[1], shape[2], *shape[3:]), read.dtype)
        host[:, start:stop] = read
        self.made += 1
        if self.complete or self.parts[self.made][0] != layer:
            self._arrays[layer] = None  # a joined layer's device memory goes with it

    def snapshot(self) -> CacheSnapshot:
        """The whole copy (every part made)."""
        if not self.complete:
            raise ValueError(f"{len(self.parts) - self.made} of {len(self.parts)} parts are not copied yet")
        return self.parked.snapshot_of([LayerSnapshot(layer.kind, host)
                                        for layer, host in zip(self.parked.layers, self._host, strict=True)])


def _parts(layer: int, arrays: dict[str, Any], part_bytes: int) -> list[tuple[int, str, int, int]]:
    """``(layer, name, start, stop)`` token ranges of each array of ``arrays``, each under ``part_bytes``
    on the host (bfloat16 is read widened to float32), at least one token a part and one part an array."""
    out = []
    for name, a in arrays.items():
        tokens = a.shape[2]
        per_token = a.nbytes * (2 if a.dtype == mx.bfloat16 else 1) // max(tokens, 1)
        step = max(1, part_bytes // max(per_token, 1))
        out += [(layer, name, start, min(tokens, start + step)) for start in range(0, max(tokens, 1), step)]
    return out


def host_readable(a: mx.array, *, by_copy: bool) -> mx.array:
    """``a`` as the host reads it for a save (lazily): bfloat16 widened to float32, which numpy
    has (losslessly: :meth:`runtime.kv.kvstate.ParkedCache.from_snapshot` narrows it back), and with
    ``by_copy`` never ``a``'s own buffer. On CUDA the host reading an array moves its whole buffer to
    managed memory for good (MLX's ``Buffer::raw_ptr``); ``a`` is a view of a parked cache, which would
    then page back onto the device at its next use, so the host reads a copy made on the device
    instead (``x * 1`` is exact for every dtype)."""
    if a.dtype == mx.bfloat16:
        return a.astype(mx.float32)  # a new array already
    return a * 1 if by_copy else a
