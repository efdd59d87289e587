"""The warm tier: agents' KV caches in a directory, written once per token.

:class:`CacheDirectory` is the only code that touches a cache directory. Layout::

    root/
      blocks/<hh>/<hash>.safetensors          immutable 256-token block, shared by every
                                              agent whose tokens up to its end are the same
      agents/<dir>/manifest-<digest>.json     what the agent's cache for one model is made of
      agents/<dir>/seg-<sha256>.safetensors   the agent's own pieces (any token range)
      agents/<dir>/state-<sha256>.safetensors sliding layers + every layer's layout

An agent has **one cache per model tag** (:attr:`runtime.spec.ModelCacheSpec.tag`):
``<digest>`` is a digest of the tag (:func:`runtime.persist_manifests.manifest_name`),
so a turn with another model saves beside the first model's cache instead of
over it, and each resumes its own. A ``manifest.json`` left by kvmem before
per-model caches is still read as the cache of the model it records, until that
model saves again (:mod:`runtime.persist_manifests`).

An agent's blocked-layer (full-attention) KV is an ordered list of **pieces**
covering tokens ``0:num_tokens`` without gaps (formats in
:mod:`runtime.persist_format`, what a save writes in :mod:`runtime.persist_plan`,
file handling in :mod:`runtime.persist_pieces`):

* a **shared block** holds one aligned 256-token block. ``<hash>`` is a hash
  chain over (format version, model tag, previous block's hash, the block's
  token ids), so agents that share a prefix share its files. A save writes a
  block file only for a block whose 256 tokens are all new in that save (the
  first save, which holds the system prompt, is the common case); if the file
  is already there and intact it is reused, even with other bits (the same
  model can compute the same prefix slightly differently, batched or alone).
* a **segment** holds any other range: the tokens a later turn adds to an
  unfinished block, the remainder after the last whole block. It is named by
  its content hash and never rewritten; a block filled over several turns
  stays made of the segments that filled it.

A save reuses every piece of the previous manifest that lies inside the common
token-id prefix, so each token's KV is written once. The **state** file holds
the sliding-window layers (bounded by their window), rewritten whole on each
save where they changed, and a zero-token slice of every blocked layer that
records its dtype and shape. The **manifest** (JSON,
:class:`runtime.persist_format.Manifest`) holds format version, model tag,
agent id, the pieces with their sizes and checksums (the SHA-256 of a file's header,
which records the CRC-32 of its data: :mod:`runtime.persist_codec`), the state file's, layer
kinds and keys, meta, times, and the text, token ids and offsets compressed
(about 6 bytes per token): the only thing rewritten in full every turn.
``<dir>`` is :func:`safe_agent_dirname` of the agent id.

A save writes new blocks, segments and the state file first (temp files, then
fsync them all, rename them all, fsync their directories: a
:class:`~runtime.persist_files.AtomicBatch`), then replaces the model's
manifest the same way (:func:`~runtime.persist_files.write_atomic`), then
removes the agent's files that no manifest of the agent (any model) lists any
more. A kill at any point leaves the old manifest with everything it needs, or
the new one. Garbage collection keeps every block that any manifest of any
agent lists. Loads verify sizes, checksums, the hash chain, contiguity and
every shape against the manifest, and turn any problem into a
:class:`~runtime.errors.CacheMiss` (logged), never an uncaught error; a file
that fails its own checksum is removed so the next save rewrites it.

Not thread-safe: callers serialize calls (the cache store runs one disk
operation at a time). Files are ``0o600``, directories ``0o700``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from runtime.errors import CacheMiss, CorruptCacheError, FormatVersionError
from runtime.persist_codec import read_tensor_entries
from runtime.persist_files import (
    AtomicBatch,
    ensure_private_dir,
    fsync_dir,
    read_header,
    read_regular_file,
    regular_file_size,
    remove_file,
    remove_temp_files,
    write_atomic,
)
from runtime.persist_format import (
    BLOCK_NAME,
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
from runtime.persist_load import (
    assemble_snapshot,
    check_manifest,
    decode_manifest,
)
from runtime.persist_manifests import (
    LEGACY_MANIFEST,
    kept_files,
    manifest_name,
    manifest_names,
    own_files,
    read_listing,
    read_listings,
)
from runtime.persist_names import safe_agent_dirname
from runtime.persist_pieces import PieceFiles, WriteTally
from runtime.persist_plan import PieceRange, common_prefix, plan_save, range_of
from runtime.snapshot import CacheSnapshot

__all__ = [
    "FORMAT_VERSION",
    "safe_agent_dirname",
    "manifest_name",
    "SaveReport",
    "AgentEntry",
    "CacheDirectory",
]

log = logging.getLogger("kvmem.persist")

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class SaveReport:
    """What one :meth:`CacheDirectory.save` wrote.

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
class AgentEntry:
    """One stored cache (an agent's, for one model), as listed by :meth:`CacheDirectory.list_agents`.

    ``disk_bytes`` counts the manifest, the state file, the segments and every
    referenced block in full, including blocks shared with other agents.
    """

    agent_id: str
    model_tag: str
    num_tokens: int
    disk_bytes: int
    updated_at: float


