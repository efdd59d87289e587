"""Agent ids to directory names that cannot escape the cache directory.

An agent id comes from a client (an HTTP path segment, a JSON field), so it is
untrusted. :func:`safe_agent_dirname` maps it to one path component under
``agents/``:

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
import re
import unicodedata

from runtime.errors import InvalidAgentIdError

__all__ = ["MAX_AGENT_ID_CHARS", "safe_agent_dirname"]

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
