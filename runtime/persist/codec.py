"""Safetensors files of a cache directory: one canonical layout, checksummed, in runs.

kvmem encodes and decodes its block, segment and state files itself rather
than through ``safetensors.numpy``, which copies every tensor twice on the
way in and once on the way out and costs a Python round trip per tensor per
file (180 tensors per block for kvmem-default). The files stay standard
safetensors: an 8-byte little-endian header length, a JSON header, the data.
The layout is canonical, so equal content always gives equal bytes:

* tensors ordered by item size (largest first, so each one is aligned in a
  file read into an aligned buffer), then by name, back to back;
* the header is compact JSON, ``__metadata__`` first, padded with spaces to a
  multiple of 8 bytes; the metadata holds one key, ``kvmem``, a canonical
  JSON string of kvmem's fields (several keys would serialize in hash order);
* those fields include ``data_xxh3``, the XXH3-64 of the data section, so the
  SHA-256 of the header alone (what a manifest records) covers the whole file
  and checking a file costs one fast pass over its data. (XXH3 rather than
  zlib's CRC-32: about 13 GB/s against 2.5 GB/s on one core, and the check is
  on every load's path; ``benches/results/cache_io.md``.)

Whole blocks of a snapshot share one layout and one header length, so a
**run** of consecutive block files is encoded into, and decoded from, one
buffer that holds the files back to back: each tensor is copied with a single
strided numpy assignment for the whole run, however many blocks it spans.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash

__all__ = [
    "HEADER_LIMIT",
    "FileLayout",
    "layout_of_entries",
    "ParsedFile",
    "DATA_CHECKSUM",
    "data_checksum",
    "header_sha256",
    "dtype_of_code",
    "parse_file",
    "data_is_intact",
    "regions_are_intact",
    "read_tensor_entries",
    "encode_file",
    "encode_run",
    "decode_arrays",
]

HEADER_LIMIT = 1 << 24
"""Largest header a reader accepts (a corrupt length must not allocate gigabytes)."""

_CODES: dict[np.dtype, str] = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("<u8"): "U64",
    np.dtype("<u4"): "U32",
    np.dtype("<u2"): "U16",
    np.dtype("u1"): "U8",
    np.dtype("bool"): "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

_encoder = msgspec.json.Encoder()


DATA_CHECKSUM = "data_xxh3"
"""The metadata field that records a file's data checksum (:func:`data_checksum`)."""

_CRC32 = "data_crc32"
"""What a file of format 3 records instead: the CRC-32 of its data (zlib's)."""


def data_checksum(data: Any) -> str:
    """XXH3-64 of a bytes-like object as 16 lower-case hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def _is_format_3(info: Mapping[str, str]) -> bool:
    return info.get("format_version") == "3"


def _unset_checksum(info: Mapping[str, str]) -> dict[str, str]:
    """The checksum field of a file with metadata ``info``, at its width, before the data is known."""
    return {_CRC32: "0" * 8} if _is_format_3(info) else {DATA_CHECKSUM: "0" * 16}


def dtype_of_code(code: Any) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (ValueError if kvmem does not store it)."""
    try:
        dtype: np.dtype = _DTYPES[code]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tensor dtype {code!r}") from None
    return dtype


def can_store(dtype: np.dtype) -> bool:
    """Whether a file can hold a tensor of ``dtype`` (safetensors has a code for it)."""
    return (dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype) in _CODES