@dataclass(frozen=True)
class _Previous:
    created_at: float
    token_ids: np.ndarray
    pieces: list[Piece]


class CacheDirectory:
    """Agents' caches in ``root`` (see the module docstring for the layout).

    Args:
        root: the cache directory; created (``0o700``) if absent.
        fsync: fsync files and directories on save (off only in tests and
            benchmarks where durability across power loss does not matter).

    Opening removes ``*.tmp`` files that a killed save left behind.
    """

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self._fsync = fsync
        self._blocks = self.root / "blocks"
        self._agents = self.root / "agents"
        if not self.root.is_dir():
            self.root.parent.mkdir(parents=True, exist_ok=True)
            ensure_private_dir(self.root, fsync=fsync)
        ensure_private_dir(self._blocks, fsync=fsync)
        ensure_private_dir(self._agents, fsync=fsync)
        self._files = PieceFiles(self._blocks, fsync=fsync)
        removed = self._remove_temp_files()
        if removed:
            log.info("removed %d temporary files left by an interrupted save", removed)

    # -- paths ---------------------------------------------------------------

    def _agent_dir(self, agent_id: str) -> Path:
        return self._agents / safe_agent_dirname(agent_id)

    def _subdirs(self, parent: Path) -> list[Path]:
        try:
            return [
                Path(e.path)
                for e in os.scandir(parent)
                if e.is_dir(follow_symlinks=False)
            ]
        except OSError:
            return []

    def _remove_temp_files(self) -> int:
        dirs = [self.root, self._blocks, self._agents]
        dirs += self._subdirs(self._blocks) + self._subdirs(self._agents)
        return sum(remove_temp_files(d) for d in dirs)

    # -- save ----------------------------------------------------------------

    def save(self, agent_id: str, snapshot: CacheSnapshot) -> SaveReport:
        """Store ``snapshot`` as ``agent_id``'s cache for its model, replacing that model's previous one.

        Writes only the tokens the previous save of the same model did not
        store (see :mod:`runtime.persist_plan`), the state file if it changed,
        and the manifest. A needed piece that is missing or damaged on disk is
        written again. The agent's caches for other models stay as they are.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
            ValueError: the snapshot is inconsistent (lengths, shapes, dtypes).
            OSError: the disk refused a write; the previous cache is untouched.
        """
        agent_dir = self._agent_dir(agent_id)
        validate_snapshot(snapshot)
        model_tag = snapshot.model_tag
        packed_text = pack_text(snapshot.text)
        packed_ids = pack_token_ids(snapshot.token_ids)
        packed_offsets = pack_offsets(snapshot.offsets)
        token_ids = np.asarray(snapshot.token_ids, dtype=np.int64).reshape(-1)
        chain = block_chain_hashes(model_tag, token_ids)
        records = [
            LayerRecord(kind=layer.kind, keys=list(layer.arrays))
            for layer in snapshot.layers
        ]
        state_data = encode_state(snapshot.layers, model_tag=model_tag)
        previous = self._previous(agent_dir, agent_id, snapshot, records, state_data)
        ensure_private_dir(agent_dir, fsync=self._fsync)

        plan = plan_save(
            previous.pieces if previous else [],
            common=common_prefix(previous.token_ids, token_ids) if previous else 0,
            num_tokens=snapshot.num_tokens,
        )
        tally = WriteTally()
        wanted: list[Piece | PieceRange] = [
            kept if self._files.is_intact(agent_dir, kept) else range_of(kept)
            for kept in plan.reuse
        ]
        wanted += plan.write
        with AtomicBatch(fsync=self._fsync) as batch:
            written = iter(
                self._files.write(
                    agent_dir,
                    snapshot,
                    chain,
                    [item for item in wanted if isinstance(item, PieceRange)],
                    tally,
                    batch,
                )
            )
            pieces = [
                next(written) if isinstance(item, PieceRange) else item
                for item in wanted
            ]
            state = self._files.write_state(agent_dir, state_data, tally, batch)
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
        write_atomic(agent_dir / manifest_name(model_tag), manifest_data, fsync=self._fsync)
        self._retire_legacy_manifest(agent_dir, agent_id, model_tag)
        self._remove_unlisted_files(agent_dir, manifest)
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
        self,
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
            data = _manifest_data(agent_dir, snapshot.model_tag)
            if data is None:
                return None
            manifest = decode_manifest(data)
            contents = check_manifest(
                manifest, agent_id=agent_id, model_tag=snapshot.model_tag
            )
        except (OSError, ValueError, CacheMiss):
            return None
        pieces = list(manifest.pieces)
        header = read_header(agent_dir / manifest.state.name, size=manifest.state.size)
        try:
            theirs = read_tensor_entries(header) if header is not None else {}
            ours = read_tensor_entries(state_data)
        except ValueError:
            pieces = []
        else:
            blocked = blocked_sources(snapshot.layers)
            if manifest.layers != records or any(
                theirs.get(name) != ours[name] for name in blocked
            ):
                pieces = []
        return _Previous(
            created_at=manifest.created_at, token_ids=contents.token_ids, pieces=pieces
        )

    def _retire_legacy_manifest(self, agent_dir: Path, agent_id: str, model_tag: str) -> None:
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
        if self._fsync:
            fsync_dir(agent_dir)

    def _remove_unlisted_files(self, agent_dir: Path, manifest: Manifest) -> int:
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
        return self._files.remove_own_files(agent_dir, keep=kept | own_files(manifest))

    # -- load ----------------------------------------------------------------

    def load(self, agent_id: str, *, model_tag: str) -> CacheSnapshot:
        """Read and fully verify ``agent_id``'s cache for ``model_tag``.

        Returns:
            A snapshot bit-identical to the one saved (up to a reused block, see
            :meth:`save`).

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
            CacheMiss: no cache is stored for ``agent_id`` and ``model_tag``
                (a cache of another model is no help).
            FormatVersionError: written by another version of the format.
            ForeignModelError: made by another model than ``model_tag`` (a
                pre-per-model ``manifest.json``, or a manifest that lies).
            CorruptCacheError: anything missing, truncated, failing a checksum
                or contradicting the manifest (logged as a warning).
        """
        agent_dir = self._agent_dir(agent_id)
        try:
            return self._load(agent_dir, agent_id, model_tag)
        except (CorruptCacheError, FormatVersionError) as exc:
            log.warning("cache of agent %r is unusable: %s", agent_id, exc)
            raise
        except CacheMiss:
            raise
        except Exception as exc:
            log.warning(
                "cache of agent %r is unusable: %s: %s",
                agent_id,
                type(exc).__name__,
                exc,
            )
            raise CorruptCacheError(f"{type(exc).__name__}: {exc}") from exc

    def _load(self, agent_dir: Path, agent_id: str, model_tag: str) -> CacheSnapshot:
        data = _manifest_data(agent_dir, model_tag)
        if data is None:
            raise CacheMiss(f"no cache stored for agent {agent_id!r} and model {model_tag!r}")
        manifest = decode_manifest(data)
        contents = check_manifest(manifest, agent_id=agent_id, model_tag=model_tag)
        state = self._files.read_state(agent_dir, manifest.state)
        return assemble_snapshot(
            manifest,
            contents,
            state=state,
            files=self._files.reader(agent_dir, model_tag=model_tag),
        )

    # -- other operations ----------------------------------------------------

    def exists(self, agent_id: str, *, model_tag: str | None = None) -> bool:
        """Whether a manifest is stored for ``agent_id`` (not whether it loads).

        Args:
            model_tag: only a manifest for this model counts (a pre-per-model
                ``manifest.json`` counts for every model); None: any model's.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache (as every method).
        """
        agent_dir = self._agent_dir(agent_id)
        if model_tag is None:
            try:
                names = manifest_names(agent_dir)
            except OSError:
                return False
        else:
            names = [manifest_name(model_tag), LEGACY_MANIFEST]
        return any(regular_file_size(agent_dir / name) is not None for name in names)

    def delete(self, agent_id: str) -> None:
        """Forget ``agent_id``'s caches, every model's (their blocks go at the next :meth:`collect_garbage`)."""
        agent_dir = self._agent_dir(agent_id)
        try:
            info = os.lstat(agent_dir)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            remove_file(agent_dir)
            return
        manifests = [
            agent_dir / name
            for name in manifest_names(agent_dir)
            if regular_file_size(agent_dir / name) is not None
        ]
        if manifests:
            # Without its manifests the agent is gone, even if a crash follows.
            for path in manifests:
                remove_file(path)
            if self._fsync:
                fsync_dir(agent_dir)
        shutil.rmtree(agent_dir)
        if self._fsync:
            fsync_dir(self._agents)

    def list_agents(self) -> list[AgentEntry]:
        """Every stored cache with a readable manifest: one per agent and model, sorted by id then tag.

        Unreadable manifests are logged and skipped; a pre-per-model
        ``manifest.json`` is listed unless its model has saved since.
        """
        entries = []
        for agent_dir in self._subdirs(self._agents):
            try:
                listings = read_listings(agent_dir)
            except OSError as exc:
                log.warning("skipping unreadable agent directory %s: %s", agent_dir, exc)
                continue
            current = {listing.name for listing in listings}
            for listing in listings:
                manifest = listing.manifest
                path = agent_dir / listing.name
                if manifest is None:
                    log.warning("skipping unreadable manifest %s: %s", path, listing.problem)
                    continue
                if safe_agent_dirname(manifest.agent_id) != agent_dir.name:
                    log.warning("skipping manifest %s: it names agent %r", path, manifest.agent_id)
                    continue
                if listing.name == LEGACY_MANIFEST and manifest_name(manifest.model_tag) in current:
                    continue  # superseded; the save that wrote its successor was cut short
                disk_bytes = (
                    listing.size + manifest.state.size + sum(piece.size for piece in manifest.pieces)
                )
                entries.append(
                    AgentEntry(
                        agent_id=manifest.agent_id,
                        model_tag=manifest.model_tag,
                        num_tokens=manifest.num_tokens,
                        disk_bytes=disk_bytes,
                        updated_at=manifest.updated_at,
                    )
                )
        return sorted(entries, key=lambda entry: (entry.agent_id, entry.model_tag))

    def collect_garbage(self) -> int:
        """Remove blocks no manifest references, orphan agent files and temp files.

        Every manifest of every agent counts, whatever its model. Manifests of
        another format version keep the blocks and the agent files they list;
        if such a manifest has a layout this version cannot read, or a
        manifest cannot be read at all, no block is removed. An undecodable
        manifest of this version references nothing: its cache cannot load
        anyway.

        Returns:
            The number of files removed.
        """
        removed = self._remove_temp_files()
        referenced: set[str] = set()
        keep_all_blocks = False
        for agent_dir in self._subdirs(self._agents):
            try:
                listings = read_listings(agent_dir)
            except OSError as exc:
                log.warning("cannot read %s: %s; keeping every block", agent_dir, exc)
                keep_all_blocks = True
                continue
            if not listings:  # a first save that never reached its manifest
                removed += self._files.remove_own_files(agent_dir, keep=())
                with contextlib.suppress(OSError):
                    agent_dir.rmdir()
                continue
            for listing in listings:
                if listing.blocks is None:
                    log.warning(
                        "manifest %s has an unknown layout; keeping every block",
                        agent_dir / listing.name,
                    )
                    keep_all_blocks = True
                else:
                    referenced.update(listing.blocks)
            kept = kept_files(listings)
            if kept is not None:
                removed += self._files.remove_own_files(agent_dir, keep=kept)
        if keep_all_blocks:
            return removed
        for shard in self._subdirs(self._blocks):
            for name in os.listdir(shard):
                if (
                    BLOCK_NAME.fullmatch(name)
                    and name.removesuffix(".safetensors") not in referenced
                ):
                    removed += remove_file(shard / name)
        return removed

    def block_hashes(self, model_tag: str, token_ids: Sequence[int]) -> list[str]:
        """Chain hashes of the full blocks of ``token_ids`` (for shared-prefix lookups)."""
        return block_chain_hashes(model_tag, token_ids)


def _manifest_data(agent_dir: Path, model_tag: str) -> bytes | None:
    """The bytes of the agent's manifest for ``model_tag``, else of its pre-per-model one, else None.

    Raises:
        OSError: a manifest is there but cannot be read.
    """
    data = read_regular_file(agent_dir / manifest_name(model_tag))
    if data is None:
        data = read_regular_file(agent_dir / LEGACY_MANIFEST)
    return data
