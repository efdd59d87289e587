"""Loading llama-family GGUF files (llama.cpp's format) as mlx-lm models.

A GGUF holds everything a model needs: the weights (often quantized), the
hyper-parameters and the tokenizer (tokens, merges, token types, special ids,
chat template) as metadata. kvmem reads it with ``mx.load`` and builds:

* the **config** mlx-lm's ``llama`` / ``qwen2`` models take. llama.cpp's
  converter permutes a llama model's Q and K rows for its rope; mlx-lm's llama
  with ``rope_traditional=True`` computes exactly that layout, so nothing is
  un-permuted. qwen2 files are not permuted (llama.cpp runs them with NEOX rope).
* the **tokenizer**, with transformers' own GGUF tokenizer builder (the one
  ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` uses), control tokens
  registered as special so ``<|im_start|>`` stays one token, and the split
  regex of the file's pre-tokenizer (``tokenizer.ggml.pre``).
* the **weights**: MLX reads Q4_0, Q4_1 and Q8_0 as its own affine quantized
  triples (group 32) and F16 / F32 as they are. They are dequantized to
  float32 where float32 is the fast path (MLX's CPU backend: one decode step of
  SmolLM2-135M takes 41 ms in float32 against ~120 ms quantized) and kept
  quantized on GPU backends; :data:`WEIGHT_MODES` overrides that.

The config and tokenizer files are written once into a small folder under the
models directory (``gguf/<stem>-<sha256 prefix>/``); the weights are read from
the GGUF itself on every load, so a large file is never copied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import mlx.nn as nn

from runtime.backend import device_profile
from runtime.errors import ModelError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "WEIGHT_MODES",
    "GGUFModel",
    "is_gguf",
    "prepare_gguf",
    "resolve_weight_mode",
]

log = logging.getLogger("kvmem.gguf")

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
"""``general.architecture`` values kvmem can build (mlx-lm module of the same name)."""

WEIGHT_MODES = ("auto", "float32", "float16", "bfloat16", "quantized")
"""How GGUF weights are held: ``auto`` is float32 on CPU and as-stored elsewhere;
``quantized`` keeps Q4/Q8 tensors packed (the file's own precision)."""

_READABLE_TYPES = "F32, F16, BF16, Q4_0, Q4_1, Q8_0; Q2_K, Q4_K, Q6_K as float16"
_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
_MLX_READS = {0, 1, 2, 3, 8, 10, 12, 14, 30}
_GROUP_SIZE = 32  # every GGUF block type MLX reads quantizes in blocks of 32
_FOLDER_VERSION = 2  # bump when the files written next to a GGUF change

# llama.cpp tensor names -> mlx-lm (Hugging Face) parameter names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PARTS = ("weight", "scales", "biases", "bias")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(" + "|".join(_PARTS) + r")")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(" + "|".join(_PARTS) + r")")

# Pre-tokenizers llama.cpp knows that transformers' GGUF builder does not map:
# SmolLM splits every digit on its own, then GPT-2's regex (llama-vocab.cpp).
_EXTRA_PRE_TOKENIZERS = ("smollm",)
# Files that name no special split use GPT-2's byte-level regex, as llama.cpp does.
_GPT2_PRE_TOKENIZERS = (None, "default", "gpt-2", "gpt2")


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, not its name)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_weight_mode(mode: str) -> str:
    """``auto`` becomes the backend profile's choice: ``float32`` under the CPU policy, ``quantized`` (as stored)
    under the GPU one (:mod:`runtime.backend`; the engine passes its profile's, already resolved)."""
    if mode not in WEIGHT_MODES:
        raise ModelError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return device_profile().weights


PACKED_FLOATS = ("auto", "float32", "float16")
"""The dtypes a packed GGUF's float tensors may take (``auto``: the backend profile's)."""


def resolve_packed_floats(floats: str) -> str:
    """``auto`` becomes the backend profile's choice: ``float32`` under the CPU policy, ``float16`` under the GPU one."""
    if floats not in PACKED_FLOATS:
        raise ModelError(f"packed_floats must be one of {', '.join(PACKED_FLOATS)}, got {floats!r}")
    return device_profile().packed_floats if floats == "auto" else floats


