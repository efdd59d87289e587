"""The shared tier: nodes with their own disks and one real ``redis-server`` serve any agent.

Each node is an in-process runtime (``open_runtime``) or a server thread with its
own cache directory, all pointed at one Redis started on a free loopback port
(skipped where ``redis-server`` is not installed). What the issue asks of the
tier: a turn on another node loads the agent from Redis (tier ``remote``) and
prefills only what is new, with the reply a single node gives; damaged bytes in
Redis are a logged miss; Redis down is a degraded mode that still serves and
publishes again when Redis returns; a fenced manifest cannot be replaced by a
stale lease holder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio
from conftest import models_dir
from redis_server import MESSAGES, RedisServer, redis_server  # noqa: F401 - redis_server is a fixture
from redis_server import open_node as _open
from redis_server import second_turn as _second_turn

from gateway.testing import ServerThread
from runtime.config import Config, ConfigError, load_config
from runtime.persist import CacheDirectory
from runtime.persist.remote import RemoteTier, redacted_url


async def test_a_turn_on_another_node_loads_the_agent_from_redis_and_replies_as_one_node_would(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with _open(tmp_path / "reference", None) as rt:  # one node, no Redis: the reference
        ref_first = await rt.agent("keeper").send(MESSAGES, max_tokens=12)
        ref_second = await rt.agent("keeper").send(_second_turn(ref_first.reply), max_tokens=12)
    async with _open(tmp_path / "node-a", redis_server.url) as rt:
        first = await rt.agent("keeper").send(MESSAGES, max_tokens=12)
    assert first.reply == ref_first.reply and first.usage.tier == "cold"
    assert redis_server.client().keys("kvmem:agent:{keeper}:manifest-*")  # published on shutdown's flush at the latest

    async with _open(tmp_path / "node-b", redis_server.url) as rt:
        second = await rt.agent("keeper").send(_second_turn(first.reply), max_tokens=12)
        remote = rt.stats().store.remote
        third = await rt.agent("keeper").send(
            [*_second_turn(first.reply), {"role": "assistant", "content": second.reply},
             {"role": "user", "content": "And the cat?"}], max_tokens=4)
    assert second.usage.tier == "remote" and second.usage.match == "extend"
    assert second.usage.tokens_reused == ref_second.usage.tokens_reused > 0
    assert second.usage.tokens_prefilled == ref_second.usage.tokens_prefilled
    assert second.reply == ref_second.reply
    assert remote is not None and remote.up and remote.pulls == 1 and remote.bytes_received > 0
    assert third.usage.tier == "hot"

    # Node B published its turns; node A, whose disk holds only turn 1, now loads them from Redis.
    async with _open(tmp_path / "node-a", redis_server.url) as rt:
        fourth = await rt.agent("keeper").send(
            [*_second_turn(first.reply), {"role": "assistant", "content": second.reply},
             {"role": "user", "content": "And the cat?"}, {"role": "assistant", "content": third.reply},
             {"role": "user", "content": "Thank you."}], max_tokens=4)
    assert fourth.usage.tier == "remote" and fourth.usage.tokens_reused > second.usage.tokens_reused


async def test_a_compacted_history_on_another_node_reuses_the_system_prompt_from_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """An agent CLI compacts its history (the system prompt kept, the conversation replaced by a summary) and
    its next turn lands on another node: the cache pulled from Redis gives what the prompts have in common,
    whatever fraction of it that is (the seeds' 80% rule sent this turn cold), with a single node's reply."""
    long = [*MESSAGES, {"role": "assistant", "content": "She kept the light for forty years. " * 12},
            {"role": "user", "content": "Tell me everything about her cat, in detail."}]
    compacted = [MESSAGES[0], {"role": "user", "content": "Summary: a keeper, her cat, forty years. What now?"}]
    async with _open(tmp_path / "reference", None) as rt:  # one node, no Redis: the reference
        await rt.agent("keeper").send(long, max_tokens=4)
        reference = await rt.agent("keeper").send(compacted, max_tokens=8)
    async with _open(tmp_path / "node-a", redis_server.url) as rt:
        await rt.agent("keeper").send(long, max_tokens=4)
    async with _open(tmp_path / "node-b", redis_server.url) as rt:
        moved = await rt.agent("keeper").send(compacted, max_tokens=8)
    assert reference.usage.tier == "hot" and reference.usage.match == "partial"
    assert moved.usage.tier == "remote" and moved.usage.match == "partial"
    assert moved.usage.tokens_reused == reference.usage.tokens_reused > 0
    assert moved.usage.tokens_prefilled == reference.usage.tokens_prefilled
    assert moved.reply == reference.reply


async def test_blocks_are_stored_once_for_every_agent_with_the_same_prefix(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    system = {"role": "system", "content": " ".join(["The harbour has many boats and old stories."] * 80)}
    async with _open(tmp_path / "node", redis_server.url) as rt:
        for name in ("one", "two"):
            await rt.agent(name, share_prefix=False).send([system, {"role": "user", "content": f"I am {name}."}],
                                                          max_tokens=2)
    client = redis_server.client()
    blocks = client.keys("kvmem:block:*")
    assert blocks  # the system prompt's whole blocks, once
    manifests = client.keys("kvmem:agent:*:manifest-*")
    assert len(manifests) == 2
    node = CacheDirectory(tmp_path / "node" / "caches")
    on_disk = {p.stem for p in node.paths.blocks.rglob("*.safetensors")}
    assert {k.decode().rsplit(":", 1)[1] for k in blocks} == on_disk


@pytest.mark.parametrize("damage", ["file", "manifest"])
async def test_damaged_bytes_in_redis_are_a_logged_miss_and_the_turn_runs_cold(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    async with _open(tmp_path / "node-a", redis_server.url) as rt:
        first = await rt.agent("keeper").send(MESSAGES, max_tokens=8)
    client = redis_server.client()
    if damage == "manifest":
        (key,) = client.keys("kvmem:agent:{keeper}:manifest-*")
        client.set(key, b'{"format_version": 3, "pieces": "not a list"}')
    else:
        for key in client.keys("kvmem:agent:{keeper}:seg-*") + client.keys("kvmem:block:*"):
            raw = bytearray(client.get(key))
            raw[-1] ^= 0xFF  # one bit of the data: the data checksum catches it
            client.set(key, bytes(raw))
    caplog.set_level(logging.WARNING, logger="kvmem")
    async with _open(tmp_path / "node-b", redis_server.url) as rt:
        second = await rt.agent("keeper").send(_second_turn(first.reply), max_tokens=8)
        remote = rt.stats().store.remote
    assert second.usage.tier == "cold" and second.usage.tokens_reused == 0
    assert remote is not None and remote.corrupt == 1 and remote.up
    assert any("in Redis is unusable" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "node-b" / "caches" / "blocks").rglob("*.safetensors.*"))


def test_redis_down_is_a_degraded_mode_that_serves_and_publishes_again_when_redis_returns(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = Config(model="tiny-llama", port=0, home=str(tmp_path), models_dir=str(models_dir()), fsync=False,
                    store=redis_server.url)
    with ServerThread(config.replace()) as server:
        chat = server.url + "/v1/chat/completions"
        body = {"model": "tiny-llama", "max_tokens": 6, "messages": MESSAGES}
        first = httpx.post(chat, json=body, headers={"x-agent-id": "keeper"}, timeout=60)
        assert first.status_code == 200 and first.headers["x-kvmem-tier"] == "cold"
        assert httpx.get(server.url + "/healthz").json()["store"]["up"] is True

        redis_server.stop()
        reply = first.json()["choices"][0]["message"]["content"]
        again = httpx.post(chat, json={**body, "messages": _second_turn(reply)}, headers={"x-agent-id": "keeper"},
                           timeout=60)
        other = httpx.post(chat, json=body, headers={"x-agent-id": "newcomer"}, timeout=60)
        assert again.status_code == 200 and again.headers["x-kvmem-tier"] == "hot"
        assert other.status_code == 200 and other.headers["x-kvmem-tier"] == "cold"
        health = _wait_for(server.url, lambda h: h["store"]["unpublished"] == 2)
        assert health["status"] == "degraded" and health["store"]["up"] is False
        metrics = httpx.get(server.url + "/metrics").text
        assert f'kvmem_remote_up{{url="{redis_server.url}"}} 0' in metrics

        redis_server.start()  # empty: what this node saved meanwhile is published again
        health = _wait_for(server.url, lambda h: h["store"]["unpublished"] == 0, timeout_s=30)
        assert health["status"] == "ok" and health["store"]["up"] is True
        assert len(redis_server.client().keys("kvmem:agent:*:manifest-*")) == 2


def _wait_for(url: str, condition, *, timeout_s: float = 30.0) -> dict:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/healthz").json()
        if condition(health) or time.monotonic() > deadline:
            assert condition(health), health
            return health
        time.sleep(0.1)


async def test_a_node_started_while_redis_is_down_serves_from_its_own_disk(tmp_path: Path) -> None:
    unreachable = "redis://127.0.0.1:1/0"
    async with _open(tmp_path, unreachable) as rt:
        first = await rt.agent("keeper").send(MESSAGES, max_tokens=4)
        await rt.flush()
        remote = rt.stats().store.remote
    assert first.usage.tier == "cold"
    assert remote is not None and not remote.up and remote.unpublished == 1
    async with _open(tmp_path, unreachable) as rt:
        second = await rt.agent("keeper").send(_second_turn(first.reply), max_tokens=4)
    assert second.usage.tier == "warm"


def test_a_stale_lease_holder_cannot_publish_over_a_newer_manifest(tmp_path: Path, redis_server: RedisServer) -> None:
    async def talk() -> None:
        async with _open(tmp_path / "node", None) as rt:
            await rt.agent("keeper").send(MESSAGES, max_tokens=4)

    trio.run(talk)
    directory = CacheDirectory(tmp_path / "node" / "caches", fsync=False)
    tier = RemoteTier(redis_server.url, directory.paths)
    (tag,) = {e.model_tag for e in directory.list_agents()}
    old = tier.lease("keeper")  # the default length: held through the next call, however slow the machine
    assert old is not None and old.fence > 0
    assert tier.lease("keeper") is None  # held
    assert tier.renew(old, lease_ms=50)  # its last renewal, then the holder stalled
    trio.run(trio.sleep, 0.2)  # expired
    new = tier.lease("keeper")
    assert new is not None and new.fence > old.fence
    assert tier.publish("keeper", tag, fence=new.fence) is True
    assert tier.publish("keeper", tag, fence=old.fence) is False and tier.stale_publishes == 1
    assert not tier.renew(old)
    tier.release(old)  # not ours any more: the new lease stays
    assert tier.lease("keeper") is None
    tier.release(new)
    assert tier.lease("keeper") is not None
    tier.close()


def test_store_setting_from_flag_environment_and_toml(tmp_path: Path) -> None:
    assert load_config({"store": "redis://10.0.0.5:6379/2"}).store == "redis://10.0.0.5:6379/2"
    assert load_config(env={"KVMEM_STORE": "rediss://:pw@cache:6380/0"}).store == "rediss://:pw@cache:6380/0"
    toml = tmp_path / "kvmem.toml"
    toml.write_text('store = "redis://127.0.0.1:6379/0"\n')
    assert load_config(config_file=toml, env={}).store == "redis://127.0.0.1:6379/0"
    assert load_config(env={"KVMEM_STORE": "none"}).store is None
    with pytest.raises(ConfigError, match="store"):
        load_config({"store": "http://cache:6379"})
    assert redacted_url("redis://:secret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted_url("rediss://cache:6380/0?password=secret&ssl_ca_certs=/etc/ca.pem") == \
        "rediss://cache:6380/0?password=***&ssl_ca_certs=/etc/ca.pem"


def test_a_turn_for_an_agent_leased_by_another_node_gets_429_with_retry_after(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    other_node = RemoteTier(redis_server.url, CacheDirectory(tmp_path / "other", fsync=False).paths)
    config = Config(model="tiny-llama", port=0, home=str(tmp_path / "node"), models_dir=str(models_dir()),
                    fsync=False, store=redis_server.url)
    with ServerThread(config) as server:
        body = {"model": "tiny-llama", "max_tokens": 4, "messages": MESSAGES}
        first = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-agent-id": "keeper"},
                           timeout=60)
        assert first.status_code == 200
        # The node gave the lease back after its turn was published: another node can take it.
        held = _wait_until(lambda: other_node.lease("keeper"))
        busy = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-agent-id": "keeper"},
                          timeout=60)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        error = busy.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "agent_busy" and "another node" in error[
            "message"]
        anthropic = httpx.post(server.url + "/v1/messages", headers={"x-agent-id": "keeper"}, timeout=60,
                               json={"model": "tiny-llama", "max_tokens": 4, "messages": MESSAGES[1:]})
        assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
        other = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-agent-id": "someone-else"},
                           timeout=60)
        assert other.status_code == 200  # only that agent waits
        other_node.release(held)
        again = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-agent-id": "keeper"},
                           timeout=60)
        assert again.status_code == 200 and again.headers["x-kvmem-tier"] == "hot"
        leases = httpx.get(server.url + "/metrics").text
        assert "kvmem_remote_publishes_total" in leases
    other_node.close()


def _wait_until(get, timeout_s: float = 10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while (value := get()) is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


async def test_two_live_nodes_take_turns_and_each_continues_from_the_others_last_turn(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Round robin without affinity: a node's hot cache is older than Redis's, so it pulls instead."""
    async with _open(tmp_path / "node-a", redis_server.url) as a, _open(tmp_path / "node-b", redis_server.url) as b:
        messages = list(MESSAGES)
        tiers, reused = [], []
        for turn, node in enumerate([a, b, a, b]):
            result = await node.agent("keeper").send(messages, max_tokens=6)
            await node.flush()  # the save (and its publish) is write-behind; the next node's turn comes at once
            tiers.append(result.usage.tier)
            reused.append(result.usage.tokens_reused)
            messages += [{"role": "assistant", "content": result.reply},
                         {"role": "user", "content": f"Go on ({turn})."}]
    assert tiers == ["cold", "remote", "remote", "remote"]
    assert reused[1] < reused[2] < reused[3]


def _chat(url: str, messages: list[dict[str, str]], *, max_tokens: int = 6, tries: int = 20) -> httpx.Response:
    """One turn of agent ``keeper``; a 429 (the agent's lease is held elsewhere) is retried after its Retry-After."""
    import time

    for _ in range(tries):
        response = httpx.post(url + "/v1/chat/completions", headers={"x-agent-id": "keeper"}, timeout=120,
                              json={"model": "tiny-llama", "max_tokens": max_tokens, "messages": messages})
        if response.status_code != 429:
            return response
        time.sleep(float(response.headers["retry-after"]))
    raise AssertionError("the agent stayed busy")


def test_two_kvmem_serve_processes_share_an_agent_and_a_killed_node_loses_no_completed_turn(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    import os

    from serve_process import kvmem_serve

    env = {**os.environ, "KVMEM_HOME": str(models_dir().parent), "KVMEM_PORT": "0", "KVMEM_FSYNC": "false",
           "KVMEM_STORE": redis_server.url, "KVMEM_LEASE_S": "2"}
    with kvmem_serve("--model", "tiny-llama", "--cache-dir", str(tmp_path / "a"), env=env) as a, \
            kvmem_serve("--model", "tiny-llama", "--cache-dir", str(tmp_path / "b"), env=env) as b:
        first = _chat(a.url, MESSAGES)
        assert first.status_code == 200 and first.headers["x-kvmem-tier"] == "cold"
        messages = _second_turn(first.json()["choices"][0]["message"]["content"])
        second = _chat(b.url, messages)
        assert second.status_code == 200 and second.headers["x-kvmem-tier"] == "remote"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        messages += [{"role": "assistant", "content": second.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Tell me everything again, slowly."}]

        # Node B dies in the middle of turn 3 (kill -9): its lease expires, node A serves the agent
        # from the last manifest B published (turn 2), never from a half-written one.
        assert b.process is not None
        with httpx.stream("POST", b.url + "/v1/chat/completions", headers={"x-agent-id": "keeper"}, timeout=120,
                          json={"model": "tiny-llama", "max_tokens": 400, "stream": True,
                                "messages": messages}) as streaming:
            assert streaming.status_code == 200
            next(streaming.iter_lines())
            b.process.kill()
            b.process.wait()
        third = _chat(a.url, messages)
        assert third.status_code == 200 and third.headers["x-kvmem-tier"] == "remote"
        cached = third.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= second.json()["usage"]["prompt_tokens"]  # turn 2 was not lost
        assert httpx.get(a.url + "/healthz").json()["store"]["up"] is True


async def test_a_lease_held_through_a_long_turn_is_renewed_and_expires_once_its_holder_stops(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    from actors.shared_tier import SharedTier

    paths = CacheDirectory(tmp_path / "node", fsync=False).paths
    holder = RemoteTier(redis_server.url, paths, lease_ms=1500)
    other = RemoteTier(redis_server.url, CacheDirectory(tmp_path / "other", fsync=False).paths)

    async def disk(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    shared = SharedTier(holder, disk=disk, dirty=lambda agent_id: False)
    assert await shared.take_lease("keeper")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shared.renewer)
        await trio.sleep(3.5)  # more than twice the lease's length
        assert other.lease("keeper") is None
        assert shared.statistics().leases == 1
        nursery.cancel_scope.cancel()  # the holder stops renewing (a dead node)
    for _ in range(50):  # Redis expires it within the lease's length
        if other.lease("keeper") is not None:
            break
        await trio.sleep(0.1)
    else:
        raise AssertionError("the lease did not expire")
    holder.close()
    other.close()


async def test_the_agent_listing_says_remote_where_redis_holds_the_newer_or_only_copy(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """What ``/v1/status/agents`` and the operator page list (``AgentRecord.remote``)."""
    async with _open(tmp_path / "node-a", redis_server.url) as a, _open(tmp_path / "node-b", redis_server.url) as b:
        first = await a.agent("keeper").send(MESSAGES, max_tokens=6)
        await a.flush()
        [on_a] = await a.list_agents()
        [on_b] = await b.list_agents()
        assert (on_a.hot, on_a.remote) == (True, False)  # a's own copy is Redis's
        assert (on_b.hot, on_b.on_disk, on_b.remote) == (False, False, True)  # only in Redis, for b
        assert on_b.num_tokens == on_a.num_tokens

        second = await b.agent("keeper").send(_second_turn(first.reply), max_tokens=6)
        await b.flush()
        assert second.usage.tier == "remote"
        [on_a] = await a.list_agents()
        [on_b] = await b.list_agents()
        assert on_a.remote and on_a.num_tokens < on_b.num_tokens  # b saved after a: a's copy is older
        assert (on_b.hot, on_b.remote) == (True, False)
