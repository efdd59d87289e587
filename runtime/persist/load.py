"""Loading one agent's cache for a model: read and check its manifest and state file, then its pieces.

:func:`load_cache` is :meth:`runtime.persist.CacheDirectory.load`. It checks
the manifest against itself first (:mod:`runtime.persist.verify`), reads the
state file whole, then each piece's file straight into the final arrays
(:mod:`runtime.persist.arena`, :class:`runtime.persist.reader.AgentPieces`),
checking every file's metadata, layout and CRC against the manifest. Any
problem becomes a :class:`~runtime.errors.CacheMiss` (logged), never an
uncaught error.
"""

from __future__ import annotations

import logging
import zlib

import numpy as np

from runtime.errors import CacheMiss, CorruptCacheError, FormatVersionError
from runtime.persist.arena import Scatter, allocate
from runtime.persist.codec import ParsedFile, decode_arrays, layout_of_entries
from runtime.persist.format import BlockPiece, Manifest, Piece
from runtime.persist.manifests import read_manifest_data
from runtime.persist.paths import CachePaths
from runtime.persist.reader import AgentPieces
from runtime.persist.tensors import (
    block_info,
    layout_problem,
    piece_layout,
    segment_info,
    state_info,
    tensor_name,
)
from runtime.persist.verify import ManifestContents, check_manifest, decode_manifest
from runtime.snapshot import CacheSnapshot, LayerKind, LayerSnapshot

__all__ = ["READ_AHEAD_BYTES", "load_cache", "assemble_snapshot"]

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
        files = AgentPieces(paths, agent_dir, model_tag)
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
    if not parsed.has_info(state_info(model_tag=manifest.model_tag)):
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
    files: AgentPieces,
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
        header = bytearray(len(scatter.layout.header({**expected, "data_crc32": "0" * 8})))
        regions = scatter.regions(whole, piece.start, tokens)
        parsed = files.read_into(piece, header, regions)
        if not parsed.has_info(expected):
            raise CorruptCacheError(f"file {piece.name} does not hold tokens {piece.start}:{piece.end}")
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
