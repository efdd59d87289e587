"""A turn's seed and repeat penalties: what mlx-lm's sampler and logits processors give, alone and in a batch.

The reference is plain mlx-lm (``generate_step`` on the model's own cache, no kvmem code): a seeded
turn draws what mlx-lm's sampler draws after ``mx.random.seed(seed)`` (mlx-lm's server's ``seed``),
and a penalized one takes the tokens mlx-lm's ``make_logits_processors`` leave it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
import trio
from conftest import models_dir, tiny
from engine_turns import tiny_engine
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from reference import masked_greedy

from actors import open_runtime
from runtime.execution.decode_batch import DecodeBatch
from runtime.execution.generate import generate
from runtime.execution.sampling import SeededSampler, SequenceSampling
from runtime.execution.sequence import Sequence
from runtime.plan.sampling import Penalties, SamplingOptions
from runtime.reply.tool_calls import ReplyRules

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
STEPS = 24
PENALTIES = Penalties(presence=1.5, frequency=0.5, repetition=1.3)


def _prompt_ids(lm) -> list[int]:
    return Sequence(lm, PROMPT, None, SequenceSampling(max_tokens=1)).token_ids


def _mlx_lm(lm, sampler=None, processors=()) -> list[int]:
    """``generate_step``'s tokens for PROMPT (its padded vocabulary masked, as kvmem never samples it)."""
    steps = generate_step(mx.array(_prompt_ids(lm)), lm.model, max_tokens=STEPS, sampler=sampler,
                          logits_processors=[masked_greedy(lm.vocab_limit), *processors])
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
def test_a_seeded_turn_draws_what_mlx_lm_draws_after_seeding(arch: str) -> None:
    lm = tiny(arch)
    params = SequenceSampling(max_tokens=STEPS, temperature=0.9, top_p=0.95, top_k=40, seed=11)
    ours = generate(lm, PROMPT, None, params).tokens
    mx.random.seed(11)
    assert ours == _mlx_lm(lm, make_sampler(0.9, top_p=0.95, top_k=40))
    mx.random.seed(0)  # the process's own stream moves between the turns: a seeded turn does not see it
    mx.random.uniform()
    assert generate(lm, PROMPT, None, params).tokens == ours
    another = generate(lm, PROMPT, None, SequenceSampling(max_tokens=STEPS, temperature=0.9, top_p=0.95, top_k=40,
                                                          seed=12)).tokens
    assert another != ours, "another seed draws another reply"


def test_a_seeded_draw_covers_the_models_padded_vocabulary_as_mlx_lm_s() -> None:
    """kvmem samples the ids the tokenizer knows; a padded model's draw still spans its whole width,
    so a seed gives the token mlx-lm's sampler gives over the masked logits."""
    width, known = 300, 257
    logprobs = mx.log(mx.softmax(mx.random.normal((1, width), key=mx.random.key(3)), axis=-1))
    masked = mx.concatenate([logprobs[:, :known], mx.full((1, width - known), -mx.inf)], axis=-1)
    theirs = make_sampler(1.0, top_k=30)
    mx.random.seed(5)
    expected = [theirs(masked).item() for _ in range(20)]
    ours = SeededSampler(5, temperature=1.0, top_k=30, width=width)
    got = [ours(logprobs[:, :known]).item() for _ in range(20)]
    assert got == expected and max(got) < known


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
def test_repeat_penalties_are_mlx_lm_s_logits_processors(arch: str) -> None:
    lm = tiny(arch)
    ours = generate(lm, PROMPT, None, SequenceSampling(max_tokens=STEPS, penalties=PENALTIES)).tokens
    processors = make_logits_processors(repetition_penalty=1.3, presence_penalty=1.5, frequency_penalty=0.5)
    assert ours == _mlx_lm(lm, processors=processors)
    assert ours != generate(lm, PROMPT, None, SequenceSampling(max_tokens=STEPS)).tokens, "the penalties bite"