class GGUFModel:
    """A GGUF file read into mlx-lm terms: config, tokenizer folder and weights.

    Attributes:
        path: the GGUF file.
        folder: config.json + tokenizer files built from the metadata.
        config: the mlx-lm config (``model_type``, sizes, ``eos_token_id``, ...).
        weights: parameters under mlx-lm's names, in the requested mode.
        quantized: parameter path -> {"group_size", "bits"} for packed layers.
        mode: how the weights are held (a :data:`WEIGHT_MODES` value other than ``auto``).
    """

    def __init__(
        self,
        path: Path,
        folder: Path,
        config: dict[str, Any],
        weights: dict[str, mx.array],
        quantized: dict[str, dict[str, int]],
        *,
        mode: str = "quantized",
    ) -> None:
        self.path = path
        self.folder = folder
        self.config = config
        self.weights = weights
        self.quantized = quantized
        self.mode = mode

    def build_model(self) -> nn.Module:
        """Instantiate the mlx-lm model and load the weights strictly."""
        from mlx_lm.utils import load_model as mlx_load_model

        # No safetensors in the folder: mlx-lm builds the module from the config alone
        # (this file's config, not the folder's copy, which an older kvmem may have written).
        model, _ = mlx_load_model(self.folder, lazy=True, strict=False, model_config=self.config)
        if self.quantized:
            nn.quantize(
                model,
                class_predicate=lambda name, module: self.quantized.get(name, False),
            )
        try:
            model.load_weights(list(self.weights.items()), strict=True)
        except ValueError as exc:
            raise ModelError(f"{self.path}: weights do not fit the {self.config['model_type']} model: {exc}") from exc
        mx.eval(model.parameters())
        model.eval()
        return model


def prepare_gguf(
    path: str | Path, *, models_dir: Path, weights: str = "auto", packed_floats: str = "auto",
    fit_mb: float | None = None,
) -> GGUFModel:
    """Read a GGUF file and write (once) the folder mlx-lm's tokenizer loader needs.

    ``packed_floats``: with ``quantized`` weights, the dtype of the file's float tensors
    (``float32`` as llama.cpp stores its norms, or ``float16``, the blocks' scale dtype);
    activations and KV follow it. ``auto``: the backend profile's choice
    (:attr:`runtime.backend.BackendProfile.packed_floats`).
    ``fit_mb``: where ``weights`` unpacks them (``float32``, ...) and the unpacked weights would take
    more than this, the file's packed weights are kept instead (``quantized``), with one warning:
    a model too large for this machine in float32 still loads (:attr:`GGUFModel.mode` says which).

    Raises:
        ModelError: the file cannot be read, or its architecture, a tensor type
            or tensor name is not supported; the message names what is missing.
    """
    path = Path(path).resolve()
    mode = resolve_weight_mode(weights)
    floats = resolve_packed_floats(packed_floats) if mode == "quantized" else mode
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises ValueError/RuntimeError with its own text
        raise ModelError(f"could not read GGUF {path}: {_unreadable(path) or exc}") from exc
    assert isinstance(tensors, dict)
    architecture = str(meta.get("general.architecture", ""))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    named, quantized = _rename_tensors(tensors, path)
    if fit_mb is not None and mode != "quantized" and quantized:
        unpacked_mb = _unpacked_bytes(named, quantized, mode) / 2**20
        if unpacked_mb > fit_mb:
            log.warning("%s: weights kept packed as stored: %s would take %.0f MiB, over the %.0f MiB this machine "
                        "leaves for weights (MLX multiplies packed weights on CPU about 3x slower)",
                        path.name, mode, unpacked_mb, fit_mb)
            mode = "quantized"
            floats = resolve_packed_floats(packed_floats)
    digest = _file_digest(path, memo=models_dir / "gguf" / "digests.json")
    config = _config(meta, named, architecture, digest=digest, mode=mode, floats=floats)
    named, quantized = _apply_weight_mode(named, quantized, mode, floats)
    folder = _ensure_folder(path, meta, config, digest=digest, models_dir=models_dir)
    return GGUFModel(path, folder, config, named, quantized, mode=mode)


