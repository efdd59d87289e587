"""A save's pieces: which it keeps and which token ranges it writes, and writing those files where not on disk intact.

**The plan** (:func:`plan_save`, pure policy, no I/O). An agent's blocked-layer
KV is a list of pieces covering ``0:num_tokens`` (see
:mod:`runtime.persist.format`). A save keeps every piece of the previous
manifest that lies wholly inside the common token-id prefix of the old and new
snapshots, and writes the rest, ``start:num_tokens``, as:

* a segment up to the next block boundary when ``start`` is not on one,
* each whole block after that as a shared block (all its tokens are new in
  this save, so its KV comes from one computation and can be shared),
* a segment for the remainder after the last whole block.

So each token's KV is written once however the turns are cut: a block that
fills up over several turns stays made of the segments that filled it. A piece
that straddles the point where the token ids diverge (a trimmed or edited
conversation) is dropped and its surviving tokens are written again.

This relies on one assumption, stated here because the save cannot check it
cheaply: the KV of a common token-id prefix of the *same agent* is the KV
already stored (the new snapshot extends the same parked cache). Where it was
recomputed instead (a cold prefill after a miss), the reused pieces hold the
older computation of the same tokens, as a shared block adopted from another
agent does.

**Writing** (:func:`write_pieces`, :func:`write_state`): the mechanism under
:mod:`runtime.persist.save`, which follows the plan and owns manifests. Every
file goes into an :class:`~runtime.persist.files.AtomicBatch`; a file already
on disk with the right content is not written again. Consecutive whole blocks
are encoded together, as one run (:func:`runtime.persist.codec.encode_run`).

Whether a file on disk is still the piece it should be is decided here too:
:func:`piece_is_intact` for a piece a previous manifest lists (by its header),
:func:`block_is_intact` for a block file on its own (by its metadata and
data checksum), which a save asks before it adopts a block already there and a load
before it removes a block that failed against its manifest.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.persist.codec import (
    FileLayout,
    data_is_intact,
    encode_run,
    header_sha256,
    layout_of_entries,
    parse_file,
)
from runtime.persist.files import (
    AtomicBatch,
    read_header,
    read_regular_file,
    regular_file_size,
    remove_file,
)
from runtime.persist.format import (
    AGENT_FILE_NAME,
    FORMAT_VERSION,
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
from runtime.spec import BLOCK_TOKENS, CacheSnapshot

if TYPE_CHECKING:
    from runtime.persist.directory import CachePaths

__all__ = [
    "PieceKind",
    "PieceRange",
    "SavePlan",
    "common_prefix",
    "plan_save",
    "range_of",
    "MAX_RUN_BLOCKS",
    "WriteTally",
    "piece_is_intact",
    "block_is_intact",
    "write_pieces",
    "write_state",
    "remove_own_files",
]

log = logging.getLogger("kvmem.persist")


# -- the plan ------------------------------------------------------------------


class PieceKind(str, enum.Enum):
    """What a written range becomes."""

    BLOCK = "block"
    SEGMENT = "segment"


@dataclass(frozen=True)
class PieceRange:
    """Tokens ``start:end`` to be written as a piece of ``kind``."""

    kind: PieceKind
    start: int
    end: int


@dataclass(frozen=True)
class SavePlan:
    """Pieces kept from the previous manifest (in order), then ranges to write."""

    reuse: list[Piece]
    write: list[PieceRange]


def range_of(piece: Piece) -> PieceRange:
    """The range a piece covers, as what it is (to write it again)."""
    kind = PieceKind.BLOCK if isinstance(piece, BlockPiece) else PieceKind.SEGMENT
    return PieceRange(kind, piece.start, piece.end)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two 1-D integer arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _ranges(start: int, stop: int) -> list[PieceRange]:
    first_block = -(-start // BLOCK_TOKENS) * BLOCK_TOKENS
    last_block = (stop // BLOCK_TOKENS) * BLOCK_TOKENS
    if first_block >= last_block:
        return [PieceRange(PieceKind.SEGMENT, start, stop)] if start < stop else []
    ranges = []
    if start < first_block:
        ranges.append(PieceRange(PieceKind.SEGMENT, start, first_block))
    ranges += [
        PieceRange(PieceKind.BLOCK, block, block + BLOCK_TOKENS)
        for block in range(first_block, last_block, BLOCK_TOKENS)
    ]
    if last_block < stop:
        ranges.append(PieceRange(PieceKind.SEGMENT, last_block, stop))
    return ranges


def plan_save(previous: Sequence[Piece], *, common: int, num_tokens: int) -> SavePlan:
    """Plan a save of ``num_tokens`` tokens over ``previous`` pieces (contiguous from 0).

    Args:
        previous: the previous manifest's pieces, already checked contiguous.
        common: length of the common token-id prefix of the old and new snapshots.
        num_tokens: tokens in the new snapshot.
    """
    reuse: list[Piece] = []
    position = 0
    for piece in previous:
        if piece.start != position or piece.end > common:
            break
        reuse.append(piece)
        position = piece.end
    return SavePlan(reuse=reuse, write=_ranges(position, num_tokens))


# -- writing and checking pieces -----------------------------------------------

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

    def add(self, kind: PieceKind, *, written: int, tokens: int) -> None:
        """Count a piece of ``kind`` and ``tokens`` tokens of which ``written`` bytes were written (0: kept)."""
        if kind is PieceKind.BLOCK:
            self.block_bytes += written
            self.blocks_written += written > 0
        else:
            self.own_bytes += written
            self.segments_written += written > 0
        self.tokens_written += tokens if written else 0


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


def piece_is_intact(paths: CachePaths, agent_dir: Path, piece: Piece) -> bool:
    """Whether a piece a previous manifest lists is still that piece on disk.

    Checks the file's size and its checksum, the SHA-256 of its header (a
    small read), so a block that another agent's save replaced with other
    bits is noticed and adopted, and a segment's range. Damage to the data
    alone is caught by a load, which removes the damaged file
    (:meth:`runtime.persist.load.AgentPieces.reject`).
    """
    header = read_header(paths.piece_path(agent_dir, piece), size=piece.size)
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


def block_is_intact(
    data: Any, *, model_tag: str, block_hash: str, like: FileLayout | None, version: int = FORMAT_VERSION
) -> bool:
    """Whether ``data`` is a whole block file of format ``version`` for ``block_hash`` (laid out as ``like``).

    Checks the block's own metadata and the checksum of its data, no manifest needed.
    """
    try:
        parsed = parse_file(data)
    except ValueError:
        return False
    if not parsed.has_info(block_info(model_tag=model_tag, block_hash=block_hash, version=version)):
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


def write_pieces(
    paths: CachePaths,
    agent_dir: Path,
    snapshot: CacheSnapshot,
    *,
    chain: list[str],
    ranges: Sequence[PieceRange],
    tally: WriteTally,
    batch: AtomicBatch,
) -> list[Piece]:
    """Store tokens ``ranges`` of ``snapshot`` as blocks and segments in ``batch``; return the pieces in order.

    ``chain`` holds the snapshot's block hashes; ``tally`` counts what is written.
    """
    sources = blocked_sources(snapshot.layers)
    layouts = {name: (array.dtype, array.shape) for name, array in sources.items()}
    pieces: list[Piece] = []
    for run in _runs(ranges):
        start, tokens = run[0].start, run[0].end - run[0].start
        layout = piece_layout(layouts, tokens)
        if run[0].kind is PieceKind.BLOCK:
            infos = [
                block_info(model_tag=snapshot.model_tag, block_hash=chain[r.start // BLOCK_TOKENS])
                for r in run
            ]
        else:
            infos = [segment_info(model_tag=snapshot.model_tag, start=start, end=run[0].end)]
        files = encode_run(
            sources, layout, start=start, count=len(run), tokens=tokens, info=infos.__getitem__
        )
        for piece_range, file in zip(run, files, strict=True):
            piece: Piece
            if piece_range.kind is PieceKind.BLOCK:
                piece, written = _store_block(
                    paths,
                    file,
                    layout,
                    model_tag=snapshot.model_tag,
                    block_hash=chain[piece_range.start // BLOCK_TOKENS],
                    start=piece_range.start,
                    batch=batch,
                )
            else:
                piece, written = _store_segment(agent_dir, file, piece_range, batch)
            pieces.append(piece)
            tally.add(piece_range.kind, written=written, tokens=tokens)
    return pieces


def write_state(agent_dir: Path, data: bytes, *, tally: WriteTally, batch: AtomicBatch) -> StateRef:
    """Store the state file ``data`` in ``batch`` (unless already there); return its ref."""
    sha = header_sha256(data)
    state = StateRef(name=state_name(sha), sha256=sha, size=len(data))
    tally.own_bytes += _store_own_file(agent_dir / state.name, data, batch)
    return state


def _store_block(
    paths: CachePaths,
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

    path = paths.block_path(block_hash)
    existing = read_regular_file(path)
    if existing is not None:
        if existing == file:
            return piece(file), 0
        if block_is_intact(existing, model_tag=model_tag, block_hash=block_hash, like=layout):
            log.debug("reusing block %s whose bits differ from ours", block_hash)
            return piece(existing), 0
        log.warning("block %s on disk is damaged; rewriting it", block_hash)
    batch.ensure_dir(path.parent)
    batch.write(path, file)
    return piece(file), len(file)


def _store_segment(
    agent_dir: Path, file: memoryview, piece_range: PieceRange, batch: AtomicBatch
) -> tuple[SegmentPiece, int]:
    """Make sure the segment is in ``agent_dir``; return its piece and the bytes written."""
    sha = header_sha256(file)
    piece = SegmentPiece(
        name=segment_name(sha), start=piece_range.start, end=piece_range.end, sha256=sha, size=len(file)
    )
    return piece, _store_own_file(agent_dir / piece.name, file, batch)


def _store_own_file(path: Path, data: memoryview | bytes, batch: AtomicBatch) -> int:
    """Write a content-named agent file unless it is there, intact; return the bytes written."""
    if regular_file_size(path) == len(data) and read_regular_file(path) == data:
        return 0
    batch.write(path, data)
    return len(data)


def remove_own_files(agent_dir: Path, *, keep: Collection[str]) -> int:
    """Remove segment, state and format-1 tail files of ``agent_dir`` not in ``keep``; return how many."""
    removed = 0
    try:
        names = os.listdir(agent_dir)
    except OSError:
        return 0
    for name in names:
        if AGENT_FILE_NAME.fullmatch(name) and name not in keep:
            removed += remove_file(agent_dir / name)
    return removed
