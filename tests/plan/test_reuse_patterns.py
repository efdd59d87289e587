"""Reuse on the patterns agent clients produce, on the real default model, against independent references.

An agent CLI does more than append: it compacts its history (keeps the system prompt,
replaces the conversation with a summary), a user edits a message and resends, a client
rewinds to an earlier message. Each turn here reuses what it has in common with the
agent's cache, cut at a divergence, and is checked two ways:

* **float KV**: the reply is a cold prefill's of the same prompt (nothing reused), up to the
  cold reply's first near tie. Exact but for float reordering, so a wrong position, a token
  kept past the divergence or a badly cut tokenization shows.
* **Q4 KV** (kvmem's default): the reply is the one the agent gets from a cache that never
  held more than the reused prefix (a cold prefill of exactly that text, parked in Q4, then
  the prompt appended), up to its first near tie: trimming a Q4 cache is exact. Q4 itself
  against float is the fidelity ``benches/quality/fidelity_real.py`` measures.

Where the texts part inside a word, the reused tokens are the cold tokenization's own first
tokens (the cut backs off to the word's start).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from conftest import models_dir, numpy_attention
from reference import first_split_is_a_near_tie, top1_margin
from runtime.execution.generate import decode_alone
from runtime.execution.sequence import Sequence, SequenceSampling
from runtime.model.loaded import LoadedModel, load_model
from runtime.spec import KVFormat

CORPUS = Path(__file__).resolve().parents[2] / "runtime" / "corpus"
STEPS = 8
MARGIN = 0.1
"""Top-1 minus top-2 log-probability below which a reply may part from its reference (as
``agreement.assert_decoded_alike`` allows for a batch)."""
TAIL = "<|im_end|>\n<|im_start|>assistant\n"


@functools.cache
def _default_model(bits: int | None) -> LoadedModel:
    return load_model("kvmem-default", kv_format=KVFormat(bits=bits, key_bits=bits), models_dir=models_dir(),
                      numpy_attention=numpy_attention())


@pytest.fixture(params=[None, 4], ids=["float-kv", "q4-kv"])
def lm(request: pytest.FixtureRequest, smollm2: LoadedModel) -> LoadedModel:
    """The default model (skipped where its package is missing) with float or Q4 KV."""
    return _default_model(request.param)


def _system(lm, tokens: int = 600) -> str:
    text = "You are a careful coding agent. Notes for the project follow.\n\n" + (CORPUS / "essays.txt").read_text()
    while len(lm.tokenize(text)[0]) > tokens:
        text = text[: int(len(text) * 0.9)]
    return text


def _history(turns: int) -> list[dict[str, str]]:
    stories = (CORPUS / "stories.txt").read_text().split("\n\n")
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Read part {i} of the story and keep it in mind."},
                     {"role": "assistant", "content": stories[i % len(stories)][:600]}]
    return messages


def _turn(lm, prompt: str, cache=None, *, trace: bool = False) -> Sequence:
    seq = Sequence(lm, prompt, cache, SequenceSampling(max_tokens=STEPS))
    if trace:
        seq.logits_trace = []
    for _ in decode_alone(seq):
        pass
    return seq


def _greedy_agrees(got: Sequence, reference: Sequence) -> None:
    rows = np.stack([np.array(t.reshape(-1)).astype(np.float64) for t in reference.logits_trace])
    rows = rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)
    confident = top1_margin(rows) > MARGIN
    first_tie = int(np.argmin(confident)) if not confident.all() else len(rows)
    assert got.generated[:first_tie] == reference.generated[:first_tie], (got.reply, reference.reply)
    assert first_tie >= 2, "the reference itself is a near tie at once: pick another prompt"


def _assert_reply_as_reference(lm: LoadedModel, prompt: str, cached: Sequence) -> None:
    """Float KV: a cold prefill's reply. Q4 KV: the reply from a cache that held only the reused text."""
    if lm.spec.kv_format.bits is None:
        _greedy_agrees(cached, _turn(lm, prompt, trace=True))
        return
    reused_text = cached.offsets[cached.stats.tokens_reused - 1]
    prefix = _turn_cache(lm, prompt[:reused_text])
    reference = _turn(lm, prompt, prefix, trace=True)
    assert reference.stats.match == "extend" and reference.stats.tokens_reused == cached.stats.tokens_reused
    _greedy_agrees(cached, reference)


