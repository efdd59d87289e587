"""The synchronous generate path: stopping, sampling, streaming."""

from __future__ import annotations

import mlx.core as mx

from conftest import tiny
from runtime.execution.generate import generate
from runtime.execution.sequence import SequenceSampling, StopMatcher, prefill_chunk_size

PROMPT_MSGS = [{"role": "user", "content": "Write about the sea and the ships."}]


def test_streamed_pieces_concatenate_to_the_reply():
    lm = tiny("tiny-qwen2")
    pieces: list[str] = []
    result = generate(lm, lm.render(PROMPT_MSGS), None, SequenceSampling(max_tokens=20), on_text=pieces.append)
    assert "".join(pieces) == result.reply
    assert result.finish_reason == "length" and len(result.tokens) == 20


def test_stop_string_truncates_reply_and_cache_covers_only_returned_text():
    lm = tiny("tiny-qwen2")
    prompt = lm.render(PROMPT_MSGS)
    free = generate(lm, prompt, None, SequenceSampling(max_tokens=24))
    stop = free.reply[len(free.reply) // 2 : len(free.reply) // 2 + 3]
    assert stop.strip()
    pieces: list[str] = []
    cut = generate(lm, prompt, None, SequenceSampling(max_tokens=24, stop=(stop,)), on_text=pieces.append)
    assert cut.finish_reason == "stop"
    assert cut.reply == free.reply[: free.reply.index(stop)]
    assert "".join(pieces) == cut.reply  # the stop string is never streamed
    assert cut.cache is not None and cut.cache.text == prompt + cut.reply[: len(cut.cache.text) - len(prompt)]
    assert cut.cache.text.startswith(prompt) and stop not in cut.cache.text[len(prompt) :]


def test_eos_ends_the_turn_and_is_not_in_the_reply():
    lm = tiny("tiny-llama")
    eos = sorted(lm.eos_token_ids)[0]
    result = generate(lm, lm.render(PROMPT_MSGS), None, SequenceSampling(max_tokens=64, logit_bias={eos: 1e4}))
    assert result.finish_reason == "stop" and result.tokens == [eos] and result.reply == ""


def test_logit_bias_steers_sampling():
    lm = tiny("tiny-llama")
    target = lm.tokenize(" ships")[0][0]
    result = generate(lm, lm.render(PROMPT_MSGS), None, SequenceSampling(max_tokens=3, logit_bias={target: 1e4}))
    assert result.tokens == [target] * 3


def test_temperature_sampling_varies_and_stays_in_vocab():
    lm = tiny("tiny-llama")
    prompt = lm.render(PROMPT_MSGS)
    params = SequenceSampling(max_tokens=12, temperature=1.5, top_p=0.95)
    mx.random.seed(1)
    a = generate(lm, prompt, None, params)
    mx.random.seed(2)
    b = generate(lm, prompt, None, params)
    assert a.tokens != b.tokens
    assert max(a.tokens + b.tokens) < lm.vocab_limit


def test_padded_vocab_rows_are_never_sampled():
    lm = tiny("tiny-llama")
    seq_logits = mx.zeros((1, lm.model.args.vocab_size + 7))
    from runtime.execution.sequence import Sequence

    seq = Sequence(lm, "x", None, SequenceSampling())
    padded = mx.concatenate([seq_logits[:, : lm.vocab_limit], mx.full((1, 7 + lm.model.args.vocab_size - lm.vocab_limit), 100.0)], axis=1)
    assert int(seq.sample(padded).item()) < lm.vocab_limit


def test_prefill_chunks_shrink_as_context_grows():
    sizes = [prefill_chunk_size(n) for n in (0, 2000, 8000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_stop_matcher_holds_back_possible_stop_prefixes():
    m = StopMatcher(("\n\nUser:",))
    assert m.safe_length("Hello\n\nUs") == len("Hello")
    assert m.safe_length("Hello there") == len("Hello there")
    assert m.find("abc\n\nUser: hi") == 3
