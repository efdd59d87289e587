"""Host arrays onto the device in one copy each (a cache read from disk, a snapshot made hot again).

``mx.array(numpy_array)`` puts the data in memory MLX allocates for the host; on CUDA that is managed
memory (``cudaMallocManaged``), and the device's first touch migrates it a page fault at a time: about
0.6 GB/s on an H200 (run 3), so a 16K-token cache of a 1B model read at the turn took 294-390 ms to
reach the GPU, more than plain mlx-lm's cold prefill of the same prompt (213 ms).

``mx.load`` of a safetensors stream takes another road on CUDA: each array is allocated on the device
and filled by one ``cudaMemcpyAsync`` from a host buffer (MLX's ``Load::eval_gpu``). So under the GPU
policy (:attr:`runtime.backend.BackendProfile.upload_by_copy`) the arrays are served to ``mx.load``
as a safetensors file that exists only as views of their own memory (:class:`SafetensorsView`: a
header, then each array's bytes, read in place). On the CPU backend ``mx.load`` reads into host memory:
the same arrays, by another road, which is how CI covers this path.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from runtime.persist.codec import FileLayout, can_store

__all__ = ["SafetensorsView", "to_device"]


class SafetensorsView(io.RawIOBase):
    """A read-only safetensors file made of ``arrays`` without copying them: a header, then each
    array's bytes in place. What ``mx.load`` needs of a file: ``readinto``, ``seek``, ``tell``."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        contiguous = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
        # The cache files' own layout and header (runtime.persist.codec), with no kvmem metadata in it.
        layout = FileLayout.of({name: (a.dtype, a.shape) for name, a in contiguous.items()})
        self._parts = [memoryview(layout.header({})),
                       *(memoryview(contiguous[name].reshape(-1).view(np.uint8)) for name in layout.offsets)]
        self._starts = [0]
        for part in self._parts[:-1]:
            self._starts.append(self._starts[-1] + len(part))
        self._size = self._starts[-1] + len(self._parts[-1])
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: object) -> int:
        out = memoryview(buffer).cast("B")  # type: ignore[arg-type]
        done = 0
        part = bisect.bisect_right(self._starts, self._pos) - 1
        while done < len(out) and self._pos < self._size:
            view, start = self._parts[part], self._pos - self._starts[part]
            take = min(len(view) - start, len(out) - done)
            out[done:done + take] = view[start:start + take]
            done += take
            self._pos += take
            part += 1
        return done


def to_device(arrays: Mapping[str, np.ndarray], *, by_copy: bool) -> dict[str, mx.array]:
    """``arrays`` as MLX arrays: through ``mx.load`` when ``by_copy`` (see the module docstring),
    else ``mx.array``. An empty array, or a dtype safetensors has no name for, goes by ``mx.array``."""
    if not by_copy:
        return {name: mx.array(array) for name, array in arrays.items()}
    loadable = {name: a for name, a in arrays.items() if a.size and can_store(a.dtype)}
    loaded = mx.load(SafetensorsView(loadable), format="safetensors") if loadable else {}
    assert isinstance(loaded, dict)
    return {name: loaded[name] if name in loaded else mx.array(array) for name, array in arrays.items()}
