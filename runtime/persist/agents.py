"""The agents a cache directory holds: listing their caches, asking whether one is stored, forgetting one.

An agent's folder holds one manifest per model it has saved with
(:mod:`runtime.persist.manifests`); these functions read those manifests
without loading any cache, and :func:`delete_agent` removes the folder (the
agent's shared blocks go at the next garbage collection, :mod:`runtime.persist.gc`).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.persist.files import fsync_dir, regular_file_size, remove_file
from runtime.persist.manifests import LEGACY_MANIFEST, manifest_name, manifest_names, read_listings

if TYPE_CHECKING:
    from runtime.persist.directory import CachePaths

__all__ = ["AgentEntry", "list_agents", "agent_exists", "delete_agent"]

log = logging.getLogger("kvmem.persist")


@dataclass(frozen=True)
class AgentEntry:
    """One stored cache (an agent's, for one model), as listed by :meth:`~runtime.persist.CacheDirectory.list_agents`.

    ``disk_bytes`` counts the manifest, the state file, the segments and every
    referenced block in full, including blocks shared with other agents.
    """

    agent_id: str
    model_tag: str
    num_tokens: int
    disk_bytes: int
    updated_at: float


def list_agents(paths: CachePaths) -> list[AgentEntry]:
    """Every stored cache with a readable manifest: one per agent and model, sorted by id then tag.

    Unreadable manifests are logged and skipped; a pre-per-model
    ``manifest.json`` is listed unless its model has saved since.
    """
    entries = []
    for agent_dir in paths.agent_dirs():
        try:
            listings = read_listings(agent_dir)
        except OSError as exc:
            log.warning("skipping unreadable agent directory %s: %s", agent_dir, exc)
            continue
        current = {listing.name for listing in listings}
        for listing in listings:
            manifest = listing.manifest
            path = agent_dir / listing.name
            if manifest is None:
                log.warning("skipping unreadable manifest %s: %s", path, listing.problem)
                continue
            if paths.agent_dir(manifest.agent_id).name != agent_dir.name:
                log.warning("skipping manifest %s: it names agent %r", path, manifest.agent_id)
                continue
            if listing.name == LEGACY_MANIFEST and manifest_name(manifest.model_tag) in current:
                continue  # superseded; the save that wrote its successor was cut short
            disk_bytes = listing.size + manifest.state.size + sum(piece.size for piece in manifest.pieces)
            entries.append(
                AgentEntry(
                    agent_id=manifest.agent_id,
                    model_tag=manifest.model_tag,
                    num_tokens=manifest.num_tokens,
                    disk_bytes=disk_bytes,
                    updated_at=manifest.updated_at,
                )
            )
    return sorted(entries, key=lambda entry: (entry.agent_id, entry.model_tag))


def agent_exists(paths: CachePaths, agent_id: str, *, model_tag: str | None = None) -> bool:
    """Whether a manifest is stored for ``agent_id`` (see :meth:`runtime.persist.CacheDirectory.exists`)."""
    agent_dir = paths.agent_dir(agent_id)
    if model_tag is None:
        try:
            names = manifest_names(agent_dir)
        except OSError:
            return False
    else:
        names = [manifest_name(model_tag), LEGACY_MANIFEST]
    return any(regular_file_size(agent_dir / name) is not None for name in names)


def delete_agent(paths: CachePaths, agent_id: str) -> None:
    """Remove ``agent_id``'s folder, its manifests first (see :meth:`runtime.persist.CacheDirectory.delete`)."""
    agent_dir = paths.agent_dir(agent_id)
    try:
        info = os.lstat(agent_dir)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        remove_file(agent_dir)
        return
    manifests = [
        agent_dir / name
        for name in manifest_names(agent_dir)
        if regular_file_size(agent_dir / name) is not None
    ]
    if manifests:
        # Without its manifests the agent is gone, even if a crash follows.
        for path in manifests:
            remove_file(path)
        if paths.fsync:
            fsync_dir(agent_dir)
    shutil.rmtree(agent_dir)
    if paths.fsync:
        fsync_dir(paths.agents)
