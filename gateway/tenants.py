"""Tenants: API keys that each name a tenant, and each tenant's limits (``--api-keys FILE``).

The key file is TOML::

    # keys.toml  (kvmem serve --api-keys keys.toml, KVMEM_API_KEYS, or api_keys = "..." in kvmem.toml)
    [keys]
    "kvmem-acme-7c1d9e0b5a4f3e21" = "acme"        # a key as is
    "sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8" = "globex"   # or its SHA-256

    [limits]                     # every tenant's, unless its own table says otherwise; 0: no limit
    max_agents = 1000            # agents with a cache or a running actor
    max_disk_mb = 10240          # the tenant's cache subtree, MiB
    requests_per_minute = 600    # every request but /healthz

    [tenants.acme]
    max_agents = 50

    [tenants.ops]
    operator = true              # may read /metrics and run /v1/scenarios

A tenant may have several keys (rotation: add the new key, then remove the
old one). A key is looked up by its SHA-256, compared with every entry's in
constant time (``hmac.compare_digest``) and without stopping at a match, so
the time a lookup takes says nothing about which keys exist. Storing keys
hashed keeps the file useless to someone who reads it: ``printf %s KEY |
sha256sum``.

What a tenant is inside kvmem is :mod:`runtime.identity`: the gateway names
its agents in the tenant's namespace (:func:`runtime.identity.namespaced`), and
the runtime keeps their caches, listings and prefix sharing within it. This
module decides who the tenant is and whether its request may run: the rate
(a token bucket, 429 with ``Retry-After``), and before a turn its number of
agents and its bytes on disk (429 without ``Retry-After``: deleting agents
frees room, waiting does not).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import stat
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import trio
from msgspec import Meta

from gateway.errors import ApiError
from runtime.config import ConfigError
from runtime.identity import check_tenant_name, local_id, safe_agent_dirname

if TYPE_CHECKING:
    from actors.supervisor import Runtime

__all__ = ["Limits", "Tenant", "TenantKeys", "load_tenant_keys", "retry_after", "HASHED_PREFIX", "OPERATOR_PATHS"]

log = logging.getLogger("kvmem.gateway")

HASHED_PREFIX = "sha256:"
"""A key file entry that starts with this is the key's SHA-256 (64 hex digits), not the key."""

MIN_KEY_CHARS = 16
"""A key as is shorter than this is accepted with a warning."""

OPERATOR_PATHS = ("/metrics", "/v1/scenarios")
"""With tenants, only operator tenants reach these (they see every tenant's load, and scenarios' agents)."""


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's limits; None (0 in the file) is no limit."""

    max_agents: Annotated[int, Meta(ge=0)] | None = None
    max_disk_mb: Annotated[float, Meta(ge=0)] | None = None
    requests_per_minute: Annotated[int, Meta(ge=0)] | None = None


class _TenantTable(Limits, frozen=True, kw_only=True, forbid_unknown_fields=True):
    operator: bool = False


class _KeyFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    keys: dict[str, str]
    limits: Limits = Limits()
    tenants: dict[str, _TenantTable] = {}


