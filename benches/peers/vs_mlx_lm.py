"""Against mlx-lm: a multi-agent, multi-round chat workload with a server restart.

The shape of LMCache's multi-round QA benchmark: 6 agents, 4 rounds each; every
agent's conversation starts with the same ~500-token system prompt, and every
round adds a ~236-token user message plus the 64-token reply (history grows
~300 tokens a round). In each round the 6 agents send their next message at
the same time (both servers batch concurrent requests). After round 2 the
server process is restarted.

The very same OpenAI Chat Completions requests (streamed, greedy, 64 tokens)
go to:

* ``mlx_lm.server`` on the same model folder, with its prompt cache on (an
  in-memory LRU trie of 10 caches: it reuses the shared system prompt and each
  agent's history while it lives; a restart empties it), float KV — its
  default, and the only mode in which it batches;
* ``kvmem serve`` (Q4 KV, ``X-Agent-ID`` per agent: caches saved to disk, so
  after the restart each agent's history comes back from disk).

After every (re)start both servers get one throwaway request, so neither pays
its model load inside a measured round (mlx-lm loads lazily on the first
request; kvmem at startup). Reported per round: TTFT p50 / p95 over the 6
agents, the round's wall time, and the prompt / cached tokens each server
reports in ``usage``; totals: summed TTFT and wall time, with the ratio.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, median, table
from benches.openai_client import StreamedCompletion, stream_chat
from benches.peers.openai_servers import mlx_lm_server, vllm_mlx_server
from benches.prompts import context_text
from benches.server import KvmemServer


@dataclass(frozen=True)
class Workload:
    """The multi-round shape: agents, rounds, token sizes, and where the restart falls."""

    agents: int = 6
    rounds: int = 4
    system_tokens: int = 500
    message_tokens: int = 236
    output_tokens: int = 64
    restart_after: int = 2

    def system_prompt(self, folder: Path) -> str:
        return context_text(folder, self.system_tokens, label="shared system prompt for every agent")

    def message(self, folder: Path, agent: int, rnd: int) -> str:
        return context_text(folder, self.message_tokens, label=f"agent {agent}, round {rnd + 1}",
                            offset=agent * 10007 + rnd * 3001)


QUICK = Workload(agents=2, rounds=3, system_tokens=200, message_tokens=80, output_tokens=16, restart_after=1)


class Server(Protocol):
    url: str

    def start(self) -> Any: ...
    def stop(self) -> None: ...
    def restart(self) -> float: ...


@dataclass
class Target:
    """One server under test and how to address an agent on it.

    ``body`` gives server-specific request fields for an agent (llama.cpp's
    ``id_slot``); ``warm_up`` sends a throwaway request after every (re)start
    (for servers that load their model on the first request, or pay first-touch
    costs there).
    """

    name: str
    server: Server
    model: str
    agent_header: bool
    body: Callable[[int], dict[str, Any]] | None = None
    warm_up: bool = True
    turns: dict[int, list[StreamedCompletion]] = field(default_factory=dict)
    walls: dict[int, float] = field(default_factory=dict)

    def headers(self, agent: int) -> dict[str, str]:
        return {"X-Agent-ID": f"vs-agent-{agent}"} if self.agent_header else {}

    def extra(self, agent: int) -> dict[str, Any]:
        return self.body(agent) if self.body else {}


async def send_round(target: Target, histories: list[list[dict[str, str]]],
                     max_tokens: int) -> tuple[list[StreamedCompletion], float]:
    """Agent ``i`` sends ``histories[i]``, all at once; their turns in agent order, and the round's wall time."""
    turns: list[StreamedCompletion | None] = [None] * len(histories)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        turns[i] = await stream_chat(client, target.server.url, histories[i], max_tokens=max_tokens,
                                     model=target.model, headers=target.headers(i), extra=target.extra(i))

    t0 = trio.current_time()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client, trio.open_nursery() as nursery:
        for i in range(len(histories)):
            nursery.start_soon(one, client, i)
    wall = trio.current_time() - t0
    return [t for t in turns if t is not None], wall


async def send_warm_up(target: Target) -> None:
    """A throwaway request (agent ``vs-warm-up``) if the target wants one (``Target.warm_up``)."""
    if not target.warm_up:
        return
    async with httpx.AsyncClient() as client:
        await stream_chat(client, target.server.url, [{"role": "user", "content": "Hello there."}], max_tokens=2,
                          model=target.model, headers={"X-Agent-ID": "vs-warm-up"} if target.agent_header else {})


