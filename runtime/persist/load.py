"""Loading one agent's cache for a model: read and check its manifest and state file, then its pieces.

:func:`load_cache` is :meth:`runtime.persist.CacheDirectory.load`. It checks
the manifest against itself first (:func:`runtime.persist.manifests.check_manifest`),
reads the state file whole, then each piece's file straight into the final
arrays, checking every file's metadata, layout and data checksum against the manifest.
Any problem becomes a :class:`~runtime.errors.CacheMiss` (logged), never an
uncaught error.

Where the data lands: :func:`allocate` carves every blocked tensor's
``num_tokens`` array from one buffer (an :class:`Arena`), and a
:class:`Scatter` lists, for a piece of a given length, the byte range of the
buffer each row of its file (one tensor, one head) lands in, so a file is read
into its arrays without a copy after the kernel's.

How the files are read: :class:`AgentPieces` reads a piece's file straight
into those rows, and the state file whole. A file whose size or header
checksum differs from the manifest is rejected
(:class:`~runtime.errors.CorruptCacheError`); one that also fails its *own*
check is removed, so that the next save writes it again instead of trusting it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from runtime.errors import CacheMiss, CorruptCacheError, FormatVersionError
from runtime.persist.codec import (
    FileLayout,
    ParsedFile,
    data_is_intact,
    decode_arrays,
    layout_of_entries,
    parse_file,
    regions_are_intact,
)
from runtime.persist.files import open_regular_file, read_exactly_into, read_regular_file, remove_file
from runtime.persist.format import (
    FORMAT_VERSION,
    BlockPiece,
    Manifest,
    Piece,
    StateRef,
    block_info,
    layout_problem,
    piece_layout,
    segment_info,
    state_info,
    tensor_name,
)
from runtime.persist.manifests import (
    ManifestContents,
    check_manifest,
    decode_manifest,
    read_manifest_data,
)
from runtime.persist.pieces import block_is_intact
from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot

if TYPE_CHECKING:
    from runtime.persist.directory import CachePaths

__all__ = [
    "READ_AHEAD_BYTES",
    "load_cache",
    "assemble_snapshot",
    "AgentPieces",
    "Arena",
    "Scatter",
    "allocate",
]

log = logging.getLogger("kvmem.persist")

READ_AHEAD_BYTES = 32 << 20
"""How far ahead of the file it reads a load asks the kernel to read."""


def load_cache(paths: CachePaths, agent_id: str, *, model_tag: str) -> CacheSnapshot:
    """Read and fully verify ``agent_id``'s cache for ``model_tag`` (see :meth:`runtime.persist.CacheDirectory.load`).

    Raises:
        InvalidAgentIdError: ``agent_id`` cannot name a cache.
        CacheMiss: no cache, or (as its subclasses, logged) an unusable one.
    """
    agent_dir = paths.agent_dir(agent_id)
    try:
        data = read_manifest_data(agent_dir, model_tag)
        if data is None:
            raise CacheMiss(f"no cache stored for agent {agent_id!r} and model {model_tag!r}")
        manifest = decode_manifest(data)
        contents = check_manifest(manifest, agent_id=agent_id, model_tag=model_tag)
        files = AgentPieces(paths, agent_dir, model_tag, version=manifest.format_version)
        return assemble_snapshot(manifest, contents, state=files.read_state(manifest.state), files=files)
    except (CorruptCacheError, FormatVersionError) as exc:
        log.warning("cache of agent %r is unusable: %s", agent_id, exc)
        raise
    except CacheMiss:
        raise
    except Exception as exc:
        log.warning("cache of agent %r is unusable: %s: %s", agent_id, type(exc).__name__, exc)
        raise CorruptCacheError(f"{type(exc).__name__}: {exc}") from exc


def _read_state(
    state: bytes, parsed: ParsedFile, manifest: Manifest, num_tokens: int
) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.dtype, tuple[int, ...]]]]:
    """The sliding arrays and every blocked tensor's zero-token ``(dtype, shape)``."""
    records = {
        tensor_name(index, key): record
        for index, record in enumerate(manifest.layers)
        for key in record.keys
    }
    if not parsed.has_info(state_info(model_tag=manifest.model_tag, version=manifest.format_version)):
        raise CorruptCacheError("state file is not this cache's")
    try:
        entries = parsed.entries()
        layout = layout_of_entries(entries)
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


def _expected_info(piece: Piece, manifest: Manifest) -> dict[str, str]:
    version = manifest.format_version
    if isinstance(piece, BlockPiece):
        return block_info(model_tag=manifest.model_tag, block_hash=piece.name, version=version)
    return segment_info(model_tag=manifest.model_tag, start=piece.start, end=piece.end, version=version)


