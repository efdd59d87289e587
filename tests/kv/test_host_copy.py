"""A parked cache's host copy made a part at a time (runtime.kv.host_copy) is the copy made whole.

Parts are token ranges of one array of one layer, each under the part size on the host; the parts
cover every array's tokens once, in order, and whatever the part size, the assembled snapshot is,
array for array, the parked arrays read straight into numpy; made in one evaluation
(``make_rest``, as ``ParkedCache.to_snapshot`` does) it is the same.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_turns import host_arrays, run_turn, tiny_engine

from runtime.kv.host_copy import HostCopy, _parts


@pytest.fixture(scope="module")
def parked():
    prompt = "User: " + "Tell me about the harbour, its boats and the people who sail them. " * 6 + "\nAssistant:"
    with tiny_engine("gpu") as engine:
        yield run_turn(engine, prompt=prompt).parked


@pytest.mark.parametrize("part_bytes", [1, 700, 5000, 2**30])
@pytest.mark.parametrize("by_copy", [True, False])
def test_a_copy_in_parts_is_the_copy_made_whole(parked, part_bytes: int, by_copy: bool) -> None:
    copy = HostCopy(parked, by_copy=by_copy, part_bytes=part_bytes)
    arrays = sum(len(layer.arrays) for layer in parked.layers)
    assert len(copy.parts) >= arrays and (part_bytes > 2**20 or len(copy.parts) > arrays)
    while not copy.complete:
        copy.make_next()
    made = copy.snapshot()
    at_once = HostCopy(parked, by_copy=by_copy, part_bytes=part_bytes)
    at_once.make_rest()
    for snapshot in (made, at_once.snapshot()):
        assert snapshot.token_ids == list(parked.token_ids) and snapshot.text == parked.text
        for layer, parked_layer, reference in zip(snapshot.layers, parked.layers, host_arrays(parked), strict=True):
            assert layer.kind == parked_layer.kind and list(layer.arrays) == list(reference)
            for name in reference:
                assert layer.arrays[name].dtype == reference[name].dtype
                np.testing.assert_array_equal(layer.arrays[name], reference[name], err_msg=name)


def test_a_snapshot_needs_every_part(parked) -> None:
    copy = HostCopy(parked, by_copy=True)
    copy.make_next()
    with pytest.raises(ValueError, match="not copied yet"):
        copy.snapshot()


def test_parts_cover_each_arrays_tokens_once_under_the_part_size() -> None:
    arrays = {"packed": mx.zeros((1, 2, 100, 8), dtype=mx.uint32),  # 64 bytes a token
              "scales": mx.zeros((1, 2, 100, 1), dtype=mx.bfloat16),  # 4 bytes a token, read as float32: 8
              "empty": mx.zeros((1, 2, 0, 8), dtype=mx.uint32)}
    parts = _parts(3, arrays, 1000)
    assert {p[0] for p in parts} == {3}
    for name, per_token in (("packed", 64), ("scales", 8)):
        ranges = [(start, stop) for _, n, start, stop in parts if n == name]
        assert ranges[0][0] == 0 and ranges[-1][1] == 100
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous, in order
        assert all(0 < (stop - start) * per_token <= 1000 for start, stop in ranges)
    assert [p for p in parts if p[1] == "empty"] == [(3, "empty", 0, 0)]  # one (empty) part all the same
