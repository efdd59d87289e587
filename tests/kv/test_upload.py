"""A cache read from disk reaches the device through ``mx.load`` under the GPU policy (runtime.kv.upload).

On CUDA, ``mx.array`` of host data is managed memory the device pages in at about 0.6 GB/s; ``mx.load``
copies each array to device memory at once. Here (the CPU backend) both roads end in host memory, so
what these tests hold is that the road changes nothing: the bytes ``mx.load`` is served are a valid
safetensors file (read back by the ``safetensors`` package, an independent reader), and a real cache
made hot again by either road is the same, array for array.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_turns import run_turn, tiny_engine
from safetensors.numpy import load as safetensors_load

from runtime.kv import upload
from runtime.kv.kvstate import ParkedCache


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "packed": rng.integers(0, 2**32, size=(8, 300, 8), dtype=np.uint32),  # Q4 words
        "scales": rng.standard_normal((8, 300, 2)).astype(np.float16),
        "k": rng.standard_normal((8, 300, 64)).astype(np.float32),
        "strided": rng.standard_normal((6, 10)).astype(np.float32)[:, ::2],  # not contiguous
        "fortran": np.asfortranarray(rng.standard_normal((3, 5)).astype(np.float32)),
    }


def test_the_view_is_a_safetensors_file_of_the_arrays() -> None:
    arrays = _arrays()
    read = safetensors_load(upload.SafetensorsView(arrays).read())
    assert read.keys() == arrays.keys()
    for name, array in arrays.items():
        assert read[name].dtype == array.dtype
        np.testing.assert_array_equal(read[name], array, err_msg=name)


def test_reads_across_parts_and_seeks_return_the_same_bytes() -> None:
    view = upload.SafetensorsView(_arrays())
    whole = view.read()
    view.seek(0)
    pieces = []
    while piece := view.read(997):  # a size that cuts header and arrays anywhere
        pieces.append(piece)
    assert b"".join(pieces) == whole
    view.seek(-100, 2)
    assert view.read() == whole[-100:] and view.tell() == len(whole)


@pytest.mark.parametrize("by_copy", [True, False])
def test_to_device_gives_the_arrays_by_either_road(by_copy: bool) -> None:
    arrays = {**_arrays(), "empty": np.zeros((0, 4), np.float32)}  # safetensors holds no empty array: mx.array
    on_device = upload.to_device(arrays, by_copy=by_copy)
    for name, array in arrays.items():
        got = on_device[name]
        assert got.shape == array.shape and np.dtype(str(got.dtype).removeprefix("mlx.core.")) == array.dtype
        np.testing.assert_array_equal(np.array(got), array, err_msg=name)


def test_by_copy_goes_through_mx_load(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = mx.load
    monkeypatch.setattr(upload.mx, "load", lambda *a, **k: calls.append(k.get("format")) or real(*a, **k))
    upload.to_device(_arrays(), by_copy=True)
    upload.to_device(_arrays(), by_copy=False)
    assert calls == ["safetensors"]  # once for all the arrays, and only when asked


@pytest.mark.parametrize(("profile", "by_copy"), [("gpu", True), ("cpu", False)])
def test_a_snapshot_made_hot_again_is_the_same_cache_by_either_road(profile: str, by_copy: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with tiny_engine(profile) as engine:
        assert engine.lm.upload_by_copy is by_copy  # the profile decides, once, at load
        finished = run_turn(engine)
        assert finished.parked is not None
        snapshot = finished.snapshot or engine.snapshot(finished.parked)
        assert snapshot is not None
        roads = [ParkedCache.from_snapshot(snapshot, float_dtype=engine.lm.float_dtype, by_copy=b) for b in (True, False)]
        for a, b in zip(roads[0].layers, roads[1].layers, strict=True):
            assert a.arrays.keys() == b.arrays.keys()
            for name in a.arrays:
                assert a.arrays[name].dtype == b.arrays[name].dtype
                np.testing.assert_array_equal(np.array(a.arrays[name]), np.array(b.arrays[name]), err_msg=name)
        loads = []
        real = mx.load
        monkeypatch.setattr(upload.mx, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
        assert engine.prepare(snapshot) is not None  # the engine's own road, as its profile says
        assert len(loads) == (1 if by_copy else 0)  # one mx.load for the whole cache under the GPU policy


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_a_cache_prepared_ahead_of_its_turn_is_on_the_device_already(profile: str) -> None:
    """``prepare`` (a read-ahead cache restored before its turn) leaves no lazy upload for the turn's first
    chunk: every parked array is evaluated when it returns (H200 run 5: a read-ahead turn's chunk took
    13 ms of submit against a hot one's 5.6)."""
    import io

    with tiny_engine(profile) as engine:
        finished = run_turn(engine)
        assert finished.parked is not None
        snapshot = finished.snapshot or engine.snapshot(finished.parked)
        assert snapshot is not None
        prepared = engine.prepare(snapshot)
        assert prepared is not None
        arrays = [a for layer in prepared.layers for a in layer.arrays.values()]
        graph = io.StringIO()
        mx.export_to_dot(graph, *arrays)
        assert graph.getvalue().count("shape=rectangle") == 0  # no primitive left to run: all evaluated
