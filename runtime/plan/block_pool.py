"""Memory accounting for KV caches in 256-token blocks (mechanism, not policy).

A :class:`BlockPool` turns a byte budget into ``budget_bytes // bytes_per_block``
blocks of :data:`~runtime.spec.BLOCK_TOKENS` tokens. Owners (agents) hold
two kinds of blocks:

* **private** blocks, grown by :meth:`BlockPool.reserve` to cover an owner's
  tokens;
* **shared** blocks, named by content (the persistence layer's block hashes)
  and reference-counted by :meth:`BlockPool.share`: a block that N owners share
  is charged to the pool once.

The pool only counts. Deciding whom to evict, when to admit a request or how
large a batch may grow is the caller's policy, built on :meth:`can_allocate`,
:meth:`agents_that_fit` and :meth:`stats`. Plain Python: no trio, no MLX, not
thread-safe (one owner of the pool calls it).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import msgspec

from runtime.errors import BudgetExceededError
from runtime.spec import BLOCK_TOKENS

__all__ = ["PoolStats", "BlockPool"]


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a pool's accounting, as ``/healthz`` and ``/metrics`` show it (all zero: no pool yet).

    ``used_blocks = private blocks of every owner + distinct shared blocks``;
    ``free_blocks = total_blocks - used_blocks``; ``owners`` counts owners that
    hold at least one block or reference.
    """

    budget_bytes: int = 0
    bytes_per_block: int = 0
    total_blocks: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0
    owners: int = 0


class BlockPool:
    """Counts cache blocks against a byte budget.

    Args:
        budget_bytes: memory the caches may use.
        bytes_per_block: bytes of one 256-token block across all layers
            (computed by the model's cache spec).

    Raises:
        ValueError: a negative budget or a non-positive block size.
    """

    def __init__(self, *, budget_bytes: int, bytes_per_block: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, not {bytes_per_block}")
        self._budget_bytes = budget_bytes
        self._bytes_per_block = bytes_per_block
        self._total_blocks = budget_bytes // bytes_per_block
        self._private: dict[str, int] = {}
        self._shared_by: dict[str, set[str]] = {}
        self._refcounts: dict[str, int] = {}
        self._used_private = 0

    @property
    def total_blocks(self) -> int:
        return self._total_blocks

    @property
    def free_blocks(self) -> int:
        return self._total_blocks - self._used_private - len(self._refcounts)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, not {num_tokens}")
        return -(-num_tokens // BLOCK_TOKENS)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens of fresh private blocks fit right now."""
        return self.blocks_for(num_tokens) <= self.free_blocks

    def reserve(self, owner: str, num_tokens: int) -> None:
        """Grow ``owner``'s private blocks so private + shared blocks cover ``num_tokens``.

        Never shrinks: to hand blocks back, :meth:`release` and reserve again.

        Raises:
            BudgetExceededError: the extra blocks do not fit; nothing changes.
        """
        needed = self.blocks_for(num_tokens) - len(self._shared_by.get(owner, ()))
        current = self._private.get(owner, 0)
        extra = needed - current
        if extra <= 0:
            return
        if extra > self.free_blocks:
            raise BudgetExceededError(
                f"{owner!r} needs {extra} more blocks for {num_tokens} tokens; "
                f"{self.free_blocks} of {self._total_blocks} are free"
            )
        self._private[owner] = current + extra
        self._used_private += extra

    def share(self, owner: str, block_ids: Sequence[str]) -> None:
        """Make ``owner`` reference the content-addressed blocks ``block_ids``.

        A block already in the pool (shared by another owner) costs nothing
        more; referencing the same block twice from one owner is a no-op.

        Raises:
            BudgetExceededError: the blocks new to the pool do not fit; nothing changes.
        """
        held = self._shared_by.get(owner, set())
        wanted = [block for block in dict.fromkeys(block_ids) if block not in held]
        new_to_pool = sum(block not in self._refcounts for block in wanted)
        if new_to_pool > self.free_blocks:
            raise BudgetExceededError(
                f"{owner!r} shares {new_to_pool} blocks new to the pool; "
                f"{self.free_blocks} of {self._total_blocks} are free"
            )
        if not wanted:
            return
        self._shared_by[owner] = held
        for block in wanted:
            held.add(block)
            self._refcounts[block] = self._refcounts.get(block, 0) + 1

    def release(self, owner: str) -> None:
        """Free ``owner``'s private blocks and drop its references (unknown owner: no-op)."""
        self._used_private -= self._private.pop(owner, 0)
        for block in self._shared_by.pop(owner, set()):
            count = self._refcounts[block] - 1
            if count:
                self._refcounts[block] = count
            else:
                del self._refcounts[block]

    def owned_tokens_capacity(self, owner: str) -> int:
        """Tokens that ``owner``'s private and shared blocks can hold."""
        blocks = self._private.get(owner, 0) + len(self._shared_by.get(owner, ()))
        return blocks * BLOCK_TOKENS

    def free_tokens(self) -> int:
        """Tokens that the free blocks can hold."""
        return self.free_blocks * BLOCK_TOKENS

    def agents_that_fit(self, tokens_per_agent: int) -> int:
        """How many more owners of ``tokens_per_agent`` private tokens fit in the free blocks."""
        if tokens_per_agent <= 0:
            raise ValueError(f"tokens_per_agent must be > 0, not {tokens_per_agent}")
        return self.free_blocks // self.blocks_for(tokens_per_agent)

    def usage(self, owner: str) -> int:
        """Bytes charged to ``owner``: its private blocks plus each shared block / its refcount.

        Rounded down; meant for reporting (the shares of all owners add up to
        the pool's used bytes, up to rounding).
        """
        private = self._private.get(owner, 0) * self._bytes_per_block
        shared = sum(
            (
                Fraction(self._bytes_per_block, self._refcounts[block])
                for block in self._shared_by.get(owner, ())
            ),
            Fraction(0),
        )
        return int(private + shared)

    def stats(self) -> PoolStats:
        """Current accounting."""
        used = self._used_private + len(self._refcounts)
        owners = {owner for owner, count in self._private.items() if count} | set(
            self._shared_by
        )
        return PoolStats(
            budget_bytes=self._budget_bytes,
            bytes_per_block=self._bytes_per_block,
            total_blocks=self._total_blocks,
            used_blocks=used,
            free_blocks=self._total_blocks - used,
            shared_blocks=len(self._refcounts),
            owners=len(owners),
        )
