"""LoadedModel.forward_last: the last position's logits, the LM head on that position only.

Reference: the model's own full forward (mlx-lm's ``Model.__call__``), last position.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny
from runtime.model.loaded import _last_position_head


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_the_full_forward_at_the_last_position(name: str, batch: int) -> None:
    lm = tiny(name)
    ids = mx.array(np.random.default_rng(0).integers(10, 200, size=(batch, 37)).tolist())
    ours_cache, ref_cache = make_prompt_cache(lm.model), make_prompt_cache(lm.model)
    for a, b in ((0, 30), (30, 37)):  # over a cache, as a last prefill chunk runs
        ours = lm.forward_last(ids[:, a:b], ours_cache)
        ref = lm.model(ids[:, a:b], cache=ref_cache)[:, -1, :]
        assert ours.shape == ref.shape
        assert mx.abs(ours - ref).max().item() < 1e-4


def test_only_llama_and_qwen2_take_the_short_path() -> None:
    assert _last_position_head(tiny("tiny-llama").model) is not None
    assert _last_position_head(tiny("tiny-qwen2").model) is not None
    assert _last_position_head(tiny("tiny-gemma3").model) is None
