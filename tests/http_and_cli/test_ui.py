"""The operator page's routes without a browser: its files, its key rules, its JSON, tenant isolation.

``/ui/`` serves three files from the package that hold no data (served without the key,
with a policy that lets them load nothing from elsewhere); everything the page shows
comes from ``/v1/status``, ``/v1/status/agents`` and ``/v1/scenarios``, which need the
key, show a tenant its own agents only, and keep the runtime-wide picture to operators.
A real hypercorn server on the fake engine (no MLX). The page in a real browser:
``tests/http_and_cli/test_ui_browser.py``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from gateway.scenario_routes import scenario_routes
from gateway.testing import ServerThread
from gateway.ui_routes import UI_FILES
from runtime.config import Config

MODEL = "fake-a"
KEY = "kvmem-ui-test-key-0123456789"
KEY_ACME = "kvmem-ui-acme-0123456789"
KEY_GLOBEX = "kvmem-ui-globex-0123456789"
KEY_OPS = "kvmem-ui-ops-0123456789"


def _turn(http: httpx.Client, agent: str, text: str = "Hello there", max_tokens: int = 4,
          before: list[dict[str, str]] | None = None) -> dict[str, Any]:
    messages = [*(before or []), {"role": "user", "content": text}]
    response = http.post(f"/v1/agents/{agent}/messages", json={"messages": messages, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    home = tmp_path_factory.mktemp("ui")
    config = Config(model=MODEL, port=0, home=str(home), fsync=False, api_key=KEY, graceful_timeout_s=2)

    def scenarios(rt: Any, nursery: Any) -> list[Any]:
        return scenario_routes(rt, home=home, nursery=nursery)

    with ServerThread(config, engine=FakeEngine(), extra_routes=scenarios) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=30) as client:
        yield client


# -- the files ----------------------------------------------------------------------


def test_the_page_is_served_without_a_key_and_holds_nothing_but_a_sign_in_form(server: ServerThread) -> None:
    anonymous = httpx.Client(base_url=server.url, timeout=30)
    redirect = anonymous.get("/ui")
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/ui/")
    page = anonymous.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    html = page.text
    assert '<form id="signin-form"' in html and 'type="password"' in html
    assert re.search(r'<main id="signin"[^>]*hidden', html) and re.search(r'<div id="app" hidden', html)
    assert KEY not in html and "agent" not in html.split('<div id="app"')[0].lower().replace("user-agent", "")
    for name, media_type in (("app.js", "text/javascript"), ("style.css", "text/css")):
        response = anonymous.get(f"/ui/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == f"{media_type}; charset=utf-8"
        assert response.content == resources.files("gateway").joinpath("ui", name).read_bytes()
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"] == "no-referrer"
    assert anonymous.head("/ui/app.js").status_code == 200


def test_only_the_pages_files_skip_the_key(server: ServerThread, http: httpx.Client) -> None:
    anonymous = httpx.Client(base_url=server.url, timeout=30)
    for path in ("/ui/secrets", "/ui/app.js/x", "/ui//app.js", "/ui/../v1/agents", "/v1/status", "/v1/status/agents",
                 "/v1/scenarios", "/ui/index.html"):
        assert anonymous.get(path).status_code == 401, path
    assert http.get("/ui/secrets").status_code == 404
    wrong = anonymous.get("/v1/status", headers={"x-api-key": KEY + "x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication"


def test_the_static_files_reach_no_other_host_and_keep_the_key_out_of_urls() -> None:
    allowed = {"http://www.w3.org/2000/svg"}  # the SVG namespace: a name, never fetched
    for name in UI_FILES:
        text = resources.files("gateway").joinpath("ui", name).read_text(encoding="utf-8")
        urls = set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}[^\s\"'`)]*", text))
        assert {u for u in urls if u not in allowed and not u.startswith("//")} == set(), name
        assert "@import" not in text and not re.search(r"url\((?!data:)", text), name
        assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=\"(https?:)?//", text), name
    script = resources.files("gateway").joinpath("ui", "app.js").read_text(encoding="utf-8")
    assert "sessionStorage" in script and "localStorage" not in script
    assert 'headers.set("x-api-key", key)' in script and "history.replaceState" in script
    assert not re.search(r"[?&](api_)?key=", script)  # the key never travels in a query string


def test_the_openapi_document_lists_the_status_routes_but_not_the_pages_files(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/status" in paths and "/v1/status/agents" in paths
    assert not [p for p in paths if p.startswith("/ui")]


# -- the JSON -----------------------------------------------------------------------------


def test_status_gives_live_figures_the_memory_picture_and_the_batch(http: httpx.Client) -> None:
    before = http.get("/v1/status").json()["live"]["turns"]
    _turn(http, "status-probe")
    status = http.get("/v1/status")
    assert status.status_code == 200 and status.headers["cache-control"] == "no-store"
    body = status.json()
    assert body["object"] == "status" and body["model"] == MODEL and body["caller"] == {"tenant": None,
                                                                                      "operator": True}
    live = body["live"]
    assert live["turns"] == before + 1 and live["ttft_ms"]["p50"] > 0 and len(live["series"]) == 60
    assert set(live["hit_rate"]) == {"hot", "warm", "remote", "shared", "cold"}
    memory = body["memory"]
    for gauge in ("kv_budget", "hot_tier", "float_pool", "prefetch"):
        assert memory[gauge]["limit_bytes"] > 0, gauge
    assert memory["hot_tier"]["used_bytes"] > 0 and memory["disk"]["limit_bytes"] > memory["disk"]["used_bytes"] > 0
    batch = body["batch"]
    assert batch["decoding"] == 0 and batch["max_batch"] >= 1 and batch["turns"] == []
    assert body["totals"]["completed"] >= 1


def test_the_agents_listing_gives_tier_bytes_model_and_last_turn(http: httpx.Client) -> None:
    first = _turn(http, "ada", "Remember the number 42.")
    history = [{"role": "user", "content": "Remember the number 42."},
               {"role": "assistant", "content": first["content"]}]
    sent = time.time()
    second = _turn(http, "ada", "And 43.", before=history)
    agents = {a["id"]: a for a in http.get("/v1/status/agents").json()["data"]}
    ada = agents["ada"]
    assert ada["tier"] == "hot" and ada["live"] and ada["model_tag"].startswith(MODEL)
    assert ada["cached_tokens"] > 0 and ada["ram_bytes"] > 0 and ada["float_bytes"] == 0
    last = ada["last_turn"]
    assert last["agent_id"] == "ada" and last["finish_reason"] == second["finish_reason"]
    assert last["usage"] == second["usage"]  # the one usage record, as the agents API reported it
    assert last["usage"]["tier"] == "hot" and last["usage"]["tokens_reused"] > first["usage"]["tokens_reused"]
    assert sent <= ada["last_used"] <= time.time()  # its last turn's end (the server runs in this process)
    assert http.delete("/v1/agents/ada").status_code == 200
    assert "ada" not in {a["id"] for a in http.get("/v1/status/agents").json()["data"]}


def test_the_scenarios_listing_holds_the_shipped_scenarios_and_the_runs(http: httpx.Client) -> None:
    listing = http.get("/v1/scenarios").json()
    assert {"gossip", "design_review"} <= {s["name"] for s in listing["library"]}
    gossip = next(s for s in listing["library"] if s["name"] == "gossip")
    assert gossip["title"] and gossip["phases"] == 3 and gossip["agents"] == 3
    started = http.post("/v1/scenarios", json={"name": "gossip", "max_tokens": 2})
    assert started.status_code == 202, started.text
    run_id = started.json()["id"]
    deadline = time.monotonic() + 60
    while http.get(f"/v1/scenarios/{run_id}").json()["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    runs = http.get("/v1/scenarios").json()["runs"]
    assert runs[0]["id"] == run_id and runs[0]["status"] == "done" and runs[0]["turns_done"] == 18


# -- tenants ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    home = tmp_path_factory.mktemp("ui-tenants")
    keys = home / "keys.toml"
    keys.write_text(f'[keys]\n"{KEY_ACME}" = "acme"\n"{KEY_GLOBEX}" = "globex"\n"{KEY_OPS}" = "ops"\n\n'
                    '[limits]\nmax_agents = 10\nmax_disk_mb = 50\n\n[tenants.ops]\noperator = true\n')
    keys.chmod(0o600)
    config = Config(model=MODEL, port=0, home=str(home), fsync=False, api_keys=str(keys), graceful_timeout_s=2)
    with ServerThread(config, engine=FakeEngine(step_delay_s=0.01)) as running:
        yield running


def _client(server: ServerThread, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"x-api-key": key}, timeout=30)


def test_a_tenant_sees_its_own_agents_and_turns_and_not_the_servers_memory(tenants: ServerThread) -> None:
    acme, globex, ops = (_client(tenants, k) for k in (KEY_ACME, KEY_GLOBEX, KEY_OPS))
    _turn(acme, "shared-name", "Acme's secret plan")
    _turn(acme, "acme-only")
    _turn(globex, "shared-name", "Globex's own, longer words")
    acme_agents = acme.get("/v1/status/agents").json()
    assert {a["id"] for a in acme_agents["data"]} == {"shared-name", "acme-only"}
    assert acme_agents["usage"]["tenant"] == "acme" and acme_agents["usage"]["agents"] == 2
    assert acme_agents["usage"]["max_agents"] == 10 and acme_agents["usage"]["max_disk_bytes"] == 50 * 2**20
    globex_agents = globex.get("/v1/status/agents").json()["data"]
    assert [a["id"] for a in globex_agents] == ["shared-name"]  # its own agent of that name, not acme's
    mine = globex_agents[0]
    acme_same = next(a for a in acme_agents["data"] if a["id"] == "shared-name")
    assert mine["last_turn"]["usage"]["tokens_prefilled"] != acme_same["last_turn"]["usage"]["tokens_prefilled"]
    assert ops.get("/v1/status/agents").json()["data"] == []  # an operator tenant lists its own agents too

    status = globex.get("/v1/status").json()
    assert status["caller"] == {"tenant": "globex", "operator": False}
    assert status["memory"] is None and status["batch"] is None and status["totals"] is None
    assert status["live"]["turns"] == 1  # its own turn only, not acme's two
    operator = ops.get("/v1/status").json()
    assert operator["caller"] == {"tenant": "ops", "operator": True}
    assert operator["memory"] is not None and operator["live"]["turns"] == 3 and operator["totals"]["completed"] == 3
    assert globex.get("/v1/scenarios").status_code == 403  # operators only (and not served here: 404 for ops)
    assert httpx.get(tenants.url + "/ui/").status_code == 200
    assert httpx.get(tenants.url + "/v1/status").status_code == 401


def test_the_batch_shows_a_running_turn_with_its_tenant_and_its_own_id(tenants: ServerThread) -> None:
    acme, ops = _client(tenants, KEY_ACME), _client(tenants, KEY_OPS)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_turn, acme, "long-one", "Write at length.", 200)  # 200 steps of 10 ms
        deadline = time.monotonic() + 10
        while not (rows := ops.get("/v1/status").json()["batch"]["turns"]):
            assert time.monotonic() < deadline, "the turn never showed in the batch"
            time.sleep(0.02)
        assert rows[0]["tenant"] == "acme" and rows[0]["turn"]["agent_id"] == "long-one"
        assert rows[0]["turn"]["phase"] in ("queued", "prefill", "decode")
        mine = {a["id"]: a for a in acme.get("/v1/status/agents").json()["data"]}
        assert mine["long-one"]["running"]["agent_id"] == "long-one"
        running.result(timeout=30)


def test_a_cache_redis_holds_newer_is_listed_remote() -> None:
    from actors.messages_store import AgentRecord
    from gateway.status_api import _agent

    def tier(**kw: object) -> str:
        record = AgentRecord(**{"agent_id": "a", "model_tag": "m", "num_tokens": 5, "hot": False, "on_disk": False,
                                "dirty": False, "disk_bytes": 0, "updated_at": 1.0, **kw})
        return _agent("a", record, live=False, ram=(0, 0), last=None, running=None).tier

    assert tier(hot=True, on_disk=True) == "hot" and tier(on_disk=True) == "warm"
    assert tier(remote=True) == "remote" and tier(on_disk=True, remote=True) == "remote"
