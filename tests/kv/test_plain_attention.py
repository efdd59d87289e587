"""Plain-operation attention for short passes (``plain_attention_queries``, GPU policy; issue 33).

On CUDA, MLX's fused attention builds a cuDNN graph for every new set of shapes, and every turn
of a growing conversation has one; the setting sends passes of 2 to N query positions through
:func:`runtime.cpu.attention.plain_attention` instead. The reference is MLX's fused
``mx.fast.scaled_dot_product_attention`` and the runtime with the setting off, never the code
under test. On the CPU both sides come out bitwise equal (MLX's CPU attention is built from the
same operations); the tolerance below is for a GPU's fused kernels, which add in another order
(not yet measured there).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
import trio
from conftest import models_dir, tiny
from mlx_lm.models.cache import KVCache

from actors import open_runtime
from runtime.cpu import attention as adapter

TOLERANCE = {mx.float32: 1e-4, mx.bfloat16: 3e-2}


def _qkv(b: int, h: int, kv_heads: int, n: int, s: int, dtype: mx.Dtype):
    mx.random.seed(n * 100 + s)
    q, k, v = (mx.random.normal(shape).astype(dtype) for shape in ((b, h, n, 64), (b, kv_heads, s, 64),
                                                                   (b, kv_heads, s, 64)))
    return q, k, v


def _masks(b: int, n: int, s: int, dtype: mx.Dtype) -> dict[str, object]:
    left_padding = mx.array([0, 5, 9][:b])  # a batch's rows, left-padded as mlx-lm's BatchKVCache
    keys = mx.arange(s)[None, None, None, :]
    allowed = (keys >= left_padding[:, None, None, None]) & (keys <= mx.arange(n)[None, None, :, None] + (s - n))
    return {"none": None, "causal": "causal", "boolean": allowed, "additive": mx.where(allowed, 0.0, -1e9).astype(dtype)}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("b", "h", "kv_heads", "n", "s"), [(1, 8, 2, 16, 100), (3, 4, 4, 7, 40), (2, 6, 3, 2, 50)])
def test_plain_attention_is_mlx_fused_attention(b: int, h: int, kv_heads: int, n: int, s: int, dtype: mx.Dtype) -> None:
    q, k, v = _qkv(b, h, kv_heads, n, s, dtype)
    for name, mask in _masks(b, n, s, dtype).items():
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        plain = adapter.plain_attention(q, k, v, scale=0.125, mask=mask)
        assert plain.dtype == fused.dtype and plain.shape == fused.shape, name
        error = mx.abs(plain.astype(mx.float32) - fused.astype(mx.float32)).max().item()
        assert error <= TOLERANCE[dtype], (name, error)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("n", "s", "buffer"), [(13, 300, 512), (16, 512, 512), (5, 300, 768), (9, 650, 700),
                                                (2, 2, 256)])
def test_a_lone_rows_pass_over_its_buffer_is_mlx_fused_attention_over_its_keys(n: int, s: int, buffer: int,
                                                                               dtype: mx.Dtype) -> None:
    """The buffer past the cache holds zeros, or an earlier turn's keys (a cache cut back): masked, they weigh
    nothing. Reference: MLX's fused attention over the cache's keys alone (causal)."""
    q, k, v = _qkv(1, 8, 2, n, buffer, dtype)
    k, v = k * 3, v * 3  # what lies past the cache is as large as what is in it
    zeros = mx.zeros((1, 2, buffer - s - 40, 64), dtype) if buffer - s > 40 else None
    if zeros is not None:  # the buffer's last keys never written
        k, v = (mx.concatenate([x[:, :, : s + 40], zeros], axis=2) for x in (k, v))
    cache = KVCache()
    cache.keys, cache.values, cache.offset = k, v, s
    ours = adapter.plain_attention_over_the_buffer(q, cache, scale=0.125, mask="causal")
    fused = mx.fast.scaled_dot_product_attention(q, k[:, :, :s], v[:, :, :s], scale=0.125, mask="causal")
    error = mx.abs(ours.astype(mx.float32) - fused.astype(mx.float32)).max().item()
    assert ours.shape == fused.shape and ours.dtype == fused.dtype and error <= TOLERANCE[dtype], error


@pytest.fixture
def plain_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query lengths of the passes that went through the plain path."""
    calls: list[int] = []
    plain = adapter.plain_attention

    def counted(queries: mx.array, *args: object, **kwargs: object) -> mx.array:
        calls.append(queries.shape[2])
        return plain(queries, *args, **kwargs)

    monkeypatch.setattr(adapter, "plain_attention", counted)
    return calls


