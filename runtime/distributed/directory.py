"""Rank 0's cache directory: every save, load and delete is also done by each follower on its own part.

Each rank keeps its part of every cache (its KV heads) in its own folder
(:func:`runtime.distributed.launch.rank_cache_dir`), written and read by the
ordinary :class:`runtime.persist.CacheDirectory`. :class:`ShardedDirectory`
is that class on rank 0, with each call also sent to the followers:

* **save**: each follower saves its part of the same turn's cache (the snapshot
  travels as a handle); the save fails if any rank's failed: ``OSError`` (the
  store retries) for a disk error, ``ValueError`` (not retried) when a rank holds
  no part of that cache.
* **load**: each follower reads its part while rank 0 reads its own; the load is a
  hit only if every rank read its part and all parts cover the same tokens and
  text (their fingerprints agree). Otherwise it is a :class:`CacheMiss` on
  every rank (the followers drop what they read): a turn never starts from
  some ranks' parts.
* **delete** and **garbage collection** run on every rank.

Listing and ``exists`` answer from rank 0's folder alone: rank 0's parts stand
for the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from runtime.distributed.leader import Leader
from runtime.distributed.wire import CollectGarbage, DeletePart, LoadPart, PartDone, PartLoaded, Reply, SavePart
from runtime.errors import CacheMiss
from runtime.persist import CacheDirectory, SaveReport
from runtime.spec import CacheSnapshot

__all__ = ["ShardedDirectory", "fingerprint"]

log = logging.getLogger("kvmem.distributed")


def fingerprint(snapshot: CacheSnapshot) -> str:
    """What every rank's part of one cache must agree on: its tokens and text (not its tag, which names the rank)."""
    body = json.dumps([snapshot.token_ids, snapshot.offsets, snapshot.text]).encode()
    return hashlib.sha256(body).hexdigest()


class ShardedDirectory(CacheDirectory):
    """Rank 0's part of every cache, in ``root``; the followers' parts, through ``leader`` (see the module docstring).

    Args:
        root: rank 0's cache folder.
        fsync: as :class:`runtime.persist.CacheDirectory`.
        leader: the connections to the other ranks.
    """

    def __init__(self, root: Path, *, fsync: bool = True, leader: Leader) -> None:
        super().__init__(root, fsync=fsync)
        self._leader = leader

    def save(
        self, agent_id: str, snapshot: CacheSnapshot, *, block_hashes: Sequence[str] | None = None
    ) -> SaveReport:
        handle = self._leader.handles.of(snapshot)  # ValueError: not a cache these ranks computed
        self._leader.ask_start(SavePart(agent_id=agent_id, handle=handle))
        try:
            report = super().save(agent_id, snapshot, block_hashes=block_hashes)
        finally:
            replies = self._leader.ask_finish()
        failed = [f"rank {rank}: {r.error}" for rank, r in enumerate(replies, 1)
                  if not isinstance(r, PartDone) or r.error is not None]
        if any(isinstance(r, PartDone) and r.missing for r in replies):
            # No retry can help: the rank never computed its part (its engine call failed).
            raise ValueError(f"saving {agent_id!r}: another rank has no part of this cache ({'; '.join(failed)})")
        if failed:
            raise OSError(f"saving {agent_id!r} failed on another rank ({'; '.join(failed)})")
        return report

    def load(self, agent_id: str, *, model_tag: str) -> CacheSnapshot:
        handles = self._leader.handles
        handle = handles.new()
        try:
            self._leader.ask_start(LoadPart(agent_id=agent_id, model_tag=model_tag, handle=handle))
            try:
                snapshot = super().load(agent_id, model_tag=model_tag)  # rank 0's own miss is a plain miss
            finally:
                replies = self._leader.ask_finish()
            self._check_parts(agent_id, fingerprint(snapshot), replies)
            handles.bind(snapshot, handle)
            return snapshot
        finally:
            handles.settle(handle)  # a miss: the followers drop the parts they read

    @staticmethod
    def _check_parts(agent_id: str, mine: str, replies: list[Reply]) -> None:
        """Raise a logged :class:`CacheMiss` unless every follower read a part covering what rank 0's covers."""
        for rank, reply in enumerate(replies, 1):
            if not isinstance(reply, PartLoaded) or reply.fingerprint is None:
                why = reply.error if isinstance(reply, PartLoaded) else "no answer"
                problem = f"rank {rank} has no part of it ({why})"
            elif reply.fingerprint != mine:
                problem = f"rank {rank}'s part covers other tokens than rank 0's"
            else:
                continue
            log.warning("the cache of %r is a miss on every rank: %s", agent_id, problem)
            raise CacheMiss(f"the cache of {agent_id!r}: {problem}")

    def delete(self, agent_id: str) -> None:
        self._leader.ask_start(DeletePart(agent_id))
        try:
            super().delete(agent_id)
        finally:
            replies = self._leader.ask_finish()
        for rank, reply in enumerate(replies, 1):
            if isinstance(reply, PartDone) and reply.error is not None:
                raise OSError(f"forgetting {agent_id!r} failed on rank {rank}: {reply.error}")

    def collect_garbage(self) -> int:
        self._leader.send(CollectGarbage())
        return super().collect_garbage()
