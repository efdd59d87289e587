"""The actor runtime on real MLX tiny models: isolation, ordering, streaming, persistence, budget, sharing.

References are computed on the test thread *before* a runtime starts (the
runtime's MLX work runs on its own thread; the two never overlap).
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import trio
from conftest import models_dir, tiny
from reference import first_split_is_a_near_tie, top1_margin


from actors import open_runtime

from runtime.execution.generate import decode_alone, generate
from runtime.persist import CacheDirectory
from runtime.execution.sequence import SequenceSampling, Sequence

CORPUS = Path(__file__).resolve().parents[2] / "runtime" / "corpus" / "stories.txt"
TOPICS = [
    "the old mill by the river",
    "a lighthouse in a storm",
    "the baker's secret recipe",
    "a fox and a crow",
    "the mountain village school",
    "a ship made of glass",
    "the last train home",
    "a garden on the moon",
]


def _open(home: Path, model: str, **kw):
    kw.setdefault("handle_signals", False)
    if kw.get("kv_bits", 4) is not None:  # the references' keys (tiny(): Q4), on any device: a GPU's would be Q8
        kw.setdefault("kv_key_bits", kw.get("kv_bits", 4))
    return open_runtime(model=model, home=home, models_dir=models_dir(), fsync=False, **kw)


def _conversation(i: int, reply: str | None) -> list[dict[str, str]]:
    messages = [
        {"role": "system", "content": "You are a storyteller."},
        {"role": "user", "content": f"Tell me about {TOPICS[i]}."},
    ]
    if reply is not None:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "What happened next?"}]
    return messages


def _alone(lm, prompt: str, cache, params: SequenceSampling):
    """The reference turn, decoded on its own, with each token's text and top-1 margin."""
    seq = Sequence(lm, prompt, cache, params)
    seq.logits_trace = []
    for _ in decode_alone(seq):
        pass
    tokens = list(seq.generated)
    texts = [lm.tokenizer.decode(tokens[: k + 1]) for k in range(len(tokens))]
    pieces = [b[len(a):] for a, b in zip(["", *texts], texts, strict=False)]
    margins = [float(m) for m in top1_margin(np.concatenate([np.array(t) for t in seq.logits_trace]))]
    return seq.reply, seq.park(), pieces, margins


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
async def test_eight_concurrent_agents_reply_exactly_as_each_conversation_alone(model, tmp_path):
    """Reference: the same two-turn conversation decoded on its own, outside the
    runtime — turn 1 from no cache, turn 2 from turn 1's cache (the agent's
    memory) — float KV, greedy, 24 tokens. The runtime batches the 8 agents
    together (prefills interleaved, merge/extend/filter as they come and go).
    Every reply must be the reference's text, except that it may depart from it
    at a near tie (top-1 margin < ``NEAR_TIE``: batching moves logits by ~2e-5);
    an agent that departed in turn 1 is not compared in turn 2 (its prompt differs)."""
    lm = tiny(model, bits=None)
    params = SequenceSampling(max_tokens=24)
    expected = {}
    for i in range(8):
        first, cache, pieces1, margins1 = _alone(lm, lm.render(_conversation(i, None)), None, params)
        second, _, pieces2, margins2 = _alone(lm, lm.render(_conversation(i, first)), cache, params)
        expected[i] = ((first, pieces1, margins1), (second, pieces2, margins2))

    got: dict[int, tuple[str, str]] = {}
    async with _open(tmp_path, model, kv_bits=None) as rt:

        async def agent(i: int) -> None:
            handle = rt.agent(f"agent-{i}")
            first = await handle.send(_conversation(i, None), max_tokens=24)
            second = await handle.send(_conversation(i, first.reply), max_tokens=24)
            assert second.usage.tier == "hot" and second.usage.tokens_reused > 0
            got[i] = (first.reply, second.reply)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(agent, i)
        assert rt.stats().gpu.steps < 2 * 8 * 24  # they really decoded together
    identical = 0
    for i in range(8):
        for turn in (0, 1):
            reply, pieces, margins = expected[i][turn]
            assert first_split_is_a_near_tie(got[i][turn], reply, pieces, margins), (i, turn, got[i][turn], reply)
            identical += got[i][turn] == reply
            if got[i][turn] != reply:
                break
    assert identical >= 12, f"only {identical} of 16 replies identical: near ties should be rare"


