"""Reading one agent's files for a load: read-ahead, scattered reads, and dropping a file that fails its own check.

:class:`AgentPieces` is the file access under :func:`runtime.persist.load.assemble_snapshot`:
it reads a piece's file straight into the arrays its data belongs in, and the
state file whole. A file whose size or header checksum differs from the
manifest is rejected (:class:`~runtime.errors.CorruptCacheError`); one that
also fails its *own* check is removed, so that the next save writes it again
instead of trusting it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from runtime.errors import CorruptCacheError
from runtime.persist.codec import ParsedFile, data_is_intact, parse_file
from runtime.persist.files import open_regular_file, read_exactly_into, read_regular_file, remove_file
from runtime.persist.format import BlockPiece, Piece, StateRef
from runtime.persist.paths import CachePaths
from runtime.persist.verify import block_is_intact

__all__ = ["AgentPieces"]

log = logging.getLogger("kvmem.persist")


@dataclass(frozen=True)
class AgentPieces:
    """The files of one agent's cache for one model, as a load reads them.

    Attributes:
        paths: the cache directory.
        agent_dir: the agent's folder.
        model_tag: the model the cache is for (a block file records it).
    """

    paths: CachePaths
    agent_dir: Path
    model_tag: str

    def prefetch(self, pieces: Sequence[Piece]) -> None:
        """Have the kernel start reading the files of ``pieces`` ahead (missing ones are skipped)."""
        for piece in pieces:
            fd = open_regular_file(self.paths.piece_path(self.agent_dir, piece), size=piece.size)
            if fd is not None:
                os.close(fd)

    def read_into(self, piece: Piece, header: bytearray, regions: list[memoryview]) -> ParsedFile:
        """Read ``piece``'s file into ``header`` then ``regions`` (scattered, in file order).

        The file must be exactly as long as they are together, and ``header``
        must hold exactly its header, with the checksum the manifest records;
        otherwise the file is handled as :meth:`reject` says. The data is not
        checked here: the caller checks its CRC (regions may lie anywhere, in
        the arrays the data belongs in, so it is read without a copy).
        """
        fd = open_regular_file(self.paths.piece_path(self.agent_dir, piece), size=piece.size)
        if fd is None:
            self.reject(piece)
        try:
            complete = read_exactly_into(fd, [memoryview(header), *regions])
        finally:
            os.close(fd)
        if not complete:
            self.reject(piece)
        parsed = self._parsed(piece, header, size=piece.size)
        if parsed.data_start != len(header):
            self.reject(piece)
        return parsed

    def read_state(self, state: StateRef) -> tuple[bytes, ParsedFile]:
        """The bytes of the state file and its parsed header, if they match ``state``, else CorruptCacheError."""
        fd = open_regular_file(self.agent_dir / state.name, size=state.size)
        data = bytearray(state.size)
        try:
            if fd is None or not read_exactly_into(fd, [memoryview(data)]):
                self.reject(state)
        finally:
            if fd is not None:
                os.close(fd)
        parsed = self._parsed(state, data)
        if not data_is_intact(data, parsed):
            self.reject(state)
        return bytes(data), parsed

    def _parsed(
        self, ref: Piece | StateRef, data: bytearray, *, size: int | None = None
    ) -> ParsedFile:
        """The parsed header of ``data`` (a whole file, or its header and ``size``) if it has ``ref``'s checksum."""
        try:
            parsed = parse_file(data, size=size)
        except ValueError:
            self.reject(ref)
        if parsed.header_sha256 != ref.sha256:
            self.reject(ref)
        return parsed

    def reject(self, ref: Piece | StateRef) -> NoReturn:
        """Raise CorruptCacheError for a file that does not match ``ref``, removing it if damaged.

        A file that fails its own check is removed, so that the next save
        rewrites it instead of trusting it: a block by its header's metadata
        and data CRC, an agent file (``<kind>-<sha256>.safetensors``) by the
        checksum in its name and the CRC of its data. A file that is intact
        but not the one the manifest lists stays.
        """
        if isinstance(ref, StateRef):
            path = self.agent_dir / ref.name
        else:
            path = self.paths.piece_path(self.agent_dir, ref)
        raw = read_regular_file(path)
        if raw is None:
            raise CorruptCacheError(f"{path.name} is missing")
        if isinstance(ref, BlockPiece):
            damaged = not block_is_intact(raw, model_tag=self.model_tag, block_hash=ref.name, like=None)
        else:
            damaged = not _agent_file_is_intact(path.name, raw)
        if damaged:
            log.warning("removing damaged cache file %s", path)
            remove_file(path)
        raise CorruptCacheError(f"{path.name}: size or checksum differs from the manifest")


def _agent_file_is_intact(name: str, raw: bytes) -> bool:
    """Whether an agent file has the checksum its name records and the data its header does."""
    try:
        parsed = parse_file(raw)
    except ValueError:
        return False
    return name.endswith(f"-{parsed.header_sha256}.safetensors") and data_is_intact(raw, parsed)
