"""Saving one agent's cache for a model: write what is new, then the manifest, then tidy the agent's folder.

:func:`save_cache` is :meth:`runtime.persist.CacheDirectory.save`. It plans
which pieces of the previous manifest of the same model it keeps
(:func:`runtime.persist.pieces.plan_save`), writes the new blocks, segments
and the state file in one :class:`~runtime.persist.files.AtomicBatch`
(:mod:`runtime.persist.pieces` too), replaces the model's manifest atomically,
retires a pre-per-model ``manifest.json`` it supersedes, and removes the
agent's files that no manifest of the agent lists any more. A kill at any
point leaves the old manifest with everything it needs, or the new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from runtime.errors import CacheMiss
from runtime.persist.codec import read_tensor_entries
from runtime.persist.files import (
    AtomicBatch,
    ensure_private_dir,
    fsync_dir,
    read_header,
    remove_file,
    write_atomic,
)
from runtime.persist.format import (
    FORMAT_VERSION,
    BlockPiece,
    LayerRecord,
    Manifest,
    Piece,
    block_chain_hashes,
    blocked_sources,
    encode_state,
    pack_offsets,
    pack_text,
    pack_token_ids,
    validate_snapshot,
)
from runtime.persist.manifests import (
    LEGACY_MANIFEST,
    check_manifest,
    decode_manifest,
    kept_files,
    manifest_name,
    own_files,
    read_listing,
    read_listings,
    read_manifest_data,
)
from runtime.persist.pieces import (
    PieceRange,
    WriteTally,
    common_prefix,
    piece_is_intact,
    plan_save,
    range_of,
    remove_own_files,
    write_pieces,
    write_state,
)
from runtime.spec import BLOCK_TOKENS, CacheSnapshot

if TYPE_CHECKING:
    from runtime.persist.directory import CachePaths

__all__ = ["SaveReport", "save_cache"]

log = logging.getLogger("kvmem.persist")

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class SaveReport:
    """What one :meth:`~runtime.persist.CacheDirectory.save` wrote.

    ``bytes_written == block bytes written + tail_bytes + manifest_bytes``, where
    ``tail_bytes`` counts the agent's own files written (segments and the
    state file). ``blocks_reused`` counts the snapshot's blocks stored as
    shared blocks that this save did not write (kept from the previous save or
    found on disk). ``tokens_written`` counts the tokens whose blocked-layer KV
    this save wrote, in blocks and segments together.
    """

    bytes_written: int
    blocks_written: int
    blocks_reused: int
    tail_bytes: int
    manifest_bytes: int
    segments_written: int = 0
    tokens_written: int = 0


@dataclass(frozen=True)
class _Previous:
    created_at: float
    token_ids: np.ndarray
    pieces: list[Piece]


def save_cache(
    paths: CachePaths, agent_id: str, snapshot: CacheSnapshot, *, block_hashes: Sequence[str] | None = None
) -> SaveReport:
    """Store ``snapshot`` as ``agent_id``'s cache for its model (see :meth:`runtime.persist.CacheDirectory.save`)."""
    agent_dir = paths.agent_dir(agent_id)
    validate_snapshot(snapshot)
    model_tag = snapshot.model_tag
    packed_text = pack_text(snapshot.text)
    packed_ids = pack_token_ids(snapshot.token_ids)
    packed_offsets = pack_offsets(snapshot.offsets)
    token_ids = np.asarray(snapshot.token_ids, dtype=np.int64).reshape(-1)
    chain = list(block_hashes) if block_hashes is not None else block_chain_hashes(model_tag, token_ids)
    if len(chain) != len(token_ids) // BLOCK_TOKENS:
        raise ValueError(f"{len(chain)} block hashes for {len(token_ids)} tokens")
    records = [LayerRecord(kind=layer.kind, keys=list(layer.arrays)) for layer in snapshot.layers]
    state_data = encode_state(snapshot.layers, model_tag=model_tag)
    previous = _previous(agent_dir, agent_id, snapshot, records, state_data)
    ensure_private_dir(agent_dir, fsync=paths.fsync)

    plan = plan_save(
        previous.pieces if previous else [],
        common=common_prefix(previous.token_ids, token_ids) if previous else 0,
        num_tokens=snapshot.num_tokens,
    )
    tally = WriteTally()
    wanted: list[Piece | PieceRange] = [
        kept if piece_is_intact(paths, agent_dir, kept) else range_of(kept) for kept in plan.reuse
    ]
    wanted += plan.write
    with AtomicBatch(fsync=paths.fsync) as batch:
        ranges = [item for item in wanted if isinstance(item, PieceRange)]
        written = iter(
            write_pieces(paths, agent_dir, snapshot, chain=chain, ranges=ranges, tally=tally, batch=batch)
        )
        pieces = [next(written) if isinstance(item, PieceRange) else item for item in wanted]
        state = write_state(agent_dir, state_data, tally=tally, batch=batch)
        batch.commit()

    now = time.time()
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model_tag=model_tag,
        agent_id=agent_id,
        num_tokens=snapshot.num_tokens,
        text=packed_text,
        token_ids=packed_ids,
        offsets=packed_offsets,
        pieces=pieces,
        state=state,
        layers=records,
        meta=dict(snapshot.meta),
        created_at=previous.created_at if previous else now,
        updated_at=now,
    )
    manifest_data = _encoder.encode(manifest)
    write_atomic(
        agent_dir / manifest_name(model_tag), manifest_data, fsync=paths.fsync, replace_directory=True
    )
    _retire_legacy_manifest(paths, agent_dir, agent_id, model_tag)
    _remove_unlisted_files(agent_dir, manifest)
    blocks = sum(isinstance(piece, BlockPiece) for piece in pieces)
    return SaveReport(
        bytes_written=tally.block_bytes + tally.own_bytes + len(manifest_data),
        blocks_written=tally.blocks_written,
        blocks_reused=blocks - tally.blocks_written,
        tail_bytes=tally.own_bytes,
        manifest_bytes=len(manifest_data),
        segments_written=tally.segments_written,
        tokens_written=tally.tokens_written,
    )


