"""Python's collector inside turns: full collections with the model load's objects frozen, and not.

A full (generation 2) collection walks every object the process holds, under the GIL, so the
model's thread builds no graph while it runs and a turn it lands in waits for it. kvmem freezes
what a model load leaves (:mod:`runtime.heap`: ``gc.collect()`` then ``gc.freeze()`` after each
load). This bench runs one runtime and alternates blocks of turns in the two states, in one
process: **frozen** (as the runtime leaves it after its load) and **thawed** (``gc.unfreeze()``
before the block: every object walked again, as before). Each turn is an agent's next short
question on its own hot cache, agents in turn; a ``gc`` callback times every collection. Per
state: collections by generation, the full ones' pauses, all collections' time per 100 turns,
and first-token times (median, 95th percentile, the worst), the turns a full collection landed in
apart. The blocks go thawed, frozen, frozen, thawed, ... (the conversations grow as they go). Here
(2-core CPU, about 15 minutes)::

    .venv/bin/python -m benches gc_pauses
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, table
from runtime import heap

STATES = ("thawed", "frozen")
QUESTIONS = ("What did we say about the harbour?", "And the ships?", "Who keeps the ledger?",
             "Say that again, shorter.", "Anything else?")


@dataclass
class Collections:
    """The collector's runs, timed by a ``gc`` callback while :attr:`on`."""

    on: bool = False
    runs: list[tuple[int, float, float]] = field(default_factory=list)  # (generation, start, end)
    _start: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.runs.append((info["generation"], self._start, now))


@dataclass
class StateRuns:
    """One state's turns (first-token ms, whether a full collection ran inside) and collections."""

    ttft_ms: list[float] = field(default_factory=list)
    full_inside: list[bool] = field(default_factory=list)
    runs: list[tuple[int, float]] = field(default_factory=list)  # (generation, ms)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _measure(model: str, agents: int, blocks: int, turns: int, max_tokens: int) -> dict[str, StateRuns]:
    from actors import open_runtime

    timer = Collections()
    gc.callbacks.append(timer)
    out = {s: StateRuns() for s in STATES}
    try:
        with tempfile.TemporaryDirectory(prefix="kvmem-bench-gc-") as home:
            async with open_runtime(model=model, home=home, fsync=False, handle_signals=False, prefetch_mb=0) as rt:
                texts = {}
                for a in range(agents):
                    name = f"agent-{a}"
                    text = f"You keep notes for agent {a}. The harbour master kept a ledger of ships. " * 8
                    texts[name] = text + (await rt.agent(name).send_prompt(text, max_tokens=max_tokens)).reply
                for block in range(2 * blocks):
                    state = STATES[(block % 2) ^ (block // 2 % 2)]  # thawed, frozen, frozen, thawed, ...: the
                    # conversations grow as the blocks go, so neither state always gets the longer ones
                    heap.thaw() if state == "thawed" else heap.settle()
                    log(f"block {block}: {state}, {heap.frozen_objects()} objects frozen, "
                        f"{len(gc.get_objects())} walked by a full collection")
                    for i in range(turns):
                        name = f"agent-{i % agents}"
                        ask = f"\nUser: {QUESTIONS[i % len(QUESTIONS)]}\nAssistant:"
                        timer.on, first = True, len(timer.runs)
                        result = await rt.agent(name).send_prompt(texts[name] + ask, max_tokens=max_tokens)
                        timer.on = False
                        texts[name] += ask + result.reply
                        mine = timer.runs[first:]
                        out[state].ttft_ms.append(result.usage.ttft_ms)
                        out[state].full_inside.append(any(g == 2 for g, _, _ in mine))
                        out[state].runs += [(g, (end - start) * 1e3) for g, start, end in mine]
    finally:
        gc.callbacks.remove(timer)
    return out


def _rows(out: dict[str, StateRuns]) -> list[list[str]]:
    rows = []
    for state in STATES:
        r = out[state]
        full = [ms for g, ms in r.runs if g == 2]
        landed = [t for t, f in zip(r.ttft_ms, r.full_inside, strict=True) if f]
        rows.append([
            state, str(len(r.ttft_ms)), " / ".join(str(sum(g == k for g, _ in r.runs)) for k in (0, 1, 2)),
            f"{statistics.median(full):.1f} / {max(full):.1f}" if full else "—",
            f"{sum(ms for _, ms in r.runs) * 100 / max(1, len(r.ttft_ms)):.1f}",
            f"{statistics.median(r.ttft_ms):.0f} / {_pct(r.ttft_ms, 0.95):.0f} / {max(r.ttft_ms):.0f}",
            f"{statistics.median(landed):.0f} ({len(landed)})" if landed else "—",
        ])
    return rows


def main(argv: list[str] | None = None) -> None:
    import trio

    p = harness.parser(__doc__, repeats=3, quick_repeats=1)
    p.add_argument("--model", default="kvmem-default", help="the runtime's model (default kvmem-default)")
    p.add_argument("--agents", type=int, default=4, help="agents taking turns (default 4)")
    p.add_argument("--turns", type=int, help="turns per block (default 120; 20 with --quick)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens a turn's reply may take (default 16)")
    args = p.parse_args(argv)
    blocks = harness.repeats(args, full=3, quick=1)
    turns = args.turns or (20 if args.quick else 120)
    res = ResultFile("gc_pauses", "Python's collector inside turns: the model load's objects frozen, and not",
                     args.quick, argv or [], model=args.model,
                     setup=[f"one runtime; {blocks} block(s) of {turns} turns per state, the states alternating "
                            f"(thawed, frozen, frozen, thawed, ...); {args.agents} agents in turn, each turn a short question on the "
                            f"agent's hot cache, replies of at most {args.max_tokens} tokens; fsync off; the "
                            "collector timed by a gc callback during turns only"])
    t0 = time.perf_counter()
    out = trio.run(_measure, args.model, args.agents, blocks, turns, args.max_tokens)
    log(f"measured in {time.perf_counter() - t0:.0f} s")
    res.body += ["## Collections and first tokens, per state", "",
                 *table(["state", "turns", "collections gen 0 / 1 / 2", "full ones: median / longest ms",
                         "all collections, ms per 100 turns", "first token ms: median / p95 / worst",
                         "turns a full one landed in: median first token ms (turns)"], _rows(out)), ""]
    for state in STATES:
        res.record(state=state, ttft_ms=out[state].ttft_ms, full_inside=out[state].full_inside,
                   collections=out[state].runs)
    print(res.write().read_text())
