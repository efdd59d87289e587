"""Test helper: write a GGUF file from a Hugging Face model folder, as llama.cpp's converter does.

Used to check kvmem's GGUF loader against the same weights loaded the ordinary
way (``mlx_lm.load`` on the folder). ``mx.save_gguf`` writes float tensors with
metadata; the quantized types are covered by the shipped SmolLM2 file, and
:func:`write_raw_gguf` writes a header by hand for tensor types MLX cannot read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.gguf import permute_weights

__all__ = ["gguf_tensor_names", "write_gguf", "write_raw_gguf"]

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_names(name: str) -> str:
    """llama.cpp's name for a Hugging Face parameter name."""
    module, part = name.rsplit(".", 1)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{part}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{part}"


def write_gguf(
    folder: Path,
    out: Path,
    *,
    dtype: mx.Dtype = mx.float32,
    metadata_overrides: dict[str, Any] | None = None,
    drop_metadata: tuple[str, ...] = (),
) -> Path:
    """Convert the llama / qwen2 model in ``folder`` to a GGUF at ``out``."""
    config = json.loads((folder / "config.json").read_text())
    arch = config["model_type"]
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, mx.array] = {}
    for name, value in weights.items():
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            value = permute_weights(value, heads, heads)  # llama.cpp's rope layout
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            value = permute_weights(value, heads, kv_heads)
        # llama.cpp keeps norms and biases in float32 whatever the file type.
        keep_f32 = "norm" in name or name.endswith(".bias")
        tensors[gguf_tensor_names(name)] = value.astype(mx.float32 if keep_f32 else dtype)

    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    control = {t["id"] for t in tok["added_tokens"] if t["special"]}
    user_defined = {t["id"] for t in tok["added_tokens"] if not t["special"]}
    types = [3 if i in control else 4 if i in user_defined else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": folder.name,
        f"{arch}.block_count": mx.array(config["num_hidden_layers"], dtype=mx.uint32),
        f"{arch}.context_length": mx.array(config["max_position_embeddings"], dtype=mx.uint32),
        f"{arch}.embedding_length": mx.array(config["hidden_size"], dtype=mx.uint32),
        f"{arch}.feed_forward_length": mx.array(config["intermediate_size"], dtype=mx.uint32),
        f"{arch}.attention.head_count": mx.array(heads, dtype=mx.uint32),
        f"{arch}.attention.head_count_kv": mx.array(kv_heads, dtype=mx.uint32),
        f"{arch}.attention.key_length": mx.array(head_dim, dtype=mx.uint32),
        f"{arch}.attention.value_length": mx.array(head_dim, dtype=mx.uint32),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": mx.array(config["bos_token_id"], dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(config["eos_token_id"], dtype=mx.uint32),
        "tokenizer.ggml.padding_token_id": mx.array(config["pad_token_id"], dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
    }
    if "chat_template" in tok_config:
        meta["tokenizer.chat_template"] = tok_config["chat_template"]
    meta.update(metadata_overrides or {})
    for key in drop_metadata:
        meta.pop(key, None)
    mx.save_gguf(str(out), tensors, meta)
    return out


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_raw_gguf(out: Path, *, tensor_type: int, architecture: str = "llama") -> Path:
    """A minimal GGUF v3 with one 32x32 tensor of ``tensor_type`` (ggml type id) and no data checks.

    Lets tests feed the loader a tensor type MLX cannot read (e.g. 12, Q4_K).
    """
    kv = [("general.architecture", architecture)]
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv))
    for key, value in kv:
        header += _gguf_string(key) + struct.pack("<I", 8) + _gguf_string(value)  # 8: string
    header += _gguf_string("token_embd.weight") + struct.pack("<IQQIQ", 2, 256, 32, tensor_type, 0)
    header += b"\0" * (-len(header) % 32)
    out.write_bytes(header + b"\0" * (256 * 32 * 4))
    return out
