"""Synthetic cache snapshots with the default model's KV geometry (no model needed).

kvmem-default (SmolLM2-135M geometry): 30 full-attention layers, 3 KV heads,
head_dim 64. Timings of save / load depend on the bytes, not on the values.
"""

from __future__ import annotations

import numpy as np

from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def bytes_per_token(mode: str, *, group: int = 64, layers: int = LAYERS, heads: int = KV_HEADS,
                    head_dim: int = HEAD_DIM) -> int:
    """KV bytes per token over all layers: ``q4`` / ``q8`` (packed + fp16 scales and biases) or float."""
    if mode in ("q4", "q8"):
        bits = 4 if mode == "q4" else 8
        per_head = 2 * (head_dim * bits // 8 + (head_dim // group) * 2 * 2)
    else:
        per_head = 2 * head_dim * (2 if mode == "float16" else 4)
    return layers * heads * per_head


def snapshot(tokens: int, *, mode: str = "q4", salt: int = 0, tag: str = "bench@synthetic/q4g64",
             group: int = 64) -> CacheSnapshot:
    """A ``tokens``-token snapshot of random KV (``salt`` makes block hashes distinct)."""
    rng = np.random.default_rng(salt)
    ids = [int(x) for x in rng.integers(1, 49000, size=tokens)]
    layers = []
    for _ in range(LAYERS):
        if mode in ("q4", "q8"):
            bits = 4 if mode == "q4" else 8
            arrays = {}
            for kv in ("k", "v"):
                arrays[f"{kv}_w"] = rng.integers(0, 2**32, size=(KV_HEADS, tokens, HEAD_DIM * bits // 32),
                                                 dtype=np.uint32)
                arrays[f"{kv}_s"] = rng.standard_normal((KV_HEADS, tokens, HEAD_DIM // group)).astype(np.float16)
                arrays[f"{kv}_b"] = rng.standard_normal((KV_HEADS, tokens, HEAD_DIM // group)).astype(np.float16)
            layers.append(LayerSnapshot(kind=LayerKind.Q4, arrays=arrays))
        else:
            dtype = np.float16 if mode == "float16" else np.float32
            arrays = {kv: rng.standard_normal((KV_HEADS, tokens, HEAD_DIM)).astype(dtype) for kv in ("k", "v")}
            layers.append(LayerSnapshot(kind=LayerKind.FLOAT, arrays=arrays))
    text_pieces = [f" w{t % 997}" for t in ids]
    offsets = np.cumsum([len(p) for p in text_pieces]).tolist()
    return CacheSnapshot(model_tag=tag, text="".join(text_pieces), token_ids=ids,
                         offsets=[int(o) for o in offsets], layers=layers, meta={})
