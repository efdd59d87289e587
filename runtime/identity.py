"""Agent identity, decided in one place: the id rules, the folder an id names, tenants' namespaces, the cache key.

* :func:`check_agent_id` is the one check of an id a client gave, and returns the one
  spelling kvmem keys the agent by (NFC); ``Runtime.agent`` calls it, every door goes there.
* :func:`safe_agent_dirname` is the folder (one path component) that holds an agent's caches.
* :data:`AgentKey` is a cache's key everywhere it is kept: (agent id, model tag).
* Tenants live inside agent ids (below).

**Tenants inside agent ids**: one namespace per tenant that no client-chosen id can forge.

With ``api_keys`` (:mod:`gateway.tenants`), every request belongs to a tenant,
and the gateway names the agent ``<tenant>\\x1f<agent id>`` inside kvmem
(:func:`namespaced`). Everything below the gateway keys agents by that one
string, so the tenant travels with the agent through the registry of live
actors, the hot tier, the turns in flight and the cache directory without a
second argument anywhere:

* the cache directory keeps a tenant's agents in their own subtree
  (:class:`runtime.persist.tenants.TenantDirectories`);
* the cache manager only lets agents of one tenant start from each other's
  prefixes, and charges a tenant's blocks to the hot tier apart from another
  tenant's identical blocks (:func:`pool_key`), so no tenant can learn from a
  ``cached_tokens`` figure, or from the pool's accounting, what another tenant sent.

The separator is U+001F (a control character). Agent ids that clients give
are checked before they are namespaced, and a client id may not hold a control
character, so no id a client writes can contain it: ``acme\\x1fbob`` can only
come from the gateway, for tenant ``acme``. Ids without the separator are the
default namespace, exactly as kvmem names agents without tenants.

**The folder an id names.** An agent id comes from a client (an HTTP path segment, a JSON field), so it is
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

Plain Python, no I/O: every layer may import it.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import NamedTuple

from runtime.errors import InvalidAgentIdError

__all__ = [
    "AgentKey",
    "MAX_AGENT_ID_CHARS",
    "check_agent_id",
    "safe_agent_dirname",
    "TENANT_SEP",
    "TENANT_NAME",
    "check_tenant_name",
    "namespaced",
    "split_agent_id",
    "tenant_of",
    "local_id",
    "pool_key",
]

TENANT_SEP = "\x1f"
"""Between the tenant's name and the agent id the client gave (ASCII unit separator)."""

TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""A tenant name: lower case, digits, ``_`` and ``-``; it is also its cache folder's name."""


def check_tenant_name(name: str) -> str:
    """``name`` when it can name a tenant (see :data:`TENANT_NAME`).

    Raises:
        ValueError: it cannot (the message says what a name may hold).
    """
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r} is not valid: use 1-64 of a-z, 0-9, '_' and '-', "
                         "starting with a letter or digit")
    return name


def namespaced(tenant: str | None, agent_id: str) -> str:
    """The id kvmem uses for tenant ``tenant``'s agent ``agent_id`` (``agent_id`` itself without a tenant)."""
    return agent_id if tenant is None else f"{tenant}{TENANT_SEP}{agent_id}"


def split_agent_id(agent_id: str) -> tuple[str | None, str]:
    """(tenant, the id the tenant gave) of an id kvmem uses; (None, ``agent_id``) in the default namespace."""
    tenant, sep, local = agent_id.partition(TENANT_SEP)
    return (tenant, local) if sep else (None, agent_id)


def tenant_of(agent_id: str) -> str | None:
    """The tenant an agent belongs to (None: the default namespace)."""
    return split_agent_id(agent_id)[0]


def may_share(agent_id: str, other_id: str) -> bool:
    """Whether ``agent_id`` may start from a prefix of ``other_id``'s cache: another agent of its own tenant
    (a tenant's agents never start from another tenant's prefix; whether they opted in is the caller's)."""
    return other_id != agent_id and tenant_of(other_id) == tenant_of(agent_id)


