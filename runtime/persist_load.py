"""Verification and assembly of a stored cache (pure: bytes in, snapshot out).

Used by :meth:`runtime.persist.CacheDirectory.load`, which does the file
access. Every check raises a :class:`~runtime.errors.CacheMiss` subclass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec
import numpy as np
import safetensors.numpy

from runtime.errors import CorruptCacheError, ForeignModelError, FormatVersionError
from runtime.persist_format import (
    FORMAT_VERSION,
    BlockListProbe,
    BlockRef,
    FormatProbe,
    Manifest,
    block_chain_hashes,
    layout_problem,
    read_metadata,
    tensor_digest,
    tensor_name,
    unpack_int32,
)
from runtime.snapshot import BLOCK_TOKENS, CacheSnapshot, LayerKind, LayerSnapshot

__all__ = [
    "sha256_hex",
    "decode_manifest",
    "decode_block_list",
    "block_is_intact",
    "check_manifest",
    "assemble_snapshot",
]

_manifest_decoder = msgspec.json.Decoder(Manifest)
_probe_decoder = msgspec.json.Decoder(FormatProbe)
_block_list_decoder = msgspec.json.Decoder(BlockListProbe)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    """Block hashes of a manifest of any version that lists them like this one, else None."""
    try:
        return [block.hash for block in _block_list_decoder.decode(data).blocks]
    except msgspec.DecodeError:
        return None


def block_is_intact(
    data: bytes, *, model_tag: str, block_hash: str, like: dict[str, np.ndarray] | None
) -> bool:
    """Whether ``data`` is a whole block file for ``block_hash`` (and shaped like ``like``).

    Checks the block's own metadata and tensor digest, no manifest needed.
    """
    try:
        info = read_metadata(data)
        tensors = safetensors.numpy.load(data)
    except Exception:  # noqa: BLE001 - any parse failure means "not intact"
        return False
    if (
        info.get("kind") != "block"
        or info.get("format_version") != str(FORMAT_VERSION)
        or info.get("model_tag") != model_tag
        or info.get("block_hash") != block_hash
        or info.get("tensor_sha256") != tensor_digest(tensors)
    ):
        return False
    if like is None:
        return True
    return set(tensors) == set(like) and all(
        tensors[name].dtype == like[name].dtype
        and tensors[name].shape == like[name].shape
        for name in like
    )


def check_manifest(
    manifest: Manifest, *, agent_id: str, model_tag: str
) -> tuple[np.ndarray, np.ndarray]:
    """Check a manifest against itself; return its token ids and offsets.

    Raises:
        ForeignModelError: made by another model.
        CorruptCacheError: counts, offsets or the block hash chain disagree.
    """
    if manifest.model_tag != model_tag:
        raise ForeignModelError(
            f"cache made by model {manifest.model_tag!r}, not {model_tag!r}"
        )
    if manifest.agent_id != agent_id:
        raise CorruptCacheError(f"manifest names agent {manifest.agent_id!r}")
    try:
        token_ids = unpack_int32(manifest.token_ids)
        offsets = unpack_int32(manifest.offsets)
    except ValueError as exc:
        raise CorruptCacheError(f"token ids or offsets do not decode: {exc}") from exc
    num_tokens = manifest.num_tokens
    if not num_tokens == len(token_ids) == len(offsets):
        raise CorruptCacheError(
            f"manifest has {num_tokens} tokens, {len(token_ids)} ids, {len(offsets)} offsets"
        )
    if num_tokens and (
        offsets[0] < 0
        or offsets[-1] > len(manifest.text)
        or np.any(np.diff(offsets) < 0)
    ):
        raise CorruptCacheError("offsets decrease or run past the text")
    if num_tokens and token_ids.min() < 0:
        raise CorruptCacheError("negative token id")
    if [ref.hash for ref in manifest.blocks] != block_chain_hashes(
        model_tag, token_ids
    ):
        raise CorruptCacheError("block hashes do not match the token ids")
    keys = [
        (index, key)
        for index, record in enumerate(manifest.layers)
        for key in record.keys
    ]
    if len(set(keys)) != len(keys):
        raise CorruptCacheError("a layer lists a key twice")
    return token_ids, offsets


def assemble_snapshot(
    manifest: Manifest,
    token_ids: np.ndarray,
    offsets: np.ndarray,
    *,
    tail: bytes,
    read_block: Callable[[BlockRef], bytes],
) -> CacheSnapshot:
    """Rebuild the snapshot from verified tail bytes and blocks read one at a time.

    Output arrays are allocated from the tail's shapes and filled block by
    block, so memory peaks at the result plus one block.

    Raises:
        CorruptCacheError: a tensor is missing, extra, or of the wrong dtype or shape.
    """
    num_tokens = manifest.num_tokens
    num_blocks = len(manifest.blocks)
    tail_tokens = num_tokens - num_blocks * BLOCK_TOKENS
    records = {
        tensor_name(index, key): record
        for index, record in enumerate(manifest.layers)
        for key in record.keys
    }
    tail_arrays = safetensors.numpy.load(tail)
    if set(tail_arrays) != set(records):
        raise CorruptCacheError("tail tensors do not match the manifest's layers")
    out: dict[str, np.ndarray] = {}
    for name, record in records.items():
        array = tail_arrays[name]
        if array.ndim < 2:
            raise CorruptCacheError(f"tail tensor {name} has no token axis")
        if record.kind is LayerKind.SLIDING:
            if array.shape[1] > num_tokens:
                raise CorruptCacheError(
                    f"sliding tensor {name} holds more tokens than the cache"
                )
            out[name] = array
        elif array.shape[1] != tail_tokens:
            raise CorruptCacheError(
                f"tail tensor {name} has {array.shape[1]} tokens, expected {tail_tokens}"
            )
        elif num_blocks:
            out[name] = np.empty(
                (array.shape[0], num_tokens, *array.shape[2:]), dtype=array.dtype
            )
            out[name][:, num_blocks * BLOCK_TOKENS :] = array
        else:
            out[name] = array
    blocked = {
        name for name, record in records.items() if record.kind is not LayerKind.SLIDING
    }

    for index, ref in enumerate(manifest.blocks):
        raw = read_block(ref)
        info = read_metadata(raw)
        if (
            info.get("block_hash") != ref.hash
            or info.get("model_tag") != manifest.model_tag
            or info.get("tensor_sha256") != ref.tensor_sha256
        ):
            raise CorruptCacheError(f"block file {ref.hash} holds another block")
        arrays = safetensors.numpy.load(raw)
        if set(arrays) != blocked:
            raise CorruptCacheError(
                f"block {index} tensors do not match the manifest's layers"
            )
        start = index * BLOCK_TOKENS
        for name in blocked:
            array, target = arrays[name], out[name]
            expected = (target.shape[0], BLOCK_TOKENS, *target.shape[2:])
            if array.dtype != target.dtype or array.shape != expected:
                raise CorruptCacheError(
                    f"block {index} tensor {name} is {array.dtype}{array.shape}, "
                    f"expected {target.dtype}{expected}"
                )
            target[:, start : start + BLOCK_TOKENS] = array

    layers = []
    for index, record in enumerate(manifest.layers):
        arrays = {key: out[tensor_name(index, key)] for key in record.keys}
        problem = layout_problem(record.kind, arrays)
        if problem is not None:
            raise CorruptCacheError(f"layer {index}: {problem}")
        layers.append(LayerSnapshot(kind=record.kind, arrays=arrays))
    return CacheSnapshot(
        model_tag=manifest.model_tag,
        text=manifest.text,
        token_ids=token_ids.tolist(),
        offsets=offsets.tolist(),
        layers=layers,
        meta=dict(manifest.meta),
    )
