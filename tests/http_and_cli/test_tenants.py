"""Tenants (``--api-keys FILE``) against each other, through a real hypercorn server.

Each tenant is a namespace: tenant B cannot read, continue, list, delete or learn the
length of tenant A's agents, through the Anthropic or OpenAI API or the agents API, and
the prefix cache tells B nothing of A (``cached_tokens`` / ``cache_read_input_tokens``
stay 0 on A's exact prompt, while a second agent of A reuses it: the control that shows
the check can fail). Caches live in separate subtrees; limits (agents, disk, requests per
minute) answer 429 in each API's error shape; keys may be stored hashed; single-key mode
is unchanged. The engine is :class:`fake_engine.FakeEngine` (one character, one token):
the isolation is decided above the engine.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from gateway.tenants import Limits, Tenant, load_tenant_keys
from gateway.testing import ServerThread
from runtime.config import Config, ConfigError, load_config
from runtime.plan.turn_plan import ParkedView
from runtime.plan.hot_tier import HotTier
from runtime.plan.kv_manager import KVCacheManager
from runtime.identity import namespaced

MODEL = "fake-a"
KEY_A = "kvmem-test-acme-0123456789"
KEY_B = "kvmem-test-globex-0123456789"  # stored hashed in the key file
KEY_TINY = "kvmem-test-tiny-0123456789"
KEY_DISK = "kvmem-test-disk-0123456789"
KEY_SLOW = "kvmem-test-slow-0123456789"
KEY_OPS = "kvmem-test-ops-0123456789"
# A system prompt longer than two 256-token blocks: what a shared prefix would reuse.
SYSTEM = "You are the assistant of ACME's treasury. " * 16
ASK = [{"role": "user", "content": "What is our cash position?"}]


def _key_file(path: Path) -> Path:
    hashed = hashlib.sha256(KEY_B.encode()).hexdigest()
    path.write_text(f"""
[keys]
"{KEY_A}" = "acme"
"sha256:{hashed}" = "globex"
"{KEY_TINY}" = "tiny"
"{KEY_DISK}" = "disk"
"{KEY_SLOW}" = "slow"
"{KEY_OPS}" = "ops"

[limits]
max_agents = 100
requests_per_minute = 0

[tenants.tiny]
max_agents = 2

[tenants.disk]
max_disk_mb = 0.002

[tenants.slow]
requests_per_minute = 3

