"""Checks that need no file access: decoding a manifest, checking it against itself, checking a block file alone.

A load (:mod:`runtime.persist.load`) runs them before it reads any piece, a
save (:mod:`runtime.persist.save`) before it reuses the previous manifest's
pieces, and garbage collection (:mod:`runtime.persist.manifests`) to tell
which files a manifest holds on to. Every check raises a
:class:`~runtime.errors.CacheMiss` subclass, or answers a yes or no.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from runtime.errors import CorruptCacheError, ForeignModelError, FormatVersionError
from runtime.persist.codec import FileLayout, data_is_intact, layout_of_entries, parse_file
from runtime.persist.format import (
    FORMAT_VERSION,
    BlockListProbe,
    BlockPiece,
    FormatProbe,
    Manifest,
    Piece,
    block_chain_hashes,
    segment_name,
    state_name,
)
from runtime.persist.packing import unpack_offsets, unpack_text, unpack_token_ids
from runtime.persist.tensors import block_info
from runtime.snapshot import BLOCK_TOKENS

__all__ = [
    "decode_manifest",
    "decode_block_list",
    "block_is_intact",
    "ManifestContents",
    "check_manifest",
]

_manifest_decoder = msgspec.json.Decoder(Manifest)
_probe_decoder = msgspec.json.Decoder(FormatProbe)
_block_list_decoder = msgspec.json.Decoder(BlockListProbe)


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
    data: Any, *, model_tag: str, block_hash: str, like: FileLayout | None
) -> bool:
    """Whether ``data`` is a whole block file for ``block_hash`` (laid out as ``like``).

    Checks the block's own metadata and the CRC of its data, no manifest needed.
    """
    try:
        parsed = parse_file(data)
    except ValueError:
        return False
    if not parsed.has_info(block_info(model_tag=model_tag, block_hash=block_hash)):
        return False
    if not data_is_intact(data, parsed):
        return False
    layout = like
    if layout is None:
        try:
            layout = layout_of_entries(parsed.entries())
        except ValueError:
            return False
    return parsed.matches(layout) and len(data) == parsed.data_start + layout.data_size


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
