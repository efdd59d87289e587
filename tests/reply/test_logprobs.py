"""A reply's log-probabilities (issue 59, item 4): each token's and its alternatives, as the model scores them.

The reference is the model's own forward pass over the prompt and the reply's tokens, cold, with
nothing of kvmem's (``log_softmax`` of its logits at each reply position): kvmem reports the model's
distribution before temperature, penalties and bias (vLLM's and llama.cpp's default), so a sampled,
penalized, biased or forced reply is scored as a greedy one is. Over HTTP, the official OpenAI SDK
reads them streamed and not, and the two agree.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import openai
import pytest
from conftest import models_dir, tiny

from gateway.testing import ServerThread
from runtime.config import Config
from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import decode_alone
from runtime.execution.sampling import SequenceSampling
from runtime.execution.sequence import Sequence
from runtime.plan.sampling import Penalties, SamplingOptions
from runtime.reply.logprobs import MAX_TOP_LOGPROBS

FLOAT_TOL = 2e-3  # float caches against a cold pass (tests/kv/test_cache_correctness.py's)
PROMPT = "The lighthouse keeper wrote in her log every night:"
TOP = 5


def _cold_logprobs(lm, seq: Sequence) -> np.ndarray:
    """The model's log-probabilities at each reply position, from one cold forward pass over the prompt and
    the reply's tokens (the last one's own position aside): mlx-lm's model, no kvmem cache or sampler."""
    ids = seq.token_ids + seq.generated[:-1]
    logits = lm.model(mx.array([ids]))[0, len(seq.token_ids) - 1 :, : lm.vocab_limit].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _run(lm, params: SequenceSampling) -> Sequence:
    seq = Sequence(lm, PROMPT, None, params)
    list(decode_alone(seq))
    return seq


def _assert_scored_as_the_model_scores(lm, seq: Sequence, top: int) -> None:
    ref = _cold_logprobs(lm, seq)
    reported = seq.logprobs
    assert len(reported) == len([t for t in seq.generated if t not in lm.eos_token_ids])
    for i, (token, entry) in enumerate(zip(seq.generated, reported, strict=False)):
        assert entry.logprob == pytest.approx(float(ref[i, token]), abs=FLOAT_TOL), i
        assert len(entry.top) == top
        best = np.sort(ref[i])[::-1][:top]
        np.testing.assert_allclose([o.logprob for o in entry.top], best, atol=FLOAT_TOL)
        for o in entry.top:  # each alternative is the token the reference scores so
            assert float(ref[i, lm.tokenizer._tokenizer.convert_tokens_to_ids(
                lm.tokenizer._tokenizer.convert_ids_to_tokens(_id_of(lm, o)))]) == pytest.approx(o.logprob,
                                                                                                   abs=FLOAT_TOL)


def _id_of(lm, option) -> int:
    """The id whose bytes ``option`` spells (the vocabulary's inverse, by bytes)."""
    table = _spellings(lm)
    return table[bytes(option.bytes)]


_SPELLINGS: dict[int, dict[bytes, int]] = {}


def _spellings(lm) -> dict[bytes, int]:
    key = id(lm)
    if key not in _SPELLINGS:
        table: dict[bytes, int] = {}
        for i in range(lm.vocab_limit):
            table.setdefault(bytes(lm.spell(i)[1]), i)
        _SPELLINGS[key] = table
    return _SPELLINGS[key]


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
def test_each_reply_token_is_scored_as_the_model_scores_it(arch: str) -> None:
    lm = tiny(arch, bits=None)
    seq = _run(lm, SequenceSampling(max_tokens=10, logprobs=TOP))
    _assert_scored_as_the_model_scores(lm, seq, TOP)
    assert seq.logprobs[0].top[0].logprob >= seq.logprobs[0].top[-1].logprob, "most likely first"
    assert all(e.logprob == e.top[0].logprob for e in seq.logprobs), "a greedy token is its position's best"


def test_a_sampled_penalized_biased_reply_is_scored_before_its_sampling() -> None:
    lm = tiny("tiny-llama", bits=None)
    params = SequenceSampling(max_tokens=10, temperature=1.3, top_p=0.9, seed=5, logprobs=3,
                              penalties=Penalties(presence=1.0, repetition=1.2), logit_bias={17: 5.0, 18: -5.0})
    seq = _run(lm, params)
    _assert_scored_as_the_model_scores(lm, seq, 3)
    same = _run(lm, SequenceSampling(**{**params.__dict__, "logprobs": None}))
    assert same.generated == seq.generated, "asking for scores changes no token"


