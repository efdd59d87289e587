"""runtime.cpu.kv_copy.place_rows: the NumPy path against the MLX one it replaces on the CPU."""

from __future__ import annotations

import io

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


def _nodes(*arrays: mx.array) -> int:
    """The operations an evaluation of ``arrays`` would run (MLX's graph, as ``export_to_dot`` draws it)."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return out.getvalue().count("shape=rectangle")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_without_host_views_rows_are_one_gather_from_whole_buffers(dtype: mx.Dtype, monkeypatch) -> None:
    """The GPU policy's path: every row's first ``count`` tokens of its whole buffer, zeros elsewhere, and
    a graph of a few nodes whatever the number of rows (a node a row costs a GPU's host at each launch)."""
    monkeypatch.setattr(kv_copy, "_host_views", False)
    mx.random.seed(1)
    buffers = [mx.random.normal((1, 2, 256, 4)).astype(dtype) for _ in range(8)]
    mx.eval(buffers)
    counts, starts = [30, 0, 12, 256, 7, 100, 64, 1], [5, 0, 40, 0, 0, 3, 9, 255]
    rows = [(b, n, s) for b, n, s in zip(buffers, counts, starts, strict=True)]
    rows[4] = (None, 0, 0)
    out = kv_copy.place_buffers(rows, 256 + 8, buffers[0])
    assert _nodes(out) <= 8 and _nodes(kv_copy.place_buffers(rows[:2], 264, buffers[0])) == _nodes(out)
    expected = mx.zeros((8, 2, 264, 4), dtype)  # the reference: a row at a time
    for i, (b, n, s) in enumerate(rows):
        if b is not None and n:
            expected[i : i + 1, :, s : s + n] = b[..., :n, :]
    assert out.shape == expected.shape and out.dtype == dtype
    assert mx.array_equal(out, expected).item()
    # and the lists the way place_rows takes them, views of the buffers included
    views = [(b[..., :n, :] if n else None, s) for b, n, s in rows if b is not None]
    assert mx.array_equal(kv_copy.place_rows(views, 264, buffers[0]),
                          mx.concatenate([expected[:4], expected[5:]])).item()


@pytest.mark.parametrize("on_a_cpu", [True, False])
def test_until_an_engine_says_the_device_decides_the_host_views(on_a_cpu: bool, monkeypatch) -> None:
    """Code that builds caches without an engine (the tests' sequences and batches) writes them through NumPy
    views only on MLX's CPU device: on a GPU a host view is the host writing device memory (H200 run 6)."""
    monkeypatch.setattr(kv_copy, "_host_views", None)
    monkeypatch.setattr(kv_copy, "_device_takes_host_views", lambda: on_a_cpu)
    viewed = []
    monkeypatch.setattr(kv_copy, "_writable_view", lambda out: viewed.append(out) and None)
    buffer = mx.zeros((1, 2, 16, 4))
    kv_copy.place_rows([(buffer[..., :5, :], 0)], 16, buffer)
    assert len(viewed) == (1 if on_a_cpu else 0)
    kv_copy.use_host_views(not on_a_cpu)  # an engine's profile wins over the device
    viewed.clear()
    kv_copy.place_rows([(buffer[..., :5, :], 0)], 16, buffer)
    assert len(viewed) == (0 if on_a_cpu else 1)


@pytest.mark.parametrize("host_views", [True, False])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_tokens_with_room_are_the_tokens_then_zeros_in_one_node_without_host_views(
        host_views: bool, dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished batch row's float buffers, and a cache read ahead's, get room for the next turn's tokens: one
    node an array under the GPU policy (a node costs a GPU's host at each launch), the same values either road."""
    monkeypatch.setattr(kv_copy, "_host_views", host_views)
    mx.random.seed(2)
    batch = mx.random.normal((3, 2, 300, 8)).astype(dtype)
    mx.eval(batch)
    row = batch[1:2, :, 7:290]  # a batch row's view, as a finished row's is
    out = kv_copy.tokens_with_room(row, 512)
    if not host_views:
        assert _nodes(out) == 2  # the row's slice, and the one pad
    assert out.shape == (1, 2, 512, 8) and out.dtype == dtype
    assert mx.array_equal(out[..., :283, :], row).item() and mx.abs(out[..., 283:, :]).max().item() == 0
    assert mx.array_equal(kv_copy.tokens_with_room(batch, 512)[:, :, :300], batch).item()
