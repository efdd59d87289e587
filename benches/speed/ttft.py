"""TTFT by cache state (cold / warm after a restart / hot) through the HTTP gateway.

The user's view: a real ``kvmem serve`` subprocess on 127.0.0.1, one streamed
``POST /v1/agents/{id}/messages`` per turn, TTFT = time to the first streamed
delta, E2E = time to the ``done`` event with 64 output tokens (greedy).

Per repeat and context size C (1K, 2K, 4K; 8K with ``--with-8k``), one agent:

1. **cold** — a fresh agent sends a C-token prompt (nothing cached).
2. **hot** — it sends turn 2 (turn 1's prompt + reply + a new question):
   the cache is in memory; only the new suffix is prefilled.
3. the server is stopped (SIGTERM: caches flushed) and started again over the
   same cache folder;
4. **warm** — turn 3: the cache comes from disk; only the new suffix is prefilled;
5. **hot** again — turn 4, a second hot sample.

Every turn's ``usage`` (tier, tokens reused / prefilled) is checked and shown:
warm and hot must prefill only the new suffix. Speedups are cold TTFT / TTFT.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.harness import ResultFile, log, median, table
from benches.prompts import context_text
from benches.server import KvmemServer, StreamedTurn, run_turn

# hot, warm and hot' prefill questions 1, 2 and 3: the same token count (13 with the template),
# so that their TTFTs compare like with like (attention cost grows with the suffix length).
QUESTIONS = ("Summarize the notes.", "Why did it matter?", "Where did they go next?", "What did the letter say?")


def _ask(q: str) -> str:
    return f"\n\nUser: {q}\nAssistant:"


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per turn (E2E)")
    p.add_argument("--with-8k", action="store_true", help="add 8K context (a cold 8K prefill takes minutes)")
    args = p.parse_args(argv)
    reps = harness.repeats(args)
    sizes = [1024] if args.quick else [1024, 2048, 4096] + ([8192] if args.with_8k else [])
    res = ResultFile("ttft", "TTFT by cache state through the HTTP gateway", args.quick, argv or [])
    folder = harness.model_dir()
    samples: dict[tuple[int, str], list[StreamedTurn]] = {}
    restarts: list[float] = []
    checks: list[str] = []

    def measure(url: str, state: str, c: int, r: int, prompt: str) -> StreamedTurn:
        """One streamed turn: recorded, logged, and (past the cold turn) checked to prefill only the suffix."""
        turn = run_turn(url, f"ttft-{c}-r{r}", prompt, max_tokens=args.tokens)
        samples.setdefault((c, state), []).append(turn)
        res.record(repeat=r, context=c, state=state, ttft_ms=turn.ttft_ms, e2e_ms=turn.e2e_ms,
                   server_ttft_ms=turn.usage.get("ttft_ms"), tier=turn.tier, reused=turn.reused,
                   prefilled=turn.prefilled, generated=turn.usage.get("tokens_generated"),
                   match=turn.usage.get("match"))
        log(f"C={c} {state}: ttft {turn.ttft_ms:.0f} ms e2e {turn.e2e_ms:.0f} ms "
            f"tier={turn.tier} reused={turn.reused} prefilled={turn.prefilled}")
        if state != "cold" and (turn.prefilled > 200 or turn.tier != state.rstrip("2")):
            checks.append(f"C={c} r{r} {state}: tier={turn.tier} prefilled={turn.prefilled}")
        return turn

    with tempfile.TemporaryDirectory(prefix="kvmem-bench-ttft-") as tmp:
        for r in range(reps):
            server = KvmemServer(Path(tmp) / f"rep{r}")
            server.start()
            log(f"repeat {r}: server up in {server.start_s:.1f} s at {server.url}")
            prompts: dict[int, str] = {}
            try:
                for c in sizes:
                    agent = f"ttft-{c}-r{r}"
                    prompt = context_text(folder, c - 12, label=agent, offset=r * 7919 + c) + _ask(QUESTIONS[0])
                    for state, q in (("cold", QUESTIONS[1]), ("hot", QUESTIONS[2])):
                        turn = measure(server.url, state, c, r, prompt)
                        prompt = prompt + turn.text + _ask(q)
                    prompts[c] = prompt
                server.wait_saved([f"ttft-{c}-r{r}" for c in sizes])
                restarts.append(server.restart())
                log(f"restarted in {restarts[-1]:.1f} s")
                for c in sizes:
                    prompt = prompts[c]
                    for state, q in (("warm", QUESTIONS[3]), ("hot2", QUESTIONS[0])):
                        turn = measure(server.url, state, c, r, prompt)
                        prompt = prompt + turn.text + _ask(q)
            finally:
                server.stop()

    rows, plot_rows = [], []
    states = ("cold", "warm", "hot", "hot2")
    for c in sizes:
        med = {s: median(t.ttft_ms for t in samples[(c, s)]) for s in states}
        e2e = {s: median(t.e2e_ms for t in samples[(c, s)]) for s in states}
        pre = {s: median(t.prefilled for t in samples[(c, s)]) for s in states}
        reu = {s: median(t.reused for t in samples[(c, s)]) for s in states}
        rows.append([
            f"{c // 1024}K ({int(pre['cold'])} tok)",
            f"{med['cold']:.0f}", f"{med['warm']:.0f}", f"{med['hot']:.0f}", f"{med['hot2']:.0f}",
            f"{med['cold'] / med['warm']:.1f}x", f"{med['cold'] / med['hot']:.1f}x", f"{med['cold'] / med['hot2']:.1f}x",
            f"{med['warm'] / med['hot']:.2f}",
            f"{e2e['cold'] / 1e3:.1f} / {e2e['warm'] / 1e3:.1f} / {e2e['hot'] / 1e3:.1f} / {e2e['hot2'] / 1e3:.1f}",
            " / ".join(f"{reu[s]:.0f}+{pre[s]:.0f}" for s in ("warm", "hot", "hot2")),
        ])
        plot_rows.append((c, med, e2e))
    gen = median(float(t.usage.get("tokens_generated", 0)) for ts in samples.values() for t in ts)
    res.setup += [
        (f"server: `kvmem serve --model kvmem-default --port 0` subprocess, Q4 KV, attention auto (at-rest on CPU); "
        f"client: httpx streaming, {args.tokens} greedy output tokens per turn; medians of {reps} repeats "
        f"(hot: 2 samples per repeat); median restart (SIGTERM + start, model load) {median(restarts):.1f} s"),
        f"median tokens generated per turn: {gen:.0f}",
    ]
    res.body += [
        *table(["context", "cold TTFT ms", "warm TTFT ms", "hot TTFT ms", "hot' TTFT ms", "warm speedup",
                "hot speedup", "hot' speedup", "warm / hot", "E2E s cold / warm / hot / hot'",
                "reused+prefilled warm / hot / hot'"], rows),
        "",
        ("cold = turn 1, nothing cached; hot = turn 2, cache in memory; warm = turn 3 after a server restart, "
        "cache loaded from disk; hot' = turn 4, in memory again. *reused+prefilled* is the server's `usage`: "
        "warm and hot prefill only the new suffix. hot, warm and hot' ask questions of the same token count, so "
        "warm / hot compares like with like."),
        "",
        "Usage check (warm tier `warm`, hot tier `hot`, ≤ 200 tokens prefilled): "
        + ("all turns passed." if not checks else "FAILED: " + "; ".join(checks)),
    ]
    _plot(res, plot_rows)
    print(res.write(plot=True).read_text())


def _plot(res: ResultFile, rows: list[tuple[int, dict[str, float], dict[str, float]]]) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    xs = [f"{c // 1024}K" for c, _, _ in rows]
    for i, (state, color) in enumerate((("cold", "C3"), ("warm", "C1"), ("hot", "C2"), ("hot2", "C0"))):
        pos = [j + (i - 1.5) * 0.2 for j in range(len(rows))]
        bars = ax[0].bar(pos, [m[state] for _, m, _ in rows], 0.2, label=state, color=color)
        ax[0].bar_label(bars, fmt="%.0f", fontsize=7)
        ax[1].plot(xs, [e[state] / 1e3 for _, _, e in rows], "o-", color=color, label=state)
    ax[0].set_xticks(range(len(rows)), xs)
    ax[0].set_yscale("log")
    ax[0].set_ylabel("TTFT ms (log)")
    ax[0].set_xlabel("context")
    ax[0].legend()
    ax[0].set_title("time to first token")
    ax[1].set_ylabel("E2E s (64 tokens)")
    ax[1].set_xlabel("context")
    ax[1].legend()
    ax[1].set_title("end to end")
    fig.suptitle("kvmem-default via kvmem serve (HTTP), CPU")
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main()
