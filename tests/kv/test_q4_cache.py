"""Q4 KV caches: storage size, exact packing, accuracy, and the batch protocol.

Tiny random-weight models (llama; a GPT-OSS with attention sinks) run real
mlx-lm forward passes through these caches. Embeddings are scaled up so that
logits are peaky and greedy tokens are well separated.

Tolerances used below:

* ``Q4_LOGIT_TOL`` (Q4 vs float KV): 5% of the float logit range at each
  position. A 4-bit affine code has 15 steps per group of 64, so each K/V
  element moves by at most one step (MLX snaps the group's larger-magnitude
  edge exactly, which can stretch the rounding error at the far end to one
  full step), i.e. about 1/15 of the group's range in the worst case and
  about 1/30 typically. Attention output is a convex combination of value
  rows, so its error is of that order, and the residual stream (which
  carries the embedding unchanged) dilutes it further; measured: 1.2–1.8%
  of the range. Greedy tokens must then agree wherever the float top-1
  margin exceeds twice that tolerance (both logits may move by one tolerance).
* ``BATCH_LOGIT_TOL`` (batched vs alone, same Q4 cache contents): 1e-3
  absolute on logits of magnitude ~1e2. The packed data are bit-identical and
  masked positions get exactly zero softmax weight, so only float32 summation
  order differs (float32 ulp at 100 is 7.6e-6); measured ≤ 3.1e-5.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import runtime  # noqa: F401  (loads OpenBLAS before mlx)

import mlx.core as mx
import pytest
from conftest import skip_without_native_attention
from mlx_lm.models import gpt_oss, llama
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, RotatingKVCache

from runtime.errors import UnsupportedModelError
from runtime.kv.q4_cache import (
    BatchDequantizingQuantizedKVCache,
    BatchQuantizedKVCache,
    DequantizingQuantizedKVCache,
    QuantizedKVCache,
)
from runtime.kv.q4_packing import dequantize_kv, q4_supported, quantize_kv

Q4_LOGIT_TOL = 0.05  # fraction of the per-position float logit range
BATCH_LOGIT_TOL = 1e-3  # absolute
VOCAB = 512
LAYERS = 2


def _tiny_llama(seed: int = 0) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=128,
            num_hidden_layers=LAYERS,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        )
    )
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 8
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return _tiny_llama()


def _tokens(n: int, seed: int) -> list[int]:
    return mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed)).tolist()


def _prefill(model: Any, tokens: Sequence[int], cache: list[Any]) -> mx.array:
    logits = model(mx.array([list(tokens)]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _step(model: Any, token: int, cache: list[Any]) -> mx.array:
    logits = model(mx.array([[token]]), cache=cache)
    mx.eval(logits)
    return logits[0, -1]


def _q4_caches(cls: type[Any] = QuantizedKVCache) -> list[Any]:
    return [cls() for _ in range(LAYERS)]


def _copy(cache: list[QuantizedKVCache]) -> list[QuantizedKVCache]:
    return [QuantizedKVCache.from_packed(*c.packed()) for c in cache]


def _assert_packed_equal(a: Any, b: Any) -> None:
    for x, y in zip((*a[0], *a[1]), (*b[0], *b[1]), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item()


# -- storage -----------------------------------------------------------------


def test_q4_cache_is_at_most_029_of_fp16_bytes_for_head_dim_64() -> None:
    keys = mx.random.normal((1, 3, 256, 64))  # float32 in: scales must still be float16
    values = mx.random.normal((1, 3, 256, 64))
    q4 = QuantizedKVCache()
    q4.update_and_fetch(keys, values)
    fp16 = KVCache()
    fp16.update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
    ratio = q4.nbytes / fp16.nbytes
    assert ratio == pytest.approx(36 / 128)  # 0.28125: 32 B codes + 2 B scale + 2 B bias
    assert ratio <= 0.29
    packed_keys, _ = q4.packed()
    assert [x.dtype for x in packed_keys] == [mx.uint32, mx.float16, mx.float16]


def test_q4_supported_rejects_head_dims_no_group_divides() -> None:
    assert q4_supported(64) and q4_supported(128) and q4_supported(256, 128)
    assert not q4_supported(8) and not q4_supported(96) and not q4_supported(80)
    assert q4_supported(96, 32) and not q4_supported(64, 64, bits=3)
    with pytest.raises(UnsupportedModelError):
        QuantizedKVCache().update_and_fetch(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)))
    with pytest.raises(ValueError):
        QuantizedKVCache(group_size=16)


def test_packed_round_trip_is_bit_exact_and_keeps_growing() -> None:
    cache = QuantizedKVCache()
    cache.update_and_fetch(mx.random.normal((1, 2, 300, 64)), mx.random.normal((1, 2, 300, 128)))
    packed = cache.packed()
    assert packed[0][0].shape == (1, 2, 300, 8) and packed[1][0].shape == (1, 2, 300, 16)
    restored = QuantizedKVCache.from_packed(*packed, group_size=64, bits=4)
    assert restored.size() == 300
    _assert_packed_equal(restored.packed(), packed)
    more_k, more_v = mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 128))
    cache.update_and_fetch(more_k, more_v)
    restored.update_and_fetch(more_k, more_v)
    _assert_packed_equal(restored.packed(), cache.packed())
    assert restored.size() == 305


def test_from_packed_does_not_write_through_the_callers_arrays() -> None:
    cache = QuantizedKVCache.from_float(mx.random.normal((1, 2, 10, 64)), mx.zeros((1, 2, 10, 64)))
    packed = cache.packed()
    before = [mx.array(x) for x in packed[0]]
    adopted = QuantizedKVCache.from_packed(*packed)
    adopted.trim(4)
    adopted.update_and_fetch(mx.ones((1, 2, 2, 64)), mx.ones((1, 2, 2, 64)))
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, packed[0], strict=True))


def test_from_packed_rejects_inconsistent_tuples() -> None:
    keys, values = QuantizedKVCache.from_float(mx.ones((1, 2, 4, 64)), mx.ones((1, 2, 4, 64))).packed()
    with pytest.raises(ValueError):
        QuantizedKVCache.from_packed(keys, values, group_size=32, bits=4)
    with pytest.raises(ValueError):
        QuantizedKVCache.from_packed((keys[0], keys[1].astype(mx.float32), keys[2]), values)
    with pytest.raises(ValueError):
        QuantizedKVCache.from_packed(keys, tuple(x[:, :, :3] for x in values))  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [4, 8])
def test_from_float_then_dequantized_is_within_one_quantization_step(bits: int) -> None:
    keys = mx.random.normal((1, 3, 300, 64), key=mx.random.key(1)) * 3 + 1
    values = mx.random.normal((1, 3, 300, 128), key=mx.random.key(2))
    cache = QuantizedKVCache.from_float(keys, values, group_size=64, bits=bits)
    restored = cache.dequantized(mx.float32)
    n_steps = 2**bits - 1
    for x, deq, (_, scales, _) in zip((keys, values), restored, cache.packed(), strict=True):
        groups = x.shape[-1] // 64
        err = mx.abs(x - deq).reshape(*x.shape[:-1], groups, 64)
        step = mx.abs(scales.astype(mx.float32))[..., None]
        # One step (MLX snaps the larger edge exactly, stretching the far end),
        # plus float16 rounding of the stored scale (times the code) and of x.
        bound = step * (1 + n_steps * 2.0**-11) + 2.0**-11 * mx.abs(x).reshape(err.shape) + 1e-6
        assert mx.all(err <= bound).item()
    # The helpers agree with the cache.
    direct = dequantize_kv(quantize_kv(keys, 64, bits), 64, bits, mx.float32)
    assert mx.array_equal(direct, restored[0]).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("group_size", "head_dim"), [(32, 64), (64, 64), (64, 128), (128, 128)])
def test_dequantize_kv_matches_mlx_dequantize(bits: int, group_size: int, head_dim: int) -> None:
    """The unpacked dequantization agrees with MLX's kernel up to its float16 rounding."""
    x = mx.random.normal((1, 3, 77, head_dim), key=mx.random.key(bits + head_dim)) * 4
    w, scales, biases = quantize_kv(x, group_size, bits)
    ours = dequantize_kv((w, scales, biases), group_size, bits, mx.float32)
    exact = (mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                           bits=bits))
    kernel = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=mx.float32)
    assert ours.shape == x.shape and ours.dtype == mx.float32
    # Against the kernel computing in float32 it is the same arithmetic: within float32 rounding, on any
    # backend. A kernel that fuses q * scale + bias (one rounding, as GPU compilers do) differs from the two
    # roundings here by at most half an ulp of q * scale: 2**-20 (9.5e-7) while |q * scale| < 32 (here <= 31.3).
    assert mx.allclose(ours, exact, rtol=1e-6, atol=1e-6).item()
    # Against the float16 kernel, within its two float16 roundings (of q * scale, then of + bias).
    assert (mx.abs(ours - kernel).max() <= 2.0**-9 * mx.abs(x).max()).item()
    assert not mx.array_equal(ours, mx.zeros_like(ours)).item()
    assert dequantize_kv((w, scales, biases), group_size, bits, mx.float16).dtype == mx.float16