def assemble_snapshot(
    manifest: Manifest,
    contents: ManifestContents,
    *,
    state: tuple[bytes, ParsedFile],
    files: AgentPieces,
) -> CacheSnapshot:
    """Rebuild the snapshot from the checked state file and the pieces' files.

    The blocked arrays are allocated from the state file's zero-token layouts,
    and each piece's file is read straight into them: one ``preadv`` per file
    scatters the header into a small buffer and each row of each tensor into
    its place (no copy after the kernel's), and the checksum of its data is
    computed right after, while the data is still in the CPU cache. The
    kernel reads :data:`READ_AHEAD_BYTES` ahead, so the disk works meanwhile.
    (A reader thread reading the next piece while this one is checked measured
    slower at every size, 2.7x at 16K from disk: each read waits to take the
    GIL back from the checking loop. So did CRCs on helper threads, before XXH3.)

    Raises:
        CorruptCacheError: a file's metadata, tensor set, dtype, shape or data
            contradicts the manifest or the layer layouts.
    """
    num_tokens = manifest.num_tokens
    out, blocked = _read_state(*state, manifest, num_tokens)
    arena = allocate(blocked, num_tokens)
    out |= arena.arrays
    whole = memoryview(arena.buffer.data).cast("B")
    scatters: dict[int, Scatter] = {}
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
            scatter = scatters[tokens] = Scatter.of(piece_layout(blocked, tokens), arena)
        expected = _expected_info(piece, manifest)
        header = bytearray(scatter.layout.header_size(expected))
        regions = scatter.regions(whole, piece.start, tokens)
        parsed = files.read_into(piece, header, regions)
        if not parsed.has_info(expected):
            raise CorruptCacheError(f"file {piece.name} does not hold tokens {piece.start}:{piece.end}")
        if not parsed.matches(scatter.layout) or piece.size != parsed.data_start + scatter.layout.data_size:
            raise CorruptCacheError(
                f"{piece.name} tensors do not match the manifest's layers"
            )
        if not regions_are_intact(regions, parsed):
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


@dataclass(frozen=True)
class Arena:
    """The blocked arrays of a load, carved from one buffer, and where each lies in it."""

    buffer: np.ndarray
    arrays: dict[str, np.ndarray]
    offsets: dict[str, int]


@dataclass(frozen=True)
class Scatter:
    """Where a piece's data goes: per row of (tensor, head) in file order, its place in the arena.

    A ``tokens``-token piece at ``start`` fills, for each row, arena bytes
    ``base + start * row : base + (start + tokens) * row``.
    """

    layout: FileLayout
    bases: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, layout: FileLayout, arena: Arena) -> Scatter:
        """The rows of a piece laid out as ``layout``, placed in ``arena``."""
        bases, rows = [], []
        for name in layout.offsets:
            array = arena.arrays[name]
            row = array.strides[1]
            for head in range(array.shape[0]):
                bases.append(arena.offsets[name] + head * array.strides[0])
                rows.append(row)
        return cls(layout, np.array(bases, dtype=np.int64), np.array(rows, dtype=np.int64))

    def regions(self, whole: memoryview, start: int, tokens: int) -> list[memoryview]:
        """The views of ``whole`` (the arena's buffer) a ``tokens``-token piece at ``start`` fills, in file order."""
        starts = (self.bases + start * self.rows).tolist()
        sizes = (self.rows * tokens).tolist()
        return [whole[at : at + size] for at, size in zip(starts, sizes, strict=True)]


def allocate(
    blocked: dict[str, tuple[np.dtype, tuple[int, ...]]], num_tokens: int
) -> Arena:
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
    return Arena(buffer, arrays, offsets)


@dataclass(frozen=True)
class AgentPieces:
    """The files of one agent's cache for one model, as a load reads them.

    Attributes:
        paths: the cache directory.
        agent_dir: the agent's folder.
        model_tag: the model the cache is for (a block file records it).
        version: the format of the manifest being read (a block file records it too).
    """

    paths: CachePaths
    agent_dir: Path
    model_tag: str
    version: int = FORMAT_VERSION

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
        checked here: the caller checks its data checksum (regions may lie anywhere, in
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
        and data checksum, an agent file (``<kind>-<sha256>.safetensors``) by the
        checksum in its name and the checksum of its data. A file that is intact
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
            damaged = not block_is_intact(
                raw, model_tag=self.model_tag, block_hash=ref.name, like=None, version=self.version
            )
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
