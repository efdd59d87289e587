"""A lone row decodes with no attention mask, and a batch's padding is known on the host (issue 33, item 4:
the decode path on a GPU).

On MLX's CUDA backend an array mask sends a one-token attention to the unfused fallback, and a
batch cache's per-row offsets cost every layer a little. So a row alone decodes on its own
``KVCache`` layers, as mlx-lm's ``generate_step`` does, and becomes a batch only when another
row joins; a batch narrowed back to one row asks for no mask. That is right only if a batch of
one never keeps left padding: checked here through every way a batch grows and narrows, and
the lone row's tokens match the same sequence decoded on its own.

A batch's rows' padding lives on the host too (``DecodeKVCache.pads``): mlx-lm read it back from the
device whenever a row left, and on a GPU that read waits for every queued step. The host's list is
checked against mlx-lm's own ``BatchKVCache`` doing the same joins and leaves.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from conftest import tiny
from mlx_lm.models.cache import BatchKVCache, KVCache

from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import decode_alone
from runtime.execution.sequence import Sequence, SequenceSampling
from runtime.execution.decode_batch import merge_with_room
from runtime.kv.decode_kv import DecodeKVCache

PROMPTS = ("The harbour master kept a ledger of ships. " * 6, "Once upon a time, " * 3)


def _prefilled(prompt: str, steps: int) -> Sequence:
    seq = Sequence(tiny("tiny-llama"), prompt, None, SequenceSampling(max_tokens=steps), attention="at-rest")
    while seq.prefill_step() is None:
        pass
    return seq


def _lone_row_on_its_own_caches(batch: DecodeBatch) -> None:
    assert all(type(c) is KVCache for c in batch.caches)
    assert batch.caches[0].make_mask(1, return_array=False, window_size=None) is None  # as the model asks


def _lone_row_has_no_padding_and_no_mask(batch: DecodeBatch) -> None:
    cache = batch.caches[0]
    assert isinstance(cache, DecodeKVCache)
    assert cache.left_padding.tolist() == [0]
    assert cache.make_mask(1) is None
    assert cache.make_mask(1, return_array=True) is not None  # asked for an array, it gets one


def test_a_lone_row_decodes_with_no_mask_through_joins_and_leaves() -> None:
    alone = Sequence(tiny("tiny-llama"), PROMPTS[0], None, SequenceSampling(max_tokens=12), attention="at-rest")
    list(decode_alone(alone))
    long, short = _prefilled(PROMPTS[0], 12), _prefilled(PROMPTS[1], 3)
    batch = DecodeBatch(shared_prefix_check=False, alone_on_own_caches=True)  # the GPU policy's
    batch.add(long)
    batch.step_once()
    _lone_row_on_its_own_caches(batch)  # alone: no merge
    batch.add(short)
    batch.step_once()
    assert isinstance(batch.caches[0], DecodeKVCache)
    assert batch.caches[0].make_mask(1) is not None  # two rows of different lengths: padding, a mask
    while short.finish_reason is None:
        batch.step_once()
    batch.remove(short)  # the shorter, padded row leaves: the lone row's padding goes with it
    _lone_row_has_no_padding_and_no_mask(batch)
    while long.finish_reason is None:
        batch.step_once()
    assert long.generated == alone.generated
    batch.remove(long)
    lone = _prefilled(PROMPTS[1], 4)
    batch.add(lone)
    batch.step_once()
    _lone_row_on_its_own_caches(batch)
    caches = batch.caches
    batch.remove(lone)
    assert lone.kv.caches is caches and not batch.caches  # it takes its own caches back, as they are
    shorter, longer = _prefilled(PROMPTS[1], 6), _prefilled(PROMPTS[0], 6)
    batch.add(shorter)
    batch.add(longer)
    batch.step_once()
    batch.remove(longer)  # the longer row leaves first: the padded row's padding is trimmed
    _lone_row_has_no_padding_and_no_mask(batch)


def test_under_the_cpu_policy_a_lone_row_is_a_batch_of_one_without_a_mask() -> None:
    batch = DecodeBatch(shared_prefix_check=False)
    batch.add(_prefilled(PROMPTS[0], 3))
    batch.step_once()
    _lone_row_has_no_padding_and_no_mask(batch)


def _row(length: int, seed: int) -> KVCache:
    cache = KVCache()
    keys, values = (mx.random.normal((1, 2, length, 8), key=mx.random.key(seed + i)) for i in (0, 1))
    cache.update_and_fetch(keys, values)
    return cache


def _same_rows(mine: DecodeKVCache, reference: BatchKVCache) -> None:
    """``mine`` holds what mlx-lm's cache holds after the same operations, and its host padding is the device's."""
    assert mine.pads == reference.left_padding.tolist() == mine.left_padding.tolist()
    assert mine._idx == reference._idx and mine.offset.tolist() == reference.offset.tolist()
    for i, pad in enumerate(mine.pads):  # every row's tokens, where each cache keeps them
        for a, b in ((mine.keys, reference.keys), (mine.values, reference.values)):
            assert mx.array_equal(a[i, :, pad : mine._idx], b[i, :, pad : reference._idx]).item()


@pytest.mark.parametrize("seed", range(6))
def test_the_host_padding_follows_joins_and_leaves_as_mlx_lm_keeps_it(seed: int) -> None:
    rng = random.Random(seed)
    made = iter(range(10_000))

    def rows(n: int) -> list[KVCache]:
        return [_row(rng.randint(1, 40), next(made) * 2) for _ in range(n)]

    first = rows(rng.randint(1, 4))
    mine, reference = merge_with_room(first), BatchKVCache.merge(first)
    _same_rows(mine, reference)
    for _ in range(8):
        size = len(mine.pads)
        if size > 1 and rng.random() < 0.5:  # rows leave: any of them, or the last ones (a view)
            if rng.random() < 0.5:
                keep = sorted(rng.sample(range(size), rng.randint(1, size - 1)))
                mine.filter(keep)
            else:
                keep = list(range(rng.randint(1, size - 1)))
                mine.keep_first(len(keep))
            reference.filter(keep)
        else:  # rows join, after a few decode steps of the batch
            for _ in range(rng.randint(0, 3)):
                new = [mx.random.normal((size, 2, 1, 8), key=mx.random.key(next(made))) for _ in range(2)]
                mine.update_and_fetch(*new)
                reference.update_and_fetch(*new)
            joining = rows(rng.randint(1, 3))
            mine.extend(merge_with_room(joining))
            reference.extend(BatchKVCache.merge(joining))
        _same_rows(mine, reference)


def test_rows_of_one_length_need_no_mask_and_rows_of_two_do() -> None:
    even = merge_with_room([_row(12, 0), _row(12, 2)])
    assert even.pads == [0, 0] and even.make_mask(1) is None
    uneven = merge_with_room([_row(12, 4), _row(9, 6)])
    assert uneven.pads == [0, 3] and uneven.make_mask(1) is not None
    uneven.keep_first(1)  # the padded row leaves: the other is alone, unpadded
    assert uneven.make_mask(1) is None


def test_a_row_leaving_a_batch_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a read of the padding waits for every step the device has queued: a finished turn
    would stall the whole batch. Rows leave here from the middle and from the end."""
    seqs = [_prefilled(PROMPTS[i % 2] * (1 + i), 40) for i in range(4)]
    batch = DecodeBatch(shared_prefix_check=False, alone_on_own_caches=True, run_ahead=True)  # the GPU policy's
    for seq in seqs:
        batch.add(seq)
    for _ in range(3):
        batch.step_once()
    reads: list[int] = []
    tolist = mx.array.tolist

    def counted(self: mx.array) -> object:
        reads.append(self.size)
        return tolist(self)

    monkeypatch.setattr(mx.array, "tolist", counted)
    batch.remove(seqs[1])  # from the middle: a gather
    batch.remove(seqs[3])  # the last row: a view
    assert reads == []
    monkeypatch.setattr(mx.array, "tolist", tolist)
    assert all(s.kv.caches for s in (seqs[1], seqs[3]))  # each took its own rows back
    batch.step_once()
    assert len(batch.members) == 2


def test_a_state_set_whole_brings_its_padding_to_the_host() -> None:
    source = merge_with_room([_row(12, 8), _row(7, 10)])
    copy = merge_with_room([_row(3, 12)])
    copy.state = source.state
    assert copy.pads == [0, 5] and copy.state[3].tolist() == [0, 5]
