"""On CUDA, quantized projections are made float at load where MLX would compile a kernel mid-turn
(runtime.model.cuda_qmm): H200 run 4's needle rows on SmolLM2-135M (576 wide) took 221 s, and its
first 1,000-token forward did not end in a minute; with only its narrow projections made float, 6
needle trials at 8K still took 152 s (run 5). A small model now has all of them made float; a larger
one keeps those MLX's fast kernel takes packed, and compiles their kernels at load. The fast kernel's
rule is read from MLX 0.32's source; here it is held, and so is what the swap must not change: the
model's logits (the same values, in float instead of packed).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np
import pytest
from conftest import models_dir

from runtime.model import cuda_qmm, default_model
from runtime.model.cuda_qmm import WARM_ROWS, float_for_cuda, has_fast_prefill_kernel, warm_quantized_kernels
from runtime.model.gguf import prepare_gguf
from runtime.model.loaded import load_model


@pytest.mark.parametrize(("out_features", "in_features", "bits", "group_size", "mode", "activations", "fast"), [
    (2048, 2048, 4, 64, "affine", mx.bfloat16, True),  # Llama-3.2-1B's projections
    (1536, 576, 8, 32, "affine", mx.float16, True),  # SmolLM2-135M's gate and up projections
    (576, 576, 8, 32, "affine", mx.float16, False),  # its query projection: 576 is not a multiple of 128
    (192, 576, 4, 32, "affine", mx.float16, False),  # its keys and values
    (576, 1536, 4, 32, "affine", mx.float16, False),  # its down projection
    (256, 96, 4, 32, "affine", mx.float16, False),  # an input width not a multiple of 64
    (256, 256, 3, 64, "affine", mx.float16, False),  # 3 bits
    (256, 256, 4, 64, "affine", mx.float32, False),  # float32 activations
    (256, 256, 4, 32, "mxfp4", mx.bfloat16, False),
])
def test_the_fast_kernel_takes_what_mlx_0_32_s_cuda_source_says(out_features, in_features, bits, group_size, mode,
                                                                 activations, fast) -> None:
    assert has_fast_prefill_kernel(out_features, in_features, bits=bits, group_size=group_size, mode=mode,
                                   activations=activations) is fast


def _logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _packed_default_model() -> nn.Module:
    return prepare_gguf(default_model.default_model_file(), models_dir=models_dir(), weights="quantized",
                        packed_floats="float16").build_model()


def test_smollm2_is_small_every_projection_becomes_float_and_its_logits_stay_right() -> None:
    model = _packed_default_model()
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 49152, size=16)]
    reference = _logits(load_model("kvmem-default", models_dir=models_dir(), weights="float32").model, ids)
    # float32 here, not the engine's float16: MLX's CPU backend multiplies float16 without BLAS, and its
    # quantized float16 matmul at these shapes took 91 s for 16 tokens (the reason the packed model's own
    # logits are not computed here; tests/model/test_gguf.py holds those against the same reference).
    made_float, quantized = float_for_cuda(model, mx.float32, activations=mx.float16)
    assert len(made_float) == quantized == 7 * len(model.model.layers) + 1  # the tied embedding too
    assert not [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert isinstance(model.model.embed_tokens, nn.Embedding) and model.model.embed_tokens.weight.dtype == mx.float32
    after = _logits(model, ids)
    # Against the file's weights loaded as float32 (an independent reference): within the 5% the packed
    # model is held to (measured: 0.12 of a largest logit of 29.5; the packed blocks, 16.7 at one position).
    assert np.abs(after - reference).max() < 0.05 * np.abs(reference).max()
    assert (after.argmax(-1) == reference.argmax(-1)).mean() >= 0.95
    assert warm_quantized_kernels(model, mx.float16) == 0  # nothing packed is left to compile


def test_a_larger_model_keeps_what_the_fast_kernel_takes_packed_and_compiles_it_at_load(monkeypatch) -> None:
    """As SmolLM2 would be were it over the small-model bound: its narrow projections go float, its gate and
    up projections and its tied head stay packed, and one warm-up product per row tile runs for each kind."""
    model = _packed_default_model()
    made_float, quantized = float_for_cuda(model, mx.float32, activations=mx.float16, small_bytes=0)
    layer = model.model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
        assert f"model.layers.0.{name}" in made_float
    assert isinstance(layer.self_attn.q_proj, nn.Linear) and layer.self_attn.q_proj.weight.dtype == mx.float32
    assert isinstance(layer.mlp.gate_proj, nn.QuantizedLinear) and isinstance(layer.mlp.up_proj, nn.QuantizedLinear)
    assert len(made_float) == 5 * len(model.model.layers) and quantized == 7 * len(model.model.layers) + 1
    kinds = {(m.bits, m.group_size, isinstance(m, nn.QuantizedEmbedding)) for _, m in model.named_modules()
             if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    products: list[tuple[int, ...]] = []  # built, not run: on a GPU running them would compile MLX's kernels
    monkeypatch.setattr(cuda_qmm.mx, "eval", lambda outs: products.extend(tuple(o.shape) for o in outs))
    assert warm_quantized_kernels(model, mx.float16) == len(WARM_ROWS) * len(kinds) == len(products)
    assert {shape[1] for shape in products} == set(WARM_ROWS) == {16, 32, 64}  # MLX's CUDA row tiles


def test_the_engine_makes_them_float_only_where_its_profile_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.execution import mlx_engine

    for on in (True, False):
        engine = mlx_engine.MlxEngine(models_dir=models_dir(), kv_bits=4, kv_group_size=64, attention="at-rest",
                                      profile="gpu")
        # as on CUDA; unfused, so that q_proj is a layer of its own to look at (tests/model/test_fused_projections.py
        # fuses float and quantized projections alike)
        engine._profile = msgspec.structs.replace(engine._profile, float_slow_projections=on, fused_projections=False)
        try:
            engine.load("kvmem-default")
            q_proj = engine.lm.model.model.layers[0].self_attn.q_proj
            assert isinstance(q_proj, nn.Linear if on else nn.QuantizedLinear)
        finally:
            engine.unload()
