"""Deterministic tiny random-weight models of real mlx-lm architectures.

No model can be downloaded where kvmem is built, so it builds its own: real
mlx-lm architectures (llama, qwen2, gemma3_text, gpt_oss, deepseek_v2) with
random float32 weights and a byte-level BPE tokenizer trained on text shipped
in the package (:mod:`runtime.model.tokenizer_build`). Each model is an ordinary
Hugging Face folder that ``mlx_lm.load(path)`` opens:

    config.json  model.safetensors  tokenizer.json  tokenizer_config.json
    special_tokens_map.json  generation_config.json

Outputs of random weights are not meaningful text; they exercise the
machinery (caches, batching, persistence), and timings depend only on the
geometry. ``smollm2-random`` has SmolLM2-135M's geometry (the real default,
``kvmem-default``, is that model's trained weights); the ``tiny-*`` test
models build in a fraction of a second.

Padded vocabulary: a recipe's ``config["vocab_size"]`` may exceed the
tokenizer (the default model keeps SmolLM2's 49152 while the corpus supports
about 3.6K tokens, like Qwen's padded vocabularies). The embedding and output
rows of the padded ids are zero, so their logits are exactly 0, and kvmem's
sampler masks every id ``>= len(tokenizer)`` before choosing a token.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from runtime.model.tokenizer_build import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    corpus_digest,
    train_tokenizer,
    write_tokenizer_files,
)

__all__ = [
    "RANDOM_SMOLLM2",
    "RECIPES",
    "BuildProgress",
    "TinyModelRecipe",
    "build_tiny_model",
    "ensure_tiny_model",
    "generate_weights",
    "recipe_hash",
    "train_tokenizer",
]

# Bump when the weight or file layout changes, so ensure_tiny_model rebuilds.
_GENERATOR_VERSION = 1

_ARCHITECTURE_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything needed to rebuild one tiny model byte for byte.

    Weights are float32, drawn per parameter (sorted names of the instantiated
    mlx-lm model) from ``numpy.random.default_rng([seed, crc32(name)])``:

    * linear weights ``N(0, gain / sqrt(fan_in))``: gain ``qk_gain`` for query
      and key projections (``q_proj``, ``k_proj``, deepseek's
      ``kv_a_proj_with_mqa`` / ``kv_b_proj``), so attention scores have a std
      of about ``qk_gain**2`` and attention is far from uniform; ``out_gain``
      for ``o_proj`` / ``down_proj``, so each block writes a residual update
      of about unit size; ``router_gain`` for MoE routers, so expert choice
      is decisive and rarely flips under float noise; 1 elsewhere;
    * biases ``N(0, 0.02)``; gpt-oss attention sinks ``N(0, 1)``;
    * RMSNorm weights 1 (gemma stores ``w`` and scales by ``1 + w``, so 0),
      except: gemma's ``q_norm``/``k_norm`` get ``qk_gain``, and a tied
      model's final norm gets the output scale below;
    * embeddings ``N(0, embed_std)`` (gemma multiplies them by
      ``sqrt(hidden)`` on input).

    Peaky logits: random weights at the usual init scale (std 0.02) give logits
    with a std below 0.5, so the greedy token flips under harmless float
    reordering. Here the logits have a std of about ``logit_std``: an untied
    ``lm_head`` is drawn with std ``logit_std / sqrt(hidden)``; a tied model
    gets final-norm weight ``logit_std / (sqrt(hidden) * embed_std)``. The
    input embedding is kept small next to the blocks' residual updates, or a
    tied model would mostly predict its own input token (measured: the top-1
    equals the input token at 0-16% of positions, and replacing the first
    half of a 256-token prompt changes 70-95% of the greedy tokens in the
    second half, so the predictions really depend on the cache). With
    ``logit_std`` 8 the median top-1 minus top-2 margin on random prompts is
    1.4-1.9 (``tests/model/test_tiny_models.py`` requires > 1), while chunked
    versus whole prefill moves logits by about 5e-5; compare greedy tokens
    only where the margin exceeds your tolerance (e.g. 1e-2: ~99% of them).

    Attributes:
        name: Recipe name (a key of :data:`RECIPES`).
        architecture: The mlx-lm ``model_type`` (module in ``mlx_lm.models``).
        config: Hugging Face ``config.json`` fields (``model_type`` included).
        tokenizer_vocab: Target tokenizer size (the corpus may support fewer).
        seed: Base seed of every weight draw.
        embed_std: Std of the token embedding entries.
        logit_std: Target std of the output logits.
        qk_gain: Gain of query/key projections (attention sharpness).
        out_gain: Gain of attention-output and MLP-down projections.
        router_gain: Gain of MoE router weights.
    """

    name: str
    architecture: str
    config: Mapping[str, Any] = field(hash=False)
    tokenizer_vocab: int
    seed: int = 0
    embed_std: float = 0.3
    logit_std: float = 8.0
    qk_gain: float = 1.4
    out_gain: float = 1.0
    router_gain: float = 4.0


_TOKEN_IDS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}


