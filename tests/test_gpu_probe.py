"""The GPU probe's sections run end to end here (``benches.gpu_probe``), so a lent device's few minutes are not
spent finding a mistake in one: each is run small, under the GPU policy forced on the CPU device where it
takes a profile. What the numbers mean is read on a GPU; here only their shape is checked."""

from __future__ import annotations

from conftest import models_dir

from benches.gpu_probe import joint_pass_rows


def test_the_joint_pass_is_timed_in_pieces_first_round_apart() -> None:
    rows = joint_pass_rows("tiny-llama", 3, 60, 2, profile="gpu", models_dir=models_dir())
    names = [r[0] for r in rows]
    pieces = ["activate 3 rows' caches", "line them up, one batch cache a layer", "joint pass, rows already active",
              "joint pass as the GPU actor makes it", "same, again at the same shapes", "one row's hot chunk alone"]
    assert names == [f"{p} (first round)" for p in pieces] + pieces
    for name, rounds, *ms in rows:
        assert rounds == "1", name
        build, submit, wait, total = map(float, ms)
        assert min(build, submit, wait) >= 0 and abs(build + submit + wait - total) < 0.02, name
