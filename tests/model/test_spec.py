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
    with pytest.raises(ValueError, match="key bits"):
        KVFormat(bits=4, key_bits=2)
    with pytest.raises(ValueError, match="float KV"):
        KVFormat(bits=None, key_bits=8)


def test_keys_at_their_own_bits_are_a_format_of_their_own():
    """Keys in Q8 with values in Q4 (llama.cpp's ``-ctk q8_0 -ctv q4_0``): a label, and so a tag, of their own (a
    Q4 cache is never read as one), and one format with equal bits whichever way it is spelled."""
    mixed = KVFormat(bits=4, key_bits=8)
    assert (mixed.label, mixed.keys_bits, mixed.values_bits, mixed.mixed) == ("k8v4g64", 8, 4, True)
    assert KVFormat(bits=4, key_bits=4) == KVFormat(bits=4) and KVFormat(bits=4, key_bits=4).label == "q4g64"
    assert KVFormat(bits=8, key_bits=4, group_size=32).label == "k4v8g32"
    spec = tiny("tiny-llama").spec
    from dataclasses import replace

    assert replace(spec, kv_format=mixed).tag.endswith("/k8v4g64") and replace(spec, kv_format=mixed).tag != spec.tag


@pytest.mark.parametrize("fmt", [KVFormat(bits=4), KVFormat(bits=8), KVFormat(bits=4, key_bits=8),
                                 KVFormat(bits=8, key_bits=4, group_size=32)], ids=lambda f: f.label)
def test_bytes_per_token_are_the_packed_arrays_bytes(fmt: KVFormat):
    """The memory accounting of a format is what its packed keys and values take (each at its own bits)."""
    import mlx.core as mx

    from runtime.kv.q4_packing import quantize_kv

    heads, dim, tokens = 2, 64, 8
    keys, values = (quantize_kv(mx.zeros((1, heads, tokens, dim)), fmt.group_size, b)
                    for b in (fmt.keys_bits, fmt.values_bits))
    packed = sum(a.nbytes for a in (*keys, *values))
    assert fmt.quantized_bytes(heads, dim, dim) * tokens == packed


def test_auto_attention_is_at_rest_on_every_device():
    from runtime.kv.kvstate import resolve_attention

    assert resolve_attention("native") == "native"
    assert resolve_attention("auto") == "at-rest"  # fidelity decides, on the CPU and on GPUs alike
    with pytest.raises(ValueError):
        resolve_attention("fast")
