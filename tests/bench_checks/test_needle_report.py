"""The needle benchmark's report: its goal verdict and the margins of replayed reply differences.

The verdict is computed from journal rows, so it is checked here on rows
written by hand: a hit/miss flip at a float margin within the stated Q4
tolerance is reported as a near-tie, one above it as a real loss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benches.quality import needle
from benches.quality.needle_margins import first_difference


def _row(fmt: str, hit: bool, answer: str, *, length: int = 8192, index: int = 3) -> dict[str, Any]:
    return {"form": "phone-primed", "seed": 0, "length": length, "format": fmt, "needle": index, "depth": 0.32,
            "position": 2440, "key": "Oslo", "value": "94952", "hit": hit, "answer": answer}


def _margin(float_margin: float) -> dict[str, Any]:
    return {"form": "phone-primed", "seed": 0, "length": 8192, "format": "q4-at-rest", "position": 2440,
            "key": "Oslo", "value": "94952", "float_answer": " 94992.", "answer": " 94952.", "reproduced": True,
            "step": 3, "float_margin": float_margin, "margin": 0.2}


@pytest.mark.parametrize(("float_margin", "verdict"), [(0.31, "**Within the stated Q4 tolerance (1.0 nats): holds**"),
                                                       (2.5, "tolerance (1.0 nats): does not hold**")])
def test_a_flip_is_judged_by_float_margin_where_the_replies_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 float_margin: float, verdict: str) -> None:
    margins = tmp_path / "margins.jsonl"
    margins.write_text(json.dumps(_margin(float_margin)) + "\n")
    monkeypatch.setattr(needle, "MARGINS", margins)
    results = [_row("float", False, " 94992."), _row("q4-at-rest", True, " 94952.")]
    goal = "\n".join(needle._goal(results, [8192]))
    assert "**Literally: does not hold on these needles**: 1 hit/miss flip, 1 where" in goal
    assert verdict in goal
    partings = "\n".join(needle._partings(results))
    assert f"{float_margin:.3f}" in partings and "`94992.`" in partings


def test_without_replays_the_report_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(needle, "MARGINS", tmp_path / "none.jsonl")
    results = [_row("float", False, " 94992."), _row("q4-at-rest", True, " 94952.")]
    assert "within the stated" not in "\n".join(needle._goal(results, [8192]))
    assert "not replayed yet" in "\n".join(needle._partings(results))


def test_a_replay_of_another_reply_is_not_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    margins = tmp_path / "margins.jsonl"
    margins.write_text(json.dumps({**_margin(0.1), "answer": " 94000."}) + "\n")  # a different trial's reply
    monkeypatch.setattr(needle, "MARGINS", margins)
    results = [_row("float", False, " 94992."), _row("q4-at-rest", True, " 94952.")]
    assert "within the stated" not in "\n".join(needle._goal(results, [8192]))


def test_replies_in_table_cells_keep_the_table_intact() -> None:
    assert needle._code(" 77625.\n\nThe | number") == "`77625.⏎⏎The \\| number`"


@pytest.mark.parametrize(("a", "b", "step"), [([1, 2, 3, -1], [1, 2, 4, -1], 2), ([1, 2, -1], [1, 2, 5, -1], 2),
                                              ([7, -1], [8, -1], 0)])
def test_first_difference(a: list[int], b: list[int], step: int) -> None:
    assert first_difference(a, b) == step


def test_the_small_sample_caveat_appears_only_while_coverage_is_uneven(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(needle, "MARGINS", tmp_path / "none.jsonl")
    even = [_row(fmt, True, " 94952.", index=i) for fmt in ("float", "q4-at-rest", "q4-native") for i in range(3)]
    assert "weaker evidence" not in "\n".join(needle._goal(even, [8192]))
    uneven = [r for r in even if not (r["format"] == "q4-native" and r["needle"] == 2)]
    assert "weaker evidence" in "\n".join(needle._goal(uneven, [8192]))


@pytest.mark.parametrize("fmt", needle.DERIVED)
def test_each_derived_format_starts_a_turn_from_the_float_context_as_its_quantization_gives_it(
        tmp_path: Path, fmt: str) -> None:
    """Every at-rest format of the needle rows, from one float context on a tiny model, kvmem's through the disk
    (Q4 and Q8 in groups of 64, Q4 in groups of 32, keys Q8 with values Q4). Reference:
    each tensor quantized and dequantized on its own by MLX (``mx.quantize``/``mx.dequantize``) in float32 at
    the format's bits and group; the caches hold the context's length and stay within a quantization step
    of it (Q8's steps far smaller than Q4's)."""
    import mlx.core as mx
    from conftest import tiny

    lm = tiny("tiny-llama", bits=None)
    kind = needle.cache_kinds(lm)["float"]
    context = list(range(5, 5 + 300))
    caches = kind.fresh()
    needle.prefill(lm.model, context, caches)
    float_kv = kind.snapshot(caches, context)
    at_rest, extra = needle.at_rest_caches(lm, float_kv, context, fmt, tmp_path / fmt)
    kv_format = needle.AT_REST_FORMATS[fmt]
    key_bits, value_bits, group = kv_format.keys_bits, kv_format.values_bits, kv_format.group_size
    assert not (tmp_path / fmt).exists() and extra["disk_bit_exact"]

    def through_mlx(x: mx.array, bits: int) -> mx.array:  # from float16, as kvmem quantizes
        packed = mx.quantize(x.astype(mx.float16), group_size=group, bits=bits)
        return mx.dequantize(*packed, group_size=group, bits=bits).astype(mx.float32)

    error = {}
    for cache, (k, v) in zip(at_rest, float_kv, strict=True):
        assert cache.offset == len(context)
        for name, got, want, bits in (("keys", cache.keys, k, key_bits), ("values", cache.values, v, value_bits)):
            got, size = got[..., : cache.offset, :].astype(mx.float32), mx.abs(want).max().item()
            # Within float16's rounding of MLX's own round trip: another group size or bits is a step away.
            assert mx.abs(got - through_mlx(want, bits)).max().item() <= 2e-3 * size, (fmt, name)
            error[name] = max(error.get(name, 0.0), mx.abs(got - want.astype(mx.float32)).max().item() / size)
    if key_bits > value_bits:
        assert error["keys"] < error["values"] / 4, error
