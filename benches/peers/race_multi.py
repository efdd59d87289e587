"""The race's multi-agent sections: the restart workload, and decode / batched throughput at 1-8 agents.

**multi** — ``benches/peers/vs_mlx_lm.py``'s workload (every agent shares a
~500-token system prompt, adds a ~236-token message and a 64-token reply a
round, all agents of a round at once, the server restarted after round 2),
run by :func:`benches.peers.vs_mlx_lm.run_workload` on each contender in turn:

* 6 agents x 4 rounds: llama.cpp with 6 slots (agent ``i`` in slot ``i`` for
  the slot-file client), kvmem, mlx_lm.server;
* 16 agents x 4 rounds on 4 slots: llama.cpp with ``-np 4`` (its RAM prompt
  cache swaps agents in and out of the slots) against kvmem capped at 4
  concurrent sequences (``KVMEM_MAX_BATCH=4``).

**throughput** — N = 1, 2, 4, 8 agents, each holding a conversation that
starts with one shared prompt of ``context`` tokens, send their next turn at
once and decode ``tokens`` greedy tokens each: *decode tok/s* is one agent's
rate after its first token (median over the agents), *batched tok/s* all the
round's tokens over its wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import trio

from benches.harness import ResultFile, log, median, table
from benches.openai_client import StreamedCompletion
from benches.prompts import sized_text
from benches.peers.race_servers import KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM, Contender, Setup
from benches.peers.vs_mlx_lm import QUICK, Target, Workload, percentile, run_workload, send_round, send_warm_up

AGENTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class MultiSpec:
    """One multi-agent workload: its shape, llama.cpp's slots, who runs it."""

    key: str
    label: str
    workload: Workload
    slots: int
    contenders: tuple[str, ...]
    cap_kvmem: bool = False  # kvmem gets as many concurrent sequences as llama.cpp has slots

    @property
    def slot_ctx(self) -> int:
        """Context per llama.cpp slot: an agent's whole conversation, with room for the template."""
        wl = self.workload
        need = wl.system_tokens + wl.rounds * (wl.message_tokens + wl.output_tokens) + 512
        return 256 * math.ceil(need / 256)


def specs(quick: bool) -> list[MultiSpec]:
    """The 6-agent workload (the must-show one) and the 16-agents-on-4-slots variant; smaller with ``quick``."""
    six = QUICK if quick else Workload()
    many, slots = (Workload(agents=4, rounds=3, system_tokens=200, message_tokens=80, output_tokens=16,
                            restart_after=1), 2) if quick else (Workload(agents=16), 4)
    return [
        MultiSpec("six", f"{six.agents} agents x {six.rounds} rounds", six, six.agents,
                  (MLX_LM, LLAMA, LLAMA_SLOTS, KVMEM)),
        MultiSpec("many", f"{many.agents} agents x {many.rounds} rounds on {slots} slots", many, slots,
                  (LLAMA, KVMEM), cap_kvmem=True),
    ]


@dataclass
class MultiResult:
    """Every repeat's :class:`Target` per contender, and the slot-file client's save / restore seconds."""

    spec: MultiSpec
    runs: dict[str, list[Target]] = field(default_factory=dict)
    restore_s: dict[str, list[float]] = field(default_factory=dict)

    def turns(self, name: str, rnd: int) -> list[StreamedCompletion]:
        return [x for t in self.runs[name] for x in t.turns[rnd]]

    def summed_ttft_s(self, name: str) -> float:
        """Summed TTFT over all agents and rounds, mean over repeats (plus the slot restores, where there are)."""
        runs = self.runs[name]
        ttft = sum(x.ttft_ms for t in runs for turns in t.turns.values() for x in turns) / 1e3
        return (ttft + sum(self.restore_s.get(name, []))) / len(runs)

    def wall_s(self, name: str) -> float:
        return sum(w for t in self.runs[name] for w in t.walls.values()) / len(self.runs[name])


def run_multi(spec: MultiSpec, setup: Setup, reps: int, res: ResultFile,
              only: tuple[str, ...] | None = None) -> MultiResult:
    out = MultiResult(spec)
    contenders = [Contender(n) for n in spec.contenders if only is None or n in only]
    for r in range(reps):
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            cap = spec.slots if spec.cap_kvmem and c.engine == KVMEM else None
            running = c.launch(setup, f"multi-{spec.key}-r{r}", slots=spec.slots, slot_ctx=spec.slot_ctx,
                               max_batch=cap)
            target = running.target()
            log(f"multi {spec.label}, repeat {r}: {c.name}")
            run_workload(target, spec.workload, setup.folder, r, res, tags={"section": f"multi-{spec.key}"})
            out.runs.setdefault(c.name, []).append(target)
            if running.restores:
                out.restore_s.setdefault(c.name, []).append(running.restore_s)
                res.record(section=f"multi-{spec.key}", server=c.name, repeat=r, save_s=running.save_s,
                           restore_s=running.restore_s, slot_saves=running.saves, slot_restores=running.restores)
    return out


