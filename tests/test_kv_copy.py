"""runtime.cpu.kv_copy.place_rows: the NumPy path against the MLX one it replaces on the CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import cpu_only
from runtime.cpu import kv_copy


@cpu_only("the NumPy host-view path is the CPU policy's (numpy_kv_copy); under the GPU policy it is off, and a "
          "NumPy view of device memory would be a host round trip")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rows_land_where_asked_and_zeros_elsewhere(dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_copy, "_host_views", True)  # the NumPy path, whatever an earlier engine set
    mx.random.seed(0)
    buffer = mx.random.normal((1, 3, 40, 8)).astype(dtype)
    rows = [(buffer[..., :25, :], 5), (None, 0), (buffer[..., 10:30, :], 0)]  # views of a larger buffer
    out = kv_copy.place_rows(rows, 32, buffer)
    assert out.shape == (3, 3, 32, 8) and out.dtype == dtype
    assert mx.array_equal(out[0:1, :, 5:30], buffer[..., :25, :]).item()
    assert mx.abs(out[0, :, :5]).max().item() == 0 and mx.abs(out[0, :, 30:]).max().item() == 0
    assert mx.abs(out[1]).max().item() == 0
    assert mx.array_equal(out[2:3, :, :20], buffer[..., 10:30, :]).item()
    monkeypatch.setattr(kv_copy, "_NUMPY_DTYPES", {})  # the MLX path
    assert mx.array_equal(kv_copy.place_rows(rows, 32, buffer), out).item()
