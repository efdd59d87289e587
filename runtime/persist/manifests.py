"""An agent directory's manifests: one per model tag, plus the single manifest of older kvmem.

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

Nothing here writes: saves (:mod:`runtime.persist.save`), deletions
(:mod:`runtime.persist.agents`) and garbage collection
(:mod:`runtime.persist.gc`) make every change to a directory.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import CorruptCacheError, FormatVersionError
from runtime.persist.files import read_regular_file
from runtime.persist.format import BlockPiece, Manifest, SegmentPiece
from runtime.persist.verify import decode_block_list, decode_manifest

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
]

LEGACY_MANIFEST = "manifest.json"
"""The one manifest of an agent directory written by kvmem before per-model caches."""

MANIFEST_NAME = re.compile(r"manifest-[0-9a-f]{32}\.json")
"""A per-model manifest (:func:`manifest_name`)."""

_DIGEST_HEX = 32


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
