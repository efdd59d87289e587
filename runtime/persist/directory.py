"""The cache directory itself: where it keeps things and its one entry point.

:class:`CacheDirectory` is the entry point: a thin facade that opens the
directory once and hands each call its :class:`CachePaths`; every operation
lives in its own module (:mod:`runtime.persist.save`,
:mod:`runtime.persist.load`, :mod:`runtime.persist.gc`,
:mod:`runtime.persist.agents`), which takes those paths.

:class:`CachePaths` is where things are: the root, ``blocks/`` (sharded by the
first two hex digits of a block's hash), ``agents/`` (one folder per agent,
named by :func:`safe_agent_dirname`), a piece's file, and whether writes under
them are fsynced. Opening one creates the folders (``0o700``).

The folder an agent id names is decided with the rest of an agent's identity, in
:func:`runtime.identity.safe_agent_dirname`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.identity import MAX_AGENT_ID_CHARS, safe_agent_dirname
from runtime.persist.agents import AgentEntry, agent_exists, delete_agent, list_agents
from runtime.persist.files import ensure_private_dir
from runtime.persist.format import BlockPiece, Piece, block_chain_hashes
from runtime.persist.gc import collect_garbage, remove_leftover_temp_files
from runtime.persist.load import load_cache
from runtime.persist.owner import OwnerLock, unless_owned
from runtime.persist.prefix_blocks import read_prefix_blocks
from runtime.persist.save import SaveReport, save_cache
from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot

__all__ = ["CacheDirectory", "CachePaths", "MAX_AGENT_ID_CHARS", "safe_agent_dirname", "subdirs"]

log = logging.getLogger("kvmem.persist")


# -- where things are ----------------------------------------------------------

def subdirs(parent: Path) -> list[Path]:
    """The directories directly inside ``parent`` (not following symlinks); empty if it cannot be listed."""
    try:
        return [Path(e.path) for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


@dataclass(frozen=True)
class CachePaths:
    """The folders and file names of one cache directory, and whether its writes are fsynced.

    Attributes:
        root: the cache directory.
        fsync: fsync files and directories on write.
    """

    root: Path
    fsync: bool

    @classmethod
    def open(cls, root: Path, *, fsync: bool) -> CachePaths:
        """Create ``root``, ``blocks/`` and ``agents/`` (``0o700``) where they are missing."""
        paths = cls(Path(root), fsync)
        if not paths.root.is_dir():
            paths.root.parent.mkdir(parents=True, exist_ok=True)
            ensure_private_dir(paths.root, fsync=fsync)
        ensure_private_dir(paths.blocks, fsync=fsync)
        ensure_private_dir(paths.agents, fsync=fsync)
        return paths

    @property
    def blocks(self) -> Path:
        """``root/blocks``: the shared blocks, in ``<hh>/`` shards."""
        return self.root / "blocks"

    @property
    def agents(self) -> Path:
        """``root/agents``: one folder per agent."""
        return self.root / "agents"

    def agent_dir(self, agent_id: str) -> Path:
        """The folder of ``agent_id``'s caches (InvalidAgentIdError if the id cannot name one)."""
        return self.agents / safe_agent_dirname(agent_id)

    def agent_dirs(self) -> list[Path]:
        """Every agent folder there is."""
        return subdirs(self.agents)

    def block_shards(self) -> list[Path]:
        """The folders of ``blocks/`` (``<hh>/``)."""
        return subdirs(self.blocks)

    def block_path(self, block_hash: str) -> Path:
        """``blocks/<hh>/<hash>.safetensors``."""
        return self.blocks / block_hash[:2] / f"{block_hash}.safetensors"

    def piece_path(self, agent_dir: Path, piece: Piece) -> Path:
        """A shared block's file under ``blocks/``, a segment's in ``agent_dir``."""
        if isinstance(piece, BlockPiece):
            return self.block_path(piece.name)
        return agent_dir / piece.name


# -- the entry point -----------------------------------------------------------


class CacheDirectory:
    """Agents' caches in ``root`` (see :mod:`runtime.persist` for the layout).

    The only code that touches a cache directory. Not thread-safe: callers
    serialize calls (the cache store runs one disk operation at a time).

    Args:
        root: the cache directory; created (``0o700``) if absent.
        fsync: fsync files and directories on save (off only in tests and
            benchmarks where durability across power loss does not matter).

    Opening removes ``*.tmp`` files that a killed save left behind, unless another
    live process owns the directory (:mod:`runtime.persist.owner`) and may be
    writing them: only ``owner``, the lock this process holds, or nobody, may clean.
    """

    def __init__(self, root: Path, *, fsync: bool = True, owner: OwnerLock | None = None) -> None:
        self._paths = CachePaths.open(Path(root), fsync=fsync)
        self.root = self._paths.root
        self.paths = self._paths
        if owner is not None and owner.held and owner.root == self.root:
            removed = remove_leftover_temp_files(self._paths)
        else:
            with unless_owned(self.root) as unowned:
                removed = remove_leftover_temp_files(self._paths) if unowned else 0
                if not unowned:
                    log.info("%s is owned by a running kvmem: its temporary files are left alone", self.root)
        if removed:
            log.info("removed %d temporary files left by an interrupted save", removed)

    def save(
        self, agent_id: str, snapshot: CacheSnapshot, *, block_hashes: Sequence[str] | None = None
    ) -> SaveReport:
        """Store ``snapshot`` as ``agent_id``'s cache for its model, replacing that model's previous one.

        Writes only the tokens the previous save of the same model did not
        store (see :mod:`runtime.persist.pieces`), the state file if it changed,
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

    def read_prefix_blocks(
        self, model_tag: str, token_ids: Sequence[int], *, layer_kinds: Sequence[LayerKind]
    ) -> list[LayerSnapshot]:
        """The layers of the longest run of ``token_ids``' whole blocks stored here, whoever saved them
        (see :mod:`runtime.persist.prefix_blocks`): an empty list when there is none."""
        return read_prefix_blocks(self._paths, model_tag, token_ids, layer_kinds=layer_kinds)
