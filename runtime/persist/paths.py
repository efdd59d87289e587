"""Where an open cache directory keeps things: its folders, an agent's folder, a piece's file.

:class:`CachePaths` is what save, load, garbage collection and the agent
listing share: the root, ``blocks/`` (sharded by the first two hex digits of a
block's hash), ``agents/`` (one folder per agent, named by
:func:`safe_agent_dirname`), and whether writes under them are fsynced.
Opening one creates the folders (``0o700``).

An agent id comes from a client (an HTTP path segment, a JSON field), so it is
untrusted. :func:`safe_agent_dirname` maps it to one path component under
``agents/`` that cannot escape the cache directory:

* ids that are already plain (``[a-z0-9][a-z0-9._-]{0,63}``) are used as is, so
  the directory stays readable;
* every other valid id becomes ``<readable prefix>~<hash>``: the prefix is the
  NFKC-normalized id with anything outside ``[A-Za-z0-9._-]`` replaced by ``_``
  (leading dots and dashes stripped, at most 32 characters), the hash is 128
  bits of SHA-256 over the *original* id. ``~`` never occurs in a plain name,
  and the hash tells apart ids that normalize alike (fullwidth ``U+FF41`` and ``a``), so two
  different ids never share a directory;
* empty, whitespace-only, over-long ids and ids holding control characters
  (NUL included) or lone surrogates raise :class:`InvalidAgentIdError`.

Upper-case letters take the hashed form on purpose: macOS volumes are
case-insensitive by default, where ``Alice`` and ``alice`` would otherwise
share a directory. The mapping is one-way for hashed names; the manifest keeps
the original id.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import InvalidAgentIdError
from runtime.persist.files import ensure_private_dir
from runtime.persist.format import BlockPiece, Piece

__all__ = ["MAX_AGENT_ID_CHARS", "CachePaths", "safe_agent_dirname", "subdirs"]

MAX_AGENT_ID_CHARS = 256
"""Longest accepted agent id, in code points."""

_PLAIN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9._-]+")
_PREFIX_CHARS = 32
_HASH_HEX = 32
_REJECTED_CATEGORIES = frozenset({"Cc", "Cs"})  # control characters, lone surrogates


def safe_agent_dirname(agent_id: str) -> str:
    """Return the directory name (one path component) that holds ``agent_id``'s cache.

    Args:
        agent_id: the id a client gave.

    Returns:
        A name made of ``[A-Za-z0-9._~-]`` that is never ``.``, ``..`` or hidden,
        distinct for distinct ids (also on case-insensitive file systems).

    Raises:
        InvalidAgentIdError: the id is not a string, is empty or blank, is longer
            than :data:`MAX_AGENT_ID_CHARS`, or contains a control character
            or a lone surrogate.
    """
    if not isinstance(agent_id, str):
        raise InvalidAgentIdError(
            f"agent id must be a string, not {type(agent_id).__name__}"
        )
    if not agent_id.strip():
        raise InvalidAgentIdError("agent id is empty")
    if len(agent_id) > MAX_AGENT_ID_CHARS:
        raise InvalidAgentIdError(
            f"agent id is {len(agent_id)} characters long; at most {MAX_AGENT_ID_CHARS} are allowed"
        )
    for char in agent_id:
        if unicodedata.category(char) in _REJECTED_CATEGORIES:
            raise InvalidAgentIdError(
                f"agent id contains the control character U+{ord(char):04X}"
            )
    if _PLAIN.fullmatch(agent_id):
        return agent_id
    normalized = unicodedata.normalize("NFKC", agent_id)
    prefix = _UNSAFE_RUN.sub("_", normalized).lstrip(".-")[:_PREFIX_CHARS] or "agent"
    digest = hashlib.sha256(b"kvmem-agent-id\0" + agent_id.encode("utf-8")).hexdigest()
    name = f"{prefix}~{digest[:_HASH_HEX]}"
    # Belt and braces: the construction above cannot produce these.
    if "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise InvalidAgentIdError(
            f"agent id {agent_id!r} cannot be mapped to a safe name"
        )
    return name


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
