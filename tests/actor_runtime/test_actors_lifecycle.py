"""Actor behaviour on the fake engine (no MLX): ordering, cancellation, store, registry, lifecycle.

``FakeEngine`` replies to a prompt with ``fake_reply(prompt, max_tokens)`` no
matter how it is scheduled, one character per token; its caches persist
through the real ``CacheDirectory``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import trio

import runtime  # noqa: F401
from actors import open_runtime
from fake_engine import FakeEngine, fake_render, fake_reply
from runtime.errors import BudgetExceededError, CacheMiss
from runtime.persist import CacheDirectory

TAG = "fake-a@0000/fake"


def _open(tmp_path: Path, engine: FakeEngine | None = None, **kw):
    kw.setdefault("handle_signals", False)
    kw.setdefault("durable", False)  # these tests watch write-behind saves; a turn asks for durability itself
    return open_runtime(model="fake-a", home=tmp_path, engine=engine or FakeEngine(), fsync=False, **kw)


def _disk(tmp_path: Path) -> CacheDirectory:
    return CacheDirectory(tmp_path / "caches", fsync=False)


def _hold_saves(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every save waits (up to 10 s) until the returned event is set."""
    gate = threading.Event()
    real_save = CacheDirectory.save

    def held_save(self, agent_id, snapshot, **kw):
        gate.wait(10)
        return real_save(self, agent_id, snapshot, **kw)

    monkeypatch.setattr(CacheDirectory, "save", held_save)
    return gate


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_replies_do_not_depend_on_concurrency(tmp_path):
    async with _open(tmp_path) as rt:
        results = {}

        async def agent(i: int) -> None:
            results[i] = await rt.agent(f"agent-{i}").send(_user(f"question {i}"), max_tokens=6)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(agent, i)
    for i, result in results.items():
        assert result.reply == fake_reply(fake_render(_user(f"question {i}")), 6)
        assert result.usage.tier == "cold" and result.finish_reason == "length"


async def test_requests_for_one_agent_run_one_after_another(tmp_path):
    engine = FakeEngine(step_delay_s=0.002)
    async with _open(tmp_path, engine, trace=True) as rt:
        base = "x" * 200
        done = []

        async def send(suffix: str) -> None:
            done.append(await rt.agent("solo").send_prompt(base + suffix, max_tokens=5))

        async with trio.open_nursery() as nursery:
            for suffix in ("a", "b", "c", "d"):
                nursery.start_soon(send, suffix)
        events = rt.gpu_events()
    assert sum(r.usage.tier == "cold" for r in done) == 1
    assert all(r.usage.tokens_reused >= 200 for r in done if r.usage.tier != "cold")
    # A request is admitted only after the previous one of the same agent finished.
    spans = {}
    for event in events:
        for rid in event.request_ids:
            spans.setdefault(rid, [event.at, event.at])[1] = event.at
    ordered = sorted(spans.values())
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:], strict=False))


async def test_cancelled_stream_leaves_the_partial_turn_in_the_cache(tmp_path):
    engine = FakeEngine(step_delay_s=0.005)
    prompt = "tell me everything"
    async with _open(tmp_path, engine) as rt:
        received = ""
        with trio.move_on_after(5):
            async with rt.agent("c").stream_prompt(prompt, max_tokens=500) as stream:
                async for delta in stream:
                    received += delta
                    if len(received) >= 5:
                        break
        await rt.wait_idle()
        await rt.flush()
        stats = rt.stats()
        assert stats.metrics.cancelled == 1 and stats.gpu.batch_size == 0
        snap = _disk(tmp_path).load("c", model_tag=TAG)
        full = fake_reply(prompt, 500)
        # Consistent: the prompt plus a prefix of the reply, one token per character.
        assert snap.text.startswith(prompt + received[:-1])
        assert full.startswith(snap.text[len(prompt) :]) and len(snap.text) < len(prompt) + 100
        assert snap.num_tokens == len(snap.text)
        # The next turn extends the partial turn.
        again = await rt.agent("c").send_prompt(snap.text + "?", max_tokens=2)
        assert again.usage.tier == "hot" and again.usage.tokens_reused == len(snap.text)