def run_workload(target: Target, wl: Workload, folder: Path, repeat: int, res: ResultFile,
                 tags: dict[str, Any] | None = None) -> None:
    """All rounds of ``wl`` against ``target`` (started here, stopped at the end); ``tags`` go into every record."""
    system = wl.system_prompt(folder)
    histories = [[{"role": "system", "content": system}] for _ in range(wl.agents)]
    target.server.start()
    try:
        trio.run(send_warm_up, target)
        for rnd in range(wl.rounds):
            if rnd == wl.restart_after:
                took = target.server.restart()
                trio.run(send_warm_up, target)
                log(f"{target.name}: restarted in {took:.1f} s")
            for i, h in enumerate(histories):
                h.append({"role": "user", "content": wl.message(folder, i, rnd)})
            turns, wall = trio.run(send_round, target, histories, wl.output_tokens)
            for i, (h, t) in enumerate(zip(histories, turns, strict=True)):
                h.append({"role": "assistant", "content": t.text})
                res.record(**(tags or {}), server=target.name, repeat=repeat, round=rnd + 1, agent=i,
                           ttft_ms=t.ttft_ms, e2e_ms=t.e2e_ms, prompt_tokens=t.prompt_tokens,
                           cached_tokens=t.cached_tokens, completion_tokens=t.completion_tokens)
            target.turns.setdefault(rnd, []).extend(turns)
            target.walls.setdefault(rnd, 0.0)
            target.walls[rnd] += wall
            ttfts = sorted(t.ttft_ms for t in turns)
            log(f"{target.name} round {rnd + 1}: wall {wall:.1f} s, TTFT p50 {median(ttfts):.0f} ms "
                f"max {ttfts[-1]:.0f} ms, prompt {sum(t.prompt_tokens for t in turns)} "
                f"cached {sum(t.cached_tokens or 0 for t in turns)}")
    finally:
        target.server.stop()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, repeats=1)
    p.add_argument("--mlx-lm-args", default="", help="extra arguments for mlx_lm.server (space separated)")
    p.add_argument("--vllm-mlx-venv", type=Path,
                   help="a virtual environment with vllm-mlx (and mlx[cpu]) installed: adds it as a third server")
    args = p.parse_args(argv)
    reps = harness.repeats(args, full=1, quick=1)
    wl = QUICK if args.quick else Workload()
    folder = harness.model_dir()
    res = ResultFile("vs_mlx_lm", "Against mlx-lm: 6 agents x 4 rounds, shared system prompt, restart after round 2",
                     args.quick, argv or [])
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-vs-") as tmp:
        targets = [Target("mlx_lm.server", mlx_lm_server(folder, Path(tmp) / "mlx", args.mlx_lm_args.split()),
                          "default_model", agent_header=False)]
        if args.vllm_mlx_venv:
            targets.append(Target("vllm-mlx", vllm_mlx_server(folder, Path(tmp) / "vllm", args.vllm_mlx_venv),
                                  str(folder), agent_header=False))
        targets.append(Target("kvmem", KvmemServer(Path(tmp) / "kvmem"), "kvmem-default", agent_header=True))
        for r in range(reps):
            # Alternate the order so that no server always runs on the warmer (or busier) machine.
            for target in targets if r % 2 == 0 else targets[::-1]:
                log(f"repeat {r}: {target.name}")
                run_workload(target, wl, folder, r, res)

    _report(res, wl, targets, reps, vllm=bool(args.vllm_mlx_venv))
    _plot(res, wl, targets, reps)
    print(res.write(plot=True).read_text())


def _cached(turns: list[StreamedCompletion], reps: int) -> str:
    prompt = sum(x.prompt_tokens for x in turns) / reps
    if any(x.cached_tokens is None for x in turns):
        return f"n/a / {prompt:.0f}"
    return f"{sum(x.cached_tokens or 0 for x in turns) / reps:.0f} / {prompt:.0f}"