def test_only_short_passes_over_float_caches_take_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes of 2 to ``plain_queries`` queries, and only kvmem's own; a lone row's attends over its buffer up to the
    next 256 keys (shapes that repeat across turns), whatever its length."""
    lm = tiny("tiny-llama")
    assert adapter.install(type(lm.model).__module__)
    widths: list[int] = []
    plain = adapter.plain_attention

    def recorded(queries: mx.array, keys: mx.array, values: mx.array, **kwargs: object) -> mx.array:
        widths.append(keys.shape[2])
        return plain(queries, keys, values, **kwargs)

    monkeypatch.setattr(adapter, "plain_attention", recorded)
    layers = len(lm.model.layers)
    for tokens, expected in ((5, layers), (8, layers), (1, 0), (9, 0)):
        widths.clear()
        cache = [KVCache() for _ in range(layers)]
        with adapter.active(False, plain_queries=8):
            mx.eval(lm.model(mx.array([[3] * tokens]), cache=cache))
        assert widths == [adapter.BUFFER_STEP] * expected, (tokens, widths)
    widths.clear()
    mx.eval(lm.model(mx.array([[3] * 5]), cache=[KVCache() for _ in range(layers)]))
    assert widths == []  # outside kvmem's own passes: mlx-lm untouched


def test_a_lone_rows_pass_builds_its_buffer_mask_once_for_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a pass sees the same keys of its buffer: one mask, built once and shared (each layer built
    its own: nine graph nodes a layer on a GPU's host); a pass of another length or cache gets its own."""
    lm = tiny("tiny-llama")
    assert adapter.install(type(lm.model).__module__)
    masks: list[mx.array] = []
    plain = adapter.plain_attention

    def recorded(queries: mx.array, keys: mx.array, values: mx.array, **kwargs: object) -> mx.array:
        masks.append(kwargs["mask"])
        return plain(queries, keys, values, **kwargs)

    monkeypatch.setattr(adapter, "plain_attention", recorded)
    layers = len(lm.model.layers)
    seen = []
    for tokens in (5, 6, 5):
        masks.clear()
        with adapter.active(False, plain_queries=8):
            mx.eval(lm.model(mx.array([[3] * tokens]), cache=[KVCache() for _ in range(layers)]))
        assert len(masks) == layers and all(m is masks[0] for m in masks), tokens
        seen.append(masks[0])
    assert seen[0] is not seen[1] and mx.array_equal(seen[2], seen[0]).item()
    n = 5
    assert mx.array_equal(seen[0], mx.arange(adapter.BUFFER_STEP)[None] <= mx.arange(n)[:, None]).item()


async def _replies(home: Path, plain: int) -> list[str]:
    from runtime.cpu import kv_copy

    replies: dict[tuple[int, int], str] = {}
    try:
        async with open_runtime(model="tiny-llama", home=home, models_dir=models_dir(), fsync=False,
                                handle_signals=False, profile="gpu", plain_attention_queries=plain) as rt:
            assert rt.stats().registry.profile.plain_attention_queries == plain

            async def agent(i: int) -> None:
                prompt = f"Agent {i} tells a story about the harbour. " * 8
                for turn in range(3):  # hot turns: a few new tokens each, joining the others' batch
                    result = await rt.agent(f"a{i}").send_prompt(prompt, max_tokens=6)
                    replies[(i, turn)] = result.reply
                    prompt += result.reply + f" Then {turn}?"

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(agent, i)
    finally:
        kv_copy.use_host_views(None)
    return [replies[key] for key in sorted(replies)]


async def test_a_runtime_with_plain_short_passes_replies_as_one_without(tmp_path: Path,
                                                                        plain_passes: list[int]) -> None:
    passes = plain_passes
    with_plain = await _replies(tmp_path / "plain", 64)
    assert passes and max(passes) <= 64  # the hot turns' short passes, and only those
    passes.clear()
    assert await _replies(tmp_path / "fused", 0) == with_plain
    assert passes == []
