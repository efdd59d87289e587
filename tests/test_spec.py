"""ModelCacheSpec is read from the model itself."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache

from conftest import tiny
from runtime.errors import UnsupportedModelError
from runtime.model.loaded import read_cache_spec
from runtime.spec import KVFormat, LayerKind, ModelCacheSpec


def test_llama_layers_are_full_attention_q4():
    spec = tiny("tiny-llama").spec
    assert all(layer.kind == "full" and layer.k_head_dim == 64 for layer in spec.layers)
    assert set(spec.layer_kinds()) == {LayerKind.Q4}
    assert spec.tag.startswith("tiny-llama@") and spec.tag.endswith("/q4g64")


def test_gemma3_mixes_sliding_and_full_layers():
    spec = tiny("tiny-gemma3").spec
    kinds = {layer.kind for layer in spec.layers}
    assert kinds == {"full", "sliding"}
    assert all(layer.window == 32 for layer in spec.layers if layer.kind == "sliding")
    assert LayerKind.SLIDING in spec.layer_kinds() and LayerKind.Q4 in spec.layer_kinds()


def test_gpt_oss_layers_have_sinks():
    spec = tiny("tiny-gpt-oss").spec
    assert all(layer.sinks for layer in spec.layers)
    assert {layer.kind for layer in spec.layers} == {"full", "sliding"}


def test_deepseek_v2_keys_and_values_differ_in_width():
    spec = tiny("tiny-deepseek-v2").spec
    assert all(layer.k_head_dim != layer.v_head_dim for layer in spec.layers)


def test_tag_depends_on_kv_format():
    assert tiny("tiny-llama", bits=4).spec.tag != tiny("tiny-llama", bits=None).spec.tag
    assert tiny("tiny-llama", bits=4).spec.tag != tiny("tiny-llama", bits=8).spec.tag


def test_q4_bytes_per_token_is_under_029_of_fp16():
    spec = tiny("tiny-llama", bits=4).spec
    fp16 = sum(layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * 2 for layer in spec.layers)
    assert spec.bytes_per_token() <= 0.29 * fp16


class _SSMModel:
    layers = [object()]

    def make_cache(self):
        return [ArraysCache(2)]


def test_unsupported_cache_kind_fails_clearly():
    with pytest.raises(UnsupportedModelError, match="ArraysCache"):
        read_cache_spec(_SSMModel(), model_id="ssm", config={}, kv_format=KVFormat())


def test_invalid_kv_format_is_rejected():
    with pytest.raises(ValueError):
        KVFormat(bits=3)


def test_auto_attention_is_at_rest_on_every_device():
    from runtime.kv.kvstate import resolve_attention

    assert resolve_attention("native") == "native"
    assert resolve_attention("auto") == "at-rest"  # fidelity decides, on the CPU and on GPUs alike
    with pytest.raises(ValueError):
        resolve_attention("fast")