def local_id(agent_id: str) -> str:
    """The id as its tenant knows it (what the HTTP answers show)."""
    return split_agent_id(agent_id)[1]


def pool_key(agent_id: str, block_hash: str) -> str:
    """A block's name in the hot tier's accounting: its hash, within the agent's tenant.

    Identical blocks of one tenant are charged once; the same block held by two
    tenants is charged to each, so whether a block is already in RAM says nothing
    about another tenant.
    """
    tenant = tenant_of(agent_id)
    return block_hash if tenant is None else f"{tenant}{TENANT_SEP}{block_hash}"


# -- the id of an agent ------------------------------------------------------------

class _AgentModel(NamedTuple):
    agent_id: str
    model_tag: str


class AgentKey(_AgentModel):
    """A cache's key wherever one is kept (the hot tier, the pending saves, the read-ahead, the
    shared tier): an agent id in the one spelling :func:`check_agent_id` returns (every door checks
    it first: ``Runtime.agent``) and a model tag, checked again when the key is made, so no layer
    keys a cache by an id the doors would refuse or spell otherwise. A pair, so it hashes and
    compares as one; read by name.

    Raises:
        InvalidAgentIdError: ``agent_id`` is not a checked id (or ``model_tag`` is empty).
    """

    __slots__ = ()

    def __new__(cls, agent_id: str, model_tag: str) -> AgentKey:
        if check_agent_id(agent_id) != agent_id:
            raise InvalidAgentIdError(f"agent id {agent_id!r} is not in its checked spelling")
        if not isinstance(model_tag, str) or not model_tag:
            raise InvalidAgentIdError(f"a cache's key needs its model tag, not {model_tag!r}")
        return super().__new__(cls, agent_id, model_tag)

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


DOT_SEGMENTS = frozenset({".", ".."})
"""Ids :func:`check_agent_id` refuses: no URL path can hold them as a segment."""


def is_checked_agent_id(agent_id: object) -> bool:
    """Whether ``agent_id`` is an id as :func:`check_agent_id` returns it (what an :class:`AgentKey` holds):
    for ids read back from disk or Redis, which a cache written by an older kvmem may spell otherwise."""
    try:
        return isinstance(agent_id, str) and check_agent_id(agent_id) == agent_id
    except InvalidAgentIdError:
        return False


def check_agent_id(agent_id: str) -> str:
    """``agent_id`` once checked, in the one spelling kvmem keys the agent by.

    The id part is NFC-normalized, so the composed and decomposed spellings of one
    name (``café`` as ``e`` + U+0301 or as U+00E9) are one agent, one cache and one
    folder, whichever door (header, body field, path, CLI) the id came in by. It may
    not hold U+FFFD: a lenient decoder writes that character for bytes that were not
    valid UTF-8, so two different byte strings would otherwise become one agent. It
    may not be ``.`` or ``..`` (:data:`DOT_SEGMENTS`), which no URL can name.

    Returns:
        The normalized id (the tenant part, if any, unchanged): callers key the agent by it.

    Raises:
        InvalidAgentIdError: either part cannot name a cache.
    """
    if not isinstance(agent_id, str):
        safe_agent_dirname(agent_id)  # raises, naming the type
    tenant, local = split_agent_id(agent_id)
    if tenant is not None:
        try:
            check_tenant_name(tenant)
        except ValueError as exc:
            raise InvalidAgentIdError(str(exc)) from None
    if "\ufffd" in local:
        raise InvalidAgentIdError("agent id contains U+FFFD (the replacement character, left where bytes "
                                  "were not valid UTF-8)")
    if local in DOT_SEGMENTS:
        # A URL cannot name it: browsers (and the WHATWG URL parser) resolve "." and ".." segments, even
        # percent-encoded, so /v1/agents/{id} and the operator page could never reach or forget it.
        raise InvalidAgentIdError(f"agent id {local!r} is a relative path segment no URL can name; choose another")
    local = unicodedata.normalize("NFC", local)
    safe_agent_dirname(local)
    return namespaced(tenant, local)
