"""Tenants tried against each other on a live ``kvmem serve --api-keys``: leaks found (goal 0).

N tenants (keys in one TOML file, half of them stored hashed) each create agents
whose prompts hold a secret of their own, on the real model. Then every tenant
B probes every other tenant A, through every channel a client has:

* **read / count**: ``GET /v1/agents/{A's id}`` (a 200 or any token count is a leak),
  ``GET /v1/agents`` (one of A's ids listed is a leak);
* **delete**: ``DELETE /v1/agents/{A's id}`` (a 200, or A's agent changed afterwards);
* **continue**: A's agent id with A's own prompt grown by a turn, through OpenAI
  (``cached_tokens``), Anthropic (``cache_read_input_tokens``) and the agents API
  (``tokens_reused``, ``tier``): anything reused is a leak;
* **side channel**: a fresh id of B on A's exact prompt, and A's conversation with no
  id at all (its ``conv-<sha256>`` name): anything reused is a leak;
* **race**: A and B send one new long prompt at the same moment (a turn in flight can
  donate its prefix): anything B reuses is a leak;
* **forged ids**: ids that try to name A's namespace or folder (the tenant separator
  U+001F, ``../tenants/A/...``): a 200 on a GET that shows tokens is a leak;
* **text**: A's secret in any answer to B is a leak.

Each probe has a **control**: the same probe by a second agent of A, which must
reuse A's prefix (else the probe could not have seen a leak). At the end the disk
is checked: every manifest in ``caches/tenants/<t>/`` names an agent ``t`` made,
and nothing of a tenant's lies in the default namespace. Writes
``benches/results/tenants.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "tiny-llama"
SEP = "\u001f"


@dataclass
class Report:
    """What the run tried and found."""

    probes: Counter[str] = field(default_factory=Counter)
    leaks: list[str] = field(default_factory=list)
    controls: Counter[str] = field(default_factory=Counter)
    controls_reused: Counter[str] = field(default_factory=Counter)
    controls_failed: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    disk: list[str] = field(default_factory=list)

    def probe(self, kind: str, leaked: bool, what: str) -> None:
        self.probes[kind] += 1
        if leaked:
            self.leaks.append(f"{kind}: {what}")

    def control(self, kind: str, ok: bool, what: str, *, required: bool = True) -> None:
        self.controls[kind] += 1
        self.controls_reused[kind] += ok
        if required and not ok:
            self.controls_failed.append(f"{kind}: {what}")


def _secret(tenant: str) -> str:
    return f"SECRET-{tenant}-{hashlib.sha256(tenant.encode()).hexdigest()[:12]}"


def _system(tenant: str, topic: str) -> str:
    # Long enough for several 256-token blocks on tiny-llama's tokenizer.
    return (f"{_secret(tenant)} {topic}: the quarterly ledger of {tenant} lists accounts, balances and "
            "the names of its counterparties, line by line, in order. ") * 14


class Tenants:
    """HTTP clients, one per tenant, and the probes."""

    def __init__(self, url: str, keys: dict[str, str], report: Report) -> None:
        self.http = {t: httpx.Client(base_url=url, headers={"x-api-key": k}, timeout=300) for t, k in keys.items()}
        self.report = report
        self.used: dict[str, set[str]] = {t: set() for t in keys}  # the agent ids each tenant's turns named

    def close(self) -> None:
        for client in self.http.values():
            client.close()

    def _send(self, tenant: str, method: str, path: str, **kw: Any) -> httpx.Response:
        response = self.http[tenant].request(method, path, **kw)
        self.report.statuses[response.status_code] += 1
        if "x-kvmem-agent-id" in response.headers:
            self.used[tenant].add(response.headers["x-kvmem-agent-id"])
        return response

    def openai(self, tenant: str, system: str, *, agent: str | None = None,
               messages: list[dict[str, str]] | None = None) -> httpx.Response:
        chat = [{"role": "system", "content": system}, *(messages or [{"role": "user", "content": "Summarize."}])]
        return self._send(tenant, "POST", "/v1/chat/completions", headers={"x-agent-id": agent} if agent else {},
                          json={"model": MODEL, "messages": chat, "max_tokens": 4, "temperature": 0})

    def anthropic(self, tenant: str, system: str, *, agent: str) -> httpx.Response:
        return self._send(tenant, "POST", "/v1/messages", headers={"x-agent-id": agent},
                          json={"model": MODEL, "system": system, "max_tokens": 4,
                                "messages": [{"role": "user", "content": "Summarize."}]})

    def agents_turn(self, tenant: str, agent: str, prompt: str) -> httpx.Response:
        return self._send(tenant, "POST", f"/v1/agents/{agent}/messages", json={"prompt": prompt, "max_tokens": 4})


def _cached(response: httpx.Response) -> int:
    if response.status_code != 200:
        return -1
    usage = response.json().get("usage", {})
    if "prompt_tokens_details" in usage:
        return int(usage["prompt_tokens_details"]["cached_tokens"])
    if "cache_read_input_tokens" in usage:
        return int(usage["cache_read_input_tokens"])
    return int(usage.get("tokens_reused", 0))


def _probe_pair(t: Tenants, a: str, b: str) -> None:
    """Tenant ``b`` tries everything against tenant ``a``.

    Every probe that sends a prompt uses a prompt of its own, new to ``b``: had ``b`` sent
    it before, ``b``'s own cache would reuse it, which is no leak.
    """
    r = t.report

    def fresh(kind: str) -> str:  # the kind comes early, so no two prompts share a whole block
        return _system(a, f"{kind} for {b}")

    grown = [{"role": "user", "content": "Summarize."}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "More."}]
    oa_id, an_id, ag_id = f"{a}-vs-{b}-oa", f"{a}-vs-{b}-an", f"{a}-vs-{b}-ag"

    # A's agents, each with the control that shows a probe could see reuse.
    s_oa, s_an, s_ag, s_fo, s_fa, s_cv = (fresh(k) for k in ("oa", "an", "ag", "fresh-oa", "fresh-an", "conv"))
    assert t.openai(a, s_oa, agent=oa_id).status_code == 200
    r.control("same tenant, fresh id, OpenAI", _cached(t.openai(a, s_oa, agent=f"{oa_id}-ctl")) > 0, f"{a} {b}")
    assert t.anthropic(a, s_an, agent=an_id).status_code == 200
    r.control("same tenant, fresh id, Anthropic", _cached(t.anthropic(a, s_an, agent=f"{an_id}-ctl")) > 0, f"{a}")
    assert t.agents_turn(a, ag_id, s_ag).status_code == 200
    r.control("same tenant continues (agents API)", _cached(t.agents_turn(a, ag_id, s_ag + " and more")) > 0, a)
    assert t.openai(a, s_fo, agent=f"{a}-side-{b}").status_code == 200
    assert t.anthropic(a, s_fa, agent=f"{a}-side2-{b}").status_code == 200
    conv = t.openai(a, s_cv)  # no agent id: named by a hash of the conversation
    r.control("same tenant continues its conversation", _cached(t.openai(a, s_cv, messages=grown)) > 0, a)
    before = t.http[a].get(f"/v1/agents/{oa_id}").json()["cached_tokens"]

    # read, count, list
    for agent in (oa_id, an_id, ag_id, conv.headers["x-kvmem-agent-id"]):
        got = t._send(b, "GET", f"/v1/agents/{agent}")
        r.probe("GET another tenant's agent", got.status_code != 404, f"{b} GET {a}'s {agent}: {got.status_code}")
    listed = [x["id"] for x in t._send(b, "GET", "/v1/agents").json()["data"]]
    r.probe("list", any(x.startswith(f"{a}-") for x in listed), f"{b} lists {listed}")

    # delete
    gone = t._send(b, "DELETE", f"/v1/agents/{oa_id}")
    after = t.http[a].get(f"/v1/agents/{oa_id}").json().get("cached_tokens")
    r.probe("DELETE another tenant's agent", gone.status_code != 404 or after != before,
            f"{b} DELETE {a}'s {oa_id}: {gone.status_code}, tokens {before} -> {after}")

    # continue A's agents under A's ids, with A's prompts (grown by a turn)
    r.probe("continue via OpenAI", _cached(t.openai(b, s_oa, agent=oa_id, messages=grown)) != 0, f"{b} as {oa_id}")
    r.probe("continue via Anthropic", _cached(t.anthropic(b, s_an, agent=an_id)) != 0, f"{b} as {an_id}")
    cont = t.agents_turn(b, ag_id, s_ag + " and more")
    r.probe("continue via the agents API", cont.status_code != 200 or cont.json()["usage"]["tier"] != "cold"
            or _cached(cont) != 0, f"{b} as {ag_id}: {cont.text[:200]}")

    # side channels on A's exact prompts, under ids of B's own
    r.probe("cached_tokens, fresh id (OpenAI)", _cached(t.openai(b, s_fo, agent=f"{b}-side-{a}")) != 0, f"{b}")
    r.probe("cache_read_input_tokens, fresh id (Anthropic)",
            _cached(t.anthropic(b, s_fa, agent=f"{b}-side2-{a}")) != 0, f"{b}")
    r.probe("conversation hash (no agent id)", _cached(t.openai(b, s_cv, messages=grown)) != 0, f"{b}")

    # forged ids
    for forged in (f"{a}{SEP}{oa_id}", f"../tenants/{a}/agents/{oa_id}", f"../../{a}/{oa_id}", f"{a}/{oa_id}"):
        got = t._send(b, "GET", "/v1/agents/" + forged.replace("/", "%2F").replace(SEP, "%1F"))
        shows = got.status_code == 200 and got.json().get("cached_tokens", 0) > 0
        r.probe("forged id naming another tenant", shows, f"{b} GET {forged!r}: {got.status_code}")

    # A's secret in an answer to B that B's own requests did not carry
    for response in (t._send(b, "GET", "/v1/agents"), t._send(b, "GET", f"/v1/agents/{oa_id}"),
                     t._send(b, "DELETE", f"/v1/agents/{an_id}-ctl")):
        r.probe("secret in an answer", _secret(a) in response.text, f"{b}: {response.text[:200]}")


def _race(t: Tenants, a: str, b: str, round_: int) -> None:
    """A and B send one new long prompt at the same time: a turn in flight must not donate across tenants."""
    system = _system(a, f"race {round_} {b}")
    with ThreadPoolExecutor(3) as pool:
        mine = pool.submit(t.openai, a, system, agent=f"{a}-race-{round_}")
        theirs = pool.submit(t.openai, b, system, agent=f"{b}-race-{round_}")
        mine2 = pool.submit(t.openai, a, system, agent=f"{a}-race2-{round_}")
        ra, rb, ra2 = mine.result(), theirs.result(), mine2.result()
    t.report.probe("race: the same prompt at the same moment", _cached(rb) != 0, f"{b} vs {a} round {round_}")
    # Whether a turn in flight donates depends on timing: informative, not required.
    t.report.control("race: two agents of A at the same moment (either reused; informative)",
                     _cached(ra) > 0 or _cached(ra2) > 0, f"{a} round {round_}", required=False)


def _check_disk(caches: Path, used: dict[str, set[str]], report: Report) -> None:
    for tenant, ids in used.items():
        for manifest in (caches / "tenants" / tenant / "agents").glob("*/manifest-*.json"):
            agent = json.loads(manifest.read_text())["agent_id"]
            report.probe("disk: a manifest in a tenant's subtree its tenant did not make", agent not in ids,
                         f"{manifest}: {agent}")
    for manifest in (caches / "agents").glob("*/manifest-*.json"):
        report.probe("disk: a tenant's agent in the default namespace", True, str(manifest))


def run(*, tenants: int, races: int, cache_dir: Path) -> Report:
    """Start a server with ``tenants`` tenants and try each against each other."""
    from gateway.testing import ServerThread
    from runtime.config import Config

    names = [f"t{i}" for i in range(tenants)]
    keys = {n: f"kvmem-bench-{n}-{hashlib.sha256(n.encode()).hexdigest()[:16]}" for n in names}
    lines = ["[keys]"]
    for i, n in enumerate(names):  # every other key stored hashed
        entry = keys[n] if i % 2 == 0 else "sha256:" + hashlib.sha256(keys[n].encode()).hexdigest()
        lines.append(f'"{entry}" = "{n}"')
    key_file = cache_dir / "keys.toml"
    key_file.write_text("\n".join(lines) + "\n")
    key_file.chmod(0o600)
    report = Report()
    config = Config(model=MODEL, port=0, cache_dir=str(cache_dir), api_keys=str(key_file), prewarm_mb=0,
                    budget_mb=256, hot_budget_mb=128, max_tokens_limit=16, fsync=False)
    with ServerThread(config) as server:
        t = Tenants(server.url, keys, report)
        try:
            for a, b in itertools.permutations(names, 2):
                _probe_pair(t, a, b)
            for round_, (a, b) in zip(range(races), itertools.cycle(itertools.permutations(names, 2))):
                _race(t, a, b, round_)
            for n in names:  # a listing holds only ids the tenant's own turns named
                listed = {x["id"] for x in t.http[n].get("/v1/agents").json()["data"]}
                report.probe("list: an id the tenant never used", bool(listed - t.used[n]),
                             f"{n}: {sorted(listed - t.used[n])}")
        finally:
            t.close()
    _check_disk(cache_dir / "caches", t.used, report)
    return report


def main(argv: list[str] | None = None) -> None:
    from benches.harness import ResultFile, log, table

    p = argparse.ArgumentParser(prog="python -m benches tenants", description=__doc__)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--races", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="3 tenants, 3 races")
    args = p.parse_args(argv)
    n, races = (3, 3) if args.quick else (args.tenants, args.races)
    res = ResultFile("tenants", "Tenants tried against each other on a live kvmem serve --api-keys", args.quick,
                     argv or [], model=None,
                     setup=[f"model `{MODEL}`, {n} tenants (every other key stored hashed), every ordered pair "
                            f"({n * (n - 1)}), {races} races; max_tokens 4"])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvmem-tenants-") as tmp:
        report = run(tenants=n, races=races, cache_dir=Path(tmp))
    wall = time.monotonic() - started
    probes = sum(report.probes.values())
    log(f"{probes} probes, {len(report.leaks)} leaks, {len(report.controls_failed)} failed controls, {wall:.0f} s")
    res.record(probes=dict(report.probes), leaks=report.leaks, controls=dict(report.controls),
               controls_reused=dict(report.controls_reused),
               controls_failed=report.controls_failed, statuses=dict(report.statuses), wall_s=wall)
    res.body += ["## Outcome", "", *table(["tenants", "ordered pairs", "probes", "leaks", "controls",
                                           "required controls that did not reuse", "wall"],
                                          [[n, n * (n - 1), probes, len(report.leaks), sum(report.controls.values()),
                                            len(report.controls_failed), f"{wall:.0f} s"]]), ""]
    res.body += ["## Probes (tenant B against tenant A)", "",
                 *table(["probe", "tries", "leaks"],
                        [[k, v, sum(x.startswith(k + ":") for x in report.leaks)]
                         for k, v in sorted(report.probes.items())]), ""]
    res.body += ["## Controls (the same probe within tenant A: must reuse, or the probe could not see a leak)", "",
                 *table(["control", "tries", "reused"],
                        [[k, v, report.controls_reused[k]] for k, v in sorted(report.controls.items())]), ""]
    res.body += ["## Answers by status", "", *table(["status", "answers"], sorted(report.statuses.items())), ""]
    if report.leaks:
        res.body += ["## Leaks", "", *[f"- `{x}`" for x in report.leaks[:50]], ""]
    if report.controls_failed:
        res.body += ["## Controls that did not reuse", "", *[f"- `{x}`" for x in report.controls_failed[:50]], ""]
    res.write()
    print(res.md_path.read_text())


if __name__ == "__main__":
    main()
