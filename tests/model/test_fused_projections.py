"""Fused projections (runtime.model.fused_projections): the same logits as mlx-lm's own layers, fewer products.

Reference: the same model folder loaded again by mlx-lm (``mlx_lm.load``), unfused: its logits over the same
prompt and cache, prefill chunks of several rows and single-token steps, float and quantized weights.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from benches.gpu.gpu_probe import graph_operation_names
from conftest import models_dir
from runtime.model.fused_projections import FusedPart, fuse_projections
from runtime.model.loaded import load_model
from runtime.model.tiny_models import ensure_tiny_model


# The largest logit difference allowed: 0 measured on the CPU (the same products, column blocks of one);
# on CUDA a product's width may pick another cuBLASLt algorithm (float32 without TF32 in the suite: about 1e-6
# of a logit's size). Argmaxes are compared where the reference's top two are further apart than this.
TOLERANCE = 1e-3


def _quantized_float32_missing() -> str | None:
    """Why this device has no quantized product for float32 activations (the tiny models'), or None."""
    w = mx.random.normal((64, 64))
    try:
        mx.eval(mx.quantized_matmul(mx.ones((2, 64)), *mx.quantize(w, group_size=32, bits=4), transpose=True,
                                    group_size=32, bits=4))
    except (RuntimeError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return None


def _products(arrays: mx.array | list[mx.array]) -> int:
    """The matrix products in the graph that computes ``arrays`` (MLX's operations by name)."""
    return sum(n in ("Matmul", "QuantizedMatmul", "AddMM") for n in graph_operation_names(arrays))


def _pair(name: str, quantized: bool) -> tuple[nn.Module, nn.Module]:
    """Two loads of the tiny model ``name`` by mlx-lm: the reference, and one to fuse (both quantized alike)."""
    if quantized and (why := _quantized_float32_missing()):
        pytest.skip(f"no quantized product for float32 activations on this device: {why}")
    folder = str(ensure_tiny_model(name, models_dir()))
    ref, fused = load(folder)[0], load(folder)[0]
    if quantized:
        for m in (ref, fused):
            nn.quantize(m, group_size=32, bits=4)
    return ref, fused


def _logits(model: nn.Module, ids: mx.array) -> list[mx.array]:
    """Logits of a prefill in two chunks, then of three single-token steps over the cache."""
    cache = make_prompt_cache(model)
    out = [model(ids[:, :20], cache=cache), model(ids[:, 20:], cache=cache)]
    for t in (7, 11, 13):
        out.append(model(mx.array([[t]] * ids.shape[0]), cache=cache))
    mx.eval(out)
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantized"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_fused_layers_give_mlx_lms_logits(name: str, quantized: bool) -> None:
    ref, fused = _pair(name, quantized)
    layers = len(fused.model.layers)
    assert fuse_projections(fused) == 2 * layers
    ids = mx.array(np.random.default_rng(1).integers(10, 200, size=(2, 33)).tolist())
    for ours, theirs in zip(_logits(fused, ids), _logits(ref, ids), strict=True):
        assert ours.shape == theirs.shape
        assert mx.abs(ours - theirs).max().item() < TOLERANCE
        top2 = mx.topk(theirs, 2, axis=-1)
        clear = mx.abs(top2[..., 0] - top2[..., 1]) > TOLERANCE
        agree = mx.argmax(ours, axis=-1) == mx.argmax(theirs, axis=-1)
        assert mx.all(agree | ~clear).item()


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantized"])
def test_each_weight_is_held_once_and_a_layer_runs_four_products(quantized: bool) -> None:
    ref, fused = _pair("tiny-llama", quantized)
    size = lambda m: sum(v.size for _, v in nn.utils.tree_flatten(m.parameters()))  # noqa: E731
    fuse_projections(fused)
    assert size(fused) == size(ref)  # the parts hold no parameters: each weight is in its group's module once
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedPart) and "weight" in attn.qkv_proj

    def products(model: nn.Module) -> int:
        return _products([model(mx.array([[5, 6, 7, 8]]), cache=make_prompt_cache(model))])

    layers = len(fused.model.layers)
    assert products(ref) - products(fused) == 3 * layers  # 7 a layer against 4

    def nodes(model: nn.Module) -> list[str]:
        return graph_operation_names([model(mx.array([[5, 6, 7, 8]]), cache=make_prompt_cache(model))])

    # and a group's parts are one node with an output each (two a layer), not a slice each (five)
    mine, theirs = nodes(fused), nodes(ref)
    assert mine.count("Split") == 2 * layers and mine.count("Slice") == theirs.count("Slice"), (mine, theirs)


def test_a_group_of_projections_quantized_differently_is_left_apart() -> None:
    ref, fused = _pair("tiny-llama", quantized=True)  # every projection at 4 bits
    for m in (ref, fused):  # then the queries at 8 bits: one product cannot hold both
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.q_proj = nn.QuantizedLinear.from_linear(_float_twin(attn.q_proj), group_size=32, bits=8)
    layers = len(fused.model.layers)
    assert fuse_projections(fused) == layers  # the MLPs only
    assert not isinstance(fused.model.layers[0].self_attn.q_proj, FusedPart)
    assert fused.model.layers[0].self_attn.q_proj.bits == 8
    ids = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    assert mx.abs(fused(ids) - ref(ids)).max().item() < TOLERANCE


def _float_twin(q: nn.QuantizedLinear) -> nn.Linear:
    """A float projection with ``q``'s dequantized weights (the same for the reference and the fused copy)."""
    out = nn.Linear(q.scales.shape[-1] * q.group_size, q.weight.shape[0], bias=False)
    out.weight = mx.dequantize(q.weight, q.scales, q.get("biases"), group_size=q.group_size, bits=q.bits)
    return out


def test_other_architectures_are_left_as_they_are() -> None:
    folder = str(ensure_tiny_model("tiny-gemma3", models_dir()))
    model = load(folder)[0]
    assert fuse_projections(model) == 0
    assert not any(isinstance(m, FusedPart) for _, m in model.named_modules())


def test_the_setting_fuses_at_load_and_the_model_answers_as_unfused() -> None:
    on = load_model("tiny-llama", models_dir=models_dir(), numpy_attention=False, fused_projections=True)
    off = load_model("tiny-llama", models_dir=models_dir(), numpy_attention=False)
    assert isinstance(on.model.model.layers[0].mlp.gate_proj, FusedPart)
    assert not isinstance(off.model.model.layers[0].mlp.gate_proj, FusedPart)
    ids = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    a, b = on.forward_last(ids, make_prompt_cache(on.model)), off.forward_last(ids, make_prompt_cache(off.model))
    assert mx.abs(a - b).max().item() < TOLERANCE


async def test_through_the_actors_turns_answer_as_unfused_and_steps_run_fewer_products(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cold, hot and warm turns under the GPU policy (forced on the CPU) give the unfused runtime's replies,
    and a decode step runs three products a layer fewer than the unfused one's."""
    from actors import open_runtime
    from runtime.execution import decode_batch

    products: list[int] = []
    launch = decode_batch.DecodeBatch._launch

    def counted(self: decode_batch.DecodeBatch, inputs: mx.array) -> mx.array:
        mx.synchronize()  # the step in flight is evaluated: only this step's products are counted
        tokens = launch(self, inputs)
        products.append(_products(tokens))
        return tokens

    monkeypatch.setattr(decode_batch.DecodeBatch, "_launch", counted)
    asks = ["Tell me about the harbour and its ships. " * 12, "And the lighthouse?", "And the keeper?"]
    replies, step_products = {}, {}
    for fused in (False, True):
        home = tmp_path / f"fused-{fused}"
        got = []
        settings = dict(home=home, models_dir=models_dir(), model="tiny-llama", prewarm_mb=0, profile="gpu",
                        fused_projections=fused)
        async with open_runtime(**settings) as rt:
            for text in asks[:2]:  # cold, then hot
                got.append((await rt.agent("a").send([{"role": "user", "content": text}], max_tokens=10)).reply)
        async with open_runtime(**settings) as rt:  # a restart: warm
            got.append((await rt.agent("a").send([{"role": "user", "content": asks[2]}], max_tokens=10)).reply)
        replies[fused] = got
        step_products[fused] = sorted(products)[len(products) // 2]
        products.clear()
    assert replies[True] == replies[False]
    layers = len(load(str(ensure_tiny_model("tiny-llama", models_dir())))[0].model.layers)
    assert step_products[False] - step_products[True] == 3 * layers, step_products


def test_the_gpu_policy_fuses_unless_told_not_to_and_the_cpu_policy_does_not() -> None:
    """H200 run 6: a 1B layer's four fused products went to the device in 0.17 ms of submit at 8 rows against its
    seven's 0.26 (every product of two or more rows costs CUDA's host a cuBLASLt lookup): the GPU policy's default.
    On the CPU the setting moved nothing measurable (``benches/results/fused_projections.md``): left off there."""
    from runtime.backend import decide_profile

    assert decide_profile(device="gpu", backend="cuda").fused_projections
    assert decide_profile(device="gpu", backend="metal").fused_projections
    assert decide_profile(device="cpu", backend="cpu", profile="gpu").fused_projections  # CI runs the GPU's layers
    assert not decide_profile(device="cpu", backend="cpu").fused_projections
    assert not decide_profile(device="gpu", backend="cuda", fused_projections=False).fused_projections
    assert decide_profile(device="cpu", backend="cpu", fused_projections=True).fused_projections
