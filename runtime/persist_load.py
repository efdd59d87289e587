"""Verification and assembly of a stored cache (pure: bytes in, snapshot out).

Used by :meth:`runtime.persist.CacheDirectory.load` (which does the file
access) and by its save (which checks the previous manifest before reusing its
pieces). Every check raises a :class:`~runtime.errors.CacheMiss` subclass.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import msgspec
import numpy as np

from runtime.errors import CorruptCacheError, ForeignModelError, FormatVersionError
from runtime.persist_codec import (
    FileLayout,
    ParsedFile,
    data_is_intact,
    decode_arrays,
    dtype_of_code,
    parse_file,
)
from runtime.persist_format import (
    FORMAT_VERSION,
    BlockListProbe,
    BlockPiece,
    FormatProbe,
    Manifest,
    Piece,
    block_chain_hashes,
    block_info,
    layout_problem,
    piece_layout,
    segment_info,
    segment_name,
    state_name,
    tensor_name,
    unpack_offsets,
    unpack_text,
    unpack_token_ids,
)
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "READ_AHEAD_BYTES",
    "PieceReader",
    "decode_manifest",
    "decode_block_list",
    "block_is_intact",
    "ManifestContents",
    "check_manifest",
    "assemble_snapshot",
]

_manifest_decoder = msgspec.json.Decoder(Manifest)
_probe_decoder = msgspec.json.Decoder(FormatProbe)
_block_list_decoder = msgspec.json.Decoder(BlockListProbe)


def decode_manifest(data: bytes) -> Manifest:
    """Strictly decode a manifest of this format version.

    Raises:
        FormatVersionError: the manifest has another ``format_version``.
        CorruptCacheError: it is not a valid manifest.
    """
    try:
        version = _probe_decoder.decode(data).format_version
    except msgspec.DecodeError as exc:
        raise CorruptCacheError(f"manifest does not decode: {exc}") from exc
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"manifest has format {version}; this kvmem reads {FORMAT_VERSION}"
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


def block_is_intact(
    data: Any, *, model_tag: str, block_hash: str, like: FileLayout | None
) -> bool:
    """Whether ``data`` is a whole block file for ``block_hash`` (laid out as ``like``).

    Checks the block's own metadata and the CRC of its data, no manifest needed.
    """
    try:
        parsed = parse_file(data)
    except ValueError:
        return False
    info = parsed.info
    if (
        info.get("kind") != "block"
        or info.get("format_version") != str(FORMAT_VERSION)
        or info.get("model_tag") != model_tag
        or info.get("block_hash") != block_hash
        or not data_is_intact(data, parsed)
    ):
        return False
    if like is not None:
        return parsed.matches(like) and len(data) == parsed.data_start + like.data_size
    try:
        layout = _layout_of(parsed.entries())
    except ValueError:
        return False
    return parsed.matches(layout) and len(data) == parsed.data_start + layout.data_size


def _layout_of(entries: dict[str, Any]) -> FileLayout:
    """The canonical layout of the tensors a header lists (ValueError if malformed)."""
    try:
        return FileLayout.of(
            {
                name: (dtype_of_code(entry["dtype"]), tuple(entry["shape"]))
                for name, entry in entries.items()
            }
        )
    except (TypeError, KeyError) as exc:
        raise ValueError(f"malformed tensor entry: {exc}") from exc


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
    _check_pieces(manifest.pieces, num_tokens, block_chain_hashes(model_tag, token_ids))
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


def _check_piece_metadata(
    piece: Piece, info: dict[str, str], manifest: Manifest
) -> None:
    expected = {"format_version": str(FORMAT_VERSION), "model_tag": manifest.model_tag}
    if isinstance(piece, BlockPiece):
        expected |= {"kind": "block", "block_hash": piece.name}
    else:
        expected |= {
            "kind": "segment",
            "start": str(piece.start),
            "end": str(piece.end),
        }
    if any(info.get(key) != value for key, value in expected.items()):
        raise CorruptCacheError(
            f"file {piece.name} does not hold tokens {piece.start}:{piece.end}"
        )


def _read_state(
    state: bytes, parsed: ParsedFile, manifest: Manifest, num_tokens: int
) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.dtype, tuple[int, ...]]]]:
    """The sliding arrays and every blocked tensor's zero-token ``(dtype, shape)``."""
    records = {
        tensor_name(index, key): record
        for index, record in enumerate(manifest.layers)
        for key in record.keys
    }
    info = parsed.info
    if (info.get("kind"), info.get("format_version"), info.get("model_tag")) != (
        "state",
        str(FORMAT_VERSION),
        manifest.model_tag,
    ):
        raise CorruptCacheError("state file is not this cache's")
    try:
        entries = parsed.entries()
        layout = _layout_of(entries)
    except ValueError as exc:
        raise CorruptCacheError(f"state header: {exc}") from exc
    if set(entries) != set(records):
        raise CorruptCacheError("state tensors do not match the manifest's layers")
    if not parsed.matches(layout) or len(state) != parsed.data_start + layout.data_size:
        raise CorruptCacheError("state file is not laid out canonically")
    sliding: list[str] = []
    blocked: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    for name, record in records.items():
        shape = layout.shapes[name]
        if len(shape) < 2:
            raise CorruptCacheError(f"state tensor {name} has no token axis")
        if record.kind is LayerKind.SLIDING:
            if shape[1] > num_tokens:
                raise CorruptCacheError(
                    f"sliding tensor {name} holds more tokens than the cache"
                )
            sliding.append(name)
        elif shape[1] != 0:
            raise CorruptCacheError(f"state holds tokens of blocked tensor {name}")
        else:
            blocked[name] = (layout.dtypes[name], shape)
    return decode_arrays(state, parsed, layout, sliding), blocked


