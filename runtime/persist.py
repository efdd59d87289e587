"""The warm tier: agents' KV caches in a directory, at block granularity.

:class:`CacheDirectory` is the only code that touches a cache directory. Layout::

    root/
      blocks/<hh>/<hash>.safetensors       one immutable file per full 256-token block
      agents/<dir>/manifest.json           what the agent's cache is made of
      agents/<dir>/tail-<sha256>.safetensors  partial last block + sliding layers

* A **block** holds every blocked (full-attention) layer's arrays for one
  256-token block, as tensors ``L{layer}.{key}``. ``<hash>`` is a hash chain
  over (format version, model tag, previous block's hash, the block's token
  ids), so agents that share a prefix share its block files; a block is
  written once and never modified. Its metadata carries a digest of its
  tensors, so a block can be checked without a manifest.
* The **tail** holds the last ``num_tokens % 256`` tokens of the blocked layers
  (zero-length arrays still record shapes and dtypes) and the whole arrays of
  sliding layers. It is named by its content hash, so a new tail never
  overwrites the one the current manifest points to.
* The **manifest** (JSON, :class:`runtime.persist_format.Manifest`) records
  format version, model tag, agent id, covered text, token ids and offsets
  (base64 int32), each block's hash, file SHA-256, size and tensor digest,
  the tail's name, SHA-256 and size, layer kinds and keys, meta, and
  created/updated times. It grows
  with the conversation (text plus ~10.7 bytes per token) and is rewritten on
  every save.
* ``<dir>`` is :func:`safe_agent_dirname` of the agent id.

A save writes new blocks and the tail first, then replaces the manifest
atomically (temp file, fsync, rename, fsync dir), then removes the previous
tail. A kill at any point leaves the old manifest with everything it needs, or
the new one. A turn that extends a cache writes only its new full blocks, the
new tail and the manifest. Loads verify sizes, checksums, the hash chain and
every shape against the manifest, and turn any problem into a
:class:`~runtime.errors.CacheMiss` (logged), never an uncaught error.

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

from runtime.errors import CacheMiss, CorruptCacheError, FormatVersionError
from runtime.persist_files import (
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
    TAIL_NAME,
    BlockRef,
    LayerRecord,
    Manifest,
    TailRef,
    block_chain_hashes,
    block_tensors,
    encode_tensors,
    pack_int32,
    read_metadata,
    tail_tensors,
    tensor_digest,
    validate_snapshot,
)
from runtime.persist_load import (
    assemble_snapshot,
    block_is_intact,
    check_manifest,
    decode_block_list,
    decode_manifest,
    sha256_hex,
)
from runtime.persist_names import safe_agent_dirname
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot, LayerSnapshot

__all__ = [
    "FORMAT_VERSION",
    "safe_agent_dirname",
    "SaveReport",
    "AgentEntry",
    "CacheDirectory",
]

log = logging.getLogger("kvmem.persist")

MANIFEST_NAME = "manifest.json"

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class SaveReport:
    """What one :meth:`CacheDirectory.save` wrote.

    ``bytes_written == block bytes written + tail_bytes + manifest_bytes``;
    ``tail_bytes`` is 0 when the tail file was already there, identical.
    """

    bytes_written: int
    blocks_written: int
    blocks_reused: int
    tail_bytes: int
    manifest_bytes: int


@dataclass(frozen=True)
class AgentEntry:
    """One stored agent, as listed by :meth:`CacheDirectory.list_agents`.

    ``disk_bytes`` counts the manifest, the tail and every referenced block in
    full, including blocks shared with other agents.
    """

    agent_id: str
    model_tag: str
    num_tokens: int
    disk_bytes: int
    updated_at: float


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
        removed = self._remove_temp_files()
        if removed:
            log.info("removed %d temporary files left by an interrupted save", removed)

    # -- paths ---------------------------------------------------------------

    def _agent_dir(self, agent_id: str) -> Path:
        return self._agents / safe_agent_dirname(agent_id)

    def _block_path(self, block_hash: str) -> Path:
        return self._blocks / block_hash[:2] / f"{block_hash}.safetensors"

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
        """Store ``snapshot`` as ``agent_id``'s cache, replacing the previous one.

        Blocks already on disk (from this agent's previous save or any other
        agent with the same prefix) are not written again. A block file for the
        same tokens that already exists intact is reused even if its bits
        differ from this snapshot's (the same model can produce slightly
        different floats for the same prefix, e.g. batched vs alone); a damaged
        one is replaced.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
            ValueError: the snapshot is inconsistent (lengths, shapes, dtypes).
            OSError: the disk refused a write; the previous cache is untouched.
        """
        agent_dir = self._agent_dir(agent_id)
        validate_snapshot(snapshot)
        model_tag = snapshot.model_tag
        packed_ids = pack_int32(snapshot.token_ids)
        packed_offsets = pack_int32(snapshot.offsets)
        hashes = block_chain_hashes(model_tag, snapshot.token_ids)
        previous = self._read_manifest_quietly(agent_dir)
        inherited = (
            {ref.hash: ref for ref in previous.blocks} if previous is not None else {}
        )
        ensure_private_dir(agent_dir, fsync=self._fsync)

        refs: list[BlockRef] = []
        block_bytes = blocks_written = 0
        for index, block_hash in enumerate(hashes):
            ref = inherited.get(block_hash)
            if ref is None or not self._still_on_disk(ref):
                ref, written = self._store_block(
                    model_tag, block_hash, snapshot.layers, index
                )
                block_bytes += written
                blocks_written += written > 0
            refs.append(ref)
        tail, tail_bytes = self._store_tail(agent_dir, snapshot, len(hashes))

        now = time.time()
        created_at = now
        if previous is not None and previous.model_tag == model_tag:
            created_at = previous.created_at
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            model_tag=model_tag,
            agent_id=agent_id,
            num_tokens=snapshot.num_tokens,
            text=snapshot.text,
            token_ids=packed_ids,
            offsets=packed_offsets,
            blocks=refs,
            tail=tail,
            layers=[
                LayerRecord(kind=layer.kind, keys=list(layer.arrays))
                for layer in snapshot.layers
            ],
            meta=dict(snapshot.meta),
            created_at=created_at,
            updated_at=now,
        )
        manifest_data = _encoder.encode(manifest)
        write_atomic(agent_dir / MANIFEST_NAME, manifest_data, fsync=self._fsync)
        self._remove_tails(agent_dir, keep=tail.name)
        return SaveReport(
            bytes_written=block_bytes + tail_bytes + len(manifest_data),
            blocks_written=blocks_written,
            blocks_reused=len(hashes) - blocks_written,
            tail_bytes=tail_bytes,
            manifest_bytes=len(manifest_data),
        )

    def _store_block(
        self,
        model_tag: str,
        block_hash: str,
        layers: Sequence[LayerSnapshot],
        index: int,
    ) -> tuple[BlockRef, int]:
        """Make sure block ``index`` is on disk; return its ref and the bytes written."""
        tensors = block_tensors(
            layers, index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS
        )
        digest = tensor_digest(tensors)
        info = {
            "kind": "block",
            "format_version": str(FORMAT_VERSION),
            "model_tag": model_tag,
            "block_hash": block_hash,
            "tensor_sha256": digest,
        }
        data = encode_tensors(tensors, info)
        ref = BlockRef(
            hash=block_hash,
            sha256=sha256_hex(data),
            size=len(data),
            tensor_sha256=digest,
        )
        path = self._block_path(block_hash)
        existing = read_regular_file(path)
        if existing is not None:
            if sha256_hex(existing) == ref.sha256:
                return ref, 0
            if block_is_intact(
                existing, model_tag=model_tag, block_hash=block_hash, like=tensors
            ):
                log.debug("reusing block %s whose bits differ from ours", block_hash)
                return BlockRef(
                    hash=block_hash,
                    sha256=sha256_hex(existing),
                    size=len(existing),
                    tensor_sha256=read_metadata(existing)["tensor_sha256"],
                ), 0
            log.warning("block %s on disk is damaged; rewriting it", block_hash)
        ensure_private_dir(path.parent, fsync=self._fsync)
        write_atomic(path, data, fsync=self._fsync)
        return ref, len(data)

    def _still_on_disk(self, ref: BlockRef) -> bool:
        """Whether a block the previous manifest lists is still that block.

        Checks size and the tensor digest in the block's header (a small read),
        so a block that was damaged and rewritten with other bits since is
        noticed; damage to the data alone is caught by :meth:`load`, which
        removes such a block.
        """
        header = read_header(self._block_path(ref.hash), size=ref.size)
        if header is None:
            return False
        try:
            info = read_metadata(header)
        except ValueError:
            return False
        return info.get("tensor_sha256") == ref.tensor_sha256

    def _store_tail(
        self, agent_dir: Path, snapshot: CacheSnapshot, num_blocks: int
    ) -> tuple[TailRef, int]:
        """Write the tail unless identical; return its ref and the bytes written."""
        start = num_blocks * BLOCK_TOKENS
        info = {
            "kind": "tail",
            "format_version": str(FORMAT_VERSION),
            "model_tag": snapshot.model_tag,
            "tokens": str(snapshot.num_tokens - start),
        }
        data = encode_tensors(tail_tensors(snapshot.layers, start), info)
        sha = sha256_hex(data)
        tail = TailRef(name=f"tail-{sha}.safetensors", sha256=sha, size=len(data))
        path = agent_dir / tail.name
        if regular_file_size(path) == tail.size:
            on_disk = read_regular_file(path)
            if on_disk is not None and sha256_hex(on_disk) == sha:
                return tail, 0
        write_atomic(path, data, fsync=self._fsync)
        return tail, len(data)

    def _read_manifest_quietly(self, agent_dir: Path) -> Manifest | None:
        try:
            data = read_regular_file(agent_dir / MANIFEST_NAME)
            return None if data is None else decode_manifest(data)
        except (OSError, CacheMiss):
            return None

    def _remove_tails(self, agent_dir: Path, *, keep: str | None) -> int:
        removed = 0
        try:
            names = os.listdir(agent_dir)
        except OSError:
            return 0
        for name in names:
            if TAIL_NAME.fullmatch(name) and name != keep:
                removed += remove_file(agent_dir / name)
        return removed

    # -- load ----------------------------------------------------------------

    def load(self, agent_id: str, *, model_tag: str) -> CacheSnapshot:
        """Read and fully verify ``agent_id``'s cache.

        Returns:
            A snapshot bit-identical to the one saved (up to a reused block, see
            :meth:`save`).

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
            CacheMiss: no cache is stored for ``agent_id``.
            FormatVersionError: written by another version of the format.
            ForeignModelError: made by another model than ``model_tag``.
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
        data = read_regular_file(agent_dir / MANIFEST_NAME)
        if data is None:
            raise CacheMiss(f"no cache stored for agent {agent_id!r}")
        manifest = decode_manifest(data)
        token_ids, offsets = check_manifest(
            manifest, agent_id=agent_id, model_tag=model_tag
        )
        tail = self._read_verified(
            agent_dir / manifest.tail.name, manifest.tail.sha256, manifest.tail.size
        )

        def read_block(ref: BlockRef) -> bytes:
            return self._read_verified(
                self._block_path(ref.hash),
                ref.sha256,
                ref.size,
                model_tag=model_tag,
                block_hash=ref.hash,
            )

        return assemble_snapshot(
            manifest, token_ids, offsets, tail=tail, read_block=read_block
        )

    def _read_verified(
        self,
        path: Path,
        sha256: str,
        size: int,
        *,
        model_tag: str | None = None,
        block_hash: str | None = None,
    ) -> bytes:
        """The bytes of ``path`` if they have ``size`` and ``sha256``, else CorruptCacheError.

        A block file that fails its own digest too is removed, so that the
        next save rewrites it instead of trusting it.
        """
        raw = read_regular_file(path)
        if raw is None:
            raise CorruptCacheError(f"{path.name} is missing")
        if len(raw) == size and sha256_hex(raw) == sha256:
            return raw
        if (
            model_tag is not None
            and block_hash is not None
            and not block_is_intact(
                raw, model_tag=model_tag, block_hash=block_hash, like=None
            )
        ):
            log.warning("removing damaged block file %s", path)
            remove_file(path)
        raise CorruptCacheError(
            f"{path.name}: size or checksum differs from the manifest"
        )

    # -- other operations ----------------------------------------------------

    def exists(self, agent_id: str) -> bool:
        """Whether a manifest is stored for ``agent_id`` (not whether it loads).

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache (as every method).
        """
        return regular_file_size(self._agent_dir(agent_id) / MANIFEST_NAME) is not None

    def delete(self, agent_id: str) -> None:
        """Forget ``agent_id``'s cache (its blocks go at the next :meth:`collect_garbage`)."""
        agent_dir = self._agent_dir(agent_id)
        try:
            info = os.lstat(agent_dir)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(info.st_mode):
            remove_file(agent_dir)
            return
        manifest = agent_dir / MANIFEST_NAME
        if regular_file_size(manifest) is not None:
            # Without its manifest the agent is gone, even if a crash follows.
            remove_file(manifest)
            if self._fsync:
                fsync_dir(agent_dir)
        shutil.rmtree(agent_dir)
        if self._fsync:
            fsync_dir(self._agents)

    def list_agents(self) -> list[AgentEntry]:
        """Every agent with a readable manifest, sorted by id (unreadable ones are logged)."""
        entries = []
        for agent_dir in self._subdirs(self._agents):
            manifest_path = agent_dir / MANIFEST_NAME
            try:
                data = read_regular_file(manifest_path)
                if data is None:
                    continue
                manifest = decode_manifest(data)
                if safe_agent_dirname(manifest.agent_id) != agent_dir.name:
                    raise CorruptCacheError(
                        f"manifest names agent {manifest.agent_id!r}"
                    )
            except (OSError, CacheMiss, ValueError) as exc:
                log.warning("skipping unreadable manifest %s: %s", manifest_path, exc)
                continue
            disk_bytes = (
                len(data)
                + manifest.tail.size
                + sum(ref.size for ref in manifest.blocks)
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
        return sorted(entries, key=lambda entry: entry.agent_id)

    def collect_garbage(self) -> int:
        """Remove blocks no manifest references, orphan tails and temp files.

        Manifests of another format version keep the blocks they list; if such
        a manifest has a layout this version cannot read, or a manifest cannot
        be read at all, no block is removed. An undecodable manifest of this
        version references nothing: its cache cannot load anyway.

        Returns:
            The number of files removed.
        """
        removed = self._remove_temp_files()
        referenced: set[str] = set()
        keep_all_blocks = False
        for agent_dir in self._subdirs(self._agents):
            data = None
            try:
                data = read_regular_file(agent_dir / MANIFEST_NAME)
            except OSError as exc:
                log.warning("cannot read %s: %s; keeping every block", agent_dir, exc)
                keep_all_blocks = True
                continue
            if data is None:  # a first save that never reached its manifest
                removed += self._remove_tails(agent_dir, keep=None)
                with contextlib.suppress(OSError):
                    agent_dir.rmdir()
                continue
            try:
                manifest = decode_manifest(data)
            except FormatVersionError:
                listed = decode_block_list(data)
                if listed is None:
                    log.warning(
                        "manifest in %s has an unknown layout; keeping every block",
                        agent_dir,
                    )
                    keep_all_blocks = True
                else:
                    referenced.update(listed)
                continue
            except CorruptCacheError:
                continue
            referenced.update(ref.hash for ref in manifest.blocks)
            removed += self._remove_tails(agent_dir, keep=manifest.tail.name)
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