def _rename_tensors(
    tensors: dict[str, mx.array], path: Path
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    """mlx-lm names for every tensor, and the group size / bits of packed ones."""
    named: dict[str, mx.array] = {}
    unknown: list[str] = []
    for name, value in tensors.items():
        target = _target_name(name)
        if target is None:
            unknown.append(name)
        else:
            named[target] = value
    if unknown:
        hint = " (llama 3 rope frequency scaling is not supported yet)" if "rope_freqs.weight" in unknown else ""
        raise ModelError(f"{path}: tensors kvmem cannot place: {', '.join(sorted(unknown)[:8])}{hint}")
    quantized: dict[str, dict[str, int]] = {}
    for name in named:
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed, scales = named[f"{module}.weight"], named[name]
        in_features = scales.shape[-1] * _GROUP_SIZE
        bits = packed.shape[-1] * 32 // in_features
        quantized[module] = {"group_size": _GROUP_SIZE, "bits": bits}
    return named, quantized


def _target_name(name: str) -> str | None:
    if match := _LAYER_TENSOR.fullmatch(name):
        layer, tensor, part = match.groups()
        if tensor in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[tensor]}.{part}"
        return None
    if match := _GLOBAL_TENSOR.fullmatch(name):
        tensor, part = match.groups()
        if tensor in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[tensor]}.{part}"
    return None


