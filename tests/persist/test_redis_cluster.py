"""The shared tier as a cluster: passwords and TLS, forgetting across nodes, garbage collection, three nodes.

Every test runs against a real ``redis-server`` on a free loopback port (skipped
where it is not installed; the TLS test also where it or ``openssl`` lacks TLS),
with nodes as in-process runtimes or server threads, each with its own disk.
"""

from __future__ import annotations

import logging
import urllib.parse
from pathlib import Path

import httpx
import pytest
from conftest import models_dir
from redis_server import MESSAGES, RedisServer, make_tls_files, redis_server  # noqa: F401 - redis_server is a fixture
from redis_server import open_node as _open
from redis_server import second_turn as _second_turn

from gateway.testing import ServerThread
from runtime.config import Config
from runtime.persist import CacheDirectory
from runtime.persist.manifests import decode_manifest
from runtime.persist.remote import RemoteTier

PASSWORD = "correct-horse:battery/staple"  # with characters a URL must escape


def _agent_keys(client, agent: str) -> set[str]:
    return {k.decode() for k in client.keys(f"kvmem:agent:{{{agent}}}:*")}


def _file_keys(client) -> set[str]:
    """Every cache file in Redis: blocks, segments and state files."""
    return {k.decode() for pattern in ("kvmem:block:*", "kvmem:agent:*:seg-*", "kvmem:agent:*:state-*")
            for k in client.keys(pattern)}


# -- passwords and TLS ----------------------------------------------------------


def test_a_password_protected_redis_serves_and_the_password_never_shows_in_logs_healthz_or_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path, password=PASSWORD)
    server.start()
    caplog.set_level(logging.INFO)
    try:
        config = Config(model="tiny-llama", port=0, home=str(tmp_path / "node"), models_dir=str(models_dir()),
                        fsync=False, store=server.url)
        body = {"model": "tiny-llama", "max_tokens": 4, "messages": MESSAGES}
        with ServerThread(config) as node:
            turn = httpx.post(node.url + "/v1/chat/completions", json=body, headers={"x-agent-id": "keeper"},
                              timeout=60)
            assert turn.status_code == 200
            health = httpx.get(node.url + "/healthz")
            metrics = httpx.get(node.url + "/metrics").text
        assert health.json()["store"] == {"url": "redis://:***@127.0.0.1:%d/0" % server.port, "up": True,
                                          "unpublished": 0}
        assert server.client().keys("kvmem:agent:{keeper}:manifest-*")  # published, authenticated

        # A wrong password: a degraded mode with a clear log line, not a crash.
        wrong = server.url.replace(urllib.parse.quote(PASSWORD, safe=""), "not-the-password")
        with ServerThread(config.replace(store=wrong, home=str(tmp_path / "other"))) as node:
            turn = httpx.post(node.url + "/v1/chat/completions", json=body, headers={"x-agent-id": "keeper"},
                              timeout=60)
            degraded = httpx.get(node.url + "/healthz")
            degraded_metrics = httpx.get(node.url + "/metrics").text
        assert turn.status_code == 200 and turn.headers["x-kvmem-tier"] == "cold"
        assert degraded.json()["status"] == "degraded" and degraded.json()["store"]["up"] is False
        assert any("unreachable" in r.getMessage() and "AuthenticationError" in r.getMessage()
                   for r in caplog.records)
    finally:
        server.stop()
    shown = "\n".join([caplog.text, health.text, metrics, degraded.text, degraded_metrics])
    for secret in (PASSWORD, urllib.parse.quote(PASSWORD, safe=""), "not-the-password"):
        assert secret not in shown
    assert "redis://:***@127.0.0.1" in metrics


async def test_a_tls_redis_verified_by_its_ca_serves_and_one_signed_by_another_ca_is_refused(
    tmp_path: Path
) -> None:
    tls = make_tls_files(tmp_path / "tls")
    server = RedisServer(tmp_path, password=PASSWORD, tls=tls)
    server.start()
    try:
        assert server.url.startswith("rediss://")
        async with _open(tmp_path / "node-a", server.url) as rt:
            first = await rt.agent("keeper").send(MESSAGES, max_tokens=6)
        async with _open(tmp_path / "node-b", server.url) as rt:
            second = await rt.agent("keeper").send(_second_turn(first.reply), max_tokens=6)
            assert rt.stats().store.remote.up
        assert second.usage.tier == "remote" and second.usage.tokens_reused > 0

        # A node that trusts another CA does not talk to this server: degraded, serving from its own disk.
        other = make_tls_files(tmp_path / "other-tls", name="other-ca")
        untrusted = server.url.replace(urllib.parse.quote(str(tls.ca_cert), safe=""),
                                       urllib.parse.quote(str(other.ca_cert), safe=""))
        assert untrusted != server.url
        async with _open(tmp_path / "node-c", untrusted) as rt:
            third = await rt.agent("keeper").send(_second_turn(first.reply), max_tokens=6)
            remote = rt.stats().store.remote
        assert third.usage.tier == "cold" and remote is not None and not remote.up and remote.pulls == 0
    finally:
        server.stop()