def _code(dtype: np.dtype) -> str:
    try:
        return _CODES[dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored") from None


def _c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of a file lies in its data section, and its header table.

    ``entries`` is the header's tensor table as JSON values (``dtype``,
    ``shape``, ``data_offsets``) in canonical order; a parsed header matches
    this layout exactly when its table equals ``entries``.
    """

    entries: dict[str, dict[str, Any]]
    dtypes: dict[str, np.dtype]
    shapes: dict[str, tuple[int, ...]]
    offsets: dict[str, int]
    data_size: int

    @classmethod
    def of(cls, tensors: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> FileLayout:
        """The canonical layout of tensors given as ``name -> (dtype, shape)`` (ValueError if a shape is not one).

        Layouts are memoized: every load and save of a model asks for the same few.
        """
        for name, (_, shape) in tensors.items():
            if not all(isinstance(size, int | np.integer) and size >= 0 for size in shape):
                raise ValueError(f"tensor {name} has shape {shape}")
        return _layout(
            tuple(
                (name, np.dtype(dtype).newbyteorder("<").str, tuple(int(size) for size in shape))
                for name, (dtype, shape) in tensors.items()
            )
        )

    def header(self, info: Mapping[str, str]) -> bytes:
        """The length prefix and padded JSON header of a file with metadata ``info``."""
        metadata = {"kvmem": json.dumps(dict(info), sort_keys=True, separators=(",", ":"))}
        body = _encoder.encode({"__metadata__": metadata, **self.entries})
        body += b" " * (-len(body) % 8)
        return len(body).to_bytes(8, "little") + body

    def header_size(self, info: Mapping[str, str]) -> int:
        """The length of :meth:`header` for ``info`` plus the data checksum its format records."""
        return len(self.header({**info, **_unset_checksum(info)}))


@functools.lru_cache(maxsize=64)
def _layout(tensors: tuple[tuple[str, str, tuple[int, ...]], ...]) -> FileLayout:
    dtypes = {name: np.dtype(code) for name, code, _ in tensors}
    shapes = {name: shape for name, _, shape in tensors}
    order = sorted(dtypes, key=lambda name: (-dtypes[name].itemsize, name))
    entries: dict[str, dict[str, Any]] = {}
    offsets: dict[str, int] = {}
    position = 0
    for name in order:
        nbytes = math.prod(shapes[name]) * dtypes[name].itemsize
        entries[name] = {
            "dtype": _code(dtypes[name]),
            "shape": list(shapes[name]),
            "data_offsets": [position, position + nbytes],
        }
        offsets[name] = position
        position += nbytes
    return FileLayout(
        entries,
        {name: dtypes[name] for name in order},
        {name: shapes[name] for name in order},
        offsets,
        position,
    )


def layout_of_entries(entries: dict[str, Any]) -> FileLayout:
    """The canonical layout of the tensors a header's table lists (:meth:`ParsedFile.entries`; ValueError if malformed)."""
    try:
        return FileLayout.of(
            {
                name: (dtype_of_code(entry["dtype"]), tuple(entry["shape"]))
                for name, entry in entries.items()
            }
        )
    except (TypeError, KeyError) as exc:
        raise ValueError(f"malformed tensor entry: {exc}") from exc


class _MetadataOnly(msgspec.Struct):
    metadata: dict[str, str] = msgspec.field(name="__metadata__")


_metadata_decoder = msgspec.json.Decoder(_MetadataOnly)


@dataclass(frozen=True)
class ParsedFile:
    """A file's header: kvmem metadata, the raw header, where the data starts, its checksum.

    Only the metadata is decoded; :meth:`matches` checks the tensor table
    against an expected layout by re-encoding the header, and
    :meth:`entries` decodes the table where no layout is expected.
    """

    info: dict[str, str]
    header: bytes
    data_start: int
    header_sha256: str

    def has_info(self, expected: Mapping[str, str]) -> bool:
        """Whether the metadata holds every field of ``expected`` with its value."""
        return all(self.info.get(key) == value for key, value in expected.items())

    def matches(self, layout: FileLayout) -> bool:
        """Whether the header is exactly the canonical header of ``layout`` with this metadata."""
        return layout.header(self.info) == self.header

    def entries(self) -> dict[str, Any]:
        """The tensor table, decoded (ValueError if malformed)."""
        try:
            header = msgspec.json.decode(self.header[8:])
        except msgspec.DecodeError as exc:
            raise ValueError(f"safetensors header does not decode: {exc}") from exc
        if not isinstance(header, dict):
            raise ValueError("safetensors header is not an object")
        header.pop("__metadata__", None)
        return header


def parse_file(data: Any, *, size: int | None = None) -> ParsedFile:
    """Parse the header of a file (or of its first bytes); ValueError if malformed.

    ``size`` is the whole file's length when ``data`` is only its header.
    Checks the metadata, not the table or the data (see :meth:`ParsedFile.matches`
    and :func:`data_is_intact`).
    """
    view = memoryview(data).cast("B")
    total = len(view) if size is None else size
    if len(view) < 8:
        raise ValueError("file shorter than a safetensors header")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > min(total - 8, HEADER_LIMIT) or header_len > len(view) - 8:
        raise ValueError("safetensors header runs past the end of the file")
    header = bytes(view[: 8 + header_len])
    try:
        metadata = _metadata_decoder.decode(header[8:]).metadata
        info = json.loads(metadata["kvmem"])
    except (msgspec.DecodeError, KeyError, ValueError) as exc:
        raise ValueError(f"safetensors header has no kvmem metadata: {exc}") from exc
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise ValueError("kvmem metadata is not a string map")
    return ParsedFile(
        info=info,
        header=header,
        data_start=8 + header_len,
        header_sha256=hashlib.sha256(header).hexdigest(),
    )


def header_sha256(file: Any) -> str:
    """The checksum of a whole file this module wrote: the SHA-256 of its header."""
    view = memoryview(file).cast("B")
    return hashlib.sha256(view[: 8 + int.from_bytes(view[:8], "little")]).hexdigest()


def data_is_intact(data: Any, parsed: ParsedFile) -> bool:
    """Whether the data section of the whole file ``data`` has the checksum its header records."""
    view = memoryview(data).cast("B")
    return regions_are_intact([view[parsed.data_start :]], parsed)


