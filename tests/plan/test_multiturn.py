"""Multi-turn reuse: turn 2 prefills only what is new, measured in tokens processed."""

from __future__ import annotations

import mlx.core as mx

from conftest import tiny
from runtime.execution.generate import decode_alone, generate
from runtime.execution.sequence import SequenceSampling, Sequence

SYSTEM = "You are a helpful assistant."
Q1 = "Describe the old mill by the river in two sentences."
Q2 = "And who lives there now?"


def _render(lm, reply, q2=Q2, *, assistant=None):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    p1 = lm.render(msgs)
    msgs += [{"role": "assistant", "content": reply if assistant is None else assistant}, {"role": "user", "content": q2}]
    return p1, lm.render(msgs)


def test_turn_two_prefills_only_the_new_message():
    lm = tiny("tiny-llama")
    p1, _ = _render(lm, "")
    first = generate(lm, p1, None, SequenceSampling(max_tokens=24))
    _, p2 = _render(lm, first.reply)
    second = Sequence(lm, p2, first.cache, SequenceSampling(max_tokens=4))
    list(decode_alone(second))
    new_part = p2[len(p1) + len(first.reply) :]
    assert new_part.startswith("<|im_end|>") and Q2 in new_part
    prompt1_tokens = len(lm.tokenize(p1)[0])
    # Every token whose KV exists is reused: the prompt and all fed reply tokens.
    assert second.stats.tokens_reused == first.cache.num_tokens >= prompt1_tokens + len(first.tokens) - 1
    # Prefilled: the new message, plus the reply's last token when the reply was
    # cut by max_tokens (that token was sampled but never went through the model).
    extra = 1 if first.finish_reason == "length" else 0
    assert second.stats.tokens_prefilled <= len(lm.tokenize(new_part)[0]) + extra + 1
    assert second.stats.tokens_prefilled < second.stats.tokens_reused / 3


def _forced_reply(lm, prompt, forced):
    """Run a turn whose reply tokens are chosen by the test (greedy first token)."""
    seq = Sequence(lm, prompt, None, SequenceSampling(max_tokens=len(forced) + 2))
    while seq.prefill_step() is None:
        pass
    for tok in forced:
        lm.model(mx.array([[seq.next_input]]), cache=seq.kv.caches)
        seq.accept(tok)
    seq.accept(sorted(lm.eos_token_ids)[0])
    return seq


def test_reply_with_broken_utf8_bytes_is_still_reused():
    lm = tiny("tiny-llama")
    hf = lm.tokenizer._tokenizer
    vocab = hf.get_vocab()
    # Byte-level tokens for 0xE2 0x82 (an unfinished 3-byte character) between words.
    from mlx_lm.tokenizer_utils import _byte_decoder

    to_char = {b: c for c, b in _byte_decoder().items()}
    lone = [vocab[to_char[0xE2]], vocab[to_char[0x82]]]
    words = lm.tokenize(" the mill")[0]
    p1, _ = _render(lm, "")
    seq = _forced_reply(lm, p1, words + lone + words)
    assert "\ufffd" in seq.reply  # what the client receives and sends back
    parked = seq.park()
    _, p2 = _render(lm, seq.reply)
    second = Sequence(lm, p2, parked, SequenceSampling(max_tokens=2))
    assert second.stats.match == "extend"
    new_part = p2[len(p1) + len(seq.reply) :]
    assert second.stats.tokens_prefilled <= len(lm.tokenize(new_part)[0])
    # Re-tokenizing the reply text would have given different ids for the U+FFFD:
    assert lm.tokenize(seq.reply)[0] != seq.generated[:-1]


def test_rerendered_earlier_turn_reprefills_only_the_changed_tail():
    lm = tiny("tiny-llama")
    p1, _ = _render(lm, "")
    first = generate(lm, p1, None, SequenceSampling(max_tokens=32))
    cut = len(first.reply) - 6  # the client re-renders the end of the reply differently
    changed = first.reply[:cut] + " [edited]"
    _, p2 = _render(lm, first.reply, assistant=changed)
    second = Sequence(lm, p2, first.cache, SequenceSampling(max_tokens=2))
    assert second.stats.match == "partial"
    unchanged_chars = len(p1) + cut
    cached_inside = sum(1 for o in first.cache.offsets if o <= unchanged_chars)
    assert second.stats.tokens_reused == cached_inside
    assert second.stats.tokens_prefilled == len(lm.tokenize(p2[first.cache.offsets[cached_inside - 1] :])[0])


def test_exact_repeat_recomputes_only_the_last_token():
    lm = tiny("tiny-gemma3")  # sliding layers: the trim must keep the window intact
    prompt = lm.render([{"role": "user", "content": Q1 * 4}])
    first = generate(lm, prompt, None, SequenceSampling(max_tokens=1))
    again = Sequence(lm, prompt, first.cache, SequenceSampling(max_tokens=1))
    assert again.stats.match == "exact"
    assert again.stats.tokens_prefilled == 1
    list(decode_alone(again))
    # Not bitwise (the first token saw float KV, this one dequantized Q4): its top-1 margin is 5.2 against
    # a Q4 difference of 2.1 in the logits (measured), so no device's float32 noise can flip it.
    assert again.generated == first.tokens


def test_a_turn_appends_to_the_parked_cache_without_copying_earlier_turns():
    lm = tiny("tiny-llama")
    p1, _ = _render(lm, "")
    first = generate(lm, p1, None, SequenceSampling(max_tokens=8))
    _, p2 = _render(lm, first.reply)
    second = generate(lm, p2, first.cache, SequenceSampling(max_tokens=8))
    for before, after in zip(first.cache.layers, second.cache.layers, strict=True):
        # The first turn's chunk objects are reused as they are: parking is O(new tokens).
        assert after.chunks[: len(before.chunks)] == before.chunks
        assert all(a is b for a, b in zip(after.chunks, before.chunks))
        assert after.num_tokens == second.cache.num_tokens


def test_raw_prompt_plus_reply_extends_the_cache():
    # mlx-lm's detokenizers drop the first token's leading space; after a prompt that
    # does not end in whitespace kvmem returns it, so prompt + reply is the model's text.
    lm = tiny("tiny-llama")
    prompt = "Notes from the harbour, day one. Question: what did the keeper see?\nAnswer:"
    first = generate(lm, prompt, None, SequenceSampling(max_tokens=16))
    second = Sequence(lm, prompt + first.reply + "\nQuestion: and then?\nAnswer:", first.cache, SequenceSampling(max_tokens=2))
    assert second.stats.match == "extend"
    assert second.stats.tokens_reused == first.cache.num_tokens
