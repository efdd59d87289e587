"""The GPU probe's sections run end to end here (``benches.gpu.gpu_probe``), so a lent device's few minutes are not
spent finding a mistake in one: each is run small, under the GPU policy forced on the CPU device where it
takes a profile. What the numbers mean is read on a GPU; here only their shape is checked."""

from __future__ import annotations

import re

from conftest import models_dir

from benches.gpu.gpu_probe import joint_pass_rows


def test_the_joint_pass_is_timed_in_pieces_first_round_apart() -> None:
    rows = joint_pass_rows("tiny-llama", 3, 60, 2, profile="gpu", models_dir=models_dir())
    names = [r[0] for r in rows]
    pieces = ["activate 3 rows' caches", "line them up, one batch cache a layer", "joint pass, rows already active",
              "joint pass from the rows' Q4 caches", "joint pass over their kept float buffers",
              "same, again at the same shapes", "one row's hot chunk alone", "one row's chunk over a cache read ahead"]
    assert names == [f"{p} (first round)" for p in pieces] + pieces
    operations = {}
    for name, rounds, count, *ms, per in rows:
        assert rounds == "1", name
        build, submit, wait, total = map(float, ms)
        assert min(build, submit, wait) >= 0 and abs(build + submit + wait - total) < 0.02, name
        operations[name] = int(count)
        assert operations[name] > 0 and float(per) > 0, name
    # The pass from Q4 caches submits what the pass over active rows does and the rows' activation besides, the
    # pass over kept float buffers the writing of each row's last turn into them (as its dequantized Q4): each
    # more than over active rows (which of the two is more is a matter of counts: the writes dequantize fewer
    # tokens, but into the buffers); one row's hot chunk over its kept buffers, less than the group's.
    for suffix in ("", " (first round)"):
        active, kept, q4, alone = (operations[f"{piece}{suffix}"] for piece in (
            "joint pass, rows already active", "joint pass over their kept float buffers",
            "joint pass from the rows' Q4 caches", "one row's hot chunk alone"))
        assert active < kept and active < q4 and alone < kept, (active, kept, q4, alone)
        # read ahead, a warm turn's buffers were made before it: no last turn to write in, fewer than a hot one's
        assert operations[f"one row's chunk over a cache read ahead{suffix}"] < alone


def test_attention_at_new_shapes_is_the_fused_kernels_every_way_it_is_timed() -> None:
    """Plain operations, and plain operations over the whole 256-step buffer with the keys past the cache
    masked, give MLX's fused attention's output (bf16: within its rounding); the kernel's columns are
    empty where CUDA is not."""
    from benches.gpu.gpu_probe import SHAPE_WAYS, attention_shape_rows
    from runtime.kv import short_attention

    for row in attention_shape_rows([1, 3, 16], [20, 300]):  # 1: a lone row's decode step
        assert len(row) == 2 + 2 * len(SHAPE_WAYS) + 1
        if not short_attention.available():
            assert row[-5:-1] == ["—"] * 4  # no kernel on this device, one pass or two
        assert float(row[-1]) < 2e-2, row


def test_the_expert_products_are_taken_every_road_on_both_sides_of_the_sort() -> None:
    """tiny-gpt-oss's expert products by each road of ``GATHER_WAYS``, under and over mlx-lm's sort threshold
    (64 pairs). On a CPU the "device" is MLX's CPU stream too, so every road gives the reference exactly; on a
    GPU (the suite on a lent machine) only the rows are checked, bfloat16 ones included."""
    from benches.gpu.gpu_probe import GATHER_WAYS, gather_rows

    import mlx.core as mx

    rows = gather_rows((4, 40))
    dtypes = ("float32", "bfloat16") if mx.default_device() == mx.gpu else ("float32",)
    assert [(r[0], r[2], r[3]) for r in rows] == [(n, d, w) for n in ("4", "40") for d in dtypes for w in GATHER_WAYS]
    assert {r[1] for r in rows} == {"8", "80 (sorted by mlx-lm)"}  # tiny-gpt-oss routes each token to 2 experts
    if mx.default_device() == mx.cpu:  # on a GPU the differences are the probe's findings, not this test's
        for row in rows:
            assert float(row[4]) < 1e-5 and float(row[5]) == 0.0, row


def test_the_engine_rows_run_after_a_long_turn_with_the_cache_kept_cleared_and_emptied() -> None:
    """The 3B rows' question (H200 run 5: its steps slowed turn after turn): the engine alone after a long turn
    with MLX's cache kept, after ``mx.clear_cache()``, and after a long turn that emptied it (the GPU policy)."""
    import glob

    from benches.gpu.gpu_probe import engine_decode_rows
    from conftest import tiny

    tiny("tiny-llama")  # built under models_dir()
    folder = sorted(glob.glob(str(models_dir() / "tiny-llama-*")))[0]
    rows = engine_decode_rows(folder, 6, profile="gpu", after_tokens=300, repeats=1)
    names = [r[0] for r in rows]
    assert names[:5] == ["mlx-lm generate_step", "kvmem MlxEngine.step, no actors, this thread",
                         "same, after a 300-token turn, MLX's cache kept", "same, then after mx.clear_cache()",
                         "same, after a 300-token turn, MLX's cache emptied at its end (the GPU policy)"]
    assert all(float(r[1]) > 0 for r in rows[:-2])
    # the last rows: one steady decode step's operations by kind, mlx-lm's and kvmem's (with its submit, what the
    # joint section's are read against)
    plain = re.fullmatch(r"mlx-lm's decode step: (\d+) operations \(by kind: (.+)\)", rows[-2][0])
    step = re.fullmatch(r"one decode step: (\d+) operations, build [\d.]+ ms, submit [\d.]+ ms \(([\d.]+) µs an "
                        r"operation; by kind: (.+)\)", rows[-1][0])
    assert plain is not None and step is not None, rows[-2:]
    assert int(step[1]) > 100 and float(step[2]) > 0 and int(plain[1]) > 100, rows[-2:]
    for line in (plain, step):  # the kinds add up to the count
        assert sum(int(part.rsplit(" ", 1)[1]) for part in line[line.lastindex].split(", ")) == int(line[1])


def test_the_products_section_times_each_row_count_again_and_again() -> None:
    from benches.gpu.gpu_probe import layer_product_shapes, product_rows

    rows = product_rows((1, 2, 13), [(64, 64)] * 3, "float32", repeats=2)
    assert [r[0] for r in rows] == ["1", "2", "13"]
    for _, *numbers in rows:
        assert all(float(x) >= 0 for x in numbers) and float(numbers[1]) > 0
    # a 1B layer's products as the fused_projections setting runs them: the same weights, four products for seven
    plain, fused = (layer_product_shapes(2048, 8192, 32, 8, 64, fused=f) for f in (False, True))
    assert len(plain) == 7 and len(fused) == 4
    assert sum(o * i for o, i in plain) == sum(o * i for o, i in fused)
    assert product_rows((3,), fused, "float32", repeats=1)[0][0] == "3"