def regions_are_intact(regions: Iterable[Any], parsed: ParsedFile) -> bool:
    """Whether a file's data, read as ``regions`` (joined in order), has the checksum its header records.

    The file says which: XXH3-64 (format 4 on), or the CRC-32 of a format-3
    file, which a load still reads.
    """
    if _is_format_3(parsed.info):
        crc = 0
        for region in regions:
            crc = zlib.crc32(region, crc)
        return parsed.info.get(_CRC32) == f"{crc:08x}"
    state = xxhash.xxh3_64()
    for region in regions:
        state.update(region)
    return parsed.info.get(DATA_CHECKSUM) == state.hexdigest()


def read_tensor_entries(data: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's safetensors dtype and shape, from a file or its header (ValueError if malformed)."""
    entries = {}
    for name, entry in parse_file(data).entries().items():
        if not isinstance(entry, dict):
            raise ValueError(f"header entry {name!r} is not an object")
        entries[name] = (str(entry.get("dtype")), tuple(entry.get("shape", ())))
    return entries


def encode_file(tensors: Mapping[str, np.ndarray], info: Mapping[str, str]) -> bytes:
    """The bytes of one file holding ``tensors``, with ``info`` (plus its data checksum) as metadata."""
    layout = FileLayout.of({name: (a.dtype, a.shape) for name, a in tensors.items()})
    data = np.empty(layout.data_size, dtype=np.uint8)
    for name, offset in layout.offsets.items():
        target = _view(data, offset, layout.dtypes[name], layout.shapes[name])
        target[...] = tensors[name]
    header = layout.header({**info, DATA_CHECKSUM: data_checksum(data)})
    return header + data.tobytes()


def _view(
    buffer: np.ndarray,
    offset: int,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    count: int | None = None,
    stride: int = 0,
) -> np.ndarray:
    """A tensor inside ``buffer`` at ``offset``; with ``count``, the same tensor in ``count`` files ``stride`` apart."""
    strides = _c_strides(shape, dtype.itemsize)
    if count is not None:
        shape, strides = (count, *shape), (stride, *strides)
    return np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset, strides=strides)


def _run_slice(source: np.ndarray, start: int, count: int, tokens: int) -> np.ndarray:
    """Tokens ``start : start + count * tokens`` of ``(H, T, ...)`` as ``(count, H, tokens, ...)``."""
    heads, token_stride, *inner = source.strides
    shape = (count, source.shape[0], tokens, *source.shape[2:])
    strides = (tokens * token_stride, heads, token_stride, *inner)
    if source.flags.c_contiguous:  # the fast way to make the view, ~1/3 of as_strided's cost
        return np.ndarray(
            shape, dtype=source.dtype, buffer=source, offset=start * token_stride, strides=strides
        )
    part = source[:, start:]
    return np.lib.stride_tricks.as_strided(
        part, shape=shape, strides=strides, writeable=part.flags.writeable
    )


def encode_run(
    sources: Mapping[str, np.ndarray],
    layout: FileLayout,
    *,
    start: int,
    count: int,
    tokens: int,
    info: Callable[[int], dict[str, str]],
) -> list[memoryview]:
    """Files of ``count`` consecutive ``tokens``-token pieces from ``start``, back to back.

    ``sources`` maps each tensor of ``layout`` to its ``(H, T, ...)`` array;
    ``info(i)`` gives file ``i``'s metadata, which must have the same length
    for every file (fixed-width fields), so that the files have one size.
    """
    header_len = layout.header_size(info(0))
    file_size = header_len + layout.data_size
    buffer = np.empty(count * file_size, dtype=np.uint8)
    for name, offset in layout.offsets.items():
        target = _view(
            buffer,
            header_len + offset,
            layout.dtypes[name],
            layout.shapes[name],
            count=count,
            stride=file_size,
        )
        target[...] = _run_slice(sources[name], start, count, tokens)
    whole = memoryview(buffer.data).cast("B")
    files = [whole[index * file_size : (index + 1) * file_size] for index in range(count)]
    for index, file in enumerate(files):
        header = layout.header({**info(index), DATA_CHECKSUM: data_checksum(file[header_len:])})
        if len(header) != header_len:
            raise ValueError("files of one run need headers of one length")
        file[:header_len] = header
    return files


def decode_arrays(
    data: Any, parsed: ParsedFile, layout: FileLayout, names: Iterable[str]
) -> dict[str, np.ndarray]:
    """Copies of tensors ``names`` of a file whose header :meth:`~ParsedFile.matches` ``layout``."""
    buffer = np.frombuffer(data, dtype=np.uint8)
    return {
        name: _view(
            buffer, parsed.data_start + layout.offsets[name], layout.dtypes[name], layout.shapes[name]
        ).copy()
        for name in names
    }