def _turn_cache(lm: LoadedModel, text: str):
    """A cold prefill of exactly ``text``, parked: a cache that never held more."""
    seq = Sequence(lm, text, None, SequenceSampling(max_tokens=1))
    while seq.prefill_step() is None:
        pass
    cache = seq.park()
    assert cache.text == text
    return cache


def _assert_cut_as_cold(lm, prompt: str, cached: Sequence) -> None:
    """The reused tokens are the cold tokenization's first tokens."""
    reused = cached.stats.tokens_reused
    assert cached.token_ids[:reused] == lm.tokenize(prompt)[0][:reused]


def test_a_compacted_history_reuses_the_system_prompt_of_its_own_cache(lm):
    """The seeds' rule discarded a cache a prompt kept less than 80% of: the compaction turn went cold."""
    system = {"role": "system", "content": _system(lm, 400)}
    long = lm.render([system, *_history(6), {"role": "user", "content": "What did the keeper see?"}])
    first = _turn(lm, long)
    compacted = lm.render([system, {"role": "user", "content": "Summary: we read four parts of a story about a "
                                    "lighthouse keeper. Now, in one sentence, what is a lighthouse for?"}])
    second = _turn(lm, compacted, first.park())
    system_tokens = len(lm.tokenize(lm.render([system], add_generation_prompt=False))[0])
    assert second.stats.match == "partial"
    assert system_tokens <= second.stats.tokens_reused < 0.5 * first.park().num_tokens  # the seeds kept >= 80%
    _assert_cut_as_cold(lm, compacted, second)
    _assert_reply_as_reference(lm, compacted, second)


@pytest.mark.parametrize(("before", "after"), [
    ("What is the capital of France? Answer in one word.", "What is the capital of Francis? Answer in one word."),
    ("Il est allé à la café.", "Il est allè à la café."),  # é and è share their first UTF-8 byte
    ("我们今天去公园散步，然后回家吃饭。", "我们今天去公园跑步，然后回家吃饭。"),  # no whitespace to back off to
], ids=["inside-a-word", "inside-a-multibyte-character", "cjk-run"])
def test_an_edited_last_message_reuses_up_to_where_it_changed(lm, before, after):
    system = {"role": "system", "content": _system(lm, 300)}
    history = _history(1)
    first = _turn(lm, lm.render([system, *history, {"role": "user", "content": before}]))
    edited = lm.render([system, *history, {"role": "user", "content": after}])
    second = _turn(lm, edited, first.park())
    shared_text = len(lm.render([system, *history], add_generation_prompt=False)) + len('<|im_start|>user\n') + next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert second.stats.match == "partial"
    reused_text = second.offsets[second.stats.tokens_reused - 1]
    assert reused_text <= shared_text and edited[:reused_text] == first.prompt[:reused_text]
    assert second.stats.tokens_prefilled <= len(lm.tokenize(after + TAIL)[0]) + 2  # at most the edited message
    if after.isascii() or " " in after:
        _assert_cut_as_cold(lm, edited, second)
    _assert_reply_as_reference(lm, edited, second)


def test_a_rewind_to_an_earlier_message_reuses_everything_before_it(lm):
    """A client's "rewind": the conversation three turns back, then a new question."""
    system = {"role": "system", "content": _system(lm, 300)}
    history = _history(4)
    first = _turn(lm, lm.render([system, *history, {"role": "user", "content": "And then?"}]))
    branch = lm.render([system, *history[:2], {"role": "user", "content": "Stop. Who wrote this story?"}])
    second = _turn(lm, branch, first.park())
    assert second.stats.tokens_reused >= len(lm.tokenize(lm.render([system, *history[:2]], add_generation_prompt=False))[0])
    _assert_cut_as_cold(lm, branch, second)
    _assert_reply_as_reference(lm, branch, second)