# -- forgetting across nodes ------------------------------------------------------


async def test_forgetting_an_agent_on_one_node_makes_it_gone_on_every_node_hot_or_on_disk(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with _open(tmp_path / "a", redis_server.url) as a, _open(tmp_path / "b", redis_server.url) as b:
        async with _open(tmp_path / "c", redis_server.url) as c:
            first = await a.agent("keeper").send(MESSAGES, max_tokens=6)
            await a.flush()
            second = await b.agent("keeper").send(_second_turn(first.reply), max_tokens=6)
            await b.flush()
            third = await c.agent("keeper").send(_second_turn(first.reply), max_tokens=6)
            await c.flush()
        assert second.usage.tier == third.usage.tier == "remote"
        # Now b holds a hot and a disk copy, c (stopped) a disk copy only; a forgets the agent.
        assert await a.agent("keeper").forget()
        client = redis_server.client()
        assert _agent_keys(client, "keeper") == {"kvmem:agent:{keeper}:fence", "kvmem:agent:{keeper}:forgotten"}
        assert not _file_keys(client) and not client.hlen("kvmem:refs")

        again = await b.agent("keeper").send(_second_turn(first.reply), max_tokens=6)
        assert again.usage.tier == "cold" and again.usage.tokens_reused == 0
        await b.flush()  # b's new memory (after the forget) is published under a newer fence
        assert client.keys("kvmem:agent:{keeper}:manifest-*")

    await _forget_reaches_a_disk_only_copy(tmp_path, redis_server, first.reply)


async def _forget_reaches_a_disk_only_copy(tmp_path: Path, redis_server: RedisServer, reply: str) -> None:
    """Node c had only a disk copy when the agent was forgotten: it pulls b's newer memory instead of its own."""
    async with _open(tmp_path / "a", redis_server.url) as a:
        assert await a.agent("keeper").forget()
    async with _open(tmp_path / "c", redis_server.url) as c:
        turn = await c.agent("keeper").send(_second_turn(reply), max_tokens=6)
    assert turn.usage.tier == "cold" and turn.usage.tokens_reused == 0


def _keeper_saved_alone(tmp_path: Path) -> tuple[CacheDirectory, str]:
    """One turn of agent ``keeper`` on a node without Redis: its cache directory and model tag."""
    import trio

    async def talk() -> None:
        async with _open(tmp_path / "node", None) as rt:
            await rt.agent("keeper").send(MESSAGES, max_tokens=4)

    trio.run(talk)
    directory = CacheDirectory(tmp_path / "node" / "caches", fsync=False)
    (tag,) = {e.model_tag for e in directory.list_agents()}
    return directory, tag


def test_a_node_that_served_an_agent_before_it_was_forgotten_cannot_publish_it_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    directory, tag = _keeper_saved_alone(tmp_path)
    node = RemoteTier(redis_server.url, directory.paths)
    elsewhere = RemoteTier(redis_server.url, CacheDirectory(tmp_path / "elsewhere", fsync=False).paths)
    lease = node.lease("keeper")
    assert lease is not None and node.publish("keeper", tag, fence=lease.fence) is True
    assert elsewhere.forget("keeper") is True  # while node still holds the lease, mid-turn
    assert node.publish("keeper", tag, fence=lease.fence) is False  # older than the tombstone
    assert node.publish("keeper", tag) is False  # unfenced (served while Redis was down): refused too
    assert not redis_server.client().keys("kvmem:agent:{keeper}:manifest-*")
    assert not _file_keys(redis_server.client())  # what the refused publishes sent went again
    assert node.check("keeper", tag) == "forgotten" and node.check("keeper", tag) == "current"
    node.release(lease)
    newer = node.lease("keeper")
    assert newer is not None and node.publish("keeper", tag, fence=newer.fence) is True
    node.close()
    elsewhere.close()


# -- garbage collection -------------------------------------------------------------


async def test_redis_holds_only_what_the_current_manifest_names_over_many_turns(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """An agent whose conversation is rewritten each turn: what the old turns stored goes, Redis stays one cache."""
    system = {"role": "system", "content": " ".join(["The lighthouse stands on a rock in a cold sea."] * 30)}
    topics = ["the storm", "the cat", "the ship", "the winter", "the letters", "the lamp", "the gulls", "the tide"]
    client = redis_server.client()
    ever: set[str] = set()  # every file Redis held after some turn
    async with _open(tmp_path / "node", redis_server.url) as rt:
        for topic in topics:
            story = [system, {"role": "user", "content": f"Tell me a long story about {topic} and the keeper."}]
            result = await rt.agent("keeper").send(story, max_tokens=16)
            await rt.agent("keeper").send([*story, {"role": "assistant", "content": result.reply},
                                           {"role": "user", "content": "Go on."}], max_tokens=16)
            await rt.flush()
            ever |= _file_keys(client)
        sent = rt.stats().store.remote.bytes_sent
    (manifest_key,) = client.keys("kvmem:agent:{keeper}:manifest-*")
    name = manifest_key.decode().rsplit(":", 1)[1]
    named = set(client.get(f"kvmem:agent:{{keeper}}:files-{name}").decode().split("\n"))
    manifest = decode_manifest(client.get(manifest_key))
    assert any(p.name.startswith("seg-") for p in manifest.pieces) and any(
        not p.name.startswith("seg-") for p in manifest.pieces)  # the system prompt's block stays, shared by all
    assert _file_keys(client) == named  # superseded segments and state files are gone
    assert len(ever - named) >= 7  # at least one from each earlier story
    assert {k.decode(): int(v) for k, v in client.hgetall("kvmem:refs").items()} == dict.fromkeys(named, 1)
    held = sum(client.strlen(k) for k in named)
    assert held == sum(p.size for p in manifest.pieces) + manifest.state.size
    assert held < sent / 3  # eight stories were sent; Redis holds one


async def test_blocks_shared_by_agents_stay_while_one_still_names_them_and_go_with_the_last(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    system = {"role": "system", "content": " ".join(["The harbour has many boats and old stories."] * 80)}
    async with _open(tmp_path / "a", redis_server.url) as a:
        for name in ("one", "two"):
            await a.agent(name, share_prefix=False).send([system, {"role": "user", "content": f"I am {name}."}],
                                                         max_tokens=2)
        await a.flush()
        client = redis_server.client()
        blocks = {k.decode() for k in client.keys("kvmem:block:*")}
        assert blocks and all(int(client.hget("kvmem:refs", b)) == 2 for b in blocks)

        assert await a.agent("one").forget()
        assert {k.decode() for k in client.keys("kvmem:block:*")} == blocks
        assert all(int(client.hget("kvmem:refs", b)) == 1 for b in blocks)
        assert _agent_keys(client, "one") == {"kvmem:agent:{one}:fence", "kvmem:agent:{one}:forgotten"}
        async with _open(tmp_path / "b", redis_server.url) as b:  # "two" still loads whole from Redis
            two = await b.agent("two", share_prefix=False).send(
                [system, {"role": "user", "content": "I am two."}, {"role": "assistant", "content": "Hello"},
                 {"role": "user", "content": "Again."}], max_tokens=2)
            await b.flush()
        assert two.usage.tier == "remote" and two.usage.tokens_reused > 256

        assert await a.agent("two").forget()
    assert not _file_keys(client) and not client.hlen("kvmem:refs")


def test_a_publish_whose_files_are_collected_before_its_manifest_sends_them_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Files go before the manifest; a collection in between must not leave a manifest naming a missing file."""
    directory, tag = _keeper_saved_alone(tmp_path)
    collected: list[str] = []

    class RacedTier(RemoteTier):
        def _send(self, agent_id, agent_dir, files):
            sent = super()._send(agent_id, agent_dir, files)
            if files and not collected:  # another node's manifest swap collects it right after the upload
                collected.append(files[0][0])
                redis_server.client().delete(files[0][0])
            return sent

    tier = RacedTier(redis_server.url, directory.paths)
    assert tier.publish("keeper", tag) is True
    tier.close()
    client = redis_server.client()
    assert collected and client.exists(collected[0])
    (manifest_key,) = client.keys("kvmem:agent:{keeper}:manifest-*")
    manifest = decode_manifest(client.get(manifest_key))
    assert len(_file_keys(client)) == len(manifest.pieces) + 1 == client.hlen("kvmem:refs")


# -- three nodes ----------------------------------------------------------------------


async def test_three_nodes_taking_turns_round_robin_each_prefill_only_the_new_text(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    def turns(results):
        return [(r.reply, r.usage.tokens_reused, r.usage.tokens_prefilled) for r in results]

    async def talk(nodes) -> list:
        messages, results = list(MESSAGES), []
        for turn, node in enumerate(nodes):
            result = await node.agent("keeper").send(messages, max_tokens=6)
            await node.flush()
            results.append(result)
            messages += [{"role": "assistant", "content": result.reply},
                         {"role": "user", "content": f"Go on ({turn})."}]
        return results

    async with _open(tmp_path / "reference", None) as one:
        reference = await talk([one] * 6)
    async with _open(tmp_path / "a", redis_server.url) as a, _open(tmp_path / "b", redis_server.url) as b, \
            _open(tmp_path / "c", redis_server.url) as c:
        results = await talk([a, b, c, a, b, c])
        remotes = [n.stats().store.remote for n in (a, b, c)]
    assert [r.usage.tier for r in results] == ["cold"] + ["remote"] * 5
    assert [r.usage.tier for r in reference] == ["cold"] + ["hot"] * 5
    assert turns(results) == turns(reference)  # the same replies, reusing and prefilling what one node does
    assert all(r.usage.tokens_prefilled < 30 for r in results[1:])
    assert all(r is not None and r.up and r.stale_publishes == 0 for r in remotes)
    assert [r.pulls for r in remotes] == [1, 2, 2]
