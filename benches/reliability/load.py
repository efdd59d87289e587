"""Load: N concurrent agents x T turns over HTTP against a running ``kvmem serve``; replies must not cross-talk.

Agent ``i`` speaks Anthropic (``/v1/messages``) when ``i`` is even, OpenAI
(``/v1/chat/completions``) when odd, and streams when ``(i // 2)`` is odd, so
the four combinations are evenly mixed. It names itself with ``X-Agent-ID``;
every request is greedy (``temperature: 0``). Turn ``k+1`` re-sends the whole
conversation: the system prompt, the user messages so far and the agent's own
replies of turns ``1..k``.

**Reference** (computed first, on the same server, before the load): each
agent's conversation run *alone* — one request in flight on the whole server —
under its own id ``ref-<i>`` (so turn 1 is cold and turns ``k+1`` reuse that
agent's cache exactly as under load), with the same endpoint, non-streaming;
turn ``k+1`` carries the reference's own reply of turn ``k``. Under load, agent
``i``'s reply of turn ``k`` must equal reference turn ``k`` byte for byte
(then, inductively, both conversations are identical): batching with other
agents, streaming and concurrency changed nothing, and no agent ever saw
another's tokens.

A second, *cold* reference is also reported (not required to match): every
turn under a fresh id (``cold-<i>-<k>``), the full prompt re-tokenized and
prefilled from nothing. Turn 1 always equals it; later turns may not, because
a cache keeps the *generated* token ids, and re-tokenizing the reply text
(random-weight models emit odd byte sequences) gives other ids — by design
(DESIGN.md: store generated tokens), not cross-talk.

Also reported: errors (must be 0), TTFT (client side: first streamed delta;
server side: ``ttft_ms`` from ``x-kvmem-*`` headers / the final stream event),
queue wait, and the server process's peak RSS (``VmHWM``) against
``RSS after startup + budget_mb + hot_budget_mb + margin``.

Run: ``python -m benches.reliability.load`` (32 agents x 5 turns, tiny-llama) — starts its
own ``kvmem serve`` subprocess on 127.0.0.1 — or ``--url`` for a running server.
``tests/reliability/test_reliability_load.py`` runs 8 x 3 through :func:`run_load`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
TOPICS = ["rivers", "lighthouses", "bees", "glaciers", "trains", "violins", "deserts", "comets"]


@dataclass
class LoadTurn:
    agent: int
    turn: int
    flavor: str
    stream: bool
    reply: str
    client_ttft_ms: float | None
    e2e_ms: float
    server: dict[str, Any]


@dataclass
class LoadResult:
    replies: dict[int, list[str]]
    turns: list[LoadTurn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def flavor_of(agent: int) -> tuple[str, bool]:
    return ("anthropic" if agent % 2 == 0 else "openai"), (agent // 2) % 2 == 1


def system_of(agent: int) -> str:
    return f"You are agent number {agent}. You answer briefly about {TOPICS[agent % len(TOPICS)]}."


def user_of(agent: int, turn: int) -> str:
    return f"Turn {turn} from agent {agent}: tell me one more thing about {TOPICS[(agent + turn) % len(TOPICS)]}."


def _messages(agent: int, replies: list[str]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for k, reply in enumerate([*replies, None]):
        out.append({"role": "user", "content": user_of(agent, k)})
        if reply is not None:
            out.append({"role": "assistant", "content": reply})
    return out


async def one_turn(client: httpx.AsyncClient, agent: int, agent_id: str, replies: list[str], *, max_tokens: int,
                   stream: bool | None = None) -> LoadTurn:
    """Send agent ``agent``'s next turn (after ``replies``) as ``agent_id``; the reply and its timings."""
    flavor, default_stream = flavor_of(agent)
    stream = default_stream if stream is None else stream
    msgs = _messages(agent, replies)
    headers = {"x-agent-id": agent_id}
    if flavor == "anthropic":
        path = "/v1/messages"
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                                "system": system_of(agent), "messages": msgs, "stream": stream}
    else:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                "messages": [{"role": "system", "content": system_of(agent)}, *msgs]}
        if stream:
            body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first: float | None = None
    if not stream:
        response = await client.post(path, json=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{path} -> {response.status_code}: {response.text[:300]}")
        data = response.json()
        reply = data["content"][0]["text"] if flavor == "anthropic" else data["choices"][0]["message"]["content"]
        server = {k.removeprefix("x-kvmem-").replace("-", "_"): v for k, v in response.headers.items()
                  if k.startswith("x-kvmem-")}
    else:
        parts: list[str] = []
        server = {}
        async with client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{path} -> {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event and event.get("type") in ("error", None):
                    raise RuntimeError(f"stream error: {event}")
                text = ""
                if flavor == "anthropic" and event.get("type") == "content_block_delta":
                    text = event["delta"]["text"]
                elif flavor == "openai" and event.get("choices"):
                    text = event["choices"][0]["delta"].get("content") or ""
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
                if "kvmem" in event:
                    server = event["kvmem"]
        reply = "".join(parts)
    done = time.perf_counter()
    return LoadTurn(agent=agent, turn=len(replies), flavor=flavor, stream=stream, reply=reply,
                     client_ttft_ms=(first - started) * 1000 if first else None, e2e_ms=(done - started) * 1000,
                     server=server)


def _client(url: str, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=10), limits=limits)


async def reference(url: str, agents: int, turns: int, *, max_tokens: int, cold: bool = False,
                    prefix: str = "ref") -> dict[int, list[str]]:
    """Each agent's conversation alone (see the module docstring): ``cold`` gives every turn a fresh id."""
    out: dict[int, list[str]] = {}
    async with _client(url, 1) as client:
        for agent in range(agents):
            replies: list[str] = []
            for turn in range(turns):
                agent_id = f"{prefix}-{agent}-{turn}" if cold else f"{prefix}-{agent}"
                stats = await one_turn(client, agent, agent_id, replies, max_tokens=max_tokens, stream=False)
                assert turn > 0 or stats.server.get("tier") == "cold", stats.server
                replies.append(stats.reply)
            out[agent] = replies
    return out


async def run_load(url: str, agents: int, turns: int, *, max_tokens: int, prefix: str = "load") -> LoadResult:
    """All agents at once, each sending its turns one after another."""
    result = LoadResult(replies={a: [] for a in range(agents)})
    start = trio.Event()

    async def agent_task(client: httpx.AsyncClient, agent: int) -> None:
        await start.wait()
        for _ in range(turns):
            try:
                stats = await one_turn(client, agent, f"{prefix}-{agent}", result.replies[agent],
                                       max_tokens=max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                result.errors.append(f"agent {agent}: {type(exc).__name__}: {exc}")
                return
            result.replies[agent].append(stats.reply)
            result.turns.append(stats)

    async with _client(url, agents) as client:
        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for agent in range(agents):
                nursery.start_soon(agent_task, client, agent)
            start.set()
        result.wall_s = time.perf_counter() - began
    return result


def mismatches(load: LoadResult, ref: dict[int, list[str]]) -> list[str]:
    """Every (agent, turn) whose reply differs from the reference, described."""
    out = []
    for agent, replies in ref.items():
        got = load.replies.get(agent, [])
        for turn, want in enumerate(replies):
            if turn >= len(got) or got[turn] != want:
                out.append(f"agent {agent} turn {turn}: {got[turn] if turn < len(got) else None!r} != {want!r}")
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(load: LoadResult) -> dict[str, float]:
    client_ttft = [t.client_ttft_ms for t in load.turns if t.client_ttft_ms is not None]
    server_ttft = [float(t.server["ttft_ms"]) for t in load.turns if "ttft_ms" in t.server]
    queue = [float(t.server["queue_wait_ms"]) for t in load.turns if "queue_wait_ms" in t.server]
    e2e = [t.e2e_ms for t in load.turns]
    return {
        "requests": len(load.turns), "errors": len(load.errors), "wall_s": load.wall_s,
        "client_ttft_p50_ms": percentile(client_ttft, 0.5), "client_ttft_p99_ms": percentile(client_ttft, 0.99),
        "server_ttft_p50_ms": percentile(server_ttft, 0.5), "server_ttft_p99_ms": percentile(server_ttft, 0.99),
        "queue_wait_p50_ms": percentile(queue, 0.5), "queue_wait_p99_ms": percentile(queue, 0.99),
        "e2e_p50_ms": percentile(e2e, 0.5), "e2e_p99_ms": percentile(e2e, 0.99),
        "tiers": {tier: sum(t.server.get("tier") == tier for t in load.turns)  # type: ignore[dict-item]
                  for tier in ("cold", "hot", "warm")},
    }


# -- the program: its own server subprocess --------------------------------------------------


def _rss_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def start_server(cache_dir: Path, *, budget_mb: float, hot_budget_mb: float, extra: list[str] | None = None,
                 home: str | None = None) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``kvmem serve`` on 127.0.0.1:0; returns the process, its URL and its (growing) stderr lines."""
    env = {**os.environ, "KVMEM_HOME": home or os.environ.get("KVMEM_HOME", "/tmp/kvmem-test-home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", MODEL, "--port", "0", "--cache-dir", str(cache_dir),
         "--budget-mb", str(budget_mb), "--hot-budget-mb", str(hot_budget_mb), *(extra or [])],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"serving \S+ on (http://\S+)", line)
            if match and not url:
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=drain, daemon=True).start()
    if not found.wait(120) or not url:
        proc.kill()
        raise RuntimeError("kvmem serve did not start:\n" + "".join(lines[-20:]))
    return proc, url[0], lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--budget-mb", type=float, default=256)
    p.add_argument("--hot-budget-mb", type=float, default=64)
    p.add_argument("--margin-mb", type=float, default=256, help="allowed RSS growth beyond the two budgets")
    p.add_argument("--url", help="a running server (skips the subprocess and the memory check)")
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)

    proc = None
    with tempfile.TemporaryDirectory(prefix="kvmem-load-") as tmp:
        if args.url:
            url = args.url
        else:
            proc, url, _lines = start_server(Path(tmp) / "cache", budget_mb=args.budget_mb,
                                             hot_budget_mb=args.hot_budget_mb)
            baseline_kib = _rss_kib(proc.pid, "VmRSS")
        try:
            t0 = time.perf_counter()
            ref = trio.run(lambda: reference(url, args.agents, args.turns, max_tokens=args.max_tokens))
            ref_s = time.perf_counter() - t0
            cold = trio.run(lambda: reference(url, args.agents, args.turns, max_tokens=args.max_tokens, cold=True,
                                              prefix="cold"))
            load = trio.run(lambda: run_load(url, args.agents, args.turns, max_tokens=args.max_tokens))
            bad = mismatches(load, ref)
            stats: dict[str, Any] = summary(load)
            stats.update(agents=args.agents, turns=args.turns, max_tokens=args.max_tokens, reference_s=ref_s,
                         mismatches=len(bad), reference_requests=args.agents * args.turns,
                         equal_to_cold_reference=sum(a == b for agent in ref for a, b in
                                                     zip(load.replies[agent], cold[agent], strict=False)),
                         first_turns_equal_to_cold=sum(load.replies[a][:1] == cold[a][:1] for a in ref))
            if proc is not None:
                peak_kib = _rss_kib(proc.pid, "VmHWM")
                bound_mib = baseline_kib / 1024 + args.budget_mb + args.hot_budget_mb + args.margin_mb
                stats.update(rss_after_start_mib=baseline_kib / 1024, peak_rss_mib=peak_kib / 1024,
                             rss_bound_mib=bound_mib, memory_ok=peak_kib / 1024 <= bound_mib)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    for line in load.errors[:10] + bad[:10]:
        print(line, file=sys.stderr)
    print(json.dumps(stats, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(stats, indent=2, default=str))
    ok = not load.errors and not bad and stats.get("memory_ok", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
