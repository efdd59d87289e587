"""The shared tier: the cache directory's files mirrored in Redis, so any node serves any agent.

:class:`RemoteTier` copies an agent's cache between this node's cache directory
(the fast tier) and a Redis server (the shared tier), file by file, as the
very bytes the directory holds: canonical safetensors files with their data checksum
and manifests that record each file's checksum. Keys (``<dir>`` is
:func:`~runtime.persist.directory.safe_agent_dirname` of the agent id; the
braces keep an agent's keys in one Redis Cluster slot)::

    kvmem:block:<hash>                 a shared 256-token block, stored once for the cluster (SET NX)
    kvmem:agent:{<dir>}:<file>         the agent's segments and state files (content-named, SET NX)
    kvmem:agent:{<dir>}:manifest-<d>   the agent's manifest for a model: replaced last, by one script
    kvmem:agent:{<dir>}:fence-manifest-<d>   the lease fence the manifest was published under
    kvmem:agent:{<dir>}:files-manifest-<d>   the keys of the files the manifest names (for reference counts)
    kvmem:agent:{<dir>}:manifests      the agent's manifest keys (a set: what forgetting drops)
    kvmem:agent:{<dir>}:lease          the agent's lease: ``<node>:<fence>``, expiring
    kvmem:agent:{<dir>}:fence          the agent's lease counter (INCR)
    kvmem:agent:{<dir>}:forgotten      the fence the agent was last forgotten at (its tombstone)
    kvmem:refs                         how many current manifests name each file key (a hash)

* :meth:`RemoteTier.publish` (after a disk save, write-behind) sends the files
  Redis lacks, then swaps the manifest in with one Lua script, so a reader sees
  the old manifest or the new one, each with every file it names (the script
  checks they exist). With a fence (a lease's counter), the script refuses to
  replace a manifest published under a newer fence, or to publish under a fence
  older than the agent's tombstone: a holder whose lease expired cannot publish
  over its successor, nor bring back a forgotten agent.
* :meth:`RemoteTier.pull` (before a load, for an agent with no hot cache)
  compares Redis's manifest with the local one; when they differ it checks
  the manifest (:func:`~runtime.persist.manifests.check_manifest`), fetches the
  files the disk lacks, checks each one's size, header checksum and data checksum,
  writes them atomically and the manifest last. The caller then loads from
  disk, which verifies everything again (:func:`~runtime.persist.load.load_cache`).
  Anything wrong in Redis is a logged miss, never an error.
* :meth:`RemoteTier.lease` / :meth:`RemoteTier.release`: one holder per agent
  across the cluster (``SET NX PX``, fenced by ``INCR``).
* Garbage collection and forgetting across nodes: reference counts kept by the
  manifest swap, and a fenced tombstone (:mod:`runtime.persist.remote_scripts`).
  :meth:`RemoteTier.check` tells the lease holder whether its own copy of an
  agent is older than Redis's or was forgotten since.

Redis down or slow is not an error either: every call catches the client's
errors, marks the tier unavailable (:attr:`RemoteTier.up`, logged once per
outage) and answers as if Redis had nothing; the node serves from its own
disk. Not thread-safe: the cache store calls it from its one disk thread.
"""

from __future__ import annotations

import logging
import secrets
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import redis
from redis.exceptions import RedisError

from runtime.errors import CacheMiss, CorruptCacheError
from runtime.persist.codec import data_is_intact, header_sha256, parse_file
from runtime.persist.files import AtomicBatch, read_header, read_regular_file, write_atomic
from runtime.persist.format import BlockPiece, Piece, StateRef
from runtime.persist.manifests import check_manifest, decode_manifest, manifest_name
from runtime.persist.pieces import block_is_intact
from runtime.persist.remote_scripts import (
    DELETE_UNREFERENCED,
    FORGET,
    PUBLISH_MANIFEST,
    PUBLISHED,
    RELEASE,
    RENEW,
    STALE,
)

if TYPE_CHECKING:
    from pathlib import Path

    from runtime.persist.directory import CachePaths

__all__ = ["RemoteTier", "RemoteEntry", "Lease", "Freshness", "redacted_url"]

