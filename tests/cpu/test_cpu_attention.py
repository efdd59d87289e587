"""kvmem's NumPy attention (runtime.cpu.attention) against MLX's own, and the adapter's boundaries.

The reference is ``mx.fast.scaled_dot_product_attention`` and mlx-lm's models
with their attention untouched, never the code under test.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx_lm.models.llama as mlx_llama
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from runtime.cpu import attention as cpu_attention
from conftest import cpu_only, tiny

pytestmark = [
    cpu_only("kvmem's NumPy attention is the CPU policy's (numpy_attention); the GPU policy never installs it"),
    pytest.mark.skipif(
        cpu_attention._why_not() is not None, reason=f"CPU attention not available: {cpu_attention._why_not()}"
    ),
]

TOL = 2e-5


def _qkv(batch: int, heads: int, kv_heads: int, length: int, span: int, dim: int = 16, seed: int = 0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, length, dim))
    k = mx.random.normal((batch, kv_heads, span, dim))
    v = mx.random.normal((batch, kv_heads, span, dim))
    return q, k, v


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "length", "span"),
    [(1, 9, 3, 1, 40), (1, 9, 3, 7, 40), (1, 4, 4, 33, 33), (2, 6, 2, 5, 70), (3, 8, 1, 1, 300)],
)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_matches_mlx_attention(batch: int, heads: int, kv_heads: int, length: int, span: int, mask_kind: str) -> None:
    q, k, v = _qkv(batch, heads, kv_heads, length, span)
    scale = 0.25
    if mask_kind == "none":
        mask = None
    elif mask_kind == "causal":
        mask = "causal"
    else:
        # a left-padded batch: row b ignores its first 3*b keys; queries see their own position
        keep = mx.arange(span)[None, None, None, :] >= (3 * mx.arange(batch))[:, None, None, None]
        causal = mx.arange(span - length, span)[:, None] >= mx.arange(span)[None, :]
        mask = keep & causal
        if mask_kind == "additive":
            mask = mx.where(mask, 0.0, -1e9).astype(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    ours = cpu_attention.numpy_attention(q, k, v, scale=scale, mask=mask)
    assert ours.shape == ref.shape
    assert mx.abs(ours - ref).max().item() < TOL


def test_keys_and_values_as_views_of_a_larger_buffer() -> None:
    """A KVCache hands attention a slice of its preallocated buffer, not a contiguous array."""
    q, k, v = _qkv(1, 9, 3, 4, 256)
    k_view, v_view = k[:, :, :100, :], v[:, :, :100, :]
    ref = mx.fast.scaled_dot_product_attention(q, k_view, v_view, scale=0.125, mask="causal")
    ours = cpu_attention.numpy_attention(q, k_view, v_view, scale=0.125, mask="causal")
    assert mx.abs(ours - ref).max().item() < TOL


def test_a_row_with_every_key_masked_gives_zeros_not_nan() -> None:
    q, k, v = _qkv(1, 2, 1, 2, 5)
    mask = mx.array([[True] * 5, [False] * 5])[None, None]
    out = cpu_attention.numpy_attention(q, k, v, scale=1.0, mask=mask)
    assert not mx.isnan(out).any().item()
    assert mx.abs(out[:, :, 1]).max().item() == 0.0


def test_unknown_mask_string_is_refused() -> None:
    q, k, v = _qkv(1, 2, 1, 1, 5)
    with pytest.raises(ValueError, match="mask"):
        cpu_attention.numpy_attention(q, k, v, scale=1.0, mask="sliding")


class _Calls:
    def __init__(self) -> None:
        self.numpy = 0

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.numpy += 1
        return _REAL_NUMPY_ATTENTION(*args, **kwargs)


_REAL_NUMPY_ATTENTION = cpu_attention.numpy_attention


def test_replaces_only_inside_active_and_only_for_float_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_attention.install("mlx_lm.models.llama")
    assert cpu_attention.is_installed("mlx_lm.models.llama")
    calls = _Calls()
    monkeypatch.setattr(cpu_attention, "numpy_attention", calls)
    q, k, v = _qkv(1, 4, 2, cpu_attention.MIN_QUERIES, 10)
    dispatch = mlx_llama.scaled_dot_product_attention
    dispatch(q, k, v, KVCache(), 0.5, "causal")
    assert calls.numpy == 0, "outside active(): mlx-lm's own attention"
    with cpu_attention.active():
        dispatch(q, k, v, KVCache(), 0.5, "causal")
        assert calls.numpy == 1

        class Quantized:
            bits, group_size = 4, 32

        with pytest.raises(Exception):  # noqa: B017 (mlx-lm's quantized path, given float arrays)
            dispatch(q, k, v, Quantized(), 0.5, "causal")
        dispatch(q, k, v, KVCache(), 0.5, "causal", sinks=mx.zeros((4,)))
        dispatch(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), KVCache(), 0.5, "causal")
        assert calls.numpy == 1, "quantized caches, sinks and non-float32 inputs keep mlx-lm's attention"
        dispatch(q[:, :, :1], k, v, KVCache(), 0.5, None)
        assert calls.numpy == 1, "a decode step (one query) keeps mlx-lm's attention"
        with cpu_attention.active(False):
            dispatch(q, k, v, KVCache(), 0.5, "causal")
        assert calls.numpy == 1
    dispatch(q, k, v, KVCache(), 0.5, "causal")
    assert calls.numpy == 1


def test_install_refuses_modules_and_releases_it_was_not_tested_with(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert not cpu_attention.install("mlx_lm.models.gemma3_text")
    monkeypatch.setattr(cpu_attention, "_mlx_lm_release", lambda: (9, 99))
    with caplog.at_level(logging.INFO, logger="kvmem.cpu_attention"):
        assert not cpu_attention.install("mlx_lm.models.qwen2")
    assert "not a tested release" in caplog.text


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_model_logits_match_mlx_lm_untouched(name: str) -> None:
    """Chunked prefill and decode through LoadedModel.forward vs the same model called plainly."""
    lm = tiny(name)
    assert lm.numpy_attention, f"{name}: expected kvmem's CPU attention to be on"
    rng = np.random.default_rng(1)
    ids = mx.array(rng.integers(10, 200, size=(1, 300)).tolist())
    ours_cache, ref_cache = make_prompt_cache(lm.model), make_prompt_cache(lm.model)
    for a, b in ((0, 128), (128, 299), (299, 300)):  # two prefill chunks, then one decode step
        ours = lm.forward(ids[:, a:b], ours_cache)
        ref = lm.model(ids[:, a:b], cache=ref_cache)
        assert mx.abs(ours - ref).max().item() < 1e-3
        assert (ours.argmax(-1) == ref.argmax(-1)).all().item()


def test_models_that_are_not_llama_or_qwen2_keep_mlx_attention() -> None:
    assert not tiny("tiny-gemma3").numpy_attention


@pytest.mark.parametrize("lengths", [(40, 37, 20), (100, 90, 120), (65, 64, 63)])
def test_a_batch_row_is_bitwise_the_row_alone(lengths: tuple[int, ...]) -> None:
    """Left-padded decode batch vs each sequence attending alone: identical, not just close."""
    mx.random.seed(3)
    heads, kv_heads, dim, span = 9, 3, 64, max(lengths)
    qs = [mx.random.normal((1, heads, 1, dim)) for _ in lengths]
    ks = [mx.random.normal((1, kv_heads, n, dim)) for n in lengths]
    vs = [mx.random.normal((1, kv_heads, n, dim)) for n in lengths]

    def padded(x: mx.array, n: int) -> mx.array:
        return mx.concatenate([mx.zeros((1, kv_heads, span - n, dim)), x], axis=2) if n < span else x

    keys = mx.concatenate([padded(k, n) for k, n in zip(ks, lengths, strict=True)])
    values = mx.concatenate([padded(v, n) for v, n in zip(vs, lengths, strict=True)])
    mask = mx.stack([mx.arange(span) >= span - n for n in lengths])[:, None, None, :]
    batched = cpu_attention.numpy_attention(mx.concatenate(qs), keys, values, scale=0.125, mask=mask)
    for i in range(len(lengths)):
        alone = cpu_attention.numpy_attention(qs[i], ks[i], vs[i], scale=0.125, mask=None)
        assert mx.array_equal(batched[i : i + 1], alone).item()


def test_causal_blocks_of_every_length_share_one_triangle() -> None:
    """A shorter chunk after a longer one gets the right triangle, and no per-length copy is kept."""
    big, small = cpu_attention._causal_block(7), cpu_attention._causal_block(3)
    expected = np.triu(np.full((3, 3), -np.inf, np.float32), 1)
    assert np.array_equal(small, expected)
    assert np.shares_memory(big, small)
