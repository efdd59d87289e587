"""Which pieces a save reuses and which token ranges it writes (pure policy, no I/O).

An agent's blocked-layer KV is a list of pieces covering ``0:num_tokens``
(see :mod:`runtime.persist.format`). A save keeps every piece of the previous
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
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.persist.format import BlockPiece, Piece
from runtime.snapshot import BLOCK_TOKENS

__all__ = [
    "PieceKind",
    "PieceRange",
    "SavePlan",
    "common_prefix",
    "plan_save",
    "range_of",
]


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