def test_a_logit_bias_is_mlx_lm_s_and_the_engine_checks_it_against_the_model() -> None:
    lm = tiny("tiny-llama")
    plain = generate(lm, PROMPT, None, SequenceSampling(max_tokens=STEPS)).tokens
    bias = {plain[0]: -100.0, plain[1]: 7.5, 1000: 3.0}
    ours = generate(lm, PROMPT, None, SequenceSampling(max_tokens=STEPS, logit_bias=bias)).tokens
    assert ours == _mlx_lm(lm, processors=make_logits_processors(logit_bias=bias))
    assert plain[0] not in ours

    with tiny_engine("cpu") as engine:
        rules = ReplyRules(fmt=None, banned=(plain[1],))  # a tool_choice's ban of the call marker, say
        params = engine.sampling_params(SamplingOptions(logit_bias=tuple(bias.items())), rules)
        assert params.logit_bias[plain[1]] == float("-inf") and params.logit_bias[1000] == 3.0
        with pytest.raises(ValueError, match="logit_bias: token 5000 is not in the model's vocabulary"):
            engine.sampling_params(SamplingOptions(logit_bias=((5000, 1.0),)))
        # top_k of the whole vocabulary or more filters nothing (mlx-lm's sampler refuses it mid-turn)
        assert engine.sampling_params(SamplingOptions(top_k=100_000)).top_k == 0
        assert engine.sampling_params(SamplingOptions(top_k=40)).top_k == 40


def test_a_batch_running_ahead_gives_penalized_and_seeded_rows_their_own_replies() -> None:
    """Under the GPU policy a batch launches step k+1 before it reads step k: a penalized row needs
    step k's token for step k+1, so the batch steps in lockstep while one is in it; a seeded row draws
    from its own stream, whatever the others sample. Each row's reply is the one it makes alone."""
    lm = tiny("tiny-llama")
    rows = {
        "penalized": SequenceSampling(max_tokens=STEPS, penalties=PENALTIES),
        "seeded": SequenceSampling(max_tokens=STEPS, temperature=0.9, seed=7),
        "sampled": SequenceSampling(max_tokens=STEPS, temperature=0.9),  # the process's stream, beside them
    }
    alone = {name: generate(lm, PROMPT, None, params).tokens for name, params in rows.items() if name != "sampled"}
    batch = DecodeBatch(shared_prefix_check=False, run_ahead=True)
    seqs = {}
    for name, params in rows.items():
        seq = Sequence(lm, PROMPT, None, params)
        while seq.prefill_step() is None:
            pass
        seqs[name] = seq
    batch.add(seqs["seeded"])
    batch.add(seqs["sampled"])
    for _ in range(3):
        batch.step_once()
    assert batch._ahead is not None, "the batch runs ahead before the penalized row joins"
    batch.add(seqs["penalized"])
    for _ in range(2 * STEPS):
        for seq, _text in batch.step_once():
            if seq.finish_reason is not None:
                batch.remove(seq)
        if not len(batch):
            break
    assert seqs["penalized"].generated == alone["penalized"]
    assert seqs["seeded"].generated == alone["seeded"]


def test_penalties_and_seeds_out_of_range_are_refused() -> None:
    for bad in ({"presence": 2.5}, {"frequency": -3.0}, {"repetition": 0.0}, {"presence": float("nan")}):
        with pytest.raises(ValueError, match="penalty"):
            Penalties(**bad)
    with pytest.raises(ValueError, match="seed"):
        SamplingOptions(seed=2**63)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingOptions(logit_bias=((3, 101.0),))
    assert Penalties.of() is None and Penalties.of(0.0, None, 1.0) is None
    assert Penalties.of(frequency=0.2) == Penalties(frequency=0.2)


async def test_a_seed_repeats_an_agent_s_reply_through_the_runtime(tmp_path) -> None:
    """Two agents send the same conversation with the same seed, once apart and once together with
    a third agent sampling beside them: the same reply each time; another seed, another reply."""
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    async with open_runtime(model="tiny-llama", home=tmp_path, models_dir=models_dir(), fsync=False) as rt:
        first = await rt.agent("a").send(messages, max_tokens=16, temperature=0.9, seed=42)
        got: dict[str, str] = {}

        async def send(agent: str, seed: int | None) -> None:
            got[agent] = (await rt.agent(agent).send(messages, max_tokens=16, temperature=0.9, seed=seed)).reply

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "b", 42)
            nursery.start_soon(send, "c", None)
            nursery.start_soon(send, "d", 43)
        penalized = await rt.agent("e").send(messages, max_tokens=16, presence_penalty=1.5, repetition_penalty=1.3)
        plain = await rt.agent("f").send(messages, max_tokens=16)
    assert got["b"] == first.reply
    assert got["d"] != first.reply
    assert penalized.reply != plain.reply
