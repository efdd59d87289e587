"""Verification and assembly of a stored cache (pure: bytes in, snapshot out).

Used by :meth:`runtime.persist.CacheDirectory.load` (which does the file
access) and by its save (which checks the previous manifest before reusing its
pieces). Every check raises a :class:`~runtime.errors.CacheMiss` subclass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import safetensors.numpy

from runtime.errors import CorruptCacheError, ForeignModelError, FormatVersionError
from runtime.persist_format import (
    FORMAT_VERSION,
    BlockListProbe,
    BlockPiece,
    FormatProbe,
    Manifest,
    Piece,
    block_chain_hashes,
    layout_problem,
    read_metadata,
    segment_name,
    state_name,
    tensor_digest,
    tensor_name,
    unpack_offsets,
    unpack_text,
    unpack_token_ids,
)
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "sha256_hex",
    "decode_manifest",
    "decode_block_list",
    "block_is_intact",
    "ManifestContents",
    "check_manifest",
    "assemble_snapshot",
]

_manifest_decoder = msgspec.json.Decoder(Manifest)
_probe_decoder = msgspec.json.Decoder(FormatProbe)
_block_list_decoder = msgspec.json.Decoder(BlockListProbe)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_manifest(data: bytes) -> Manifest:
    """Strictly decode a manifest of this format version.

    Raises:
        FormatVersionError: the manifest has another ``format_version``.
        CorruptCacheError: it is not a valid manifest.
    """
    try:
        version = _probe_decoder.decode(data).format_version
    except msgspec.DecodeError as exc:
        raise CorruptCacheError(f"manifest does not decode: {exc}") from exc
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"manifest has format {version}; this kvmem reads {FORMAT_VERSION}"
        )
    try:
        return _manifest_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptCacheError(f"manifest does not decode: {exc}") from exc


def decode_block_list(data: bytes) -> list[str] | None:
    """Shared-block hashes of a manifest of format 2 or 1, or None for an unknown layout."""
    try:
        probe = _block_list_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    if probe.pieces is not None:
        return [piece.name for piece in probe.pieces if piece.kind == "block"]
    if probe.blocks is not None:
        return [block.hash for block in probe.blocks]
    return None


def block_is_intact(
    data: bytes, *, model_tag: str, block_hash: str, like: dict[str, np.ndarray] | None
) -> bool:
    """Whether ``data`` is a whole block file for ``block_hash`` (and shaped like ``like``).

    Checks the block's own metadata and tensor digest, no manifest needed.
    """
    try:
        info = read_metadata(data)
        tensors = safetensors.numpy.load(data)
    except Exception:  # noqa: BLE001 - any parse failure means "not intact"
        return False
    if (
        info.get("kind") != "block"
        or info.get("format_version") != str(FORMAT_VERSION)
        or info.get("model_tag") != model_tag
        or info.get("block_hash") != block_hash
        or info.get("tensor_sha256") != tensor_digest(tensors)
    ):
        return False
    if like is None:
        return True
    return set(tensors) == set(like) and all(
        tensors[name].dtype == like[name].dtype
        and tensors[name].shape == like[name].shape
        for name in like
    )


@dataclass(frozen=True)
class ManifestContents:
    """What a checked manifest's packed fields hold."""

    text: str
    token_ids: np.ndarray
    offsets: np.ndarray