log = logging.getLogger("kvmem.remote")

_T = TypeVar("_T")

TIMEOUT_S = 2.0
"""Connect and read timeout of each Redis call: a slow Redis is a down Redis."""

LEASE_MS = 30_000
"""How long a lease lasts unless renewed or released (a dead node's lease expires)."""

RETRY_S = 5.0
"""After a call fails, further calls answer at once as if Redis had nothing for this long (but a ping
tries), so a Redis that does not answer costs one timeout per :data:`RETRY_S`, not one per call."""

PUBLISH_TRIES = 3
"""How often a publish sends files again that vanished before its manifest went in (collected meanwhile)."""

Freshness = Literal["current", "newer", "forgotten"]
"""What :meth:`RemoteTier.check` finds: this node's copy of an agent is Redis's latest, older, or forgotten since."""


def redacted_url(url: str) -> str:
    """``url`` without its password (for logs, ``/healthz`` and ``/metrics``), in the netloc or the query."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "password" for name, _ in query):
        redacted = [(name, "***" if name == "password" else value) for name, value in query]
        parts = parts._replace(query=urllib.parse.urlencode(redacted, safe="/*"))
    return urllib.parse.urlunsplit(parts)


@dataclass(frozen=True)
class Lease:
    """An agent's lease, held by this node: ``fence`` orders holders (a newer one is larger)."""

    agent_id: str
    token: str
    fence: int


@dataclass(frozen=True)
class RemoteEntry:
    """One cache published in Redis (an agent's, for one model), as :meth:`RemoteTier.list_agents` lists it."""

    agent_id: str
    model_tag: str
    num_tokens: int
    updated_at: float


