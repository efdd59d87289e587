"""Quality checks on small models with real trained weights (../shared/fixtures).

Skipped cleanly when the fixtures are absent.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import FIXTURES, fixture_model
from reference import cold_generate
from runtime.execution.generate import decode_alone, generate
from runtime.kv.kvstate import ActiveKV, ParkedCache
from runtime.persist import CacheDirectory
from runtime.execution.sequence import SequenceSampling, Sequence
from runtime.spec import LayerKind

STORY = "Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog."

# Q4 KV quality bar on trained weights (plain mlx-lm's Q4 KV measured KL 0.0041,
# top-1 agreement 97% on this held-out text).
KL_TOL = 0.01
TOP1_MIN = 0.95


def _warm(lm, parked, tmp_path):
    store = CacheDirectory(tmp_path)
    store.save("a", parked.to_snapshot())
    return ParkedCache.from_snapshot(store.load("a", model_tag=lm.spec.tag), float_dtype=lm.float_dtype)


def test_stories260k_head_dim_8_falls_back_to_float_kv(caplog):
    lm = fixture_model("stories260K", bits=4)
    assert set(lm.spec.layer_kinds()) == {LayerKind.FLOAT}


@pytest.mark.parametrize("source", ["hot", "warm"])
def test_stories260k_continuation_from_cache_equals_cold_run(source, tmp_path):
    lm = fixture_model("stories260K", bits=4)
    prompt = lm._with_bos(STORY)
    first = generate(lm, prompt, None, SequenceSampling(max_tokens=16))
    cache = first.cache if source == "hot" else _warm(lm, first.cache, tmp_path)
    # A raw-text client appends the reply to its prompt: prompt + reply is the model's text.
    seq = Sequence(lm, prompt + first.reply + " One day,", cache, SequenceSampling(max_tokens=64))
    list(decode_alone(seq))
    assert seq.stats.tokens_reused >= 16 and seq.stats.match == "extend"
    cold_tokens, _ = cold_generate(lm, seq.token_ids, 64)
    assert seq.generated == cold_tokens[: len(seq.generated)]
    assert len(seq.generated) == 64 or seq.finish_reason == "stop"


def test_stories260k_multi_turn_conversation_reuses_cache():
    lm = fixture_model("stories260K", bits=4)
    messages: list[dict[str, str]] = []
    cache = None
    for i, question in enumerate(["Tell me a story about a cat.", "What did the cat eat?", "Where did it sleep?"]):
        messages.append({"role": "user", "content": question})
        result = generate(lm, lm.render(messages), cache, SequenceSampling(max_tokens=24))
        if i:
            assert result.stats.match == "extend"
            assert result.stats.tokens_reused > result.stats.tokens_prefilled
        messages.append({"role": "assistant", "content": result.reply})
        cache = result.cache


def _heldout(n: int) -> np.ndarray:
    path = FIXTURES / "tinystories-heldout" / "val.npy"
    if not path.exists():
        pytest.skip("held-out text fixture absent")
    return np.load(path).astype("int32")[:n]


def test_tinystories_q4_cache_reloaded_from_disk_continues_bit_identically(tmp_path):
    lm = fixture_model("tinystories-hd64", bits=4)
    assert set(lm.spec.layer_kinds()) == {LayerKind.Q4}
    prompt = lm._with_bos(STORY)
    first = generate(lm, prompt, None, SequenceSampling(max_tokens=32))
    warm = _warm(lm, first.cache, tmp_path)
    runs = []
    for cache in (first.cache, warm):
        seq = Sequence(lm, first.cache.text + " The end.", cache, SequenceSampling(max_tokens=32))
        seq.logits_trace = []
        list(decode_alone(seq))
        runs.append(seq)
    # Bitwise on any backend: the same Q4 bytes through the same path and kernels on one device.
    assert runs[0].generated == runs[1].generated
    for a, b in zip(runs[0].logits_trace, runs[1].logits_trace, strict=True):
        assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("attention", ["at-rest", "native"])
def test_tinystories_q4_kv_stays_within_stated_kl_on_heldout_text(attention):
    lm = fixture_model("tinystories-hd64", bits=4)
    seqs = _heldout(8)
    split = 256
    kls, agree = [], []
    for row in seqs:
        tokens = mx.array(row[None])
        ref = lm.model(tokens, cache=lm.model.make_cache())[0, split:].astype(mx.float32)
        # Cache the first half as Q4 (park), then run the second half on it.
        empty = ParkedCache.empty(lm.spec)
        kv = ActiveKV(empty, lm.spec, attention)
        lm.model(tokens[:, :split], cache=kv.caches)
        ids = [int(t) for t in row[:split]]
        parked = kv.park(text="", token_ids=ids, offsets=list(range(1, split + 1)))
        kv2 = ActiveKV(parked, lm.spec, attention)
        ours = lm.model(tokens[:, split:], cache=kv2.caches)[0].astype(mx.float32)
        lp_ref = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
        lp_q = ours - mx.logsumexp(ours, axis=-1, keepdims=True)
        kl = (mx.exp(lp_ref) * (lp_ref - lp_q)).sum(-1)
        kls.append(np.array(kl))
        agree.append(np.array(ref.argmax(-1) == ours.argmax(-1)))
    mean_kl = float(np.concatenate(kls).mean())
    top1 = float(np.concatenate(agree).mean())
    print(f"{attention}: mean KL {mean_kl:.5f}, top-1 agreement {top1:.3f}")
    assert mean_kl <= KL_TOL
    assert top1 >= TOP1_MIN
