"""The float decode batch's cache: mlx-lm's ``BatchKVCache``, with its rows' padding known on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

__all__ = ["DecodeKVCache", "host_padding"]


class DecodeKVCache(BatchKVCache):
    """A left-padded batch of float KV rows whose padding the host knows without asking the device.

    **The padding on the host** (:attr:`pads`). mlx-lm keeps each row's left padding in an array
    (``left_padding``) and reads it back whenever a row leaves (``filter``, ``extract``): on a GPU
    that read waits for every step the device has queued, the one launched ahead included, so each
    finished turn stalled the whole batch's pipeline. Here every change of the padding (joining
    rows, rows leaving, the shift that drops padding every row shares) is made on the host list
    too, from host integers, and nothing reads the array back.

    **No mask where none is needed.** A batch whose rows all begin at the first key (one row,
    always: every way kvmem builds or narrows a batch drops the padding all its rows share; or rows
    of one length) has its one query per row see every key it holds, so the causal mask is all
    true. mlx-lm builds it anyway, and on MLX's CUDA backend any array mask sends a one-token
    attention to the unfused fallback (the vector and cuDNN decode kernels take none): an extra
    matmul, mask and softmax per layer, which made one agent's decode about 0.7x plain mlx-lm's on
    an H200 (``benches/results/gpu.md``).
    """

    def __init__(self, left_padding: Sequence[int]) -> None:
        super().__init__(list(left_padding))
        self.pads = [int(p) for p in left_padding]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N == 1 and not return_array and kwargs.get("window_size") is None and self._unpadded():
            return None
        return super().make_mask(N, return_array=return_array, **kwargs)

    def _unpadded(self) -> bool:
        return self.keys is not None and not any(self.pads)

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep rows ``batch_indices`` (mlx-lm's ``filter``, the padding they share dropped), reading nothing back."""
        keep = [int(i) for i in batch_indices]
        rows = mx.array(keep)
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]
        self.pads = [self.pads[i] for i in keep]
        self._drop_shared_padding()

    def keep_first(self, n: int) -> None:
        """Keep the first ``n`` rows: views, not a gather (the last row leaving costs no copy)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:n], self.values[:n]
        self.offset, self.left_padding = self.offset[:n], self.left_padding[:n]
        self.pads = self.pads[:n]
        self._drop_shared_padding()

    def _drop_shared_padding(self) -> None:
        shared = min(self.pads, default=0)
        if shared <= 0:
            return
        if self.keys is not None:
            self.keys = self.keys[..., shared:, :]
            self.values = self.values[..., shared:, :]
        self._idx -= shared
        self.left_padding = self.left_padding - shared
        self.pads = [p - shared for p in self.pads]

    def extend(self, other: Any) -> None:
        """Append ``other``'s rows (mlx-lm's ``extend``: the rows right-justified at the later write position)."""
        theirs = host_padding(other)
        if self.keys is None and other.keys is None:
            pads = self.pads + theirs
        else:
            end = max(self._idx, other._idx)
            pads = [p + end - self._idx for p in self.pads] + [p + end - other._idx for p in theirs]
        super().extend(other)
        self.pads = pads

    @BatchKVCache.state.setter  # type: ignore[attr-defined]
    def state(self, v: tuple[Any, ...]) -> None:
        """Whole state set from elsewhere (mlx-lm's own cache loading): the padding is read back once."""
        BatchKVCache.state.fset(self, v)  # type: ignore[attr-defined]
        self.pads = [int(p) for p in self.left_padding.tolist()]

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("a decode batch's rows are prefilled before they join it")

    def finalize(self) -> None:
        raise NotImplementedError("a decode batch's rows are prefilled before they join it")


def host_padding(cache: Any) -> list[int]:
    """Each row's left padding of a float batch cache: the host's list for a :class:`DecodeKVCache`, else read
    from the device (mlx-lm's own ``BatchKVCache``)."""
    if isinstance(cache, DecodeKVCache):
        return list(cache.pads)
    return [int(p) for p in cache.left_padding.tolist()]
