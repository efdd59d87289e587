"""Piece files on disk: writing blocks, segments and state files, checking and reading them.

The mechanism under :class:`runtime.persist.CacheDirectory` (which decides
what to write, with :mod:`runtime.persist_plan`, and owns manifests). Every
write goes through :func:`runtime.persist_files.write_atomic`; a file already
on disk with the right content is not written again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import CorruptCacheError
from runtime.persist_files import (
    ensure_private_dir,
    read_header,
    read_regular_file,
    regular_file_size,
    remove_file,
    write_atomic,
)
from runtime.persist_format import (
    AGENT_FILE_NAME,
    BlockPiece,
    Piece,
    SegmentPiece,
    StateRef,
    encode_block,
    encode_segment,
    piece_tensors,
    read_metadata,
    segment_name,
    state_name,
)
from runtime.persist_load import block_is_intact, sha256_hex
from runtime.persist_plan import PieceKind, PieceRange
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot

__all__ = ["WriteTally", "PieceFiles"]

log = logging.getLogger("kvmem.persist")


@dataclass
class WriteTally:
    """What a save has written so far."""

    block_bytes: int = 0
    own_bytes: int = 0
    blocks_written: int = 0
    segments_written: int = 0
    tokens_written: int = 0


class PieceFiles:
    """Block files under ``blocks_dir`` and agent files in agent directories.

    Args:
        blocks_dir: the cache directory's ``blocks/``.
        fsync: fsync files and directories on write.
    """

    def __init__(self, blocks_dir: Path, *, fsync: bool) -> None:
        self._blocks = blocks_dir
        self._fsync = fsync

    def block_path(self, block_hash: str) -> Path:
        return self._blocks / block_hash[:2] / f"{block_hash}.safetensors"

    def path(self, agent_dir: Path, piece: Piece) -> Path:
        if isinstance(piece, BlockPiece):
            return self.block_path(piece.name)
        return agent_dir / piece.name

    # -- write ---------------------------------------------------------------

    def is_intact(self, agent_dir: Path, piece: Piece) -> bool:
        """Whether a piece a previous manifest lists is still that piece on disk.

        Checks the file's size and its header (a small read): a block's tensor
        digest, so a block that another agent's save replaced with other bits
        is noticed and adopted; a segment's range. Damage to the data alone is
        caught by :meth:`read_verified`, which removes the damaged file.
        """
        header = read_header(self.path(agent_dir, piece), size=piece.size)
        if header is None:
            return False
        try:
            info = read_metadata(header)
        except ValueError:
            return False
        if isinstance(piece, BlockPiece):
            return info.get("tensor_sha256") == piece.tensor_sha256
        return (info.get("kind"), info.get("start"), info.get("end")) == (
            "segment",
            str(piece.start),
            str(piece.end),
        )

    def write(
        self,
        agent_dir: Path,
        snapshot: CacheSnapshot,
        chain: list[str],
        piece_range: PieceRange,
        tally: WriteTally,
    ) -> Piece:
        """Store tokens ``piece_range`` of ``snapshot`` as a block or segment; return the piece."""
        start, end = piece_range.start, piece_range.end
        tensors = piece_tensors(snapshot.layers, start, end)
        piece: Piece
        if piece_range.kind is PieceKind.BLOCK:
            piece, written = self._store_block(
                tensors,
                model_tag=snapshot.model_tag,
                block_hash=chain[start // BLOCK_TOKENS],
                start=start,
            )
            tally.block_bytes += written
            tally.blocks_written += written > 0
        else:
            data = encode_segment(
                tensors, model_tag=snapshot.model_tag, start=start, end=end
            )
            sha = sha256_hex(data)
            piece = SegmentPiece(
                name=segment_name(sha), start=start, end=end, sha256=sha, size=len(data)
            )
            written = self._store_own_file(agent_dir / piece.name, data)
            tally.own_bytes += written
            tally.segments_written += written > 0
        tally.tokens_written += (end - start) if written else 0
        return piece

    def write_state(self, agent_dir: Path, data: bytes, tally: WriteTally) -> StateRef:
        """Store the state file ``data`` (unless already there); return its ref."""
        sha = sha256_hex(data)
        state = StateRef(name=state_name(sha), sha256=sha, size=len(data))
        tally.own_bytes += self._store_own_file(agent_dir / state.name, data)
        return state

    def _store_block(
        self,
        tensors: dict[str, np.ndarray],
        *,
        model_tag: str,
        block_hash: str,
        start: int,
    ) -> tuple[BlockPiece, int]:
        """Make sure the block is on disk; return its piece and the bytes written.

        A block file for the same tokens that is already there intact is kept
        even if its bits differ from ours (the same model can compute the same
        prefix slightly differently, e.g. batched vs alone); a damaged one is
        replaced.
        """
        data, digest = encode_block(tensors, model_tag=model_tag, block_hash=block_hash)

        def piece(content: bytes, content_digest: str) -> BlockPiece:
            return BlockPiece(
                name=block_hash,
                start=start,
                end=start + BLOCK_TOKENS,
                sha256=sha256_hex(content),
                size=len(content),
                tensor_sha256=content_digest,
            )

        path = self.block_path(block_hash)
        existing = read_regular_file(path)
        if existing is not None:
            if existing == data:
                return piece(data, digest), 0
            if block_is_intact(
                existing, model_tag=model_tag, block_hash=block_hash, like=tensors
            ):
                log.debug("reusing block %s whose bits differ from ours", block_hash)
                return piece(existing, read_metadata(existing)["tensor_sha256"]), 0
            log.warning("block %s on disk is damaged; rewriting it", block_hash)
        ensure_private_dir(path.parent, fsync=self._fsync)
        write_atomic(path, data, fsync=self._fsync)
        return piece(data, digest), len(data)

    def _store_own_file(self, path: Path, data: bytes) -> int:
        """Write a content-named agent file unless it is there, intact; return the bytes written."""
        if regular_file_size(path) == len(data) and read_regular_file(path) == data:
            return 0
        write_atomic(path, data, fsync=self._fsync)
        return len(data)

    @staticmethod
    def remove_own_files(agent_dir: Path, *, keep: Collection[str]) -> int:
        """Remove segment, state and format-1 tail files of ``agent_dir`` not in ``keep``."""
        removed = 0
        try:
            names = os.listdir(agent_dir)
        except OSError:
            return 0
        for name in names:
            if AGENT_FILE_NAME.fullmatch(name) and name not in keep:
                removed += remove_file(agent_dir / name)
        return removed

    # -- read ----------------------------------------------------------------

    def read_verified(self, agent_dir: Path, piece: Piece, *, model_tag: str) -> bytes:
        """The bytes of ``piece``'s file if they have its size and SHA-256, else CorruptCacheError."""
        if isinstance(piece, BlockPiece):
            return self._read_verified(
                self.block_path(piece.name),
                piece.sha256,
                piece.size,
                model_tag=model_tag,
                block_hash=piece.name,
            )
        return self._read_verified(agent_dir / piece.name, piece.sha256, piece.size)

    def read_state(self, agent_dir: Path, state: StateRef) -> bytes:
        """The bytes of the state file if they have its size and SHA-256, else CorruptCacheError."""
        return self._read_verified(agent_dir / state.name, state.sha256, state.size)

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

        A file that fails its own check is removed, so that the next save
        rewrites it instead of trusting it: a block by its header's digest, an
        agent file (``<kind>-<sha256>.safetensors``) by the hash in its name.
        """
        raw = read_regular_file(path)
        if raw is None:
            raise CorruptCacheError(f"{path.name} is missing")
        actual = sha256_hex(raw)
        if len(raw) == size and actual == sha256:
            return raw
        if model_tag is None or block_hash is None:
            damaged = not path.name.endswith(f"-{actual}.safetensors")
        else:
            damaged = not block_is_intact(
                raw, model_tag=model_tag, block_hash=block_hash, like=None
            )
        if damaged:
            log.warning("removing damaged cache file %s", path)
            remove_file(path)
        raise CorruptCacheError(
            f"{path.name}: size or checksum differs from the manifest"
        )