def report_multi(res: ResultFile, result: MultiResult, reps: int) -> None:
    spec, wl = result.spec, result.spec.workload
    names = list(result.runs)
    rows = []
    for rnd in range(wl.rounds):
        for name in names:
            turns = result.turns(name, rnd)
            ttfts = [x.ttft_ms for x in turns]
            cached = "n/a" if any(x.cached_tokens is None for x in turns) else \
                f"{sum(x.cached_tokens or 0 for x in turns) / reps:.0f}"
            rows.append([f"{rnd + 1}" + (" (after restart)" if rnd == wl.restart_after else ""), name,
                         f"{median(ttfts) / 1e3:.2f}", f"{percentile(ttfts, 95) / 1e3:.2f}",
                         f"{sum(t.walls[rnd] for t in result.runs[name]) / reps:.1f}",
                         f"{cached} / {sum(x.prompt_tokens for x in turns) / reps:.0f}"])
    totals = []
    for name in names:
        total = result.summed_ttft_s(name)
        vs = [f"{result.summed_ttft_s(other) / total:.2f}x" if other in result.runs else "—"
              for other in (LLAMA, MLX_LM)]
        restore = result.restore_s.get(name)
        totals.append([name, f"{total:.1f}", f"{sum(restore) / reps:.2f}" if restore else "—", *vs,
                       f"{result.wall_s(name):.1f}"])
    cap = f"; kvmem capped at {spec.slots} concurrent sequences (`KVMEM_MAX_BATCH`)" if spec.cap_kvmem else ""
    res.body += [
        f"## Multi-agent restart workload: {spec.label}", "",
        f"{wl.agents} agents, shared {wl.system_tokens}-token system prompt, +{wl.message_tokens}-token message and "
        f"{wl.output_tokens} greedy tokens a round, all agents of a round at once, every server restarted after round "
        f"{wl.restart_after}; llama.cpp `-np {spec.slots}`, {spec.slot_ctx} tokens per slot{cap}; {reps} repeat(s).",
        "",
        *table(["round", "server", "TTFT p50 s", "TTFT p95 s", "round wall s", "cached / prompt tok"], rows),
        "",
        *table(["server", "summed TTFT s (with slot restores)", "of which slot restores s", "llama.cpp / this",
                "mlx_lm.server / this", "wall s"], totals),
        "",
    ]


@dataclass(frozen=True)
class Burst:
    """N agents' simultaneous turns on one server."""

    contender: str
    agents: int
    wall_s: float
    turns: tuple[StreamedCompletion, ...]

    @property
    def batched_tps(self) -> float:
        return sum(t.completion_tokens for t in self.turns) / self.wall_s

    @property
    def decode_tps(self) -> float:
        """One agent's decode rate after its first token, median over the agents."""
        return median((t.completion_tokens - 1) / ((t.e2e_ms - t.ttft_ms) / 1e3) for t in self.turns
                      if t.completion_tokens > 1 and t.e2e_ms > t.ttft_ms)


def run_throughput(contender: Contender, setup: Setup, *, context: int, tokens: int, reps: int,
                   res: ResultFile) -> list[Burst]:
    """Rounds of N = 1, 2, 4, 8 simultaneous turns (cycled ``reps`` times) on one server."""
    n_max = max(AGENTS)
    running = contender.launch(setup, "throughput", slots=n_max, slot_ctx=context + 2048)
    target = running.target()
    bursts: list[Burst] = []
    running.start()
    try:
        trio.run(send_warm_up, target)
        shared = sized_text(running.count_tokens, context, label="race throughput, shared by every agent")
        histories = [[{"role": "system", "content": shared}, {"role": "user", "content": f"Agent {i}: summarize."}]
                     for i in range(n_max)]
        trio.run(send_round, target, histories[:1], 1)  # agent 0 prefills the shared prompt alone first
        setup_turns, _ = trio.run(send_round, target, histories, 1)
        for h, t in zip(histories, setup_turns, strict=True):
            h.append({"role": "assistant", "content": t.text})
        k = 0
        for r in range(reps):
            for n in AGENTS:
                k += 1
                for h in histories[:n]:
                    h.append({"role": "user", "content": f"Question {k}: tell me more."})
                turns, wall = trio.run(send_round, target, histories[:n], tokens)
                for h, t in zip(histories[:n], turns, strict=True):
                    h.append({"role": "assistant", "content": t.text})
                burst = Burst(contender.name, n, wall, tuple(turns))
                bursts.append(burst)
                res.record(section="throughput", contender=contender.name, repeat=r, agents=n, wall_s=wall,
                           completion_tokens=[t.completion_tokens for t in turns],
                           ttft_ms=[t.ttft_ms for t in turns], e2e_ms=[t.e2e_ms for t in turns])
                log(f"throughput {contender.name} N={n}: batched {burst.batched_tps:.1f} tok/s, decode "
                    f"{burst.decode_tps:.1f} tok/s per agent")
    finally:
        running.stop()
    return bursts


def report_throughput(res: ResultFile, bursts: list[Burst], *, context: int, tokens: int, reps: int) -> None:
    rows = []
    names = list(dict.fromkeys(b.contender for b in bursts))
    for n in AGENTS:
        for name in names:
            mine = [b for b in bursts if b.contender == name and b.agents == n]
            one = median(b.batched_tps for b in bursts if b.contender == name and b.agents == 1)
            batched = median(b.batched_tps for b in mine)
            rows.append([str(n), name, f"{median(b.decode_tps for b in mine):.1f}", f"{batched:.1f}",
                         f"{batched / one:.2f}x", f"{median(median(t.ttft_ms for t in b.turns) for b in mine):.0f}"])
    res.body += [
        "## Decode and batched throughput", "",
        f"Every agent holds a conversation that starts with one shared {context}-token prompt; N agents send their "
        f"next turn at once and decode up to {tokens} greedy tokens each (llama.cpp: `-np {max(AGENTS)}`); medians "
        f"of {reps} round(s) per N, rounds cycling N = {', '.join(map(str, AGENTS))}.",
        "",
        *table(["agents", "server", "decode tok/s per agent", "batched tok/s", "batched vs 1 agent",
                "TTFT ms (median)"], rows),
        "",
    ]