def _unpacked_bytes(named: dict[str, mx.array], quantized: dict[str, dict[str, int]], mode: str) -> int:
    """The bytes the weights take once ``mode`` unpacks them: every packed matrix at its full size."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[mode]
    elements = 0
    for name, value in named.items():
        module, part = name.rsplit(".", 1)
        if module in quantized and part in ("scales", "biases"):
            continue
        if module in quantized and part == "weight":
            elements += value.size * 32 // quantized[module]["bits"]  # uint32 words of bits-wide values
        else:
            elements += value.size
    return elements * itemsize


def _apply_weight_mode(
    named: dict[str, mx.array], quantized: dict[str, dict[str, int]], mode: str, floats: str
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]]]:
    if mode == "quantized":
        if floats == "float32":
            return named, quantized  # as stored: float32 norms, float16 scales
        half = getattr(mx, floats)
        return {name: value.astype(half) if mx.issubdtype(value.dtype, mx.floating) else value
                for name, value in named.items()}, quantized
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[mode]
    out: dict[str, mx.array] = {}
    for module, params in quantized.items():
        # Scales and biases in float32 first: MLX dequantizes in the scales' dtype,
        # and llama.cpp's own dequantization computes d * q + m in float32.
        out[f"{module}.weight"] = mx.dequantize(
            named[f"{module}.weight"],
            named[f"{module}.scales"].astype(mx.float32),
            named[f"{module}.biases"].astype(mx.float32),
            group_size=params["group_size"],
            bits=params["bits"],
        ).astype(dtype)
    for name, value in named.items():
        module, part = name.rsplit(".", 1)
        if module in quantized and part in ("weight", "scales", "biases"):
            continue  # dequantized above; a quantized layer's own ``bias`` stays
        out[name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    mx.eval(out)
    return out, {}


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _config(
    meta: dict[str, Any], named: dict[str, mx.array], architecture: str, *, digest: str, mode: str, floats: str
) -> dict[str, Any]:
    def hp(key: str, default: Any = None) -> Any:
        value = _scalar(meta, f"{architecture}.{key}", default)
        if value is None:
            raise ModelError(f"GGUF metadata lacks {architecture}.{key}")
        return value

    hidden = int(hp("embedding_length"))
    heads = int(hp("attention.head_count"))
    vocab = int(named["model.embed_tokens.weight"].shape[0])
    config: dict[str, Any] = {
        "model_type": architecture,
        "architectures": ["LlamaForCausalLM" if architecture == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(hp("block_count")),
        "intermediate_size": int(hp("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(hp("attention.head_count_kv", heads)),
        "rms_norm_eps": float(hp("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(hp("rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in named,
        # llama.cpp permutes llama's Q/K rows for its interleaved rope; qwen2 uses NEOX rope.
        "rope_traditional": architecture == "llama",
        "eos_token_id": _eos_ids(meta),
        "kvmem_source": {"gguf_sha256": digest, "weights": mode},
    }
    if mode == "quantized" and floats != "float32":  # half floats: another model tag (its KV differs)
        config["kvmem_source"]["floats"] = floats
    context = _scalar(meta, f"{architecture}.context_length")
    if context is not None:  # absent: kvmem says at load that it cannot read the model's context
        config["max_position_embeddings"] = int(context)
    if mode != "quantized":
        config["torch_dtype"] = mode
    head_dim = _scalar(meta, f"{architecture}.attention.key_length")
    if head_dim is not None and int(head_dim) != hidden // heads:
        config["head_dim"] = int(head_dim)
    if architecture == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in named
        config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in named
    scaling = _scalar(meta, f"{architecture}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelError(f"GGUF rope scaling {scaling!r} is not supported (supported: linear)")
        config["rope_scaling"] = {"type": "linear", "factor": float(hp("rope.scaling.factor"))}
    return config


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _scalar(meta, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _file_digest(path: Path, *, memo: Path) -> str:
    """SHA-256 of the file, remembered in ``memo`` per (path, size, mtime) so large files hash once."""
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return str(known[key])
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            sha.update(chunk)
    digest = sha.hexdigest()
    known = {k: v for k, v in (known.items() if isinstance(known, dict) else []) if k != key}
    known[key] = digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(list(known.items())[-64:])))
        os.replace(tmp, memo)
    except OSError:  # a memo we cannot write only costs a re-hash next time
        pass
    return digest


def _ensure_folder(
    path: Path, meta: dict[str, Any], config: dict[str, Any], *, digest: str, models_dir: Path
) -> Path:
    """config.json + tokenizer files for this GGUF, written once (atomically) under models_dir."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)[:64]
    folder = models_dir / "gguf" / f"{stem}-{digest[:16]}-v{_FOLDER_VERSION}"
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            _write_tokenizer(meta, staging, architecture=config["model_type"], gguf=path)
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            try:
                staging.rename(folder)
            except OSError:  # another process finished first: keep theirs
                if not (folder / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_tokenizer(meta: dict[str, Any], folder: Path, *, architecture: str, gguf: Path) -> None:
    """tokenizer.json + tokenizer_config.json from the file's tokenizer metadata."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
        convert_gguf_tokenizer,
    )

    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelError(f"{gguf}: GGUF has no tokenizer (tokenizer.ggml.tokens)")
    kind = _scalar(meta, "tokenizer.ggml.model")
    pre = _scalar(meta, "tokenizer.ggml.pre")
    if kind == "gpt2" and pre not in GGUF_PRE_TOKENIZER_SPLITS and pre not in _EXTRA_PRE_TOKENIZERS + _GPT2_PRE_TOKENIZERS:
        raise ModelError(
            f"{gguf}: pre-tokenizer {pre!r} is not known to kvmem; token ids would not match llama.cpp's"
        )
    tokenizer_dict: dict[str, Any] = {"tokenizer_type": kind, "pre_tokenizer_type": pre, "tokens": tokens}
    for key, name in (("merges", "merges"), ("scores", "scores"), ("token_type", "token_type")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            tokenizer_dict[name] = value.tolist() if isinstance(value, mx.array) else list(value)
    try:
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{gguf}: cannot build its tokenizer: {exc}") from exc
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    backend.save(str(folder / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = _scalar(meta, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    add_bos = _scalar(meta, "tokenizer.ggml.add_bos_token", kind == "llama")
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, f"{architecture}.context_length", 4096)),
    }
    template = _scalar(meta, "tokenizer.chat_template")
    if isinstance(template, str) and template:
        tokenizer_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _unreadable(path: Path) -> str | None:
    """Which tensor types in the file MLX cannot read, from the GGUF header (None if it cannot tell)."""
    try:
        with open(path, "rb") as fh:
            types = _header_tensor_types(fh)
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError):
        return None
    bad = sorted({(_GGML_TYPES.get(t, f"type {t}"), name) for name, t in types if t not in _MLX_READS})
    if not bad:
        return None
    kinds = sorted({kind for kind, _ in bad})
    return (
        f"tensor type {', '.join(kinds)} (e.g. {bad[0][1]}) cannot be read by MLX; "
        f"readable: {_READABLE_TYPES}"
    )


def _header_tensor_types(fh: BinaryIO) -> list[tuple[str, int]]:
    """(name, ggml type) of every tensor, skipping the metadata (GGUF v2/v3 layout)."""

    def unpack(fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = fh.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack(fmt, data)[0]

    def string() -> str:
        return fh.read(unpack("<Q")).decode()

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def skip(kind: int) -> None:
        if kind == 8:
            string()
        elif kind == 9:
            inner, count = unpack("<I"), unpack("<Q")
            for _ in range(count):
                skip(inner)
        else:
            fh.read(struct.calcsize(scalar[kind]))

    if fh.read(4) != b"GGUF" or unpack("<I") not in (2, 3):
        raise ValueError("not a GGUF v2/v3 file")
    n_tensors, n_kv = unpack("<Q"), unpack("<Q")
    for _ in range(n_kv):
        string()
        skip(unpack("<I"))
    types: list[tuple[str, int]] = []
    for _ in range(n_tensors):
        name = string()
        fh.read(8 * unpack("<I"))  # dims
        types.append((name, unpack("<I")))
        unpack("<Q")  # offset
    return types
