"""The cache directory's one entry point: :class:`CacheDirectory`, a thin facade over save, load and gc.

Each operation lives in its own module (:mod:`runtime.persist.save`,
:mod:`runtime.persist.load`, :mod:`runtime.persist.gc`,
:mod:`runtime.persist.agents`); this class opens the directory once and hands
each call its :class:`~runtime.persist.paths.CachePaths`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from runtime.persist.agents import AgentEntry, agent_exists, delete_agent, list_agents
from runtime.persist.format import block_chain_hashes
from runtime.persist.gc import collect_garbage, remove_leftover_temp_files
from runtime.persist.load import load_cache
from runtime.persist.paths import CachePaths
from runtime.persist.save import SaveReport, save_cache
from runtime.snapshot import CacheSnapshot

__all__ = ["CacheDirectory"]

log = logging.getLogger("kvmem.persist")


class CacheDirectory:
    """Agents' caches in ``root`` (see :mod:`runtime.persist` for the layout).

    The only code that touches a cache directory. Not thread-safe: callers
    serialize calls (the cache store runs one disk operation at a time).

    Args:
        root: the cache directory; created (``0o700``) if absent.
        fsync: fsync files and directories on save (off only in tests and
            benchmarks where durability across power loss does not matter).

    Opening removes ``*.tmp`` files that a killed save left behind.
    """

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self._paths = CachePaths.open(Path(root), fsync=fsync)
        self.root = self._paths.root
        removed = remove_leftover_temp_files(self._paths)
        if removed:
            log.info("removed %d temporary files left by an interrupted save", removed)

    def save(
        self, agent_id: str, snapshot: CacheSnapshot, *, block_hashes: Sequence[str] | None = None
    ) -> SaveReport:
        """Store ``snapshot`` as ``agent_id``'s cache for its model, replacing that model's previous one.

        Writes only the tokens the previous save of the same model did not
        store (see :mod:`runtime.persist.plan`), the state file if it changed,
        and the manifest. A needed piece that is missing or damaged on disk is
        written again. The agent's caches for other models stay as they are.

        ``block_hashes``: the snapshot's full blocks' chain hashes when the caller
        already has them (:meth:`block_hashes`; the cache store computes them once
        per turn), so they are not computed twice.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
            ValueError: the snapshot is inconsistent (lengths, shapes, dtypes).
            OSError: the disk refused a write; the previous cache is untouched.
        """
        return save_cache(self._paths, agent_id, snapshot, block_hashes=block_hashes)

    def load(self, agent_id: str, *, model_tag: str) -> CacheSnapshot:
        """Read and fully verify ``agent_id``'s cache for ``model_tag``.

        Returns:
            A snapshot bit-identical to the one saved (up to a reused block, see
            :meth:`save`).

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
            CacheMiss: no cache is stored for ``agent_id`` and ``model_tag``
                (a cache of another model is no help).
            FormatVersionError: written by another version of the format.
            ForeignModelError: made by another model than ``model_tag`` (a
                pre-per-model ``manifest.json``, or a manifest that lies).
            CorruptCacheError: anything missing, truncated, failing a checksum
                or contradicting the manifest (logged as a warning).
        """
        return load_cache(self._paths, agent_id, model_tag=model_tag)

    def exists(self, agent_id: str, *, model_tag: str | None = None) -> bool:
        """Whether a manifest is stored for ``agent_id`` (not whether it loads).

        Args:
            model_tag: only a manifest for this model counts (a pre-per-model
                ``manifest.json`` counts for every model); None: any model's.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache (as every method).
        """
        return agent_exists(self._paths, agent_id, model_tag=model_tag)

    def delete(self, agent_id: str) -> None:
        """Forget ``agent_id``'s caches, every model's (their blocks go at the next :meth:`collect_garbage`)."""
        delete_agent(self._paths, agent_id)

    def list_agents(self) -> list[AgentEntry]:
        """Every stored cache with a readable manifest: one per agent and model, sorted by id then tag.

        Unreadable manifests are logged and skipped; a pre-per-model
        ``manifest.json`` is listed unless its model has saved since.
        """
        return list_agents(self._paths)

    def collect_garbage(self) -> int:
        """Remove blocks no manifest references, orphan agent files and temp files (see :mod:`runtime.persist.gc`).

        Returns:
            The number of files removed.
        """
        return collect_garbage(self._paths)

    def block_hashes(self, model_tag: str, token_ids: Sequence[int]) -> list[str]:
        """Chain hashes of the full blocks of ``token_ids`` (for shared-prefix lookups)."""
        return block_chain_hashes(model_tag, token_ids)
