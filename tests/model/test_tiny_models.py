"""Tiny random-weight models: they load through mlx-lm exactly as generated.

Building ``smollm2-random`` (540 MB) is skipped unless ``KVMEM_TEST_DEFAULT_MODEL=1``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from runtime.model import tiny_models as tm
from runtime.model.tokenizer_build import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS, _trained_json

TEST_MODELS = [name for name in tm.RECIPES if name != tm.RANDOM_SMOLLM2]
# Greedy tokens are compared only where the top-1 margin beats float noise
# (~1e-4 between chunked and whole prefill); the median margin is far above it.
MEDIAN_MARGIN = 1.0
MIN_LOGIT_STD = 4.0

Loaded = tuple[Any, Any]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: tm.build_tiny_model(name, root / name) for name in TEST_MODELS}


@pytest.fixture(scope="module")
def loaded(built: dict[str, Path]) -> dict[str, Loaded]:
    return {name: mlx_lm.load(str(path)) for name, path in built.items()}


def _random_prompt(n_real: int, length: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(3, n_real, size=(1, length)))


@pytest.mark.parametrize("name", TEST_MODELS)
def test_loaded_weights_equal_generated_weights(name: str, loaded: dict[str, Loaded]) -> None:
    model, _ = loaded[name]
    generated = tm.generate_weights(name)
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(generated)
    for key, expected in generated.items():
        got = params[key]
        assert got.dtype == mx.float32, key
        np.testing.assert_array_equal(np.array(got), expected, err_msg=key)


@pytest.mark.parametrize("name", TEST_MODELS)
def test_forward_gives_finite_logits_over_the_whole_vocab(
    name: str, loaded: dict[str, Loaded]
) -> None:
    model, tokenizer = loaded[name]
    vocab = tm.RECIPES[name].config["vocab_size"]
    assert len(tokenizer._tokenizer) == vocab == tm.RECIPES[name].tokenizer_vocab
    for length in (256, 512):
        logits = model(_random_prompt(vocab, length, seed=length))
        assert logits.shape == (1, length, vocab)
        assert mx.all(mx.isfinite(logits)).item()


@pytest.mark.parametrize("name", TEST_MODELS)
def test_logits_are_peaky(name: str, loaded: dict[str, Loaded]) -> None:
    model, tokenizer = loaded[name]
    n_real = len(tokenizer._tokenizer)
    margins, stds = [], []
    for seed in range(3):
        logits = np.array(model(_random_prompt(n_real, 256, seed))[0, :, :n_real])
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
        stds.append(logits.std(axis=-1))
    assert np.median(np.concatenate(margins)) > MEDIAN_MARGIN
    assert np.mean(np.concatenate(stds)) > MIN_LOGIT_STD


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v2"])
def test_build_is_byte_identical(name: str, tmp_path: Path) -> None:
    a = tm.build_tiny_model(name, tmp_path / "a")
    b = tm.build_tiny_model(tm.RECIPES[name], tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(files)
    for fname in files:
        assert (a / fname).read_bytes() == (b / fname).read_bytes(), fname


def test_tokenizer_training_is_deterministic() -> None:
    assert _trained_json.__wrapped__(2048) == tm.train_tokenizer(2048).to_str(pretty=True)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! def f(x): return {'a': [1, 2.5, None]}\n\ttabs  and  spaces ",
        "Café crème, naïve Zoë — Καλημέρα! 你好，世界 こんにちは 안녕하세요 🎉🦉 龍 ǅ",
        "",
        " \n\n ",
    ],
)
def test_tokenizer_round_trips_text(text: str, loaded: dict[str, Loaded]) -> None:
    tok = tm.train_tokenizer(2048)
    assert tok.decode(tok.encode(text).ids) == text
    _, wrapper = loaded["tiny-llama"]
    assert wrapper.decode(wrapper.encode(text, add_special_tokens=False)) == text


def test_rare_characters_stay_split_into_byte_tokens() -> None:
    tok = tm.train_tokenizer(2048)
    for ch in "龍🦉":
        assert len(tok.encode(ch).ids) > 1
    # A lone UTF-8 continuation byte is a token of its own and decodes lossily.
    byte_0x80 = tok.token_to_id("Ģ")  # ByteLevel's symbol for 0x80
    assert byte_0x80 is not None
    assert tok.decode([byte_0x80]) == "\ufffd"


def test_special_and_tool_tokens_have_single_ids() -> None:
    tok = tm.train_tokenizer(2048)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    for t in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        assert len(tok.encode(t).ids) == 1


def test_chat_template_renders_chatml_with_generation_prompt(loaded: dict[str, Loaded]) -> None:
    _, tokenizer = loaded["tiny-qwen2"]
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi there\n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\n Be brief. <|im_end|>\n"
        "<|im_start|>user\nHi there\n<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert no_system == "<|im_start|>user\nHi there\n<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(2) == 4
    assert tokenizer.eos_token_ids == {2}


def test_chat_template_renders_tools_calls_and_results(loaded: dict[str, Loaded]) -> None:
    _, tokenizer = loaded["tiny-qwen2"]
    weather = {"name": "get_weather", "parameters": {"type": "object"}}
    tools = [{"type": "function", "function": weather}]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                # OpenAI sends arguments as a JSON string, HF templates as a dict.
                {"function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            ],
        },
        {"role": "tool", "content": "12 °C"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "get_weather"' in text
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
    assert (
        f"<|im_start|>assistant\n{call.format('Zürich')}\n{call.format('Oslo')}<|im_end|>\n"
    ) in text
    assert "<|im_start|>tool\n<tool_response>\n12 °C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, *messages], tools=tools, tokenize=False
    )
    assert with_system.startswith("<|im_start|>system\nS\n\n# Tools\n")
    # mlx-lm infers its JSON tool-call parser from the template.
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"


def test_tokenizer_folder_files(built: dict[str, Path]) -> None:
    folder = built["tiny-gemma3"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == "<|im_end|>"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"


def test_gemma3_has_sliding_and_full_layers(loaded: dict[str, Loaded]) -> None:
    model, _ = loaded["tiny-gemma3"]
    kinds = [type(c) for c in model.make_cache()]
    assert RotatingKVCache in kinds and KVCache in kinds
    window = tm.RECIPES["tiny-gemma3"].config["sliding_window"]
    assert all(c.max_size == window for c in model.make_cache() if isinstance(c, RotatingKVCache))


def test_gpt_oss_has_sinks_and_rotating_layers(loaded: dict[str, Loaded]) -> None:
    model, _ = loaded["tiny-gpt-oss"]
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, KVCache] * 2
    sinks = [np.array(layer.self_attn.sinks) for layer in model.layers]
    assert all(s.shape == (4,) and np.abs(s).sum() > 0 for s in sinks)


def test_deepseek_v2_key_and_value_widths_differ(loaded: dict[str, Loaded]) -> None:
    model, _ = loaded["tiny-deepseek-v2"]
    cache = make_prompt_cache(model)
    mx.eval(model(_random_prompt(2048, 40, seed=0), cache=cache))
    # mlx-lm 0.32's KVCache.state is (keys, values, offset) with unsliced buffers.
    keys, values = cache[0].keys_and_values()
    assert keys.shape == (1, 2, 40, 128)
    assert values.shape == (1, 2, 40, 64)


def test_padded_vocab_rows_give_zero_logits(tmp_path: Path) -> None:
    base = tm.RECIPES["tiny-llama"]
    recipe = replace(base, name="tiny-padded", config={**base.config, "vocab_size": 2304})
    model, tokenizer = mlx_lm.load(str(tm.build_tiny_model(recipe, tmp_path / "padded")))
    logits = model(_random_prompt(2048, 64, seed=0))
    assert logits.shape[-1] == 2304 and len(tokenizer._tokenizer) == 2048
    assert mx.all(logits[..., 2048:] == 0).item()


def test_ensure_tiny_model_builds_once(tmp_path: Path) -> None:
    first = tm.ensure_tiny_model("tiny-qwen2", tmp_path)
    assert first.parent == tmp_path
    assert first.name == f"tiny-qwen2-{tm.recipe_hash('tiny-qwen2')}"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = tm.ensure_tiny_model("tiny-qwen2", tmp_path)
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp folder left


def test_recipe_hash_tracks_the_recipe() -> None:
    base = tm.RECIPES["tiny-llama"]
    assert tm.recipe_hash(base) == tm.recipe_hash("tiny-llama")
    assert tm.recipe_hash(replace(base, seed=99)) != tm.recipe_hash(base)


def test_default_recipe_has_smollm2_135m_geometry() -> None:
    recipe = tm.RECIPES[tm.RANDOM_SMOLLM2]
    config = recipe.config
    assert recipe.architecture == "llama"
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    }
    assert {k: config[k] for k in expected} == expected


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVMEM_TEST_DEFAULT_MODEL") != "1", reason="540 MB build")
def test_default_model_builds_and_is_peaky(tmp_path: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tm.ensure_tiny_model(tm.RANDOM_SMOLLM2, tmp_path)))
    n_real = len(tokenizer._tokenizer)
    logits = model(_random_prompt(n_real, 256, seed=0))
    assert logits.shape == (1, 256, 49152)
    real = np.array(logits[0, :, :n_real])
    top2 = np.sort(real, axis=-1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > MEDIAN_MARGIN
    assert np.all(np.array(logits[0, :, n_real:]) == 0)
