"""Synthetic cache snapshots for the persistence tests (tests/persist/, tests/runtime_core/test_distributed.py):
every layer kind kvmem saves, with token ids and contents a seed decides, and a bit-exact comparison."""

from __future__ import annotations

import numpy as np

from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot

TAG = "tiny-llama@0123abcd/q4g64"
HEADS = 2
WINDOW = 32


# -- synthetic snapshots -------------------------------------------------------


def make_ids(num_tokens: int, *, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729 + 17) % 50000 for i in range(num_tokens)]


def _mix(ids: np.ndarray, layer: int, salt: int) -> np.ndarray:
    """Per-token uint64 values that depend on (token id, position, layer, salt) only."""
    positions = np.arange(len(ids), dtype=np.uint64)
    x = ids.astype(np.uint64) * np.uint64(2654435761) + positions * np.uint64(40503)
    return x + np.uint64(layer * 1000003 + salt * 7777777)


def _q4_layer(ids: np.ndarray, layer: int, salt: int) -> LayerSnapshot:
    base = _mix(ids, layer, salt)  # (T,)
    heads = np.arange(HEADS, dtype=np.uint64)[:, None, None] * np.uint64(131)

    def packed(width: int) -> np.ndarray:
        cols = np.arange(width, dtype=np.uint64)[None, None, :] * np.uint64(977)
        mixed: np.ndarray = (base[None, :, None] + heads + cols) & np.uint64(0xFFFFFFFF)
        return mixed.astype(np.uint32)

    def scale(shift: int) -> np.ndarray:
        values = ((base + np.uint64(shift)) % np.uint64(1000)).astype(
            np.float32
        ) / 997.0
        return np.broadcast_to(values[None, :, None], (HEADS, len(ids), 1)).astype(
            np.float16
        )

    arrays = {
        "k_w": packed(8),
        "k_s": scale(1),
        "k_b": scale(2),
        "v_w": packed(4),
        "v_s": scale(3),
        "v_b": scale(4),
    }
    return LayerSnapshot(kind=LayerKind.Q4, arrays=arrays)


def float_layer(
    ids: np.ndarray,
    layer: int,
    salt: int,
    kind: LayerKind,
    dim: int,
    sliding_dtype: type[np.floating] = np.float32,
) -> LayerSnapshot:
    base = (_mix(ids, layer, salt) % np.uint64(65521)).astype(np.float32)
    grid = base[None, :, None] + np.arange(HEADS * dim, dtype=np.float32).reshape(
        HEADS, 1, dim
    )
    k = np.sin(grid)
    v = np.cos(grid)
    if kind is LayerKind.SLIDING:
        window = min(len(ids), WINDOW)
        k, v = k[:, len(ids) - window :], v[:, len(ids) - window :]
        dtype: type[np.floating] = sliding_dtype
    else:
        dtype = np.float16
    return LayerSnapshot(kind=kind, arrays={"k": k.astype(dtype), "v": v.astype(dtype)})


def make_snapshot(
    num_tokens: int,
    *,
    ids: list[int] | None = None,
    salt: int = 0,
    model_tag: str = TAG,
    meta: dict[str, int | str] | None = None,
    sliding: str = "wide",
) -> CacheSnapshot:
    """3 Q4 layers, a float full-attention layer and a sliding layer (window 32).

    ``sliding``: ``"wide"`` (float32, head dim 64: 1 KiB per token, more than
    the four blocked layers together, 464 B), ``"like-float"`` (shaped like
    the float full-attention layer: float16, head dim 16, 128 B per token) or
    ``"none"``.
    """
    token_ids = make_ids(num_tokens) if ids is None else ids[:num_tokens]
    assert len(token_ids) == num_tokens
    pieces = [f" w{t % 997}" if t % 5 else f"\nété{t % 13}" for t in token_ids]
    offsets = np.cumsum([len(p) for p in pieces]).tolist() if pieces else []
    array_ids = np.asarray(token_ids, dtype=np.int64)
    layers = [_q4_layer(array_ids, layer, salt) for layer in range(3)]
    layers.append(float_layer(array_ids, 3, salt, LayerKind.FLOAT, 16))
    if sliding == "wide":
        layers.append(float_layer(array_ids, 4, salt, LayerKind.SLIDING, 64))
    elif sliding == "like-float":
        layers.append(
            float_layer(array_ids, 4, salt, LayerKind.SLIDING, 16, np.float16)
        )
    else:
        assert sliding == "none", sliding
    return CacheSnapshot(
        model_tag=model_tag,
        text="".join(pieces),
        token_ids=list(token_ids),
        offsets=[int(o) for o in offsets],
        layers=layers,
        meta={"window_offset": num_tokens, "note": "synthetic"}
        if meta is None
        else meta,
    )


def assert_same(a: CacheSnapshot, b: CacheSnapshot) -> None:
    """Bit-for-bit equality of two snapshots."""
    assert a.model_tag == b.model_tag
    assert a.text == b.text
    assert a.token_ids == b.token_ids
    assert a.offsets == b.offsets
    assert a.meta == b.meta
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.kind is lb.kind
        assert list(la.arrays) == list(lb.arrays)
        for key, x in la.arrays.items():
            y = lb.arrays[key]
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert x.tobytes() == y.tobytes(), key