READ_AHEAD_BYTES = 32 << 20
"""How far ahead of the file it reads a load asks the kernel to read."""


class PieceReader(Protocol):
    """File access for :func:`assemble_snapshot` (:class:`runtime.persist_pieces.PieceFiles`)."""

    def prefetch(self, pieces: Sequence[Piece]) -> None:
        """Start reading these files ahead."""

    def read_into(
        self, piece: Piece, header: bytearray, regions: list[memoryview]
    ) -> ParsedFile:
        """Read a file into ``header`` then ``regions``; check its size and header checksum."""
        ...

    def reject(self, piece: Piece) -> NoReturn:
        """Raise CorruptCacheError for a file whose data fails its CRC (removing it if damaged)."""
        ...


@dataclass(frozen=True)
class _Arena:
    """The blocked arrays of a load, carved from one buffer, and where each lies in it."""

    buffer: np.ndarray
    arrays: dict[str, np.ndarray]
    offsets: dict[str, int]


@dataclass(frozen=True)
class _Scatter:
    """Where a piece's data goes: per row of (tensor, head) in file order, its place in the arena.

    A ``tokens``-token piece at ``start`` fills, for each row, arena bytes
    ``base + start * row : base + (start + tokens) * row``.
    """

    layout: FileLayout
    bases: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, layout: FileLayout, arena: _Arena) -> _Scatter:
        bases, rows = [], []
        for name in layout.offsets:
            array = arena.arrays[name]
            row = array.strides[1]
            for head in range(array.shape[0]):
                bases.append(arena.offsets[name] + head * array.strides[0])
                rows.append(row)
        return cls(layout, np.array(bases, dtype=np.int64), np.array(rows, dtype=np.int64))

    def regions(self, whole: memoryview, start: int, tokens: int) -> list[memoryview]:
        starts = (self.bases + start * self.rows).tolist()
        sizes = (self.rows * tokens).tolist()
        return [whole[at : at + size] for at, size in zip(starts, sizes, strict=True)]


def _expected_info(piece: Piece, manifest: Manifest) -> dict[str, str]:
    if isinstance(piece, BlockPiece):
        return block_info(model_tag=manifest.model_tag, block_hash=piece.name)
    return segment_info(model_tag=manifest.model_tag, start=piece.start, end=piece.end)


def _crc32_of(regions: list[memoryview]) -> str:
    crc = 0
    for region in regions:
        crc = zlib.crc32(region, crc)
    return f"{crc:08x}"


