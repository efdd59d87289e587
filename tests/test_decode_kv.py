"""A lone row decodes with no attention mask (issue 33, item 4: the decode path on a GPU).

On MLX's CUDA backend an array mask sends a one-token attention to the unfused fallback, and a
batch cache's per-row offsets cost every layer a little. So a row alone decodes on its own
``KVCache`` layers, as mlx-lm's ``generate_step`` does, and becomes a batch only when another
row joins; a batch narrowed back to one row asks for no mask. That is right only if a batch of
one never keeps left padding: checked here through every way a batch grows and narrows, and
the lone row's tokens match the same sequence decoded on its own.
"""

from __future__ import annotations

from conftest import tiny
from mlx_lm.models.cache import KVCache

from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import decode_alone
from runtime.execution.sequence import Sequence, SequenceSampling
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