async def test_cancel_during_prefill_keeps_the_prefilled_part(tmp_path):
    engine = FakeEngine(chunk_delay_s=0.01, default_chunk=16)
    prompt = "p" * 400
    async with _open(tmp_path, engine) as rt:
        client = trio.CancelScope()

        async def turn() -> None:
            with client:
                await rt.agent("slow").send_prompt(prompt, max_tokens=3)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            while not any(t.tokens_prefilled for t in rt.running_turns()):  # a few chunks in, not a clock
                await trio.sleep(0.005)
            client.cancel()
        await rt.wait_idle()
        await rt.flush()
        snap = _disk(tmp_path).load("slow", model_tag=TAG)
        assert 0 < snap.num_tokens < len(prompt) and prompt.startswith(snap.text)


async def test_idle_agent_actor_stops_and_its_cache_stays_hot(tmp_path, autojump_clock):
    async with _open(tmp_path, idle_timeout_s=30) as rt:
        first = await rt.agent("idle").send_prompt("hello agent", max_tokens=3)
        assert rt.live_agents() == ["idle"]
        await trio.sleep(31)
        assert rt.live_agents() == []
        again = await rt.agent("idle").send_prompt("hello agent" + first.reply + "!", max_tokens=3)
        assert again.usage.tier == "hot" and rt.live_agents() == ["idle"]


COPY_MODES = pytest.mark.parametrize("copy_after_turn", [False, True], ids=["copy-at-turn-end", "copy-after-turn"])
"""The store's behaviour with the save's copy made at the turn's end (CPU policy) and after it (GPU policy)."""


@COPY_MODES
async def test_saves_are_write_behind_and_flushed_on_exit(tmp_path, monkeypatch, copy_after_turn):
    gate = _hold_saves(monkeypatch)
    async with _open(tmp_path, FakeEngine(copy_after_turn=copy_after_turn)) as rt:
        prompt = "prompt"
        for _ in range(3):  # each turn returns while the first save still waits
            result = await rt.agent("w").send_prompt(prompt, max_tokens=3)
            prompt += result.reply + "."
        store = rt.stats().store
        assert store.dirty == 1 and store.writes == 0
        gate.set()
    assert _disk(tmp_path).load("w", model_tag=TAG).text == prompt[:-2]


async def test_a_turn_reads_its_cache_while_another_agents_save_is_still_writing(tmp_path, monkeypatch):
    """A long context's save takes a while (issue 33: a 32K cache delayed the next turn's first token
    by 300 ms on an H200): reads do not queue behind it."""
    async with _open(tmp_path) as rt:
        first = await rt.agent("w").send_prompt("earlier", max_tokens=3)  # on disk at exit
    gate, writing = threading.Event(), threading.Event()
    real_save = CacheDirectory.save

    def slow_save(self, agent_id, snapshot, **kw):
        if agent_id == "x":
            writing.set()
            gate.wait(10)
        return real_save(self, agent_id, snapshot, **kw)

    monkeypatch.setattr(CacheDirectory, "save", slow_save)
    try:
        async with _open(tmp_path, prefetch_mb=0) as rt:
            await rt.agent("x").send_prompt("a long context", max_tokens=3)
            assert await trio.to_thread.run_sync(writing.wait, 5)  # x's save holds the writer
            with trio.fail_after(5):
                warm = await rt.agent("w").send_prompt("earlier" + first.reply + ".", max_tokens=3)
                cold = await rt.agent("new").send_prompt("hello", max_tokens=3)
            assert not gate.is_set() and rt.stats().store.writes == 0
            assert (warm.usage.tier, cold.usage.tier) == ("warm", "cold")
            gate.set()
    finally:
        gate.set()


