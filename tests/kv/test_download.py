"""A cache copied to the host for its save is read from a device copy under the GPU policy.

On CUDA, the host reading an MLX array moves the array's whole buffer to managed memory for good
(``Buffer::raw_ptr``, MLX 0.32). The arrays a save copy reads are views of the parked cache, which
stays hot after the save: read in place, its buffers would page back onto the device at its next
use. Here (the CPU backend) host memory is the device's, so what these tests hold is that the host
is handed a new array (a Multiply node in the graph, not the parked cache's slice) with the same
values, that the GPU policy's engine reads through it and the CPU policy's does not, and that the
snapshot is the same by either road.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_turns import host_arrays, run_turn, tiny_engine

from runtime.kv import host_copy


def _ops(a: mx.array, tmp_path: Path) -> set[str]:
    """The operations of ``a``'s (lazy) graph, from MLX's own DOT export."""
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), a)
    return {label for label in re.findall(r'label ?="([^"]*)"', dot.read_text()) if label[:1].isupper()}


@pytest.mark.parametrize("dtype", [mx.uint32, mx.float16, mx.float32])
def test_by_copy_the_host_reads_a_new_array_with_the_same_values(dtype: mx.Dtype, tmp_path: Path) -> None:
    parked = (mx.random.normal((1, 2, 40, 8)) * 1000).astype(dtype)
    mx.eval(parked)
    view = parked[0]
    copied = host_copy.host_readable(view, by_copy=True)
    assert "Multiply" in _ops(copied, tmp_path)  # computed on the device into a buffer of its own
    assert "Multiply" not in _ops(host_copy.host_readable(view, by_copy=False), tmp_path)  # the view itself
    assert copied.dtype == dtype
    np.testing.assert_array_equal(np.array(copied), np.array(view))  # x * 1 is exact


def test_bfloat16_is_widened_to_a_new_float32_array_either_way(tmp_path: Path) -> None:
    scales = mx.random.normal((1, 2, 40, 1)).astype(mx.bfloat16)
    for by_copy in (True, False):
        host = host_copy.host_readable(scales[0], by_copy=by_copy)
        assert host.dtype == mx.float32 and "AsType" in _ops(host, tmp_path)
        np.testing.assert_array_equal(np.array(host), np.array(scales[0].astype(mx.float32)))


@pytest.mark.parametrize(("profile", "by_copy"), [("gpu", True), ("cpu", False)])
def test_the_engine_reads_a_save_copy_as_its_profile_says(profile: str, by_copy: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with tiny_engine(profile) as engine:
        assert engine.profile.download_by_copy is by_copy
        finished = run_turn(engine)
        assert finished.parked is not None
        roads: list[bool] = []
        real = host_copy.host_readable
        monkeypatch.setattr(host_copy, "host_readable", lambda a, *, by_copy: roads.append(by_copy) or real(a, by_copy=by_copy))
        made = engine.snapshot(finished.parked)  # what the GPU actor calls for a copy after the turn
        assert made is not None and roads and set(roads) == {by_copy}
        # the same bytes by either road: the parked arrays read straight into numpy
        for layer, reference in zip(made.layers, host_arrays(finished.parked), strict=True):
            assert layer.arrays.keys() == reference.keys()
            for name in reference:
                np.testing.assert_array_equal(layer.arrays[name], reference[name], err_msg=name)
