"""The on-disk format of a cache directory: manifest schema, file names, block hash chain, the tensors each file holds.

Pure: nothing here touches the file system. How a file's tensors become bytes
is :mod:`runtime.persist.codec`.

* A **block** file (:class:`BlockPiece`) holds, for every blocked layer of a
  snapshot, its arrays sliced on the token axis to one aligned
  :data:`BLOCK_TOKENS`-token block, as tensors ``L{layer}.{key}``. It is named
  by a hash chain (:func:`block_chain_hashes`), and its safetensors metadata
  names the block (kind, format version, model tag, chain hash) and carries
  the checksum of its data, so a block file can be checked without a manifest.
* A **segment** file (:class:`SegmentPiece`) holds the same tensors for any
  other token range ``start:end``; its metadata records the range. It is named
  by its checksum (``seg-<sha256>.safetensors``).
* The **state** file (:class:`StateRef`, ``state-<sha256>.safetensors``) holds
  every sliding layer whole and a zero-token slice of every blocked layer, so
  the layout (dtype, heads, inner dims) of every layer is known even when no
  piece exists.
* Every file is canonical safetensors written by :mod:`runtime.persist.codec`.
  Its **checksum** (``sha256`` in the manifest, and in an agent file's name) is
  the SHA-256 of its header, which covers the data through the data checksum
  (XXH3-64) it records: a file is checked with one SHA-256 over a few KiB and
  one XXH3 pass over its data.
* The **manifest** (:class:`Manifest`) is JSON. Its packed fields, text, token
  ids and offsets, are each zlib-compressed (level 1) then base64-encoded: the
  text as UTF-8, token ids as little-endian int32, offsets as int32 deltas (each
  against the one before, the first against 0); about 6 bytes per token for
  English-like text (:func:`pack_text`, :func:`pack_token_ids`,
  :func:`pack_offsets`). Unpacking rejects anything that does not decode
  exactly: bad base64 or zlib, trailing bytes, the wrong count, a decreasing
  offset.
* **Which tensors**: a blocked (full-attention) layer's arrays are cut on the
  token axis into pieces; a sliding layer is stored whole in the state file,
  with a zero-token slice of every blocked layer that records its layout.
  Tensors are named ``L{layer}.{key}`` (:func:`tensor_name`); each file's
  metadata is :func:`block_info`, :func:`segment_info` or :func:`state_info`.
  :func:`validate_snapshot` checks a snapshot (and :func:`layout_problem` a
  loaded layer) against the layouts of :mod:`runtime.spec` before anything is
  stored or returned.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec
import numpy as np

from runtime.persist.codec import FileLayout, encode_file
from runtime.spec import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "FORMAT_VERSION",
    "READABLE_FORMATS",
    "MAX_TOKEN_ID",
    "BlockPiece",
    "SegmentPiece",
    "Piece",
    "StateRef",
    "LayerRecord",
    "Manifest",
    "FormatProbe",
    "BlockListProbe",
    "block_chain_hashes",
    "segment_name",
    "state_name",
    "BLOCK_NAME",
    "SEGMENT_NAME",
    "STATE_NAME",
    "AGENT_FILE_NAME",
    "pack_token_ids",
    "unpack_token_ids",
    "pack_offsets",
    "unpack_offsets",
    "pack_text",
    "unpack_text",
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

FORMAT_VERSION = 4
"""Version of the on-disk format; part of every block hash and manifest.

Version 1 stored a whole partial tail block per save; version 2 stores pieces;
version 3 checks files by the SHA-256 of their header and the CRC-32 of their
data (:mod:`runtime.persist.codec`) instead of a SHA-256 over every byte;
version 4 records the XXH3-64 of the data instead of its CRC-32, five times
faster to check on every load. A save writes this version; a load reads
:data:`READABLE_FORMATS` (an upgrade keeps every agent's memory; its next save
rewrites it in this one). Caches of any other version are logged misses.
"""

READABLE_FORMATS = (3, FORMAT_VERSION)
"""The versions a load reads: format 3 differs from 4 only in the data checksum its files record."""

MAX_TOKEN_ID = 2**31 - 1

BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
SEGMENT_NAME = re.compile(r"seg-[0-9a-f]{64}\.safetensors")
STATE_NAME = re.compile(r"state-[0-9a-f]{64}\.safetensors")
AGENT_FILE_NAME = re.compile(r"(?:seg|state|tail)-[0-9a-f]{64}\.safetensors")
"""Files a save may leave in an agent directory (``tail-``: format 1)."""

_Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
_Size = Annotated[int, msgspec.Meta(ge=0, le=2**48)]
_Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
_End = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKEN_ID)]


class _PieceFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every piece records: its name, tokens ``start:end``, its file's checksum and size."""

    name: str
    start: _Tokens
    end: _End
    sha256: _Hex64
    size: _Size


