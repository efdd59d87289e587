"""Decode runs: one agent's decode tokens/s through the actors, runs of steps against one step per job.

With ``decode_run_steps`` 1 every decode step is one job on the MLX thread and a round trip
through trio before the next; with runs (the GPU policy's default, 16) the batch steps back to back
while nothing else needs the GPU actor (each step's tokens still streamed at once). What the
round trip costs depends on how long a step takes, so three models:

* **micro** (1 layer, hidden 64: a step far shorter than the round trip; what a small model on a
  fast GPU looks like to the host), under the GPU policy and the CPU policy;
* **tiny-llama** (4 layers, hidden 256), under the GPU policy;
* **kvmem-default** (SmolLM2-135M, 30 layers: a CPU step of ~40 ms) under the CPU policy, as
  kvmem runs here by default.

Two runtimes side by side per row, one per setting, their turns alternating (each turn a new
agent: the same cold prompt, then ``--tokens`` greedy tokens), medians of ``--repeats``; plain
mlx-lm's ``generate_step`` on the same folder, in the same process, is the floor. Here (2-core CPU)::

    .venv/bin/python -m benches decode_runs
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.gpu.gpu import Geometry, build_model, mlx_lm_turn
from benches.harness import ResultFile, log, median, table

MICRO = Geometry("micro", "micro (1 layer)", 64, 128, 1, 1, 1, 64, vocab=4096, dtype="float32",
                 rope_theta=10000.0, llama3_rope=False)
ROWS = (("micro", "gpu"), ("micro", "cpu"), ("tiny-llama", "gpu"), ("kvmem-default", "cpu"))
PROMPT = "The harbour master kept a ledger of ships, and every evening he wrote down who came in. " * 4


def _folder(model: str) -> Path:
    if model == "micro":
        return build_model(MICRO, harness.BENCH_HOME / "models")
    return harness.model_dir(model)


async def _kvmem_rates(folder: Path, profile: str, tokens: int, repeats: int) -> dict[int, list[float]]:
    """Decode tokens/s per turn in two runtimes side by side (``decode_run_steps`` 1 and the GPU
    policy's), their turns alternating."""
    from actors import open_runtime
    from runtime.backend import GPU_DECODE_RUN_STEPS

    runs_of = GPU_DECODE_RUN_STEPS
    rates: dict[int, list[float]] = {1: [], runs_of: []}
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-runs-") as home:
        def opened(steps: int) -> Any:
            return open_runtime(model=str(folder), home=Path(home) / str(steps), fsync=False, handle_signals=False,
                                profile=profile, decode_run_steps=steps, prefetch_mb=0, prewarm_mb=0)

        async with opened(1) as one, opened(runs_of) as runs:
            by_steps = {1: one, runs_of: runs}
            for rt in by_steps.values():
                await rt.agent("warm-up").send_prompt(PROMPT, max_tokens=16)
            for r in range(repeats):
                for steps in (1, runs_of) if r % 2 == 0 else (runs_of, 1):
                    result = await by_steps[steps].agent(f"r{r}").send_prompt(PROMPT, max_tokens=tokens)
                    rates[steps].append(result.usage.decode_tps)
    return rates


def _mlx_lm_rates(folder: Path, tokens: int, repeats: int) -> list[float]:
    from mlx_lm import load

    model, tokenizer = load(str(folder))
    mlx_lm_turn(model, tokenizer, PROMPT, 16)  # warm-up
    return [mlx_lm_turn(model, tokenizer, PROMPT, tokens).decode_tps for _ in range(repeats)]


def main(argv: list[str] | None = None) -> None:
    import trio

    from runtime.backend import GPU_DECODE_RUN_STEPS as RUNS

    p = harness.parser(__doc__, repeats=6, quick_repeats=2)
    p.add_argument("--tokens", type=int, help="tokens per turn (default 400, 200 for kvmem-default; 64 with --quick)")
    p.add_argument("--rows", nargs="+", choices=[f"{m}:{pol}" for m, pol in ROWS], help="only these rows (model:policy)")
    args = p.parse_args(argv)
    repeats = harness.repeats(args, full=6, quick=2)
    res = ResultFile("decode_runs", "Decode runs: one agent's decode tokens/s, runs of steps against one step per job",
                     args.quick, argv or [], model=None,
                     setup=[f"runs of up to {RUNS} steps (`decode_run_steps`, the GPU policy's) against 1, under "
                            f"the policy each row names; two runtimes side by side, their turns alternating; {repeats} "
                            "turns each, medians; plain mlx-lm "
                            "`generate_step` on the same folder in the same process"])
    rows, points = [], []
    for model, profile in ROWS:
        if args.rows and f"{model}:{profile}" not in args.rows:
            continue
        tokens = args.tokens or (64 if args.quick else 200 if model == "kvmem-default" else 400)
        folder = _folder(model)
        t0 = time.perf_counter()
        floor = _mlx_lm_rates(folder, tokens, max(2, repeats // 2))
        rates = trio.run(_kvmem_rates, folder, profile, tokens, repeats)
        one, runs, mlx = median(rates[1]), median(rates[RUNS]), median(floor)
        log(f"{model} ({profile} policy): mlx-lm {mlx:.1f}, one step per job {one:.1f}, runs {runs:.1f} tok/s "
            f"({time.perf_counter() - t0:.0f} s)")
        rows.append([f"`{model}`", profile, str(tokens), f"{mlx:.1f}", f"{one:.1f} ({one / mlx:.2f}x)",
                     f"{runs:.1f} ({runs / mlx:.2f}x)", f"{runs / one:.2f}x"])
        points.append((f"{model}\n{profile} policy", mlx, one, runs))
        res.record(model=model, profile=profile, tokens=tokens, mlx_lm=floor, one_step=rates[1],
                   runs=rates[RUNS])
    res.body += ["## Decode tokens/s of one agent (medians)", "",
                 *table(["model", "policy", "tokens", "plain mlx-lm", "kvmem, one step per job",
                         f"kvmem, runs of {RUNS}", "runs / one step"], rows), ""]
    _plot(res, points)
    print(res.write(plot=True).read_text())


def _plot(res: ResultFile, points: list[tuple[str, float, float, float]]) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, (label, *values) in enumerate(points):
        for j, (value, name) in enumerate(zip(values, ("plain mlx-lm", "one step per job", "runs"), strict=True)):
            ax.bar(i + (j - 1) * width, value / values[0], width, label=name if i == 0 else None,
                   color=("#888888", "#d98c3a", "#3a7dd9")[j])
    ax.set_xticks(range(len(points)), [p[0] for p in points], fontsize=8)
    ax.set_ylabel("decode tokens/s, relative to plain mlx-lm")
    ax.axhline(1.0, color="#444444", linewidth=0.8)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    ax.set_title("One agent's decode through kvmem's actors")
    harness.save_figure(res, fig)