# -- through the runtime: another agent's prefix to the token, blocks after a restart, a branch from disk --


def _reply_pieces(lm: LoadedModel, seq: Sequence) -> tuple[list[str], list[float]]:
    """The reference reply's token texts and top-1 margins, per step (for ``first_split_is_a_near_tie``)."""
    texts = [lm.tokenizer.decode(seq.generated[: k + 1]) for k in range(len(seq.generated))]
    pieces = [b[len(a):] for a, b in zip(["", *texts], texts, strict=False)]
    return pieces, [float(m) for m in top1_margin(np.stack([np.array(t.reshape(-1)) for t in seq.logits_trace]))]


def _as_cold(lm: LoadedModel, messages: list[dict[str, str]], reply: str) -> None:
    reference = _turn(lm, lm.render(messages), trace=True)
    assert first_split_is_a_near_tie(reply, reference.reply, *_reply_pieces(lm, reference)), (reply, reference.reply)


async def test_agents_share_a_prefix_to_the_token_hot_from_blocks_after_a_restart_and_a_branch_from_disk(tmp_path, smollm2):
    """Float KV, so each reply is a cold prefill's of its prompt (up to a near tie):

    * a sibling starts from the first agent's hot cache to the last whole token they share (not whole blocks);
    * after a restart (nothing in RAM), a third starts from the whole blocks the first one's save stored;
    * an agent that branched back to an earlier point (its hot cache is the new branch) and then returns to
      the first branch starts from that branch's blocks on disk, beyond what its hot cache shares."""
    from actors import open_runtime

    lm = _default_model(None)
    system = {"role": "system", "content": _system(lm, 500)}
    asks = ["Who wrote the notes?", "What is the first note about?", "Name one idea from the notes."]
    sibling_messages = [[system, {"role": "user", "content": q}] for q in asks]
    system_tokens = len(lm.tokenize(lm.render([system], add_generation_prompt=False))[0])
    history = _history(6)  # branch A runs more than a block past where branch B leaves it
    branch_a = [system, *history, {"role": "user", "content": "And then?"}]
    branch_b = [system, history[0], {"role": "user", "content": "Stop there. Who is speaking?"}]

    def runtime():
        return open_runtime(model="kvmem-default", home=tmp_path, models_dir=models_dir(), fsync=False,
                            handle_signals=False, kv_bits=None)

    async with runtime() as rt:
        first = await rt.agent("first").send(sibling_messages[0], max_tokens=STEPS)
        second = await rt.agent("second").send(sibling_messages[1], max_tokens=STEPS)
        writer = rt.agent("writer")
        await writer.send(branch_a, max_tokens=STEPS)
        on_b = await writer.send(branch_b, max_tokens=STEPS)
    assert first.usage.tier == "cold"
    assert second.usage.tier == "shared" and system_tokens <= second.usage.tokens_reused
    assert second.usage.tokens_reused % 256 != 0  # to the token, not whole blocks
    assert on_b.usage.tier == "hot" and on_b.usage.match == "partial"

    async with runtime() as rt:  # a restart: nothing in RAM, and nobody holds the system prompt
        third = await rt.agent("third").send(sibling_messages[2], max_tokens=STEPS)
        back = await rt.agent("writer").send(branch_a, max_tokens=STEPS)
    assert third.usage.tier == "warm" and third.usage.tokens_reused == system_tokens // 256 * 256 > 0
    whole_a = len(lm.tokenize(lm.render(branch_a))[0])
    assert back.usage.tier == "warm" and back.usage.tokens_reused == (whole_a - 1) // 256 * 256
    assert back.usage.tokens_reused > on_b.usage.tokens_reused  # more than its own cache (branch B) shares

    for messages, result in zip([*sibling_messages, branch_b, branch_a], [first, second, third, on_b, back]):
        _as_cold(lm, messages, result.reply)