async def test_two_requests_for_one_agent_run_in_order_and_the_second_reuses_the_first(tmp_path):
    base = "User: " + CORPUS.read_text()[:900] + "\nAssistant:"
    prompts = [base, base + " Sure.\nUser: Go on.\nAssistant:"]
    async with _open(tmp_path, "tiny-llama", trace=True) as rt:
        results = {}

        async def send(i: int) -> None:
            results[i] = await rt.agent("ordered").send_prompt(prompts[i], max_tokens=8)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, 0)
            nursery.start_soon(send, 1)
        events = rt.gpu_events()
    first, second = sorted(results.values(), key=lambda r: r.usage.tokens_reused)
    assert first.usage.tier == "cold" and first.usage.tokens_reused == 0
    assert second.usage.tier == "hot" and second.usage.tokens_reused > 150
    finished_first = next(e.at for e in events if e.kind == "finish" and first.request_id in e.request_ids)
    admitted_second = next(e.at for e in events if e.kind == "admit" and second.request_id in e.request_ids)
    assert finished_first <= admitted_second


async def test_long_prefill_does_not_block_a_streaming_agent(tmp_path):
    lm = tiny("tiny-qwen2", bits=None)
    text = CORPUS.read_text()
    long_prompt = text[: 4 * len(text) // max(1, len(lm.tokenize(text)[0]) // 1000)]  # about 4K tokens
    while len(lm.tokenize(long_prompt)[0]) > 3900:
        long_prompt = long_prompt[:-200]
    assert len(lm.tokenize(long_prompt)[0]) > 3500
    chunk = 256
    async with _open(tmp_path, "tiny-qwen2", kv_bits=None, prefill_chunk=chunk, trace=True) as rt:
        arrivals: list[int] = []  # at each of A's deltas: how many prefill chunks the trace held
        b_result = []

        async def long_prefill() -> None:
            b_result.append(await rt.agent("B").send_prompt(long_prompt, max_tokens=2))

        async with trio.open_nursery() as nursery:
            async with rt.agent("A").stream_prompt("User: Tell me a long story.\nAssistant:", max_tokens=60) as stream:
                async for _delta in stream:
                    arrivals.append(sum(e.kind == "chunk" for e in rt.gpu_events()))
                    if len(arrivals) == 3:
                        nursery.start_soon(long_prefill)
            a_result = stream.result
        events = rt.gpu_events()
    assert a_result is not None and a_result.finish_reason == "length"
    a_id, b_id = a_result.request_id, b_result[0].request_id
    b_chunks = [e for e in events if e.kind == "chunk" and b_id in e.request_ids]
    assert len(b_chunks) >= 3500 // chunk
    start, end = b_chunks[0].at, b_chunks[-1].at
    window = [e for e in events if start <= e.at <= end]
    # In steps: between two decode steps of A there is at most one prefill chunk.
    chunks_since_step = 0
    a_steps = 0
    for event in window:
        if event.kind == "step" and a_id in event.request_ids:
            a_steps += 1
            chunks_since_step = 0
        elif event.kind == "chunk":
            chunks_since_step += 1
            assert chunks_since_step <= 1
    assert a_steps >= len(b_chunks) - 1
    # At A's client: A's tokens keep arriving during B's prefill, a chunk or so apart, not all at the end. Counted
    # in B's chunks, not in seconds: A's deltas came after at least half of B's chunks (before its last one), each
    # such chunk followed by one of them before the next chunk.
    before_b = sum(e.kind == "chunk" for e in events if e.at < start)  # A's own
    during = {seen - before_b for seen in arrivals if 0 < seen - before_b < len(b_chunks)}
    assert len(during) >= len(b_chunks) // 2, (sorted(during), len(b_chunks))


async def test_restarted_runtime_serves_a_returning_agent_from_disk(tmp_path):
    messages = [{"role": "user", "content": "Describe the harbour at dawn."}]
    async with _open(tmp_path, "tiny-llama") as rt:
        first = await rt.agent("returning").send(messages, max_tokens=12)
        assert first.usage.tier == "cold"
    async with _open(tmp_path, "tiny-llama") as rt:
        messages += [{"role": "assistant", "content": first.reply}, {"role": "user", "content": "And at night?"}]
        second = await rt.agent("returning").send(messages, max_tokens=4)
    assert second.usage.tier == "warm" and second.usage.tokens_reused > 0 and second.usage.match == "extend"


async def test_cancelling_the_runtime_mid_traffic_leaves_completed_turns_on_disk(tmp_path):
    completed: dict[str, tuple[str, str]] = {}
    turns = 0
    in_flight_at_cancel = 0
    asking: set[str] = set()
    tag = None
    with trio.CancelScope() as cancel:
        async with _open(tmp_path, "tiny-llama") as rt:
            tag = rt.stats().registry.model_tag

            async def chat(name: str) -> None:
                nonlocal turns, in_flight_at_cancel
                prompt = f"User: {name}, tell me about the sea.\nAssistant:"
                while True:
                    asking.add(name)
                    result = await rt.agent(name).send_prompt(prompt, max_tokens=6)
                    asking.discard(name)
                    completed[name] = (prompt, result.reply)
                    turns += 1
                    if turns == 12:
                        # Turns sent and not answered: on the GPU, or still being rendered, tokenized or saved
                        # (the GPU actor's own counts miss a turn being tokenized, which a loaded machine shows).
                        in_flight_at_cancel = len(asking)
                        cancel.cancel()  # mid-traffic
                    prompt += result.reply + "\nUser: More.\nAssistant:"

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(chat, f"sailor{i}")
    assert cancel.cancelled_caught and len(completed) == 5 and in_flight_at_cancel > 0
    disk = CacheDirectory(tmp_path / "caches")
    for name, (prompt, _reply) in completed.items():
        snap = disk.load(name, model_tag=tag)  # verified load: checksums, hash chain, shapes
        # The last turn the client saw complete (or a later one that completed too).
        assert snap.text.startswith(prompt) and snap.offsets[-1] == len(snap.text)


async def test_small_budget_serves_every_agent_and_bounds_peak_memory(tmp_path):
    """Budget 4 MiB of running KV (float32 tiny-llama: 4 KiB/token, 1 MiB per 256-token
    block), hot tier 2 MiB, kept float KV 2 MiB. Each agent needs 2 blocks, so at most 2 run at once; the
    other 6 wait. Stated margin: 16 MiB over budget + hot budget + weights + what the device's
    libraries keep, for transients: a prefill chunk's logits and attention scores (<= 512 tokens:
    512 x 2048 vocab x 4 B = 4 MiB of logits, 4 heads x 512 x 512 x 4 B = 4 MiB of scores per layer),
    the copies a batch extend/filter makes (old and new batch cache), and a parked copy made before
    the active cache is freed. Measured: peak ~18 MiB over the baseline (limit 26.75) on the CPU.

    What the device keeps after its first turns (workspaces, compiled kernels' buffers) is measured
    by warm-up turns whose agents are then forgotten, not guessed: MLX's CUDA backend kept about
    22 MiB here (an H200, run 4: peak 49 MiB over the baseline, 30.75 MiB still active at the end),
    the CPU about none. Before, GPUs had a fixed 32 MiB margin, which run 4 overshot. Two warm-up
    agents at once, as the test's own turns run: after one alone, run 5 measured nothing kept,
    yet 28 MiB over the baseline (the model 5) were still active after the batches of two.

    The transients are measured too: the test's own turns are bounded by what stays active after the
    warm-up, the budgets, and the margin or, where more, the warm-up's own peak over what it left
    active (the same prompts, two at once, so the same products' workspaces). H200 run 6: the whole
    run peaked 49.6 MiB over the baseline (the model 5, kept 5.3): a fixed margin for transients
    measured on the CPU does not hold for a device whose libraries allocate scratch per product."""
    prompt = "User: " + CORPUS.read_text()[:1200] + "\nAssistant:"
    # The float KV kept for hot turns is a third budget: named, so the bound holds on every device
    # (left unset, a GPU keeps 10% of its memory: an H200's run 3 peaked at 49 MiB here).
    budget_mb, hot_mb, float_mb = 4, 2, 2
    margin = 16 * 2**20
    async with _open(tmp_path, "tiny-llama", kv_bits=None, budget_mb=budget_mb, hot_budget_mb=hot_mb,
                     keep_float_mb=float_mb, trace=True) as rt:
        async with trio.open_nursery() as nursery:  # two at once: the batch's kernels and workspaces too
            for name in ("warm-up-a", "warm-up-b"):
                nursery.start_soon(partial(rt.agent(name).send_prompt, f"{name} " + prompt, max_tokens=16))
        for name in ("warm-up-a", "warm-up-b"):
            assert await rt.agent(name).forget()
        kept = rt.stats().gpu.memory
        device_keeps = max(0, kept.active - kept.baseline - kept.model)
        transients = max(margin, kept.peak - kept.active)  # the warm-up's: no budget held two agents back
        mx.reset_peak_memory()  # the peak of the test's own turns from here (the runtime is idle)
        results = []

        async def agent(i: int) -> None:
            results.append(await rt.agent(f"tight-{i}").send_prompt(f"{i} " + prompt, max_tokens=16))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(agent, i)
        stats = rt.stats()
        batch_sizes = {len(e.request_ids) for e in rt.gpu_events() if e.kind == "step"}
    assert len(results) == 8 and all(r.finish_reason in ("length", "stop") for r in results)
    assert max(batch_sizes) == 2  # batched, but never more than the budget holds
    assert stats.gpu.memory_waits_total >= 1 and max(r.usage.queue_wait_ms for r in results) > 0
    assert stats.gpu.pool.total_blocks == 4
    mem = stats.gpu.memory
    assert device_keeps <= 32 * 2**20, f"the device's libraries keep {device_keeps / 2**20:.1f} MiB after a turn"
    assert mem.peak - kept.active <= (budget_mb + hot_mb + float_mb) * 2**20 + transients, (
        f"peak {(mem.peak - kept.active) / 2**20:.1f} MiB over the warm-up's leftover; transients "
        f"{transients / 2**20:.1f} MiB")


async def test_second_agent_prefills_only_its_own_part_of_a_shared_system_prompt(tmp_path):
    lm = tiny("tiny-llama", bits=4)
    system = CORPUS.read_text()[:6000]
    while len(lm.tokenize(system)[0]) > 1100:
        system = system[:-100]
    a_messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who is the hero?"}]
    b_messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where does it happen?"}]
    b_tokens = len(lm.tokenize(lm.render(b_messages))[0])
    async with _open(tmp_path, "tiny-llama") as rt:
        a = await rt.agent("alpha").send(a_messages, max_tokens=4)
        b = await rt.agent("beta").send(b_messages, max_tokens=4)
        c = await rt.agent("gamma", share_prefix=False).send(b_messages, max_tokens=4)
        await rt.flush()
        stats = rt.stats()
        tag = stats.registry.model_tag
    assert a.usage.tier == "cold" and a.usage.tokens_prefilled > 1024
    system_tokens = len(lm.tokenize(lm.render(a_messages[:1], add_generation_prompt=False))[0])
    assert b.usage.tier == "shared" and b.usage.tokens_reused >= system_tokens > 1024  # to the token, not 1024
    assert b.usage.tokens_reused + b.usage.tokens_prefilled == b_tokens  # its own part only
    assert c.usage.tier == "cold" and c.usage.tokens_prefilled >= b_tokens - 2  # opted out
    disk = CacheDirectory(tmp_path / "caches")
    names = ("alpha", "beta", "gamma")
    hashes = {name: disk.block_hashes(tag, disk.load(name, model_tag=tag).token_ids) for name in names}
    assert hashes["alpha"][:4] == hashes["beta"][:4]
    pool = stats.store.pools[tag]
    distinct = set().union(*hashes.values())
    tails = 3  # every cache ends in a partial block
    assert pool.shared_blocks == len(distinct)
    assert pool.used_blocks == len(distinct) + tails < sum(map(len, hashes.values())) + tails
    on_disk = list((tmp_path / "caches" / "blocks").rglob("*.safetensors"))
    assert len(on_disk) == len(distinct)  # shared blocks are stored once


async def test_agents_arriving_together_share_the_first_ones_prefix_and_reply_as_alone(tmp_path):
    """Four cold agents with one long system prompt arrive at once: the first prefills
    it, the others start from its prompt, to the token they share, while it decodes. Reference: each
    conversation alone through ``runtime.execution.generate.generate`` from no cache (float KV,
    greedy); the replies must be identical and the others must prefill only the rest."""
    lm = tiny("tiny-llama", bits=None)
    system = CORPUS.read_text()[:4000]
    while len(lm.tokenize(system)[0]) > 600:
        system = system[:-50]
    questions = ["Who is the hero?", "Where does it happen?", "What is the weather?", "How does it end?"]
    conversations = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    prompt_ids = [lm.tokenize(lm.render(c))[0] for c in conversations]
    params = SequenceSampling(max_tokens=12)
    expected = [generate(lm, lm.render(c), None, params).reply for c in conversations]
    prompt_tokens = [len(lm.tokenize(lm.render(c))[0]) for c in conversations]
    assert all(512 < n < 768 for n in prompt_tokens)
    results = {}
    # The reference's chunk schedule (runtime.execution.sequence.prefill_chunk_size: 512 below 1024 tokens) on any
    # device: the GPU policy's 2048 would prefill these prompts in one chunk where the reference takes two.
    async with _open(tmp_path, "tiny-llama", kv_bits=None, prefill_chunk=512) as rt:

        async def agent(i: int) -> None:
            results[i] = await rt.agent(f"together-{i}").send(conversations[i], max_tokens=12)

        async def opted_out() -> None:
            results["alone"] = await rt.agent("alone", share_prefix=False).send(conversations[0], max_tokens=12)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(agent, i)
            nursery.start_soon(opted_out)
    # Exact, not near-tie, on any backend: the references' smallest top-1 margin is 0.45 (measured),
    # four orders above what batching or another device's float32 kernels move logits by (~2e-5, NEAR_TIE).
    assert [results[i].reply for i in range(4)] == expected
    assert sorted(results[i].usage.tier for i in range(4)) == ["cold", "shared", "shared", "shared"]
    for i in range(4):
        usage = results[i].usage
        assert usage.tokens_reused + usage.tokens_prefilled == prompt_tokens[i]
        if usage.tier == "shared":  # the first one's prompt, to the token they have in common with it
            donor = next(j for j in range(4) if results[j].usage.tier == "cold")
            in_common = len(os.path.commonprefix([prompt_ids[donor], prompt_ids[i]]))
            assert usage.tokens_reused == in_common > 512 and usage.match == "extend"
    alone = results["alone"]
    assert alone.reply == expected[0]
    assert alone.usage.tier == "cold" and alone.usage.tokens_prefilled == prompt_tokens[0]


@pytest.mark.parametrize(("kv_bits", "profile", "key_bits"), [(None, "auto", None), (4, "auto", None), (4, "gpu", 8)],
                         ids=["float", "q4-at-rest", "k8v4-at-rest-gpu-policy"])
async def test_an_agent_arriving_while_another_decodes_starts_from_its_prompt(tmp_path, kv_bits, profile, key_bits):
    """The second agent with the same system prompt arrives after the first one's prefill ended (its first
    token is out) and nobody waited for that prompt: the first turn's prompt is parked from its batch row
    then, and the second prefills only its own part. Before, it prefilled the whole prompt again: the cause
    of the test above's occasional second cold agent, when an agent's message reached the GPU actor late.

    References, each conversation alone through ``runtime.execution.sequence.Sequence`` outside the
    runtime: the first from no cache; the second from no cache (float KV: identical replies) or, Q4 at
    rest, from the first's whole turn parked in Q4 and cut to the tokens the two prompts have in common (what
    it starts from; replies may depart only at a near tie). Under the GPU policy the first decodes alone on its own
    caches (``alone_on_own_caches``), elsewhere in a batch of one: its prompt is parked from either; and its
    keys are in Q8 (the policy's default ``kv_key_bits``), as the references' are."""
    lm = tiny("tiny-llama", bits=kv_bits, key_bits=key_bits)
    system = CORPUS.read_text()[:4000]
    while len(lm.tokenize(system)[0]) > 600:
        system = system[:-50]
    prompts = [lm.render([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in ("Who is the hero?", "Where does it happen?")]
    prompt_tokens = [len(lm.tokenize(p)[0]) for p in prompts]
    params = SequenceSampling(max_tokens=48)
    first_expected, first_cache, _, _ = _alone(lm, prompts[0], None, params)
    in_common = len(os.path.commonprefix([lm.tokenize(p)[0] for p in prompts]))
    assert in_common > 512
    donor = first_cache.truncated(in_common, lm.spec) if kv_bits else None
    second_expected, _, pieces, margins = _alone(lm, prompts[1], donor, params)
    options = {"attention": "at-rest", "kv_key_bits": key_bits or kv_bits} if kv_bits else {}
    async with _open(tmp_path, "tiny-llama", kv_bits=kv_bits, prefill_chunk=512, profile=profile, **options) as rt:
        async with rt.agent("first").stream_prompt(prompts[0], max_tokens=48) as stream:
            deltas = aiter(stream)
            text = await anext(deltas)  # its prefill ended: it decodes
            second = await rt.agent("second").send_prompt(prompts[1], max_tokens=48)
            async for delta in deltas:
                text += delta
        first = stream.result
    assert first is not None and first.reply == text == first_expected
    assert second.usage.tier == "shared" and second.usage.match == "extend"
    assert second.usage.tokens_reused == in_common  # to the token, not whole blocks
    assert second.usage.tokens_prefilled == prompt_tokens[1] - in_common
    if kv_bits is None:
        assert second.reply == second_expected
    else:
        assert first_split_is_a_near_tie(second.reply, second_expected, pieces, margins), (
            second.reply, second_expected)


async def test_cancelled_consumer_stops_generation_and_keeps_a_consistent_cache(tmp_path):
    prompt = "User: Tell me about the harbour.\nAssistant:"
    async with _open(tmp_path, "tiny-llama") as rt:
        seen = ""
        async with rt.agent("quitter").stream_prompt(prompt, max_tokens=200) as stream:
            async for delta in stream:
                seen += delta
                if len(seen) >= 10:
                    break  # leaving the block cancels the turn
        await rt.wait_idle()
        await rt.flush()
        stats = rt.stats()
        tag = stats.registry.model_tag
        snap = CacheDirectory(tmp_path / "caches").load("quitter", model_tag=tag)
        assert stats.metrics.cancelled == 1 and stats.metrics.tokens_generated < 200
        # With the partial turn: the prompt and the reply tokens generated before the cancel.
        assert snap.text.startswith(prompt) and len(snap.text) > len(prompt)
        follow_up = snap.text + "\nUser: Go on.\nAssistant:"
        again = await rt.agent("quitter").send_prompt(follow_up, max_tokens=3)
    assert again.usage.tier == "hot" and again.usage.match == "extend"
    assert again.usage.tokens_reused == snap.num_tokens


FOLLOW_UPS = ["What happened next?", "Why?", "And what did everyone in the village say about it afterwards?",
              "Then?"]


async def test_agents_answering_together_prefill_in_one_pass_and_reply_as_alone(tmp_path):
    """Q4 at rest, the default: four agents' second turns arrive together with new messages
    of different lengths (one wants a single token); the GPU actor prefills them in one
    pass (runtime.execution.batch_prefill). Reference: each conversation decoded alone outside the
    runtime, from its turn-1 cache; replies may depart only at a near tie."""
    lm = tiny("tiny-llama")
    wants = [16, 16, 16, 1]
    expected = {}
    for i, follow_up in enumerate(FOLLOW_UPS):
        first, cache, _, _ = _alone(lm, lm.render(_conversation(i, None)), None, SequenceSampling(max_tokens=16))
        conv = _conversation(i, first)
        conv[-1]["content"] = follow_up
        second = _alone(lm, lm.render(conv), cache, SequenceSampling(max_tokens=wants[i]))
        expected[i] = (first, second)

    got: dict[int, object] = {}
    # at-rest named: ``auto`` is native under the GPU policy, whose packed caches do not prefill in groups.
    async with _open(tmp_path, "tiny-llama", trace=True, attention="at-rest") as rt:
        for i in range(4):  # one at a time: the same first turns as the reference
            # Opted out of sharing: the first turns share the template's opening and system prompt, and the
            # reference's first turns are each cold (tests/plan/test_reuse_patterns.py checks what sharing gives).
            first = await rt.agent(f"agent-{i}", share_prefix=False).send(_conversation(i, None), max_tokens=16)
            # Exact on any backend: these replies' smallest top-1 margin is 0.054 (measured), far above
            # float32 kernel differences (~2e-5); the grouped second turns below allow near ties.
            assert first.reply == expected[i][0]

        async def second(i: int) -> None:
            conv = _conversation(i, expected[i][0])
            conv[-1]["content"] = FOLLOW_UPS[i]
            got[i] = await rt.agent(f"agent-{i}", share_prefix=False).send(conv, max_tokens=wants[i])

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(second, i)
        groups = [e for e in rt.gpu_events() if e.kind == "chunk" and len(e.request_ids) > 1]
    assert groups, "some of the second turns prefilled together"
    for i in range(4):
        result = got[i]
        reply, _, pieces, margins = expected[i][1]
        assert result.usage.tier == "hot" and result.usage.tokens_generated == wants[i]
        assert first_split_is_a_near_tie(result.reply, reply, pieces, margins), (i, result.reply, reply)


async def test_the_python_api_takes_a_response_format_and_tools_on_every_turn(tmp_path):
    # The direct API: the same ResponseFormat and generic tool format as the HTTP APIs (tests/reply/test_generic_tools.py).
    verdict = {"type": "object", "properties": {"ok": {"enum": [True, False]}}, "required": ["ok"],
               "additionalProperties": False}
    async with _open(tmp_path, "tiny-llama") as rt:
        agent = rt.agent("structured")
        result = await agent.send([{"role": "user", "content": "Is it fine?"}], max_tokens=40,
                                  response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": verdict}})
        assert json.loads(result.reply) in ({"ok": True}, {"ok": False})
        with pytest.raises(ValueError, match="schema"):
            await agent.send([{"role": "user", "content": "?"}],
                             response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": 1}}})