class RemoteTier:
    """An agent cache mirror in Redis at ``url`` for the cache directory ``paths`` (see the module docstring).

    Args:
        url: ``redis://[:PASSWORD@]HOST:PORT/DB`` or ``rediss://`` (TLS), as the client takes it.
        paths: this node's cache directory.
        prefix: the first part of every key.
        timeout_s: connect and read timeout of each call.
        lease_ms: how long a lease lasts unless renewed or given back.
    """

    def __init__(
        self, url: str, paths: CachePaths, *, prefix: str = "kvmem", timeout_s: float = TIMEOUT_S,
        lease_ms: int = LEASE_MS,
    ) -> None:
        self.url = redacted_url(url)
        self._paths = paths
        self._prefix = prefix
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           health_check_interval=0)
        self._publish_manifest = self._redis.register_script(PUBLISH_MANIFEST)
        self._forget = self._redis.register_script(FORGET)
        self._delete_unreferenced = self._redis.register_script(DELETE_UNREFERENCED)
        self._release = self._redis.register_script(RELEASE)
        self._renew = self._redis.register_script(RENEW)
        self._node = secrets.token_hex(8)
        self.lease_ms = lease_ms
        self._down_until = float("-inf")
        self._seen: dict[str, int] = {}  # manifest key -> fence of the manifest this node last published or pulled
        self._checked: dict[str, int] = {}  # agent dir -> the tombstone this node's copies of the agent are past
        self.up = True
        self.errors = 0
        self.pulls = 0
        self.publishes = 0
        self.stale_publishes = 0
        self.corrupt = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def close(self) -> None:
        """Close the client's connections."""
        self._redis.close()

    # -- keys --------------------------------------------------------------------

    def _agent_key(self, agent_dir: Path, name: str) -> str:
        return f"{self._prefix}:agent:{{{agent_dir.name}}}:{name}"

    def _refs_key(self) -> str:
        return f"{self._prefix}:refs"

    def _block_key(self, block_hash: str) -> str:
        return f"{self._prefix}:block:{block_hash}"

    def _key(self, agent_dir: Path, ref: Piece | StateRef) -> str:
        return self._block_key(ref.name) if isinstance(ref, BlockPiece) else self._agent_key(agent_dir, ref.name)

    def _path(self, agent_dir: Path, ref: Piece | StateRef) -> Path:
        return agent_dir / ref.name if isinstance(ref, StateRef) else self._paths.piece_path(agent_dir, ref)

    # -- availability ------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], _T], default: _T) -> _T:
        """``fn()``; on a Redis error the tier is down (logged once per outage) and the answer ``default``."""
        if not self.up and what != "ping" and time.monotonic() < self._down_until:
            return default
        try:
            result = fn()
        except (RedisError, OSError) as exc:
            self.errors += 1
            if self.up:  # the client's messages name host and port, never the password
                log.warning("Redis at %s is unreachable (%s: %s: %s); serving from the local tier", self.url,
                            what, type(exc).__name__, exc)
            self.up = False
            self._down_until = time.monotonic() + RETRY_S
            return default
        except CacheMiss as exc:  # a local manifest that does not decode: nothing to publish
            log.warning("Redis %s skipped: %s", what, exc)
            return default
        if not self.up:
            log.warning("Redis at %s is reachable again", self.url)
        self.up = True
        return result

    def ping(self) -> bool:
        """Whether Redis answers (and :attr:`up` updated)."""
        return self._call("ping", lambda: bool(self._redis.ping()), False)

    # -- publish -----------------------------------------------------------------

    def publish(self, agent_id: str, model_tag: str, *, fence: int | None = None) -> bool | None:
        """Send the agent's cache for ``model_tag`` from disk to Redis: missing files, then the manifest.

        Returns:
            True when published (or already there), False when a newer fence's
            manifest is there (nothing replaced), None when Redis is down or
            there is no local cache to publish.
        """
        return self._call("publish", lambda: self._publish(agent_id, model_tag, fence), None)

    def _publish(self, agent_id: str, model_tag: str, fence: int | None) -> bool | None:
        agent_dir = self._paths.agent_dir(agent_id)
        name = manifest_name(model_tag)
        data = read_regular_file(agent_dir / name)
        if data is None:
            return None
        manifest = decode_manifest(data)
        by_key: dict[str, Piece | StateRef] = {self._key(agent_dir, ref): ref for ref in (*manifest.pieces,
                                                                                          manifest.state)}
        keys = list(by_key)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        missing = [key for key, there in zip(keys, pipe.execute(), strict=True) if not there]
        manifest_key = self._agent_key(agent_dir, name)
        script_keys = [manifest_key, *(self._agent_key(agent_dir, f"{what}-{name}") for what in ("fence", "files")),
                       self._agent_key(agent_dir, "forgotten"), self._refs_key(),
                       self._agent_key(agent_dir, "manifests")]
        for _ in range(PUBLISH_TRIES):
            if not self._send(agent_id, agent_dir, [(key, by_key[key]) for key in missing]):
                return None
            answer = self._publish_manifest(keys=script_keys, args=[data, fence or 0, *keys])
            self.bytes_sent += len(data)
            if answer == STALE:  # this node's next turn of the agent finds why in check(): newer or forgotten
                self.stale_publishes += 1
                log.warning("not publishing the cache of %r: a newer lease holder published (or forgot it) since",
                            agent_id)
                return False
            if answer == PUBLISHED:
                self._seen[manifest_key] = fence or 0
                self.publishes += 1
                return True
            missing = [key.decode() if isinstance(key, bytes) else str(key) for key in answer]  # collected meanwhile
        log.warning("not publishing the cache of %r: its files kept vanishing from Redis", agent_id)
        return None

    def _send(self, agent_id: str, agent_dir: Path, files: list[tuple[str, Piece | StateRef]]) -> bool:
        """``SET NX`` each of ``files`` from the disk; False (logged) when one is missing locally."""
        pipe = self._redis.pipeline(transaction=False)
        for key, ref in files:
            raw = read_regular_file(self._path(agent_dir, ref))
            if raw is None or len(raw) != ref.size:
                log.warning("not publishing the cache of %r: %s is missing locally", agent_id, ref.name)
                return False
            pipe.set(key, raw, nx=True)
            self.bytes_sent += len(raw)
        if files:
            pipe.execute()
        return True

    # -- pull --------------------------------------------------------------------

    def pull(self, agent_id: str, model_tag: str) -> bool:
        """Bring Redis's cache of the agent for ``model_tag`` onto the disk when it differs from the local one.

        Returns:
            True when the local directory now holds Redis's (newer) cache; False
            when Redis has none, the same one, a damaged one (logged) or is down.
        """
        return self._call("pull", lambda: self._pull(agent_id, model_tag), False)

    def _pull(self, agent_id: str, model_tag: str) -> bool:
        agent_dir = self._paths.agent_dir(agent_id)
        name = manifest_name(model_tag)
        manifest_key = self._agent_key(agent_dir, name)
        data, fence = self._redis.mget([manifest_key, self._agent_key(agent_dir, "fence-" + name)])
        if data is None:
            return False
        self._seen[manifest_key] = int(fence or 0)
        if data == read_regular_file(agent_dir / name):
            return False
        assert isinstance(data, bytes)
        try:
            manifest = decode_manifest(data)
            check_manifest(manifest, agent_id=agent_id, model_tag=model_tag)
            refs = [ref for ref in (*manifest.pieces, manifest.state) if not self._on_disk(agent_dir, ref)]
            raws = self._redis.mget([self._key(agent_dir, ref) for ref in refs]) if refs else []
            for ref, raw in zip(refs, raws, strict=True):
                self._check_file(ref, raw, model_tag, manifest.format_version)
        except CacheMiss as exc:
            self.corrupt += 1
            log.warning("the cache of %r in Redis is unusable: %s", agent_id, exc)
            return False
        with AtomicBatch(fsync=self._paths.fsync) as batch:
            batch.ensure_dir(agent_dir)
            for ref, raw in zip(refs, raws, strict=True):
                path = self._path(agent_dir, ref)
                batch.ensure_dir(path.parent)
                batch.write(path, raw)
                self.bytes_received += len(raw)
            batch.commit()
        write_atomic(agent_dir / name, data, fsync=self._paths.fsync)
        self.bytes_received += len(data)
        self.pulls += 1
        return True

    def check(self, agent_id: str, model_tag: str) -> Freshness:
        """Whether this node's copy of the agent (hot or on disk) is still Redis's latest, for the lease holder.

        ``"forgotten"``: the agent was forgotten (on any node) since this node
        last checked: the caller drops every local copy of it, hot and on disk.
        ``"newer"``: another node published the agent's cache for ``model_tag``
        since this node last published or pulled it: a hot cache is older than
        Redis's (still correct to reuse, but it covers less of the
        conversation), so the caller drops it and pulls. ``"current"`` otherwise,
        and when Redis does not answer.
        """
        agent_dir = self._paths.agent_dir(agent_id)
        manifest_key = self._agent_key(agent_dir, manifest_name(model_tag))

        def ask() -> Freshness:
            tombstone, fence = self._redis.mget([self._agent_key(agent_dir, "forgotten"),
                                                 self._agent_key(agent_dir, "fence-" + manifest_name(model_tag))])
            if tombstone is not None and int(tombstone) > self._checked.get(agent_dir.name, 0):
                self._checked[agent_dir.name] = int(tombstone)  # the caller drops its copies now
                return "forgotten"
            return "newer" if fence is not None and int(fence) > self._seen.get(manifest_key, 0) else "current"

        return self._call("check", ask, "current")

    def _on_disk(self, agent_dir: Path, ref: Piece | StateRef) -> bool:
        header = read_header(self._path(agent_dir, ref), size=ref.size)
        return header is not None and header_sha256(header) == ref.sha256

    @staticmethod
    def _check_file(ref: Piece | StateRef, raw: Any, model_tag: str, version: int) -> None:
        """CorruptCacheError unless ``raw`` is the whole file ``ref`` names: size, header checksum, data checksum."""
        if not isinstance(raw, bytes) or len(raw) != ref.size:
            raise CorruptCacheError(f"{ref.name} is missing or has the wrong size")
        try:
            parsed = parse_file(raw)
        except ValueError as exc:
            raise CorruptCacheError(f"{ref.name}: {exc}") from exc
        if parsed.header_sha256 != ref.sha256 or not data_is_intact(raw, parsed):
            raise CorruptCacheError(f"{ref.name}: checksum differs from the manifest")
        if isinstance(ref, BlockPiece) and not block_is_intact(raw, model_tag=model_tag, block_hash=ref.name,
                                                               like=None, version=version):
            raise CorruptCacheError(f"block {ref.name} is not the block its name says")

    # -- forget ------------------------------------------------------------------

    def list_agents(self) -> list[RemoteEntry]:
        """Every cache published in Redis with a readable manifest (an empty list when Redis does not answer).

        One ``SCAN`` for the manifest keys and one ``MGET`` for the manifests; a manifest that
        does not decode is skipped (a load would treat it as a miss too).
        """

        def scan() -> list[RemoteEntry]:
            keys = sorted(self._redis.scan_iter(match=f"{self._prefix}:agent:*:manifest-*", count=500))
            if not keys:
                return []
            entries = []
            for key, data in zip(keys, self._redis.mget(keys), strict=True):
                if data is None:
                    continue  # forgotten between the scan and the read
                try:
                    manifest = decode_manifest(data)
                except CacheMiss as exc:
                    log.warning("skipping an unreadable manifest in Redis (%s): %s", key.decode(errors="replace"), exc)
                    continue
                entries.append(RemoteEntry(agent_id=manifest.agent_id, model_tag=manifest.model_tag,
                                           num_tokens=manifest.num_tokens, updated_at=manifest.updated_at))
            return entries

        return self._call("list", scan, [])

    def forget(self, agent_id: str) -> bool:
        """Forget the agent cluster-wide: a tombstone, its manifests gone, and every file no other manifest names.

        Other nodes drop their own copies when they next take the agent's lease
        (:meth:`check`). Returns whether Redis held any cache of the agent.
        """
        agent_dir = self._paths.agent_dir(agent_id)

        def delete() -> bool:
            script_keys = [self._agent_key(agent_dir, what) for what in ("fence", "forgotten")]
            tombstone, deleted = self._forget(keys=[*script_keys, self._refs_key(),
                                                    self._agent_key(agent_dir, "manifests")], args=["fence-", "files-"])
            self._checked[agent_dir.name] = int(tombstone)
            # Files of publishes that never reached a manifest (no references: safe to delete at any time).
            pattern = [self._agent_key(agent_dir, f"{kind}-*") for kind in ("seg", "state")]
            orphans = [k for match in pattern for k in self._redis.scan_iter(match=match, count=500)]
            if orphans:
                self._delete_unreferenced(keys=[self._refs_key(), *orphans])
            for key in [k for k in self._seen if k.startswith(self._agent_key(agent_dir, ""))]:
                del self._seen[key]
            return bool(deleted or orphans)

        return self._call("forget", delete, False)

    # -- leases ------------------------------------------------------------------

    def lease(self, agent_id: str, *, lease_ms: int | None = None) -> Lease | None:
        """Take the agent's lease for this node; None when another node holds it.

        Redis down: a lease that fences nothing (``fence`` 0), so the node serves
        from its local tier instead of refusing the turn.
        """
        agent_dir = self._paths.agent_dir(agent_id)

        def take() -> Lease | None:
            key = self._agent_key(agent_dir, "lease")
            fence = int(self._redis.incr(self._agent_key(agent_dir, "fence")))
            token = f"{self._node}:{fence}"
            if not self._redis.set(key, token, nx=True, px=lease_ms or self.lease_ms):
                return None
            return Lease(agent_id, token, fence)

        unfenced: Lease | None = Lease(agent_id, "", 0)
        return self._call("lease", take, unfenced)

    def renew(self, lease: Lease, *, lease_ms: int | None = None) -> bool:
        """Extend ``lease``; False when it expired and someone else may hold it."""
        if not lease.token:
            return True
        key = self._agent_key(self._paths.agent_dir(lease.agent_id), "lease")
        args = [lease.token, lease_ms or self.lease_ms]
        return self._call("renew", lambda: bool(self._renew(keys=[key], args=args)), True)

    def release(self, lease: Lease) -> None:
        """Give ``lease`` back (only if it is still ours)."""
        if not lease.token:
            return
        key = self._agent_key(self._paths.agent_dir(lease.agent_id), "lease")
        self._call("release", lambda: self._release(keys=[key], args=[lease.token]), 0)