class BlockPiece(_PieceFields, tag_field="kind", tag="block"):
    """Tokens ``start:end`` (one aligned block): ``blocks/<name[:2]>/<name>.safetensors``.

    ``name`` is the block's chain hash; ``sha256`` is the file's checksum (of
    its header, which records the checksum of its data), so a save can check
    that the block on disk is still this one by reading its header alone.
    """

    name: _Hex64


class SegmentPiece(_PieceFields, tag_field="kind", tag="segment"):
    """Tokens ``start:end`` in the agent's own ``agents/<dir>/<name>``, ``name == seg-<sha256>.safetensors``."""

    name: Annotated[str, msgspec.Meta(pattern=r"^seg-[0-9a-f]{64}\.safetensors$")]


Piece = BlockPiece | SegmentPiece


class StateRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The agent's state file, ``agents/<dir>/<name>``, ``name == state-<sha256>.safetensors``."""

    name: Annotated[str, msgspec.Meta(pattern=r"^state-[0-9a-f]{64}\.safetensors$")]
    sha256: _Hex64
    size: _Size


class LayerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layer's kind and the keys of its arrays, in the snapshot's order."""

    kind: LayerKind
    keys: list[Annotated[str, msgspec.Meta(min_length=1)]]


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``agents/<dir>/manifest.json``: everything needed to rebuild a snapshot.

    ``pieces`` cover tokens ``0:num_tokens`` in order, without gaps. ``text``,
    ``token_ids`` and ``offsets`` are packed (:func:`pack_text` and its siblings).
    The manifest is rewritten on every save, so it stays compact: about 6
    bytes per token plus ~200 bytes per piece.
    """

    format_version: int
    model_tag: Annotated[str, msgspec.Meta(min_length=1)]
    agent_id: str
    num_tokens: _Tokens
    text: str
    token_ids: str
    offsets: str
    pieces: list[Piece]
    state: StateRef
    layers: list[LayerRecord]
    meta: dict[str, int | str]
    created_at: float
    updated_at: float


class FormatProbe(msgspec.Struct):
    """Reads only the version of a manifest, whatever else it holds."""

    format_version: int


class _NamedPiece(msgspec.Struct):
    kind: str
    name: str


class _HashOnly(msgspec.Struct):
    hash: str


class BlockListProbe(msgspec.Struct):
    """Reads the shared blocks a manifest of format 2 (``pieces``) or 1 (``blocks``) lists."""

    pieces: list[_NamedPiece] | None = None
    blocks: list[_HashOnly] | None = None


