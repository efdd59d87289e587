"""Rows that begin with the same keys and values, attended once (runtime.execution.shared_prefix, cpu_attention).

References: ``mx.fast.scaled_dot_product_attention`` on the same keys, mlx-lm's
model with its attention untouched, and each turn decoded alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from agreement import assert_decoded_alike
from conftest import cpu_only, tiny
from runtime.cpu import attention as cpu_attention
from runtime.execution.decode_batch import DecodeBatch, merge_with_room
from runtime.execution.generate import decode_alone, generate
from runtime.execution.sequence import SequenceSampling, Sequence
from runtime.execution.shared_prefix import MIN_SHARED_TOKENS, shared_prefix_length

pytestmark = [
    cpu_only("kvmem's NumPy attention is the CPU policy's (numpy_attention); the GPU policy never installs it"),
    pytest.mark.skipif(
        cpu_attention._why_not() is not None, reason=f"CPU attention not available: {cpu_attention._why_not()}"
    ),
]

TOL = 2e-5


def _rows_sharing(lengths: list[int], shared: int, *, kv_heads: int = 3, dim: int = 16, seed: int = 0):
    """Float ``KVCache`` rows whose first ``shared`` tokens hold the same keys and values."""
    mx.random.seed(seed)
    common_k = mx.random.normal((1, kv_heads, shared, dim))
    common_v = mx.random.normal((1, kv_heads, shared, dim))
    rows = []
    for n in lengths:
        cache = KVCache()
        own_k = mx.random.normal((1, kv_heads, n - shared, dim))
        own_v = mx.random.normal((1, kv_heads, n - shared, dim))
        cache.update_and_fetch(mx.concatenate([common_k, own_k], axis=2), mx.concatenate([common_v, own_v], axis=2))
        rows.append(cache)
    return rows


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("masked", [True, False])
def test_matches_mlx_attention_over_a_left_padded_batch(heads: int, kv_heads: int, masked: bool) -> None:
    lengths = [300, 340, 290, 410, 301]
    batch = merge_with_room(_rows_sharing(lengths, 280, kv_heads=kv_heads))
    q = mx.random.normal((len(lengths), heads, 1, 16))
    mask = batch.make_mask(1)  # as mlx-lm's model makes it: before the step's keys go in
    k, v = batch.update_and_fetch(mx.random.normal((len(lengths), kv_heads, 1, 16)),
                                  mx.random.normal((len(lengths), kv_heads, 1, 16)))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    ours = cpu_attention.shared_prefix_attention(q, k, v, scale=0.25, mask=mask if masked else None,
                                                 left_padding=np.asarray(batch.left_padding), shared=280)
    assert ours is not None and ours.shape == ref.shape
    assert mx.abs(ours - ref).max().item() < TOL


def test_masks_it_cannot_honour_go_back_to_the_ordinary_path() -> None:
    batch = merge_with_room(_rows_sharing([300, 320], 280))
    q = mx.random.normal((2, 9, 1, 16))
    mask = batch.make_mask(1)
    k, v = batch.update_and_fetch(mx.random.normal((2, 3, 1, 16)), mx.random.normal((2, 3, 1, 16)))
    pads = np.asarray(batch.left_padding)
    additive = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    hides_a_shared_key = mask & (mx.arange(k.shape[2]) != int(pads[0]) + 5)[None, None, None, :]
    for bad in (additive, hides_a_shared_key):
        assert cpu_attention.shared_prefix_attention(q, k, v, scale=0.25, mask=bad, left_padding=pads,
                                                     shared=280) is None


def test_finds_the_tokens_every_row_holds_alike() -> None:
    lengths = [400, 420, 390]
    ids = [list(range(n)) for n in lengths]
    layers = [merge_with_room(_rows_sharing(lengths, 350, seed=s)) for s in range(3)]
    assert shared_prefix_length(layers, ids) == 350, "bit for bit up to where the rows' own keys start"
    ids[2][300:] = [-1] * (len(ids[2]) - 300)
    assert shared_prefix_length(layers, ids) == 300, "the tokens bound it"
    assert shared_prefix_length(layers[:1], ids[:1]) == 0, "one row shares with nobody"

    changed = [merge_with_room(_rows_sharing(lengths, 350, seed=s)) for s in range(3)]
    keys = np.array(changed[1].keys)
    keys[1, 0, int(np.asarray(changed[1].left_padding)[1]) + 280, 3] += 1e-6  # one element, one layer, one row
    changed[1].keys = mx.array(keys)
    assert shared_prefix_length(changed, [list(range(n)) for n in lengths]) == 280
    keys[2, 1, int(np.asarray(changed[1].left_padding)[2]) + 10, 0] += 1e-6
    changed[1].keys = mx.array(keys)
    assert shared_prefix_length(changed, [list(range(n)) for n in lengths]) == 0, f"under {MIN_SHARED_TOKENS}"


def test_a_model_step_over_shared_rows_matches_mlx_lm_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "MIN_SHARED_ROWS", 2)  # four rows here: below it the path is slower, not wrong
    lm = tiny("tiny-llama")
    rng = np.random.default_rng(3)
    common = rng.integers(10, 200, size=300).tolist()
    prefix = make_prompt_cache(lm.model)
    mx.eval(lm.model(mx.array([common]), cache=prefix))
    rows = []
    for n in (12, 30, 5, 21):
        cache = make_prompt_cache(lm.model)
        for mine, theirs in zip(cache, prefix, strict=True):
            mine.update_and_fetch(theirs.keys[..., :300, :], theirs.values[..., :300, :])
        mx.eval(lm.model(mx.array([rng.integers(10, 200, size=n).tolist()]), cache=cache))
        rows.append(cache)
    layers = len(rows[0])
    ours_cache = [BatchKVCache.merge([row[i] for row in rows]) for i in range(layers)]
    ref_cache = [BatchKVCache.merge([row[i] for row in rows]) for i in range(layers)]
    shared = shared_prefix_length(ours_cache, [common] * len(rows))
    assert shared == 300
    step = mx.array(rng.integers(10, 200, size=(len(rows), 1)).tolist())
    for _ in range(3):
        with cpu_attention.sharing(shared):
            ours = lm.forward(step, ours_cache)[:, -1, :]
        ref = lm.model(step, cache=ref_cache)[:, -1, :]
        assert mx.abs(ours - ref).max().item() < 1e-3
        assert (ours.argmax(-1) == ref.argmax(-1)).all().item()
        step = ref.argmax(-1)[:, None]


def test_agents_sharing_a_prompt_decode_together_as_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns over one parked system prompt: the batch finds it shared and replies as each turn alone."""
    lm = tiny("tiny-llama")
    system = " ".join(f"Rule {i}: keep the mill by the river running and the lighthouse lit." for i in range(40))
    briefing = generate(lm, lm.render([{"role": "system", "content": system}]), None,
                        SequenceSampling(max_tokens=1)).cache
    assert briefing.num_tokens > MIN_SHARED_TOKENS
    prompts = [lm.render([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in ("What next?", "Who keeps the light?", "Why the mill?")]
    params = SequenceSampling(max_tokens=6)
    alone = []
    for prompt in prompts:
        seq = Sequence(lm, prompt, briefing, params)
        seq.logits_trace = []
        list(decode_alone(seq))
        alone.append(seq)

    used = []
    real = cpu_attention.shared_prefix_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        used.append(kwargs["shared"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "shared_prefix_attention", counting)
    monkeypatch.setattr(cpu_attention, "MIN_SHARED_ROWS", 2)
    batch = DecodeBatch()
    rows = []
    for prompt in prompts:
        seq = Sequence(lm, prompt, briefing, params)
        seq.logits_trace = []
        while seq.prefill_step() is None:
            pass
        batch.add(seq)
        rows.append(seq)
    while len(batch):
        batch.step_once()
        assert batch.shared >= MIN_SHARED_TOKENS or len(batch) < 2
        for s in reversed([s for s in batch.members if s.finish_reason]):
            batch.remove(s)
    assert used and min(used) >= MIN_SHARED_TOKENS
    for a, b in zip(alone, rows, strict=True):
        assert_decoded_alike(a, b, lm.vocab_limit, 2e-3)


def test_dispatch_takes_the_shared_path_from_enough_rows_inside_sharing(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm.models.llama as mlx_llama

    assert cpu_attention.install("mlx_lm.models.llama")
    used: list[int] = []
    real = cpu_attention.shared_prefix_attention
    monkeypatch.setattr(cpu_attention, "shared_prefix_attention",
                        lambda *a, **k: used.append(a[0].shape[0]) or real(*a, **k))
    dispatch = mlx_llama.scaled_dot_product_attention
    enough = cpu_attention.MIN_SHARED_ROWS
    for rows in (enough - 1, enough):
        batch = merge_with_room(_rows_sharing([300 + 3 * b for b in range(rows)], 280))
        q = mx.random.normal((rows, 9, 1, 16))
        mask = batch.make_mask(1)
        k, v = batch.update_and_fetch(mx.random.normal((rows, 3, 1, 16)), mx.random.normal((rows, 3, 1, 16)))
        with cpu_attention.active():
            dispatch(q, k, v, batch, 0.25, mask)
            with cpu_attention.sharing(280):
                dispatch(q, k, v, batch, 0.25, mask)
    assert used == [enough], "only inside sharing(), only from MIN_SHARED_ROWS rows"


def test_a_batch_finds_its_shared_tokens_only_with_enough_rows_to_use_them() -> None:
    from types import SimpleNamespace

    for rows, expected in ((cpu_attention.MIN_SHARED_ROWS - 1, 0), (cpu_attention.MIN_SHARED_ROWS, 300)):
        lengths = [320 + 4 * b for b in range(rows)]
        layers = [merge_with_room(_rows_sharing(lengths, 300, seed=s)) for s in range(2)]
        members = [SimpleNamespace(token_ids=list(range(n))) for n in lengths]
        batch = DecodeBatch()
        batch.add_group(members, layers)  # type: ignore[arg-type]
        assert batch.shared == expected
