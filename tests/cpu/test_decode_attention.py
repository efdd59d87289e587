"""kvmem's decode-step attention (runtime.cpu.attention.decode_attention) against MLX's own.

The references are ``mx.fast.scaled_dot_product_attention`` and mlx-lm's model
with its attention untouched, never the code under test.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.llama as mlx_llama
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from runtime.cpu import attention as cpu_attention
from conftest import cpu_only, tiny

pytestmark = [
    cpu_only("kvmem's NumPy attention is the CPU policy's (numpy_attention); the GPU policy never installs it"),
    pytest.mark.skipif(
        cpu_attention._why_not() is not None, reason=f"CPU attention not available: {cpu_attention._why_not()}"
    ),
]

TOL = 2e-5


def _qkv(batch: int, heads: int, kv_heads: int, span: int, dim: int = 16, seed: int = 0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, 1, dim))
    k = mx.random.normal((batch, kv_heads, span, dim))
    v = mx.random.normal((batch, kv_heads, span, dim))
    return q, k, v


def _left_padding(batch: int, span: int) -> mx.array:
    """A left-padded batch's boolean mask: row b ignores its first 5*b keys."""
    return (mx.arange(span)[None, None, None, :] >= (5 * mx.arange(batch))[:, None, None, None])


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "span"), [(1, 9, 3, 40), (2, 6, 2, 70), (8, 9, 3, 300),
                                                                   (3, 8, 1, 33), (4, 4, 4, 128)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_matches_mlx_attention(batch: int, heads: int, kv_heads: int, span: int, mask_kind: str) -> None:
    q, k, v = _qkv(batch, heads, kv_heads, span)
    mask = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind in ("bool", "additive"):
        mask = _left_padding(batch, span)
        if mask_kind == "additive":
            mask = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    ours = cpu_attention.decode_attention(q, k, v, scale=0.25, mask=mask)
    assert ours.shape == ref.shape
    assert mx.abs(ours - ref).max().item() < TOL


def test_keys_and_values_as_views_of_a_larger_buffer() -> None:
    """A batch cache hands attention a slice of its preallocated buffer."""
    q, k, v = _qkv(4, 9, 3, 512)
    k_view, v_view = k[:, :, :300, :], v[:, :, :300, :]
    mask = _left_padding(4, 300)
    ref = mx.fast.scaled_dot_product_attention(q, k_view, v_view, scale=0.125, mask=mask)
    ours = cpu_attention.decode_attention(q, k_view, v_view, scale=0.125, mask=mask)
    assert mx.abs(ours - ref).max().item() < TOL


def test_a_row_with_every_key_masked_gives_zeros_not_nan() -> None:
    q, k, v = _qkv(2, 2, 1, 5)
    mask = mx.array([[True] * 5, [False] * 5])[:, None, None, :]
    out = cpu_attention.decode_attention(q, k, v, scale=1.0, mask=mask)
    assert not mx.isnan(out).any().item()
    assert mx.abs(out[1]).max().item() == 0.0


def test_refuses_several_queries_and_unknown_masks() -> None:
    q, k, v = _qkv(1, 2, 1, 5)
    with pytest.raises(ValueError, match="one query"):
        cpu_attention.decode_attention(mx.concatenate([q, q], axis=2), k, v, scale=1.0, mask=None)
    with pytest.raises(ValueError, match="mask"):
        cpu_attention.decode_attention(q, k, v, scale=1.0, mask="sliding")


def test_dispatch_sends_decode_steps_over_enough_keys_here(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_attention.install("mlx_lm.models.llama")
    calls: list[tuple[int, int]] = []
    real = cpu_attention.decode_attention

    def counting(queries, keys, values, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((queries.shape[0], keys.shape[2]))
        return real(queries, keys, values, **kwargs)

    monkeypatch.setattr(cpu_attention, "decode_attention", counting)
    dispatch = mlx_llama.scaled_dot_product_attention
    enough = cpu_attention.MIN_DECODE_KEYS
    one_row = _qkv(1, 9, 3, enough)
    eight_rows = _qkv(8, 9, 3, enough // 8)
    short = _qkv(2, 9, 3, enough // 2 - 1)
    dispatch(*one_row, KVCache(), 0.125, None)
    assert calls == [], "outside active(): mlx-lm's own attention"
    with cpu_attention.active():
        dispatch(*one_row, KVCache(), 0.125, None)
        dispatch(*eight_rows, KVCache(), 0.125, _left_padding(8, enough // 8))
        dispatch(*short, KVCache(), 0.125, None)
        dispatch(*(x.astype(mx.float16) for x in one_row), KVCache(), 0.125, None)
        dispatch(*one_row, KVCache(), 0.125, None, sinks=mx.zeros((9,)))
    assert calls == [(1, enough), (8, enough // 8)], "fewer keys, float16 and sinks keep MLX's attention"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_a_batched_decode_step_matches_mlx_lm_untouched(name: str) -> None:
    """Rows of different lengths merged into one left-padded batch cache, one step, both ways."""
    lm = tiny(name)
    assert lm.numpy_attention
    rng = np.random.default_rng(2)
    lengths = [300, 280, 310, 256, 299, 305, 270, 290]  # 8 rows x ~290 keys: over MIN_DECODE_KEYS
    assert len(lengths) * min(lengths) >= cpu_attention.MIN_DECODE_KEYS
    rows = []
    for n in lengths:
        cache = make_prompt_cache(lm.model)
        mx.eval(lm.model(mx.array([rng.integers(10, 200, size=n).tolist()]), cache=cache))
        rows.append(cache)
    ours_cache = [BatchKVCache.merge([row[i] for row in rows]) for i in range(len(rows[0]))]
    ref_cache = [BatchKVCache.merge([row[i] for row in rows]) for i in range(len(rows[0]))]
    step = mx.array(rng.integers(10, 200, size=(len(lengths), 1)).tolist())
    for _ in range(3):
        ours = lm.forward(step, ours_cache)[:, -1, :]
        ref = lm.model(step, cache=ref_cache)[:, -1, :]
        assert mx.abs(ours - ref).max().item() < 1e-3
        assert (ours.argmax(-1) == ref.argmax(-1)).all().item()
        step = ref.argmax(-1)[:, None]
