"""A prompt's first whole blocks read from the tenant's shared blocks, by their hash chain, without a manifest.

Every 256-token block a save wrote whole lies in ``blocks/`` under the hash chain of
the token ids up to its end (:func:`runtime.persist.format.block_chain_hashes`), whoever
saved it. So a prompt that begins with tokens some agent of the tenant once cached — a
sibling agent's system prompt, an agent's own earlier branch — can start from those
blocks when no cache in RAM holds them: after a restart, or once the hot tier dropped
them. :func:`read_prefix_blocks` hashes the prompt's whole blocks and reads the longest
chain of them on disk.

Only a model whose every layer is blocked (no sliding window) can start this way: a
sliding layer lives in an agent's state file, not in blocks. Each block is checked as a
load checks it (its own metadata, the hash it is named by, its data checksum, its
layout), and one that fails is removed (the next save rewrites it) and ends the chain
there: a damaged block is a logged miss, never an error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from runtime.persist.codec import decode_arrays, layout_of_entries, parse_file
from runtime.persist.files import read_regular_file, remove_file
from runtime.persist.format import block_chain_hashes, layout_problem
from runtime.persist.pieces import block_is_intact
from runtime.spec import BLOCK_TOKENS, LayerKind, LayerSnapshot

if TYPE_CHECKING:
    from runtime.persist.directory import CachePaths

__all__ = ["read_prefix_blocks"]

log = logging.getLogger("kvmem.persist")

_TENSOR = re.compile(r"L(\d+)\.(\w+)")


def read_prefix_blocks(
    paths: CachePaths, model_tag: str, token_ids: Sequence[int], *, layer_kinds: Sequence[LayerKind]
) -> list[LayerSnapshot]:
    """The layers of the longest run of ``token_ids``' whole blocks stored in ``paths``, from the first.

    Returns every layer's arrays over ``k * 256`` tokens (k >= 0; an empty list when the first block
    is not there). ``layer_kinds``: the model's layers, each blocked (``q4`` or ``float``).
    """
    if any(kind is LayerKind.SLIDING for kind in layer_kinds):
        return []
    blocks: list[dict[int, dict[str, np.ndarray]]] = []
    for block_hash in block_chain_hashes(model_tag, token_ids):
        layers = _read_block(paths, model_tag, block_hash, len(layer_kinds))
        if layers is None:
            break
        blocks.append(layers)
    if not blocks:
        return []
    out = []
    for index, kind in enumerate(layer_kinds):
        keys = blocks[0][index]
        arrays = {key: np.concatenate([block[index][key] for block in blocks], axis=1) for key in keys}
        problem = layout_problem(kind, arrays)
        if problem is not None:  # blocks of another KV format under this tag cannot be: a stale or forged file
            log.warning("blocks of %s do not fit layer %d: %s", model_tag, index, problem)
            return []
        out.append(LayerSnapshot(kind=kind, arrays=arrays))
    return out


def _read_block(paths: CachePaths, model_tag: str, block_hash: str, layers: int) -> dict[int, dict[str, np.ndarray]] | None:
    """One block's arrays by layer, or None: not there, damaged (removed, logged) or not a whole block."""
    path = paths.block_path(block_hash)
    raw = read_regular_file(path)
    if raw is None:
        return None
    if not block_is_intact(raw, model_tag=model_tag, block_hash=block_hash, like=None):
        log.warning("removing damaged cache file %s", path)
        remove_file(path)
        return None
    parsed = parse_file(raw)
    layout = layout_of_entries(parsed.entries())
    by_layer: dict[int, dict[str, np.ndarray]] = {}
    for name, array in decode_arrays(raw, parsed, layout, layout.offsets).items():
        found = _TENSOR.fullmatch(name)
        if found is None or array.ndim < 2 or array.shape[1] != BLOCK_TOKENS:
            log.warning("block %s holds %s %s: not a whole block", path.name, name, array.shape)
            return None
        by_layer.setdefault(int(found[1]), {})[found[2]] = array
    if sorted(by_layer) != list(range(layers)):
        log.warning("block %s holds layers %s, the model has %d", path.name, sorted(by_layer), layers)
        return None
    return by_layer