def _test_config(architecture: str, **fields: Any) -> Mapping[str, Any]:
    base: dict[str, Any] = {
        "model_type": architecture,
        "hidden_size": 128,
        "vocab_size": 2048,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    base.update(fields)
    return MappingProxyType(base)


RANDOM_SMOLLM2 = "smollm2-random"
"""SmolLM2-135M's geometry with random weights (540 MB): timings of the real
default (``kvmem-default``, :mod:`runtime.model.default_model`) without its package."""

RECIPES: dict[str, TinyModelRecipe] = {
    r.name: r
    for r in (
        TinyModelRecipe(
            name=RANDOM_SMOLLM2,
            architecture="llama",
            config=MappingProxyType({
                "model_type": "llama",
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
                "hidden_act": "silu",
                "attention_bias": False,
                "mlp_bias": False,
                "torch_dtype": "float32",
            }),
            tokenizer_vocab=8192,
            embed_std=0.3,
            out_gain=0.7,
        ),
        TinyModelRecipe(
            name="tiny-llama",
            architecture="llama",
            config=_test_config(
                "llama",
                intermediate_size=384,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                tie_word_embeddings=True,
                rope_theta=10000.0,
            ),
            tokenizer_vocab=2048,
            seed=1,
        ),
        TinyModelRecipe(
            name="tiny-qwen2",
            architecture="qwen2",
            config=_test_config(
                "qwen2",
                intermediate_size=384,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=1,
                tie_word_embeddings=False,
                rope_theta=1000000.0,
            ),
            tokenizer_vocab=2048,
            seed=2,
            embed_std=1.0,
        ),
        TinyModelRecipe(
            name="tiny-gemma3",
            architecture="gemma3_text",
            config=_test_config(
                "gemma3_text",
                intermediate_size=384,
                num_hidden_layers=4,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=64,
                query_pre_attn_scalar=64,
                sliding_window=32,
                sliding_window_pattern=2,
                rope_theta=1000000.0,
                rope_local_base_freq=10000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
            ),
            tokenizer_vocab=2048,
            seed=3,
            embed_std=0.3 / math.sqrt(128),
        ),
        TinyModelRecipe(
            name="tiny-gpt-oss",
            architecture="gpt_oss",
            config=_test_config(
                "gpt_oss",
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=32,
                layer_types=["sliding_attention", "full_attention"] * 2,
                rope_theta=150000.0,
                rope_scaling=None,
                tie_word_embeddings=False,
            ),
            tokenizer_vocab=2048,
            seed=4,
            embed_std=1.0,
        ),
        TinyModelRecipe(
            name="tiny-deepseek-v2",
            architecture="deepseek_v2",
            config=_test_config(
                "deepseek_v2",
                intermediate_size=256,
                moe_intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=2,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                kv_lora_rank=64,
                q_lora_rank=None,
                qk_nope_head_dim=64,
                qk_rope_head_dim=64,
                v_head_dim=64,
                rope_theta=10000.0,
                rope_scaling={
                    "type": "yarn",
                    "factor": 1.0,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.0,
                },
                topk_method="greedy",
                tie_word_embeddings=False,
            ),
            tokenizer_vocab=2048,
            seed=5,
            embed_std=1.0,
        ),
    )
}


def _recipe(recipe: TinyModelRecipe | str) -> TinyModelRecipe:
    if isinstance(recipe, TinyModelRecipe):
        return recipe
    try:
        return RECIPES[recipe]
    except KeyError:
        raise KeyError(f"unknown tiny model {recipe!r}; known: {sorted(RECIPES)}") from None


def recipe_hash(recipe: TinyModelRecipe | str) -> str:
    """Short digest of a recipe, the generator version and the corpus."""
    r = _recipe(recipe)
    payload = {
        "version": _GENERATOR_VERSION,
        "corpus": corpus_digest(),
        "name": r.name,
        "architecture": r.architecture,
        "config": dict(r.config),
        "tokenizer_vocab": r.tokenizer_vocab,
        "seed": r.seed,
        "gains": [r.embed_std, r.logit_std, r.qk_gain, r.out_gain, r.router_gain],
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _hf_config(r: TinyModelRecipe) -> dict[str, Any]:
    config = {"architectures": [_ARCHITECTURE_CLASS[r.architecture]], **r.config, **_TOKEN_IDS}
    if config["model_type"] != r.architecture:
        raise ValueError(f"{r.name}: config model_type differs from {r.architecture!r}")
    return config


def _parameter_shapes(r: TinyModelRecipe) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters ``mlx_lm.load`` fills (after sanitize)."""
    from mlx.utils import tree_flatten  # runtime/__init__ has loaded OpenBLAS already

    module = importlib.import_module(f"mlx_lm.models.{r.architecture}")
    model = module.Model(module.ModelArgs.from_dict(_hf_config(r)))
    shapes = {name: tuple(a.shape) for name, a in tree_flatten(model.parameters())}
    if r.config.get("tie_word_embeddings") and r.architecture == "gemma3_text":
        # gemma3_text always builds lm_head; its sanitize() ties it when absent.
        del shapes["lm_head.weight"]
    return shapes


def _tied(r: TinyModelRecipe) -> bool:
    return bool(r.config.get("tie_word_embeddings", False))


Weights = npt.NDArray[np.float32]


def _draw(r: TinyModelRecipe, name: str, shape: tuple[int, ...], n_real: int) -> Weights:
    rng = np.random.default_rng([r.seed, zlib.crc32(name.encode())])
    hidden = int(r.config["hidden_size"])
    leaf = name.rsplit(".", 2)
    module, kind = leaf[-2], leaf[-1]
    gemma = r.architecture == "gemma3_text"

    def normal(std: float) -> Weights:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def norm(gain: float) -> Weights:
        return np.full(shape, gain - 1.0 if gemma else gain, dtype=np.float32)

    if kind == "sinks":
        return normal(1.0)
    if kind == "bias":
        return normal(0.02)
    if module.endswith("norm"):
        if name == "model.norm.weight" and _tied(r):
            return norm(r.logit_std / (math.sqrt(hidden) * r.embed_std))
        if module in ("q_norm", "k_norm"):
            return norm(r.qk_gain)
        return norm(1.0)
    if module in ("embed_tokens", "lm_head"):
        std = r.embed_std if module == "embed_tokens" else r.logit_std / math.sqrt(hidden)
        w = normal(std)
        w[n_real:] = 0.0  # padded vocabulary: logits exactly 0, masked by the sampler
        return w
    fan_in = shape[-1]
    if module in ("q_proj", "k_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        gain = r.qk_gain
    elif module in ("o_proj", "down_proj"):
        gain = r.out_gain
    elif module in ("router", "gate"):
        gain = r.router_gain
    else:
        gain = 1.0
    return normal(gain / math.sqrt(fan_in))


BuildProgress = Callable[[int, int], None]
"""``progress(done, total)``: ``done`` of a build's ``total`` steps are done (one per tensor, one to write)."""


def generate_weights(recipe: TinyModelRecipe | str, *, progress: BuildProgress | None = None) -> dict[str, Weights]:
    """The float32 weights of a recipe, keyed as ``mlx_lm.load`` names them.

    ``progress(done, total)`` is called after each tensor (``total``: the tensors, plus one
    for writing them, which :func:`build_tiny_model` reports).
    """
    r = _recipe(recipe)
    n_real = min(
        train_tokenizer(r.tokenizer_vocab).get_vocab_size(), int(r.config["vocab_size"])
    )
    shapes = _parameter_shapes(r)
    weights = {}
    for i, name in enumerate(sorted(shapes), 1):
        weights[name] = _draw(r, name, shapes[name], n_real)
        if progress is not None:
            progress(i, len(shapes) + 1)
    return weights


def build_tiny_model(recipe: TinyModelRecipe | str, dest: Path, *, progress: BuildProgress | None = None) -> Path:
    """Write a recipe's model folder to ``dest`` (created if needed) and return it.

    The folder is byte-identical for the same recipe, corpus and generator.
    ``progress(done, total)`` follows the build (:data:`BuildProgress`).
    """
    from safetensors.numpy import save_file

    r = _recipe(recipe)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(r.tokenizer_vocab)
    if tok.get_vocab_size() > int(r.config["vocab_size"]):
        raise ValueError(f"{r.name}: tokenizer larger than config vocab_size")
    for token, key in (
        (BOS_TOKEN, "bos_token_id"),
        (EOS_TOKEN, "eos_token_id"),
        (PAD_TOKEN, "pad_token_id"),
    ):
        assert tok.token_to_id(token) == _TOKEN_IDS[key]

    weights = generate_weights(r, progress=progress)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "mlx"})
    config = _hf_config(r)
    generation = {
        "bos_token_id": _TOKEN_IDS["bos_token_id"],
        "eos_token_id": _TOKEN_IDS["eos_token_id"],
        "pad_token_id": _TOKEN_IDS["pad_token_id"],
    }
    for fname, obj in (("config.json", config), ("generation_config.json", generation)):
        (dest / fname).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    max_len = int(r.config.get("max_position_embeddings", 4096))
    write_tokenizer_files(tok, dest, model_max_length=max_len)
    if progress is not None:
        progress(len(weights) + 1, len(weights) + 1)
    return dest


def ensure_tiny_model(name: str, models_dir: Path, *, progress: BuildProgress | None = None) -> Path:
    """Return ``models_dir/<name>-<recipe hash>/``, building it on first use.

    The build happens in a temporary folder beside the target and is moved in
    place with one ``os.rename``, so a reader never sees a half-written model
    and concurrent builders are safe (the loser discards its copy).
    ``progress`` follows a build (:data:`BuildProgress`; not called when the model is built already).
    """
    r = _recipe(name)
    models_dir = Path(models_dir)
    final = models_dir / f"{r.name}-{recipe_hash(r)}"
    if final.is_dir():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=models_dir))
    try:
        build_tiny_model(r, tmp, progress=progress)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