@dataclass
class Tenant:
    """One tenant: its name, limits and the state its limits need.

    Attributes:
        name: also its agents' namespace and its cache folder's name.
        limits: the limits that apply to it (its own over the file's ``[limits]``).
        operator: may reach :data:`OPERATOR_PATHS`.
    """

    name: str
    limits: Limits
    operator: bool = False
    clock: Callable[[], float] = time.monotonic
    _tokens: float = field(default=0.0, init=False)
    _refilled_at: float | None = field(default=None, init=False)
    _admitting: trio.Lock = field(default_factory=trio.Lock, init=False)

    def take_request(self) -> float | None:
        """Count one request against the rate; None when it may run, else the seconds until it could.

        A token bucket of ``requests_per_minute`` tokens refilled evenly: a burst of a minute's
        requests passes, and then one per ``60 / requests_per_minute`` seconds.
        """
        rpm = self.limits.requests_per_minute
        if not rpm:
            return None
        now = self.clock()
        if self._refilled_at is None:
            self._tokens = float(rpm)
        else:
            self._tokens = min(float(rpm), self._tokens + (now - self._refilled_at) * rpm / 60.0)
        self._refilled_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return (1.0 - self._tokens) * 60.0 / rpm

    async def admit(self, rt: Runtime, agent_id: str) -> None:
        """Before a turn of ``agent_id`` (in this tenant's namespace): refuse it over the tenant's limits.

        A new agent counts against ``max_agents`` from here: its actor starts under the
        tenant's lock, so concurrent requests that each create an agent cannot all pass.

        Raises:
            ApiError: 429 ``tenant_agent_limit`` or ``tenant_disk_limit``.
        """
        max_agents, max_mb = self.limits.max_agents, self.limits.max_disk_mb
        if not max_agents and not max_mb:
            return
        async with self._admitting:
            used = await rt.tenant_usage(self.name)
            if max_mb and used.disk_bytes >= max_mb * 2**20:
                raise ApiError(429, "rate_limit", f"tenant {self.name!r} holds {used.disk_bytes} bytes of caches, "
                               f"its limit is {max_mb:g} MiB: delete agents (DELETE /v1/agents/{{id}}) to free room",
                               code="tenant_disk_limit")
            new = safe_agent_dirname(local_id(agent_id)) not in used.agent_dirs
            if new and max_agents and len(used.agent_dirs) >= max_agents:
                raise ApiError(429, "rate_limit", f"tenant {self.name!r} has {len(used.agent_dirs)} agents, its "
                               f"limit is {max_agents}: delete agents (DELETE /v1/agents/{{id}}) to make room",
                               code="tenant_agent_limit")
            if new:
                rt.start(agent_id)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class TenantKeys:
    """The key file, loaded: which tenant a key names.

    Args:
        entries: (SHA-256 of a key, tenant name) pairs.
        tenants: the tenants by name.
    """

    def __init__(self, entries: list[tuple[bytes, str]], tenants: Mapping[str, Tenant]) -> None:
        self._entries = entries
        self.tenants = dict(tenants)

    def resolve(self, given: str | None) -> Tenant | None:
        """The tenant ``given`` is a key of (None: no key, or not a key in the file); constant time."""
        if given is None:
            return None
        digest = _digest(given)
        found: str | None = None
        for entry, name in self._entries:  # every entry, always: no early exit on a match
            if hmac.compare_digest(entry, digest):
                found = name
        return None if found is None else self.tenants[found]


def _entry_digest(key: str, tenant: str, path: Path) -> bytes:
    if key.startswith(HASHED_PREFIX):
        hexdigest = key[len(HASHED_PREFIX):].lower()
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ConfigError(f"key file {path}: {key[:16]}... is not 'sha256:' and 64 hex digits")
        return bytes.fromhex(hexdigest)
    if not key or key != key.strip() or any(c.isspace() for c in key):
        raise ConfigError(f"key file {path}: a key is empty or holds white space")
    if len(key) < MIN_KEY_CHARS:  # unauthenticated requests are not rate limited: a short key can be guessed
        log.warning("key file %s: a key of tenant %r has %d characters; use %d or more (e.g. openssl rand -hex 24)",
                    path, tenant, len(key), MIN_KEY_CHARS)
    return _digest(key)


def _merged(default: Limits, own: _TenantTable | None) -> Limits:
    values = {f: getattr(own, f, None) for f in Limits.__struct_fields__}
    values = {f: getattr(default, f) if v is None else v for f, v in values.items()}
    return Limits(**{f: v or None for f, v in values.items()})  # 0: no limit


def load_tenant_keys(path: str | os.PathLike[str], *, clock: Callable[[], float] = time.monotonic) -> TenantKeys:
    """Read a key file (see the module docstring).

    Raises:
        ConfigError: unreadable, not TOML, an unknown table or setting, a bad tenant
            name, a bad hashed key, or one key given twice (as is and hashed).
    """
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            info = os.fstat(f.fileno())
            data = tomllib.load(f)
        parsed = msgspec.convert(data, _KeyFile)
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"key file {path} is not valid TOML: {exc}") from exc
    except msgspec.ValidationError as exc:
        raise ConfigError(f"key file {path}: {exc}") from exc
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("key file %s can be read by other users (mode %o); chmod 600 it", path, info.st_mode & 0o777)
    if not parsed.keys:
        raise ConfigError(f"key file {path} has no [keys]: nobody could use the server")
    try:
        for name in {*parsed.keys.values(), *parsed.tenants}:
            check_tenant_name(name)
    except ValueError as exc:
        raise ConfigError(f"key file {path}: {exc}") from None
    entries: list[tuple[bytes, str]] = []
    seen: dict[bytes, str] = {}
    for key, name in parsed.keys.items():
        digest = _entry_digest(key, name, path)
        if digest in seen:
            raise ConfigError(f"key file {path}: one key is given twice (as is and hashed), for tenants "
                              f"{seen[digest]!r} and {name!r}")
        seen[digest] = name
        entries.append((digest, name))
    tenants = {
        name: Tenant(name, _merged(parsed.limits, parsed.tenants.get(name)),
                     operator=bool(parsed.tenants.get(name, _TenantTable()).operator), clock=clock)
        for name in dict.fromkeys(parsed.keys.values())
    }
    return TenantKeys(entries, tenants)


def retry_after(seconds: float) -> int:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return max(1, math.ceil(seconds))