def _check_pieces(pieces: Sequence[Piece], num_tokens: int, chain: list[str]) -> None:
    position = 0
    for piece in pieces:
        where = f"piece {piece.start}:{piece.end}"
        if piece.start != position or piece.end <= piece.start:
            raise CorruptCacheError(
                f"{where} leaves a gap or overlaps at token {position}"
            )
        if piece.end > num_tokens:
            raise CorruptCacheError(f"{where} runs past {num_tokens} tokens")
        if isinstance(piece, BlockPiece):
            if piece.start % BLOCK_TOKENS or piece.end - piece.start != BLOCK_TOKENS:
                raise CorruptCacheError(f"block {where} is not one aligned block")
            if piece.name != chain[piece.start // BLOCK_TOKENS]:
                raise CorruptCacheError(
                    f"block {where} is not the block of these tokens"
                )
        elif piece.name != segment_name(piece.sha256):
            raise CorruptCacheError(f"segment {where} is not named by its checksum")
        position = piece.end
    if position != num_tokens:
        raise CorruptCacheError(f"pieces cover {position} of {num_tokens} tokens")


def check_manifest(
    manifest: Manifest, *, agent_id: str, model_tag: str
) -> ManifestContents:
    """Check a manifest against itself, without reading other files.

    Raises:
        ForeignModelError: made by another model.
        CorruptCacheError: the packed fields, counts, offsets, pieces (gaps,
            block names against the hash chain) or file names disagree.
    """
    if manifest.model_tag != model_tag:
        raise ForeignModelError(
            f"cache made by model {manifest.model_tag!r}, not {model_tag!r}"
        )
    if manifest.agent_id != agent_id:
        raise CorruptCacheError(f"manifest names agent {manifest.agent_id!r}")
    num_tokens = manifest.num_tokens
    try:
        text = unpack_text(manifest.text)
        token_ids = unpack_token_ids(manifest.token_ids, num_tokens)
        offsets = unpack_offsets(manifest.offsets, num_tokens)
    except ValueError as exc:
        raise CorruptCacheError(f"text, token ids or offsets: {exc}") from exc
    if num_tokens and offsets[-1] > len(text):
        raise CorruptCacheError("offsets run past the text")
    if num_tokens and token_ids.min() < 0:
        raise CorruptCacheError("negative token id")
    _check_pieces(manifest.pieces, num_tokens, block_chain_hashes(model_tag, token_ids))
    if manifest.state.name != state_name(manifest.state.sha256):
        raise CorruptCacheError("state file is not named by its checksum")
    keys = [
        (index, key)
        for index, record in enumerate(manifest.layers)
        for key in record.keys
    ]
    if len(set(keys)) != len(keys):
        raise CorruptCacheError("a layer lists a key twice")
    return ManifestContents(text=text, token_ids=token_ids, offsets=offsets)


def _check_piece_metadata(
    piece: Piece, info: dict[str, str], manifest: Manifest
) -> None:
    expected = {"format_version": str(FORMAT_VERSION), "model_tag": manifest.model_tag}
    if isinstance(piece, BlockPiece):
        expected |= {
            "kind": "block",
            "block_hash": piece.name,
            "tensor_sha256": piece.tensor_sha256,
        }
    else:
        expected |= {
            "kind": "segment",
            "start": str(piece.start),
            "end": str(piece.end),
        }
    if any(info.get(key) != value for key, value in expected.items()):
        raise CorruptCacheError(
            f"file {piece.name} does not hold tokens {piece.start}:{piece.end}"
        )


def assemble_snapshot(
    manifest: Manifest,
    contents: ManifestContents,
    *,
    state: bytes,
    read_piece: Callable[[Piece], bytes],
) -> CacheSnapshot:
    """Rebuild the snapshot from verified state bytes and pieces read one at a time.

    Blocked arrays are allocated from the state file's zero-token layouts and
    filled piece by piece, so memory peaks at the result plus one piece.

    Raises:
        CorruptCacheError: a file's metadata, tensor set, dtype or shape
            contradicts the manifest or the layer layouts.
    """
    num_tokens = manifest.num_tokens
    records = {
        tensor_name(index, key): record
        for index, record in enumerate(manifest.layers)
        for key in record.keys
    }
    info = read_metadata(state)
    if (info.get("kind"), info.get("format_version"), info.get("model_tag")) != (
        "state",
        str(FORMAT_VERSION),
        manifest.model_tag,
    ):
        raise CorruptCacheError("state file is not this cache's")
    state_arrays = safetensors.numpy.load(state)
    if set(state_arrays) != set(records):
        raise CorruptCacheError("state tensors do not match the manifest's layers")
    out: dict[str, np.ndarray] = {}
    for name, record in records.items():
        array = state_arrays[name]
        if array.ndim < 2:
            raise CorruptCacheError(f"state tensor {name} has no token axis")
        if record.kind is LayerKind.SLIDING:
            if array.shape[1] > num_tokens:
                raise CorruptCacheError(
                    f"sliding tensor {name} holds more tokens than the cache"
                )
            out[name] = array
        elif array.shape[1] != 0:
            raise CorruptCacheError(f"state holds tokens of blocked tensor {name}")
        else:
            out[name] = np.empty(
                (array.shape[0], num_tokens, *array.shape[2:]), dtype=array.dtype
            )
    blocked = {
        name for name, record in records.items() if record.kind is not LayerKind.SLIDING
    }

    for piece in manifest.pieces:
        raw = read_piece(piece)
        _check_piece_metadata(piece, read_metadata(raw), manifest)
        arrays = safetensors.numpy.load(raw)
        if set(arrays) != blocked:
            raise CorruptCacheError(
                f"{piece.name} tensors do not match the manifest's layers"
            )
        for name in blocked:
            array, target = arrays[name], out[name]
            expected = (target.shape[0], piece.end - piece.start, *target.shape[2:])
            if array.dtype != target.dtype or array.shape != expected:
                raise CorruptCacheError(
                    f"{piece.name} tensor {name} is {array.dtype}{array.shape}, "
                    f"expected {target.dtype}{expected}"
                )
            target[:, piece.start : piece.end] = array

    layers = []
    for index, record in enumerate(manifest.layers):
        arrays = {key: out[tensor_name(index, key)] for key in record.keys}
        problem = layout_problem(record.kind, arrays)
        if problem is not None:
            raise CorruptCacheError(f"layer {index}: {problem}")
        layers.append(LayerSnapshot(kind=record.kind, arrays=arrays))
    return CacheSnapshot(
        model_tag=manifest.model_tag,
        text=contents.text,
        token_ids=contents.token_ids.tolist(),
        offsets=contents.offsets.tolist(),
        layers=layers,
        meta=dict(manifest.meta),
    )