@COPY_MODES
async def test_cancelling_the_runtime_flushes_completed_turns(tmp_path, copy_after_turn):
    """Also under the GPU policy's turn end, the copies the GPU actor still owed made before it stopped."""
    engine = FakeEngine(step_delay_s=0.003, copy_after_turn=copy_after_turn)
    completed: dict[str, str] = {}
    turns = dict.fromkeys((f"agent{i}" for i in range(4)), 0)
    # Cancelled mid-traffic once every agent has completed two turns (counted, not after a time a slow machine
    # might spend opening the runtime): the others' next turns are under way then.
    with trio.fail_after(60), trio.CancelScope() as traffic:
        async with _open(tmp_path, engine) as rt:

            async def chat(name: str) -> None:
                prompt = f"{name}:"
                while True:
                    result = await rt.agent(name).send_prompt(prompt, max_tokens=4)
                    completed[name] = prompt + result.reply[:-1]
                    prompt += result.reply + "."
                    turns[name] += 1
                    if min(turns.values()) >= 2:
                        traffic.cancel()

            async with trio.open_nursery() as nursery:
                for name in turns:
                    nursery.start_soon(chat, name)
    assert traffic.cancelled_caught and len(completed) == 4
    disk = _disk(tmp_path)
    for name, covered in completed.items():
        assert disk.load(name, model_tag=TAG).text.startswith(covered)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
@COPY_MODES
async def test_sigterm_flushes_and_exits(tmp_path, copy_after_turn):
    with pytest.raises(SystemExit) as exit_info:
        async with open_runtime(model="fake-a", home=tmp_path, engine=FakeEngine(copy_after_turn=copy_after_turn),
                                fsync=False) as rt:
            await rt.agent("sig").send_prompt("before the signal", max_tokens=3)
            os.kill(os.getpid(), signal.SIGTERM)
            await trio.sleep(10)
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert _disk(tmp_path).load("sig", model_tag=TAG).text.startswith("before the signal")


@COPY_MODES
async def test_model_swap_flushes_hot_caches_and_they_return_warm(tmp_path, copy_after_turn):
    engine = FakeEngine(copy_after_turn=copy_after_turn)
    async with _open(tmp_path, engine, models=["fake-b"]) as rt:
        x1 = await rt.agent("x").send_prompt("on model a", max_tokens=3)
        y = await rt.agent("y").send_prompt("on model b", max_tokens=3, model="fake-b")
        assert y.model == "fake-b" and rt.stats().registry.swaps == 1
        assert rt.stats().store.hot_agents == 1  # a's caches were dropped after being written
        assert _disk(tmp_path).load("x", model_tag=TAG).text.startswith("on model a")
        x2 = await rt.agent("x").send_prompt("on model a" + x1.reply + "?", max_tokens=3)
        assert x2.model == "fake-a" and x2.usage.tier == "warm" and x2.usage.tokens_reused > 0
        with pytest.raises(CacheMiss):  # y's cache is model b's: never served to model a
            _disk(tmp_path).load("y", model_tag=TAG)
    assert engine.loads == ["fake-a", "fake-b", "fake-a"]


async def test_a_turn_waiting_for_its_model_whose_client_leaves_lets_its_agent_go_on(tmp_path):
    """A turn for another model waits in the GPU actor until the loaded model's turns end; if its client leaves
    meanwhile, its agent is told (the turn is cancelled) and serves its next turn, instead of waiting for good."""
    async with _open(tmp_path, FakeEngine(step_delay_s=0.01), models=["fake-b"]) as rt:
        async with rt.agent("x").stream_prompt("on model a", max_tokens=60) as busy:
            async for _ in busy:
                break  # model a decodes: a turn for model b waits behind it
            with trio.move_on_after(0.05):
                await rt.agent("y").send_prompt("on model b", max_tokens=3, model="fake-b")  # the client leaves
            assert rt.stats().registry.queued == 1
            async for _ in busy:
                pass
        with trio.fail_after(60):  # a safety: an agent left waiting hangs here
            y = await rt.agent("y").send_prompt("on model b, again", max_tokens=3, model="fake-b")
        assert y.model == "fake-b" and rt.stats().registry.queued == 0


async def test_unconfigured_model_is_rejected(tmp_path):
    async with _open(tmp_path) as rt:
        with pytest.raises(ValueError, match="not configured"):
            await rt.agent("u").send_prompt("hi", model="fake-zzz")


