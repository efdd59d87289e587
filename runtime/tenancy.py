"""Tenants inside agent ids: one namespace per tenant that no client-chosen id can forge.

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

Plain Python, no I/O: every layer may import it.
"""

from __future__ import annotations

import re

__all__ = [
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
