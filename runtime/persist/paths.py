"""Where an open cache directory keeps things: its folders, an agent's folder, a piece's file.

:class:`CachePaths` is what save, load, garbage collection and the agent
listing share: the root, ``blocks/`` (sharded by the first two hex digits of a
block's hash), ``agents/`` (one folder per agent, named by
:func:`~runtime.persist.names.safe_agent_dirname`), and whether writes under
them are fsynced. Opening one creates the folders (``0o700``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime.persist.files import ensure_private_dir
from runtime.persist.format import BlockPiece, Piece
from runtime.persist.names import safe_agent_dirname

__all__ = ["CachePaths", "subdirs"]


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