async def test_idle_model_is_unloaded_and_reloaded_on_demand(tmp_path, autojump_clock):
    engine = FakeEngine()
    async with _open(tmp_path, engine, model_idle_s=60) as rt:
        await rt.agent("m").send_prompt("one", max_tokens=2)
        await trio.sleep(61)
        assert rt.stats().registry.model is None and rt.stats().registry.idle_unloads == 1
        result = await rt.agent("m").send_prompt("two", max_tokens=2)
        assert result.model == "fake-a" and engine.loads == ["fake-a", "fake-a"]


class _SlowTokenizer(FakeEngine):
    """Tokenizing a prompt with "slow" in it takes ``clock``'s 100 seconds (the test's autojump clock)."""

    def __init__(self, clock) -> None:
        super().__init__()
        self.clock = clock

    def tokenize(self, prompt, plan):
        if "slow" in prompt:
            trio.from_thread.run_sync(self.clock.jump, 100)  # on the text worker's thread
        return super().tokenize(prompt, plan)


async def test_a_turn_tokenized_past_the_idle_timeout_is_not_unloaded_under(tmp_path, autojump_clock):
    """The idle unload waits for a turn handed to the loop but not yet registered: once its prompt was
    tokenized (for longer than ``model_idle_s``) the loop's idle check must not take the model from under it
    (a CI run failed so: the turn registered on no model)."""
    engine = _SlowTokenizer(autojump_clock)
    async with _open(tmp_path, engine, model_idle_s=60) as rt:
        await rt.agent("m").send_prompt("one", max_tokens=2)
        await trio.sleep(61)  # unloaded: the next turn waits for its model, then is served from the loop's top
        result = await rt.agent("m").send_prompt("two, slow", max_tokens=2)
        assert result.model == "fake-a" and engine.loads == ["fake-a", "fake-a"]


async def test_a_turn_that_starts_at_once_is_accepted_by_its_announcement_and_one_that_waits_first(tmp_path):
    """A streaming client answers its status once its turn is accepted. A turn that starts in the loop pass it
    was registered in says so with its ``TurnStarted`` alone (one message fewer a turn, issue 60); one that waits
    for memory gets a ``TurnAccepted`` first, so its status does not wait for the batch."""
    async with _open(tmp_path, budget_mb=8 * 1024 / 2**20) as rt:  # two 256-token blocks: one turn at a time
        started_when_accepted: list[bool] = []

        async def one(i: int) -> None:
            async with rt.agent(f"b{i}").stream_prompt(f"{i:03d}" + "z" * 250, max_tokens=8) as stream:
                await stream.accepted()
                started_when_accepted.append(stream.started is not None)
                async for _ in stream:
                    pass
                assert stream.started is not None and stream.result is not None

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        assert rt.stats().gpu.memory_waits_total >= 1
    assert True in started_when_accepted and False in started_when_accepted, started_when_accepted


async def test_a_turn_that_comes_while_another_with_its_system_prompt_decodes_starts_from_that_prompt(tmp_path):
    """The first turn prefilled its prompt before the second came, so nobody asked it to park it: the step that
    follows the second's admission parks it from its batch row (the scheduler's ``park``), and the second's
    first chunk starts from it, to the token, instead of prefilling the same blocks again."""
    system = "S" * 700  # the fake engine's tokens are characters: two whole blocks and more
    async with _open(tmp_path, engine=FakeEngine(step_delay_s=0.005)) as rt:
        async with rt.agent("a").stream_prompt(system + " a's question", max_tokens=200) as first:
            async for _ in first:
                break  # its first token: it decodes now
            second = await rt.agent("b").send_prompt(system + " b's question", max_tokens=2)
            async for _ in first:
                pass
        assert rt.stats().gpu.prefix_hits == 1
    assert second.usage.tier == "shared" and second.usage.tokens_reused == len(system) + 1


async def test_small_budget_queues_requests_and_none_fails(tmp_path):
    # 16 bytes/token: a 4 KiB block is 256 tokens; 2 blocks fit one 300-token request.
    async with _open(tmp_path, budget_mb=8 * 1024 / 2**20) as rt:
        results = []

        async def ask(i: int) -> None:
            results.append(await rt.agent(f"b{i}").send_prompt(f"{i:03d}" + "z" * 250, max_tokens=8))

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(ask, i)
        stats = rt.stats()
    assert len(results) == 6 and stats.gpu.memory_waits_total >= 1
    assert max(r.usage.queue_wait_ms for r in results) > 0
    with pytest.raises(BudgetExceededError):
        async with _open(tmp_path, budget_mb=8 * 1024 / 2**20) as rt:
            await rt.agent("huge").send_prompt("z" * 1000, max_tokens=8)