def assemble_snapshot(
    manifest: Manifest,
    contents: ManifestContents,
    *,
    state: tuple[bytes, ParsedFile],
    files: PieceReader,
) -> CacheSnapshot:
    """Rebuild the snapshot from the checked state file and the pieces' files.

    The blocked arrays are allocated from the state file's zero-token layouts,
    and each piece's file is read straight into them: one ``preadv`` per file
    scatters the header into a small buffer and each row of each tensor into
    its place (no copy after the kernel's), and the CRC of its data is
    computed right after, while the data is still in the CPU cache. The
    kernel reads :data:`READ_AHEAD_BYTES` ahead, so the disk works meanwhile.
    (CRCs on helper threads measured no faster: most rows are short, and
    their CRC calls hold the GIL.)

    Raises:
        CorruptCacheError: a file's metadata, tensor set, dtype, shape or data
            contradicts the manifest or the layer layouts.
    """
    num_tokens = manifest.num_tokens
    out, blocked = _read_state(*state, manifest, num_tokens)
    arena = _allocate(blocked, num_tokens)
    out |= arena.arrays
    whole = memoryview(arena.buffer.data).cast("B")
    scatters: dict[int, _Scatter] = {}
    pieces = manifest.pieces
    asked, ahead = 0, 0  # pieces[:asked] are being read ahead, ``ahead`` bytes of them from here
    for index, piece in enumerate(pieces):
        first = asked
        while asked < len(pieces) and (asked <= index or ahead < READ_AHEAD_BYTES):
            ahead += pieces[asked].size
            asked += 1
        if asked > first:
            files.prefetch(pieces[first:asked])
        ahead -= piece.size
        tokens = piece.end - piece.start
        scatter = scatters.get(tokens)
        if scatter is None:
            scatter = scatters[tokens] = _Scatter.of(piece_layout(blocked, tokens), arena)
        header = bytearray(
            len(scatter.layout.header({**_expected_info(piece, manifest), "data_crc32": "0" * 8}))
        )
        regions = scatter.regions(whole, piece.start, tokens)
        parsed = files.read_into(piece, header, regions)
        _check_piece_metadata(piece, parsed.info, manifest)
        if not parsed.matches(scatter.layout) or piece.size != parsed.data_start + scatter.layout.data_size:
            raise CorruptCacheError(
                f"{piece.name} tensors do not match the manifest's layers"
            )
        if _crc32_of(regions) != parsed.info.get("data_crc32"):
            files.reject(piece)

    layers = []
    for index, record in enumerate(manifest.layers):
        arrays = {key: out[tensor_name(index, key)] for key in record.keys}
        problem = layout_problem(record.kind, arrays)
        if problem is not None:
            raise CorruptCacheError(f"layer {index}: {problem}")
        layers.append(LayerSnapshot(kind=record.kind, arrays=arrays))
    return CacheSnapshot(
        model_tag=manifest.model_tag,
        text=contents.text,
        token_ids=contents.token_ids.tolist(),
        offsets=contents.offsets.tolist(),
        layers=layers,
        meta=dict(manifest.meta),
    )


def _allocate(
    blocked: dict[str, tuple[np.dtype, tuple[int, ...]]], num_tokens: int
) -> _Arena:
    """Empty ``num_tokens``-token arrays for the blocked tensors, carved from one allocation.

    One large allocation is backed by huge pages where the kernel offers them
    (numpy asks for it), so filling it costs a few page faults instead of one
    per 4 KiB: for a large cache, faulting in fresh memory page by page costs
    as much as reading it.
    """
    shapes = {
        name: (dtype, (shape[0], num_tokens, *shape[2:]))
        for name, (dtype, shape) in blocked.items()
    }
    sizes = {
        name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in shapes.items()
    }
    # Each array starts on a 64-byte boundary, as numpy's own allocations do.
    buffer = np.empty(sum(-(-size // 64) * 64 for size in sizes.values()), dtype=np.uint8)
    arrays, offsets = {}, {}
    position = 0
    for name, (dtype, shape) in shapes.items():
        arrays[name] = buffer[position : position + sizes[name]].view(dtype).reshape(shape)
        offsets[name] = position
        position += -(-sizes[name] // 64) * 64
    return _Arena(buffer, arrays, offsets)
