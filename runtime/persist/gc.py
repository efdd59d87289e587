"""Garbage collection of a cache directory: blocks no manifest lists, orphan agent files, temporary files.

Every manifest of every agent counts, whatever its model. A manifest of
another format version keeps the blocks and agent files it lists; if its
layout is unknown, or a manifest cannot be read at all, no block is removed.
An undecodable manifest of this version references nothing: its cache cannot
load anyway. Temporary files are what a killed save left behind
(:func:`runtime.persist.files.write_atomic`); opening a cache directory removes them too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

from runtime.persist.files import remove_file, remove_temp_files
from runtime.persist.format import BLOCK_NAME
from runtime.persist.manifests import kept_files, read_listings
from runtime.persist.pieces import remove_own_files

if TYPE_CHECKING:
    from runtime.persist.directory import CachePaths

__all__ = ["collect_garbage", "remove_leftover_temp_files"]

log = logging.getLogger("kvmem.persist")


def remove_leftover_temp_files(paths: CachePaths) -> int:
    """Delete the ``*.tmp`` files of every folder of the cache directory; return how many."""
    dirs = [paths.root, paths.blocks, paths.agents, *paths.block_shards(), *paths.agent_dirs()]
    return sum(remove_temp_files(d) for d in dirs)


def collect_garbage(paths: CachePaths) -> int:
    """Remove blocks no manifest references, orphan agent files and temp files; return how many files.

    An agent folder without any manifest (a first save that never reached
    its manifest) is emptied of kvmem's files and removed.
    """
    removed = remove_leftover_temp_files(paths)
    referenced: set[str] = set()
    keep_all_blocks = False
    for agent_dir in paths.agent_dirs():
        try:
            listings = read_listings(agent_dir)
        except OSError as exc:
            log.warning("cannot read %s: %s; keeping every block", agent_dir, exc)
            keep_all_blocks = True
            continue
        if not listings:  # a first save that never reached its manifest
            removed += remove_own_files(agent_dir, keep=())
            with contextlib.suppress(OSError):
                agent_dir.rmdir()
            continue
        for listing in listings:
            if listing.blocks is None:
                path = agent_dir / listing.name
                log.warning("manifest %s has an unknown layout; keeping every block", path)
                keep_all_blocks = True
            else:
                referenced.update(listing.blocks)
        kept = kept_files(listings)
        if kept is not None:
            removed += remove_own_files(agent_dir, keep=kept)
    if keep_all_blocks:
        return removed
    for shard in paths.block_shards():
        for name in os.listdir(shard):
            if BLOCK_NAME.fullmatch(name) and name.removesuffix(".safetensors") not in referenced:
                removed += remove_file(shard / name)
    return removed