def test_trim_then_update_overwrites_the_tail() -> None:
    keys, values = mx.random.normal((1, 2, 50, 64)), mx.random.normal((1, 2, 50, 64))
    cache = QuantizedKVCache()
    cache.update_and_fetch(keys, values)
    assert cache.is_trimmable() and cache.trim(10) == 10 and cache.size() == 40
    reference = QuantizedKVCache.from_float(keys[:, :, :40], values[:, :, :40])
    _assert_packed_equal(cache.packed(), reference.packed())
    tail_k, tail_v = mx.random.normal((1, 2, 3, 64)), mx.random.normal((1, 2, 3, 64))
    cache.update_and_fetch(tail_k, tail_v)
    reference.update_and_fetch(tail_k, tail_v)
    _assert_packed_equal(cache.packed(), reference.packed())
    assert cache.trim(100) == 43 and cache.size() == 0


# -- accuracy against a float cache ------------------------------------------


def test_q4_prefill_and_decode_logits_track_a_float_cache(model: llama.Model) -> None:
    skip_without_native_attention()  # quantized SDPA over float32 activations
    tokens = _tokens(60, seed=3)
    float_cache: list[Any] = [KVCache() for _ in range(LAYERS)]
    q4_cache = _q4_caches()
    float_logits = [_prefill(model, tokens[:48], float_cache)[0]]
    q4_logits = [_prefill(model, tokens[:48], q4_cache)[0]]
    for t in tokens[48:]:
        float_logits.append(_step(model, t, float_cache)[None])
        q4_logits.append(_step(model, t, q4_cache)[None])
    ref, got = mx.concatenate(float_logits), mx.concatenate(q4_logits)
    tol = Q4_LOGIT_TOL * (ref.max(axis=-1) - ref.min(axis=-1))
    assert mx.all(mx.abs(ref - got).max(axis=-1) <= tol).item()
    top2 = mx.sort(ref, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * tol
    assert decided.sum().item() >= len(tokens) // 2  # the check below is not vacuous
    same = mx.argmax(ref, axis=-1) == mx.argmax(got, axis=-1)
    assert mx.all(same | ~decided).item()


# -- batch protocol ----------------------------------------------------------


def _merge(caches: list[list[Any]]) -> list[Any]:
    """As mlx-lm's BatchGenerator does: through the first cache's class."""
    return [caches[0][i].merge([c[i] for c in caches]) for i in range(LAYERS)]


def _batch_step(model: Any, tokens: Sequence[int], batch: list[Any]) -> mx.array:
    logits = model(mx.array(list(tokens))[:, None], cache=batch)
    mx.eval(logits)
    return logits[:, -1]


def test_merge_copies_packed_bits_without_a_float_round_trip(model: llama.Model) -> None:
    skip_without_native_attention()  # quantized SDPA over float32 activations
    lengths = [37, 70, 12]
    alone = [_q4_caches() for _ in lengths]
    for i, n in enumerate(lengths):
        _prefill(model, _tokens(n, seed=10 + i), alone[i])
    batch = _merge(alone)
    assert isinstance(batch[0], BatchQuantizedKVCache)
    assert batch[0].left_padding.tolist() == [33, 0, 58] == batch[0].pads  # the host's list, kept with the array
    assert batch[0].offset.tolist() == lengths and batch[0].size() == 70
    for layer in range(LAYERS):
        merged = (*batch[layer].keys, *batch[layer].values)
        for row, (n, c) in enumerate(zip(lengths, alone, strict=True)):
            pad = 70 - n
            for got, want in zip(merged, (*c[layer].packed()[0], *c[layer].packed()[1]), strict=True):
                assert got.dtype == want.dtype
                assert mx.array_equal(got[row : row + 1, :, pad:], want).item()
                assert not mx.any(got[row, :, :pad]).item()


def test_batch_decode_matches_each_sequence_alone(model: llama.Model) -> None:
    skip_without_native_attention()  # quantized SDPA over float32 activations
    lengths = [37, 70, 12]
    prompts = [_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    alone = [_q4_caches() for _ in lengths]
    for p, c in zip(prompts, alone, strict=True):
        _prefill(model, p, c)
    batch = _merge([_copy(c) for c in alone])
    rows = list(range(3))  # which sequence each batch row is
    steps = _tokens(8 * 4, seed=99)
    late_prompt = _tokens(20, seed=50)
    late = _q4_caches()

    def check_step(step: int) -> None:
        next_tokens = [steps[8 * seq + step] for seq in rows]
        got = _batch_step(model, next_tokens, batch)
        for row, seq in enumerate(rows):
            want = _step(model, next_tokens[row], late if seq == 3 else alone[seq])
            assert mx.abs(got[row] - want).max().item() <= BATCH_LOGIT_TOL

    for step in range(3):
        check_step(step)

    for c in batch:
        c.filter([0, 2])
    rows = [0, 2]
    assert batch[0].left_padding.tolist() == [0, 25] == batch[0].pads  # shared padding dropped
    for step in range(3, 5):
        check_step(step)

    _prefill(model, late_prompt, late)
    newcomer = _merge([_copy(late)])
    for c, n in zip(batch, newcomer, strict=True):
        c.extend(n)
    rows = [0, 2, 3]
    assert batch[0].pads == batch[0].left_padding.tolist()
    for step in range(5, 8):
        check_step(step)

    for row, seq in enumerate(rows):
        cache = late if seq == 3 else alone[seq]
        for layer in range(LAYERS):
            extracted = batch[layer].extract(row)
            assert isinstance(extracted, QuantizedKVCache)
            assert extracted.size() == cache[layer].size()
            _assert_packed_equal(extracted.packed(), cache[layer].packed())


def test_right_padded_prompt_is_rolled_to_left_padding(model: llama.Model) -> None:
    skip_without_native_attention()  # quantized SDPA over float32 activations
    prompts = [_tokens(30, seed=5), _tokens(18, seed=6)]
    alone = [_q4_caches() for _ in prompts]
    for p, c in zip(prompts, alone, strict=True):
        _prefill(model, p, c)
    batch = _merge([_q4_caches(), _q4_caches()])  # empty, as BatchGenerator starts
    assert batch[0].empty() and batch[0].nbytes == 0
    for c in batch:
        c.prepare(lengths=[30, 18], right_padding=[0, 12])
    model(mx.array([prompts[0], prompts[1] + [0] * 12]), cache=batch)
    for c in batch:
        c.finalize()
    assert batch[0].left_padding.tolist() == [0, 12] == batch[0].pads and batch[0].offset.tolist() == [30, 18]
    got = _batch_step(model, [7, 9], batch)
    for row in range(2):
        want = _step(model, [7, 9][row], alone[row])
        # Prompt K/V came from a batched forward pass here, so codes may differ
        # by rounding: this is the Q4-vs-Q4 of slightly different floats.
        ref_range = (want.max() - want.min()).item()
        assert mx.abs(got[row] - want).max().item() <= Q4_LOGIT_TOL * ref_range
    assert batch[0].extract(1).size() == 19


def test_batch_trim_drops_the_last_positions_of_every_row() -> None:
    a = QuantizedKVCache.from_float(mx.random.normal((1, 2, 10, 64)), mx.random.normal((1, 2, 10, 64)))
    b = QuantizedKVCache.from_float(mx.random.normal((1, 2, 6, 64)), mx.random.normal((1, 2, 6, 64)))
    batch = BatchQuantizedKVCache.merge([a, b])
    assert batch.is_trimmable() and batch.trim(2) == 2
    assert batch.size() == 8 and batch.offset.tolist() == [8, 4]
    for row, c in enumerate((a, b)):
        c.trim(2)
        _assert_packed_equal(batch.extract(row).packed(), c.packed())
    mask = batch.make_mask(1)
    assert mask.shape == (2, 1, 1, 9) and mask[1, 0, 0].tolist() == [False] * 4 + [True] * 5


# -- attention sinks (GPT-OSS) -----------------------------------------------


def _tiny_gpt_oss() -> gpt_oss.Model:
    mx.random.seed(4)
    model = gpt_oss.Model(
        gpt_oss.ModelArgs(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=128,
            head_dim=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
        )
    )
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 8
    for layer in model.layers:
        layer.self_attn.sinks = mx.random.normal((4,))
    mx.eval(model.parameters())
    return model


def _gpt_oss_caches(model: gpt_oss.Model, full: type[Any] | None) -> list[Any]:
    return [
        RotatingKVCache(max_size=16) if kind == "sliding_attention" else (full or KVCache)()
        for kind in model.model.layer_types
    ]


def test_sink_layers_attend_on_a_dequantized_copy() -> None:
    model = _tiny_gpt_oss()
    tokens = _tokens(40, seed=8)
    with pytest.raises(ValueError, match="sinks"):  # why the dequantizing cache exists
        model(mx.array([tokens]), cache=_gpt_oss_caches(model, QuantizedKVCache))
    float_cache = _gpt_oss_caches(model, None)
    q4_cache = _gpt_oss_caches(model, DequantizingQuantizedKVCache)
    assert not hasattr(q4_cache[1], "bits") and q4_cache[1].q_bits == 4
    ref, got = [_prefill(model, tokens[:32], float_cache)[0]], [_prefill(model, tokens[:32], q4_cache)[0]]
    for t in tokens[32:]:
        ref.append(_step(model, t, float_cache)[None])
        got.append(_step(model, t, q4_cache)[None])
    r, g = mx.concatenate(ref), mx.concatenate(got)
    assert g.dtype == mx.float32
    tol = Q4_LOGIT_TOL * (r.max(axis=-1) - r.min(axis=-1))
    assert mx.all(mx.abs(r - g).max(axis=-1) <= tol).item()
    assert q4_cache[1].packed()[0][1].dtype == mx.float16


def test_dequantizing_batch_matches_sequences_alone_with_sinks() -> None:
    heads, kv_heads, dim = 4, 2, 64
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    lengths = [9, 21]
    alone = [
        DequantizingQuantizedKVCache.from_float(
            mx.random.normal((1, kv_heads, n, dim)), mx.random.normal((1, kv_heads, n, dim))
        )
        for n in lengths
    ]
    copies = [DequantizingQuantizedKVCache.from_packed(*c.packed()) for c in alone]
    batch = DequantizingQuantizedKVCache.merge(copies)
    assert isinstance(batch, BatchDequantizingQuantizedKVCache) and not hasattr(batch, "bits")
    new_k = mx.random.normal((2, kv_heads, 1, dim))
    new_v = mx.random.normal((2, kv_heads, 1, dim))
    queries = mx.random.normal((2, heads, 1, dim))
    mask = batch.make_mask(1)  # made before the update, as models do
    keys, values = batch.update_and_fetch(new_k, new_v)
    assert keys.dtype == mx.float32 and keys.shape == (2, kv_heads, 22, dim)
    out = scaled_dot_product_attention(
        queries, keys, values, batch, scale=dim**-0.5, mask=mask, sinks=sinks
    )
    for row, c in enumerate(alone):
        k, v = c.update_and_fetch(new_k[row : row + 1], new_v[row : row + 1])
        want = scaled_dot_product_attention(
            queries[row : row + 1], k, v, c, scale=dim**-0.5, mask=None, sinks=sinks
        )
        assert mx.abs(out[row] - want[0]).max().item() <= 1e-5
        extracted = batch.extract(row)
        assert isinstance(extracted, DequantizingQuantizedKVCache)
        _assert_packed_equal(extracted.packed(), c.packed())