[tenants.ops]
operator = true
""")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tenants")


@pytest.fixture(scope="module")
def server(caches: Path) -> Iterator[ServerThread]:
    keys = _key_file(caches / "keys.toml")
    config = Config(model=MODEL, port=0, home=str(caches / "home"), cache_dir=str(caches), api_keys=str(keys),
                    fsync=False, max_tokens_limit=64, graceful_timeout_s=2)
    with ServerThread(config, engine=FakeEngine()) as running:
        yield running


def _client(server: ServerThread, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"x-api-key": key}, timeout=30)


@pytest.fixture
def acme(server: ServerThread) -> Iterator[httpx.Client]:
    with _client(server, KEY_A) as client:
        yield client


@pytest.fixture
def globex(server: ServerThread) -> Iterator[httpx.Client]:
    with _client(server, KEY_B) as client:
        yield client


def _openai(http: httpx.Client, *, agent: str | None = None, messages: list[dict[str, Any]] | None = None,
            system: str = SYSTEM) -> httpx.Response:
    headers = {"x-agent-id": agent} if agent else {}
    chat = [{"role": "system", "content": system}, *(messages or ASK)]
    return http.post("/v1/chat/completions", headers=headers,
                     json={"model": MODEL, "messages": chat, "max_tokens": 8, "temperature": 0})


def _anthropic(http: httpx.Client, *, agent: str | None = None, messages: list[dict[str, Any]] | None = None,
               system: str = SYSTEM) -> httpx.Response:
    headers = {"x-agent-id": agent} if agent else {}
    return http.post("/v1/messages", headers=headers, json={"model": MODEL, "system": system, "max_tokens": 8,
                                                             "messages": messages or ASK})


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


# -- keys --------------------------------------------------------------------------


def test_a_wrong_or_missing_key_is_a_401_in_each_apis_shape(server: ServerThread) -> None:
    with _client(server, "not-a-key") as wrong, httpx.Client(base_url=server.url, timeout=30) as none:
        for http in (wrong, none):
            claude = _anthropic(http)
            assert claude.status_code == 401 and claude.json()["error"]["type"] == "authentication_error"
            gpt = _openai(http)
            assert gpt.status_code == 401 and gpt.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/v1/agents").status_code == 401
        assert none.get("/healthz").status_code == 200  # liveness needs no key
    # A tenant's name is not a key, nor is a hashed entry's hash.
    hashed = "sha256:" + hashlib.sha256(KEY_B.encode()).hexdigest()
    for fake in ("acme", hashed, hashed[7:], KEY_A + "x", KEY_A[:-1], KEY_A.upper()):
        with _client(server, fake) as http:
            assert http.get("/v1/models").status_code == 401, fake


def test_a_key_stored_hashed_works_as_bearer_and_x_api_key(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEY_B}"}, timeout=30) as bearer:
        assert _openai(bearer, agent="hashed-key").status_code == 200
    with _client(server, KEY_B) as http:
        assert http.get("/v1/agents/hashed-key").json()["id"] == "hashed-key"


# -- tenants against each other ----------------------------------------------------------


def test_b_cannot_read_list_count_or_delete_as_agents(acme: httpx.Client, globex: httpx.Client) -> None:
    made = acme.post("/v1/agents/alice/messages", json={"prompt": SYSTEM + "ledger", "max_tokens": 8})
    assert made.status_code == 200, made.text
    assert made.json()["agent_id"] == "alice" and made.headers["x-kvmem-agent-id"] == "alice"
    mine = acme.get("/v1/agents/alice").json()
    assert mine["cached_tokens"] > 256

    assert globex.get("/v1/agents/alice").status_code == 404  # no length, no existence
    assert "alice" not in [a["id"] for a in globex.get("/v1/agents").json()["data"]]
    assert "alice" in [a["id"] for a in acme.get("/v1/agents").json()["data"]]
    gone = globex.delete("/v1/agents/alice")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found"
    assert acme.get("/v1/agents/alice").json()["cached_tokens"] == mine["cached_tokens"]


def test_b_continuing_as_agent_id_starts_cold(acme: httpx.Client, globex: httpx.Client) -> None:
    prompt = SYSTEM + "the secret quarter"
    assert acme.post("/v1/agents/carol/messages", json={"prompt": prompt, "max_tokens": 8}).status_code == 200
    again = acme.post("/v1/agents/carol/messages", json={"prompt": prompt + " and more", "max_tokens": 8}).json()
    assert again["usage"]["tokens_reused"] > 256  # the control: the owner does continue

    theirs = globex.post("/v1/agents/carol/messages", json={"prompt": prompt + " and more", "max_tokens": 8})
    assert theirs.status_code == 200
    usage = theirs.json()["usage"]
    assert usage["tokens_reused"] == 0 and usage["tier"] == "cold", usage
    # Each tenant's carol is its own agent: deleting B's leaves A's.
    assert globex.delete("/v1/agents/carol").status_code == 200
    assert acme.get("/v1/agents/carol").status_code == 200


def _claude_cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["cache_read_input_tokens"])


@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize("b_agent", ["treasury-1", "treasury-9"])  # A's own id, and another
def test_cached_tokens_say_nothing_of_another_tenants_prompt(
    acme: httpx.Client, globex: httpx.Client, api: str, b_agent: str
) -> None:
    send, cached = (_openai, _cached) if api == "openai" else (_anthropic, _claude_cached)
    system = f"{b_agent} {api}: treasury notes, for ACME's eyes only. " * 12  # new to both tenants from its start
    # Ids fresh to each case: any common prefix of an agent's own cache is reused (the chat template's opening
    # too), so an id that held another case's prompt would not start from nothing.
    first = f"treasury-1-{api}-{b_agent}"
    b_id = first if b_agent == "treasury-1" else f"treasury-9-{api}"
    assert cached(send(acme, agent=first, system=system)) == 0
    # The control: another agent of the same tenant starts from the first one's prefix.
    assert cached(send(acme, agent=f"treasury-2-{api}-{b_agent}", system=system)) >= 256
    # Tenant B, A's exact prompt: nothing reused, whatever the agent id.
    assert cached(send(globex, agent=b_id, system=system)) == 0


def test_b_cannot_continue_as_conversation_by_its_hash(acme: httpx.Client, globex: httpx.Client) -> None:
    system = "A conversation only ACME has had so far. " * 12
    first = _openai(acme, system=system)  # no agent id: named by a hash of the conversation
    assert _cached(first) == 0
    reply = first.json()["choices"][0]["message"]["content"]
    grown = [*ASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "And next week?"}]
    assert _cached(_openai(acme, system=system, messages=grown)) >= 256  # the control: A continues
    assert _cached(_openai(globex, system=system, messages=grown)) == 0
    conv = _openai(globex, system=system).headers["x-kvmem-agent-id"]
    assert conv.startswith("conv-") and conv == first.headers["x-kvmem-agent-id"]  # same name, other agent


def test_ids_that_try_to_name_another_tenant_are_refused_or_stay_home(
    caches: Path, acme: httpx.Client, globex: httpx.Client
) -> None:
    for hostile in ("acme\u001falice", "\u001facme", "acme\u001f"):
        body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, *ASK], "max_tokens": 4,
                "user": hostile}
        refused = globex.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_agent_id", hostile
        assert globex.get("/v1/agents/" + hostile.replace("\u001f", "%1F")).status_code == 400
    acme_before = sorted(p.name for p in (caches / "caches" / "tenants" / "acme").rglob("*"))
    for sneaky in ("../acme/agents/alice", "../../tenants/acme", "acme:alice"):
        assert _openai(globex, agent=sneaky).status_code == 200
        assert globex.get("/v1/agents/" + sneaky.replace("/", "%2F")).status_code in (200, 404)
    refused = _openai(globex, agent="..")  # no URL could name it (runtime.identity.DOT_SEGMENTS)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_agent_id"
    assert sorted(p.name for p in (caches / "caches" / "tenants" / "acme").rglob("*")) == acme_before
    assert acme.get("/v1/agents/alice").status_code in (200, 404)


def test_answers_never_show_the_namespace(acme: httpx.Client) -> None:
    for response in (_openai(acme, agent="plain"), _anthropic(acme, agent="plain"),
                     acme.get("/v1/agents"), acme.get("/v1/agents/plain"),
                     acme.post("/v1/agents/plain/messages", json={"prompt": "hi", "max_tokens": 4, "stream": True})):
        assert response.status_code == 200, response.text
        assert "\\u001f" not in response.text and "\u001f" not in response.text
        assert "acme" not in response.headers.get("x-kvmem-agent-id", "")


def test_each_tenant_has_its_own_cache_subtree(caches: Path, acme: httpx.Client, globex: httpx.Client) -> None:
    prompt = SYSTEM + "subtree"
    for http in (acme, globex):
        assert http.post("/v1/agents/same-name/messages", json={"prompt": prompt, "max_tokens": 4}).status_code == 200
    root = caches / "caches"
    deadline = time.monotonic() + 20
    trees = [root / "tenants" / t for t in ("acme", "globex")]
    while not all(list((t / "agents" / "same-name").glob("manifest-*.json")) for t in trees):
        assert time.monotonic() < deadline, "the write-behind saves did not land"
        time.sleep(0.05)
    assert not (root / "agents" / "same-name").exists()  # nothing in the namespace without tenants
    for tree in trees:
        assert (tree.stat().st_mode & 0o777) == 0o700
        manifest = json.loads(next((tree / "agents" / "same-name").glob("manifest-*.json")).read_text())
        assert manifest["agent_id"] == "same-name"
        assert list((tree / "blocks").rglob("*.safetensors"))  # each tenant's own copy of the same blocks
    acme_blocks = {p.name for p in (trees[0] / "blocks").rglob("*.safetensors")}
    globex_blocks = {p.name for p in (trees[1] / "blocks").rglob("*.safetensors")}
    assert acme_blocks & globex_blocks  # the same content, stored twice: no dedup across tenants


# -- limits -----------------------------------------------------------------------------------


def test_max_agents_is_a_429_in_each_apis_shape_until_one_is_deleted(server: ServerThread) -> None:
    with _client(server, KEY_TINY) as tiny:
        assert _openai(tiny, agent="one").status_code == 200
        assert _anthropic(tiny, agent="two").status_code == 200
        gpt = _openai(tiny, agent="three")
        assert gpt.status_code == 429 and gpt.json()["error"]["code"] == "tenant_agent_limit"
        assert gpt.headers["x-should-retry"] == "false" and "retry-after" not in gpt.headers
        claude = _anthropic(tiny, agent="three")
        assert claude.status_code == 429 and claude.json()["error"]["type"] == "rate_limit_error"
        own = tiny.post("/v1/agents/three/messages", json={"prompt": "hi", "max_tokens": 4})
        assert own.status_code == 429 and own.json()["error"]["code"] == "tenant_agent_limit"
        assert _openai(tiny, agent="one").status_code == 200  # existing agents go on
        assert tiny.delete("/v1/agents/two").status_code == 200
        assert _openai(tiny, agent="three").status_code == 200
        assert len(tiny.get("/v1/agents").json()["data"]) == 2


def test_agents_created_at_once_cannot_all_pass_the_limit(server: ServerThread) -> None:
    with _client(server, KEY_TINY) as tiny:
        for agent in [a["id"] for a in tiny.get("/v1/agents").json()["data"]]:
            tiny.delete(f"/v1/agents/{agent}")

        def create(i: int) -> int:
            return _openai(tiny, agent=f"burst-{i}").status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(create, range(8)))
        assert statuses.count(200) == 2 and statuses.count(429) == 6, statuses


def test_max_disk_is_a_429_once_the_tenants_subtree_is_full(server: ServerThread, caches: Path) -> None:
    with _client(server, KEY_DISK) as disk:
        assert _openai(disk, agent="big").status_code == 200  # nothing on disk yet
        manifest = caches / "caches" / "tenants" / "disk" / "agents" / "big"
        deadline = time.monotonic() + 20
        while not list(manifest.glob("manifest-*.json")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        full = _openai(disk, agent="big")
        assert full.status_code == 429 and full.json()["error"]["code"] == "tenant_disk_limit", full.text
    with _client(server, KEY_A) as acme:
        assert _openai(acme, agent="big").status_code == 200  # another tenant's disk is its own


def test_requests_per_minute_is_a_429_with_retry_after(server: ServerThread) -> None:
    with _client(server, KEY_SLOW) as slow, _client(server, KEY_A) as acme:
        assert [slow.get("/v1/models").status_code for _ in range(3)] == [200, 200, 200]
        over = slow.get("/v1/models")
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
        assert over.json()["error"]["code"] == "tenant_rate_limit"
        assert int(over.headers["retry-after"]) >= 1 and over.headers["x-should-retry"] == "true"
        claude = _anthropic(slow)
        assert claude.status_code == 429 and claude.json()["error"]["type"] == "rate_limit_error"
        assert acme.get("/v1/models").status_code == 200  # one tenant's rate is not another's


def test_metrics_and_scenarios_are_for_operator_tenants(server: ServerThread, acme: httpx.Client) -> None:
    denied = acme.get("/metrics")
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "operator_only"
    assert acme.post("/v1/scenarios", json={}).status_code == 403
    with _client(server, KEY_OPS) as ops:
        assert ops.get("/metrics").status_code == 200


def test_the_token_bucket_refills_evenly() -> None:
    now = [0.0]
    tenant = Tenant("t", Limits(requests_per_minute=60), clock=lambda: now[0])
    assert all(tenant.take_request() is None for _ in range(60))
    wait = tenant.take_request()
    assert wait is not None and 0.9 < wait <= 1.0
    now[0] += 1.0
    assert tenant.take_request() is None and tenant.take_request() is not None


# -- the key file ---------------------------------------------------------------------------------


def test_key_file_limits_merge_and_every_entry_is_compared(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    keys = load_tenant_keys(_key_file(tmp_path / "k.toml"))
    assert keys.tenants["tiny"].limits == Limits(max_agents=2)  # rpm 0 in [limits]: no limit
    assert keys.tenants["acme"].limits == Limits(max_agents=100)
    assert keys.tenants["ops"].operator and not keys.tenants["acme"].operator
    import gateway.tenants

    calls: list[int] = []
    real = gateway.tenants.hmac.compare_digest
    monkeypatch.setattr(gateway.tenants.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for given in (KEY_A, KEY_OPS, "nobody"):
        calls.clear()
        keys.resolve(given)
        assert len(calls) == 6, given  # no early exit: the time says nothing of which key matched
    assert keys.resolve(KEY_B) is keys.tenants["globex"] and keys.resolve(None) is None


@pytest.mark.parametrize("text, problem", [
    ('[keys]\n"sha256:abc" = "a"\n', "64 hex"),
    ('[keys]\n"k1-0123456789" = "Not A Name"\n', "tenant name"),
    ('[keys]\n"k1-0123456789" = "a"\n[limits]\nmax_agent = 3\n', "max_agent"),
    ('[keys]\n', "no [keys]"),
    ('[keys]\n"k1-0123456789" = "a"\n"sha256:' + hashlib.sha256(b"k1-0123456789").hexdigest() + '" = "b"\n',
     "given twice"),
    ('keys = [', "not valid TOML"),
])
def test_a_bad_key_file_is_a_config_error_naming_the_problem(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem.replace("[", r"\[")):
        load_tenant_keys(path)


def test_short_keys_and_a_key_file_others_can_read_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[keys]\n"short" = "a"\n')
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="kvmem.gateway"):
        load_tenant_keys(path)
    assert "5 characters" in caplog.text and "chmod 600" in caplog.text


def test_api_key_and_api_keys_together_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api_key and api_keys"):
        load_config({"api_key": "k", "api_keys": str(tmp_path / "keys.toml")}, env={})
    with pytest.raises(ConfigError, match="not supported together"):
        load_config({"api_keys": "keys.toml", "store": "redis://127.0.0.1:6379/0"}, env={})
    assert load_config(env={"KVMEM_API_KEYS": "/etc/kvmem/keys.toml"}).api_keys == "/etc/kvmem/keys.toml"


# -- single-key mode, unchanged --------------------------------------------------------------------


def test_single_key_mode_keeps_one_namespace_and_shares_prefixes(tmp_path: Path) -> None:
    config = Config(model=MODEL, port=0, home=str(tmp_path / "home"), cache_dir=str(tmp_path), api_key=KEY_A,
                    fsync=False, max_tokens_limit=64, graceful_timeout_s=2)
    with ServerThread(config, engine=FakeEngine()) as server, _client(server, KEY_A) as http:
        assert _cached(_openai(http, agent="solo-1")) == 0
        assert _cached(_openai(http, agent="solo-2")) >= 256  # agents of one key share prefixes, as before
        with _client(server, KEY_B) as other:
            assert other.get("/v1/agents").status_code == 401
        ids = [a["id"] for a in http.get("/v1/agents").json()["data"]]
        assert {"solo-1", "solo-2"} <= set(ids)
    assert (tmp_path / "caches" / "agents" / "solo-1").is_dir()
    assert not (tmp_path / "caches" / "tenants").exists()


# -- the cache manager -------------------------------------------------------------------------------


def _hot(text: str) -> ParkedView:
    from fake_engine import FakeParked

    return FakeParked(MODEL, text, tuple(ord(c) for c in text), tuple(range(1, len(text) + 1)))


def test_the_hot_tier_shares_prefixes_within_a_tenant_only() -> None:
    hot, planner = HotTier(hot_budget_bytes=2**20), KVCacheManager()
    text = "x" * 600
    donor = namespaced("acme", "a")
    hot.put(donor, _hot(text), share_prefix=True, block_bytes=16, block_hashes=["h1", "h2"])

    def tier(agent: str) -> str:  # planned against what its checkout gives, as the GPU actor plans a turn
        return planner.plan(agent, MODEL, text + "y", share_prefix=True, own=hot.checkout(agent, MODEL),
                            hot=hot.donors(agent, MODEL)).tier

    assert tier(namespaced("acme", "b")) == "shared"
    assert tier(namespaced("globex", "a")) == "cold"
    assert tier("a") == "cold"  # the default namespace too
    # The same blocks held by another tenant are charged again: the pool's dedup is per tenant.
    hot.put(namespaced("acme", "c"), _hot(text), share_prefix=True, block_bytes=16, block_hashes=["h1", "h2"])
    shared_once = hot.stats().pools[MODEL].used_blocks
    hot.put(namespaced("globex", "c"), _hot(text), share_prefix=True, block_bytes=16, block_hashes=["h1", "h2"])
    assert hot.stats().pools[MODEL].used_blocks > shared_once


async def test_new_agents_admitted_at_once_cannot_all_pass_the_limit() -> None:
    """The admission lock and the actor started inside it: what the HTTP burst above cannot race reliably."""
    import trio

    from actors.messages_store import Used
    from gateway.errors import ApiError
    from runtime.identity import local_id

    class SlowRuntime:  # a store that takes a while to count, like a disk walk
        def __init__(self) -> None:
            self.live: set[str] = set()

        async def tenant_usage(self, tenant: str) -> Used:
            await trio.sleep(0.001)
            return Used(agent_dirs=frozenset(self.live), disk_bytes=0)

        def start(self, agent_id: str) -> None:
            self.live.add(local_id(agent_id))

    rt = SlowRuntime()
    tenant = Tenant("tiny", Limits(max_agents=2))
    outcomes: list[str] = []
    admitted: list[str] = []

    async def create(i: int) -> None:
        try:
            await tenant.admit(rt, namespaced("tiny", f"n{i}"))  # type: ignore[arg-type]
            outcomes.append("in")
            admitted.append(f"n{i}")
        except ApiError as exc:
            outcomes.append(exc.code or "")

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(create, i)
    assert sorted(outcomes) == ["in", "in", *["tenant_agent_limit"] * 4]
    await tenant.admit(rt, namespaced("tiny", admitted[0]))  # type: ignore[arg-type]  # an existing agent goes on


def test_the_cli_lists_and_forgets_a_tenants_agents(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import main

    # The settings file names this test's home; the suite's KVMEM_HOME (CI's, where the docs' examples ran
    # and left their conversations) would win over it.
    monkeypatch.delenv("KVMEM_HOME", raising=False)

    keys = _key_file(tmp_path / "keys.toml")
    config = Config(model=MODEL, port=0, home=str(tmp_path / "home"), cache_dir=str(tmp_path), api_keys=str(keys),
                    fsync=False, max_tokens_limit=64, graceful_timeout_s=2)
    with ServerThread(config, engine=FakeEngine()) as server, _client(server, KEY_A) as acme:
        assert _openai(acme, agent="kept").status_code == 200
        assert _openai(acme, agent="dropped").status_code == 200
    settings = tmp_path / "kvmem.toml"
    settings.write_text(f'cache_dir = "{tmp_path}"\nhome = "{tmp_path / "home"}"\nfsync = false\n')
    where = ["--config", str(settings)]
    assert main(["agents", "--json", "--tenant", "acme", *where]) == 0
    assert sorted(a["agent"] for a in json.loads(capsys.readouterr().out)) == ["dropped", "kept"]
    assert main(["agents", "--json", *where]) == 0
    assert json.loads(capsys.readouterr().out) == []  # the keyless namespace holds none of them
    assert main(["forget", "dropped", "--tenant", "globex", *where]) == 1  # another tenant's: not found
    assert main(["forget", "dropped", "--tenant", "acme", *where]) == 0
    assert capsys.readouterr().out.strip() == "forgot dropped"
    assert main(["agents", "--json", "--tenant", "acme", *where]) == 0
    assert [a["agent"] for a in json.loads(capsys.readouterr().out)] == ["kept"]
    assert main(["agents", "--tenant", "Bad Name", *where]) == 2


def test_a_cache_key_holds_only_an_agent_id_in_its_checked_spelling() -> None:
    """Issue 60: the (agent, model) key is one validated type; an id the doors would refuse or spell otherwise
    never keys a cache (here the decomposed spelling of an id ``check_agent_id`` composes)."""
    from runtime.errors import InvalidAgentIdError
    from runtime.identity import AgentKey, check_agent_id, is_checked_agent_id

    key = AgentKey(namespaced("acme", "café"), MODEL)
    assert key == (namespaced("acme", "café"), MODEL) and key.agent_id == check_agent_id(key.agent_id)
    for bad in ("cafe\u0301", "..", "", "a\ufffd"):
        assert not is_checked_agent_id(bad)
        with pytest.raises(InvalidAgentIdError):
            AgentKey(bad, MODEL)
    with pytest.raises(InvalidAgentIdError):
        AgentKey("a", "")
