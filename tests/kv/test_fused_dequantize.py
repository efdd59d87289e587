"""The GPU policy dequantizes Q4 caches with MLX's one kernel (``mx.dequantize``), the CPU policy unpacked.

On a GPU the unpacked form (runtime.kv.q4_packing.dequantize_kv) is nine kernels an array with float32
intermediates eight times the packed size; ``mx.dequantize`` is one (and a cast). Here (CPU) what holds
is that the fused road is a handful of operations, gives the unpacked road's values within float16's
rounding (far under Q4's own error), and that the engine takes it under the GPU policy only: for a
turn activated from a parked Q4 cache and for a park's kept float buffers alike, so the two stay the
same bytes (a turn resumed from kept float is the turn activated from Q4).
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_turns import run_turn, tiny_engine

from runtime.kv import q4_packing
from runtime.kv.q4_packing import dequantize_kv, quantize_kv
from runtime.plan.turn_plan import FromHot, TurnPlan


def _ops(a: mx.array, tmp_path: Path) -> list[str]:
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), a)
    return [label for label in re.findall(r'label ?="([^"]*)"', dot.read_text()) if label[:1].isupper()]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_fused_road_is_mlx_dequantize_with_the_unpacked_values(dtype: mx.Dtype, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    x = mx.random.normal((1, 4, 300, 64), key=mx.random.key(3)) * 3
    packed = quantize_kv(x, 64, 4)
    mx.eval(x, packed)  # the graphs below are the dequantizations alone
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(q4_packing.mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    unpacked = dequantize_kv(packed, 64, 4, dtype)
    assert not calls and "Dequantize" not in " ".join(_ops(unpacked, tmp_path))
    fused = dequantize_kv(packed, 64, 4, dtype, fused=True)
    assert len(calls) == 1  # one call for the array (on a GPU one kernel; MLX's CPU backend composes it)
    assert fused.dtype == unpacked.dtype == dtype and fused.shape == unpacked.shape == x.shape
    a, b = np.array(fused.astype(mx.float32)), np.array(unpacked.astype(mx.float32))
    # float16 arithmetic (two roundings) against float32's, then one more rounding into bfloat16 (an ulp apart)
    eps = 2**-7 if dtype == mx.bfloat16 else 2**-10
    np.testing.assert_allclose(a, b, rtol=eps, atol=1e-2)
    q4_error = float(np.abs(b - np.array(x)).max())
    assert float(np.abs(a - b).max()) < q4_error / 10


@pytest.mark.parametrize(("profile", "fused"), [("gpu", True), ("cpu", False)])
def test_the_engine_dequantizes_by_its_profiles_road(profile: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = q4_packing.dequantize_kv

    def spy(*args, fused: bool = False, **kwargs):
        calls.append(fused)
        return real(*args, fused=fused, **kwargs)

    monkeypatch.setattr(q4_packing, "dequantize_kv", spy)
    import runtime.kv.kvstate as kvstate

    monkeypatch.setattr(kvstate, "dequantize_kv", spy)
    with tiny_engine(profile, keep_float_mb=0) as engine:  # no kept float: a hot turn activates its Q4
        assert engine.lm.spec.fused_dequantize is fused and engine.profile.fused_dequantize is fused
        parked = run_turn(engine).parked
        assert parked is not None and parked.resident is None
        hot = TurnPlan(tier="hot", source=FromHot(parked=parked), match="extend", reuse_tokens=parked.num_tokens,
                       reuse_chars=len(parked.text))
        calls.clear()
        run_turn(engine, 2, parked.text + " And the harbour?", hot)
        assert calls and set(calls) == {fused}


def test_under_the_gpu_policy_a_turn_resumed_from_kept_float_is_the_turn_activated_from_q4() -> None:
    """The kept float buffers are overwritten by the same (fused) dequantization activating the Q4
    would make, so both roads give the same next turn, token for token and logit for logit."""
    replies = []
    for keep_float_mb in (64, 0):
        with tiny_engine("gpu", keep_float_mb=keep_float_mb) as engine:
            first = run_turn(engine, max_tokens=6)
            parked = first.parked
            assert (parked.resident is not None) is (keep_float_mb > 0)
            hot = TurnPlan(tier="hot", source=FromHot(parked=parked), match="extend",
                           reuse_tokens=parked.num_tokens, reuse_chars=len(parked.text))
            second = run_turn(engine, 2, parked.text + " And the harbour?", hot, max_tokens=8)
            replies.append((second.reply, [np.array(a) for layer in second.parked.layers
                                           for a in layer.arrays.values()]))
    (reply_a, arrays_a), (reply_b, arrays_b) = replies
    assert reply_a == reply_b
    for a, b in zip(arrays_a, arrays_b, strict=True):
        np.testing.assert_array_equal(a, b)
