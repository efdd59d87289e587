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
import numpy as np
from mlx_lm.gguf import permute_weights

__all__ = ["gguf_tensor_names", "write_gguf", "write_quantized_gguf", "write_raw_gguf"]

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


# --- a GGUF written byte by byte, with llama.cpp's own block quantization ---------------------

_GGML = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def _quantize_blocks(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    """llama.cpp's reference quantization of rows of ``x`` (float32) into 32-value blocks.

    Returns the block bytes and what llama.cpp's dequantization gives back.
    """
    blocks = x.reshape(-1, 32).astype(np.float32)
    if kind == "Q8_0":
        d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
        inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(d, dtype=np.float32), where=d != 0)
        q = np.round(blocks * inv[:, None]).astype(np.int8)
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
        return raw.tobytes(), (q.astype(np.float32) * d.astype(np.float32)[:, None]).reshape(x.shape)
    if kind == "Q4_0":
        signed_max = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
        d = (signed_max / -8).astype(np.float16)
        inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(d, dtype=np.float32), where=d != 0)
        q = np.minimum(15, (blocks * inv[:, None] + 8.5).astype(np.int32)).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), packed], axis=1)
        return raw.tobytes(), ((q.astype(np.float32) - 8) * d.astype(np.float32)[:, None]).reshape(x.shape)
    if kind == "Q4_1":
        lo, hi = blocks.min(axis=1), blocks.max(axis=1)
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(d, dtype=np.float32), where=d != 0)
        q = np.minimum(15, ((blocks - m.astype(np.float32)[:, None]) * inv[:, None] + 0.5).astype(np.int32))
        q = q.astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), packed], axis=1)
        deq = q.astype(np.float32) * d.astype(np.float32)[:, None] + m.astype(np.float32)[:, None]
        return raw.tobytes(), deq.reshape(x.shape)
    raise ValueError(kind)


def _gguf_value(value: Any) -> bytes:
    """Type tag + payload of one metadata value (strings, numbers, bools, arrays)."""
    if isinstance(value, str):
        return struct.pack("<I", 8) + _gguf_string(value)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_gguf_string(v) for v in value)
        return struct.pack("<IIQ", 9, 5, len(value)) + np.asarray(value, dtype="<i4").tobytes()
    array = np.asarray(value)
    if array.dtype == np.bool_:
        return struct.pack("<I?", 7, bool(array))
    if np.issubdtype(array.dtype, np.floating):
        return struct.pack("<If", 6, float(array))
    return struct.pack("<II", 4, int(array))


def write_quantized_gguf(template: Path, out: Path, kind: str) -> dict[str, np.ndarray]:
    """Re-write the float GGUF ``template`` with every 2-D weight in ``kind`` (Q4_0, Q4_1, Q8_0).

    Returns the weights llama.cpp's dequantization gives back, under the GGUF's
    names: the reference a reader of ``out`` must reproduce.
    """
    tensors, meta = mx.load(str(template), return_metadata=True)
    values = {k: (v.tolist() if isinstance(v, mx.array) and v.ndim == 1 else v) for k, v in meta.items()}
    values = {k: (np.array(v) if isinstance(v, mx.array) else v) for k, v in values.items()}
    infos, data, reference = b"", b"", {}
    for name in sorted(tensors):
        x = np.array(tensors[name].astype(mx.float32))
        quantize = x.ndim == 2 and x.shape[1] % 32 == 0
        raw, back = _quantize_blocks(x, kind) if quantize else (x.astype("<f4").tobytes(), x)
        reference[name] = back
        data += b"\0" * (-len(data) % 32)
        dims = list(reversed(x.shape))  # ggml lists the fastest-varying dimension first
        infos += _gguf_string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        infos += struct.pack("<IQ", _GGML[kind] if quantize else 0, len(data))
        data += raw
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(values))
    header += b"".join(_gguf_string(k) + _gguf_value(v) for k, v in values.items())
    header += infos
    header += b"\0" * (-len(header) % 32)
    out.write_bytes(header + data)
    return reference
