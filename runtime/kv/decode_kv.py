"""The float decode batch's cache: mlx-lm's ``BatchKVCache``, without a mask where none is needed."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import BatchKVCache

__all__ = ["DecodeKVCache"]


class DecodeKVCache(BatchKVCache):
    """A left-padded batch of float KV rows that asks for no attention mask when one row decodes.

    A batch of one row has no left padding: every way kvmem builds or narrows a batch drops
    the padding all its rows share (``merge_with_room``, ``filter``, the prefix view of
    ``DecodeBatch.remove``). Its one query then sees every key it holds, so the causal mask
    is all true. mlx-lm builds it anyway, and on MLX's CUDA backend any array mask sends a
    one-token attention to the unfused fallback (the vector and cuDNN decode kernels take
    none): an extra matmul, mask and softmax per layer, which made one agent's decode about
    0.7x plain mlx-lm's on an H200 (``benches/results/gpu.md``).
    """

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N == 1 and not return_array and kwargs.get("window_size") is None and self._one_row():
            return None
        return super().make_mask(N, return_array=return_array, **kwargs)

    def _one_row(self) -> bool:
        return self.keys is not None and self.keys.shape[0] == 1