async def test_forget_deletes_hot_and_warm_cache(tmp_path):
    async with _open(tmp_path) as rt:
        await rt.agent("f").send_prompt("remember me", max_tokens=2)
        await rt.flush()
        assert await rt.agent("f").forget() is True
        assert await rt.agent("f").forget() is False
        again = await rt.agent("f").send_prompt("remember me", max_tokens=2)
        assert again.usage.tier == "cold"


async def test_forget_removes_the_blocks_only_that_agent_used(tmp_path):
    def blocks() -> set[str]:
        return {p.name for p in (tmp_path / "caches" / "blocks").rglob("*.safetensors")}

    shared = "s" * 600  # two whole blocks in both agents' caches
    async with _open(tmp_path) as rt:
        await rt.agent("keeper").send_prompt(shared + " keeper", max_tokens=2)
        await rt.agent("leaver").send_prompt(shared + " leaver" + "l" * 300, max_tokens=2)
        await rt.flush()
        before = blocks()
        assert await rt.agent("leaver").forget() is True
        after = blocks()
    assert after and after < before  # the leaver's own blocks went, the shared ones stayed
    assert _disk(tmp_path).load("keeper", model_tag=TAG).text.startswith(shared)


async def test_shared_prefix_is_content_addressed_and_opt_out(tmp_path):
    system = "s" * 700
    async with _open(tmp_path) as rt:
        await rt.agent("donor").send_prompt(system + " first", max_tokens=2)
        shared = await rt.agent("taker").send_prompt(system + " second", max_tokens=2)
        assert shared.usage.tier == "shared" and shared.usage.tokens_reused == 700  # to the token, not 512
        private = await rt.agent("private", share_prefix=False).send_prompt(system + " third", max_tokens=2)
        assert private.usage.tier == "cold"
        other = await rt.agent("other").send_prompt("t" + system, max_tokens=2)
        assert other.usage.tier == "cold"  # nothing it did not send itself


async def test_all_engine_jobs_run_on_one_dedicated_thread(tmp_path):
    seen: set[int] = set()

    class Recording(FakeEngine):
        def step(self):
            seen.add(threading.get_ident())
            return super().step()

        def prefill(self, request_id, chunk, *, adopt=None):
            seen.add(threading.get_ident())
            return super().prefill(request_id, chunk, adopt=adopt)

    async with _open(tmp_path, Recording()) as rt:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(rt.agent(f"t{i}").send_prompt, "thread check")
        ident = rt._gpu.thread_ident
    assert seen == {ident} and ident != threading.get_ident()


async def test_stats_count_requests_tokens_and_tiers(tmp_path):
    async with _open(tmp_path) as rt:
        first = await rt.agent("s").send_prompt("count me", max_tokens=4)
        await rt.agent("s").send_prompt("count me" + first.reply + " more", max_tokens=4)
        m = rt.stats().metrics
    assert m.requests == 2 and m.completed == 2 and m.tokens_generated == 8
    assert m.hits["cold"] == 1 and m.hits["hot"] == 1
    assert m.ttft_ms.count == 2 and m.ttft_ms.counts[-1] == 2
    assert m.tokens_reused == len("count me") + len(first.reply) - 1


async def test_slow_stream_reader_gets_coalesced_deltas_that_add_up_to_the_reply(tmp_path):
    async with _open(tmp_path) as rt:
        deltas = []
        async with rt.agent("slow-reader").stream_prompt("stream to me", max_tokens=300) as stream:
            async for delta in stream:
                deltas.append(delta)
                await trio.sleep(0.002)
        assert stream.result is not None and stream.result.finish_reason == "length"
    assert "".join(deltas) == stream.result.reply == fake_reply("stream to me", 300)
    assert len(deltas) < 300  # the GPU actor never waited for the reader


