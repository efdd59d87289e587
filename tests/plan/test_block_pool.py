"""BlockPool: block accounting against a byte budget, shared blocks counted once."""

from __future__ import annotations

import pytest

from runtime.plan.block_pool import BlockPool, PoolStats
from runtime.errors import BudgetExceededError, KvmemError
from runtime.spec import BLOCK_TOKENS

BPB = 1000  # bytes per block in these tests


def make_pool(blocks: int = 10) -> BlockPool:
    return BlockPool(budget_bytes=blocks * BPB + BPB // 2, bytes_per_block=BPB)


def test_budget_is_divided_into_whole_blocks() -> None:
    pool = make_pool(10)
    assert pool.stats() == PoolStats(
        budget_bytes=10 * BPB + BPB // 2,
        bytes_per_block=BPB,
        total_blocks=10,
        used_blocks=0,
        free_blocks=10,
        shared_blocks=0,
        owners=0,
    )
    assert pool.free_tokens() == 10 * BLOCK_TOKENS


@pytest.mark.parametrize(
    ("tokens", "blocks"),
    [(0, 0), (1, 1), (255, 1), (256, 1), (257, 2), (1000, 4), (1024, 4)],
)
def test_blocks_for_rounds_up_to_whole_blocks(tokens: int, blocks: int) -> None:
    assert make_pool().blocks_for(tokens) == blocks


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(budget_bytes=100, bytes_per_block=0)
    with pytest.raises(ValueError):
        BlockPool(budget_bytes=-1, bytes_per_block=10)
    with pytest.raises(ValueError):
        make_pool().blocks_for(-1)
    with pytest.raises(ValueError):
        make_pool().agents_that_fit(0)


def test_reserve_grows_private_blocks_and_never_shrinks() -> None:
    pool = make_pool(10)
    pool.reserve("a", 300)
    assert pool.owned_tokens_capacity("a") == 2 * BLOCK_TOKENS
    assert pool.usage("a") == 2 * BPB
    pool.reserve("a", 700)
    assert pool.owned_tokens_capacity("a") == 3 * BLOCK_TOKENS
    pool.reserve("a", 10)  # already covered
    assert pool.owned_tokens_capacity("a") == 3 * BLOCK_TOKENS
    stats = pool.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.owners) == (3, 7, 1)
    assert pool.free_tokens() == 7 * BLOCK_TOKENS


def test_budget_exceeded_raises_and_changes_nothing() -> None:
    pool = make_pool(4)
    pool.reserve("a", 3 * BLOCK_TOKENS)
    assert pool.can_allocate(BLOCK_TOKENS)
    assert not pool.can_allocate(BLOCK_TOKENS + 1)
    with pytest.raises(BudgetExceededError) as info:
        pool.reserve("b", 2 * BLOCK_TOKENS)
    assert isinstance(info.value, KvmemError)
    with pytest.raises(BudgetExceededError):
        pool.reserve("a", 5 * BLOCK_TOKENS)
    with pytest.raises(BudgetExceededError):
        pool.share("c", ["x", "y"])
    assert pool.owned_tokens_capacity("a") == 3 * BLOCK_TOKENS
    assert pool.owned_tokens_capacity("b") == 0
    assert pool.stats().used_blocks == 3
    assert pool.stats().owners == 1
    pool.reserve("b", BLOCK_TOKENS)  # exactly the last block
    assert pool.stats().free_blocks == 0


def test_shared_blocks_are_counted_once() -> None:
    pool = make_pool(10)
    prefix = ["h0", "h1", "h2", "h3"]
    pool.share("a", prefix)
    pool.share("b", prefix)
    pool.share("c", prefix[:2])
    stats = pool.stats()
    assert (stats.used_blocks, stats.shared_blocks, stats.owners) == (4, 4, 3)
    pool.share("a", prefix)  # sharing again is a no-op
    assert pool.stats().used_blocks == 4
    # Shared blocks count towards an owner's coverage: only the rest is private.
    pool.reserve("a", 4 * BLOCK_TOKENS + 10)
    assert pool.owned_tokens_capacity("a") == 5 * BLOCK_TOKENS
    assert pool.stats().used_blocks == 5
    # Usage splits a shared block between the owners that reference it.
    assert pool.usage("a") == 2666  # 1000 private + 2 x 1000/3 + 2 x 1000/2
    assert pool.usage("c") == 666  # 2 x 1000/3
    assert pool.usage("nobody") == 0


def test_sharing_fails_only_for_blocks_new_to_the_pool() -> None:
    pool = make_pool(3)
    pool.share("a", ["h0", "h1", "h2"])
    assert pool.stats().free_blocks == 0
    pool.share("b", ["h0", "h1", "h2"])  # all already present: free
    with pytest.raises(BudgetExceededError):
        pool.share("b", ["h0", "h9"])
    assert pool.stats().shared_blocks == 3


def test_release_frees_private_blocks_and_drops_references() -> None:
    pool = make_pool(10)
    pool.share("a", ["h0", "h1"])
    pool.share("b", ["h0", "h1"])
    pool.reserve("a", 5 * BLOCK_TOKENS)
    pool.reserve("b", 3 * BLOCK_TOKENS)
    assert pool.stats().used_blocks == 2 + 3 + 1
    pool.release("a")
    stats = pool.stats()
    assert (stats.used_blocks, stats.shared_blocks, stats.owners) == (3, 2, 1)
    assert pool.owned_tokens_capacity("a") == 0
    assert pool.usage("b") == 3 * BPB
    pool.release("b")
    assert pool.stats() == make_pool(10).stats()
    pool.release("b")  # unknown owner: no-op
    assert pool.stats().used_blocks == 0


def test_agents_that_fit_divides_free_blocks() -> None:
    pool = make_pool(10)
    assert pool.agents_that_fit(BLOCK_TOKENS) == 10
    assert pool.agents_that_fit(BLOCK_TOKENS + 1) == 5
    assert pool.agents_that_fit(1000) == 2  # 4 blocks each
    assert pool.agents_that_fit(11 * BLOCK_TOKENS) == 0
    pool.reserve("a", 3 * BLOCK_TOKENS)
    assert pool.agents_that_fit(1000) == 1
    assert pool.agents_that_fit(1) == 7


def test_an_empty_budget_holds_nothing() -> None:
    pool = BlockPool(budget_bytes=BPB - 1, bytes_per_block=BPB)
    assert pool.stats().total_blocks == 0
    assert pool.can_allocate(0)
    assert not pool.can_allocate(1)
    pool.reserve("a", 0)
    with pytest.raises(BudgetExceededError):
        pool.reserve("a", 1)
