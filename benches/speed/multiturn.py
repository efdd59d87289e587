"""Multi-turn: 3 turns on a ~2K-token context through the HTTP gateway, with and without restarts.

One agent per scenario talks to a ``kvmem serve`` subprocess (127.0.0.1):
turn 1 sends a ``--context``-token prompt (cold); turns 2 and 3 append the
previous reply and a new question, so they reuse the cache and prefill only the
new suffix. The **restart** scenario stops the server (SIGTERM, caches flushed)
and starts it again before turns 2 and 3 (warm: cache loaded from disk). Each
turn generates ``--tokens`` tokens greedily. TTFT = first streamed delta, E2E =
the done event; tier and reused / prefilled tokens from the server's ``usage``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, median, table
from benches.prompts import context_text
from benches.server import KvmemServer, StreamedTurn, run_turn

QUESTIONS = ("What happened next?", "Who was there at the end?")


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--context", type=int, help="turn-1 tokens (default 2048; 1024 with --quick)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per turn")
    args = p.parse_args(argv)
    reps = harness.repeats(args)
    context = args.context or (1024 if args.quick else 2048)
    res = ResultFile("multiturn", f"Multi-turn: 3 turns on a {context}-token context, with and without restarts",
                     args.quick, argv or [])
    folder = harness.model_dir()
    turns: dict[tuple[str, int], list[StreamedTurn]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-mt-") as tmp:
        for r in range(reps):
            for scenario in ("no restart", "restart") if r % 2 == 0 else ("restart", "no restart"):
                server = KvmemServer(Path(tmp) / f"{scenario.replace(' ', '')}{r}")
                server.start()
                agent = f"mt-{scenario.replace(' ', '')}-{r}"
                prompt = (context_text(folder, context - 12, label=agent, offset=r * 313)
                          + "\n\nUser: Summarize the notes.\nAssistant:")
                try:
                    for t in range(3):
                        if t > 0 and scenario == "restart":
                            server.wait_saved([agent])
                            server.restart()
                        turn = run_turn(server.url, agent, prompt, max_tokens=args.tokens)
                        turns.setdefault((scenario, t), []).append(turn)
                        res.record(repeat=r, scenario=scenario, turn=t + 1, ttft_ms=turn.ttft_ms, e2e_ms=turn.e2e_ms,
                                   tier=turn.tier, reused=turn.reused, prefilled=turn.prefilled,
                                   match=turn.usage.get("match"), generated=turn.usage.get("tokens_generated"))
                        log(f"r{r} {scenario} turn {t + 1}: ttft {turn.ttft_ms:.0f} e2e {turn.e2e_ms:.0f} ms "
                            f"tier={turn.tier} reused={turn.reused} prefilled={turn.prefilled}")
                        if t < 2:
                            prompt = prompt + turn.text + f"\n\nUser: {QUESTIONS[t]}\nAssistant:"
                finally:
                    server.stop()
    rows = []
    for scenario in ("no restart", "restart"):
        t1 = median(x.ttft_ms for x in turns[(scenario, 0)])
        e1 = median(x.e2e_ms for x in turns[(scenario, 0)])
        for t in range(3):
            xs = turns[(scenario, t)]
            ttft, e2e = median(x.ttft_ms for x in xs), median(x.e2e_ms for x in xs)
            rows.append([scenario, t + 1, xs[-1].tier, f"{median(x.reused for x in xs):.0f}",
                         f"{median(x.prefilled for x in xs):.0f}", f"{ttft:.0f}", f"{e2e:.0f}",
                         f"{t1 / ttft:.1f}x", f"{e1 / e2e:.2f}x"])
    res.setup.append(f"{reps} repeats, medians; {args.tokens} greedy tokens per turn; `kvmem serve` subprocess, "
                     "Q4 KV, attention auto")
    res.body += [
        *table(["scenario", "turn", "tier", "reused", "prefilled", "TTFT ms", "E2E ms", "TTFT speedup vs turn 1",
                "E2E speedup vs turn 1"], rows),
        "",
        "Seed (M4 Pro, Gemma 3 12B): 2.0-4.3x E2E speedup on multi-turn conversations.",
    ]
    print(res.write().read_text())


if __name__ == "__main__":
    main()