def _report(res: ResultFile, wl: Workload, targets: list[Target], reps: int, *, vllm: bool) -> None:
    base = targets[0]
    rows = []
    for rnd in range(wl.rounds):
        base_p50 = median(x.ttft_ms for x in base.turns[rnd])
        for t in targets:
            ttfts = [x.ttft_ms for x in t.turns[rnd]]
            rows.append([
                f"{rnd + 1}" + (" (after restart)" if rnd == wl.restart_after else ""), t.name,
                f"{median(ttfts) / 1e3:.2f}", f"{percentile(ttfts, 95) / 1e3:.2f}", f"{t.walls[rnd] / reps:.1f}",
                _cached(t.turns[rnd], reps), f"{base_p50 / median(ttfts):.2f}x",
            ])

    def total_ttft(t: Target) -> float:
        return sum(x.ttft_ms for turns in t.turns.values() for x in turns) / reps / 1e3

    def total_wall(t: Target) -> float:
        return sum(t.walls.values()) / reps

    totals = [[t.name, f"{total_ttft(t):.1f}", f"{total_ttft(base) / total_ttft(t):.2f}x", f"{total_wall(t):.1f}",
               f"{total_wall(base) / total_wall(t):.2f}x"] for t in targets]
    ratio = total_ttft(base) / total_ttft(targets[-1])
    res.setup += [
        (f"workload: {wl.agents} agents x {wl.rounds} rounds, shared {wl.system_tokens}-token system prompt, "
         f"+{wl.message_tokens}-token user message a round, {wl.output_tokens} greedy output tokens, all agents of a "
         f"round sent at once, server restarted after round {wl.restart_after}; {reps} repeat(s)"),
        ("mlx_lm.server: `mlx_lm.server --model <kvmem-default folder>` (prompt cache on, size 10, float KV, "
         "batching on), launched after `import runtime` so it uses the same OpenBLAS; kvmem: `kvmem serve "
         "--model kvmem-default` (Q4 KV, attention auto), agents named by `X-Agent-ID`"),
    ]
    if vllm:
        res.setup.append("vllm-mlx: `vllm-mlx serve <folder> --continuous-batching --enable-prefix-cache "
                         "--ssd-cache-dir ...` from its own venv (OpenBLAS via LD_PRELOAD); it persists its prefix "
                         "cache on shutdown and reloads it on start; it does not report cached tokens")
    res.body += [
        *table(["round", "server", "TTFT p50 s", "TTFT p95 s", "round wall s", "cached / prompt tok",
                "p50 speedup vs mlx-lm"], rows),
        "",
        *table(["server", "summed TTFT s (all agents, all rounds)", "vs mlx-lm", "wall s (all rounds)", "vs mlx-lm"],
               totals),
        "",
        f"Goal: ≥ 3x lower total TTFT than mlx-lm's server — {'met' if ratio >= 3 else 'missed'} ({ratio:.2f}x).",
        "",
        _failures(targets),
        "",
        ("*cached / prompt tok* is what each server reports in `usage` (`prompt_tokens_details.cached_tokens` / "
         "`prompt_tokens`), summed over the round's agents. TTFT is the time from sending the request to the "
         "first content delta, with all the round's agents in flight at once; p95 is the nearest rank over the "
         "round's agents."),
    ]


def _failures(targets: list[Target]) -> str:
    """A sentence on requests that ended without content (they count in TTFT with their whole duration)."""
    failed = []
    for t in targets:
        empty = [(rnd + 1, x) for rnd, turns in t.turns.items() for x in turns if x.completion_tokens == 0]
        if empty:
            rounds = sorted({rnd for rnd, _ in empty})
            longest = max(x.e2e_ms for _, x in empty) / 1e3
            failed.append(f"{t.name}: {len(empty)} in round(s) {', '.join(map(str, rounds))} (ended after up to "
                          f"{longest:.0f} s)")
    if not failed:
        return "Every request returned content."
    return ("Requests that ended without any content (counted in TTFT and wall with their whole duration; see the "
            "raw runs): " + "; ".join(failed) + ".")


def _plot(res: ResultFile, wl: Workload, targets: list[Target], reps: int) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(range(wl.rounds))
    width = 0.8 / len(targets)
    colors = {"mlx_lm.server": "C3", "vllm-mlx": "C1", "kvmem": "C2"}
    for k, t in enumerate(targets):
        pos = [x + (k - (len(targets) - 1) / 2) * width for x in xs]
        p50 = [median(x.ttft_ms for x in t.turns[r]) / 1e3 for r in xs]
        p95 = [percentile([x.ttft_ms for x in t.turns[r]], 95) / 1e3 for r in xs]
        bars = ax[0].bar(pos, p50, width, label=f"{t.name} p50", color=colors.get(t.name))
        ax[0].bar_label(bars, fmt="%.1f", fontsize=7)
        ax[0].scatter(pos, p95, marker="_", s=150, color="k", zorder=3, label="p95" if k == 0 else None)
        cum, total = [], 0.0
        for r in xs:
            total += t.walls[r] / reps
            cum.append(total)
        ax[1].plot([r + 1 for r in xs], cum, "o-", color=colors.get(t.name), label=t.name)
    ax[0].set_xticks(xs, [f"round {r + 1}" + ("\n(restart)" if r == wl.restart_after else "") for r in xs])
    ax[0].set_ylabel("TTFT s")
    ax[0].set_title(f"TTFT per round ({wl.agents} agents at once)")
    ax[0].legend(fontsize=8)
    ax[1].axvline(wl.restart_after + 0.5, color="gray", ls=":", label="restart")
    ax[1].set_xticks([r + 1 for r in xs])
    ax[1].set_xlabel("round")
    ax[1].set_ylabel("cumulative wall s (mean of repeats)")
    ax[1].set_title("wall time")
    ax[1].legend(fontsize=8)
    fig.suptitle("kvmem vs mlx_lm.server" + (" vs vllm-mlx" if len(targets) > 2 else "") + ", kvmem-default on CPU")
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main()
