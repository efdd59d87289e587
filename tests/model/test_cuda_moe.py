"""The diagnostic roads for expert products (``runtime.model.cuda_moe``, ``KVMEM_CUDA_MOE``) compute what mlx-lm's
``SwitchGLU`` does: a lent GPU runs run 5's failing tiny-gpt-oss tests down each to find the wrong kernel, so
here every road must give the model's own logits, with a pass long enough to sort its pairs. On MLX's CPU
stream, whatever the device: the kernels under suspicion are CUDA's, and this is the roads' own logic."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import models_dir
from mlx_lm.models.switch_layers import SwitchGLU

from runtime.model.cuda_moe import MOE_ROADS, take_moe_road
from runtime.model.loaded import load_model


def _logits(lm) -> np.ndarray:
    ids = lm.tokenize("The harbour master kept a ledger of ships and their cargo. " * 4)[0]
    assert len(ids) * lm.model.layers[0].mlp.num_experts_per_tok >= 64  # mlx-lm sorts this pass's pairs
    with mx.stream(mx.cpu):
        return np.array(lm.model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("road", sorted(MOE_ROADS))
def test_each_road_gives_the_models_own_logits(road: str) -> None:
    lm = load_model("tiny-gpt-oss", models_dir=models_dir(), numpy_attention=False)
    before = _logits(lm)
    blocks = [m for _, m in lm.model.named_modules() if isinstance(m, SwitchGLU)]
    assert take_moe_road(lm.model, road) == len(blocks) == len(lm.model.layers)
    assert all(type(m) is MOE_ROADS[road] for m in blocks)
    np.testing.assert_allclose(_logits(lm), before, atol=1e-4)


def test_an_unknown_road_is_refused() -> None:
    lm = load_model("tiny-gpt-oss", models_dir=models_dir(), numpy_attention=False)
    with pytest.raises(ValueError, match="KVMEM_CUDA_MOE"):
        take_moe_road(lm.model, "sideways")
