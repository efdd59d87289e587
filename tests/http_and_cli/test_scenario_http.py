"""``POST /v1/scenarios`` and ``GET /v1/scenarios/{id}`` on a bare Starlette app (httpx ASGITransport, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from conftest import models_dir
from starlette.applications import Starlette

from actors import open_runtime
from gateway.scenario_routes import scenario_routes

MODEL = "tiny-llama"


def _open(home: Path):
    return open_runtime(model=MODEL, home=home, models_dir=models_dir(), fsync=False, handle_signals=False)


def _client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvmem.test")


async def _wait(client: httpx.AsyncClient, run_id: str, view: str = "public") -> dict[str, Any]:
    with trio.fail_after(60):
        while True:
            response = await client.get(f"/v1/scenarios/{run_id}", params={"view": view})
            assert response.status_code == 200, response.text
            body = response.json()
            if body["status"] != "running":
                return body
            await trio.sleep(0.05)


async def test_post_runs_a_shipped_scenario_and_get_keeps_private_phases_out_of_the_public_view(tmp_path):
    async with _open(tmp_path) as rt, trio.open_nursery() as nursery:
        app = Starlette(routes=scenario_routes(rt, home=tmp_path, nursery=nursery))
        async with _client(app) as client:
            response = await client.post("/v1/scenarios", json={"name": "gossip", "max_tokens": 4})
            assert response.status_code == 202, response.text
            run_id = response.json()["id"]
            assert response.json()["url"] == f"/v1/scenarios/{run_id}"
            again = await client.post("/v1/scenarios", json={"name": "gossip"})
            assert again.status_code == 409  # the permanent agents' caches are in use

            public = await _wait(client, run_id)
            assert public["status"] == "done" and public["turns_done"] == public["turns_total"] == 18
            assert {line["phase"] for line in public["transcript"]} == {"reunion"}
            assert [p["status"] for p in public["phases"]] == ["done", "done", "done"]
            assert len(public["turns"]) == 18 and all("text" not in t and "reply" not in t for t in public["turns"])
            assert {row["agent"] for row in public["report"]["rows"]} == {"alice", "bob", "eve"}

            bob = (await client.get(f"/v1/scenarios/{run_id}?view=bob")).json()
            assert {line["phase"] for line in bob["transcript"]} == {"alice_bob", "reunion"}
            full = (await client.get(f"/v1/scenarios/{run_id}?view=full")).json()
            assert {line["phase"] for line in full["transcript"]} == {"alice_bob", "alice_eve", "reunion"}
            assert (await client.get(f"/v1/scenarios/{run_id}?view=zed")).status_code == 400
    assert (tmp_path / "scenarios" / run_id / "transcript.md").is_file()
    assert (tmp_path / "scenarios" / run_id / "report.md").is_file()


async def test_invalid_requests_and_scenarios_are_rejected_with_the_problem(tmp_path):
    async with _open(tmp_path) as rt, trio.open_nursery() as nursery:
        app = Starlette(routes=scenario_routes(rt, home=tmp_path, nursery=nursery))
        async with _client(app) as client:
            bad = "name: bad\nagents: {alice: {name: Alice}}\nphases: [{name: one, agents: [alice, zed]}]\n"
            response = await client.post("/v1/scenarios", json={"yaml": bad})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["type"] == "invalid_scenario" and "unknown agent 'zed'" in error["problems"][0]
            response = await client.post("/v1/scenarios", json={"name": "gossip", "max_tokens": 0})
            assert response.status_code == 400 and "$.max_tokens" in response.json()["error"]["message"]
            assert (await client.post("/v1/scenarios", json={"name": "gossip", "yaml": bad})).status_code == 400
            assert (await client.post("/v1/scenarios", json={"nme": "gossip"})).status_code == 400
            assert (await client.post("/v1/scenarios", content=b"{nope")).status_code == 400
            not_utf8 = await client.post("/v1/scenarios", content=b'{"name": "go\xffssip"}')
            assert not_utf8.status_code == 400 and "UTF-8" in not_utf8.json()["error"]["message"]
            assert (await client.post("/v1/scenarios", json={"name": "nope"})).status_code == 404
            assert (await client.post("/v1/scenarios", json={"resume": "nope"})).status_code == 404
            assert (await client.get("/v1/scenarios/nope")).status_code == 404
            assert (await client.get("/v1/scenarios/..%2F..%2Fetc")).status_code == 404
            response = await client.post("/v1/scenarios", json={"name": "gossip", "stop_after": "nowhere"})
            assert response.status_code == 400 and "nowhere" in response.json()["error"]["message"]


async def test_a_stopped_run_resumes_over_http_after_a_server_restart_with_warm_caches(tmp_path):
    async with _open(tmp_path) as rt, trio.open_nursery() as nursery:
        app = Starlette(routes=scenario_routes(rt, home=tmp_path, nursery=nursery))
        async with _client(app) as client:
            response = await client.post(
                "/v1/scenarios", json={"name": "gossip", "max_tokens": 4, "stop_after": "alice_bob"}
            )
            run_id = response.json()["id"]
            stopped = await _wait(client, run_id)
            assert stopped["status"] == "stopped" and stopped["phase"] == "alice_eve"

    async with _open(tmp_path) as rt:  # a new runtime and a new app: the run comes back from disk
        app = Starlette(routes=scenario_routes(rt, home=tmp_path))  # its own background nursery
        async with _client(app) as client:
            assert (await client.get(f"/v1/scenarios/{run_id}")).json()["status"] == "stopped"
            response = await client.post("/v1/scenarios", json={"resume": run_id})
            assert response.status_code == 202, response.text
            done = await _wait(client, run_id, view="full")
    assert done["status"] == "done" and done["turns_done"] == 18
    alice = next(t for t in done["turns"] if t["agent"] == "alice" and t["phase"] == "alice_eve")
    assert (alice["tier"], alice["match"]) == ("warm", "extend")