def test_a_forced_opening_is_scored_too_and_no_alternatives_when_none_asked() -> None:
    lm = tiny("tiny-llama", bits=None)
    seq = _run(lm, SequenceSampling(max_tokens=6, forced=(40, 41, 42), logprobs=0))
    assert seq.generated[:3] == [40, 41, 42]
    _assert_scored_as_the_model_scores(lm, seq, 0)


def test_the_tokens_bytes_spell_the_reply_and_a_stop_string_is_not_scored() -> None:
    lm = tiny("tiny-llama", bits=None)
    whole = _run(lm, SequenceSampling(max_tokens=12, logprobs=1))
    # (a prompt that ends in whitespace would drop the first token's leading space from the reply, as mlx-lm
    # does: the token is still reported as the model wrote it; the HTTP test below meets that case)
    assert b"".join(bytes(e.bytes) for e in whole.logprobs).decode() == whole.reply
    assert "".join(e.token for e in whole.logprobs) == whole.reply  # no character split over tokens here
    stop = whole.reply[len(whole.reply) // 2 :][:3]
    cut = _run(lm, SequenceSampling(max_tokens=12, logprobs=1, stop=(stop,)))
    assert cut.stop_sequence == stop and cut.reply == whole.reply[: whole.reply.index(stop)]
    spelled = b"".join(bytes(e.bytes) for e in cut.logprobs).decode()
    assert spelled.startswith(cut.reply) and len(spelled) < len(cut.reply) + len(stop)


def test_a_scored_row_in_a_batch_running_ahead_gets_what_it_gets_alone() -> None:
    """A row asking for scores makes its batch step in lockstep (its scores are read with its token); the
    other rows decode as before, and the scored row's tokens and scores are those it gets alone."""
    lm = tiny("tiny-llama")
    prompts = {"scored": PROMPT, "plain": "Once upon a time in a quiet town, " * 4}
    params = {"scored": SequenceSampling(max_tokens=9, logprobs=2), "plain": SequenceSampling(max_tokens=12)}
    alone = {name: _run_prompt(lm, prompts[name], params[name]) for name in prompts}
    seqs = {}
    for name in prompts:
        seqs[name] = seq = Sequence(lm, prompts[name], None, params[name])
        while seq.prefill_step() is None:
            pass
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=True)
    batch.add(seqs["plain"])
    for step in range(30):
        if step == 2:
            batch.add(seqs["scored"])
        for seq, _ in batch.step_once():
            if seq.finish_reason is not None:
                batch.remove(seq)
        if all(s.finish_reason is not None for s in seqs.values()):
            break
    for name in prompts:
        assert seqs[name].generated == alone[name].generated, name
    for together, by_itself in zip(seqs["scored"].logprobs, alone["scored"].logprobs, strict=True):
        assert together.token == by_itself.token
        assert together.logprob == pytest.approx(by_itself.logprob, abs=5e-3)
        assert [o.token for o in together.top][:1] == [o.token for o in by_itself.top][:1]


def _run_prompt(lm, prompt: str, params: SequenceSampling) -> Sequence:
    seq = Sequence(lm, prompt, None, params)
    list(decode_alone(seq))
    return seq


def test_the_options_bound_the_alternatives() -> None:
    assert SamplingOptions(logprobs=MAX_TOP_LOGPROBS).logprobs == MAX_TOP_LOGPROBS
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingOptions(logprobs=MAX_TOP_LOGPROBS + 1)


# -- over HTTP, with the official OpenAI SDK ------------------------------------------------------------------

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    config = Config(model=MODEL, port=0, home=str(models_dir().parent),
                    cache_dir=str(tmp_path_factory.mktemp("caches")), budget_mb=256, hot_budget_mb=64)
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, user: str, **extra):
    return client.chat.completions.create(model=MODEL, user=user, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Tell me about lighthouses."}],
                                          **extra)


def test_openai_logprobs_streamed_and_not_agree_and_spell_the_content(client: openai.OpenAI) -> None:
    whole = _ask(client, "lp-whole", logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert content and "".join(t.token for t in content) == choice.message.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == choice.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    assert len(content) <= whole.usage.completion_tokens

    streamed, text = [], ""
    for chunk in _ask(client, "lp-streamed", logprobs=True, top_logprobs=3, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0]
        text += delta.delta.content or ""
        if delta.logprobs is not None:
            streamed.extend(delta.logprobs.content)
    assert text == choice.message.content
    assert [t.token for t in streamed] == [t.token for t in content]
    np.testing.assert_allclose([t.logprob for t in streamed], [t.logprob for t in content], atol=5e-3)

    plain = _ask(client, "lp-plain", logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)
    assert _ask(client, "lp-none").choices[0].logprobs is None


def test_openai_top_logprobs_needs_logprobs_and_a_bound(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        _ask(client, "lp-bad", top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        _ask(client, "lp-bad", logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1)
