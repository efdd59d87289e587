"""Piece files on disk: writing blocks, segments and state files, checking and reading them.

The mechanism under :class:`runtime.persist.CacheDirectory` (which decides
what to write, with :mod:`runtime.persist_plan`, and owns manifests). Every
write goes through :func:`runtime.persist_files.write_atomic`; a file already
on disk with the right content is not written again. Consecutive whole blocks
are encoded together and read back together (:mod:`runtime.persist_codec`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from runtime.errors import CorruptCacheError
from runtime.persist_codec import (
    FileLayout,
    ParsedFile,
    data_is_intact,
    encode_run,
    header_sha256,
    parse_file,
)
from runtime.persist_files import (
    AtomicBatch,
    open_regular_file,
    read_exactly_into,
    read_header,
    read_regular_file,
    regular_file_size,
    remove_file,
)
from runtime.persist_format import (
    AGENT_FILE_NAME,
    BlockPiece,
    Piece,
    SegmentPiece,
    StateRef,
    block_info,
    blocked_sources,
    piece_layout,
    segment_info,
    segment_name,
    state_name,
)
from runtime.persist_load import block_is_intact
from runtime.persist_plan import PieceKind, PieceRange
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot

__all__ = ["WriteTally", "PieceFiles", "AgentPieces", "MAX_RUN_BLOCKS"]

log = logging.getLogger("kvmem.persist")

MAX_RUN_BLOCKS = 16
"""Blocks encoded in one buffer by a save (bounds its extra memory to ~16 blocks)."""


@dataclass
class WriteTally:
    """What a save has written so far."""

    block_bytes: int = 0
    own_bytes: int = 0
    blocks_written: int = 0
    segments_written: int = 0
    tokens_written: int = 0


def _runs(ranges: Sequence[PieceRange]) -> list[list[PieceRange]]:
    """``ranges`` cut into runs of adjacent blocks (at most MAX_RUN_BLOCKS) and single segments."""
    runs: list[list[PieceRange]] = []
    for piece_range in ranges:
        last = runs[-1] if runs else None
        if (
            last is not None
            and piece_range.kind is PieceKind.BLOCK
            and last[-1].kind is PieceKind.BLOCK
            and last[-1].end == piece_range.start
            and len(last) < MAX_RUN_BLOCKS
        ):
            last.append(piece_range)
        else:
            runs.append([piece_range])
    return runs


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

        Checks the file's size and its checksum, the SHA-256 of its header (a
        small read), so a block that another agent's save replaced with other
        bits is noticed and adopted, and a segment's range. Damage to the data alone is caught by
        :meth:`read_pieces`, which removes the damaged file.
        """
        header = read_header(self.path(agent_dir, piece), size=piece.size)
        if header is None or header_sha256(header) != piece.sha256:
            return False
        if isinstance(piece, BlockPiece):
            return True
        info = parse_file(header, size=piece.size).info
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
        ranges: Sequence[PieceRange],
        tally: WriteTally,
        batch: AtomicBatch,
    ) -> list[Piece]:
        """Store tokens ``ranges`` of ``snapshot`` as blocks and segments in ``batch``; return the pieces in order."""
        sources = blocked_sources(snapshot.layers)
        layouts = {name: (array.dtype, array.shape) for name, array in sources.items()}
        pieces: list[Piece] = []
        for run in _runs(ranges):
            start, tokens = run[0].start, run[0].end - run[0].start
            layout = piece_layout(layouts, tokens)
            if run[0].kind is PieceKind.BLOCK:
                hashes = [chain[r.start // BLOCK_TOKENS] for r in run]
                files = encode_run(
                    sources,
                    layout,
                    start=start,
                    count=len(run),
                    tokens=tokens,
                    info=lambda i, hashes=hashes: block_info(  # type: ignore[misc]
                        model_tag=snapshot.model_tag, block_hash=hashes[i]
                    ),
                )
                for piece_range, block_hash, file in zip(run, hashes, files, strict=True):
                    piece, written = self._store_block(
                        file,
                        layout,
                        model_tag=snapshot.model_tag,
                        block_hash=block_hash,
                        start=piece_range.start,
                        batch=batch,
                    )
                    pieces.append(piece)
                    tally.block_bytes += written
                    tally.blocks_written += written > 0
                    tally.tokens_written += tokens if written else 0
                continue
            end = run[0].end
            info = segment_info(model_tag=snapshot.model_tag, start=start, end=end)
            (file,) = encode_run(
                sources,
                layout,
                start=start,
                count=1,
                tokens=tokens,
                info=lambda _, info=info: info,  # type: ignore[misc]
            )
            sha = header_sha256(file)
            pieces.append(
                SegmentPiece(
                    name=segment_name(sha), start=start, end=end, sha256=sha, size=len(file)
                )
            )
            written = self._store_own_file(agent_dir / segment_name(sha), file, batch)
            tally.own_bytes += written
            tally.segments_written += written > 0
            tally.tokens_written += tokens if written else 0
        return pieces

    def write_state(
        self, agent_dir: Path, data: bytes, tally: WriteTally, batch: AtomicBatch
    ) -> StateRef:
        """Store the state file ``data`` in ``batch`` (unless already there); return its ref."""
        sha = header_sha256(data)
        state = StateRef(name=state_name(sha), sha256=sha, size=len(data))
        tally.own_bytes += self._store_own_file(agent_dir / state.name, data, batch)
        return state

    def _store_block(
        self,
        file: memoryview,
        layout: FileLayout,
        *,
        model_tag: str,
        block_hash: str,
        start: int,
        batch: AtomicBatch,
    ) -> tuple[BlockPiece, int]:
        """Make sure the block is on disk; return its piece and the bytes written.

        A block file for the same tokens that is already there intact is kept
        even if its bits differ from ours (the same model can compute the same
        prefix slightly differently, e.g. batched vs alone); a damaged one is
        replaced.
        """

        def piece(content: memoryview | bytes) -> BlockPiece:
            return BlockPiece(
                name=block_hash,
                start=start,
                end=start + BLOCK_TOKENS,
                sha256=header_sha256(content),
                size=len(content),
            )

        path = self.block_path(block_hash)
        existing = read_regular_file(path)
        if existing is not None:
            if existing == file:
                return piece(file), 0
            if block_is_intact(
                existing, model_tag=model_tag, block_hash=block_hash, like=layout
            ):
                log.debug("reusing block %s whose bits differ from ours", block_hash)
                return piece(existing), 0
            log.warning("block %s on disk is damaged; rewriting it", block_hash)
        batch.ensure_dir(path.parent)
        batch.write(path, file)
        return piece(file), len(file)

    @staticmethod
    def _store_own_file(path: Path, data: memoryview | bytes, batch: AtomicBatch) -> int:
        """Write a content-named agent file unless it is there, intact; return the bytes written."""
        if regular_file_size(path) == len(data) and read_regular_file(path) == data:
            return 0
        batch.write(path, data)
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

    def reader(self, agent_dir: Path, *, model_tag: str) -> AgentPieces:
        """The files of one agent's pieces, as :func:`~runtime.persist_load.assemble_snapshot` reads them."""
        return AgentPieces(self, agent_dir, model_tag)

    def prefetch(self, agent_dir: Path, pieces: Sequence[Piece]) -> None:
        """Have the kernel start reading the files of ``pieces`` ahead (missing ones are skipped)."""
        for piece in pieces:
            fd = open_regular_file(self.path(agent_dir, piece), size=piece.size)
            if fd is not None:
                os.close(fd)

    def read_into(
        self,
        agent_dir: Path,
        piece: Piece,
        header: bytearray,
        regions: list[memoryview],
        *,
        model_tag: str,
    ) -> ParsedFile:
        """Read ``piece``'s file into ``header`` then ``regions`` (scattered, in file order).

        The file must be exactly as long as they are together, and ``header``
        must hold exactly its header, with the checksum the manifest records;
        otherwise the file is handled as :meth:`reject` says. The data is not
        checked here: the caller checks its CRC (regions may lie anywhere, in
        the arrays the data belongs in, so it is read without a copy).
        """
        fd = open_regular_file(self.path(agent_dir, piece), size=piece.size)
        if fd is None:
            self.reject(agent_dir, piece, model_tag=model_tag)
        try:
            complete = read_exactly_into(fd, [memoryview(header), *regions])
        finally:
            os.close(fd)
        if not complete:
            self.reject(agent_dir, piece, model_tag=model_tag)
        try:
            parsed = parse_file(header, size=piece.size)
        except ValueError:
            self.reject(agent_dir, piece, model_tag=model_tag)
        if parsed.data_start != len(header) or parsed.header_sha256 != piece.sha256:
            self.reject(agent_dir, piece, model_tag=model_tag)
        return parsed

    def read_state(self, agent_dir: Path, state: StateRef) -> tuple[bytes, ParsedFile]:
        """The bytes of the state file and its parsed header, if they match ``state``, else CorruptCacheError."""
        fd = open_regular_file(agent_dir / state.name, size=state.size)
        data = bytearray(state.size)
        try:
            if fd is None or not read_exactly_into(fd, [memoryview(data)]):
                self.reject(agent_dir, state)
        finally:
            if fd is not None:
                os.close(fd)
        parsed = self._parsed(agent_dir, state, data)
        if not data_is_intact(data, parsed):
            self.reject(agent_dir, state)
        return bytes(data), parsed

    def _parsed(
        self,
        agent_dir: Path,
        ref: Piece | StateRef,
        data: memoryview | bytearray,
        *,
        model_tag: str | None = None,
    ) -> ParsedFile:
        """The parsed header of ``data`` if it has ``ref``'s checksum (the data is not checked)."""
        try:
            parsed = parse_file(data)
        except ValueError:
            self.reject(agent_dir, ref, model_tag=model_tag)
        if parsed.header_sha256 != ref.sha256:
            self.reject(agent_dir, ref, model_tag=model_tag)
        return parsed

    def reject(
        self, agent_dir: Path, ref: Piece | StateRef, *, model_tag: str | None = None
    ) -> NoReturn:
        """Raise CorruptCacheError for a file that does not match ``ref``, removing it if damaged.

        A file that fails its own check is removed, so that the next save
        rewrites it instead of trusting it: a block by its header's metadata
        and data CRC, an agent file (``<kind>-<sha256>.safetensors``) by the
        checksum in its name and the CRC of its data. A file that is intact
        but not the one the manifest lists stays.
        """
        path = (
            agent_dir / ref.name if isinstance(ref, StateRef) else self.path(agent_dir, ref)
        )
        raw = read_regular_file(path)
        if raw is None:
            raise CorruptCacheError(f"{path.name} is missing")
        if isinstance(ref, BlockPiece) and model_tag is not None:
            damaged = not block_is_intact(
                raw, model_tag=model_tag, block_hash=ref.name, like=None
            )
        else:
            damaged = not _agent_file_is_intact(path.name, raw)
        if damaged:
            log.warning("removing damaged cache file %s", path)
            remove_file(path)
        raise CorruptCacheError(
            f"{path.name}: size or checksum differs from the manifest"
        )


def _agent_file_is_intact(name: str, raw: bytes) -> bool:
    """Whether an agent file has the checksum its name records and the data its header does."""
    try:
        parsed = parse_file(raw)
    except ValueError:
        return False
    return name.endswith(f"-{parsed.header_sha256}.safetensors") and data_is_intact(
        raw, parsed
    )


@dataclass(frozen=True)
class AgentPieces:
    """:class:`PieceFiles` bound to one agent directory and model (a :class:`~runtime.persist_load.PieceReader`)."""

    files: PieceFiles
    agent_dir: Path
    model_tag: str

    def prefetch(self, pieces: Sequence[Piece]) -> None:
        self.files.prefetch(self.agent_dir, pieces)

    def read_into(
        self, piece: Piece, header: bytearray, regions: list[memoryview]
    ) -> ParsedFile:
        return self.files.read_into(
            self.agent_dir, piece, header, regions, model_tag=self.model_tag
        )

    def reject(self, piece: Piece) -> NoReturn:
        self.files.reject(self.agent_dir, piece, model_tag=self.model_tag)
