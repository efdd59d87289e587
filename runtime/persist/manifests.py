"""An agent directory's manifests (one per model tag, plus the single one of older kvmem), and their checks.

An agent keeps one cache per model it has talked to, so that a turn with model
B never replaces its model-A cache::

    agents/<dir>/manifest-<digest>.json   one per model tag (:func:`manifest_name`)
    agents/<dir>/manifest.json            kvmem before per-model caches: one cache,
                                          of whichever model saved last (legacy)

Every manifest of a directory lists its own segments and state file in that
same directory. Their names are content hashes over headers that record the
model tag, so two models' caches never name the same file; still, a file stays
while *any* manifest of the directory lists it (:func:`kept_files`).

A legacy ``manifest.json`` is read as that model's cache until the model saves
again (:mod:`runtime.persist.save` then removes it), so an upgrade keeps warm
caches. It is only a fallback: a ``manifest-<digest>.json`` of the same model
wins (:func:`read_manifest_data`).

A manifest is checked here too, without reading any other file:
:func:`decode_manifest` decodes one of this format version strictly, and
:func:`check_manifest` checks it against itself (packed fields, counts,
offsets, pieces against the block hash chain, file names). A load runs both
before it reads any piece, and a save before it reuses the previous
manifest's pieces; garbage collection and the agent listing decode each
manifest (:func:`read_listing`) to tell which files it holds on to. Both
checks raise a :class:`~runtime.errors.CacheMiss` subclass.

Nothing here writes: saves (:mod:`runtime.persist.save`), deletions
(:mod:`runtime.persist.agents`) and garbage collection
(:mod:`runtime.persist.gc`) make every change to a directory.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from runtime.errors import CorruptCacheError, ForeignModelError, FormatVersionError
from runtime.persist.files import read_regular_file
from runtime.persist.format import (
    READABLE_FORMATS,
    BlockListProbe,
    BlockPiece,
    FormatProbe,
    Manifest,
    Piece,
    SegmentPiece,
    block_chain_hashes,
    segment_name,
    state_name,
    unpack_offsets,
    unpack_text,
    unpack_token_ids,
)
from runtime.spec import BLOCK_TOKENS

__all__ = [
    "LEGACY_MANIFEST",
    "MANIFEST_NAME",
    "manifest_name",
    "manifest_names",
    "read_manifest_data",
    "own_files",
    "Listing",
    "read_listing",
    "read_listings",
    "kept_files",
    "decode_manifest",
    "decode_block_list",
    "ManifestContents",
    "check_manifest",
]

LEGACY_MANIFEST = "manifest.json"
"""The one manifest of an agent directory written by kvmem before per-model caches."""

MANIFEST_NAME = re.compile(r"manifest-[0-9a-f]{32}\.json")
"""A per-model manifest (:func:`manifest_name`)."""

_DIGEST_HEX = 32

_manifest_decoder = msgspec.json.Decoder(Manifest)
_probe_decoder = msgspec.json.Decoder(FormatProbe)
_block_list_decoder = msgspec.json.Decoder(BlockListProbe)


def manifest_name(model_tag: str) -> str:
    """The file name of an agent's manifest for ``model_tag``: ``manifest-<128-bit digest>.json``.

    Model tags hold ``/``, ``@`` and whatever path a model was loaded from, so
    the name is a digest; the manifest itself records the tag, and a load
    checks it.
    """
    raw = model_tag.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(b"kvmem-model-tag\0" + raw).hexdigest()
    return f"manifest-{digest[:_DIGEST_HEX]}.json"


def manifest_names(agent_dir: Path) -> list[str]:
    """Names in ``agent_dir`` that a manifest may have (legacy included), sorted.

    Raises:
        OSError: the directory cannot be listed (absent: an empty list).
    """
    try:
        names = os.listdir(agent_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n == LEGACY_MANIFEST or MANIFEST_NAME.fullmatch(n))


def read_manifest_data(agent_dir: Path, model_tag: str) -> bytes | None:
    """The bytes of the agent's manifest for ``model_tag``, else of its pre-per-model one, else None.

    Raises:
        OSError: a manifest is there but cannot be read.
    """
    data = read_regular_file(agent_dir / manifest_name(model_tag))
    if data is None:
        data = read_regular_file(agent_dir / LEGACY_MANIFEST)
    return data


def own_files(manifest: Manifest) -> set[str]:
    """The agent-directory files ``manifest`` lists: its segments and state file."""
    names = {piece.name for piece in manifest.pieces if isinstance(piece, SegmentPiece)}
    return names | {manifest.state.name}


def decode_manifest(data: bytes) -> Manifest:
    """Strictly decode a manifest of a format this kvmem reads (:data:`~runtime.persist.format.READABLE_FORMATS`).

    Raises:
        FormatVersionError: the manifest has another ``format_version``.
        CorruptCacheError: it is not a valid manifest.
    """
    try:
        version = _probe_decoder.decode(data).format_version
    except msgspec.DecodeError as exc:
        raise CorruptCacheError(f"manifest does not decode: {exc}") from exc
    if version not in READABLE_FORMATS:
        raise FormatVersionError(
            f"manifest has format {version}; this kvmem reads {', '.join(map(str, READABLE_FORMATS))}"
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
    chain = block_chain_hashes(model_tag, token_ids, version=manifest.format_version)
    _check_pieces(manifest.pieces, num_tokens, chain)
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


@dataclass(frozen=True)
class Listing:
    """What one manifest file of an agent directory holds on to.

    Attributes:
        name: the manifest's file name.
        size: its size in bytes.
        manifest: the manifest, when it is one of this format version (it may
            still fail a load's checks).
        blocks: the shared blocks it lists; None when unknown (a manifest of
            another format whose layout this version cannot read: keep every block).
        own: the agent files it lists; None when unknown (another format
            version: keep every file of the directory).
        problem: why ``manifest`` is None.

    A manifest of this version that does not decode lists nothing: its cache
    can never load, and the next save of its model starts afresh.
    """

    name: str
    size: int
    manifest: Manifest | None
    blocks: frozenset[str] | None
    own: frozenset[str] | None
    problem: str | None = None


def read_listing(agent_dir: Path, name: str) -> Listing | None:
    """Read and classify manifest ``name`` of ``agent_dir``; None when it is not a regular file.

    Raises:
        OSError: it exists but cannot be read.
    """
    data = read_regular_file(agent_dir / name)
    if data is None:
        return None
    try:
        manifest = decode_manifest(data)
    except FormatVersionError as exc:
        listed = decode_block_list(data)
        blocks = None if listed is None else frozenset(listed)
        return Listing(name=name, size=len(data), manifest=None, blocks=blocks, own=None, problem=str(exc))
    except CorruptCacheError as exc:
        return Listing(
            name=name, size=len(data), manifest=None, blocks=frozenset(), own=frozenset(), problem=str(exc)
        )
    blocks = frozenset(piece.name for piece in manifest.pieces if isinstance(piece, BlockPiece))
    return Listing(
        name=name, size=len(data), manifest=manifest, blocks=blocks, own=frozenset(own_files(manifest))
    )


def read_listings(agent_dir: Path) -> list[Listing]:
    """Every manifest of ``agent_dir`` (see :func:`read_listing`), by name.

    Raises:
        OSError: the directory or one of its manifests cannot be read.
    """
    listings = (read_listing(agent_dir, name) for name in manifest_names(agent_dir))
    return [listing for listing in listings if listing is not None]


def kept_files(listings: Iterable[Listing]) -> set[str] | None:
    """The agent files any of ``listings`` lists; None when one of them may list unknown files."""
    kept: set[str] = set()
    for listing in listings:
        if listing.own is None:
            return None
        kept |= listing.own
    return kept