async def test_a_default_model_that_does_not_load_fails_open_runtime(tmp_path):
    from runtime.errors import ModelError

    with pytest.raises(ModelError):
        async with open_runtime(model="not-a-fake", home=tmp_path, engine=FakeEngine(), handle_signals=False):
            pass


async def test_a_turn_hashes_its_blocks_once_for_the_hot_tier_and_the_save(tmp_path, monkeypatch):
    import actors.gpu_caches as gpu_caches_module
    import runtime.persist.directory as directory_module
    import runtime.persist.save as save_module

    calls: list[int] = []
    real = save_module.block_chain_hashes

    def counting(model_tag, token_ids):
        calls.append(len(token_ids))
        return real(model_tag, token_ids)

    monkeypatch.setattr(gpu_caches_module, "block_chain_hashes", counting)  # the GPU actor's, for its hot tier
    monkeypatch.setattr(directory_module, "block_chain_hashes", counting)
    monkeypatch.setattr(save_module, "block_chain_hashes", counting)
    async with _open(tmp_path) as rt:
        result = await rt.agent("hasher").send_prompt("x" * 600, max_tokens=4)
        await rt.flush()  # written by now: by the flush, or by the write-behind before it (a race: either)
    assert calls == [600 + result.usage.tokens_generated - 1]  # the parked cache: prompt + fed reply tokens
    assert _disk(tmp_path).load("hasher", model_tag=TAG).num_tokens == calls[0]


async def test_a_streaming_turn_announces_its_accounting_before_the_first_token(tmp_path):
    async with _open(tmp_path) as rt:
        handle = rt.agent("announcer")
        async with handle.stream_prompt("tell me", max_tokens=4) as stream:
            started = await stream.start_info()
            deltas = [d async for d in stream]
        assert started is not None and stream.started is started
        first = stream.result
        assert (started.tier, started.tokens_reused, started.tokens_prefilled) == ("cold", 0, len("tell me"))
        assert "".join(deltas) == first.reply

        async with handle.stream_prompt("tell me" + first.reply + " more", max_tokens=4) as stream:
            started = await stream.start_info()
            async for _ in stream:
                pass
        usage = stream.result.usage
        assert (started.tier, started.tokens_reused, started.tokens_prefilled) == (
            usage.tier, usage.tokens_reused, usage.tokens_prefilled) == ("hot", usage.tokens_reused, 5 + 1)
        # a turn that fails before it starts announces nothing
        async with handle.stream_prompt("x", max_tokens=4, model="not-configured") as stream:
            assert await stream.start_info() is None
            with pytest.raises(ValueError):
                async for _ in stream:
                    pass


