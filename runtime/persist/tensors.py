"""Which tensors a cache's files hold: snapshot layers to named tensors, piece layouts, file metadata.

A blocked (full-attention) layer's arrays are cut on the token axis into
pieces; a sliding layer is stored whole in the state file, with a zero-token
slice of every blocked layer that records its layout. Tensors are named
``L{layer}.{key}`` (:func:`tensor_name`). Also checks a snapshot (or a loaded
layer) against the layouts of :mod:`runtime.snapshot` before anything is
stored or returned. Pure: no file system.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from runtime.persist.codec import FileLayout, encode_file
from runtime.persist.format import FORMAT_VERSION
from runtime.snapshot import CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "tensor_name",
    "layout_problem",
    "validate_snapshot",
    "blocked_sources",
    "piece_layout",
    "state_tensors",
    "block_info",
    "segment_info",
    "state_info",
    "encode_state",
]


def tensor_name(layer: int, key: str) -> str:
    """The name of array ``key`` of layer ``layer`` in a file: ``L{layer}.{key}``."""
    return f"L{layer}.{key}"


_Q4_KEYS = ("k_w", "k_s", "k_b", "v_w", "v_s", "v_b")
_FLOAT_KEYS = ("k", "v")


def layout_problem(kind: LayerKind, arrays: dict[str, np.ndarray]) -> str | None:
    """Why ``arrays`` do not fit a layer of ``kind`` (see :mod:`runtime.snapshot`), or None.

    Checks the key set, dtypes (packed weights ``uint32``, everything else
    floating), at least a head and a token axis, and that all arrays agree on
    both. An empty dict (a layer with nothing cached) is accepted.
    """
    if not arrays:
        return None
    expected = _Q4_KEYS if kind is LayerKind.Q4 else _FLOAT_KEYS
    if set(arrays) != set(expected):
        return (
            f"{kind.value} layer has arrays {sorted(arrays)}, expected {list(expected)}"
        )
    heads_tokens = set()
    for key, array in arrays.items():
        if array.ndim < 2:
            return f"{key} has no token axis (shape {array.shape})"
        heads_tokens.add(array.shape[:2])
        packed = kind is LayerKind.Q4 and key.endswith("_w")
        if packed and array.dtype != np.uint32:
            return f"{key} is {array.dtype}, expected uint32"
        if not packed and not np.issubdtype(array.dtype, np.floating):
            return f"{key} is {array.dtype}, expected a float dtype"
    if len(heads_tokens) != 1:
        return f"arrays disagree on heads and tokens: {sorted(heads_tokens)}"
    if kind is LayerKind.Q4:
        for side in "kv":
            if arrays[f"{side}_s"].shape != arrays[f"{side}_b"].shape:
                return f"{side}_s and {side}_b differ in shape"
    return None


def validate_snapshot(snapshot: CacheSnapshot) -> None:
    """Raise ValueError if ``snapshot`` cannot be stored faithfully."""
    num_tokens = snapshot.num_tokens
    if not isinstance(snapshot.model_tag, str) or not snapshot.model_tag:
        raise ValueError("snapshot has no model_tag")
    if len(snapshot.offsets) != num_tokens:
        raise ValueError(f"{len(snapshot.offsets)} offsets for {num_tokens} tokens")
    offsets = np.asarray(snapshot.offsets, dtype=np.int64).reshape(-1)
    if offsets.size and (
        offsets.min() < 0
        or offsets.max() > len(snapshot.text)
        or np.any(np.diff(offsets) < 0)
    ):
        raise ValueError("offsets must be non-decreasing and within the text")
    for key, value in snapshot.meta.items():
        if (
            not isinstance(key, str)
            or isinstance(value, bool)
            or not isinstance(value, int | str)
        ):
            raise ValueError(f"meta[{key!r}] must map a string to an int or a string")
    for index, layer in enumerate(snapshot.layers):
        problem = layout_problem(layer.kind, layer.arrays)
        if problem is not None:
            raise ValueError(f"layer {index}: {problem}")
        for key, array in layer.arrays.items():
            if layer.is_blocked and array.shape[1] != num_tokens:
                raise ValueError(
                    f"layer {index} {key}: {array.shape[1]} tokens on axis 1, expected {num_tokens}"
                )
            if not layer.is_blocked and array.shape[1] > num_tokens:
                raise ValueError(f"layer {index} {key}: window longer than the cache")


def blocked_sources(layers: Sequence[LayerSnapshot]) -> dict[str, np.ndarray]:
    """Every blocked layer's arrays by tensor name, whole (pieces are cut from them)."""
    return {
        tensor_name(index, key): array
        for index, layer in enumerate(layers)
        if layer.is_blocked
        for key, array in layer.arrays.items()
    }


def piece_layout(
    layouts: Mapping[str, tuple[np.dtype, tuple[int, ...]]], tokens: int
) -> FileLayout:
    """The layout of a piece of ``tokens`` tokens, from each blocked tensor's ``(dtype, shape)``."""
    return FileLayout.of(
        {
            name: (dtype, (shape[0], tokens, *shape[2:]))
            for name, (dtype, shape) in layouts.items()
        }
    )


def state_tensors(layers: Sequence[LayerSnapshot]) -> dict[str, np.ndarray]:
    """The sliding layers whole and a zero-token slice of each blocked layer (its layout)."""
    return {
        tensor_name(index, key): array[:, :0] if layer.is_blocked else array
        for index, layer in enumerate(layers)
        for key, array in layer.arrays.items()
    }


def _info(kind: str, model_tag: str, **fields: str) -> dict[str, str]:
    return {
        "kind": kind,
        "format_version": str(FORMAT_VERSION),
        "model_tag": model_tag,
        **fields,
    }


def block_info(*, model_tag: str, block_hash: str) -> dict[str, str]:
    """The metadata of a block file (fixed width for a model: one header length per layout)."""
    return _info("block", model_tag, block_hash=block_hash)


def segment_info(*, model_tag: str, start: int, end: int) -> dict[str, str]:
    """The metadata of a segment file of tokens ``start:end``."""
    return _info("segment", model_tag, start=str(start), end=str(end))


def state_info(*, model_tag: str) -> dict[str, str]:
    """The metadata of a state file."""
    return _info("state", model_tag)


def encode_state(layers: Sequence[LayerSnapshot], *, model_tag: str) -> bytes:
    """A state file's bytes (see :func:`state_tensors`)."""
    return encode_file(state_tensors(layers), state_info(model_tag=model_tag))
