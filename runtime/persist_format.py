"""The on-disk format of a cache directory: manifest schema, block hashes, file encodings.

Pure functions and msgspec types used by :mod:`runtime.persist`; nothing here
touches the file system.

* A **block** file holds, for every blocked layer of a snapshot, its arrays
  sliced on the token axis to one :data:`BLOCK_TOKENS`-token block, as tensors
  ``L{layer}.{key}``. Its safetensors metadata names the block (kind, format
  version, model tag, chain hash) and carries a SHA-256 over its tensors, so a
  block file can be checked on its own without a manifest.
* A **tail** file holds the partial last block of every blocked layer (possibly
  zero tokens long, which still records shapes and dtypes) and the whole arrays
  of every sliding layer. It is named by the SHA-256 of its bytes.
* The **manifest** (:class:`Manifest`) is JSON; token ids and offsets are
  base64 of little-endian int32 arrays (about 5.3 bytes per token each).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np
import safetensors.numpy

from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "FORMAT_VERSION",
    "MAX_TOKEN_ID",
    "BlockRef",
    "TailRef",
    "LayerRecord",
    "Manifest",
    "FormatProbe",
    "BlockListProbe",
    "block_chain_hashes",
    "pack_int32",
    "unpack_int32",
    "tensor_name",
    "tensor_digest",
    "validate_snapshot",
    "layout_problem",
    "block_tensors",
    "tail_tensors",
    "encode_tensors",
    "read_metadata",
    "TAIL_NAME",
    "BLOCK_NAME",
]

FORMAT_VERSION = 1
"""Version of the on-disk format; part of every block hash and manifest."""

MAX_TOKEN_ID = 2**31 - 1

BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
TAIL_NAME = re.compile(r"tail-[0-9a-f]{64}\.safetensors")

_Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
_Size = Annotated[int, msgspec.Meta(ge=0)]


class BlockRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One full block of an agent's cache: ``blocks/<hash[:2]>/<hash>.safetensors``.

    ``sha256`` is over the file's bytes; ``tensor_sha256`` repeats the digest
    in the block's own header, which a save can check without reading the
    whole block.
    """

    hash: _Hex64
    sha256: _Hex64
    size: _Size
    tensor_sha256: _Hex64


class TailRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An agent's tail file, ``agents/<dir>/<name>``."""

    name: Annotated[str, msgspec.Meta(pattern=r"^tail-[0-9a-f]{64}\.safetensors$")]
    sha256: _Hex64
    size: _Size


class LayerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layer's kind and the keys of its arrays, in the snapshot's order."""

    kind: LayerKind
    keys: list[Annotated[str, msgspec.Meta(min_length=1)]]


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``agents/<dir>/manifest.json``: everything needed to rebuild a snapshot.

    Its size grows with the conversation (covered text plus about 10.7 bytes per
    token for ids and offsets) and it is rewritten on every save; at ~4 bytes of
    text per token that is ~15 bytes per token, small next to the KV itself.
    """

    format_version: int
    model_tag: Annotated[str, msgspec.Meta(min_length=1)]
    agent_id: str
    num_tokens: _Size
    text: str
    token_ids: str
    offsets: str
    blocks: list[BlockRef]
    tail: TailRef
    layers: list[LayerRecord]
    meta: dict[str, int | str]
    created_at: float
    updated_at: float


class FormatProbe(msgspec.Struct):
    """Reads only the version of a manifest, whatever else it holds."""

    format_version: int


class _HashOnly(msgspec.Struct):
    hash: str


class BlockListProbe(msgspec.Struct):
    """Reads only the block hashes of a manifest (used by garbage collection)."""

    blocks: list[_HashOnly]


def pack_int32(values: Sequence[int]) -> str:
    """Base64 of ``values`` as little-endian int32 (ValueError if one does not fit)."""
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() > MAX_TOKEN_ID):
        raise ValueError("value outside 0..2**31-1")
    return base64.b64encode(array.astype("<i4").tobytes()).decode("ascii")


def unpack_int32(packed: str) -> np.ndarray:
    """Inverse of :func:`pack_int32` (ValueError on bad base64 or length)."""
    raw = base64.b64decode(packed.encode("ascii"), validate=True)
    if len(raw) % 4:
        raise ValueError("int32 array byte length is not a multiple of 4")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def block_chain_hashes(
    model_tag: str, token_ids: Sequence[int] | np.ndarray
) -> list[str]:
    """SHA-256 hex of each full block: over (format version, model tag, previous hash, ids)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        raise ValueError("token id outside 0..2**31-1")
    ids32 = ids.astype("<i4")
    tag = model_tag.encode("utf-8")
    hashes: list[str] = []
    previous = b""
    for start in range(0, (len(ids32) // BLOCK_TOKENS) * BLOCK_TOKENS, BLOCK_TOKENS):
        h = hashlib.sha256(b"kvmem-block\0")
        h.update(FORMAT_VERSION.to_bytes(4, "little"))
        h.update(len(tag).to_bytes(8, "little") + tag)
        h.update(len(previous).to_bytes(1, "little") + previous)
        h.update(ids32[start : start + BLOCK_TOKENS].tobytes())
        digest = h.hexdigest()
        hashes.append(digest)
        previous = digest.encode("ascii")
    return hashes


def tensor_name(layer: int, key: str) -> str:
    return f"L{layer}.{key}"


def tensor_digest(tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of ``tensors`` (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        h.update(
            f"{name}\0{array.dtype.newbyteorder('<').str}\0{array.shape}\0".encode()
        )
        h.update(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


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


def block_tensors(
    layers: Sequence[LayerSnapshot], start: int, stop: int
) -> dict[str, np.ndarray]:
    """Tensors of the blocked layers restricted to tokens ``start:stop``."""
    return {
        tensor_name(index, key): np.ascontiguousarray(array[:, start:stop])
        for index, layer in enumerate(layers)
        if layer.is_blocked
        for key, array in layer.arrays.items()
    }


def tail_tensors(layers: Sequence[LayerSnapshot], start: int) -> dict[str, np.ndarray]:
    """Tokens ``start:`` of the blocked layers and the whole sliding layers."""
    return {
        tensor_name(index, key): np.ascontiguousarray(
            array[:, start:] if layer.is_blocked else array
        )
        for index, layer in enumerate(layers)
        for key, array in layer.arrays.items()
    }


def encode_tensors(tensors: dict[str, np.ndarray], info: dict[str, str]) -> bytes:
    """Deterministic safetensors bytes of ``tensors`` with ``info`` as metadata.

    ``info`` travels as one canonical JSON string under the ``kvmem`` metadata
    key: safetensors writes a metadata map in hash order, so several keys would
    make identical content serialize differently. Arrays must be C-contiguous
    (the library trusts their data pointers).
    """
    for name, array in tensors.items():
        if not array.flags.c_contiguous:
            raise ValueError(f"tensor {name} is not C-contiguous")
    metadata = {"kvmem": json.dumps(info, sort_keys=True, separators=(",", ":"))}
    return safetensors.numpy.save(tensors, metadata=metadata)


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``info`` that :func:`encode_tensors` stored (ValueError if malformed)."""
    if len(data) < 8:
        raise ValueError("file shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError("safetensors header runs past the end of the file")
    header = json.loads(data[8 : 8 + header_len])
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("safetensors header has no metadata")
    info = json.loads(header["__metadata__"].get("kvmem", "null"))
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise ValueError("kvmem metadata is not a string map")
    return info