async def test_a_long_prefill_shows_its_progress_in_the_runtime_and_the_agent_api(tmp_path):
    import httpx

    from gateway.app import create_app
    from runtime.config import Config

    engine = FakeEngine(chunk_delay_s=0.05, default_chunk=16)
    prompt = "p" * 400  # 25 chunks of 16 tokens
    async with _open(tmp_path, engine) as rt:
        app = create_app(rt, Config(model="fake-a"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvmem.test") as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: rt.agent("slow").send_prompt(prompt, max_tokens=3))
                seen = []
                for _ in range(100):
                    await trio.sleep(0.1)
                    info = (await http.get("/v1/agents/slow")).json()
                    if info.get("turn") and info["turn"]["phase"] == "prefill" and info["turn"]["tokens_prefilled"]:
                        seen.append(info["turn"])
                    if len(seen) >= 2:
                        break
            assert seen, "no prefill progress was visible"
            assert all(t["tokens_to_prefill"] == len(prompt) and 0 < t["tokens_prefilled"] < len(prompt) for t in seen)
            assert seen[0]["tokens_prefilled"] <= seen[-1]["tokens_prefilled"]
            assert rt.running_turns() == []
            assert (await http.get("/v1/agents/slow")).json()["turn"] is None


def test_the_cli_progress_line_is_erased_before_the_reply():
    import io

    from actors.metrics import RunningTurn
    from gateway.cli_chat import PrefillProgress

    class Runtime:
        def running_turns(self):
            return [RunningTurn(agent_id="a", request_id=1, phase="prefill", tokens_reused=0, tokens_prefilled=1024,
                                tokens_to_prefill=4096, tokens_generated=0, max_tokens=8, elapsed_ms=2000.0)]

    stream = io.StringIO()
    progress = PrefillProgress(Runtime(), "a", stream=stream, tty=True, delay_s=0)  # type: ignore[arg-type]
    progress.EVERY_S = 0.01

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress.show)
            await trio.sleep(0.05)
            progress.stop()
            nursery.cancel_scope.cancel()

    trio.run(run)
    err = stream.getvalue()
    assert "\r[a] prefill [######------------------] 1,024/4,096 tokens" in err and err.endswith("\r\033[K")


async def test_each_turn_visits_the_gpu_actor_once_and_the_store_once_a_hot_one_for_its_save_alone(
        tmp_path, monkeypatch):
    """One Generate, whose GPU actor takes the agent's cache (from the store when it holds none of it and the
    store does), renders, plans, generates and hands the new cache's copy to the store: a new agent's first
    turn and a hot turn only Save, a turn after a restart Loads first, and a turn that fails at its template
    has nothing to save (the failure is the Generate's reply)."""
    from actors.cache_store import CacheStoreActor
    from actors.gpu import GPUActor

    seen: list[str] = []
    for actor in (GPUActor, CacheStoreActor):
        real = actor._handle

        async def recording(self, message, real=real):
            seen.append(type(message).__name__)
            await real(self, message)

        monkeypatch.setattr(actor, "_handle", recording)
    engine = FakeEngine()
    async with _open(tmp_path, engine=engine) as rt:
        agent = rt.agent("walker")
        seen.clear()
        await agent.send(_user("hello"), max_tokens=4)
        assert seen == ["Generate", "Save"]  # the disk held nothing of it at start: nothing to ask
        seen.clear()
        await agent.send(_user("hello"), max_tokens=4)  # hot now: the GPU actor holds it
        assert seen == ["Generate", "Save"]

        seen.clear()
        monkeypatch.setattr(engine, "render", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad template")))
        with pytest.raises(Exception, match="bad template"):
            await agent.send(_user("again"), max_tokens=4)
        assert seen == ["Generate"]
        assert (await agent.send_prompt("raw text", max_tokens=2)).reply  # the agent goes on
    async with _open(tmp_path, engine=FakeEngine()) as rt:
        seen.clear()
        await rt.agent("walker").send_prompt("raw text, again", max_tokens=2)
        assert seen == ["Generate", "Load", "Save"]  # on disk since the restart: the store reads it


async def test_the_stores_saves_and_reads_join_the_trace(tmp_path):
    async with _open(tmp_path, trace=True) as rt:
        first = await rt.agent("a").send_prompt("hello there", max_tokens=3)
        assert await rt.flush() >= 0
        for _ in range(100):  # written behind the turn
            if any(e.kind == "save" for e in rt.gpu_events()):
                break
            await trio.sleep(0.01)
        saves = [e for e in rt.gpu_events() if e.kind == "save"]
    assert saves and saves[0].took_ms is not None and saves[0].detail.endswith("bytes written")
    async with _open(tmp_path, trace=True, prefetch_mb=0) as rt:  # a restart: the turn reads its cache from disk
        again = await rt.agent("a").send_prompt("hello there" + first.reply + " more", max_tokens=3)
        reads = [e for e in rt.gpu_events() if e.kind == "read"]
    assert again.usage.tier == "warm"
    assert len(reads) == 1 and reads[0].detail.endswith("tokens") and reads[0].took_ms is not None
    # in order with the GPU actor's own work: the read ended before the turn was admitted
    admit = next(e for e in rt.gpu_events() if e.kind == "admit")
    assert reads[0].at <= admit.at


async def test_the_trace_says_when_each_turn_was_checked_out(tmp_path):
    """H200 run 5: turns reached the GPU actor 5-7 ms after they were sent, and nothing in its trace said why:
    the GPU actor logs each turn's checkout, right after its ``submit`` (from the send: the wait to reach that
    actor, then the checkout)."""
    async with _open(tmp_path, trace=True) as rt:
        t0 = time.perf_counter()
        done = await rt.agent("a").send_prompt("hello there", max_tokens=3)
        events = [e for e in rt.gpu_events() if done.request_id in e.request_ids]
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["submit", "checkout"], kinds
    checkout = events[1]
    assert checkout.waited_ms is not None and checkout.took_ms is not None
    assert 0 <= checkout.waited_ms and 0 <= checkout.took_ms
    assert t0 <= checkout.at - (checkout.waited_ms + checkout.took_ms) / 1e3 + 1e-6  # it starts at the send


async def test_the_trace_splits_a_turns_way_to_tokenized_into_render_plan_and_tokenize(tmp_path):
    """H200 run 5's hot 16K turns took 4-6 ms from reaching the GPU actor to being tokenized, and the trace
    could not say which of the three did it: rendering the chat, planning against the agent's cache, or
    tokenizing the rest. Each now has its event, in that order, and none is a unit of the GPU actor's work
    (a decode step's time is not split by a render ending on another thread)."""
    from actors.metrics import units_of_work

    async with _open(tmp_path, trace=True) as rt:
        agent = rt.agent("a")
        await agent.send([{"role": "user", "content": "hello there"}], max_tokens=3)
        done = await agent.send([{"role": "user", "content": "and again"}], max_tokens=3)
        events = [e for e in rt.gpu_events() if done.request_id in e.request_ids]
    kinds = [e.kind for e in events]
    way = [k for k in kinds if k in ("submit", "rendered", "planned", "tokenized", "admit")]
    assert way == ["submit", "rendered", "planned", "tokenized", "admit"], kinds
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert not {"rendered", "planned"} & {e.kind for e in units_of_work(events)}


async def test_the_agent_actor_knows_what_its_cache_holds_where_it_was_left_and_which_branch(tmp_path):
    """The agent's own handle (issue 60, item 1), checked against the disk and the tokens each turn reports."""
    async with _open(tmp_path) as rt:
        agent = rt.agent("brancher")
        first = await agent.send_prompt("The harbour at dawn:", max_tokens=4, durable=True)
        actor = rt._agents["brancher"][1]  # started by its first turn
        handle = actor.handle
        on_disk = _disk(tmp_path).load("brancher", model_tag=TAG)  # durable: on disk when it was answered
        assert (handle.model_tag, handle.num_tokens, handle.text_chars, handle.on_disk) == (
            TAG, on_disk.num_tokens, len(on_disk.text), True)
        assert on_disk.num_tokens == first.usage.tokens_prefilled + first.usage.tokens_generated - 1
        longer = await agent.send_prompt("The harbour at dawn:" + first.reply + " then", max_tokens=4)
        assert longer.usage.tier == "hot" and actor.handle.num_tokens > handle.num_tokens
        assert not actor.handle.on_disk and actor.handle.branch != handle.branch  # written behind; it grew
        again = await agent.send_prompt("The harbour at dawn:", max_tokens=4)  # rewound: the first branch again
        assert again.reply == first.reply and actor.handle.branch == handle.branch
        await agent.forget()
        assert actor.handle is None


async def test_a_cache_demoted_before_its_save_is_served_from_the_copy_the_store_queued(tmp_path, monkeypatch):
    """A hot cache may leave RAM once its copy is with the store, written or not (the GPU actor owns the hot
    tier and needs no word back from the store): the agent's next turn gets the queued copy, never the disk."""
    gate = _hold_saves(monkeypatch)
    async with _open(tmp_path, hot_budget_mb=0.0001) as rt:  # no cache fits: each leaves RAM once stored
        first = await rt.agent("d").send_prompt("a cache too big to keep", max_tokens=3)
        stats = rt.stats().store
        assert (stats.hot_agents, stats.demotions, stats.writes) == (0, 1, 0)
        assert rt.stats().store.dirty == 1 and not _disk(tmp_path).exists("d")  # queued, not written
        second = await rt.agent("d").send_prompt("a cache too big to keep" + first.reply + ".", max_tokens=3)
        assert (second.usage.tier, second.usage.match) == ("warm", "extend")
        assert second.usage.tokens_reused == len("a cache too big to keep" + first.reply) - 1
        gate.set()
    assert _disk(tmp_path).load("d", model_tag=TAG).text.startswith("a cache too big to keep" + first.reply + ".")