def _previous(
    agent_dir: Path,
    agent_id: str,
    snapshot: CacheSnapshot,
    records: list[LayerRecord],
    state_data: bytes,
) -> _Previous | None:
    """What a save takes from the agent's previous manifest for this model, if any.

    Its pieces are reusable only if the manifest passes every check a load
    makes without reading pieces, and records the same layers with the
    same blocked layouts (dtype and shape of the zero-token tensors in its
    state file's header).
    """
    try:
        data = read_manifest_data(agent_dir, snapshot.model_tag)
        if data is None:
            return None
        manifest = decode_manifest(data)
        contents = check_manifest(manifest, agent_id=agent_id, model_tag=snapshot.model_tag)
    except (OSError, ValueError, CacheMiss):
        return None
    # Pieces of an older format are read, never kept: its blocks are named by that format's chain.
    pieces = list(manifest.pieces) if manifest.format_version == FORMAT_VERSION else []
    header = read_header(agent_dir / manifest.state.name, size=manifest.state.size)
    try:
        theirs = read_tensor_entries(header) if header is not None else {}
        ours = read_tensor_entries(state_data)
    except ValueError:
        pieces = []
    else:
        blocked = blocked_sources(snapshot.layers)
        if manifest.layers != records or any(theirs.get(name) != ours[name] for name in blocked):
            pieces = []
    return _Previous(created_at=manifest.created_at, token_ids=contents.token_ids, pieces=pieces)


def _retire_legacy_manifest(paths: CachePaths, agent_dir: Path, agent_id: str, model_tag: str) -> None:
    """Remove a pre-per-model ``manifest.json`` that the manifest just written replaces.

    It stays only while it may be another model's usable cache: a manifest
    of this format, of this agent, made by another model. Any other one
    (this model's, another format's, undecodable) is what the save would
    have overwritten before caches were kept per model.
    """
    try:
        legacy = read_listing(agent_dir, LEGACY_MANIFEST)
    except OSError as exc:
        log.warning("cannot read %s: %s", agent_dir / LEGACY_MANIFEST, exc)
        return
    if legacy is None:
        return
    kept = legacy.manifest
    if kept is not None and kept.model_tag != model_tag and kept.agent_id == agent_id:
        return
    remove_file(agent_dir / LEGACY_MANIFEST)
    if paths.fsync:
        fsync_dir(agent_dir)


def _remove_unlisted_files(agent_dir: Path, manifest: Manifest) -> int:
    """Remove the agent's files that neither ``manifest`` nor another manifest of the agent lists.

    Nothing is removed while a manifest of the agent may list files this
    version cannot tell (another format version) or cannot be read.
    """
    ours = manifest_name(manifest.model_tag)
    try:
        others = [listing for listing in read_listings(agent_dir) if listing.name != ours]
    except OSError as exc:
        log.warning("cannot read the manifests in %s: %s; keeping its files", agent_dir, exc)
        return 0
    kept = kept_files(others)
    if kept is None:
        return 0
    return remove_own_files(agent_dir, keep=kept | own_files(manifest))