def block_chain_hashes(
    model_tag: str, token_ids: Sequence[int] | np.ndarray, *, version: int = FORMAT_VERSION
) -> list[str]:
    """SHA-256 hex of each full block: over (format ``version``, model tag, previous hash, ids)."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        raise ValueError("token id outside 0..2**31-1")
    ids32 = ids.astype("<i4")
    tag = model_tag.encode("utf-8")
    hashes: list[str] = []
    previous = b""
    for start in range(0, (len(ids32) // BLOCK_TOKENS) * BLOCK_TOKENS, BLOCK_TOKENS):
        h = hashlib.sha256(b"kvmem-block\0")
        h.update(version.to_bytes(4, "little"))
        h.update(len(tag).to_bytes(8, "little") + tag)
        h.update(len(previous).to_bytes(1, "little") + previous)
        h.update(ids32[start : start + BLOCK_TOKENS].tobytes())
        digest = h.hexdigest()
        hashes.append(digest)
        previous = digest.encode("ascii")
    return hashes


def segment_name(sha256: str) -> str:
    """The file name of the segment whose checksum is ``sha256``."""
    return f"seg-{sha256}.safetensors"


def state_name(sha256: str) -> str:
    """The file name of the state file whose checksum is ``sha256``."""
    return f"state-{sha256}.safetensors"


_ZLIB_LEVEL = 1
"""The manifest is compressed on every save: level 9 costs ~70 ms at 16K tokens
for ~10% fewer bytes than level 1 (~4 ms)."""


def _pack(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, _ZLIB_LEVEL)).decode("ascii")


def _unpack(packed: str, *, max_bytes: int | None = None) -> bytes:
    """Inverse of :func:`_pack`; ValueError on bad base64, zlib, trailing bytes or overflow."""
    try:
        compressed = base64.b64decode(packed.encode("ascii"), validate=True)
        inflater = zlib.decompressobj()
        if max_bytes is None:
            raw = inflater.decompress(compressed)
        else:
            raw = inflater.decompress(compressed, max_bytes + 1)
    except (binascii.Error, zlib.error, UnicodeEncodeError) as exc:
        raise ValueError(f"packed field does not decode: {exc}") from exc
    if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise ValueError("packed field is truncated, too long or has trailing bytes")
    return raw


def _int32_le(values: np.ndarray) -> bytes:
    if values.size and (values.min() < 0 or values.max() > MAX_TOKEN_ID):
        raise ValueError("value outside 0..2**31-1")
    return values.astype("<i4").tobytes()


def _int32_array(raw: bytes, count: int) -> np.ndarray:
    if len(raw) != 4 * count:
        raise ValueError(f"{len(raw)} bytes for {count} int32 values")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def pack_token_ids(token_ids: Sequence[int]) -> str:
    """zlib + base64 of ``token_ids`` as little-endian int32 (ValueError if one does not fit)."""
    return _pack(_int32_le(np.asarray(token_ids, dtype=np.int64).reshape(-1)))


def unpack_token_ids(packed: str, count: int) -> np.ndarray:
    """Inverse of :func:`pack_token_ids`; ValueError unless exactly ``count`` ids decode."""
    return _int32_array(_unpack(packed, max_bytes=4 * count), count)


def pack_offsets(offsets: Sequence[int]) -> str:
    """zlib + base64 of the deltas of non-decreasing ``offsets`` (the first against 0)."""
    values = np.asarray(offsets, dtype=np.int64).reshape(-1)
    return _pack(_int32_le(np.diff(values, prepend=0)))


def unpack_offsets(packed: str, count: int) -> np.ndarray:
    """Inverse of :func:`pack_offsets`; ValueError on a negative delta."""
    deltas = _int32_array(_unpack(packed, max_bytes=4 * count), count)
    if deltas.size and deltas.min() < 0:
        raise ValueError("offsets decrease")
    return np.cumsum(deltas, dtype=np.int64)


def pack_text(text: str) -> str:
    """zlib + base64 of ``text`` as UTF-8 (UnicodeEncodeError, a ValueError, on lone surrogates)."""
    return _pack(text.encode("utf-8"))


def unpack_text(packed: str) -> str:
    """Inverse of :func:`pack_text` (ValueError on anything that does not decode)."""
    return _unpack(packed).decode("utf-8")


# -- which tensors the files hold ----------------------------------------------


def tensor_name(layer: int, key: str) -> str:
    """The name of array ``key`` of layer ``layer`` in a file: ``L{layer}.{key}``."""
    return f"L{layer}.{key}"


_Q4_KEYS = ("k_w", "k_s", "k_b", "v_w", "v_s", "v_b")
_FLOAT_KEYS = ("k", "v")


def layout_problem(kind: LayerKind, arrays: dict[str, np.ndarray]) -> str | None:
    """Why ``arrays`` do not fit a layer of ``kind`` (see :mod:`runtime.spec`), or None.

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


def _info(kind: str, model_tag: str, version: int, **fields: str) -> dict[str, str]:
    return {
        "kind": kind,
        "format_version": str(version),
        "model_tag": model_tag,
        **fields,
    }


def block_info(*, model_tag: str, block_hash: str, version: int = FORMAT_VERSION) -> dict[str, str]:
    """The metadata of a block file (fixed width for a model: one header length per layout)."""
    return _info("block", model_tag, version, block_hash=block_hash)


def segment_info(*, model_tag: str, start: int, end: int, version: int = FORMAT_VERSION) -> dict[str, str]:
    """The metadata of a segment file of tokens ``start:end``."""
    return _info("segment", model_tag, version, start=str(start), end=str(end))


def state_info(*, model_tag: str, version: int = FORMAT_VERSION) -> dict[str, str]:
    """The metadata of a state file."""
    return _info("state", model_tag, version)


def encode_state(layers: Sequence[LayerSnapshot], *, model_tag: str) -> bytes:
    """A state file's bytes (see :func:`state_tensors`)."""
    return encode_file(state_tensors(layers), state_info(model_tag=model_tag))
