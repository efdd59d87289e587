"""One cache subtree per tenant: which cache directory an agent id names.

Layout (the default namespace is the cache directory as kvmem keeps it without tenants)::

    caches/
      blocks/ agents/                 agents without a tenant (no key, one --api-key)
      tenants/<tenant>/blocks/        tenant <tenant>'s shared blocks
      tenants/<tenant>/agents/<dir>/  its agents (<dir>: safe_agent_dirname of the id it gave)

Each tenant's subtree is a whole :class:`~runtime.persist.CacheDirectory`, so
saves, loads, verification and garbage collection are the same code; only the
place differs. Blocks are deduplicated within a tenant and never across
tenants: a block file that already exists is not written again, and a tenant
must not be able to tell from a save that another tenant holds its prompt.
Deleting an agent collects the garbage of its own subtree only. The manifest
keeps the id as the tenant gave it; listings put the tenant back in front
(:func:`runtime.identity.namespaced`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import msgspec

from runtime.errors import InvalidAgentIdError
from runtime.persist.agents import AgentEntry
from runtime.persist.directory import CacheDirectory
from runtime.persist.files import ensure_private_dir
from runtime.persist.save import SaveReport
from runtime.spec import CacheSnapshot, LayerKind, LayerSnapshot
from runtime.identity import check_agent_id, check_tenant_name, namespaced, safe_agent_dirname, split_agent_id

__all__ = ["TenantDirectories", "TenantUsage", "TENANTS_DIR"]

TENANTS_DIR = "tenants"
"""The folder of the tenants' subtrees, inside the cache directory."""


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one tenant holds on disk.

    Attributes:
        agent_dirs: the folder names of its agents with a cache on disk
            (:func:`~runtime.identity.safe_agent_dirname` of each id: distinct per agent).
        disk_bytes: every file of its subtree, shared blocks once.
    """

    agent_dirs: frozenset[str]
    disk_bytes: int


class TenantDirectories:
    """The cache directory with a subtree per tenant (see the module docstring).

    The same calls as :class:`~runtime.persist.CacheDirectory`, each sent to the
    directory the agent id's tenant names. Not thread-safe (the cache store runs
    one disk operation at a time), like the directories it holds.

    Args:
        default: the cache directory itself (agents without a tenant).
    """

    def __init__(self, default: CacheDirectory) -> None:
        self.default = default
        self._fsync = default.paths.fsync
        self._tenants: dict[str, CacheDirectory] = {}

    def tenant_root(self, tenant: str) -> Path:
        """``<cache dir>/tenants/<tenant>``."""
        return self.default.root / TENANTS_DIR / check_tenant_name(tenant)

    def directory(self, tenant: str | None) -> CacheDirectory:
        """The cache directory of ``tenant`` (None: the default one), opened (and created) on first use."""
        if tenant is None:
            return self.default
        found = self._tenants.get(tenant)
        if found is None:
            root = self.tenant_root(tenant)
            ensure_private_dir(root.parent, fsync=self._fsync)
            found = self._tenants[tenant] = CacheDirectory(root, fsync=self._fsync)
        return found

    def _of(self, agent_id: str) -> tuple[CacheDirectory, str]:
        tenant, local = split_agent_id(check_agent_id(agent_id))  # the normalized id names the folder
        return self.directory(tenant), local

    def save(self, agent_id: str, snapshot: CacheSnapshot, *, block_hashes: Sequence[str] | None = None
             ) -> SaveReport:
        """:meth:`CacheDirectory.save` in the agent's directory."""
        directory, local = self._of(agent_id)
        return directory.save(local, snapshot, block_hashes=block_hashes)

    def load(self, agent_id: str, *, model_tag: str) -> CacheSnapshot:
        """:meth:`CacheDirectory.load` from the agent's directory."""
        directory, local = self._of(agent_id)
        return directory.load(local, model_tag=model_tag)

    def read_prefix_blocks(
        self, agent_id: str, model_tag: str, token_ids: Sequence[int], *, layer_kinds: Sequence[LayerKind]
    ) -> list[LayerSnapshot]:
        """:meth:`CacheDirectory.read_prefix_blocks` of the agent's tenant: never another tenant's blocks."""
        directory, _ = self._of(agent_id)
        return directory.read_prefix_blocks(model_tag, token_ids, layer_kinds=layer_kinds)

    def exists(self, agent_id: str, *, model_tag: str | None = None) -> bool:
        """:meth:`CacheDirectory.exists` in the agent's directory."""
        directory, local = self._of(agent_id)
        return directory.exists(local, model_tag=model_tag)

    def delete(self, agent_id: str) -> None:
        """Forget the agent's caches, then the blocks of its directory no other agent of it references."""
        directory, local = self._of(agent_id)
        directory.delete(local)
        directory.collect_garbage()

    def list_agents(self, tenant: str | None = None) -> list[AgentEntry]:
        """The stored caches of ``tenant`` (None: the default namespace), ids as kvmem names them."""
        if tenant is not None and not self.tenant_root(tenant).is_dir():
            return []  # listing creates nothing
        entries = self.directory(tenant).list_agents()
        if tenant is None:
            return entries
        return [dataclasses.replace(e, agent_id=namespaced(tenant, e.agent_id)) for e in entries]

    def list_all_agents(self) -> list[AgentEntry]:
        """The stored caches of the default namespace and of every tenant with a subtree, ids as kvmem names them."""
        entries = self.default.list_agents()
        try:
            tenants = sorted(e.name for e in os.scandir(self.default.root / TENANTS_DIR)
                             if e.is_dir(follow_symlinks=False))
        except OSError:
            tenants = []
        for tenant in tenants:
            try:
                entries += self.list_agents(tenant)
            except ValueError:  # a folder that names no tenant (not kvmem's): skipped
                continue
        return entries

    def usage(self, tenant: str) -> TenantUsage:
        """The agents and bytes ``tenant`` holds on disk (a walk of its subtree; links are not followed)."""
        root = self.tenant_root(tenant)
        total = 0
        for folder, _dirs, files in os.walk(root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    pass  # removed meanwhile
        try:
            agents = frozenset(e.name for e in os.scandir(root / "agents") if e.is_dir(follow_symlinks=False))
        except OSError:
            agents = frozenset()
        return TenantUsage(agent_dirs=agents, disk_bytes=total)
